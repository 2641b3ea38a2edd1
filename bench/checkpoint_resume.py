"""The whole-resume and scaling phases of bench/checkpoint.py (run under torchrun by it).

Whole resume (phase "resume"): a fresh torchrun launch that resumes from a checkpoint as a user's
run does, timed from the orchestrator's launch of torchrun (BENCH_T0, wall clock, the
same host) until the first training step after the resume returned on every rank:

- fsdpkit: `resolve_checkpoint("auto")` (the newest committed checkpoint) +
  `load_checkpoint(verify=True, verify_files=True)` (fingerprint check, the load reading each file
  once and checking `.metadata` and every item as it reads them, post-load per-tensor checksums),
  i.e. what `find_checkpoint` + `Checkpointer.resume` do with the default settings
  (`checkpoint.verify_checksums`, `checkpoint.verify_on_load`), minus the directory lock;
- fsdpkit before issue 56: the same, but a pass that checks every file's checksum first
  (`resume.verify_files`), then the load through DCP's reader (`verify_files=False`), then the
  per-tensor checksums: what those settings did until the load checked its own reads;
- plain DCP: `dcp.load` of the same directory (its path known) + `set_state_dict`.

The first step is one real forward/backward/AdamW step. The checkpoint part (resolution to loaded
and verified) is timed apart; after the first step the same process repeats the checkpoint part of
every method `--runs` times each (rounded up to a multiple of 3; pages evicted before each; each
method following each about equally often, see `checkpoint_common.balanced_order`) for medians,
peak RSS and the bytes each read (/proc/self/io `rchar`, every rank's: what the process asked the
kernel for, page cache or not).

Scaling (phase "scale"): per (size, ranks), fsdpkit `save_checkpoint` and plain `dcp.save`
alternating, `--scale-runs` times each, wall time and peak RSS; the last fsdpkit save stays for
the resume launch that follows.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch.distributed as tdist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import set_state_dict

from checkpoint_common import (
    DCP_SYNC,
    FSDPKIT,
    OUR_SYNC,
    PASS_FIRST,
    PLAIN,
    RESUME_METHODS,
    T0_ENV,
    balanced_order,
)
from checkpoint_measure import (
    PeakRSS,
    drop_page_cache,
    gather,
    log,
    max_over_ranks,
    med,
    remove,
    timed,
    trim,
)
from checkpoint_methods import dcp_state, save_dcp, save_fsdpkit
from checkpoint_model import Bench, real_step
from fsdpkit.checkpoint.manifest import read_manifest
from fsdpkit.checkpoint.resolve import resolve_checkpoint
from fsdpkit.checkpoint.resume import load_checkpoint, verify_files


def _newest(b: Bench, root: Path) -> Path:
    path = resolve_checkpoint("auto", ckpt_root=root, group=b.sync_group, verify_checksums=False)
    if path is None:
        raise RuntimeError(f"no committed checkpoint under {root}")
    return path


def resume_fsdpkit(b: Bench, root: Path) -> dict[str, Any]:
    """What `find_checkpoint` + `Checkpointer.resume` do with the default settings: resolution,
    then `load_checkpoint(verify=True, verify_files=True)` (each file read once, checked as read)."""
    t0 = time.perf_counter()
    path = _newest(b, root)
    t1 = time.perf_counter()
    report = load_checkpoint(b.target, path, fingerprint=b.fingerprint, group=b.sync_group, verify=True,
                             verify_files=True)
    return {"resolve_s": t1 - t0, "load_s": report.load_s, "verify_s": report.verify_s}


def resume_fsdpkit_pass(b: Bench, root: Path) -> dict[str, Any]:
    """The default settings before issue 56: resolution, a pass over every file's checksum (split
    over ranks), then the load through DCP's reader and the per-tensor checks."""
    t0 = time.perf_counter()
    path = _newest(b, root)
    t1 = time.perf_counter()
    if problems := verify_files(path, read_manifest(path), group=b.sync_group):
        raise RuntimeError(f"{path} failed verification: {problems}")
    t2 = time.perf_counter()
    report = load_checkpoint(b.target, path, fingerprint=b.fingerprint, group=b.sync_group, verify=True,
                             verify_files=False)
    return {"resolve_s": t1 - t0, "pass_s": t2 - t1, "load_s": report.load_s, "verify_s": report.verify_s}


