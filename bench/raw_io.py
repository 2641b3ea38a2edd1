"""The benchmarks' own raw writes, the disk's ceilings they compare fsdpkit against: plain writes
in 256 KiB calls, writes that start their write-back as they go, and O_DIRECT writes from an
aligned buffer. fsdpkit itself writes checkpoints through DCP's own writer (its write fast paths
were removed: bench/RESULTS-io.md); these stay here as ways of measuring the disk, not the library."""

from __future__ import annotations

import errno
import mmap
import os
from collections.abc import Callable, Iterable

import torch

ALIGN = 4096  # offsets, lengths and buffers of O_DIRECT I/O are multiples of this
WRITE_PIECE_BYTES = 256 << 10  # os.write calls of at most this size (cheap for the kernel on a ballooning VM)
WRITEBACK_BYTES = 64 << 20  # the write-back of this many bytes is started as the writing goes on
DIRECT_BUFFER_BYTES = 8 << 20


def write_in_pieces(write: Callable[[memoryview], int | None], data: memoryview, piece: int = WRITE_PIECE_BYTES) -> int:
    """`write(part)` for each `piece` bytes of `data` (0: all at once); the bytes written, stopping
    at the first short write."""
    step = piece if piece > 0 else max(len(data), 1)
    done = 0
    while done < len(data):
        part = data[done : done + step]
        n = write(part)
        n = len(part) if n is None else n
        done += n
        if n < len(part):
            break
    return done


def pwrite_all(fd: int, view, offset: int, *, piece: int = 0) -> None:
    """All of `view` at `offset`, in pwrite calls of `piece` bytes at most (0: as few as the OS takes)."""
    view = memoryview(view).cast("B")
    while view:
        n = os.pwrite(fd, view[:piece] if piece > 0 else view, offset)
        view, offset = view[n:], offset + n


class WriteBack:
    """Starts the write-back of every `every` bytes written to `fd` (posix_fadvise DONTNEED, which
    never drops unwritten data); nothing with `every` <= 0, no posix_fadvise, or once refused."""

    def __init__(self, fd: int, every: int) -> None:
        self._fd = fd if every > 0 and hasattr(os, "posix_fadvise") else None
        self._every, self._started = every, 0

    def written_to(self, end: int) -> None:
        if self._fd is None or end - self._started < self._every:
            return
        try:
            os.posix_fadvise(self._fd, self._started, end - self._started, os.POSIX_FADV_DONTNEED)
        except OSError:
            self._fd = None
        self._started = end


def aligned_buffer(nbytes: int) -> torch.Tensor:
    """A page-aligned uint8 tensor of at least `nbytes` (anonymous mmap memory)."""
    return torch.frombuffer(mmap.mmap(-1, max(ALIGN, -(-nbytes // ALIGN) * ALIGN)), dtype=torch.uint8)


def open_direct(path, flags: int) -> int | None:
    """`os.open` with O_DIRECT, or None where the platform or the file system has none."""
    if not hasattr(os, "O_DIRECT"):
        return None
    try:
        return os.open(path, flags | os.O_DIRECT, 0o644)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return None
        raise


def write_direct(path, chunks: Iterable[torch.Tensor], *, buffer_bytes: int = DIRECT_BUFFER_BYTES) -> None:
    """A new file of `chunks` (contiguous uint8 tensors): whole aligned blocks with O_DIRECT from one
    reused aligned buffer, the last partial block through an ordinary descriptor, then fsync."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    direct = open_direct(path, os.O_WRONLY)
    if direct is None:
        os.close(fd)
        raise OSError(errno.EINVAL, f"{path}: this file system takes no O_DIRECT")
    buf, filled, position = aligned_buffer(buffer_bytes), 0, 0
    try:
        for chunk in chunks:
            src, done = chunk.reshape(-1), 0
            while done < src.numel():
                n = min(src.numel() - done, buf.numel() - filled)
                buf[filled : filled + n].copy_(src[done : done + n])
                filled, done = filled + n, done + n
                if filled == buf.numel():
                    pwrite_all(direct, buf.numpy(), position)
                    position, filled = position + filled, 0
        whole = filled - filled % ALIGN
        if whole:
            pwrite_all(direct, buf[:whole].numpy(), position)
        pwrite_all(fd, buf[whole:filled].numpy(), position + whole)
        os.fsync(fd)
    finally:
        os.close(direct)
        os.close(fd)
