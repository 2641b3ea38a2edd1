"""The faults themselves: patches applied to fsdpkit from the outside, through seams a user could
plug into too (the DCP file system a save writes through, storage's `os`, the Stateful objects a
resume restores, the module functions a loop or a background save calls). Nothing here is
imported by fsdpkit; fsdpkit has no test hooks.

A fault is a dict {"kind": ..., params} (built by the functions of `faults/__init__.py`). It
is applied in one of two ways:
- in the test's own process, by `faults.injected(...)` (undone on exit);
- in every process started with `faults.env(...)`: that puts this directory first on PYTHONPATH,
  so `sitecustomize.py` here runs at interpreter start-up (torchrun's ranks inherit it) and calls
  `install_from_env()`, which patches each fsdpkit module right after it is first imported.

Every fault appends one JSON line to the marker file when it fires (where and when it landed:
step, rank, file, byte count...), so a test asserts that it fired where it should; a fault that
never lands fails the test instead of passing it. The marker file is written with O_APPEND and
fsync'd before anything destructive happens (a SIGKILL), so it survives the process.

This module is imported as `faults.fault_hooks` in a test and as `fault_hooks` by sitecustomize.
"""

from __future__ import annotations

import errno
import importlib
import importlib.abc
import io
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

SPEC_ENV = "FAULTS_SPEC"  # JSON: {"marker": path, "faults": [fault, ...]}; deliberately not FSDPKIT_*


class Marker:
    """Where fired faults are recorded: one JSON object per line."""

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)

    def fire(self, kind: str, **facts: Any) -> None:
        line = json.dumps({"fault": kind, "pid": os.getpid(), "time": time.time(), **facts}) + "\n"
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        sys.stderr.write(f"[faults] fired: {line}")
        sys.stderr.flush()


def fired(marker: str | os.PathLike, kind: str | None = None) -> list[dict[str, Any]]:
    """The faults recorded in `marker` (of `kind`, if given), in the order they fired."""
    path = Path(marker)
    if not path.is_file():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in records if kind is None or r["fault"] == kind]


class Patches:
    """setattr with undo (for faults applied in a test's own process)."""

    def __init__(self) -> None:
        self._undo: list[tuple[Any, str, bool, Any]] = []

    def set(self, obj: Any, name: str, value: Any) -> None:
        own = vars(obj) if hasattr(obj, "__dict__") else {}
        self._undo.append((obj, name, name in own, own.get(name)))
        setattr(obj, name, value)

    def undo(self) -> None:
        for obj, name, had, old in reversed(self._undo):
            if had:
                setattr(obj, name, old)
            else:
                delattr(obj, name)
        self._undo.clear()


def _rank() -> int:
    import torch.distributed as tdist

    return tdist.get_rank() if tdist.is_available() and tdist.is_initialized() else 0


def _matches(rank_spec: int | str, rank: int) -> bool:
    return rank_spec == "*" or int(rank_spec) == rank


# -- shard writes: a SIGKILL or a stall after N bytes of a checkpoint's shard file ----------------
def _step_of(ckpt_dir: Any) -> int | None:
    """The step a checkpoint directory holds, from its name (step_<N> or step_<N>.incoming)."""
    from fsdpkit.checkpoint.catalog import STEP_DIR
    from fsdpkit.checkpoint.layout import INCOMING

    found = STEP_DIR.match(str(ckpt_dir.name).removesuffix(INCOMING))
    return int(found.group(1)) if found else None


class _ObservedStream:
    """A shard file's write stream (fsdpkit's checksumming stream underneath) that counts the bytes
    written through it. With `stop_at`, the write that would pass that many bytes writes only up to
    it, then calls `at_stop(self)` (which does not return: a SIGKILL); `after_first_write(self)`
    runs once, after the first write."""

    def __init__(self, inner: Any, name: str, *, stop_at: int | None = None,
                 at_stop: Callable[[_ObservedStream], None] | None = None,
                 after_first_write: Callable[[_ObservedStream], None] | None = None):
        self._inner, self.name, self.written = inner, name, 0
        self._stop_at, self._at_stop, self._after_first_write = stop_at, at_stop, after_first_write

    def write(self, b: Any) -> int:
        data = memoryview(b).cast("B")
        if self._stop_at is not None and self.written + len(data) >= self._stop_at:
            head = data[: self._stop_at - self.written]
            if len(head):
                self.written += self._inner.write(head)
            self._at_stop(self)
        n = self._inner.write(b)
        self.written += n
        if self._after_first_write is not None:
            after, self._after_first_write = self._after_first_write, None
            after(self)
        return n

    def __getattr__(self, name: str) -> Any:  # tell, fileno, flush, close...: the real stream's
        return getattr(self._inner, name)


