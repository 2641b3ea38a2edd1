"""Checkpoint files read through the page cache: from start to end, with a descriptor renewed every few MiB."""

from __future__ import annotations

import os

import pytest

from fsdpkit.checkpoint.io.page_cache import SequentialReader


def _read_all(reader: SequentialReader, size: int, step: int) -> bytes:
    buf, out = bytearray(step), bytearray()
    while n := reader.readinto(buf):
        out += buf[:n]
    assert len(out) == size
    return bytes(out)


def _spy_reopens(monkeypatch) -> list[str]:
    opened: list[str] = []
    real_open = os.open

    def spy(path, *args, **kwargs):
        opened.append(str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", spy)
    return opened


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="no /proc here: one descriptor reads it all")
def test_read_to_end_reopens_every_restart_bytes_even_after_path_replaced(tmp_path, monkeypatch, tune):
    tune(read_restart_bytes=3 * 4096)
    data = os.urandom(10 * 4096 + 123)
    path = tmp_path / "f.distcp"
    path.write_bytes(data)
    opened = _spy_reopens(monkeypatch)
    with SequentialReader(path) as reader:
        first = bytearray(5000)
        assert reader.readinto(first) == 5000
        other = tmp_path / "other"
        other.write_bytes(b"x" * len(data))
        other.replace(path)  # the path now names another file: the reader keeps reading the first
        rest = _read_all(reader, len(data) - 5000, 7000)
    assert bytes(first) + rest == data
    reopens = [p for p in opened if p.startswith("/proc/self/fd/")]
    assert len(reopens) == len(data) // (3 * 4096)  # a new descriptor at 12 KiB, 24 KiB, 36 KiB


def test_without_proc_one_descriptor_reads_the_whole_file(tmp_path, monkeypatch, tune):
    tune(read_restart_bytes=4096)
    data = os.urandom(5 * 4096)
    path = tmp_path / "f.distcp"
    path.write_bytes(data)
    real_open = os.open

    def no_proc(p, *args, **kwargs):
        if str(p).startswith("/proc/"):
            raise FileNotFoundError(p)
        return real_open(p, *args, **kwargs)

    monkeypatch.setattr(os, "open", no_proc)
    with SequentialReader(path) as reader:
        assert _read_all(reader, len(data), 3000) == data
        assert reader._restart == 0  # gave up reopening after the first try


def test_restart_off_reads_through_one_descriptor(tmp_path, monkeypatch, tune):
    tune(read_restart_bytes=0)
    data = os.urandom(3 * 4096 + 1)
    path = tmp_path / "f"
    path.write_bytes(data)
    opened = _spy_reopens(monkeypatch)
    with SequentialReader(path) as reader:
        assert _read_all(reader, len(data), 4096) == data
    assert opened == [str(path)]


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="no /proc here: one descriptor reads it all")
def test_file_checksums_read_through_a_descriptor_renewed_every_restart_bytes(tmp_path, monkeypatch, tune):
    """The checksum pass before every load (hashing.file_checksum) reads each file through
    SequentialReader: a new descriptor every FSDPKIT_READ_RESTART_BYTES, the same digest."""
    import xxhash

    from fsdpkit.checkpoint.hashing import file_checksum

    tune(read_restart_bytes=1 << 20)
    data = os.urandom((5 << 20) + 77)
    path = tmp_path / "__0_0.distcp"
    path.write_bytes(data)
    opened = _spy_reopens(monkeypatch)
    assert file_checksum(path) == (len(data), xxhash.xxh3_64_hexdigest(data))
    assert len([p for p in opened if p.startswith("/proc/self/fd/")]) == len(data) // (1 << 20)
