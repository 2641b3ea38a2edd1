"""Checkpoint performance of fsdpkit against plain DCP and the classic torch.save recipe.

An orchestrator (this process, without RANK) first measures the machine's ceilings, then runs
the benchmark phases under torchrun (OMP_NUM_THREADS=1 per rank; bench/checkpoint_worker.py),
collects their JSON, and prints one markdown report against the targets; it writes
bench/results/checkpoint.json. Checkpoints go to a temporary directory on the repository's disk
(bench/checkpoint_run_*, or under --dir), deleted after every run and at the end.

Ceilings (this process, torch on one thread, as each rank runs):
- disk write: a new --ceiling-gib file written in 16 MiB os.write chunks, then fsync, 3 times
  (median; each time a new file, the previous one deleted first, as between checkpoint runs);
  also two half-size files written concurrently by two threads (the ranks write in parallel);
- cold-ish read: the file's pages evicted with posix_fadvise(POSIX_FADV_DONTNEED) (no root
  needed; on a VM the host may still cache the disk), then read in 16 MiB chunks; also O_DIRECT
  reads and a warm (page-cache) re-read for reference;
- memcpy: `dst.copy_(src)` between two existing 512 MiB tensors, and into a fresh allocation
  (`torch.empty` + `copy_`, page faults included), 5 times each (median); also two copies at once
  (two threads), as both ranks stage at the same moment (information; the target uses one copy).

Model: nn.Linear(w, w, bias=False) layers (w = --width, default 2304, divisible by 1, 2 and 3 so no
rank holds a padded shard), each `fully_shard`-ed, then the root; AdamW(foreach); one real
forward/backward/step so that exp_avg and exp_avg_sq exist. The layer count makes
params + exp_avg + exp_avg_sq (fp32) total each of --sizes-gib over 2 gloo ranks. The target
holds a Stateful "train" step counter (load verification compares it with the optimizer's steps).

Phases, per size (medians of --runs runs, methods rotated within each run so none is always first):
- B1 sync save: wall time from a barrier until the last rank returned (= committed) for
  fsdpkit `save_checkpoint` (meta built as Checkpointer._meta builds it), plain `dcp.save`
  (FileSystemWriter, sync_files=True) and rank-0 `torch.save` of the full state dict gathered by
  `get_state_dict(full_state_dict=True, cpu_offload=True)` + fsync. Durable GB/s = bytes of model
  and optimizer state over all ranks / that time.
- B2 async stall: for fsdpkit `AsyncSaver.save`, `dcp.async_save` (FileSystemWriter staging) and
  `dcp.async_save` with a reused `DefaultStager(StagingOptions(False, False, False, False))`, each on
  its own gloo group: the time until the call returned (max over ranks; state dict capture
  included), and the time until durable (fsdpkit: return + the SaveResult's background_s; DCP: a
  done-callback on the future). The first save of fsdpkit and of the DefaultStager allocates the
  staging buffer and is reported apart. While a save is in flight the loop runs fixed-cost steps
  (below); their median time over the median of steps with nothing in flight is the slowdown.
- B3 peak memory: for each sync and async method (async: from the call until durable, no training
  steps), the peak RSS per rank: the larger of a thread sampling /proc/self/statm every 2 ms and
  the kernel's VmHWM, reset before each save (clear_refs). Reported: the absolute peak, its
  increase over the RSS just before the save (after gc + malloc_trim), and the footprint
  peak - RSS of the same process before the model existed, relative to this rank's state bytes S;
  the targets compare that footprint (sync <= 1.1 S + 256 MiB, async <= 2.1 S). Max over ranks and
  over --b3-runs runs (for memory the worst case is the figure that matters).
- B4 load: a checkpoint saved by fsdpkit on 2 ranks, loaded on 2 ranks after evicting its pages
  (posix_fadvise): fsdpkit `load_checkpoint` with and without verify, and plain dcp.load +
  set_state_dict. B5 elastic load: the same checkpoint loaded on 1 and on 3 ranks (separate
  torchrun launches); time relative to the 2-rank load.
- B6 goodput: --b6-steps fixed-cost steps, a save every --b6-every steps, for no checkpoint,
  fsdpkit sync, fsdpkit AsyncSaver and dcp.async_save, state --b6-size-gib; --b6-rounds runs of
  each, in the order A B C D, then D C B A (a linear drift in machine load cancels in the means).
  Overhead = mean loop time / mean loop time without checkpoints - 1; the loop ends when the last
  step's save call returned, and the time from then until that save is durable (drain) is
  reported apart. A fixed-cost step is a burst of [512, 512] matmuls calibrated to --step-ms, an
  in-place add on every model and optimizer shard (so the async snapshot races with mutation)
  and a one-element all-reduce: a real forward/backward/AdamW step of this model takes seconds on
  2 CPU cores, too slow for 200 steps. B2 runs the same step while its saves are in flight.

Usage: python bench/checkpoint.py [--sizes-gib 1,2] [--runs 5] [--only B1,B2,...] [--quick] [--dir D]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import mmap
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).parent / "results" / "checkpoint.json"
PHASES = ("B1", "B2", "B3", "B4", "B5", "B6")
CHUNK = 16 * 2**20
MiB, GiB = 2**20, 2**30
QUICK = {"sizes_gib": "0.125", "runs": 2, "b3_runs": 1, "b6_size_gib": 0.0625, "b6_steps": 40, "b6_every": 10,
         "step_ms": 20.0, "ceiling_gib": 0.25, "memcpy_mib": 128, "b6_rounds": 1}
FULL = {"sizes_gib": "1,2", "runs": 5, "b3_runs": 1, "b6_size_gib": 0.5, "b6_steps": 200, "b6_every": 20,
        "step_ms": 100.0, "ceiling_gib": 1.0, "memcpy_mib": 512, "b6_rounds": 2}


# -- ceilings --------------------------------------------------------------------------------
def _write_file(path: Path, nbytes: int, block: bytes) -> tuple[float, float]:
    """(seconds for write + fsync, of which fsync)."""
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for _ in range(nbytes // len(block)):
            os.write(fd, block)
        t1 = time.perf_counter()
        os.fsync(fd)
    finally:
        os.close(fd)
    t2 = time.perf_counter()
    return t2 - t0, t2 - t1


def _read_file(path: Path, *, drop: bool, direct: bool = False) -> float:
    """Seconds to read `path` in CHUNK reads (after evicting it from the page cache if `drop`)."""
    flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
    fd = os.open(path, flags)
    buf = mmap.mmap(-1, CHUNK)  # page-aligned, as O_DIRECT needs
    try:
        if drop:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        t0 = time.perf_counter()
        while os.readv(fd, [buf]) > 0:
            pass
        return time.perf_counter() - t0
    finally:
        os.close(fd)
        buf.close()


def measure_ceilings(workdir: Path, *, gib: float, memcpy_mib: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    nbytes = int(gib * GiB) // CHUNK * CHUNK
    block = os.urandom(CHUNK)
    # A new file per repetition, the previous one deleted first: the pattern of the checkpoint runs
    # (new files, the last run's deleted). Rewriting one file in place (O_TRUNC) was ~4x slower here.
    paths = [workdir / f"ceiling_{i}.bin" for i in range(3)]
    writes = []
    for i, path in enumerate(paths):
        if i:
            paths[i - 1].unlink()
        writes.append(_write_file(path, nbytes, block))
    path = paths[-1]  # kept for the read tests
    cold = [_read_file(path, drop=True) for _ in range(3)]
    try:
        direct: list[float] | None = [_read_file(path, drop=True, direct=True) for _ in range(3)]
    except OSError:
        direct = None
    warm = [_read_file(path, drop=False) for _ in range(3)]
    path.unlink()
    pair = [workdir / "ceiling_a.bin", workdir / "ceiling_b.bin"]
    half = nbytes // 2 // CHUNK * CHUNK
    t0 = time.perf_counter()
    threads = [threading.Thread(target=_write_file, args=(p, half, block)) for p in pair]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    two = time.perf_counter() - t0
    for p in pair:
        p.unlink()
    n = memcpy_mib * MiB // 4
    src, dst = torch.ones(n), torch.empty(n)
    dst.copy_(src)  # touch the pages once
    copies, fresh = [], []
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        copies.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        torch.empty(n).copy_(src)
        fresh.append(time.perf_counter() - t0)
    pair_src, pair_dst = [torch.ones(n) for _ in range(2)], [torch.ones(n) for _ in range(2)]  # pages touched
    together = []
    for _ in range(5):  # two copies at once (copy_ drops the GIL): both ranks stage at the same moment
        threads = [threading.Thread(target=d.copy_, args=(s,)) for d, s in zip(pair_dst, pair_src, strict=True)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        together.append(time.perf_counter() - t0)
    del src, dst, pair_src, pair_dst
    gbps = lambda b, ts: b / statistics.median(ts) / 1e9  # noqa: E731
    return {
        "file_bytes": nbytes,
        "write_fsync_gbps": gbps(nbytes, [w for w, _ in writes]),
        "write_fsync_runs_gbps": [nbytes / w / 1e9 for w, _ in writes],
        "fsync_s": [f for _, f in writes],
        "write_fsync_2streams_gbps": half * 2 / two / 1e9,
        "read_cold_fadvise_gbps": gbps(nbytes, cold),
        "read_o_direct_gbps": gbps(nbytes, direct) if direct else None,
        "read_warm_gbps": gbps(nbytes, warm),
        "memcpy_bytes": n * 4,
        "memcpy_gbps": gbps(n * 4, copies),
        "memcpy_fresh_alloc_gbps": gbps(n * 4, fresh),
        "memcpy_2threads_each_gbps": gbps(n * 4, together),
    }


# -- orchestration ---------------------------------------------------------------------------
def code_version() -> dict[str, Any]:
    """The commit and a digest of fsdpkit's checkpoint code: each phase imports it when it starts,
    so an edit during the run would mix versions (the report says so)."""
    import fsdpkit.checkpoint

    root = Path(fsdpkit.checkpoint.__file__).parent
    digest = hashlib.sha256()
    for f in sorted(root.glob("*.py")):
        digest.update(f.name.encode() + f.read_bytes())
    head = subprocess.run(["git", "-C", str(root), "log", "-1", "--format=%h %s"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "."], capture_output=True, text=True)
    return {"head": head.stdout.strip()[:72], "uncommitted": bool(dirty.stdout.strip()), "digest": digest.hexdigest()[:12]}


def launch(args: argparse.Namespace, phase: str, nproc: int, size: float, workdir: Path) -> dict[str, Any] | str:
    """One torchrun phase; its rank 0's JSON, or why there is none."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", __file__,
           "--phase", phase, "--phase-size-gib", str(size), "--workdir", str(workdir),
           "--only", ",".join(args.only), "--runs", str(args.runs), "--b3-runs", str(args.b3_runs),
           "--width", str(args.width), "--step-ms", str(args.step_ms), "--b6-steps", str(args.b6_steps),
           "--b6-every", str(args.b6_every), "--b6-rounds", str(args.b6_rounds)]
    print(f"[checkpoint bench] phase {phase}, {nproc} ranks, {size:g} GiB", file=sys.stderr, flush=True)
    rc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}).returncode
    out = workdir / f"result_{phase}_{nproc}_{size:g}.json"
    if not out.is_file():
        return f"phase {phase} on {nproc} ranks ({size:g} GiB) failed with exit code {rc}"
    return json.loads(out.read_text())


