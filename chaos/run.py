"""`make chaos`: seeded fault injection through `fsdpkit train` on CPU/gloo with the demo model.

Every case runs real jobs (launcher + 2 gloo ranks), hurts them (SIGKILL of the whole job, one rank
killed or stopped, preemption signals, a full disk, corrupted shards, elastic restarts), then runs
the same command again and checks that it resumes from a committed checkpoint and ends
bit-identical to an uninterrupted run. Issue 10's corruption fuzz (one mutation of every kind in
tests/fuzz/corruption.py per trial) and a directory-reuse misuse run end to end the same way. Prints
one table; exits 1 on any failure. A trial whose fault did not land where its case names it (a
kill that arrived after the save committed, a disk that filled elsewhere) is "not exercised":
reported apart, never counted as a pass, and a case with no exercised trial fails the run. A trial's
faults depend only on --seed, the case and the trial index: `--only CASE --trial N` re-runs one.
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import sys
import tempfile
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "fuzz"))  # the corruption fuzz's mutations
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # tests/faults: the faults injected into saves
from cases import Context, cases  # noqa: E402
from harness import Outcome, Reference  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="chaos", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, default=20261122)
    p.add_argument("--scale", type=float, default=1.0,
                   help="multiply the trial counts of the repeated cases (1.0: full, 25+25 kill trials, 20 "
                        "restarts; 0.1: a quick run); every case runs at least once")
    p.add_argument("--only", action="append", default=[], metavar="CASE", help="run only these cases (repeatable)")
    p.add_argument("--trial", type=int, default=None, help="with --only: run just this trial index")
    p.add_argument("--work-dir", default=None, help="where the runs go (default: a new temporary directory, "
                                                    "removed after a passing run)")
    p.add_argument("--jobs", type=int, default=1, help="trials run at once (each is its own 2-rank job; default 1). "
                                                      "Exit-time figures are measured under whatever load this makes")
    p.add_argument("--list", action="store_true", help="list the cases and their trial counts")
    args = p.parse_args(argv)
    selected = [c for c in cases(args.scale) if not args.only or c[0] in args.only]
    if args.list or not selected:
        for name, n, _ in cases(args.scale):
            print(f"{name}  ({n} trial(s))")
        return 0 if args.list else 2
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="fsdpkit-chaos-"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    print(f"chaos: seed {args.seed}, scale {args.scale}, work dir {work}", flush=True)
    ctx = Context(work=work, reference=Reference.build(work / "reference"), seed=args.seed)
    trials = [(name, trial, case) for name, n, case in selected
              for trial in (range(n) if args.trial is None else [args.trial])]
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        results = list(pool.map(lambda t: run_trial(*t, ctx=ctx), trials))
    print(table(results, seed=args.seed, wall_s=time.monotonic() - t0))
    failed = [r for r in results if not r.ok]
    idle_cases = never_exercised(results)
    for case in idle_cases:
        print(f"chaos: FAIL {case}: no trial's fault landed where the case names it; it proved nothing")
    if not failed and not idle_cases and args.work_dir is None:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed or idle_cases else 0


def never_exercised(results: list[Outcome]) -> list[str]:
    """The cases none of whose trials landed its fault (every trial "not exercised")."""
    cases: dict[str, bool] = {}
    for r in results:
        name = r.case.split(":")[0]
        cases[name] = cases.get(name, False) or r.exercised or not r.ok
    return [name for name, exercised in cases.items() if not exercised]


def run_trial(name: str, trial: int, case, *, ctx: Context) -> Outcome:
    """One trial; its faults depend only on the seed, the case's name and the trial index."""
    rng = random.Random(zlib.crc32(f"{ctx.seed}/{name}/{trial}".encode()))
    t = time.monotonic()
    try:
        out = case(trial, rng, ctx)
    except Exception as e:  # noqa: BLE001 - a harness error is a failed trial, with its cause
        out = Outcome(case=name, trial=trial, seed=ctx.seed, ok=False, detail=f"harness: {type(e).__name__}: {e}")
    out.case = f"{name}: {out.case}"
    verdict = "FAIL" if not out.ok else "PASS" if out.exercised else "NOT EXERCISED"
    print(f"chaos: {verdict} {name} #{trial} ({time.monotonic() - t:.0f} s) {out.detail}", flush=True)
    return out


def table(results: list[Outcome], *, seed: int, wall_s: float) -> str:
    """One markdown table: per case trials, passes, trials whose fault did not land where the case
    names it (not exercised: not passes), failures, kills (inside a save), restarts, exit times; then
    every failure with its seed and exact case."""
    groups: dict[str, list[Outcome]] = {}
    for r in results:
        groups.setdefault(r.case.split(":")[0], []).append(r)
    rows = ["| case | trials | pass | not exercised | fail | faults | inside a save | restarts "
            "| time to exit (s) median / max |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for name, rs in groups.items():
        exits = [x for r in rs for x in r.exit_s]
        times = f"{statistics.median(exits):.1f} / {max(exits):.1f}" if exits else "-"
        passed, idle = sum(r.ok and r.exercised for r in rs), sum(r.ok and not r.exercised for r in rs)
        rows.append(f"| {name} | {len(rs)} | {passed} | {idle} | {sum(not r.ok for r in rs)} | "
                    f"{sum(r.kills for r in rs)} | {sum(r.kills_in_save for r in rs)} | {sum(r.restarts for r in rs)} "
                    f"| {times} |")
    idle = [r for r in results if r.ok and not r.exercised]
    total = (f"{len(results)} trials, {sum(r.ok and r.exercised for r in results)} passed, {len(idle)} not "
             f"exercised, seed {seed}, {wall_s / 60:.1f} min")
    failures = [f"- FAIL seed {r.seed} `--only {r.case.split(':')[0]} --trial {r.trial}` ({r.case}): {r.detail}"
                for r in results if not r.ok]
    notes = [f"- not exercised: {r.case} #{r.trial}: {r.detail}" for r in idle]
    notes += [f"- note: {r.case} #{r.trial}: {r.detail}" for r in results if r.ok and r.exercised and r.detail]
    return "\n".join(["", *rows, "", total, *failures, *notes])


if __name__ == "__main__":
    raise SystemExit(main())
