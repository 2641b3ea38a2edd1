"""Reads and writes that bypass the page cache (O_DIRECT): checkpoint files as a save writes them,
and export's one-pass streams.

A checkpoint save writes every byte once and nobody reads it back soon; an export reads every
checkpoint byte once and writes every output byte once. The page cache only costs them: the kernel
copies each byte into fresh page-cache pages and later reclaims them, and on a VM that hands free
memory back to its host every fresh page also costs a host fault (fsdpkit.checkpoint.page_cache).
Two processes each writing 512 MiB and fsyncing it took 0.42-1.5 s through the page cache (0.9 s of
kernel CPU each) and 0.39-0.49 s with O_DIRECT from reused buffers (0.1 s of CPU) on the 2-core
benchmark VM; a 2 GiB `dd` copy took 9.4 s buffered, 8.8 s of it kernel CPU, and 1.7-3.5 s with
O_DIRECT. O_DIRECT moves bytes between the device and our buffers directly, but offsets, lengths and
buffer addresses must be multiples of the device's block size: reads go through a page-aligned
bounce buffer, writes through page-aligned staging buffers (kept for reuse: `_BufferPool`), and the
last partial block of a file is written through an ordinary descriptor.

Where O_DIRECT is missing (macOS, tmpfs, some network file systems) or refused at the first read or
write, the same calls fall back to ordinary I/O, in the pieces fsdpkit.checkpoint.page_cache
describes (reads through a descriptor of their own, writes in 256 KiB calls). FSDPKIT_DIRECT_IO=0
turns O_DIRECT off everywhere (FSDPKIT_EXPORT_DIRECT_IO=0 for export only; fsdpkit.tunables).
"""

from __future__ import annotations

import errno
import mmap
import os
import queue
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from fsdpkit import tunables
from fsdpkit.checkpoint.page_cache import reopen
from fsdpkit.checkpoint.writeback import WriteBack

ALIGN = 4096
"""Offsets, lengths and buffers of O_DIRECT I/O are multiples of this (the page size; every common
device's logical block size divides it)."""



def enabled() -> bool:
    """Whether O_DIRECT is tried at all: the platform has it and FSDPKIT_DIRECT_IO is not 0."""
    return hasattr(os, "O_DIRECT") and tunables.current().direct_io


try:
    from fsdpkit.checkpoint._rowhash import stream_copy as _copy
except ImportError:  # built without a C compiler, or a build older than stream_copy
    _copy = np.copyto


def _round_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def aligned_buffer(nbytes: int) -> torch.Tensor:
    """A page-aligned uint8 tensor of at least `nbytes` (anonymous mmap memory)."""
    return torch.frombuffer(mmap.mmap(-1, max(ALIGN, _round_up(nbytes))), dtype=torch.uint8)


class _BufferPool:
    """Page-aligned write buffers kept for the next file instead of freed: fresh anonymous memory
    costs a page fault per page (a host fault on the benchmark VM), reused memory costs nothing.
    Keeps `keep_bytes` at most (None: FSDPKIT_DIRECT_KEEP_BYTES); a buffer given back beyond that is freed."""

    def __init__(self, keep_bytes: int | None = None) -> None:
        self._keep = keep_bytes
        self._kept: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        nbytes = max(ALIGN, _round_up(nbytes))
        with self._lock:
            for i, buf in enumerate(self._kept):
                if buf.numel() == nbytes:
                    return self._kept.pop(i)
        return aligned_buffer(nbytes)

    def give(self, buf: torch.Tensor) -> None:
        with self._lock:
            keep = tunables.current().direct_keep_bytes if self._keep is None else self._keep
            if sum(b.numel() for b in self._kept) + buf.numel() <= keep:
                self._kept.append(buf)


BUFFERS = _BufferPool()
"""The process's O_DIRECT write buffers between files (FSDPKIT_DIRECT_KEEP_BYTES, default 64 MiB
at most stay allocated)."""


