"""Tensor checksums: the same however the rows are split, different when anything moves."""

from __future__ import annotations

import os

import pytest
import torch

from fsdpkit.checkpoint.hashing import LINEAR, ROWS, hash_part


def split_sum(t: torch.Tensor, cuts: list[int], algorithm: str) -> int:
    bounds = [0, *cuts, t.shape[0]]
    total = sum(hash_part(t[a:b], first_row=a, algorithm=algorithm) for a, b in zip(bounds, bounds[1:], strict=False))
    return (total + (1 << 63)) % (1 << 64) - (1 << 63)  # int64 wrap-around, as the all-reduce does


@pytest.mark.parametrize("algorithm", [ROWS, LINEAR])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_split_invariant_and_sensitive(algorithm, dtype):
    t = (torch.randn(37, 5, generator=torch.Generator().manual_seed(0)) * 100).to(dtype)
    whole = hash_part(t, first_row=0, algorithm=algorithm)
    assert split_sum(t, [10], algorithm) == whole == split_sum(t, [1, 13, 36], algorithm)
    swapped = t.clone()
    swapped[[3, 4]] = t[[4, 3]]
    changed = t.clone()
    changed.view(-1).view(torch.uint8)[37] ^= 1  # one bit of one element, whatever the dtype
    assert hash_part(swapped, first_row=0, algorithm=algorithm) != whole
    assert hash_part(changed, first_row=0, algorithm=algorithm) != whole
    # the same rows at another global position (a mismapped shard) hash differently
    assert hash_part(t[1:], first_row=0, algorithm=algorithm) != hash_part(t[1:], first_row=1, algorithm=algorithm)


def test_unknown_algorithm_is_an_error():
    with pytest.raises(ValueError, match="unknown tensor hash algorithm"):
        hash_part(torch.zeros(2, 2), first_row=0, algorithm="md5")


@pytest.mark.parametrize("piece", [0, 256 << 10])
def test_file_stream_hashes_what_reached_the_file_small_large_and_short_writes(monkeypatch, piece):
    """Writes under and over the overlap threshold (the latter hashed on another thread while
    written), and a short write, give xxh3-64 of exactly the bytes the file holds; with pieces
    (page_cache.WRITE_PIECE_BYTES), no write call is larger than a piece, and a short piece ends
    the write there."""
    import io

    import xxhash

    from fsdpkit.checkpoint import page_cache
    from fsdpkit.checkpoint.hashing import _HashingStream

    monkeypatch.setattr(page_cache, "WRITE_PIECE_BYTES", piece)

    class Recording(io.BytesIO):
        def __init__(self):
            super().__init__()
            self.calls: list[int] = []

        def write(self, b):
            self.calls.append(len(b))
            return super().write(b)

    class Short(Recording):  # accepts only part of one large write, as a non-blocking stream may
        short_done = False

        def write(self, b):
            if len(b) >= (piece or 3 << 20) and not self.short_done and sum(self.calls) > 2 << 20:
                self.short_done = True
                self.calls.append(len(b))
                return io.BytesIO.write(self, bytes(b)[: len(b) - 7])
            return super().write(b)

    big = torch.randint(0, 255, (5 << 20,), dtype=torch.uint8).numpy()
    for raw in (Recording(), Short()):
        got, returned = {}, []
        stream = _HashingStream(raw, lambda size, digest, got=got: got.update(size=size, digest=digest))
        for chunk in (b"header", big[: 2 << 20], b"x" * 100, big):
            returned.append(stream.write(chunk))
        stream.close()
        data = raw.getvalue()
        assert got == {"size": len(data), "digest": xxhash.xxh3_64(data).hexdigest()}
        last = ((piece or len(big)) - 7) if isinstance(raw, Short) else len(big)  # what the file took of `big`
        assert returned == [6, 2 << 20, 100, last]
        assert len(data) == 6 + (2 << 20) + 100 + last
        assert max(raw.calls) == (piece or 5 << 20)


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="no posix_fadvise here (macOS): no write-back advice")
def test_file_stream_starts_write_back_as_it_writes(tmp_path, monkeypatch):
    """A file with a descriptor has its write-back started every WRITEBACK_BYTES, over ranges that
    tile what was written; a stream without one (object storage) and a file system that refuses
    the advice still write and hash every byte."""
    import io

    import xxhash

    from fsdpkit.checkpoint import hashing

    monkeypatch.setattr(hashing, "WRITEBACK_BYTES", 3 << 20)
    advice: list[tuple[int, int, int]] = []
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, offset, length, how: advice.append((offset, length, how)))
    chunk = torch.randint(0, 255, (1 << 20,), dtype=torch.uint8).numpy()

    def write(raw) -> dict:
        got: dict = {}
        stream = hashing._HashingStream(raw, lambda size, digest: got.update(size=size, digest=digest))
        for _ in range(10):
            stream.write(chunk)
        stream.close()
        return got

    path = tmp_path / "shard.distcp"
    with path.open("wb") as raw:
        got = write(raw)
    data = path.read_bytes()
    assert got == {"size": 10 << 20, "digest": xxhash.xxh3_64(data).hexdigest()}
    assert advice == [(0, 3 << 20, os.POSIX_FADV_DONTNEED), (3 << 20, 3 << 20, os.POSIX_FADV_DONTNEED),
                      (6 << 20, 3 << 20, os.POSIX_FADV_DONTNEED)]

    advice.clear()
    assert write(io.BytesIO())["size"] == 10 << 20  # no descriptor: no advice
    assert advice == []

    def refuse(*args):
        advice.append(args)
        raise OSError(29, "Illegal seek")

    monkeypatch.setattr(os, "posix_fadvise", refuse)
    with path.open("wb") as raw:
        got = write(raw)
    assert got == {"size": 10 << 20, "digest": xxhash.xxh3_64(path.read_bytes()).hexdigest()}
    assert len(advice) == 1  # refused once, then not asked again


