"""Asynchronous save: the step blocks only while the state is copied into a host buffer; writing,
checksumming and the commit run on a background thread.

The staging buffer has the state dict's structure (DTensors keep their placements around CPU
local tensors, pinned on CUDA) and is allocated once, then reused by every save whose state has
the same keys, shapes and dtypes; it is rebuilt only when that changes (e.g. the optimizer state
appears after the first step). At most one save is in flight, so the buffer is never written while
a save still reads it: a new save first waits for the previous one.

With `background_staging` (state in host memory only), even the copy leaves the loop: the save
call returns once the state's structure is captured, the background thread copies the tensors
into the buffer first (computing their checksums in the same pass: save.stage_hashing), and a
step pre-hook on the target's optimizer makes the next `optimizer.step()` wait until that copy
is done. The state is then still the state at the save's
step, provided nothing but `optimizer.step()` changes it in place before that step (true of
fsdpkit's trainer; a loop that does, e.g. an in-place weight edit, calls `wait_staged()` first).
The loop's wait in that hook counts in the save's `stall_s`. Tensors on an accelerator are always
staged before the call returns (a device-to-host copy into pinned memory is fast), and so is the
state of a target without an optimizer (an EMA copy): there is no step to hook.

The background thread's collectives run on their own gloo group, which nothing else uses while a
save is in flight; DCP's planning, the tensor checksums, the file-list gather and the commit
barrier all go through it (sharing the training group from two threads mismatches collectives).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as tdist

from fsdpkit import watchdog
from fsdpkit.checkpoint.hashing import ROWS
from fsdpkit.checkpoint.layout import CkptPath
from fsdpkit.checkpoint.save import FrozenShare, PlanCache, Snapshot, capture, stage_hashing, write_snapshot
from fsdpkit.checkpoint.settings import IOSettings
from fsdpkit.checkpoint.staging import (
    allocate,
    copy_into,
    copy_tensors,
    copy_threads,
    signature,
    tensors,
)
from fsdpkit.checkpoint.state import CheckpointTarget
from fsdpkit.checkpoint.storage.mirror import Mirror
from fsdpkit.dist import group_rank

log = logging.getLogger("fsdpkit.checkpoint")


@dataclass
class SaveResult:
    """What one save did, on this rank."""

    step: int
    path: CkptPath
    mode: str  # "sync" | "async"
    reason: str = "manual"  # every_steps, every_minutes, end, preempted, ...
    stall_s: float = 0.0  # the training loop was blocked this long
    wait_s: float = 0.0  # of which: waiting for the previous save to finish
    background_s: float = 0.0  # writing, checksums and commit after the loop went on
    background_cpu_s: float = 0.0  # CPU time of the background thread itself (the checksum worker's is in timings)
    manifest: dict[str, Any] = field(default_factory=dict)

    @property
    def bytes_per_rank(self) -> list[int]:
        return self.manifest.get("bytes_per_rank", [])


class AsyncSaver:
    """Stages state into a reused host buffer and writes it on one background thread."""

    def __init__(self, *, group: tdist.ProcessGroup | None, thread_count: int = 1, background_staging: bool = False,
                 io: IOSettings | None = None, mirror: Mirror | None = None, plans: PlanCache | None = None,
                 frozen: FrozenShare | None = None):
        self.group, self.thread_count, self.background_staging = group, thread_count, background_staging
        self.io = io or IOSettings.from_environment()  # the owning Checkpointer's I/O tunables
        self.mirror = mirror  # the owning Checkpointer's checkpoint.local_dir copy, if any
        self.plans = plans  # the owning Checkpointer's save-plan cache, if any
        self.frozen = frozen  # the owning Checkpointer's shared frozen tensors, if any
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fsdpkit-ckpt")
        threads = copy_threads(self.io)  # a blocking host copy on this many threads (see staging.py)
        self._copiers = (ThreadPoolExecutor(max_workers=threads, thread_name_prefix="fsdpkit-stage")
                         if threads > 1 else None)
        self._buffer: dict[str, Any] | None = None
        self._signature: Any = None
        self._pending: tuple[SaveResult, Future] | None = None
        self._staging: tuple[SaveResult, threading.Event] | None = None  # a background copy not yet known done
        self._hooked: list[tuple[weakref.ref, Any]] = []  # (optimizer, its step pre-hook's handle)

    @property
    def in_flight(self) -> SaveResult | None:
        return self._pending[0] if self._pending is not None else None

    def done(self) -> bool:
        """True when no save is in flight or the one in flight has finished (ok or not)."""
        return self._pending is None or self._pending[1].done()

    def failed(self) -> bool:
        """True when the save in flight has finished with an error (not yet collected)."""
        return self._pending is not None and self._pending[1].done() and self._pending[1].exception() is not None

    def save(self, target: CheckpointTarget, *, ckpt_dir: CkptPath, step: int, meta: dict[str, Any],
             then: Callable[[], None] | None = None) -> tuple[SaveResult | None, SaveResult]:
        """Wait for the save in flight (if any), stage `target`, and start writing it; `then` runs on
        the background thread once it is committed (the caller's policy after a commit: retention).

        Returns: (the previous save's result, if one had to be waited for; the new, running save).
        Raises: CheckpointSaveError if the previous save failed (nothing new is started then).
        """
        t0 = time.perf_counter()
        previous = None
        if self._pending is not None:
            if not self._pending[1].done():
                log.info("checkpoint: step %d waits for the save of step %d, still being written", step,
                         self._pending[0].step)
            previous = self.wait()
        t_waited = time.perf_counter()
        rank = group_rank(self.group)
        live = capture(target, step=step, meta=meta, rank=rank)
        if self.frozen is not None:  # before staging: frozen tensors are neither copied nor written while unchanged
            # the write checksums the host copy (save.stage_hashing or _write_and_hash): the row hash
            self.frozen.take(live, target, run_id=meta["run_id"], group=self.group, thread_count=self.thread_count,
                             algorithm=ROWS)
        result = SaveResult(step=step, path=ckpt_dir, mode="async", wait_s=t_waited - t0)
        background = (self.background_staging and target.optimizer is not None
                      and not any(t.device.type != "cpu" for t in tensors(live.state)))
        copied = threading.Event()
        if background:
            self._ensure_buffer(live.state)
            staged = Snapshot(step=step, state=copy_into(live.state, self._buffer, copy_tensors=False),
                              trainer=live.trainer, meta=meta, shared=live.shared,
                              frozen_s=live.frozen_s)
            self._guard(target.optimizer)
            self._staging = (result, copied)
        else:
            staged = Snapshot(step=step, state=self._stage(live.state), trainer=live.trainer, meta=meta,
                              shared=live.shared, frozen_s=live.frozen_s)
        result.stall_s = time.perf_counter() - t0

        def write() -> dict[str, Any]:
            t_bg, cpu_bg = time.perf_counter(), time.thread_time()
            watchdog.doing(f"background save of step {step}: writing and commit", slot=watchdog.BACKGROUND)
            try:
                if background:
                    try:
                        with torch.no_grad():  # the tensor checksums come from the copy's own pass
                            staged.shares = stage_hashing(live.state, staged.state, group=self.group, io=self.io)
                    finally:
                        copied.set()  # an error is raised by wait(); the loop must not hang on it
                manifest = write_snapshot(staged, ckpt_dir=ckpt_dir, group=self.group, thread_count=self.thread_count,
                                          io=self.io, mirror=self.mirror, plans=self.plans)
                if then is not None:
                    then()
            finally:
                watchdog.doing(None, slot=watchdog.BACKGROUND)
            result.background_s = time.perf_counter() - t_bg
            result.background_cpu_s = time.thread_time() - cpu_bg
            return manifest

        self._pending = (result, self._executor.submit(write))
        return previous, result

    def wait(self) -> SaveResult | None:
        """Block until the save in flight is committed; returns its result (None if there was none).

        Raises: CheckpointSaveError (or what the write raised) if it failed on any rank.
        """
        if self._pending is None:
            return None
        result, future = self._pending
        self._pending = None
        try:
            result.manifest = future.result()  # re-raises the background error here, on the caller's thread
        finally:
            self._staging = None
        return result

    def wait_staged(self) -> None:
        """Block until the save in flight has copied the state (background staging); the time
        waited is added to that save's `stall_s`. A no-op otherwise. Call it before changing the
        saved state in place other than through `optimizer.step()` (which calls it itself)."""
        if self._staging is None:
            return
        result, copied = self._staging
        t0 = time.perf_counter()
        copied.wait()
        result.stall_s += time.perf_counter() - t0
        self._staging = None

    def _guard(self, optimizer: torch.optim.Optimizer) -> None:
        """A step pre-hook on `optimizer` (once) that waits for the background copy."""
        if not any(ref() is optimizer for ref, _ in self._hooked):
            hook = optimizer.register_step_pre_hook(lambda *_: self.wait_staged())
            self._hooked.append((weakref.ref(optimizer), hook))

    def collect_if_ok(self) -> SaveResult | None:
        """The finished save's result if it succeeded; None while it runs, or if it failed (a
        failure is raised by `wait`, once every rank agreed to look at it)."""
        if self._pending is None or not self._pending[1].done() or self._pending[1].exception() is not None:
            return None
        return self.wait()

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        if self._copiers is not None:
            self._copiers.shutdown(wait=True)
        self._staging = None
        for _, handle in self._hooked:
            handle.remove()
        self._hooked.clear()

    def _ensure_buffer(self, state: dict[str, Any]) -> bool:
        """Allocate the staging buffer unless the one held fits `state`; True if it allocated."""
        sig = signature(state)
        if self._buffer is not None and sig == self._signature:
            return False
        pin = torch.cuda.is_available() and any(t.is_cuda for t in tensors(state))
        log.info("checkpoint: allocating the %sstaging buffer", "pinned " if pin else "")
        self._buffer, self._signature = allocate(state, pin=pin), sig
        return True

    @torch.no_grad()
    def _stage(self, state: dict[str, Any]) -> dict[str, Any]:
        fresh = self._ensure_buffer(state)
        # a fresh buffer's first touch faults its pages in, which several threads do slower than one
        if self._copiers is not None and not fresh and all(t.device.type == "cpu" for t in tensors(state)):
            staged = copy_into(state, self._buffer, copy_tensors=False)
            copy_tensors(state, self._buffer, pool=self._copiers)
            return staged
        cuda = torch.cuda.is_available()
        staged = copy_into(state, self._buffer, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize()  # the device-to-host copies must land before the write starts
        return staged