def open_direct(path: os.PathLike | str, flags: int) -> int | None:
    """`os.open` with O_DIRECT, or None where it is off or the file system refuses it."""
    if not enabled():
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
    """Appends bytes to a file from its start: whole aligned blocks with O_DIRECT from staging
    buffers, written by `writers` threads while the caller fills the next buffer (an O_DIRECT write
    returns only once the device has the bytes: written inline, it would stall the caller for every
    block), the last partial block through an ordinary descriptor. `finish()` writes what is staged
    and waits for the writes (later bytes go through the ordinary descriptor); `close()` finishes,
    fsyncs and closes. Without O_DIRECT (or not `direct`), ordinary writes, whose disk write-back is
    started every `flush_bytes` (0: all in the final fsync).

    The file is `path`, created (or truncated) here, unless `fd` is given: an ordinary descriptor
    the caller opened on `path` for writing, an empty file, which the caller keeps and closes.

    Bytes are copied into the staging buffers with non-temporal stores where the C extension is
    built (`_rowhash.stream_copy`): the buffers go to the device, not to the CPU, so their lines are
    neither read into the cache before being overwritten nor kept there.

    `digest` (e.g. an xxhash object), if given, is updated with every byte written, in order, a
    piece of at most DIGEST_PIECE_BYTES at a time, each hashed from the caller's memory right before
    it is copied: the copy then reads it from the cache, so hashing adds no second read from memory."""

    DIGEST_PIECE_BYTES = 1 << 20

    def __init__(self, path: os.PathLike | str, *, buffer_bytes: int, writers: int, flush_bytes: int = 0,
                 direct: bool = True, fd: int | None = None, digest=None) -> None:
        self._digest = digest
        self._owns_fd = fd is None
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) if fd is None else fd
        self._direct = _open_same(path, self._fd) if direct else None
        self._free: queue.SimpleQueue[torch.Tensor] = queue.SimpleQueue()
        self._pending: deque[Future] = deque()
        self._pool: ThreadPoolExecutor | None = None
        self._buffer: torch.Tensor | None = None
        self._buffers: list[torch.Tensor] = []  # every staging buffer, given back to BUFFERS at the end
        if self._direct is not None:
            # one filled while `writers` are written
            self._buffers = [BUFFERS.take(buffer_bytes) for _ in range(writers + 1)]
            for buf in self._buffers[1:]:
                self._free.put(buf)
            self._buffer = self._buffers[0]
            self._pool = ThreadPoolExecutor(max_workers=writers, thread_name_prefix="fsdpkit-direct-write")
        self._refused = False  # O_DIRECT refused on the way: the blocks after it are written ordinarily
        self._filled = 0  # bytes staged in the buffer, which starts at file offset self._position
        self._position = 0
        self._writeback = WriteBack(self._fd, flush_bytes)  # ordinary writes
        self.written = 0  # bytes handed to write()

    @property
    def direct(self) -> bool:
        """Whether bytes still go through O_DIRECT (not after `finish`, nor where it is off)."""
        return self._buffer is not None

    def write(self, data: torch.Tensor | memoryview | bytes) -> None:
        """Append the bytes of a contiguous uint8 tensor or of a bytes-like object."""
        src = data.numpy() if isinstance(data, torch.Tensor) else np.frombuffer(data, dtype=np.uint8)
        self.written += src.size
        if self._buffer is None:  # no O_DIRECT here, or finished
            if self._digest is not None:
                self._digest.update(src)
            self._write_ordinary(src)
            return
        piece = self.DIGEST_PIECE_BYTES if self._digest is not None else src.size
        done = 0
        while done < src.size:
            n = min(src.size - done, self._buffer.numel() - self._filled, piece)
            part = src[done : done + n]
            if self._digest is not None:
                self._digest.update(part)
            _copy(self._buffer.numpy()[self._filled : self._filled + n], part)  # releases the GIL, as xxhash does
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
            pwrite_all(self._fd, view, offset, piece=tunables.current().write_piece_bytes)
        finally:
            self._free.put(buffer)

    def _take(self) -> torch.Tensor:
        """A free buffer (waiting for the oldest write if none is); raises a write's error."""
        while self._pending and (self._pending[0].done() or self._free.empty()):
            self._pending.popleft().result()
        return self._free.get()

    def _write_ordinary(self, view) -> None:
        pwrite_all(self._fd, view, self._position, piece=tunables.current().write_piece_bytes)
        self._position += len(view)
        self._writeback.written_to(self._position)  # the final fsync then has little left to do

    def finish(self) -> None:
        """Write what is staged and wait for every write (raising the first write's error); bytes
        written after this go through the ordinary descriptor."""
        if self._buffer is None:
            return
        whole = self._filled - self._filled % ALIGN
        tail = self._buffer[whole : self._filled].numpy().copy()
        if whole:
            self._submit(whole)
        self._buffer = None
        while self._pending:
            self._pending.popleft().result()
        if tail.size:
            self._write_ordinary(tail)
        self._release()

    def close(self, *, fsync: bool = True) -> None:
        """Finish, fsync (unless not `fsync`: the caller did) and close."""
        try:
            self.finish()
            if fsync:
                os.fsync(self._fd)
        finally:
            self.abort()

    def abort(self) -> None:
        """Close without writing what is staged (the caller is failing and removes the file)."""
        self._buffer = None
        self._release()
        fds = (self._direct, self._fd) if self._owns_fd else (self._direct,)
        for fd in fds:
            if fd is not None:
                os.close(fd)
        self._direct = self._fd = None

    def _release(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)  # no write may land after its file is closed or its buffer reused
            self._pool = None
        self._pending.clear()
        for buf in self._buffers:
            BUFFERS.give(buf)
        self._buffers = []


def _open_same(path: os.PathLike | str, fd: int) -> int | None:
    """An O_DIRECT write descriptor on the file `fd` is open on, found at `path` (None where
    O_DIRECT is off or refused, or `path` now names another file)."""
    direct = open_direct(path, os.O_WRONLY)
    if direct is not None:
        a, b = os.fstat(fd), os.fstat(direct)
        if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino):
            os.close(direct)
            return None
    return direct


def pwrite_all(fd: int, view, offset: int, *, piece: int = 0) -> None:
    """All of `view` at `offset`, in pwrite calls of `piece` bytes at most (0: as few as the OS takes)."""
    view = memoryview(view).cast("B")
    while view:
        n = os.pwrite(fd, view[:piece] if piece > 0 else view, offset)
        view, offset = view[n:], offset + n
