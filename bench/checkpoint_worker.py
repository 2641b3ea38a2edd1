"""The distributed phases of bench/checkpoint.py; it runs them under torchrun (see its docstring).

Each phase builds the synthetic model on the ranks it was launched with, runs the benchmarks it
was asked for, and rank 0 writes `<workdir>/result_<phase>_<nproc>_<size>.json` for the
orchestrator. Every figure here is a wall time on rank 0's clock between barriers of a dedicated
gloo group, or the maximum over ranks where each rank measures its own (stalls, memory).
"""

from __future__ import annotations

import ctypes
import functools
import gc
import json
import math
import mmap
import os
import shutil
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from fsdpkit import dist, tunables
from fsdpkit.checkpoint import direct_io
from fsdpkit.checkpoint.async_save import AsyncSaver
from fsdpkit.checkpoint.direct_io import DirectWriter
from fsdpkit.checkpoint.hashing import DIRECT_WRITERS
from fsdpkit.checkpoint.manifest import model_fingerprint, optimizer_summary
from fsdpkit.checkpoint.page_cache import write_in_pieces
from fsdpkit.checkpoint.resume import load_checkpoint
from fsdpkit.checkpoint.save import save_checkpoint
from fsdpkit.checkpoint.staging import HAS_STREAM_COPY, copy_host
from fsdpkit.checkpoint.state import CheckpointTarget, flatten
from fsdpkit.checkpoint.writeback import WriteBack

MiB = 2**20
BATCH = 16  # rows per forward of the real step (only the setup step and its timing use it)
N_BASE_STEPS = 3  # B2: steps timed before each save, with nothing in flight
SAMPLE_S = 0.002  # RSS sampling period
MATMUL = 512  # the fixed-cost step's burst is [512, 512] matmuls (~5 ms each): few GIL hand-offs per step
OUR_ASYNC_BG = "fsdpkit AsyncSaver, background staging"
B6_MODES = ("no checkpoint", "fsdpkit sync", "fsdpkit AsyncSaver", OUR_ASYNC_BG, "dcp.async_save")
_PAGE = os.sysconf("SC_PAGE_SIZE")
_LIBC = ctypes.CDLL("libc.so.6")