class _ObservedFileSystem:
    """A DCP file system that passes everything to `inner` (fsdpkit's DigestFileSystem) and
    observes the writes to shard files (*.distcp; `.metadata` is left alone) through
    _ObservedStream(**observe)."""

    def __init__(self, inner: Any, observe: dict[str, Any]):
        self._inner, self._observe = inner, observe

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        name = Path(str(path)).name
        with self._inner.create_stream(path, mode) as stream:
            if "w" in mode and name.endswith(".distcp"):
                yield _ObservedStream(stream, name, **self._observe)
            else:
                yield stream

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _observe_shard_writes(save: ModuleType, patches: Patches,
                          observe: Callable[[int | None], dict[str, Any] | None]) -> None:
    """Wrap `fsdpkit.checkpoint.save.hashing_writer`, the factory of the DCP writer every sharded
    save writes through: the writer's file system becomes an _ObservedFileSystem around fsdpkit's
    own whenever `observe(step)` returns how (the _ObservedStream arguments) for the checkpoint
    being written."""
    real = save.hashing_writer

    def hashing_writer(into: Any, **kwargs: Any) -> Any:
        writer, fs = real(into, **kwargs)
        how = observe(_step_of(into))
        if how is not None:
            writer.fs = _ObservedFileSystem(writer.fs, how)
        return writer, fs

    patches.set(save, "hashing_writer", hashing_writer)


def _kill_mid_write(save: ModuleType, fault: dict, marker: Marker, patches: Patches) -> None:
    """SIGKILL rank `rank` once exactly `after_bytes` bytes of its shard of step `step` went into
    the file (the write that crosses that count is cut there)."""
    def observe(step: int | None) -> dict[str, Any] | None:
        rank = _rank()
        if step != fault["step"] or rank != fault["rank"]:
            return None

        def die(stream: _ObservedStream) -> None:
            marker.fire("kill_mid_write", step=step, rank=rank, file=stream.name, bytes_written=stream.written,
                        after_bytes=fault["after_bytes"])
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)  # never reached: the signal ends the process while it is delivered
        return {"stop_at": fault["after_bytes"], "at_stop": die}

    _observe_shard_writes(save, patches, observe)


def _stall_mid_write(save: ModuleType, fault: dict, marker: Marker, patches: Patches) -> None:
    """Sleep `seconds` after the first write into each shard file (of step `step`, or of every
    save): the save is then in flight, its directory on disk and uncommitted, for that long."""
    def observe(step: int | None) -> dict[str, Any] | None:
        if fault.get("step") is not None and step != fault["step"]:
            return None

        def stall(stream: _ObservedStream) -> None:
            marker.fire("stall_mid_write", step=step, rank=_rank(), file=stream.name,
                        bytes_written=stream.written, seconds=fault["seconds"])
            time.sleep(fault["seconds"])
        return {"after_first_write": stall}

    _observe_shard_writes(save, patches, observe)


# -- shard writes: the disk fills after N bytes of a checkpoint's shard file --------------------
class _FillingFile(io.RawIOBase):
    """A shard file's raw layer on a disk with `room` bytes left for it: the write that would pass
    them writes what fits, then fails with ENOSPC, as the kernel's write(2) does; later writes
    fail too. Python's buffer sits above it (_FullDisk), so the error surfaces where a real full
    disk's does: in a write, a flush or the close."""

    def __init__(self, path: str, *, room: int, on_full: Callable[[int], None]):
        super().__init__()
        self._file, self._room, self._on_full = open(path, "wb", buffering=0), room, on_full  # noqa: SIM115
        self.written, self.full = 0, False

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        data = memoryview(b).cast("B")
        if self.written + len(data) > self._room:
            fits = self._file.write(data[: self._room - self.written]) if self._room > self.written else 0
            self.written += fits
            if fits:
                return fits  # a short write; the caller's next write fails
            if not self.full:  # recorded once per file
                self.full = True
                self._on_full(self.written)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        n = self._file.write(data)
        self.written += n
        return n

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:  # DCP asks the stream's position (tell)
        return self._file.seek(pos, whence)

    def fileno(self) -> int:
        return self._file.fileno()

    def close(self) -> None:
        if not self.closed:
            self._file.close()
        super().close()


