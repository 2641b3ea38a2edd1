"""The disk ceilings of bench/export.py, measured in the same run as the exports: sequential
write + fsync, a cold sequential read and a copy (overlapped, and read-then-write as dd), one stream
through the page cache (in fsdpkit's pieces) and with O_DIRECT; and the checkpoint's own files
read, written and copied with the export's own parallelism. See bench/export.py's docstring.
"""

from __future__ import annotations

import mmap
import os
import queue
import statistics
import threading
import time
from pathlib import Path

from fsdpkit.checkpoint.io.page_cache import SequentialReader, reopen
from raw_io import WRITE_PIECE_BYTES, pwrite_all, write_in_pieces

MIB = 2**20


def evict(path: Path) -> None:
    """Drop clean cached pages of every file under `path` (no root needed)."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _buffers(count: int = 2) -> list:
    """`count` 16 MiB buffers of random bytes, page-aligned (mmap) as O_DIRECT needs."""
    out = []
    for _ in range(count):
        buf = mmap.mmap(-1, 16 * MIB)
        buf[:] = os.urandom(16 * MIB)
        out.append(buf)
    return out


def _write_out(fd: int, buf, n: int, *, direct: bool) -> None:
    """The first `n` bytes of `buf` appended to `fd`: through the page cache in 256 KiB calls
    (bench/raw_io.py), with O_DIRECT in one call."""
    view = memoryview(buf)[:n]
    while view:
        view = view[os.write(fd, view) if direct else write_in_pieces(lambda v: os.write(fd, v), view):]


def _open(path: Path, flags: int, direct: bool) -> int:
    return os.open(path, flags | (os.O_DIRECT if direct else 0), 0o644)


class _Source:
    """`path` read from its start: with O_DIRECT, or through the page cache with a descriptor
    renewed every 16 MiB, as fsdpkit reads there (page_cache.SequentialReader)."""

    def __init__(self, path: Path, *, direct: bool) -> None:
        self._direct = _open(path, os.O_RDONLY, True) if direct else None
        self._cached = None if direct else SequentialReader(path)

    def readinto(self, buf) -> int:
        return os.readv(self._direct, [buf]) if self._direct is not None else self._cached.readinto(buf)

    def close(self) -> None:
        if self._direct is not None:
            os.close(self._direct)
        else:
            self._cached.close()


def _write_seconds(path: Path, nbytes: int, *, direct: bool) -> float:
    block = _buffers()[0]
    t0 = time.perf_counter()
    fd = _open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, direct)
    for _ in range(nbytes // len(block)):
        _write_out(fd, block, len(block), direct=direct)
    os.fsync(fd)
    os.close(fd)
    return time.perf_counter() - t0


def _read_seconds(path: Path, *, direct: bool) -> float:
    evict(path)
    buf = _buffers()[0]
    t0 = time.perf_counter()
    source = _Source(path, direct=direct)
    while source.readinto(buf):
        pass
    source.close()
    return time.perf_counter() - t0


def _copy_seconds(src: Path, dst: Path, *, direct: bool) -> float:
    """Seconds to copy `src` (cold) to `dst` with fsync, reading and writing at once (a reader
    thread filling one buffer while the writer writes the other)."""
    evict(src)
    free: queue.Queue = queue.Queue()
    full: queue.Queue = queue.Queue()
    for buf in _buffers():
        free.put(buf)

    def read() -> None:
        source = _Source(src, direct=direct)
        while True:
            buf = free.get()
            n = source.readinto(buf)
            full.put((buf, n))
            if n == 0:
                break
        source.close()

    t0 = time.perf_counter()
    reader = threading.Thread(target=read)
    reader.start()
    fd = _open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, direct)
    while True:
        buf, n = full.get()
        if n == 0:
            break
        _write_out(fd, buf, n, direct=direct)
        free.put(buf)
    os.fsync(fd)
    os.close(fd)
    reader.join()
    seconds = time.perf_counter() - t0
    dst.unlink()
    return seconds


def _serial_copy_seconds(src: Path, dst: Path, *, direct: bool) -> float:
    """Seconds to copy `src` (cold) to `dst` with fsync on one thread, 16 MiB read then written
    (as `dd`): on a disk whose reads and writes slow each other, this can beat the overlapped copy."""
    evict(src)
    buf = _buffers()[0]
    t0 = time.perf_counter()
    fin, fout = _Source(src, direct=direct), _open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, direct)
    while n := fin.readinto(buf):
        _write_out(fout, buf, n, direct=direct)
    os.fsync(fout)
    fin.close()
    os.close(fout)
    seconds = time.perf_counter() - t0
    dst.unlink()
    return seconds


def parallel_seconds(sources: list[Path], dst: Path | None, *, nbytes: int, readers: int, writers: int,
                     direct: bool) -> float:
    """Seconds to move bytes with the export's own parallelism, 16 MiB blocks, O_DIRECT if `direct`:
    read `sources` cold on `readers` threads (no `dst`), write `nbytes` to `dst` on `writers`
    threads with fsync (no `sources`), or copy: every block read is written at its own offset of
    `dst` by a writer thread, as the export's read-ahead threads feed its writer threads."""
    block = 16 * MIB
    planned, end = [], 0  # (file or None, offset in it, offset in dst)
    for path in sources:
        planned += [(path, offset, end + offset) for offset in range(0, path.stat().st_size, block)]
        end += -(-path.stat().st_size // block) * block
    jobs = iter(planned if sources else [(None, 0, offset) for offset in range(0, nbytes, block)])
    lock = threading.Lock()
    free: queue.SimpleQueue = queue.SimpleQueue()
    full: queue.SimpleQueue = queue.SimpleQueue()
    for buf in _buffers(readers + writers + 1):  # pages touched before the clock
        free.put(buf)
    for path in sources:
        evict(path)
    fds = {path: _open(path, os.O_RDONLY, direct) for path in sources}
    out = _open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, direct) if dst is not None else None

    def next_job():
        with lock:
            return next(jobs, None)

    def read() -> None:
        while (job := next_job()) is not None:
            buf = free.get()
            fresh = None if direct else reopen(fds[job[0]])  # through the page cache: a readahead per block
            try:
                n = os.preadv(fds[job[0]] if fresh is None else fresh, [buf], job[1])
            finally:
                if fresh is not None:
                    os.close(fresh)
            if out is None:
                free.put(buf)
            else:
                full.put((buf, n, job[2]))

    def write() -> None:
        while True:
            if sources:
                item = full.get()
                if item is None:
                    return
                buf, n, offset = item
            else:
                if (job := next_job()) is None:
                    return
                buf, n, offset = free.get(), block, job[2]
            view = memoryview(buf)[: -(-n // 4096) * 4096]  # O_DIRECT writes whole 4 KiB blocks
            pwrite_all(out, view, offset, piece=0 if direct else WRITE_PIECE_BYTES)
            free.put(buf)

    t0 = time.perf_counter()
    reading = [threading.Thread(target=read) for _ in range(readers if sources else 0)]
    writing = [threading.Thread(target=write) for _ in range(writers if out is not None else 0)]
    for t in reading + writing:
        t.start()
    for t in reading:
        t.join()
    for _ in writing:
        full.put(None)
    for t in writing:
        t.join()
    if out is not None:
        os.fsync(out)
        os.close(out)
    seconds = time.perf_counter() - t0
    for fd in fds.values():
        os.close(fd)
    if dst is not None:
        dst.unlink()
    return seconds


def disk_ceilings(work: Path, *, nbytes: int, reps: int) -> dict[str, float]:
    """Median GB/s of sequential write+fsync, of a cold sequential read, and of a copy (reading and
    writing overlapped, and one after the other), 16 MiB at a time, through the page cache and with
    O_DIRECT (where the file system takes it); a ceiling is the best of these, whichever export uses."""
    path = work / "disk_probe.bin"
    runs: dict[str, list[float]] = {}
    modes = [False, True] if direct_ok(work) else [False]
    for _ in range(reps):
        for direct in modes:
            tag = "direct" if direct else "buffered"
            runs.setdefault(f"write_{tag}", []).append(nbytes / _write_seconds(path, nbytes, direct=direct) / 1e9)
            runs.setdefault(f"read_{tag}", []).append(nbytes / _read_seconds(path, direct=direct) / 1e9)
            runs.setdefault(f"copy_{tag}",
                            []).append(nbytes / _copy_seconds(path, work / "disk_probe_copy.bin", direct=direct) / 1e9)
            runs.setdefault(f"copy_serial_{tag}", []).append(
                nbytes / _serial_copy_seconds(path, work / "disk_probe_copy.bin", direct=direct) / 1e9)
            path.unlink()
    medians = {k: statistics.median(v) for k, v in runs.items()}
    best = {kind: max(v for k, v in medians.items() if k.startswith(kind)) for kind in ("write", "read", "copy")}
    return {"write_fsync_gb_s": best["write"], "read_cold_gb_s": best["read"], "copy_gb_s": best["copy"],
            "medians": medians, "runs": runs, "probe_bytes": nbytes}


def direct_ok(work: Path) -> bool:
    try:
        os.close(_open(work / "disk_probe_direct.bin", os.O_WRONLY | os.O_CREAT, True))
    except (OSError, AttributeError):
        return False
    finally:
        (work / "disk_probe_direct.bin").unlink(missing_ok=True)
    return True