# -- small helpers ---------------------------------------------------------------------------
def log(msg: str) -> None:
    if tdist.get_rank() == 0:
        print(f"[checkpoint bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def med(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def max_over_ranks(x: float, group) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    tdist.all_reduce(t, op=tdist.ReduceOp.MAX, group=group)
    return float(t)


def gather(obj: Any, group) -> list[Any]:
    out: list[Any] = [None] * tdist.get_world_size(group)
    tdist.all_gather_object(out, obj, group=group)
    return out


def timed(fn: Callable[[], Any], group) -> tuple[Any, float]:
    """Run `fn` on every rank between barriers; (its result, seconds until the last rank finished)."""
    tdist.barrier(group=group)
    t0 = time.perf_counter()
    out = fn()
    return out, max_over_ranks(time.perf_counter() - t0, group)


def rotation(names: list[str] | tuple[str, ...], r: int) -> list[str]:
    """The order of run `r`: rotated by r and reversed in odd runs, so that no method always runs
    first nor always right after the same one (a write leaves the disk and the page cache busy for
    whatever follows it)."""
    order = list(names[r % len(names):]) + list(names[: r % len(names)])
    return order[::-1] if r % 2 else order


def remove(path: Path, group) -> None:
    """Delete a checkpoint directory between runs (rank 0), so the disk never fills."""
    tdist.barrier(group=group)
    if tdist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
    tdist.barrier(group=group)


def drop_page_cache(root: Path) -> None:
    """Evict the checkpoint's (clean, fsynced) pages from the page cache: posix_fadvise(DONTNEED)."""
    for f in root.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def _vm_hwm() -> int | None:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return None


def trim() -> None:
    """Collect garbage and hand freed heap pages back, so that 'RSS before' is not inflated by
    what an earlier measurement freed (glibc keeps it otherwise)."""
    gc.collect()
    _LIBC.malloc_trim(0)


class PeakRSS:
    """Peak resident set size while the block runs: the larger of a sampling thread's maximum
    (every SAMPLE_S) and the kernel's VmHWM after resetting it (writing 5 to clear_refs)."""

    def __enter__(self) -> PeakRSS:
        try:
            Path("/proc/self/clear_refs").write_text("5")
            self._hwm_reset = True
        except OSError:
            self._hwm_reset = False
        self.sampled = rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self.sampled = max(self.sampled, rss())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.sampled = max(self.sampled, rss())
        self.hwm = _vm_hwm() if self._hwm_reset else None
        self.peak = max(self.sampled, self.hwm or 0)


# -- the synthetic model ---------------------------------------------------------------------
class TrainCounter:
    """The trainer's step counter, stored in the manifest as a Stateful (load verification
    compares it with the optimizer's step count, under the name "train")."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])


@dataclass
class Bench:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    counter: TrainCounter
    target: CheckpointTarget
    fingerprint: dict[str, Any]
    n_layers: int
    width: int
    sync_group: Any  # saves, loads and the benchmark's own barriers
    fsdpkit_async_group: Any  # AsyncSaver's background thread only
    dcp_async_group: Any  # dcp.async_save's background thread only
    base_rss: int  # RSS before the model existed (torch imported, process group up)
    state_bytes: int = 0  # this rank's model + optimizer tensor bytes
    real_step_s: float = 0.0

    @property
    def rank(self) -> int:
        return tdist.get_rank()


def build_bench(size_gib: float, width: int, *, warm_step: bool = True) -> Bench:
    """nn.Linear(width, width) layers, each fully_shard-ed, then the root; AdamW; one real step
    (unless not `warm_step`: a resumed run loads into an optimizer that never stepped).
    The layer count makes params + exp_avg + exp_avg_sq (fp32) total `size_gib` over all ranks."""
    groups = [tdist.new_group(backend="gloo") for _ in range(3)]
    base_rss = rss()
    n_layers = max(1, round(size_gib * 2**30 / (12 * width * width)))
    mesh = init_device_mesh("cpu", (tdist.get_world_size(),))
    with torch.device("meta"):
        model = nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(n_layers)))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(1234 + tdist.get_rank())
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().normal_(0.0, width**-0.5, generator=gen)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    counter = TrainCounter()
    target = CheckpointTarget(model=model, optimizer=optimizer, stateful={"train": counter})
    fingerprint = model_fingerprint(model, sharding={"wrap_policy": ["Linear"], "activation_checkpointing": [],
                                                     "mixed_precision": "fp32", "reshard_after_forward": True,
                                                     "compiled": False})
    b = Bench(model=model, optimizer=optimizer, counter=counter, target=target, fingerprint=fingerprint,
              n_layers=n_layers, width=width, sync_group=groups[0], fsdpkit_async_group=groups[1],
              dcp_async_group=groups[2], base_rss=base_rss)
    if warm_step:
        _, b.real_step_s = timed(lambda: real_step(b), b.sync_group)  # the AdamW state exists from here on
    b.state_bytes = sum(t.nbytes for t in local_tensors(b, with_steps=True))
    return b


def real_step(b: Bench) -> None:
    """One forward/backward/AdamW step of the synthetic model."""
    x = torch.randn(BATCH, b.width)
    b.model(x).pow(2).mean().backward()
    b.optimizer.step()
    b.optimizer.zero_grad(set_to_none=True)
    b.counter.step += 1


def local_tensors(b: Bench, *, with_steps: bool = False) -> list[torch.Tensor]:
    """This rank's shards of every model and optimizer tensor (the live storage a save reads)."""
    model_sd, optim_sd = get_state_dict(b.model, b.optimizer)
    flat = flatten({"model": model_sd, "optim": optim_sd})
    out = []
    for key, v in flat.items():
        if isinstance(v, torch.Tensor) and (with_steps or not key.endswith(".step")):
            out.append(v.to_local() if isinstance(v, DTensor) else v)
    return out


class FixedStep:
    """A fixed-cost training step: a matmul burst calibrated on rank 0 to `burst_ms`, an in-place
    add on every model and optimizer tensor shard (so an async snapshot really races with
    mutation, and the step streams the state through memory as AdamW does), and a one-element
    all-reduce that keeps the ranks in lockstep as a gradient reduction would."""

    def __init__(self, b: Bench, burst_ms: float):
        self.b, self.tensors = b, local_tensors(b)
        self.a = torch.randn(MATMUL, MATMUL)
        self.c = torch.empty(MATMUL, MATMUL)
        self.flag = torch.zeros(1)
        t0 = time.perf_counter()
        for _ in range(10):
            torch.mm(self.a, self.a, out=self.c)
        per_mm = (time.perf_counter() - t0) / 10
        n = torch.tensor([round(burst_ms / 1000 / per_mm)], dtype=torch.int64)
        tdist.broadcast(n, src=0, group=b.sync_group)
        self.n_mm = int(n)
        self.n = 0

    @torch.no_grad()
    def __call__(self) -> None:
        for _ in range(self.n_mm):
            torch.mm(self.a, self.a, out=self.c)
        # No gradients: AdamW updates nothing, but its step pre-hooks run as in a real step (an async
        # save staged in the background makes the loop wait there for the copy), then the update.
        self.b.optimizer.step()
        torch._foreach_add_(self.tensors, 1e-7)
        tdist.all_reduce(self.flag)
        self.n += 1  # not an optimizer step: the trainer's counter (checked against AdamW's on load) stays

    def median_s(self, n: int = 5) -> float:
        times = []
        for _ in range(n):
            _, dt = timed(self, self.b.sync_group)
            times.append(dt)
        return statistics.median(times)


# -- the save methods ------------------------------------------------------------------------
def meta(b: Bench) -> dict[str, Any]:
    """What Checkpointer._meta adds to the manifest (fingerprint cached, as it caches it)."""
    return {"run_id": "bench", "fingerprint": b.fingerprint, "optimizer": optimizer_summary(b.optimizer, step=b.counter.step),
            "metrics": {}}


def dcp_state(b: Bench) -> dict[str, Any]:
    model_sd, optim_sd = get_state_dict(b.model, b.optimizer)
    return {"model": model_sd, "optim": optim_sd}


def save_fsdpkit(b: Bench, root: Path, label: int | None = None) -> dict[str, Any]:
    step = b.counter.step if label is None else label
    return save_checkpoint(b.target, ckpt_dir=root / f"step_{step}", step=step, meta=meta(b), group=b.sync_group)


def save_dcp(b: Bench, root: Path) -> None:
    dcp.save(dcp_state(b), storage_writer=FileSystemWriter(root, sync_files=True), process_group=b.sync_group)


def save_torch(b: Bench, root: Path) -> None:
    """The classic recipe: gather the full state dict to rank 0 (CPU), torch.save it, fsync."""
    model_sd, optim_sd = get_state_dict(b.model, b.optimizer,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if b.rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        with open(root / "checkpoint.pt", "wb") as f:
            torch.save({"model": model_sd, "optim": optim_sd}, f)
            f.flush()
            os.fsync(f.fileno())


RAW_CHUNK = 16 << 20


def write_raw(b: Bench, root: Path, *, writeback: int = 0, direct: bool = False) -> None:
    """The disk's ceiling for this save, taken beside it: every rank writes its own state bytes
    (the same bytes a save writes) to a new file in os.write calls of FSDPKIT_WRITE_PIECE_BYTES
    (256 KiB), then fsyncs it; with `writeback`, starting the write-back of every `writeback`
    bytes as it goes (FSDPKIT_WRITEBACK_BYTES); with `direct`, through O_DIRECT from reused aligned
    buffers (direct_io.DirectWriter as fsdpkit's checkpoint writer sets it up): the ways fsdpkit's
    writer writes, with O_DIRECT and where it is off."""
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"raw_{b.rank}.bin"
    if direct:
        writer = DirectWriter(path, buffer_bytes=TUNED.direct_write_buffer_bytes, writers=DIRECT_WRITERS)
        try:
            for t in local_tensors(b, with_steps=True):
                writer.write(t.detach().contiguous().reshape(-1).view(torch.uint8))
            writer.close()
        finally:
            writer.abort()
        return
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    written, wb = 0, WriteBack(fd, writeback)
    try:
        for t in local_tensors(b, with_steps=True):
            raw = memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
            done = 0
            while done < len(raw):  # os.write may write less than asked: count what it wrote
                n = write_in_pieces(lambda v: os.write(fd, v), raw[done : done + RAW_CHUNK])
                done, written = done + n, written + n
                wb.written_to(written)
        os.fsync(fd)
    finally:
        os.close(fd)


SYNC_SAVES: dict[str, Callable[[Bench, Path], Any]] = {
    "fsdpkit save_checkpoint": save_fsdpkit, "dcp.save": save_dcp, "torch.save (rank 0, full)": save_torch}
TUNED = tunables.current()  # this benchmark process's FSDPKIT_* settings, which name the ceilings
RAW_WRITE = "raw write + fsync of each rank's bytes (ceiling)"
RAW_WRITE_WB = f"raw write + fsync, write-back started every {TUNED.writeback_bytes >> 20} MiB (ceiling)"
RAW_WRITES: dict[str, Callable[[Bench, Path], Any]] = {RAW_WRITE: write_raw}
if TUNED.writeback_bytes > 0:
    RAW_WRITES[RAW_WRITE_WB] = functools.partial(write_raw, writeback=TUNED.writeback_bytes)
RAW_WRITE_DIRECT = (f"raw write + fsync, O_DIRECT from {TUNED.direct_write_buffer_bytes >> 20} MiB buffers on "
                    f"{DIRECT_WRITERS} threads (ceiling)")
if direct_io.enabled():
    RAW_WRITES[RAW_WRITE_DIRECT] = functools.partial(write_raw, direct=True)
B1_METHODS = {**SYNC_SAVES, **RAW_WRITES}  # B1 times the ceilings in the same rotation as the saves


class AsyncMethod:
    """Start an async save (returning once the loop may go on) and later wait for it, reporting
    when it became durable (perf_counter on this rank; rank 0 commits)."""

    def __init__(self, b: Bench, kind: str):
        self.b, self.kind = b, kind
        self.saver = (AsyncSaver(group=b.fsdpkit_async_group, background_staging=kind == OUR_ASYNC_BG)
                      if kind.startswith("fsdpkit AsyncSaver") else None)
        self.stager = (DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                                    use_async_staging=False, use_non_blocking_copy=False))
                       if kind == "dcp.async_save + DefaultStager" else None)
        self._pending: Any = None
        self.timings: list[dict[str, float]] = []  # fsdpkit's own, of every finished save

    def start(self, root: Path, label: int = 0) -> None:
        """Save into root/step_<label> (the label names the directory and the manifest's step)."""
        b = self.b
        ckpt_dir = root / f"step_{label}"
        if self.saver is not None:
            previous, running = self.saver.save(b.target, ckpt_dir=ckpt_dir, step=label, meta=meta(b))
            if previous is not None:
                self._record(previous)
            self._pending = (time.perf_counter(), running)
            return
        if self._pending is not None:  # at most one in flight, as AsyncSaver does
            self.finish()
        done: list[float] = []
        fut = dcp.async_save(dcp_state(b), storage_writer=FileSystemWriter(ckpt_dir, sync_files=True),
                             process_group=b.dcp_async_group, async_stager=self.stager)
        fut.add_done_callback(lambda _: done.append(time.perf_counter()))
        self._pending = (fut, done)

    def finish(self) -> float | None:
        """Wait for the save in flight; when it became durable (None if none was in flight)."""
        if self._pending is None:
            return None
        pending, self._pending = self._pending, None
        if self.saver is not None:
            t_returned, _ = pending
            result = self.saver.wait()
            self._record(result)
            return t_returned + result.background_s
        fut, done = pending
        fut.result()
        return done[0]

    def _record(self, result) -> None:
        # stall_s: the call, plus (background staging) the next optimizer step's wait for the copy
        self.timings.append({**result.manifest.get("timings", {}), "background_s": result.background_s,
                             "background_cpu_s": result.background_cpu_s, "stall_s": result.stall_s})

    def close(self) -> None:
        self.finish()
        if self.saver is not None:
            self.saver.close()
        if self.stager is not None:
            self.stager.close()


