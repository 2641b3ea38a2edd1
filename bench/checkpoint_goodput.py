"""B6 goodput, a phase of bench/checkpoint.py (run under torchrun by it; see its docstring):
fixed-cost steps with a save every N, for no checkpoint, fsdpkit sync, fsdpkit AsyncSaver (blocking
and background staging) and dcp.async_save, in alternating order; loop time, stalls, the drain
after the loop, the process CPU the saves add and how late a sleeping Python thread wakes.
"""

from __future__ import annotations

import statistics
import threading
import time
from pathlib import Path
from typing import Any

import torch.distributed as tdist

from checkpoint_common import B6_MODES
from checkpoint_measure import gather, log, max_over_ranks, remove
from checkpoint_methods import ASYNC_KINDS, AsyncMethod, save_fsdpkit
from checkpoint_model import Bench, FixedStep


class Heartbeat:
    """A Python thread that sleeps `period` s at a time: how late it wakes is how long a Python
    thread of this process waits for the GIL (or for a core, when none is free). Run during every
    B6 mode alike, so its own small cost is the same in all of them."""

    def __init__(self, period: float = 0.005) -> None:
        self.period, self.late_s, self.wakes = period, 0.0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while True:
            t = time.perf_counter()
            if self._stop.wait(self.period):
                return
            self.late_s += max(0.0, time.perf_counter() - t - self.period)
            self.wakes += 1

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def b6_run(b: Bench, root: Path, mode: str, method: AsyncMethod | None, *, steps: int, every: int,
           step: FixedStep) -> dict[str, Any]:
    """One run of `steps` fixed-cost steps with a save every `every` (none for "no checkpoint"),
    through `method` for the async modes."""
    with Heartbeat() as beat:
        out = _b6_loop(b, root, mode, method, steps=steps, every=every, step=step)
    out.update({"heartbeat_late_s": beat.late_s, "heartbeat_wakes": beat.wakes})
    return out


def _b6_loop(b: Bench, root: Path, mode: str, method: AsyncMethod | None, *, steps: int, every: int,
             step: FixedStep) -> dict[str, Any]:
    stalls, step_s, background = [], [], []
    done_before = len(method.timings) if method is not None else 0
    tdist.barrier(group=b.sync_group)
    cpu0 = time.process_time()  # all threads of this rank: the loop's and the background saves'
    t0 = time.perf_counter()
    for s in range(1, steps + 1):
        ts = time.perf_counter()
        step()
        step_s.append(time.perf_counter() - ts)
        if mode == "no checkpoint" or s % every:
            continue
        ts = time.perf_counter()
        if method is None:
            background.append(save_fsdpkit(b, root, label=s).get("timings"))
        else:
            method.start(root, label=s)
        stalls.append(time.perf_counter() - ts)
    loop = max_over_ranks(time.perf_counter() - t0, b.sync_group)
    t1 = time.perf_counter()
    if method is not None:
        method.finish()
        background += method.timings[done_before:]
        if method.saver is not None:  # the call plus, with background staging, the optimizer step's wait
            stalls = [t["stall_s"] for t in method.timings[done_before:]]
    drain = max_over_ranks(time.perf_counter() - t1, b.sync_group)
    cpu = statistics.fmean(gather(time.process_time() - cpu0, b.sync_group))  # per rank, mean over ranks
    remove(root, b.sync_group)
    log(f"B6 {mode}: {loop:.2f} s for {steps} steps (+{drain:.2f} s until the last save is durable), "
        f"CPU {cpu:.2f} s per rank")
    # against this run's own median step: insensitive to a load drift between runs (rank 0's steps)
    own = (loop / (steps * statistics.median(step_s)) - 1) * 100
    return {"loop_s": loop, "drain_s": drain, "stall_s": stalls, "own_median_overhead_pct": own,
            "process_cpu_s": cpu, "fsdpkit_timings": [t for t in background if t]}


def bench_b6(b: Bench, root: Path, *, steps: int, every: int, rounds: int, step: FixedStep) -> dict[str, Any]:
    out: dict[str, Any] = {"fixed_step_s": step.median_s(), "n_matmul": step.n_mm, "rounds": rounds,
                           "world_size": tdist.get_world_size()}
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in B6_MODES}
    # Each async method is made once, as a training run makes its saver once, and warmed by one
    # untimed save: a staging buffer's one-time allocation is B2's first stall, not goodput.
    methods = {m: AsyncMethod(b, m) for m in B6_MODES if m in ASYNC_KINDS}
    for method in methods.values():
        method.start(root, label=0)
        method.finish()
        method.timings.clear()
        remove(root, b.sync_group)
    for r in range(rounds):  # A B C D, D C B A, ...: a drift in machine load spreads over the modes
        for mode in B6_MODES if r % 2 == 0 else B6_MODES[::-1]:
            runs[mode].append(b6_run(b, root, mode, methods.get(mode), steps=steps, every=every, step=step))
    for method in methods.values():
        method.close()
    base = statistics.median(x["loop_s"] for x in runs["no checkpoint"])
    base_cpu = statistics.median(x["process_cpu_s"] for x in runs["no checkpoint"])
    for mode, rows in runs.items():
        stalls = [s for x in rows for s in x["stall_s"]]
        loop = statistics.median(x["loop_s"] for x in rows)
        cpu = statistics.median(x["process_cpu_s"] for x in rows)
        timings = [t for x in rows for t in x["fsdpkit_timings"]]
        phases = sorted({k for t in timings for k in t if k.endswith("cpu_s") or k.endswith("_s")})
        out[mode] = {"runs": rows, "loop_s": [x["loop_s"] for x in rows], "loop_median_s": loop,
                     "loop_min_s": min(x["loop_s"] for x in rows), "loop_max_s": max(x["loop_s"] for x in rows),
                     "overhead_pct": (loop / base - 1) * 100, "saves_per_run": len(rows[0]["stall_s"]),
                     "stall_median_s": statistics.median(stalls) if stalls else 0.0,
                     "drain_median_s": statistics.median(x["drain_s"] for x in rows),
                     "process_cpu_median_s": cpu, "extra_cpu_s": cpu - base_cpu,
                     # the least overhead the extra work allows when no core is free for it
                     "extra_cpu_over_loop_pct": (cpu - base_cpu) / base * 100,
                     # rank 0's Python-thread wake-up delay (GIL or core wait) during the loop, per run
                     "heartbeat_late_median_s": statistics.median(x["heartbeat_late_s"] for x in rows),
                     "fsdpkit_phase_median_s": {k: statistics.median(t[k] for t in timings if k in t) for k in phases},
                     "own_median_overhead_pct": statistics.median(x["own_median_overhead_pct"] for x in rows)}
    return out
