"""fsdpkit.checkpoint.direct_io: O_DIRECT reads and writes give the same bytes as ordinary I/O, at any
offset and length, and fall back to ordinary I/O where O_DIRECT is refused."""

from __future__ import annotations

import errno
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import opens_o_direct  # noqa: E402
from fsdpkit.checkpoint import direct_io  # noqa: E402
from fsdpkit.checkpoint.direct_io import ALIGN, DirectReader, DirectWriter, aligned_buffer  # noqa: E402


def _bytes(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def test_aligned_buffer_is_page_aligned():
    for n in (1, ALIGN, 3 * ALIGN + 5):
        buf = aligned_buffer(n)
        assert buf.data_ptr() % ALIGN == 0 and buf.numel() >= n and buf.numel() % ALIGN == 0


@pytest.mark.parametrize("copy", ["native", "numpy"])
@pytest.mark.parametrize("pieces", [[1], [8, 4096 * 3 + 1, 17], [50_000, 200_000, 3], [4096, 4096]])
def test_writer_writes_every_byte_in_order(tmp_path, pieces, copy, monkeypatch):
    """Every byte in order, and the digest fed while staging is the file's, also for bytes written
    after `finish()` (through the ordinary descriptor); with the C streaming copy and without it."""
    direct = opens_o_direct(tmp_path)
    if copy == "numpy":
        monkeypatch.setattr(direct_io, "_copy", np.copyto)
    elif direct_io._copy is np.copyto:
        pytest.skip("fsdpkit's C extension was not built here")
    monkeypatch.setattr(DirectWriter, "DIGEST_PIECE_BYTES", 5000)  # pieces straddle the buffer's ends
    data = [_bytes(n, seed=i) for i, n in enumerate(pieces)]
    digest = xxhash.xxh3_64()
    writer = DirectWriter(tmp_path / "out.bin", buffer_bytes=16 * 1024, writers=2,  # several flushes per piece
                          digest=digest)
    assert (writer._direct is not None) == direct
    for d in data:
        writer.write(d)
    writer.finish()
    after = _bytes(7000, seed=99)
    writer.write(after)
    writer.close()
    content = (tmp_path / "out.bin").read_bytes()
    assert content == b"".join(d.numpy().tobytes() for d in [*data, after])
    assert writer.written == sum(pieces) + after.numel()
    assert digest.hexdigest() == xxhash.xxh3_64(content).hexdigest()


def test_reader_reads_any_range(tmp_path):
    payload = _bytes(5 * ALIGN + 123, seed=7)
    path = tmp_path / "in.bin"
    path.write_bytes(payload.numpy().tobytes())
    with path.open("rb") as f:
        reader = DirectReader(path, f.fileno(), bounce_bytes=2 * ALIGN)  # ranges larger than the bounce: several reads
        assert (reader._direct is not None) == opens_o_direct(tmp_path)
        for offset, length in [(0, 1), (1, ALIGN), (ALIGN - 1, 3 * ALIGN + 2), (17, payload.numel() - 17),
                               (0, payload.numel())]:
            out = torch.empty(length, dtype=torch.uint8)
            assert reader.pread_into(out, offset) == length
            assert torch.equal(out, payload[offset : offset + length]), (offset, length)
        out = torch.empty(200, dtype=torch.uint8)  # past the end: the count says how many bytes the file had
        assert reader.pread_into(out, payload.numel() - 50) == 50
        assert torch.equal(out[:50], payload[-50:])
        reader.close()


def test_refused_direct_io_falls_back_to_ordinary_io(tmp_path, monkeypatch, tune):
    """A file system that opens with O_DIRECT but refuses the I/O (EINVAL) still gets every byte."""
    tune(direct_io=True)
    real_pwrite, real_preadv = os.pwrite, os.preadv
    direct_fds: set[int] = set()
    real_open_direct = direct_io.open_direct

    def open_direct(path, flags):
        fd = real_open_direct(path, flags)
        if fd is None:  # no O_DIRECT here at all: stand an ordinary descriptor in for one
            fd = os.open(path, flags)
        direct_fds.add(fd)
        return fd

    def refuse(real):
        def call(fd, *args):
            if fd in direct_fds:
                raise OSError(errno.EINVAL, "Invalid argument")
            return real(fd, *args)
        return call

    monkeypatch.setattr(direct_io, "open_direct", open_direct)
    monkeypatch.setattr(os, "pwrite", refuse(real_pwrite))
    monkeypatch.setattr(os, "preadv", refuse(real_preadv))
    data = _bytes(3 * 16 * 1024 + 99, seed=3)
    writer = DirectWriter(tmp_path / "out.bin", buffer_bytes=16 * 1024, writers=2)
    writer.write(data[:10])
    writer.write(data[10:])
    writer.close()
    assert (tmp_path / "out.bin").read_bytes() == data.numpy().tobytes()
    with (tmp_path / "out.bin").open("rb") as f:
        reader = DirectReader(tmp_path / "out.bin", f.fileno(), bounce_bytes=ALIGN)
        out = torch.empty(data.numel() - 5, dtype=torch.uint8)
        assert reader.pread_into(out, 5) == out.numel()
        assert torch.equal(out, data[5:])
        assert reader._direct is None  # gave up O_DIRECT after the refusal
        reader.close()


def test_switched_off_uses_ordinary_io(tmp_path, tune):
    tune(direct_io=False)
    writer = DirectWriter(tmp_path / "out.bin", buffer_bytes=ALIGN, writers=2)
    assert writer._direct is None
    writer.write(_bytes(ALIGN + 1))
    writer.close()
    assert (tmp_path / "out.bin").stat().st_size == ALIGN + 1


def test_abort_leaves_no_descriptor_open(tmp_path):
    before = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None
    writer = DirectWriter(tmp_path / "out.bin", buffer_bytes=ALIGN, writers=2)
    writer.write(_bytes(100))
    writer.abort()
    if before is not None:
        assert len(os.listdir("/proc/self/fd")) == before


@pytest.mark.parametrize("limit", [20000, 16])
def test_dcp_source_reads_through_one_descriptor_per_file_near_the_open_file_limit(tmp_path, monkeypatch, limit):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    from fsdpkit.export import sources

    state = {f"t{i}": torch.randn(40, 8, generator=torch.Generator().manual_seed(i)) for i in range(4)}
    dcp.save(state, storage_writer=FileSystemWriter(tmp_path, thread_count=2), no_dist=True)
    monkeypatch.setattr(sources, "_open_file_limit", lambda: limit)
    source = sources.DcpSource(tmp_path)
    try:
        for key, value in state.items():
            assert torch.equal(source.read_rows(key, 5, 31), value[5:31])
        directs = [r._direct is not None for r in source._readers.values()]
        assert len(directs) == 2
        assert directs == [limit > 2 * 2 + 256 and opens_o_direct(tmp_path)] * 2
    finally:
        source.close()


def test_a_failed_background_write_is_raised_to_the_caller(tmp_path, monkeypatch):
    """A write that fails on a writer thread (a full disk) fails the export: at a later write or at close."""
    if not opens_o_direct(tmp_path):
        pytest.skip("no O_DIRECT here: writes are inline")
    real_pwrite = os.pwrite
    writer = DirectWriter(tmp_path / "out.bin", buffer_bytes=ALIGN, writers=2)
    direct_fd = writer._direct

    def full_disk(fd, *args):
        if fd == direct_fd:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwrite(fd, *args)

    monkeypatch.setattr(os, "pwrite", full_disk)
    with pytest.raises(OSError, match="No space left"):
        for _ in range(8):
            writer.write(_bytes(ALIGN))
        writer.close()
    writer.abort()


def test_write_buffers_are_kept_for_the_next_file_up_to_the_bound(tmp_path, monkeypatch):
    """The aligned buffers of a finished file serve the next one (fresh memory is what costs on a VM
    that returns free pages to its host); no more than the pool's bound stays allocated."""
    if not opens_o_direct(tmp_path):
        pytest.skip("no O_DIRECT here: no write buffers")
    pool = direct_io._BufferPool(keep_bytes=3 * 16 * 1024)
    monkeypatch.setattr(direct_io, "BUFFERS", pool)
    seen = []
    for i, writers in enumerate((2, 2, 4)):
        writer = DirectWriter(tmp_path / f"out{i}.bin", buffer_bytes=16 * 1024, writers=writers)
        seen.append({b.data_ptr() for b in writer._buffers})
        writer.write(_bytes(100_000, seed=i))
        writer.close()
        assert (tmp_path / f"out{i}.bin").read_bytes() == _bytes(100_000, seed=i).numpy().tobytes()
    assert seen[1] == seen[0]  # the second file wrote from the first one's buffers
    assert seen[0] < seen[2] and len(seen[2]) == 5  # two more allocated for the wider writer
    assert sum(b.numel() for b in pool._kept) == 3 * 16 * 1024  # of its five, three were kept
