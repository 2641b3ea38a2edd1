"""Checkpoint performance of fsdpkit against plain DCP and the classic torch.save recipe.

An orchestrator (this process, without RANK) first measures the machine's ceilings, then runs
the benchmark phases under torchrun (OMP_NUM_THREADS=1 per rank; bench/checkpoint_worker.py),
collects their JSON, and prints one markdown report against the targets (bench/checkpoint_report.py,
bench/checkpoint_tables.py); it writes bench/results/checkpoint.json. Checkpoints go to a temporary
directory on the repository's disk (bench/checkpoint_run_*, or under --dir), deleted after every
run and at the end.

Ceilings (bench/checkpoint_ceilings.py; this process, torch on one thread, as each rank runs; every
one a median of --ceiling-reps):
- disk write: N new files (N = 1, 2 and every --scale-ranks count) of --ceiling-gib / N each,
  written at once by N threads in 256 KiB os.write calls, each fsynced (a new set of files per
  repetition, the previous set deleted first, as between checkpoint runs): the yardstick of N
  ranks saving at once is the N-stream figure, never the 1-stream one;
- cold-ish read: the same N files read at once after evicting their pages with
  posix_fadvise(POSIX_FADV_DONTNEED) (no root needed; on a VM the host may still cache the disk),
  a new descriptor every 16 MiB;
  also O_DIRECT reads and a warm (page-cache) re-read of one file for reference;
- memcpy: `dst.copy_(src)` between two existing 512 MiB tensors, and into a fresh allocation
  (`torch.empty` + `copy_`, page faults included); also two copies at once (two threads), as both
  ranks stage at the same moment; and both again with non-temporal stores (fsdpkit's
  `_rowhash.stream_copy`, which its staging copies use: on this VM faster than `copy_`, whose
  cached stores read every destination line first). The faster of the two ways is the ceiling.

Model: nn.Linear(w, w, bias=False) layers (w = --width, default 2304, divisible by 1, 2 and 3 so no
rank holds a padded shard), each `fully_shard`-ed, then the root; AdamW(foreach); one real
forward/backward/step so that exp_avg and exp_avg_sq exist. The layer count makes
params + exp_avg + exp_avg_sq (fp32) total each of --sizes-gib over 2 gloo ranks. The target
holds a Stateful "train" step counter (load verification compares it with the optimizer's steps).

Phases, per size (medians of --runs runs; the methods' order rotates from run to run and is reversed
in every other run, so that none is always first nor always right after the same one):
- B1 sync save: wall time from a barrier until the last rank returned (= committed) for
  fsdpkit `save_checkpoint` (meta built as Checkpointer._meta builds it), plain `dcp.save`
  (FileSystemWriter, sync_files=True) and rank-0 `torch.save` of the full state dict gathered by
  `get_state_dict(full_state_dict=True, cpu_offload=True)` + fsync, and, in the same rotation, the
  disk's ceiling at that moment: every rank writes its own state bytes to a new file and fsyncs
  it, in 256 KiB os.write calls (plain, and starting the write-back every 64 MiB) and with O_DIRECT
  as fsdpkit writes (the B1 "x disk" target uses the fastest; the ceilings measured before the
  benchmarks are reported beside it). Durable GB/s = bytes of model and optimizer state over all
  ranks / that time.
- B2 async stall: for fsdpkit `AsyncSaver.save` (blocking staging, and background staging, whose
  stall is the call plus the next optimizer step's wait for the copy), `dcp.async_save` (FileSystemWriter staging) and
  `dcp.async_save` with a reused `DefaultStager(StagingOptions(False, False, False, False))`, each on
  its own gloo group: the time until the call returned (max over ranks; state dict capture
  included), and the time until durable (fsdpkit: return + the SaveResult's background_s; DCP: a
  done-callback on the future). The first save of fsdpkit and of the DefaultStager allocates the
  staging buffer and is reported apart. While a save is in flight the loop runs fixed-cost steps
  (below); their median time over the median of steps with nothing in flight is the slowdown.
  The stall's yardstick is a plain memcpy of the per-rank state (every rank copying its shards
  into tensors touched beforehand, at once, one thread each; with torch's copy_ and with
  non-temporal stores, the faster median counting), timed in the same rotation as the saves: this
  VM's memory bandwidth drifts by up to half between minutes, so the memcpy ceiling measured before
  the benchmarks is only quoted beside it.
- B3 peak memory: for each sync and async method (async: from the call until durable, no training
  steps), the peak RSS per rank: the larger of a thread sampling /proc/self/statm every 2 ms and
  the kernel's VmHWM, reset before each save (clear_refs). Reported: the absolute peak, its
  increase over the RSS just before the save (after gc + malloc_trim), and the footprint
  peak - RSS of the same process before the model existed, relative to this rank's state bytes S;
  the targets compare that footprint (sync <= 1.1 S + 256 MiB, async <= 2.1 S), and what an async
  save adds over training alone (the RSS before a dcp.save: <= 1.1 S). Max over ranks and
  over --b3-runs runs (for memory the worst case is the figure that matters).
- B4 load: a checkpoint saved by fsdpkit on 2 ranks, loaded on 2 ranks after evicting its pages
  (posix_fadvise): fsdpkit `load_checkpoint` with and without verify, and plain dcp.load +
  set_state_dict, and in the same rotation a raw read of the same bytes on as many ranks (the
  disk at that moment). B5 elastic load: the same checkpoint loaded on 1 and on 3 ranks (separate
  torchrun launches); time relative to the 2-rank load, also each over its own raw read.
- B6 goodput (bench/checkpoint_goodput.py): --b6-steps fixed-cost steps, a save every --b6-every
  steps, for no checkpoint,
  fsdpkit sync, fsdpkit AsyncSaver (blocking and background staging) and dcp.async_save, state
  --b6-size-gib; --b6-rounds runs of each (medians), in the order A B C D E, then E D C B A, ...;
  each async method is made once per phase and warmed by one untimed save before the runs, as a
  training run makes its saver once (a staging buffer's one-time allocation is B2's first stall);
  a thread of rank 0 that sleeps 5 ms at a time measures how late it wakes (GIL or core wait); on
  2 ranks (no core free on a 2-core
  machine) and on 1 rank (a core free for the background work, as on GPU nodes). Overhead =
  median loop time / that without checkpoints - 1; the loop ends when the last step's save call
  returned, and the time from then until that save is durable (drain) is reported apart. The
  process CPU time of each run (all threads) minus that without checkpoints is the work the saves
  add; fsdpkit's per-phase wall and CPU times come from its manifests. A fixed-cost step is a
  burst of [512, 512] matmuls calibrated to --step-ms, `optimizer.step()` without gradients (it
  updates nothing but runs the step pre-hooks, where background staging waits), an in-place add on
  every model and optimizer shard (so the async snapshot races with mutation) and a one-element all-reduce: a
  real forward/backward/AdamW step of this model takes seconds on 2 CPU cores. B2 runs the same
  step while its saves are in flight.
- B7 whole resume and B8 scaling: see bench/checkpoint_resume.py.

Duration with the defaults: about 25-30 minutes on a 2-core VM (B6 ~9, B8 ~8, B7 ~3); a reduced run
(--sizes-gib 0.5, B8 up to 2 GiB, B6 0.25 GiB x 60 steps) took 16 minutes.

Usage: python bench/checkpoint.py [--sizes-gib 1] [--runs 5] [--only B1,B2,...] [--quick] [--dir D] [--report-only]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from checkpoint_ceilings import measure_ceilings
from checkpoint_common import FSDPKIT, RESUME_METHODS, T0_ENV
from checkpoint_measure import drop_page_cache
from checkpoint_report import render

RESULTS = Path(__file__).parent / "results" / "checkpoint.json"
PHASES = ("B1", "B2", "B3", "B4", "B5", "B6", "B7", "B8")
GiB = 2**30
QUICK = {"sizes_gib": "0.125", "runs": 2, "b3_runs": 1, "b6_size_gib": 0.0625, "b6_steps": 40, "b6_every": 10,
         "step_ms": 20.0, "ceiling_gib": 0.25, "memcpy_mib": 128, "b6_rounds": 1, "ceiling_reps": 2,
         "resume_launches": 1, "resume_runs": 1, "scale_sizes_gib": "0.0625,0.125", "scale_rank_size_gib": 0.125,
         "scale_ranks": "1,2",
         "scale_runs": 1}
FULL = {"sizes_gib": "1", "runs": 5, "b3_runs": 3, "b6_size_gib": 0.5, "b6_steps": 80, "b6_every": 20,
        "step_ms": 100.0, "ceiling_gib": 1.0, "memcpy_mib": 512, "b6_rounds": 5, "ceiling_reps": 5,
        "resume_launches": 5, "resume_runs": 4, "scale_sizes_gib": "0.01,0.25,0.5,1,2,4", "scale_rank_size_gib": 1.0,
        "scale_ranks": "1,2,4",
        "scale_runs": 6}


def code_version() -> dict[str, Any]:
    """The commit and a digest of fsdpkit's checkpoint code: each phase imports it when it starts,
    so an edit during the run would mix versions (the report says so)."""
    import fsdpkit.checkpoint

    root = Path(fsdpkit.checkpoint.__file__).parent
    digest = hashlib.sha256()
    for f in sorted(root.rglob("*.py")):
        digest.update(str(f.relative_to(root)).encode() + f.read_bytes())
    head = subprocess.run(["git", "-C", str(root), "log", "-1", "--format=%h %s"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "."], capture_output=True, text=True)
    return {"head": head.stdout.strip()[:72], "uncommitted": bool(dirty.stdout.strip()),
            "digest": digest.hexdigest()[:12]}


def launch(args: argparse.Namespace, phase: str, nproc: int, size: float, workdir: Path, *, tag: str = "",
           extra: tuple[str, ...] = ()) -> dict[str, Any] | str:
    """One torchrun phase; its rank 0's JSON, or why there is none."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", __file__,
           "--phase", phase, "--phase-size-gib", str(size), "--workdir", str(workdir), "--tag", tag,
           "--only", ",".join(args.only), "--runs", str(args.runs), "--b3-runs", str(args.b3_runs),
           "--width", str(args.width), "--step-ms", str(args.step_ms), "--b6-steps", str(args.b6_steps),
           "--b6-every", str(args.b6_every), "--b6-rounds", str(args.b6_rounds), "--scale-runs", str(args.scale_runs),
           *extra]
    print(f"[checkpoint bench] phase {phase}{tag}, {nproc} ranks, {size:g} GiB", file=sys.stderr, flush=True)
    # the whole-resume phase times from here: torchrun's and the interpreters' start-up included
    env = {**os.environ, "OMP_NUM_THREADS": "1", T0_ENV: repr(time.time())}
    rc = subprocess.run(cmd, env=env).returncode
    out = workdir / f"result_{phase}_{nproc}_{size:g}{tag}.json"
    if not out.is_file():
        return f"phase {phase}{tag} on {nproc} ranks ({size:g} GiB) failed with exit code {rc}"
    return json.loads(out.read_text())