class _FullDisk:
    """Stands in for the DCP file system under fsdpkit's DigestFileSystem (its `base`): the shard
    files (*.distcp) it creates have `room` bytes each (_FillingFile); everything else is `inner`'s."""

    def __init__(self, inner: Any, *, room: int, on_full: Callable[[str, int], None]):
        self._inner, self._room, self._on_full = inner, room, on_full

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        name = Path(str(path)).name
        if "w" not in mode or not name.endswith(".distcp"):
            with self._inner.create_stream(path, mode) as stream:
                yield stream
            return
        with io.BufferedWriter(_FillingFile(str(path), room=self._room,
                                            on_full=lambda written: self._on_full(name, written))) as stream:
            yield stream

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _shard_enospc(save: ModuleType, fault: dict, marker: Marker, patches: Patches) -> None:
    """The disk fills after `after_bytes` bytes of each shard file of step `step`: the file system
    under fsdpkit's own (DigestFileSystem's `base`, a constructor argument) becomes a _FullDisk."""
    real = save.hashing_writer

    def hashing_writer(into: Any, **kwargs: Any) -> Any:
        writer, fs = real(into, **kwargs)
        step = _step_of(into)
        if step == fault["step"]:
            def full(name: str, written: int) -> None:
                marker.fire("shard_enospc", step=step, rank=_rank(), file=name, bytes_written=written)
            fs.base = _FullDisk(fs.base, room=fault["after_bytes"], on_full=full)
        return writer, fs

    patches.set(save, "hashing_writer", hashing_writer)


