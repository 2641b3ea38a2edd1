"""How the phases of bench/checkpoint.py measure (under torchrun): wall times on rank 0's clock
between barriers of a dedicated gloo group, maxima and lists over ranks, the order of the methods
in each run, peak RSS, and the page-cache eviction before every cold read.
"""

from __future__ import annotations

import ctypes
import gc
import os
import shutil
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist

SAMPLE_S = 0.002  # RSS sampling period
_PAGE = os.sysconf("SC_PAGE_SIZE")
_LIBC = ctypes.CDLL("libc.so.6")


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
