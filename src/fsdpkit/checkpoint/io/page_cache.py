"""Checkpoint files read from start to end through the page cache, in pieces the kernel handles cheaply.

The kernel builds large page-cache folios for a long sequential read, whose readahead grows its
window after window. On a VM that hands free memory back to its host (virtio-balloon free page
reporting; measured on a Firecracker VM with 2 vCPUs), the large free blocks those folios come from
have gone back to the host after a few idle seconds, and every page of them costs a host fault when
the kernel first copies into it. There, reading 2 files of 541 MB after evicting them took 1.0-1.6 s
in 16 MiB reads through one descriptor (1.1-2.0 s of kernel CPU) and 0.50-0.67 s through a
descriptor opened anew every 16 MiB (0.2 s), which starts the readahead afresh (DCP's own reader,
seeking between the parts of each item, does so by accident). Medians of 4-6, each after 3 idle
seconds. Used by file_checksum (hashing.py): every file checksum verified, before a load or by
`fsdpkit ckpt verify`, is read through it.
"""

from __future__ import annotations

import os
from typing import Any

from fsdpkit.fileio import pread_into

# A file read from start to end gets a new descriptor every IOSettings.read_restart_bytes
# (FSDPKIT_READ_RESTART_BYTES, 16 MiB; 0: never): checkpoint/settings.py.


def reopen(fd: int) -> int | None:
    """A new read-only descriptor on the file `fd` is open on (a readahead of its own), through
    /proc/self/fd: the same inode even if its path was replaced meanwhile. None without /proc
    (macOS) or should it name another file."""
    try:
        new = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY)
    except OSError:
        return None
    a, b = os.fstat(fd), os.fstat(new)
    if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino):
        os.close(new)
        return None
    return new


class SequentialReader:
    """A local file read from its start to its end (`readinto`), through a descriptor replaced
    every `restart_bytes` by a new one on the same file (`reopen`; 0: never; default: the
    environment's IOSettings.read_restart_bytes). Where that is not possible (no /proc), one
    descriptor reads it all."""

    def __init__(self, path: str | os.PathLike, *, restart_bytes: int | None = None) -> None:
        if restart_bytes is None:
            from fsdpkit.checkpoint.settings import IOSettings

            restart_bytes = IOSettings.from_environment().read_restart_bytes
        self._fd = os.open(path, os.O_RDONLY)
        self._pos = 0
        self._since = 0  # bytes read through the current descriptor
        self._restart = restart_bytes

    def readinto(self, view: Any) -> int:
        """Up to len(view) bytes into `view`; 0 at the end of the file."""
        buffer = memoryview(view).cast("B")
        if self._restart > 0 and self._since >= self._restart:
            self._reopen()
        if self._restart > 0:
            buffer = buffer[: self._restart - self._since]
        n = pread_into(self._fd, buffer, self._pos)
        self._pos += n
        self._since += n
        return n

    def _reopen(self) -> None:
        fd = reopen(self._fd)
        if fd is None:  # one descriptor from here on
            self._restart = 0
            return
        os.close(self._fd)
        self._fd, self._since = fd, 0

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> SequentialReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
