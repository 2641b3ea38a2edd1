"""The machine's ceilings for bench/checkpoint.py, measured by its orchestrator before the phases
(this process, torch on one thread, as each rank runs; every figure a median of --ceiling-reps):
disk write + fsync and cold-ish reads of N files at once (N = 1, 2 and every --scale-ranks count),
O_DIRECT and warm reads of one file, and memcpy with torch's copy_ and with non-temporal stores,
one and two copies at once. How each is taken: bench/checkpoint.py's docstring, "Ceilings".
"""

from __future__ import annotations

import mmap
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

CHUNK = 16 * 2**20
MiB, GiB = 2**20, 2**30


def _write_file(path: Path, nbytes: int, block: bytes, *, writeback: int = 0,
                direct: bool = False) -> tuple[float, float]:
    """(seconds for write + fsync, of which fsync), `block` after `block` in 256 KiB write calls
    (on a VM that returns free memory to its host, 16 MiB calls were up to 3x slower); with
    `writeback`, the write-back of every `writeback` bytes is started as the writing goes on; with
    `direct`, through O_DIRECT from a reused aligned buffer (bench/raw_io.py: the disk's ways; the
    fsync of an O_DIRECT file is counted in the write)."""
    from raw_io import WriteBack, write_direct, write_in_pieces

    t0 = time.perf_counter()
    if direct:
        chunk = torch.frombuffer(bytearray(block), dtype=torch.uint8)
        write_direct(path, (chunk for _ in range(nbytes // len(block))))
        t2 = time.perf_counter()
        return t2 - t0, 0.0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        wb = WriteBack(fd, writeback)
        for i in range(nbytes // len(block)):
            view = memoryview(block)
            while view:  # in 256 KiB calls
                view = view[write_in_pieces(lambda v: os.write(fd, v), view):]
            wb.written_to((i + 1) * len(block))
        t1 = time.perf_counter()
        os.fsync(fd)
    finally:
        os.close(fd)
    t2 = time.perf_counter()
    return t2 - t0, t2 - t1


def _read_file(path: Path, *, drop: bool, direct: bool = False) -> float:
    """Seconds to read `path` in CHUNK reads (after evicting it from the page cache if `drop`):
    with O_DIRECT, or through the page cache with a new descriptor every 16 MiB, as fsdpkit's
    checksum pass before a load reads (fsdpkit.checkpoint.io.page_cache: on a VM that returns free
    memory to its host, one descriptor's growing readahead was up to 2.5x slower)."""
    from fsdpkit.checkpoint.io.page_cache import SequentialReader

    if drop:
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    buf = mmap.mmap(-1, CHUNK)  # page-aligned, as O_DIRECT needs
    try:
        t0 = time.perf_counter()
        if direct:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            try:
                while os.readv(fd, [buf]) > 0:
                    pass
            finally:
                os.close(fd)
        else:
            with SequentialReader(path) as reader:
                while reader.readinto(buf) > 0:
                    pass
        return time.perf_counter() - t0
    finally:
        buf.close()


def _concurrently(fns: list) -> float:
    """Seconds until every one of `fns`, each started on its own thread at once, returned."""
    threads = [threading.Thread(target=fn) for fn in fns]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def write_ceiling(workdir: Path, *, nbytes: int, streams: int, reps: int, block: bytes) -> dict[str, Any]:
    """`streams` new files of nbytes/streams each, written at once by as many threads (os.write
    drops the GIL), each fsynced: what N ranks writing their shards at once can reach. Three ways,
    alternating: plain (all the write-back in the fsync), starting the write-back every 64 MiB
    as the writing goes on, and O_DIRECT (bench/raw_io.py); the ceiling is the fastest median. A
    new set of files per repetition,
    the previous set deleted first (the pattern of the
    checkpoint runs: new files, the last run's deleted; rewriting one file in place was ~4x slower
    here)."""
    from raw_io import WRITEBACK_BYTES

    writeback_bytes = WRITEBACK_BYTES

    each = nbytes // streams // CHUNK * CHUNK
    ways = {"plain": {}, **({"writeback": {"writeback": writeback_bytes}} if writeback_bytes > 0 else {}),
            **({"O_DIRECT": {"direct": True}} if _takes_direct(workdir) else {})}
    times: dict[str, list[float]] = {w: [] for w in ways}
    fsyncs: dict[str, list[float]] = {w: [] for w in ways}
    previous: list[Path] = []
    for r in range(reps):
        for k, (way, how) in enumerate(ways.items()):
            for p in previous:
                p.unlink()
            previous = [workdir / f"ceiling_{streams}_{r}_{k}_{i}.bin" for i in range(streams)]
            out: list[tuple[float, float]] = []
            times[way].append(_concurrently([lambda p=p, out=out, how=how: out.append(_write_file(p, each, block,
                                                                                                  **how))
                                             for p in previous]))
            fsyncs[way].append(max(f for _, f in out))
    for p in previous:
        p.unlink()
    total = each * streams
    runs = {way: [total / t / 1e9 for t in ts] for way, ts in times.items()}
    gbps = {way: statistics.median(r) for way, r in runs.items()}
    best = max(gbps, key=gbps.__getitem__)
    return {"streams": streams, "bytes": total, "gbps": gbps[best], "runs_gbps": runs[best], "fsync_s": fsyncs[best],
            "best_way": best, "ways_gbps": gbps, "writeback_bytes": writeback_bytes if "writeback" in ways else 0}


def _takes_direct(folder: Path) -> bool:
    """Whether files in `folder` take O_DIRECT writes (not tmpfs)."""
    from raw_io import ALIGN, aligned_buffer, open_direct

    made, probe = tempfile.mkstemp(prefix=".o_direct_probe_", dir=folder)  # a new file of ours, never one found there
    os.close(made)
    try:
        fd = open_direct(probe, os.O_WRONLY)
        if fd is None:
            return False
        try:
            os.pwrite(fd, aligned_buffer(ALIGN).numpy(), 0)
            return True
        except OSError:
            return False
        finally:
            os.close(fd)
    finally:
        os.unlink(probe)


def read_ceiling(paths: list[Path], *, reps: int, drop: bool, direct: bool = False) -> dict[str, Any]:
    """All of `paths` read at once, one thread each (evicted from the page cache first if `drop`)."""
    total = sum(p.stat().st_size for p in paths)
    runs = [total / _concurrently([lambda p=p: _read_file(p, drop=drop, direct=direct) for p in paths]) / 1e9
            for _ in range(reps)]
    return {"streams": len(paths), "bytes": total, "gbps": statistics.median(runs), "runs_gbps": runs}


def measure_ceilings(workdir: Path, *, gib: float, memcpy_mib: int, streams: list[int], reps: int) -> dict[str, Any]:
    """Disk, page-cache and memcpy ceilings; every figure a median of `reps` repetitions."""
    from fsdpkit import tunables
    from fsdpkit.checkpoint import staging
    from raw_io import WRITE_PIECE_BYTES

    torch.set_num_threads(1)
    nbytes = int(gib * GiB) // CHUNK * CHUNK
    block = os.urandom(CHUNK)
    writes = {str(n): write_ceiling(workdir, nbytes=nbytes, streams=n, reps=reps, block=block) for n in streams}
    reads: dict[str, Any] = {}
    for n in streams:  # N ranks loading read N files at once
        each = nbytes // n // CHUNK * CHUNK
        paths = [workdir / f"read_{n}_{i}.bin" for i in range(n)]
        for p in paths:
            _write_file(p, each, block)
        reads[str(n)] = read_ceiling(paths, reps=reps, drop=True)
        if n == 1:
            try:
                reads["o_direct_1"] = read_ceiling(paths, reps=reps, drop=True, direct=True)
            except OSError:
                reads["o_direct_1"] = None
            reads["warm_1"] = read_ceiling(paths, reps=reps, drop=False)
        for p in paths:
            p.unlink()
    n = memcpy_mib * MiB // 4
    src, dst = torch.ones(n), torch.empty(n)
    dst.copy_(src)  # touch the pages once
    copies, fresh = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        copies.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        torch.empty(n).copy_(src)
        fresh.append(time.perf_counter() - t0)
    stream_copy = staging.copy_host if staging.HAS_STREAM_COPY else None  # non-temporal stores
    streamed = []
    for _ in range(reps if stream_copy else 0):
        t0 = time.perf_counter()
        stream_copy(dst, src)
        streamed.append(time.perf_counter() - t0)
    pair_src, pair_dst = [torch.ones(n) for _ in range(2)], [torch.ones(n) for _ in range(2)]  # pages touched
    # two copies at once (both copies drop the GIL): both ranks stage at the same moment
    together = [_concurrently([lambda d=d, s=s: d.copy_(s) for d, s in zip(pair_dst, pair_src, strict=True)])
                for _ in range(reps)]
    together_streamed = [_concurrently([lambda d=d, s=s: stream_copy(d, s)
                                        for d, s in zip(pair_dst, pair_src, strict=True)])
                         for _ in range(reps)] if stream_copy else []
    del src, dst, pair_src, pair_dst
    gbps = lambda b, ts: b / statistics.median(ts) / 1e9  # noqa: E731

    return {
        "reps": reps,
        "write_fsync": writes,
        "write_piece_bytes": WRITE_PIECE_BYTES,
        "read_cold": reads,
        "read_restart_bytes": tunables.current().read_restart_bytes,
        "memcpy_bytes": n * 4,
        "memcpy_gbps": gbps(n * 4, copies),
        "memcpy_fresh_alloc_gbps": gbps(n * 4, fresh),
        "memcpy_2threads_each_gbps": gbps(n * 4, together),
        **({"memcpy_stream_gbps": gbps(n * 4, streamed),
            "memcpy_stream_2threads_each_gbps": gbps(n * 4, together_streamed)} if stream_copy else {}),
    }
