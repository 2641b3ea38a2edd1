"""Checksums: tensor checksums the same however the rows are split, different when anything moves;
file checksums those of the bytes each file holds, and none for a file whose write failed."""

from __future__ import annotations

import os
from contextlib import contextmanager

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




def _digest_fs(base=None):
    from fsdpkit.checkpoint.hashing import DigestFileSystem

    return DigestFileSystem() if base is None else DigestFileSystem(base=base)


def test_file_digest_is_that_of_the_bytes_the_file_took_small_large_and_short_writes(tmp_path):
    """Small and large writes, of any buffer item format, and a short write: size and xxh3-64 are
    those of exactly the bytes the file holds, and `write` returns what the file took."""
    import io

    import xxhash
    from torch.distributed.checkpoint.filesystem import FileSystem

    class Short(io.RawIOBase):  # takes only part of one large write, as a non-blocking stream may
        def __init__(self, f):
            super().__init__()
            self.f, self.cut = f, False

        def writable(self):
            return True

        def write(self, b):
            data = bytes(b)
            if len(data) > 1 << 20 and not self.cut:
                self.cut = True
                data = data[:-7]
            return self.f.write(data)

        def fileno(self):
            return self.f.fileno()

    class ShortFileSystem(FileSystem):
        @contextmanager
        def create_stream(self, path, mode):
            with open(path, mode) as f:
                yield Short(f)

    big = torch.randint(0, 255, (3 << 20,), dtype=torch.uint8).numpy()
    pieces = [b"header", big[: 2 << 20], torch.arange(100, dtype=torch.float32).numpy(), big]
    for name, fs, short in (("whole.distcp", _digest_fs(), 0), ("short.distcp", _digest_fs(ShortFileSystem()), 7)):
        with fs.create_stream(tmp_path / name, "wb") as stream:
            returned = [stream.write(piece) for piece in pieces]
        data = (tmp_path / name).read_bytes()
        assert returned == [6, (2 << 20) - short, 400, 3 << 20]
        assert len(data) == 6 + (2 << 20) + 400 + (3 << 20) - short
        assert fs.files == {name: {"size": len(data), "xxh3_64": xxhash.xxh3_64(data).hexdigest()}}


def test_dcp_save_records_every_file_with_the_digest_of_its_bytes(tmp_path):
    """A save through the one writer (io.hashing_writer): every file DCP wrote is recorded (the
    metadata under its final name), with the size and an independent xxh3-64 of the file on disk,
    and the checkpoint loads back to the same tensors."""
    import torch.distributed.checkpoint as dcp
    import xxhash
    from torch.distributed.checkpoint import FileSystemWriter

    from fsdpkit.checkpoint.hashing import DigestFileSystem
    from fsdpkit.checkpoint.io import hashing_writer, safe_reader

    g = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(1000, 257, generator=g), "b": torch.randn(3, generator=g),
             "h": torch.randn(40, 40, generator=g).to(torch.bfloat16), "n": torch.tensor(7)}
    writer, fs = hashing_writer(tmp_path, thread_count=2)
    assert type(writer) is FileSystemWriter and isinstance(fs, DigestFileSystem) and writer.fs is fs
    dcp.save(state, storage_writer=writer, no_dist=True)
    on_disk = sorted(p.name for p in tmp_path.iterdir())
    assert sorted(fs.files) == on_disk and ".metadata" in on_disk and len(on_disk) == 3  # 2 threads: 2 data files
    for name, info in fs.files.items():
        data = (tmp_path / name).read_bytes()
        assert info == {"size": len(data), "xxh3_64": xxhash.xxh3_64(data).hexdigest()}, name
    back = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(back, storage_reader=safe_reader(tmp_path), no_dist=True)
    assert all(torch.equal(back[k], v) for k, v in state.items())


class _FullDisk:
    """A file that refuses writes (ENOSPC) once it holds `room` bytes."""

    def __init__(self, f, room: int):
        self.f, self.room = f, room

    def write(self, b):
        import errno

        if self.f.tell() >= self.room:
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.f.write(b)

    def __getattr__(self, name):
        return getattr(self.f, name)


