"""The distributed phases of bench/checkpoint.py; it runs them under torchrun (see its docstring).

Each phase builds the synthetic model on the ranks it was launched with, runs the benchmarks it
was asked for, and rank 0 writes `<workdir>/result_<phase>_<nproc>_<size>.json` for the
orchestrator. Every figure here is a wall time on rank 0's clock between barriers of a dedicated
gloo group, or the maximum over ranks where each rank measures its own (stalls, memory).

Here: the phases' entry point and B1-B5; B6 is in checkpoint_goodput.py, B7 and B8 in
checkpoint_resume.py; what they time in checkpoint_methods.py, on the model of checkpoint_model.py,
measured with checkpoint_measure.py.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist

from checkpoint_common import (
    DCP_LOAD,
    OUR_LOAD,
    OUR_LOAD_VERIFY,
    OUR_SYNC,
    RAW_READ,
)
from checkpoint_goodput import bench_b6
from checkpoint_measure import (
    SAMPLE_S,
    PeakRSS,
    drop_page_cache,
    gather,
    log,
    max_over_ranks,
    med,
    remove,
    rotation,
    rss,
    timed,
    trim,
)
from checkpoint_methods import (
    ASYNC_KINDS,
    B1_METHODS,
    FIRST_REPORTED,
    SYNC_SAVES,
    AsyncMethod,
    load_dcp_plain,
    read_raw,
    save_fsdpkit,
)
from checkpoint_model import Bench, FixedStep, build_bench, local_tensors
from checkpoint_resume import bench_resume, bench_scale, launch_t0
from fsdpkit import dist
from fsdpkit.checkpoint.resume import load_checkpoint
from fsdpkit.checkpoint.staging import HAS_STREAM_COPY, copy_host

MiB = 2**20
N_BASE_STEPS = 3  # B2: steps timed before each save, with nothing in flight


# -- B1: synchronous save --------------------------------------------------------------------
def bench_b1(b: Bench, root: Path, runs: int) -> dict[str, Any]:
    names = list(B1_METHODS)
    times: dict[str, list[float]] = {n: [] for n in names}
    fsdpkit_timings = []
    for r in range(runs):
        for name in rotation(names, r):
            path = root / f"b1_{r}"
            out, dt = timed(lambda: B1_METHODS[name](b, path), b.sync_group)  # noqa: B023 - called at once
            times[name].append(dt)
            if name == OUR_SYNC and b.rank == 0:
                fsdpkit_timings.append(out["timings"])
            remove(path, b.sync_group)
        log(f"B1 run {r + 1}/{runs}: " + ", ".join(f"{n} {times[n][-1]:.2f} s" for n in names))
    return {"seconds": times, "median_s": {n: med(times[n]) for n in names},
            "fsdpkit_manifest_timings": fsdpkit_timings}


# -- B2: async stall ---------------------------------------------------------------------------
STATE_MEMCPY = "memcpy of the per-rank state (yardstick)"
STATE_MEMCPY_STREAM = "memcpy of the per-rank state, non-temporal stores (yardstick)"


class StateCopy:
    """B2's yardstick, timed in the same rotation as the saves: every rank copies its shards of the
    model and optimizer state (one thread, as the ranks run) into tensors of the same shapes
    allocated and touched beforehand, all ranks at once as they stage at once; with torch copy_,
    or with `stream` fsdpkit's non-temporal copy (staging.copy_host). The faster is the yardstick."""

    def __init__(self, b: Bench, *, stream: bool = False) -> None:
        self.src = local_tensors(b, with_steps=True)
        self.dst = [torch.empty_like(t) for t in self.src]
        self.copy = copy_host if stream else torch.Tensor.copy_
        self()  # touch the pages once, as a reused staging buffer's are

    @torch.no_grad()
    def __call__(self) -> None:
        for d, s in zip(self.dst, self.src, strict=True):
            self.copy(d, s)


def one_async_save(b: Bench, method: AsyncMethod, root: Path, step: FixedStep, n_during: int) -> dict[str, Any]:
    base = [timed(step, b.sync_group)[1] for _ in range(N_BASE_STEPS)]
    tdist.barrier(group=b.sync_group)
    t0 = time.perf_counter()
    method.start(root)
    stall = time.perf_counter() - t0
    during = []
    for _ in range(n_during):
        s = time.perf_counter()
        step()
        during.append((s, time.perf_counter()))
    t_done = method.finish()
    if method.saver is not None:  # with background staging, the wait in the next optimizer step counts too
        stall = method.timings[-1]["stall_s"]
    stall = max_over_ranks(stall, b.sync_group)
    remove(root, b.sync_group)
    return {"stall_s": stall, "durable_s": t_done - t0, "base_step_s": base,
            "in_flight_step_s": [e - s for s, e in during if s < t_done],
            "after_step_s": [e - s for s, e in during if s >= t_done]}


