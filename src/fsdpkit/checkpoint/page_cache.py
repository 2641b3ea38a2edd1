"""Checkpoint files written and read through the page cache in pieces the kernel handles cheaply.

The kernel builds large page-cache folios where a program moves big pieces: a 16 MiB write(), or
a long sequential read, whose readahead grows its folios window after window. On a VM that hands
free memory back to its host (virtio-balloon free page reporting; measured on a Firecracker VM with
2 vCPUs), the large free blocks those folios come from have gone back to the host after a few idle
seconds, and every page of them costs a host fault when the kernel first copies into or out of it.
There, 2 processes each writing a new 541 MB file and fsyncing it took 1.5-2.0 s in 16 MiB write
calls (2.1-2.9 s of kernel CPU) and 0.59-0.65 s in 256 KiB calls (0.3 s); reading those files after
evicting them, 1.0-1.6 s in 16 MiB reads through one descriptor (1.1-2.0 s of kernel CPU) and
0.50-0.67 s through a descriptor opened anew every 16 MiB (0.2 s), which starts the readahead
afresh (DCP's own reader, seeking between the parts of each item, does so by accident). Medians
of 4-6, each after 3 idle seconds. Where memory stays with the guest both should cost little, a
few thousand more system calls per GiB and one readahead restart per 16 MiB (not measured here:
no such machine was available).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from fsdpkit import tunables

# Checkpoint data goes to the page cache in write calls of at most FSDPKIT_WRITE_PIECE_BYTES (256 KiB;
# 0: as given), and a file read from start to end gets a new descriptor every
# FSDPKIT_READ_RESTART_BYTES (16 MiB; 0: never): fsdpkit.tunables.


def write_in_pieces(write: Callable[[memoryview], int | None], data: memoryview) -> int:
    """`write(piece)` for each FSDPKIT_WRITE_PIECE_BYTES piece of `data` (bytes); the bytes
    written, stopping at the first short write. A None from `write` counts as the whole piece
    written (a buffered file's write)."""
    piece_bytes = tunables.current().write_piece_bytes
    step = piece_bytes if piece_bytes > 0 else max(len(data), 1)
    done = 0
    while done < len(data):
        piece = data[done : done + step]
        n = write(piece)
        n = len(piece) if n is None else n
        done += n
        if n < len(piece):
            break
    return done


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
    every FSDPKIT_READ_RESTART_BYTES by a new one on the same file (`reopen`). Where that is not possible
    (no /proc), one descriptor reads it all."""

    def __init__(self, path: str | os.PathLike) -> None:
        self._fd = os.open(path, os.O_RDONLY)
        self._pos = 0
        self._since = 0  # bytes read through the current descriptor
        self._restart = tunables.current().read_restart_bytes

    def readinto(self, view: Any) -> int:
        """Up to len(view) bytes into `view`; 0 at the end of the file."""
        buffer = memoryview(view).cast("B")
        if self._restart > 0 and self._since >= self._restart:
            self._reopen()
        if self._restart > 0:
            buffer = buffer[: self._restart - self._since]
        n = os.preadv(self._fd, [buffer], self._pos)
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
