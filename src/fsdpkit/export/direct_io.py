"""Reads and writes that bypass the page cache (O_DIRECT), for export's one-pass streams.

Export reads every checkpoint byte once and writes every output byte once: the page cache only
costs it. Through the cache, the kernel copies each byte twice and later reclaims the pages, and on
a small machine that kernel CPU is the bottleneck (2-core VM, 2 GiB: `dd` copies in 9.4 s buffered,
8.8 s of it kernel CPU, and in 1.7-3.5 s with O_DIRECT, 0.2 s of kernel CPU). O_DIRECT moves bytes between
the device and our buffers directly, but offsets, lengths and buffer addresses must be multiples of
the device's block size: reads go through a page-aligned bounce buffer, writes through a page-aligned
staging buffer, and the last partial block of a file is written through an ordinary descriptor.

Where O_DIRECT is missing (macOS, tmpfs, some network file systems) or refused at the first read or
write, the same calls fall back to ordinary I/O, in the pieces fsdpkit.checkpoint.page_cache
describes (reads through a descriptor of their own, writes in 256 KiB calls: 2 GiB exported in
2.3-3.5 s instead of 3.5-5.4 s on the benchmark VM). FSDPKIT_EXPORT_DIRECT_IO=0 turns O_DIRECT off.
"""

from __future__ import annotations

import errno
import mmap
import os
import queue
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from fsdpkit.checkpoint import page_cache
from fsdpkit.checkpoint.page_cache import reopen
from fsdpkit.checkpoint.writeback import WriteBack
from fsdpkit.export.tunables import WRITE_THREADS

ALIGN = 4096
"""Offsets, lengths and buffers of O_DIRECT I/O are multiples of this (the page size; every common
device's logical block size divides it)."""

ENABLED = hasattr(os, "O_DIRECT") and os.environ.get("FSDPKIT_EXPORT_DIRECT_IO", "1") != "0"


def _round_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def aligned_buffer(nbytes: int) -> torch.Tensor:
    """A page-aligned uint8 tensor of at least `nbytes` (anonymous mmap memory)."""
    return torch.frombuffer(mmap.mmap(-1, max(ALIGN, _round_up(nbytes))), dtype=torch.uint8)


def open_direct(path: os.PathLike | str, flags: int) -> int | None:
    """`os.open` with O_DIRECT, or None where it is off or the file system refuses it."""
    if not ENABLED:
        return None
    try:
        return os.open(path, flags | os.O_DIRECT, 0o644)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return None
        raise


def _refused(exc: OSError) -> bool:
    return exc.errno in (errno.EINVAL, errno.EOPNOTSUPP)


_local = threading.local()


def _bounce(nbytes: int) -> torch.Tensor:
    """This thread's bounce buffer for O_DIRECT reads (one per thread, whatever the number of files)."""
    bounce = getattr(_local, "bounce", None)
    if bounce is None or bounce.numel() < nbytes:
        bounce = _local.bounce = aligned_buffer(nbytes)
    return bounce


class DirectReader:
    """Byte ranges of one file read into caller tensors; O_DIRECT (unless not `direct`) through a
    bounce buffer per thread (`bounce_bytes` at most are read per call)."""

    def __init__(self, path: os.PathLike | str, fd: int, *, bounce_bytes: int, direct: bool = True) -> None:
        self._fd = fd  # the caller's ordinary descriptor: the fallback, closed by the caller
        self._direct = open_direct(path, os.O_RDONLY) if direct else None
        self._bounce_bytes = _round_up(bounce_bytes) + ALIGN

    def close(self) -> None:
        if self._direct is not None:
            os.close(self._direct)
            self._direct = None

    def pread_into(self, out: torch.Tensor, offset: int) -> int:
        """Read `out.nbytes` bytes at `offset` into contiguous `out`; returns how many the file had
        (fewer at its end). Without O_DIRECT, through a descriptor of its own (a readahead of its
        own: fsdpkit.checkpoint.page_cache)."""
        dst = out.reshape(-1).view(torch.uint8)
        fresh = reopen(self._fd) if self._direct is None else None
        done = 0
        try:
            while done < dst.numel():
                if self._direct is None:
                    n = os.preadv(self._fd if fresh is None else fresh, [dst[done:].numpy()], offset + done)
                else:
                    n = self._direct_piece(dst[done:], offset + done)
                if n == 0:
                    break
                done += n
        finally:
            if fresh is not None:
                os.close(fresh)
        return done

    def _direct_piece(self, dst: torch.Tensor, offset: int) -> int:
        bounce = _bounce(self._bounce_bytes)
        start = offset - offset % ALIGN
        skip = offset - start
        want = min(dst.numel(), bounce.numel() - skip)
        try:
            got = os.preadv(self._direct, [bounce[: _round_up(skip + want)].numpy()], start)
        except OSError as exc:
            if not _refused(exc):
                raise
            self.close()  # refused by this file system: ordinary reads from now on
            return os.preadv(self._fd, [dst.numpy()], offset)
        n = max(0, min(want, got - skip))
        dst[:n].copy_(bounce[skip : skip + n])
        return n