def bench_b2(b: Bench, root: Path, runs: int, *, sync_s: float, step: FixedStep) -> dict[str, Any]:
    step_s = step.median_s()
    n = torch.tensor([min(40, max(3, math.ceil(1.5 * sync_s / step_s)))])
    tdist.broadcast(n, src=0, group=b.sync_group)  # every rank runs the same number of steps
    n_during = int(n)
    capture = []
    for _ in range(5):  # the part of fsdpkit's stall that is not a copy: get_state_dict
        t0 = time.perf_counter()
        b.target.tensor_state(rank=b.rank)
        capture.append(time.perf_counter() - t0)
    methods = {k: AsyncMethod(b, k) for k in ASYNC_KINDS}
    first = {k: one_async_save(b, methods[k], root / "b2_first", step, n_during) for k in FIRST_REPORTED}
    per_run: dict[str, list[dict[str, Any]]] = {k: [] for k in ASYNC_KINDS}
    copies = {STATE_MEMCPY: StateCopy(b)}
    if HAS_STREAM_COPY:
        copies[STATE_MEMCPY_STREAM] = StateCopy(b, stream=True)
    memcpy: dict[str, list[float]] = {k: [] for k in copies}
    for r in range(runs):
        kinds = (*ASYNC_KINDS, *copies)
        for k in rotation(kinds, r):
            if k in copies:
                memcpy[k].append(timed(copies[k], b.sync_group)[1])
                continue
            per_run[k].append(one_async_save(b, methods[k], root / f"b2_{r}", step, n_during))
        log(f"B2 run {r + 1}/{runs}: stall " + ", ".join(f"{k} {per_run[k][-1]['stall_s'] * 1e3:.0f} ms"
                                                          for k in ASYNC_KINDS)
            + "".join(f"; {k} {v[-1] * 1e3:.0f} ms" for k, v in memcpy.items()))
    del copies
    for m in methods.values():
        m.close()
    summary = {}
    for k, rows in per_run.items():
        base = [x for row in rows for x in row["base_step_s"]]
        flight = [x for row in rows for x in row["in_flight_step_s"]]
        summary[k] = {"stall_median_s": med([row["stall_s"] for row in rows]),
                      "durable_median_s": med([row["durable_s"] for row in rows]),
                      "first_stall_s": first[k]["stall_s"] if k in first else None,
                      "first_durable_s": first[k]["durable_s"] if k in first else None,
                      "step_median_s": med(base), "in_flight_step_median_s": med(flight),
                      "in_flight_steps": len(flight),
                      "step_slowdown": med(flight) / med(base) if flight and base else None}
    return {"fixed_step_s": step_s, "steps_per_save": n_during, "n_base_steps": N_BASE_STEPS,
            "fsdpkit_capture_median_s": max_over_ranks(med(capture), b.sync_group),
            "state_memcpy_s": memcpy[STATE_MEMCPY], "state_memcpy_median_s": med(memcpy[STATE_MEMCPY]),
            **({"state_memcpy_stream_s": memcpy[STATE_MEMCPY_STREAM],
                "state_memcpy_stream_median_s": med(memcpy[STATE_MEMCPY_STREAM])} if HAS_STREAM_COPY else {}),
            "summary": summary, "first": first, "runs": per_run}


# -- B3: peak memory -------------------------------------------------------------------------
def measure_rss(b: Bench, fn: Callable[[], Any]) -> dict[str, Any]:
    trim()
    tdist.barrier(group=b.sync_group)
    before = rss()
    with PeakRSS() as peak:
        fn()
    after = rss()
    rows = gather({"before": before, "peak": peak.peak, "sampled": peak.sampled, "hwm": peak.hwm, "after": after,
                   "base": b.base_rss, "state": b.state_bytes}, b.sync_group)
    return {"per_rank": rows,
            "peak_mib": max(r["peak"] for r in rows) / MiB,
            "increase_mib": max(r["peak"] - r["before"] for r in rows) / MiB,
            "footprint_over_state": max((r["peak"] - r["base"]) / r["state"] for r in rows),
            "footprint_mib": max(r["peak"] - r["base"] for r in rows) / MiB,
            "retained_after_mib": max(r["after"] - r["before"] for r in rows) / MiB}


def bench_b3(b: Bench, root: Path, runs: int) -> dict[str, Any]:
    out: dict[str, list[dict[str, Any]]] = {}

    def record(name: str, fn: Callable[[], Any]) -> None:
        out.setdefault(name, []).append(measure_rss(b, fn))
        remove(root, b.sync_group)

    for _ in range(runs):
        for name, save in SYNC_SAVES.items():
            record(name, lambda save=save: save(b, root))
    for kind in ASYNC_KINDS:
        method = AsyncMethod(b, kind)
        for i in range(runs + (kind in FIRST_REPORTED)):
            label = kind + (" (first: allocates)" if kind in FIRST_REPORTED and i == 0 else "")
            record(label, lambda m=method: (m.start(root), m.finish()))
        method.close()
        del method
        trim()
    log("B3: " + ", ".join(f"{k} +{max(r['increase_mib'] for r in v):.0f} MiB" for k, v in out.items()))
    return {"methods": out, "state_bytes_per_rank": gather(b.state_bytes, b.sync_group),
            "base_rss_per_rank": gather(b.base_rss, b.sync_group), "sample_period_s": SAMPLE_S}