def resume_plain(b: Bench, root: Path) -> dict[str, Any]:
    """Plain DCP: the user knows the directory (the newest step_<N>)."""
    path = max((p for p in root.iterdir() if p.name.startswith("step_") and p.is_dir()),
               key=lambda p: int(p.name.split("_")[1]))
    state = dcp_state(b)
    dcp.load(state, storage_reader=FileSystemReader(path), process_group=b.sync_group)
    set_state_dict(b.model, b.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    b.counter.step = int(path.name.split("_")[1])  # plain DCP keeps no trainer state: the user tracks it
    return {}


RESUMES = {FSDPKIT: resume_fsdpkit, PASS_FIRST: resume_fsdpkit_pass, PLAIN: resume_plain}


def _cold(b: Bench, root: Path) -> None:
    tdist.barrier(group=b.sync_group)
    if b.rank == 0:
        drop_page_cache(root)
    tdist.barrier(group=b.sync_group)


def bench_resume(b: Bench, root: Path, *, first: str, runs: int, launch_t0: float) -> dict[str, Any]:
    """The first resume of this process (`first`), its first step, then `runs` more of each method."""
    t_start = time.time()
    out: dict[str, Any] = {"first_method": first}
    tdist.barrier(group=b.sync_group)
    t0 = time.perf_counter()
    parts = RESUMES[first](b, root)
    t1 = time.perf_counter()
    real_step(b)
    t2 = time.perf_counter()
    ready = max_over_ranks(t_start - launch_t0, b.sync_group)  # process start -> model built
    ckpt = max_over_ranks(t1 - t0, b.sync_group)
    step = max_over_ranks(t2 - t1, b.sync_group)
    out.update({"start_to_built_s": ready, "checkpoint_s": ckpt, "first_step_s": step,
                "start_to_first_step_s": max_over_ranks(time.time() - launch_t0, b.sync_group),
                "first_parts": parts})
    log(f"whole resume ({first}): {out['start_to_first_step_s']:.2f} s from launch to the first step "
        f"(built after {ready:.2f} s, checkpoint part {ckpt:.2f} s, first step {step:.2f} s)")
    times: dict[str, list[float]] = {m: [] for m in RESUME_METHODS}
    peaks: dict[str, list[float]] = {m: [] for m in RESUME_METHODS}
    read: dict[str, list[int]] = {m: [] for m in RESUME_METHODS}
    parts_of: dict[str, list[dict[str, float]]] = {FSDPKIT: [], PASS_FIRST: []}
    for m in balanced_order(RESUME_METHODS, runs, start=RESUME_METHODS.index(first)):
        _cold(b, root)
        trim()
        before = _rchar()
        with PeakRSS() as peak:
            parts, dt = timed(lambda m=m: RESUMES[m](b, root), b.sync_group)
        read[m].append(sum(gather(_rchar() - before, b.sync_group)))
        times[m].append(dt)
        peaks[m].append(max_over_ranks(float(peak.peak), b.sync_group))
        if m in parts_of:
            parts_of[m].append({k: max_over_ranks(v, b.sync_group) for k, v in parts.items()})
        log(f"resume {m}: {dt:.2f} s, {read[m][-1] / 2**30:.2f} GiB read")
    out.update({"seconds": times, "median_s": {m: med(times[m]) for m in RESUME_METHODS},
                "peak_rss_bytes": {m: max(v) for m, v in peaks.items()}, "bytes_read": read,
                "checkpoint_bytes": _checkpoint_bytes(root),
                "fsdpkit_parts_median_s": {m: {k: med([p[k] for p in ps]) for k in ps[0]}
                                           for m, ps in parts_of.items() if ps}})
    return out


def _rchar() -> int:
    """Bytes this process asked the kernel to read so far (read/pread calls, page cache or disk)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def _checkpoint_bytes(root: Path) -> int:
    """The size of the files of the checkpoint a resume under `root` loads (its manifest's)."""
    path = max((p for p in root.iterdir() if p.name.startswith("step_") and p.is_dir()),
               key=lambda p: int(p.name.split("_")[1]))
    return sum(info["size"] for info in read_manifest(path)["files"].values())


def bench_scale(b: Bench, root: Path, keep: Path, runs: int) -> dict[str, Any]:
    """fsdpkit save_checkpoint and dcp.save alternating (AB BA AB ...); the last fsdpkit save is kept
    at `keep`. With an odd `runs`, one method is first in one pair more: at 2 GiB this VM's disk
    alternated slow and fast writes (2.2-2.8 s vs 1.0-1.3 s, whichever method wrote), so 5 runs gave
    fsdpkit 3 slow saves and dcp.save 2; the default is even."""
    methods = {OUR_SYNC: lambda path: save_fsdpkit(b, path), DCP_SYNC: lambda path: save_dcp(b, path)}
    times: dict[str, list[float]] = {m: [] for m in methods}
    peaks: dict[str, list[float]] = {m: [] for m in methods}
    names = list(methods)
    for r in range(runs):
        for m in names[r % 2:] + names[: r % 2]:
            path = root / f"scale_{r}"
            trim()
            with PeakRSS() as peak:
                _, dt = timed(lambda m=m, path=path: methods[m](path), b.sync_group)
            times[m].append(dt)
            peaks[m].append(max_over_ranks(float(peak.peak), b.sync_group))
            remove(path, b.sync_group)
        log(f"scale run {r + 1}/{runs}: " + ", ".join(f"{m} {times[m][-1]:.2f} s" for m in names))
    save_fsdpkit(b, keep)
    return {"seconds": times, "median_s": {m: med(v) for m, v in times.items()},
            "peak_rss_bytes": {m: max(v) for m, v in peaks.items()},
            "base_rss_bytes": max(gather(b.base_rss, b.sync_group))}


def launch_t0() -> float:
    return float(os.environ.get(T0_ENV, time.time()))
