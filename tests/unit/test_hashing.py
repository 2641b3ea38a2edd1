"""Tensor checksums: the same however the rows are split, different when anything moves."""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import opens_o_direct  # noqa: E402
from fsdpkit.checkpoint.hashing import LINEAR, ROWS, hash_part  # noqa: E402


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
def test_file_stream_hashes_what_reached_the_file_small_large_and_short_writes(piece, tune):
    """Writes under and over the overlap threshold (the latter hashed on another thread while
    written), and a short write, give xxh3-64 of exactly the bytes the file holds; with pieces
    (FSDPKIT_WRITE_PIECE_BYTES), no write call is larger than a piece, and a short piece ends
    the write there."""
    import io

    import xxhash

    from fsdpkit.checkpoint.hashing import _HashingStream

    tune(write_piece_bytes=piece)

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
def test_file_stream_starts_write_back_as_it_writes(tmp_path, monkeypatch, tune):
    """A file with a descriptor has its write-back started every FSDPKIT_WRITEBACK_BYTES, over ranges that
    tile what was written; a stream without one (object storage) and a file system that refuses
    the advice still write and hash every byte."""
    import io

    import xxhash

    from fsdpkit.checkpoint import hashing

    tune(writeback_bytes=3 << 20)
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
            assert native(raw, row_bytes, first_row) == rows_sum_python(raw, row_bytes, first_row), (row_bytes,
                                                                                                     first_row)
    for dtype in (torch.float32, torch.bfloat16, torch.int8, torch.float64):
        t = (torch.randn(50, 33, generator=gen) * 50).to(dtype)[:, 1:]  # not contiguous
        assert _rows_hash(t, 3, native=True) == _rows_hash(t, 3, native=False)
    with pytest.raises(ValueError, match="not a whole number of 5-byte rows"):
        native(b"x" * 12, 5, 0)
    with pytest.raises(ValueError):
        native(b"x" * 10, 0, 0)


@pytest.mark.parametrize("native", ["fused", "an older build", "python"])
def test_hash_part_with_copy_to_copies_in_the_same_pass_and_hashes_the_same(native, monkeypatch, tune):
    """hash_part(copy_to=...) (the staging copy of background staging) gives the share hash_part
    gives, and `copy_to` holds the bytes after it: rows of every xxh3 size class, rows longer
    than the C copy's 32 KiB piece, destinations not 16-byte aligned, both algorithms, and the
    fallbacks (copy, then hash): a C extension built before copy_rows_sum existed, and none."""
    from fsdpkit.checkpoint import hashing

    if native != "python":
        _native_rows_sum()
    fused_calls = []
    if native == "an older build":
        monkeypatch.setattr(hashing, "_native_copy_rows_sum", None)
    elif native == "fused":
        real = hashing._native_copy_rows_sum
        assert real is not None, "the C extension was built without copy_rows_sum"
        monkeypatch.setattr(hashing, "_native_copy_rows_sum", lambda *a: fused_calls.append(a[2]) or real(*a))
    tune(python_row_hash=native == "python")
    gen = torch.Generator().manual_seed(5)
    shapes = [(7, 1), (9, 5), (3, 60), (4, 1000), (3, 8192 + 3), (2, 20000), (6,), ()]
    for shape in shapes:
        for dtype in (torch.float32, torch.bfloat16, torch.int8):
            for algorithm in (ROWS, LINEAR):
                t = (torch.randn(shape, generator=gen) * 50).to(dtype)
                want = hash_part(t, first_row=11, algorithm=algorithm)
                room = torch.zeros(t.numel() * t.element_size() + 1, dtype=torch.uint8)
                out = room[1:].view(dtype).view(shape) if dtype == torch.int8 else torch.zeros_like(t)
                assert hash_part(t, first_row=11, algorithm=algorithm, copy_to=out) == want, (shape, dtype, algorithm)
                assert torch.equal(out.view(torch.uint8) if out.dim() else out, t.view(torch.uint8) if t.dim() else t)
    # the single pass ran for every 2-d part (rows of 1 to 80000 bytes), and only where asked for
    assert (len(fused_calls) == 3 * 6) == (native == "fused") and (not fused_calls or max(fused_calls) == 80000)


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


def test_local_checkpoint_files_are_written_with_o_direct(tmp_path, monkeypatch, tune):
    """A local file goes through O_DIRECT in whole aligned blocks, only its last partial block
    through the ordinary descriptor; `tell` counts what was written, `fileno` (DCP's fsync) first
    writes what is staged, and bytes after it still land in order; the checksum is the file's."""
    import xxhash

    from fsdpkit.checkpoint import hashing
    from fsdpkit.checkpoint.direct_io import ALIGN

    if not opens_o_direct(tmp_path):
        pytest.skip("this file system takes no O_DIRECT")
    tune(direct_write_buffer_bytes=16 * ALIGN)  # many blocks per large write
    calls: list[tuple[int, int]] = []
    real_pwrite = os.pwrite
    monkeypatch.setattr(os, "pwrite", lambda fd, data, offset: calls.append((fd, len(memoryview(data).cast("B"))))
                        or real_pwrite(fd, data, offset))
    big = torch.randint(0, 255, (3 << 20,), dtype=torch.uint8).numpy()
    pieces = [b"PK\x03\x04 header", big[: (1 << 20) + 5], b"y" * 333, big, b"end"]
    fs = hashing.HashingFileSystem()
    path = tmp_path / "__0_0.distcp"
    with fs.create_stream(path, "wb") as stream:
        direct_fd = stream._direct._direct
        written = 0
        for piece in pieces[:-1]:
            assert stream.write(piece) == len(piece)
            written += len(piece)
            assert stream.tell() == written
        fd = stream.fileno()
        os.fsync(fd)
        stream.write(pieces[-1])  # after the fsync: through the ordinary descriptor
    data = path.read_bytes()
    expected = b"".join(bytes(p) for p in pieces)
    assert data == expected
    assert fs.files["__0_0.distcp"] == {"size": len(expected), "xxh3_64": xxhash.xxh3_64(expected).hexdigest()}
    before_fileno = len(expected) - len(pieces[-1])
    assert sum(n for f, n in calls if f == direct_fd) == before_fileno - before_fileno % ALIGN
    assert sum(n for f, n in calls if f != direct_fd) == before_fileno % ALIGN + len(pieces[-1])


