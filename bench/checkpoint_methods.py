"""What bench/checkpoint.py's phases time: fsdpkit's, DCP's and torch.save's saves and loads, the
async methods behind one start/finish interface, and the raw writes and reads of the same bytes
that are timed beside them as the disk's ceiling at that moment.
"""

from __future__ import annotations

import functools
import mmap
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from checkpoint_common import (
    DCP_ASYNC,
    DCP_ASYNC_STAGER,
    DCP_SYNC,
    OUR_ASYNC,
    OUR_ASYNC_BG,
    OUR_SYNC,
    RAW_WRITE,
    RAW_WRITE_DIRECT,
    RAW_WRITE_WB,
    TORCH_SYNC,
)
from checkpoint_model import Bench, local_tensors
from fsdpkit.checkpoint.async_save import AsyncSaver
from fsdpkit.checkpoint.manifest import optimizer_summary
from fsdpkit.checkpoint.save import save_checkpoint
from raw_io import DIRECT_BUFFER_BYTES, WRITEBACK_BYTES, WriteBack, write_direct, write_in_pieces


# -- saves -----------------------------------------------------------------------------------
def meta(b: Bench) -> dict[str, Any]:
    """What Checkpointer._meta adds to the manifest (fingerprint cached, as it caches it)."""
    optimizer = optimizer_summary(b.optimizer, step=b.counter.step)
    return {"run_id": "bench", "fingerprint": b.fingerprint, "optimizer": optimizer, "metrics": {}}


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
    (the same bytes a save writes) to a new file in os.write calls of 256 KiB, then fsyncs it; with
    `writeback`, starting the write-back of every `writeback` bytes as it goes; with `direct`,
    through O_DIRECT from a reused aligned buffer (bench/raw_io.py: the disk's ways, not fsdpkit's)."""
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"raw_{b.rank}.bin"
    if direct:
        write_direct(path, (t.detach().contiguous().reshape(-1).view(torch.uint8)
                            for t in local_tensors(b, with_steps=True)))
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
    OUR_SYNC: save_fsdpkit, DCP_SYNC: save_dcp, TORCH_SYNC: save_torch}
RAW_WRITES: dict[str, Callable[[Bench, Path], Any]] = {RAW_WRITE: write_raw}
RAW_WRITES[f"{RAW_WRITE_WB} {WRITEBACK_BYTES >> 20} MiB (ceiling)"] = functools.partial(
    write_raw, writeback=WRITEBACK_BYTES)
if hasattr(os, "O_DIRECT"):
    RAW_WRITES[f"{RAW_WRITE_DIRECT} from a {DIRECT_BUFFER_BYTES >> 20} MiB buffer (ceiling)"] = functools.partial(
        write_raw, direct=True)
B1_METHODS = {**SYNC_SAVES, **RAW_WRITES}  # B1 times the ceilings in the same rotation as the saves


class AsyncMethod:
    """Start an async save (returning once the loop may go on) and later wait for it, reporting
    when it became durable (perf_counter on this rank; rank 0 commits)."""

    def __init__(self, b: Bench, kind: str):
        self.b, self.kind = b, kind
        self.saver = (AsyncSaver(group=b.fsdpkit_async_group, background_staging=kind == OUR_ASYNC_BG)
                      if kind.startswith(OUR_ASYNC) else None)
        self.stager = (DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                                    use_async_staging=False, use_non_blocking_copy=False))
                       if kind == DCP_ASYNC_STAGER else None)
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


ASYNC_KINDS = (OUR_ASYNC, OUR_ASYNC_BG, DCP_ASYNC, DCP_ASYNC_STAGER)
FIRST_REPORTED = (OUR_ASYNC, OUR_ASYNC_BG, DCP_ASYNC_STAGER)  # they allocate a buffer once


# -- loads -----------------------------------------------------------------------------------
def load_dcp_plain(b: Bench, path: Path) -> None:
    state = dcp_state(b)
    dcp.load(state, storage_reader=FileSystemReader(path), process_group=b.sync_group)
    set_state_dict(b.model, b.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def read_raw(b: Bench, path: Path) -> None:
    """The disk's read ceiling for this load, taken beside it: rank r of N reads the r-th Nth of
    the checkpoint's data files (their bytes one after another) in 16 MiB preads into one buffer,
    each through a new descriptor, as fsdpkit's checksum pass restarts the readahead (page_cache)."""
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