class DirectWriter:
    """Appends bytes to a new file: whole aligned blocks with O_DIRECT from staging buffers, written
    by `writers` threads while the caller fills the next buffer (an O_DIRECT write returns only once
    the device has the bytes: written inline, it would stall the caller for every block), the last
    partial block through an ordinary descriptor. `close()` waits for the writes and fsyncs.
    Without O_DIRECT, the disk write-back of ordinary writes is started every `flush_bytes` (0: all
    in the final fsync)."""

    def __init__(self, path: os.PathLike | str, *, buffer_bytes: int, flush_bytes: int = 0, writers: int = WRITE_THREADS) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._direct = open_direct(path, os.O_WRONLY)
        self._free: queue.SimpleQueue[torch.Tensor] = queue.SimpleQueue()
        self._pending: deque[Future] = deque()
        self._pool: ThreadPoolExecutor | None = None
        self._buffer: torch.Tensor | None = None
        if self._direct is not None:
            for _ in range(writers + 1):  # one filled by the caller while `writers` are written
                self._free.put(aligned_buffer(buffer_bytes))
            self._buffer = self._free.get()
            self._pool = ThreadPoolExecutor(max_workers=writers, thread_name_prefix="fsdpkit-direct-write")
        self._refused = False  # O_DIRECT refused on the way: the blocks after it are written ordinarily
        self._filled = 0  # bytes staged in the buffer, which starts at file offset self._position
        self._position = 0
        self._writeback = WriteBack(self._fd, flush_bytes)  # ordinary writes
        self.written = 0  # bytes handed to write()

    def write(self, data: torch.Tensor) -> None:
        """Append a contiguous uint8 tensor's bytes."""
        self.written += data.numel()
        if self._buffer is None:  # no O_DIRECT here
            self._write_ordinary(data.numpy())
            return
        done = 0
        while done < data.numel():
            n = min(data.numel() - done, self._buffer.numel() - self._filled)
            self._buffer[self._filled : self._filled + n].copy_(data[done : done + n])
            self._filled += n
            done += n
            if self._filled == self._buffer.numel():
                self._submit(self._filled)
                self._buffer, self._filled = self._take(), 0

    def _submit(self, nbytes: int) -> None:
        """Hand the first `nbytes` (a multiple of ALIGN) of the buffer to a writer thread."""
        self._pending.append(self._pool.submit(self._write_block, self._buffer, nbytes, self._position))
        self._position += nbytes

    def _write_block(self, buffer: torch.Tensor, nbytes: int, offset: int) -> None:
        view = buffer[:nbytes].numpy()
        try:
            if not self._refused:
                try:
                    pwrite_all(self._direct, view, offset)
                    return
                except OSError as exc:
                    if not _refused(exc):
                        raise
                    self._refused = True  # this file system takes no O_DIRECT writes: the same bytes, ordinarily
            pwrite_all(self._fd, view, offset, piece=page_cache.WRITE_PIECE_BYTES)
        finally:
            self._free.put(buffer)

    def _take(self) -> torch.Tensor:
        """A free buffer (waiting for the oldest write if none is); raises a write's error."""
        while self._pending and (self._pending[0].done() or self._free.empty()):
            self._pending.popleft().result()
        return self._free.get()

    def _write_ordinary(self, view) -> None:
        pwrite_all(self._fd, view, self._position, piece=page_cache.WRITE_PIECE_BYTES)
        self._position += len(view)
        self._writeback.written_to(self._position)  # the final fsync then has little left to do

    def close(self) -> None:
        """Write what is staged, wait for every write, fsync and close."""
        try:
            if self._buffer is not None:
                whole = self._filled - self._filled % ALIGN
                tail = self._buffer[whole : self._filled].clone()
                if whole:
                    self._submit(whole)
                while self._pending:
                    self._pending.popleft().result()
                if tail.numel():
                    self._write_ordinary(tail.numpy())
            os.fsync(self._fd)
        finally:
            self.abort()

    def abort(self) -> None:
        """Close without writing what is staged (the caller is failing and removes the file)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)  # no write may land after its file is closed
            self._pool = None
        for fd in (self._direct, self._fd):
            if fd is not None:
                os.close(fd)
        self._direct = self._fd = None
        self._buffer = None
        self._pending.clear()


def pwrite_all(fd: int, view, offset: int, *, piece: int = 0) -> None:
    """All of `view` at `offset`, in pwrite calls of `piece` bytes at most (0: as few as the OS takes)."""
    view = memoryview(view).cast("B")
    while view:
        n = os.pwrite(fd, view[:piece] if piece > 0 else view, offset)
        view, offset = view[n:], offset + n