def _native_rows_sum():
    """fsdpkit's C row hash; skips only where no C compiler could have built it."""
    import shutil
    import sysconfig

    from fsdpkit.checkpoint import hashing

    if hashing._native_rows_sum is None:
        if shutil.which(sysconfig.get_config_var("CC").split()[0] if sysconfig.get_config_var("CC") else "cc"):
            pytest.fail("a C compiler is here but fsdpkit.checkpoint._rowhash was not built: reinstall "
                        "fsdpkit (pip install -e .) and read the compiler's error")
        pytest.skip("no C compiler: fsdpkit runs its Python row hash")
    return hashing._native_rows_sum


def test_native_row_hash_equals_the_python_loop():
    """The C extension and the python-xxhash loop give the same sums for every xxh3 size class
    (1-16, 17-128, 129-240 bytes and longer), any seed, and any dtype; bad shapes are errors."""
    from fsdpkit.checkpoint.hashing import _rows_hash, rows_sum_python

    native = _native_rows_sum()
    gen = torch.Generator().manual_seed(1)
    for row_bytes in (1, 3, 8, 16, 17, 100, 128, 129, 240, 241, 1000, 4096, 8192 + 5):
        raw = memoryview(torch.randint(0, 256, (7 * row_bytes,), dtype=torch.uint8, generator=gen).numpy())
        for first_row in (0, 1, 12345, (1 << 64) - 7):
            assert native(raw, row_bytes, first_row) == rows_sum_python(raw, row_bytes, first_row), (row_bytes, first_row)
    for dtype in (torch.float32, torch.bfloat16, torch.int8, torch.float64):
        t = (torch.randn(50, 33, generator=gen) * 50).to(dtype)[:, 1:]  # not contiguous
        assert _rows_hash(t, 3, native=True) == _rows_hash(t, 3, native=False)
    with pytest.raises(ValueError, match="not a whole number of 5-byte rows"):
        native(b"x" * 12, 5, 0)
    with pytest.raises(ValueError):
        native(b"x" * 10, 0, 0)


def test_native_row_hash_releases_the_gil():
    """Another Python thread runs while the C row hash works: its timestamps fall inside the
    call (a call holding the GIL, as python-xxhash's one-shot digest does, allows none there)."""
    import threading
    import time

    native = _native_rows_sum()
    raw = memoryview(torch.ones(256 << 20, dtype=torch.uint8).numpy())
    for _ in range(5):  # a loaded machine may not schedule the other thread within one call
        stamps, stop = [], threading.Event()

        def tick(stamps=stamps, stop=stop):
            while not stop.is_set():
                stamps.append(time.perf_counter())
                time.sleep(0.0005)

        thread = threading.Thread(target=tick)
        thread.start()
        time.sleep(0.01)
        t0 = time.perf_counter()
        native(raw, 4096, 0)
        t1 = time.perf_counter()
        stop.set()
        thread.join()
        inside = [s for s in stamps if t0 + 0.25 * (t1 - t0) < s < t0 + 0.75 * (t1 - t0)]
        if inside:
            return
    pytest.fail(f"no other thread ran during a {1e3 * (t1 - t0):.0f} ms call: the GIL was held")
