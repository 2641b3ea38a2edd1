"""The DCP reader and writer for a checkpoint directory: local (FileSystemReader/Writer, the fast
path) or a URL (DCP's fsspec reader/writer, see safe_fsspec.py). Both read `.metadata` safely and
checksum every file they write."""

from __future__ import annotations

from pathlib import Path

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystemReader

from fsdpkit.checkpoint.hashing import HashingFileSystem
from fsdpkit.checkpoint.mirror import Mirror
from fsdpkit.checkpoint.safe_io import SafeFileSystemReader
from fsdpkit.checkpoint.storage import RemotePath


def hashing_writer(into: Path | RemotePath, *, thread_count: int,
                   mirror: Mirror | None = None) -> tuple[FileSystemWriter, HashingFileSystem]:
    """(writer, its filesystem): after dcp.save, `fs.files` holds every written file's size and
    checksum. A remote `into` is also copied into `mirror` (checkpoint.local_dir), if given."""
    if isinstance(into, RemotePath):
        from fsdpkit.checkpoint.safe_fsspec import fsspec_writer

        return fsspec_writer(into, thread_count=thread_count, mirror=mirror)
    fs = HashingFileSystem()
    writer = FileSystemWriter(into, sync_files=True, thread_count=thread_count)
    writer.fs = fs
    return writer, fs


def safe_reader(ckpt_dir: Path | RemotePath) -> FileSystemReader:
    """A DCP reader of `ckpt_dir` that never runs code from its `.metadata`."""
    if isinstance(ckpt_dir, RemotePath):
        from fsdpkit.checkpoint.safe_fsspec import fsspec_reader

        return fsspec_reader(ckpt_dir)
    return SafeFileSystemReader(ckpt_dir)