def _full_disk_file_system(room: int):
    from torch.distributed.checkpoint.filesystem import FileSystem

    class FullDiskFileSystem(FileSystem):
        @contextmanager
        def create_stream(self, path, mode):
            with super().create_stream(path, mode) as f:
                yield _FullDisk(f, room) if "w" in mode else f

    return FullDiskFileSystem()


def test_a_failed_write_is_raised_at_fsync_with_the_file_name(tmp_path):
    """A write the file refuses (a full disk) is kept and raised when DCP asks for the descriptor
    to fsync (not from inside torch.save, where it would come out as torch's "unexpected pos"); the
    writes after it are dropped and the file gets no checksum."""
    fs = _digest_fs(_full_disk_file_system(600))
    path = tmp_path / "__0_0.distcp"
    with pytest.raises(OSError, match="No space left on device") as failure:
        with fs.create_stream(path, "wb") as stream:
            for _ in range(4):
                assert stream.write(b"x" * 600) == 600  # the 2nd fails and is kept; the rest are dropped
            os.fsync(stream.fileno())
    assert any(str(path) in note for note in failure.value.__notes__)
    assert fs.files == {}
    assert path.read_bytes() == b"x" * 600


def test_a_failed_write_fails_the_dcp_save_naming_the_file_and_records_no_checksum(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.api import CheckpointException

    fs = _digest_fs(_full_disk_file_system(1 << 20))
    writer = FileSystemWriter(tmp_path, sync_files=True, thread_count=1)
    writer.fs = fs
    with pytest.raises(CheckpointException, match=r"No space left on device\n.*__0_0.distcp"):
        dcp.save({"w": torch.randn(1024, 512)}, storage_writer=writer, no_dist=True)
    assert "__0_0.distcp" not in fs.files


def test_file_checksum_over_several_read_chunks(tmp_path):
    """file_checksum (every verification pass before a load, `fsdpkit ckpt verify`) reads a file in
    READ_CHUNK_BYTES pieces into one buffer: the digest is that of the whole file, and of an empty one."""
    import xxhash

    from fsdpkit.checkpoint.hashing import READ_CHUNK_BYTES, file_checksum

    data = os.urandom(READ_CHUNK_BYTES * 2 + 12345)
    path = tmp_path / "blob"
    path.write_bytes(data)
    assert file_checksum(path) == (len(data), xxhash.xxh3_64_hexdigest(data))
    (tmp_path / "empty").write_bytes(b"")
    assert file_checksum(tmp_path / "empty") == (0, xxhash.xxh3_64_hexdigest(b""))


def test_every_checkpoint_file_is_in_the_kernel_when_dcp_fsyncs_it(tmp_path, monkeypatch):
    """DCP fsyncs a data file's descriptor before it closes the file: bytes still in Python's write
    buffer then would miss the fsync (a power cut after the commit could cut every file's tail).
    Each fsync of a checkpoint file must see the file at its final size. (torch 2.13 flushes after
    each item it writes, so this holds without fsdpkit's flush in _DigestStream.fileno too; the flush
    keeps it so whatever torch's writer does.)"""
    import os

    from torch import nn

    from fsdpkit.checkpoint.save import save_checkpoint
    from fsdpkit.checkpoint.state import CheckpointTarget

    seen: dict[str, int] = {}
    fsync = os.fsync

    def recording(fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        if os.path.isfile(path):
            seen[os.path.basename(path).removesuffix(".tmp")] = os.fstat(fd).st_size
        fsync(fd)

    monkeypatch.setattr(os, "fsync", recording)
    torch.manual_seed(0)
    model = nn.Linear(4, 4)  # every file fits Python's 8 KiB buffer: all of it would miss the fsync
    target = CheckpointTarget(model=model, optimizer=torch.optim.AdamW(model.parameters()), stateful={})
    step = tmp_path / "step_1"
    save_checkpoint(target, ckpt_dir=step, step=1, meta={"run_id": "a", "fingerprint": {"tensors": {}},
                                                         "metrics": {}}, group=None)
    data = {p.name: p.stat().st_size for p in step.glob("*.distcp")}
    assert data and all(seen.get(name) == size for name, size in data.items()), (seen, data)
