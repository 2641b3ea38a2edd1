"""Positional reads of local files: the one `preadv` loop of fsdpkit.

A positional read (pread) neither uses nor moves the file's own position, so several threads may
read one descriptor at once. The kernel may return fewer bytes than asked (a signal, a large read
split by the file system); `pread_into` loops until the view is full or the file ends.
"""

from __future__ import annotations

import os

__all__ = ["pread_into"]


def pread_into(fd: int, view: memoryview, offset: int) -> int:
    """Read `len(view)` bytes of the file open on `fd`, starting at byte `offset`, into `view`.

    Args:
        fd: a descriptor open for reading (its file position is not used or moved).
        view: a writable byte view (`memoryview(...).cast("B")` of a buffer) to fill.
        offset: where in the file the read starts.

    Returns:
        How many bytes were read: `len(view)`, or fewer where the file ends first.

    Raises:
        OSError: as `os.preadv` does.
    """
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            break
        done += n
    return done