# -- B4 / B5: load ---------------------------------------------------------------------------
def bench_load(b: Bench, path: Path, runs: int) -> dict[str, Any]:
    """Cold-ish loads of `path` (page cache dropped with posix_fadvise before each), and the raw
    read of the same bytes on as many ranks in the same rotation: this disk's speed drifts by up to
    2x over minutes, and B5 compares loads timed in different launches."""
    variants: dict[str, Callable[[], Any]] = {
        OUR_LOAD: lambda: load_checkpoint(b.target, path, fingerprint=b.fingerprint, group=b.sync_group,
                                              verify=False),
        OUR_LOAD_VERIFY: lambda: load_checkpoint(b.target, path, fingerprint=b.fingerprint, group=b.sync_group,
                                                     verify=True),
        DCP_LOAD: lambda: load_dcp_plain(b, path),
        RAW_READ: lambda: read_raw(b, path),
    }
    names = list(variants)
    times: dict[str, list[float]] = {n: [] for n in names}
    verify_s = []
    for r in range(runs):
        for name in rotation(names, r):
            drop_page_cache(path)
            report, dt = timed(variants[name], b.sync_group)
            times[name].append(dt)
            if name.endswith("verify=True"):
                verify_s.append(report.verify_s)
        log(f"load on {tdist.get_world_size()} ranks, run {r + 1}/{runs}: "
            + ", ".join(f"{n} {times[n][-1]:.2f} s" for n in names))
    return {"seconds": times, "median_s": {n: med(times[n]) for n in names}, "verify_part_median_s": med(verify_s)}


# -- phases ----------------------------------------------------------------------------------
def run_phase(args) -> None:
    torch.set_num_threads(1)
    tdist.init_process_group(backend="gloo")
    only = set(args.only)
    workdir = Path(args.workdir)
    size = args.phase_size_gib
    b = build_bench(size, args.width, warm_step=args.phase != "resume")
    ws = tdist.get_world_size()
    log(f"phase {args.phase} on {ws} ranks: {b.n_layers} x Linear({b.width}, {b.width}), "
        f"{b.state_bytes / MiB:.0f} MiB of state per rank, a real step took {b.real_step_s:.2f} s")
    res: dict[str, Any] = {"phase": args.phase, "world_size": ws, "size_gib": size, "n_layers": b.n_layers,
                           "width": b.width, "state_bytes_per_rank": gather(b.state_bytes, b.sync_group),
                           "real_step_s": b.real_step_s, "loadavg_start": os.getloadavg()}
    root = workdir / f"ckpt_{args.phase}_{ws}_{size:g}"
    src = workdir / f"src_{size:g}"  # saved by the main phase, loaded by every phase
    if args.phase == "main":
        if "B3" in only:
            res["B3"] = bench_b3(b, root, args.b3_runs)
        if "B1" in only:
            res["B1"] = bench_b1(b, root, args.runs)
        if "B2" in only:
            if "B1" in res:
                sync_s = res["B1"]["median_s"][OUR_SYNC]
            else:
                _, sync_s = timed(lambda: save_fsdpkit(b, root), b.sync_group)
                remove(root, b.sync_group)
            res["B2"] = bench_b2(b, root, args.runs, sync_s=sync_s, step=FixedStep(b, args.step_ms))
            res["B2"]["sync_save_s"] = sync_s
        if only & {"B4", "B5", "B7"}:
            save_fsdpkit(b, src)
        if "B4" in only:
            res["B4"] = bench_load(b, src / f"step_{b.counter.step}", args.runs)
    elif args.phase == "load":
        steps = [p for p in src.iterdir() if p.name.startswith("step_")]
        res["B5"] = bench_load(b, steps[0], args.runs)
    elif args.phase == "resume":
        res["resume"] = bench_resume(b, Path(args.resume_root), first=args.resume_first, runs=args.runs,
                                     launch_t0=launch_t0())
    elif args.phase == "scale":
        res["scale"] = bench_scale(b, root, Path(args.resume_root), args.scale_runs)
    elif args.phase == "goodput":
        res["B6"] = bench_b6(b, root, steps=args.b6_steps, every=args.b6_every, rounds=args.b6_rounds,
                             step=FixedStep(b, args.step_ms))
    res["loadavg_end"] = os.getloadavg()
    if b.rank == 0:
        (workdir / f"result_{args.phase}_{ws}_{size:g}{args.tag}.json").write_text(json.dumps(res, indent=1))
    b = None  # drop model and optimizer references before teardown (see FIELD-NOTES: abort at exit)
    dist.shutdown()  # collect, barrier, destroy
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