def whole_resumes(args: argparse.Namespace, nproc: int, size: float, workdir: Path, root: Path, *,
                  launches: int, runs: int, methods: tuple[str, ...]) -> list[dict[str, Any] | str]:
    """`launches` fresh resumed runs per method of `methods`, alternating (cold pages each time)."""
    out = []
    for i in range(launches):
        for k, method in enumerate(methods[i % len(methods):] + methods[: i % len(methods)]):
            drop_page_cache(root)
            out.append(launch(args, "resume", nproc, size, workdir, tag=f"_{i}_{k}",
                              extra=("--resume-root", str(root), "--resume-first", method, "--runs", str(runs))))
    return out


def _available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def scaling(args: argparse.Namespace, workdir: Path, results: dict[str, Any]) -> None:
    """B8: save and whole resume per (state size, ranks); sizes that would not fit in RAM skipped."""
    rows: dict[str, Any] = {}
    configs = [(s, 2) for s in args.scale_sizes] + [(args.scale_rank_size, n) for n in args.scale_ranks if n != 2]
    for size, nproc in configs:
        key = f"{size:g} GiB x {nproc} ranks"
        need = 3 * size * GiB  # state + a loaded copy in flight + headroom; the page cache may be evicted
        if need > _available_bytes():
            rows[key] = {"skipped": f"needs ~{need / GiB:.1f} GiB of RAM, {_available_bytes() / GiB:.1f} available"}
            continue
        keep = workdir / f"scale_src_{nproc}_{size:g}"
        saved = launch(args, "scale", nproc, size, workdir, extra=("--resume-root", str(keep)))
        resumed = (whole_resumes(args, nproc, size, workdir, keep, launches=1, runs=args.scale_runs,
                                 methods=(FSDPKIT,)) if not isinstance(saved, str) else ["not saved"])
        shutil.rmtree(keep, ignore_errors=True)
        errors = [x for x in (saved, *resumed) if isinstance(x, str)]
        results["errors"] += errors
        rows[key] = {"size_gib": size, "ranks": nproc, "errors": errors,
                     "save": None if isinstance(saved, str) else saved,
                     "resume": None if isinstance(resumed[0], str) else resumed[0]}
    results["scaling"] = {"rows": rows, "runs": args.scale_runs, "methods": RESUME_METHODS}


