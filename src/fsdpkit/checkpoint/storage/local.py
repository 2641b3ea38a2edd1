"""Checkpoints on a local (or mounted) file system: `LocalPath`, the StoragePath of a local path.

A `LocalPath` is a `pathlib.PosixPath` (every pathlib method works, and DCP's own FileSystemWriter
and FileSystemReader take it) with the storage operations of storage/protocol.py:

- `write_atomic`: tmp + fsync + rename + directory fsync (readers see the old content or the new);
- `move_to`: one rename (atomic), then the directory fsync;
- `replace_with`: the committed replacement renamed into place, the predecessor set aside first and
  deleted after;
- `lock`: an exclusive flock on `<root>/.lock`, released by the kernel when the process dies.

The commit's writes go through this module's `os` (tests put a full disk there: tests/faults).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import socket
import tempfile
import time
from pathlib import PosixPath
from typing import TYPE_CHECKING, Any

from fsdpkit.checkpoint.errors import CheckpointError
from fsdpkit.fileio import pread_into
from fsdpkit.tunables import DEFAULTS

if TYPE_CHECKING:
    from fsdpkit.checkpoint.hashing import DigestFileSystem
    from fsdpkit.checkpoint.settings import IOSettings
    from fsdpkit.checkpoint.storage.mirror import Mirror
    from fsdpkit.checkpoint.storage.protocol import SequentialRead, StoragePath

log = logging.getLogger("fsdpkit.checkpoint")
LOCK = ".lock"
REPLACED = ".replaced"  # a committed checkpoint being replaced (replace_with), beside its successor


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a local file, or a directory (its entries: a rename or a new file in it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalPath(PosixPath):
    """A local file or directory where checkpoints live (see the module docstring)."""

    checks_items = True  # a re-read costs no request: a save records item checksums, a load checks them

    def local_path(self) -> LocalPath:
        return self

    def write_atomic(self, data: str | bytes) -> None:
        tmp = self.with_name(f".{self.name}.tmp")
        try:
            with tmp.open("wb" if isinstance(data, bytes) else "w") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self)
        except BaseException:
            tmp.unlink(missing_ok=True)  # e.g. ENOSPC: leave no half-written temporary behind
            raise
        fsync_path(self.parent)

    def remove_tree(self, *, first: str | None = None) -> None:
        if first is not None:
            (self / first).unlink(missing_ok=True)
        shutil.rmtree(self, ignore_errors=True)

    def move_to(self, dst: StoragePath, *, last: str | None = None) -> None:
        os.rename(self, dst)  # to another local path only (a RemotePath is no os.PathLike)
        fsync_path(dst.parent)

    def replace_with(self, incoming: StoragePath, *, marker: str) -> None:
        replaced = self.with_name(self.name + REPLACED)
        if self.exists():
            if replaced.exists():
                replaced.remove_tree()  # the predecessor of an earlier replacement that was interrupted
            self.move_to(replaced)
        incoming.move_to(self, last=marker)
        replaced.remove_tree()

    def fsync(self) -> None:
        fsync_path(self)

    def open_sequential(self, io: IOSettings) -> SequentialRead:
        from fsdpkit.checkpoint.io.page_cache import SequentialReader

        return SequentialReader(self, restart_bytes=io.read_restart_bytes)

    def open_ranges(self, io: IOSettings | None = None) -> LocalRanges:
        return LocalRanges(self)

    def lock(self, io: IOSettings) -> DirectoryLock:
        return DirectoryLock(self, wait_s=io.lock_wait_s)

    def check_writable(self, *, setting: str) -> None:
        if self.exists() and not self.is_dir():
            raise ValueError(f"{setting}={self} is an existing file, not a directory; choose another {setting} "
                             "(fsdpkit never replaces a file it did not write)")
        try:
            self.mkdir(parents=True, exist_ok=True)
            fd, probe = tempfile.mkstemp(prefix=".fsdpkit-write-test-", dir=self)
            try:
                os.write(fd, b"ok")
                os.fsync(fd)
            finally:
                os.close(fd)
                os.unlink(probe)
        except OSError as e:
            where = f" ({e.filename})" if e.filename and str(e.filename) != str(self) else ""
            raise ValueError(f"{setting}={self} cannot be written: {e.strerror or e}{where}. Point {setting} at a "
                             "writable directory (a read-only mount, a missing permission or a file in the path "
                             "stops every save)") from None

    def dcp_writer(self, *, thread_count: int, io: IOSettings,
                   mirror: Mirror | None = None) -> tuple[Any, DigestFileSystem]:
        from torch.distributed.checkpoint import FileSystemWriter

        from fsdpkit.checkpoint.hashing import DigestFileSystem

        fs = DigestFileSystem()
        # a plain pathlib path: DCP pickles it into `.metadata`, whose readers accept pathlib's types only
        writer = FileSystemWriter(PosixPath(self), sync_files=True, thread_count=thread_count)
        writer.fs = fs
        return writer, fs

    def dcp_reader(self, *, io: IOSettings, files: dict[str, Any] | None = None, covered: Any = ()) -> Any:
        if files is not None:
            from fsdpkit.checkpoint.io.checked_read import CheckedFileSystemReader

            return CheckedFileSystemReader(self, files=files, covered=covered, restart_bytes=io.read_restart_bytes)
        from fsdpkit.checkpoint.safe_io import SafeFileSystemReader

        return SafeFileSystemReader(self)


class LocalRanges:
    """A local file open for positional reads (storage.protocol.RangeReader)."""

    noun = "file"

    def __init__(self, path: str | os.PathLike) -> None:
        self._fd: int | None = os.open(path, os.O_RDONLY)

    def read_into(self, view: memoryview, offset: int) -> int:
        assert self._fd is not None, "read after close"
        return pread_into(self._fd, view, offset)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> LocalRanges:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class DirectoryLock:
    """An exclusive flock on `<root>/.lock`, held for a run's life by its rank 0."""

    def __init__(self, root: str | os.PathLike, *, wait_s: float = DEFAULTS.lock_wait_s):
        """`wait_s`: how long `acquire` waits by default for another holder to go (a just-killed
        predecessor still exiting; IOSettings.lock_wait_s)."""
        self.root, self.wait_s, self._fd = LocalPath(root), wait_s, None

    def acquire(self, *, wait_s: float | None = None) -> DirectoryLock:
        """Raises CheckpointError when another live process holds the lock after `wait_s` (default:
        the constructor's)."""
        path = self.root / LOCK
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + (self.wait_s if wait_s is None else wait_s)
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "unknown"
                    os.close(fd)
                    raise CheckpointError(
                        f"checkpoint.dir={self.root} is in use by another run ({holder}): two runs must never write "
                        "into one checkpoint directory. Wait for it to end, stop it, or set checkpoint.dir (or "
                        "run_dir) to another directory") from None
                time.sleep(0.2)
            except OSError as e:  # a filesystem without flock: say so and go on unprotected
                log.warning("cannot lock %s (%s): nothing stops a second run from using this directory", path, e)
                os.close(fd)
                return self
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock
            self._fd = None