# -- the manifest commit: ENOSPC from its fsync or its rename -------------------------------------
class _FailingOs:
    """Stands in for `os` in fsdpkit.checkpoint.storage.local (the module that commits a manifest by
    tmp + fsync + rename): `fsync` of the manifest's temporary file, or its `replace` onto
    manifest.json, fails with ENOSPC when that manifest is step `step`'s. Everything else is `os`."""

    def __init__(self, real: ModuleType, fault: dict, marker: Marker):
        self._os, self._fault, self._marker = real, fault, marker

    def __getattr__(self, name: str) -> Any:
        return getattr(self._os, name)

    def _manifest_step(self, tmp: str) -> int | None:
        from fsdpkit.checkpoint.layout import MANIFEST

        if Path(tmp).name != f".{MANIFEST}.tmp":
            return None
        try:
            return json.loads(Path(tmp).read_text())["step"]
        except (OSError, ValueError, KeyError):
            return None

    def _fail(self, op: str, path: str) -> None:
        self._marker.fire("manifest_enospc", op=op, path=path, step=self._fault["step"], rank=_rank())
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    def fsync(self, fd: int) -> None:
        if self._fault["op"] == "fsync":
            path = self._os.readlink(f"/proc/self/fd/{fd}")
            if self._manifest_step(path) == self._fault["step"]:
                self._fail("fsync", path)
        self._os.fsync(fd)

    def replace(self, src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        if self._fault["op"] == "rename" and self._manifest_step(os.fspath(src)) == self._fault["step"]:
            self._fail("rename", os.fspath(dst))
        self._os.replace(src, dst, *args, **kwargs)


def _manifest_enospc(storage: ModuleType, fault: dict, marker: Marker, patches: Patches) -> None:
    patches.set(storage, "os", _FailingOs(storage.os, fault, marker))


# -- resume: a piece of state left unrestored -----------------------------------------------------
def _skip_restore(manager: ModuleType, fault: dict, marker: Marker, patches: Patches) -> None:
    """Every Checkpointer load leaves the named Stateful pieces (or `rng`) as they are: their
    `load_state_dict` (fsdpkit.checkpoint.state.restore_rng for `rng`) does nothing for the
    duration of the load."""
    real = manager.load_checkpoint

    def load_checkpoint(target: Any, ckpt_dir: Any, **kwargs: Any) -> Any:
        from fsdpkit.checkpoint import resume

        during = Patches()
        for name in fault["names"]:
            def skipped(*_: Any, name: str = name) -> None:
                marker.fire("skip_restore", name=name, ckpt=str(ckpt_dir), rank=_rank())
            if name == "rng":
                during.set(resume, "restore_rng", skipped)
            else:
                during.set(target.stateful[name], "load_state_dict", skipped)
        try:
            return real(target, ckpt_dir, **kwargs)
        finally:
            during.undo()

    patches.set(manager, "load_checkpoint", load_checkpoint)


# -- training: an exception in step N, before its optimizer update --------------------------------
def _raise_at(loop: ModuleType, fault: dict, marker: Marker, patches: Patches) -> None:
    """Trainer.train_step of step `step` on rank `rank` ("*": every rank) raises where the grad
    clipping starts: after forward and backward consumed its batch, before the optimizer update
    (fsdpkit.train.loop calls clip_grad_norm there), as a bug or a bad batch would."""
    real_step = loop.Trainer.train_step

    def train_step(self: Any) -> dict[str, float]:
        step, rank = self.state.step + 1, _rank()
        if step != fault["step"] or not _matches(fault["rank"], rank):
            return real_step(self)

        def clip_grad_norm(*_: Any, **__: Any) -> None:
            marker.fire("raise_at", step=step, rank=rank)
            raise RuntimeError(f"injected failure at step {step} on rank {rank} (tests/faults raise_at)")

        during = Patches()
        during.set(loop, "clip_grad_norm", clip_grad_norm)
        try:
            return real_step(self)
        finally:
            during.undo()

    patches.set(loop.Trainer, "train_step", train_step)


KINDS: dict[str, tuple[str, Callable[[ModuleType, dict, Marker, Patches], None]]] = {
    "kill_mid_write": ("fsdpkit.checkpoint.save", _kill_mid_write),
    "stall_mid_write": ("fsdpkit.checkpoint.save", _stall_mid_write),
    "shard_enospc": ("fsdpkit.checkpoint.save", _shard_enospc),
    "manifest_enospc": ("fsdpkit.checkpoint.storage.local", _manifest_enospc),
    "skip_restore": ("fsdpkit.checkpoint.manager", _skip_restore),
    "raise_at": ("fsdpkit.train.loop", _raise_at),
}


def apply(fault: dict, module: ModuleType, marker: Marker, patches: Patches) -> None:
    KINDS[fault["kind"]][1](module, fault, marker, patches)


@contextmanager
def injected(*faults: dict, marker: str | os.PathLike) -> Iterator[Marker]:
    """Apply `faults` in this process (importing the modules they patch); undone on exit."""
    patches, mark = Patches(), Marker(marker)
    try:
        for fault in faults:
            apply(fault, importlib.import_module(KINDS[fault["kind"]][0]), mark, patches)
        yield mark
    finally:
        patches.undo()


# -- in every process of a launch: patch each module right after its first import -----------------
class _PatchingLoader(importlib.abc.Loader):
    """The module's own loader, then the patches."""

    def __init__(self, loader: Any, then: list[Callable[[ModuleType], None]]):
        self._loader, self._then = loader, then

    def create_module(self, spec: Any) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        for patch in self._then:
            patch(module)

    def __getattr__(self, name: str) -> Any:  # get_source, is_package, resource readers...
        return getattr(self._loader, name)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader the other finders return for a pending module."""

    def __init__(self, pending: dict[str, list[Callable[[ModuleType], None]]]):
        self.pending = pending

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in self.pending:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader, self.pending.pop(fullname))
                return spec
        return None


def install_from_env() -> None:
    """Arm the faults of $FAULTS_SPEC in this process (sitecustomize calls it at start-up)."""
    text = os.environ.get(SPEC_ENV)
    if not text:
        return
    spec = json.loads(text)
    marker, patches = Marker(spec["marker"]), Patches()
    pending: dict[str, list[Callable[[ModuleType], None]]] = {}
    for fault in spec["faults"]:
        module = KINDS[fault["kind"]][0]  # an unknown kind: KeyError, reported by sitecustomize
        pending.setdefault(module, []).append(lambda m, f=fault: apply(f, m, marker, patches))
    for name in [n for n in pending if n in sys.modules]:  # already imported: patch it now
        for patch in pending.pop(name):
            patch(sys.modules[name])
    if pending:
        sys.meta_path.insert(0, _AfterImport(pending))