def test_dcp_save_with_o_direct_writes_the_same_files_as_through_the_page_cache(tmp_path, monkeypatch, tune):
    """The same state saved by DCP through fsdpkit's writer with and without O_DIRECT: byte-identical
    files and checksums, and the O_DIRECT checkpoint loads back to the same tensors."""
    import torch.distributed.checkpoint as dcp

    from fsdpkit.checkpoint import direct_io, hashing
    from fsdpkit.checkpoint.dcp_storage import hashing_writer, safe_reader

    if not opens_o_direct(tmp_path):
        pytest.skip("this file system takes no O_DIRECT")
    tune(direct_write_buffer_bytes=8 * direct_io.ALIGN)
    g = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(1000, 257, generator=g), "b": torch.randn(3, generator=g),
             "h": torch.randn(40, 40, generator=g).to(torch.bfloat16), "n": torch.tensor(7)}
    used: list[bool] = []
    real_init = hashing._HashingStream.__init__

    def spy(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        used.append(self._direct is not None)

    monkeypatch.setattr(hashing._HashingStream, "__init__", spy)
    files = {}
    for way, enabled in (("direct", True), ("page_cache", False)):
        tune(direct_io=enabled)
        writer, fs = hashing_writer(tmp_path / way, thread_count=2)
        dcp.save(state, storage_writer=writer, no_dist=True)
        files[way] = fs.files
    assert used == [True] * 3 + [False] * 3  # 2 data files and .metadata per save
    data_files = [name for name in files["direct"] if name.endswith(".distcp")]  # .metadata names its directory
    assert len(data_files) == 2
    assert {n: files["direct"][n] for n in data_files} == {n: files["page_cache"][n] for n in data_files}
    for name in data_files:
        assert (tmp_path / "direct" / name).read_bytes() == (tmp_path / "page_cache" / name).read_bytes()
    back = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(back, storage_reader=safe_reader(tmp_path / "direct"), no_dist=True)
    assert all(torch.equal(back[k], v) for k, v in state.items())


def test_a_failed_o_direct_write_fails_the_save_and_records_no_checksum(tmp_path, monkeypatch, tune):
    """A full disk under an O_DIRECT write (on a writer thread) is raised to DCP's save, and the
    file gets no checksum."""
    import errno

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from fsdpkit.checkpoint import direct_io
    from fsdpkit.checkpoint.dcp_storage import hashing_writer

    if not opens_o_direct(tmp_path):
        pytest.skip("this file system takes no O_DIRECT")
    tune(direct_write_buffer_bytes=8 * direct_io.ALIGN)
    direct_fds: set[int] = set()
    real_open_direct, real_pwrite = direct_io.open_direct, os.pwrite

    def open_direct(path, flags):
        fd = real_open_direct(path, flags)
        direct_fds.add(fd)
        return fd

    def pwrite(fd, data, offset):
        if fd in direct_fds:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(direct_io, "open_direct", open_direct)
    monkeypatch.setattr(os, "pwrite", pwrite)
    writer, fs = hashing_writer(tmp_path / "ckpt", thread_count=1)
    with pytest.raises(CheckpointException, match=r"No space left on device\n.*__0_0.distcp"):
        dcp.save({"w": torch.randn(512, 512)}, storage_writer=writer, no_dist=True)
    assert "__0_0.distcp" not in fs.files


def test_a_failed_write_through_the_page_cache_is_raised_at_fsync_with_the_file_name(tmp_path, tune):
    """Where O_DIRECT is off, a write the file refuses (a full disk) is kept and raised when DCP
    asks for the descriptor to fsync (not from inside torch.save, where it would come out as
    torch's "unexpected pos"); the writes after it are dropped, the stream ends closed and the
    file gets no checksum."""
    import errno
    import io

    from torch.distributed.checkpoint.filesystem import FileSystem

    from fsdpkit.checkpoint import hashing

    tune(direct_io=False)

    class FullDisk(io.RawIOBase):
        def __init__(self, f):
            super().__init__()
            self.f, self.taken = f, 0

        def writable(self):
            return True

        def write(self, b):
            if self.taken >= 600:
                raise OSError(errno.ENOSPC, "No space left on device")
            self.taken += len(b)
            return self.f.write(b)

        def fileno(self):
            return self.f.fileno()

    class FullDiskFileSystem(FileSystem):
        @contextmanager
        def create_stream(self, path, mode):
            with open(path, mode) as f:
                yield FullDisk(f)

    fs = hashing.HashingFileSystem(base=FullDiskFileSystem())
    path = tmp_path / "__0_0.distcp"
    with pytest.raises(OSError, match="No space left on device") as failure:
        with fs.create_stream(path, "wb") as stream:
            for _ in range(4):
                assert stream.write(b"x" * 600) == 600  # the 2nd fails and is kept; the rest are dropped
            os.fsync(stream.fileno())
    assert any(str(path) in note for note in failure.value.__notes__)
    assert stream.closed and fs.files == {}
    assert path.read_bytes() == b"x" * 600