ASYNC_KINDS = ("fsdpkit AsyncSaver", OUR_ASYNC_BG, "dcp.async_save", "dcp.async_save + DefaultStager")
FIRST_REPORTED = ("fsdpkit AsyncSaver", OUR_ASYNC_BG, "dcp.async_save + DefaultStager")  # they allocate a buffer once


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
            if name == "fsdpkit save_checkpoint" and b.rank == 0:
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
def load_dcp_plain(b: Bench, path: Path) -> None:
    state = dcp_state(b)
    dcp.load(state, storage_reader=FileSystemReader(path), process_group=b.sync_group)
    set_state_dict(b.model, b.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


RAW_READ = "raw read of each rank's share of the bytes (ceiling)"


def read_raw(b: Bench, path: Path) -> None:
    """The disk's read ceiling for this load, taken beside it: rank r of N reads the r-th Nth of
    the checkpoint's data files (their bytes one after another) in 16 MiB preads into one buffer,
    each through a new descriptor, as fsdpkit's loads restart the readahead (page_cache)."""
    files = sorted(path.glob("*.distcp"))
    sizes = [f.stat().st_size for f in files]
    total, n = sum(sizes), tdist.get_world_size(b.sync_group)
    lo, hi = total * b.rank // n, total * (b.rank + 1) // n
    spans, base = [], 0  # (file, first byte, end) of this rank's share in each file
    for f, size in zip(files, sizes, strict=True):
        if max(lo, base) < min(hi, base + size):
            spans.append((f, max(lo, base) - base, min(hi, base + size) - base))
        base += size
    with mmap.mmap(-1, RAW_CHUNK) as buf:
        view = memoryview(buf)
        for f, pos, end in spans:
            while pos < end:  # preadv may return less than asked: count what it read
                fd = os.open(f, os.O_RDONLY)
                try:
                    pos += os.preadv(fd, [view[: min(RAW_CHUNK, end - pos)]], pos)
                finally:
                    os.close(fd)
        view.release()


def bench_load(b: Bench, path: Path, runs: int) -> dict[str, Any]:
    """Cold-ish loads of `path` (page cache dropped with posix_fadvise before each), and the raw
    read of the same bytes on as many ranks in the same rotation: this disk's speed drifts by up to
    2x over minutes, and B5 compares loads timed in different launches."""
    variants: dict[str, Callable[[], Any]] = {
        "fsdpkit load_checkpoint": lambda: load_checkpoint(b.target, path, fingerprint=b.fingerprint,
                                                           group=b.sync_group, verify=False),
        "fsdpkit load_checkpoint, verify=True": lambda: load_checkpoint(b.target, path, fingerprint=b.fingerprint,
                                                                        group=b.sync_group, verify=True),
        "dcp.load + set_state_dict": lambda: load_dcp_plain(b, path),
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
                verify_s.append(report["verify_s"])
        log(f"load on {tdist.get_world_size()} ranks, run {r + 1}/{runs}: "
            + ", ".join(f"{n} {times[n][-1]:.2f} s" for n in names))
    return {"seconds": times, "median_s": {n: med(times[n]) for n in names}, "verify_part_median_s": med(verify_s)}


# -- B6: goodput -----------------------------------------------------------------------------
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
                sync_s = res["B1"]["median_s"]["fsdpkit save_checkpoint"]
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
        from checkpoint_resume import bench_resume, launch_t0  # noqa: I001 - it imports this module

        res["resume"] = bench_resume(b, Path(args.resume_root), first=args.resume_first, runs=args.runs,
                                     launch_t0=launch_t0())
    elif args.phase == "scale":
        from checkpoint_resume import bench_scale  # noqa: I001 - it imports this module

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