def orchestrate(args: argparse.Namespace) -> int:
    t_start = time.monotonic()
    load_before = os.getloadavg()
    parent = Path(args.dir) if args.dir else Path(__file__).parent
    parent.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="checkpoint_run_", dir=parent))
    repo_dev = os.stat(Path(__file__).parent).st_dev
    results: dict[str, Any] = {"sizes": {}, "errors": [], "code_before": code_version()}
    try:
        print(f"[checkpoint bench] ceilings in {workdir}", file=sys.stderr, flush=True)
        results["ceilings"] = measure_ceilings(workdir, gib=args.ceiling_gib, memcpy_mib=args.memcpy_mib)
        for size in args.sizes:
            per: dict[str, Any] = {}
            if set(args.only) & {"B1", "B2", "B3", "B4", "B5"}:
                per["main"] = launch(args, "main", 2, size, workdir)
            if "B5" in args.only:
                per["load_1"] = launch(args, "load", 1, size, workdir)
                per["load_3"] = launch(args, "load", 3, size, workdir)
            shutil.rmtree(workdir / f"src_{size:g}", ignore_errors=True)
            results["errors"] += [v for v in per.values() if isinstance(v, str)]
            results["sizes"][f"{size:g}"] = {k: v for k, v in per.items() if not isinstance(v, str)}
        if "B6" in args.only:
            g = launch(args, "goodput", 2, args.b6_size_gib, workdir)
            if isinstance(g, str):
                results["errors"].append(g)
            else:
                results["goodput"] = g
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    results["machine"] = {
        "cpu_count": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
        "torch": torch.__version__, "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
        "checkpoint_dir_same_device_as_repo": os.stat(parent).st_dev == repo_dev, "checkpoint_parent": str(parent),
    }
    results["code_after"] = code_version()
    results["config"] = {k: v for k, v in vars(args).items() if not k.startswith("phase") and k != "workdir"}
    results["elapsed_s"] = time.monotonic() - t_start
    from checkpoint_report import render  # noqa: I001 - a sibling module of this script

    text, results["targets"] = render(results)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    print(text + f"\nwritten to {RESULTS}", flush=True)
    return 1 if results["errors"] else 0


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes-gib", help="total state sizes over 2 ranks (default 1,2)")
    p.add_argument("--runs", type=int, help="runs per method for medians (default 5)")
    p.add_argument("--b3-runs", type=int, help="runs per method for peak memory (default 1)")
    p.add_argument("--only", default=",".join(PHASES), help="phases to run, e.g. B1,B2 (default all)")
    p.add_argument("--quick", action="store_true", help="tiny sizes and few runs: a ~1-minute smoke run")
    p.add_argument("--dir", help="where the temporary checkpoint directory goes (default bench/)")
    p.add_argument("--width", type=int, default=2304, help="Linear layer width (default 2304)")
    p.add_argument("--step-ms", type=float, help="matmul burst of the fixed-cost step, ms (default 100)")
    p.add_argument("--b6-size-gib", type=float, help="state size for B6 (default 0.5)")
    p.add_argument("--b6-steps", type=int, help="B6 steps (default 200)")
    p.add_argument("--b6-every", type=int, help="B6: save every N steps (default 20)")
    p.add_argument("--b6-rounds", type=int, help="B6: runs of each mode, in alternating order (default 2)")
    p.add_argument("--ceiling-gib", type=float, help="file size for the disk ceilings (default 1)")
    p.add_argument("--memcpy-mib", type=int, help="tensor size for the memcpy ceiling (default 512)")
    p.add_argument("--phase", help=argparse.SUPPRESS)
    p.add_argument("--phase-size-gib", type=float, help=argparse.SUPPRESS)
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    args = p.parse_args()
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.sizes = [float(s) for s in str(args.sizes_gib).split(",")]
    args.only = [s.strip().upper() for s in args.only.split(",") if s.strip()]
    unknown = set(args.only) - set(PHASES)
    if unknown:
        p.error(f"--only: unknown phase(s) {sorted(unknown)}; choose from {','.join(PHASES)}")
    return args


def main() -> None:
    args = parse_args()
    if "RANK" in os.environ:
        from checkpoint_worker import run_phase  # noqa: I001 - a sibling module of this script

        run_phase(args)
        return
    sys.exit(orchestrate(args))


if __name__ == "__main__":
    main()
