"""What `make demo` runs, the way a user would:

1. train the reference Llama on 2 CPU ranks with FSDP2 (`fsdpkit train --nproc 2 experiment=demo`);
2. train it again, but kill the whole job (SIGKILL, as a preemption or crash would) once the
   step-100 checkpoint is committed, then run the same command again: it resumes automatically;
3. show that the resumed losses equal the uninterrupted ones, step for step.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from fsdpkit.train.metrics import read_records

DEMO = Path("runs/demo")
FULL, RESUMED = DEMO / "uninterrupted", DEMO / "resumed"
KILL_AFTER = "step_100"


def train_cmd(run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "fsdpkit", "train", "--nproc", "2", "experiment=demo", f"run_dir={run_dir}"]


def metrics(run_dir: Path) -> dict[int, dict]:
    """The last record of each step (a resumed run logs again the steps after its checkpoint)."""
    return {r["step"]: r for r in read_records(run_dir)}


def run_until_killed(run_dir: Path) -> None:
    job = subprocess.Popen(train_cmd(run_dir), start_new_session=True, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    latest = run_dir / "checkpoints" / "latest"
    while job.poll() is None:
        if latest.is_file() and latest.read_text().strip() == KILL_AFTER:
            # Every rank and the launcher, no warning. The ranks are not in the launcher's process
            # group (torch's launcher starts each in a new session), so kill the process tree.
            tree = [job.pid] + [c.pid for c in psutil.Process(job.pid).children(recursive=True)]
            for pid in tree:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            job.wait()
            print(f"demo: killed the job (SIGKILL) after {KILL_AFTER} was committed", flush=True)
            return
        time.sleep(0.05)
    raise SystemExit(f"demo: the job ended (exit {job.returncode}) before {KILL_AFTER} was committed")


def main() -> int:
    shutil.rmtree(DEMO, ignore_errors=True)
    print("$ fsdpkit train --nproc 2 experiment=demo run_dir=runs/demo/uninterrupted", flush=True)
    t0 = time.perf_counter()
    if subprocess.call(train_cmd(FULL)) != 0:
        return 1
    wall = time.perf_counter() - t0
    print(f"\n$ fsdpkit train --nproc 2 experiment=demo run_dir={RESUMED}   # killed part-way ...", flush=True)
    run_until_killed(RESUMED)
    print(f"$ fsdpkit train --nproc 2 experiment=demo run_dir={RESUMED}   # ... and run again", flush=True)
    if subprocess.call(train_cmd(RESUMED), stdout=subprocess.DEVNULL) != 0:
        return 1
    full, resumed = metrics(FULL), metrics(RESUMED)
    resumes = [e["step"] for e in read_records(RESUMED, events=True) if e["event"] == "resume"]
    if resumes != [int(KILL_AFTER.split("_")[1])]:
        raise SystemExit(f"demo: expected one resume from {KILL_AFTER}, metrics.jsonl shows resumes at {resumes}")
    resumed_from = resumes[0]
    after = [s for s in sorted(full) if s > resumed_from]
    identical = all(resumed[s]["loss"] == full[s]["loss"] and resumed[s]["grad_norm"] == full[s]["grad_norm"]
                    for s in after)
    losses = [full[s]["loss"] for s in sorted(full)]
    print(f"\ndemo: {len(full)} steps on 2 ranks in {wall:.1f} s; loss {losses[0]:.3f} -> {losses[-1]:.3f}, "
          f"val_loss {full[max(full)].get('val_loss', float('nan')):.3f}")
    print("demo: step   uninterrupted   resumed")
    for s in [1, 50, resumed_from, *after[:2], *after[-2:]]:
        print(f"demo: {s:4d}   {full[s]['loss']:.10f}   {resumed[s]['loss']:.10f}")
    print(f"demo: losses and grad norms of the {len(after)} steps after the resume are "
          + ("bit-identical to the uninterrupted run" if identical else "DIFFERENT from the uninterrupted run"))
    print(f"demo: run directories {FULL.resolve()} and {RESUMED.resolve()} "
          "(config.yaml, metrics.jsonl, summary.json, diagnostics.json, checkpoints/)")
    picture = DEMO / "loss.png"
    cmd = ["fsdpkit", "plot", str(FULL), str(RESUMED), "--labels", "uninterrupted,resumed", "-o", str(picture)]
    print(f"\n$ {' '.join(cmd)}", flush=True)
    if subprocess.call([sys.executable, "-m", *cmd]) != 0:
        return 1
    print(f"demo: the picture {picture.resolve()} shows the resumed curves on the uninterrupted ones")
    return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
