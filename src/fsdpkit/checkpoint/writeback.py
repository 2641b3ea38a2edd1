"""Start a file's write-back to disk while it is being written, so that the fsync ending it waits
for little (the disk writes while the rest is produced)."""

from __future__ import annotations

import os


class WriteBack:
    """Tell it how far `fd` is written (`written_to(end)`, bytes from the file's start); every
    `every` bytes it starts the write-back of what was written since (posix_fadvise DONTNEED:
    starts writing the dirty pages without waiting and drops them once clean; it never drops
    unwritten data). Nothing happens with `every` <= 0, no descriptor, no posix_fadvise (macOS),
    or once the file refused the advice: the closing fsync then writes it all."""

    def __init__(self, fd: int | None, every: int) -> None:
        self._fd = fd if fd is not None and every > 0 and hasattr(os, "posix_fadvise") else None
        self._every = every
        self._started = 0  # bytes whose write-back was started

    def written_to(self, end: int) -> None:
        if self._fd is None or end - self._started < self._every:
            return
        try:
            os.posix_fadvise(self._fd, self._started, end - self._started, os.POSIX_FADV_DONTNEED)
        except OSError:  # a file system or file type that takes no advice
            self._fd = None
        self._started = end