def orchestrate(args: argparse.Namespace) -> int:
    t_start = time.monotonic()
    load_before = os.getloadavg()
    parent = Path(args.dir) if args.dir else Path(__file__).parent
    parent.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="checkpoint_run_", dir=parent))
    repo_dev = os.stat(Path(__file__).parent).st_dev
    results: dict[str, Any] = {"sizes": {}, "errors": [], "code_before": code_version(),
                               "started_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    try:
        print(f"[checkpoint bench] ceilings in {workdir}", file=sys.stderr, flush=True)
        streams = sorted({1, 2, *args.scale_ranks})
        results["ceilings"] = measure_ceilings(workdir, gib=args.ceiling_gib, memcpy_mib=args.memcpy_mib,
                                               streams=streams, reps=args.ceiling_reps)
        for size in args.sizes:
            per: dict[str, Any] = {}
            if set(args.only) & {"B1", "B2", "B3", "B4", "B5", "B7"}:
                per["main"] = launch(args, "main", 2, size, workdir)
            if "B5" in args.only:
                per["load_1"] = launch(args, "load", 1, size, workdir)
                per["load_3"] = launch(args, "load", 3, size, workdir)
            if "B7" in args.only and size == args.sizes[0]:  # fresh launches are slow: the first size only
                per["whole_resume"] = whole_resumes(args, 2, size, workdir, workdir / f"src_{size:g}",
                                                    launches=args.resume_launches, runs=args.resume_runs,
                                                    methods=RESUME_METHODS)
                results["errors"] += [v for v in per["whole_resume"] if isinstance(v, str)]
                per["whole_resume"] = [v for v in per["whole_resume"] if not isinstance(v, str)]
            shutil.rmtree(workdir / f"src_{size:g}", ignore_errors=True)
            results["errors"] += [v for v in per.values() if isinstance(v, str)]
            results["sizes"][f"{size:g}"] = {k: v for k, v in per.items() if not isinstance(v, str)}
        if "B8" in args.only:
            scaling(args, workdir, results)
        if "B6" in args.only:
            for key, nproc in (("goodput", 2), ("goodput_free_core", 1)):
                g = launch(args, "goodput", nproc, args.b6_size_gib, workdir)
                if isinstance(g, str):
                    results["errors"].append(g)
                else:
                    results[key] = g
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    results["machine"] = machine(parent, repo_dev, load_before)
    results["code_after"] = code_version()
    results["config"] = {k: v for k, v in vars(args).items() if not k.startswith("phase") and k != "workdir"}
    results["elapsed_s"] = time.monotonic() - t_start
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")  # first: a report that fails loses no figures
    print(report(), flush=True)
    return 1 if results["errors"] else 0


def report() -> str:
    """Render RESULTS (and store the verdicts in it): the markdown report."""
    results = json.loads(RESULTS.read_text())
    text, results["targets"] = render(results)
    results["markdown"] = text
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    return text + f"\nwritten to {RESULTS}"


def machine(parent: Path, repo_dev: int, load_before: tuple[float, float, float]) -> dict[str, Any]:
    """What the figures were measured on."""
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    mem = next(int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines()
               if line.startswith("MemTotal:"))
    fs = subprocess.run(["df", "-T", str(parent)], capture_output=True, text=True).stdout.splitlines()[-1:]
    return {"cpu_count": os.cpu_count(), "cpu_model": cpu, "mem_total_bytes": mem, "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__, "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(), "checkpoint_dir_same_device_as_repo": os.stat(parent).st_dev == repo_dev,
            "checkpoint_parent": str(parent), "checkpoint_filesystem": fs[0] if fs else "unknown"}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes-gib", help="total state sizes over 2 ranks for B1-B5, B7 (default 1; B8 covers 0.01-4)")
    p.add_argument("--runs", type=int, help="runs per method for medians (default 5)")
    p.add_argument("--b3-runs", type=int, help="runs per method for peak memory (default 3)")
    p.add_argument("--only", default=",".join(PHASES), help="phases to run, e.g. B1,B2 (default all)")
    p.add_argument("--quick", action="store_true", help="tiny sizes and few runs: a ~1-minute smoke run")
    p.add_argument("--dir", help="where the temporary checkpoint directory goes (default bench/)")
    p.add_argument("--width", type=int, default=2304, help="Linear layer width (default 2304)")
    p.add_argument("--step-ms", type=float, help="matmul burst of the fixed-cost step, ms (default 100)")
    p.add_argument("--b6-size-gib", type=float, help="state size for B6 (default 0.5)")
    p.add_argument("--b6-steps", type=int, help="B6 steps (default 80)")
    p.add_argument("--b6-every", type=int, help="B6: save every N steps (default 20)")
    p.add_argument("--b6-rounds", type=int, help="B6: runs of each mode, in alternating order (default 5)")
    p.add_argument("--ceiling-gib", type=float, help="file size for the disk ceilings (default 1)")
    p.add_argument("--memcpy-mib", type=int, help="tensor size for the memcpy ceiling (default 512)")
    p.add_argument("--ceiling-reps", type=int, help="repetitions of every ceiling, medians (default 5)")
    p.add_argument("--resume-launches", type=int, help="B7: fresh resumed runs per method (default 5)")
    p.add_argument("--resume-runs", type=int, help="B7: checkpoint parts repeated per method in each launch, after "
                                                   "its first step, rounded up to a multiple of 2 (default 4)")
    p.add_argument("--scale-sizes-gib", help="B8: state sizes over 2 ranks (default 0.01,0.25,0.5,1,2,4: the smallest "
                                             "pins the constant of the fit)")
    p.add_argument("--scale-rank-size-gib", type=float, help="B8: state size for the rank counts (default 1)")
    p.add_argument("--scale-ranks", help="B8: rank counts at that size (default 1,2,4)")
    p.add_argument("--scale-runs", type=int, help="B8: runs per size and method (default 6: even, so that "
                   "each method saves first in as many pairs as second; this disk slows every other large write)")
    p.add_argument("--report-only", action="store_true", help=f"re-render the report of {RESULTS.name} and exit")
    p.add_argument("--phase", help=argparse.SUPPRESS)
    p.add_argument("--tag", default="", help=argparse.SUPPRESS)
    p.add_argument("--resume-root", help=argparse.SUPPRESS)
    p.add_argument("--resume-first", help=argparse.SUPPRESS)
    p.add_argument("--phase-size-gib", type=float, help=argparse.SUPPRESS)
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    args = p.parse_args()
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.sizes = [float(s) for s in str(args.sizes_gib).split(",")]
    args.scale_sizes = [float(s) for s in str(args.scale_sizes_gib).split(",")]
    args.scale_rank_size = float(args.scale_rank_size_gib)
    args.scale_ranks = [int(s) for s in str(args.scale_ranks).split(",")]
    args.only = [s.strip().upper() for s in args.only.split(",") if s.strip()]
    unknown = set(args.only) - set(PHASES)
    if unknown:
        p.error(f"--only: unknown phase(s) {sorted(unknown)}; choose from {','.join(PHASES)}")
    return args


def main() -> None:
    args = parse_args()
    if args.report_only:
        print(report())
        return
    if "RANK" in os.environ:
        # imported here: the orchestrator, which measures the ceilings, never loads the ranks' stack
        from checkpoint_worker import run_phase

        run_phase(args)
        return
    sys.exit(orchestrate(args))


if __name__ == "__main__":
    main()
