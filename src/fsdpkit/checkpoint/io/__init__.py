"""The I/O seam: the DCP writer that moves a checkpoint's bytes, and the reader that loads them.

The checkpoint core (save.py, resume.py) asks this package for a writer and a reader and names no
I/O class itself. What is in it: this module (the writer and the reader), page_cache.py (files read
from start to end: hashing.file_checksum) and torch_save.py (finds a tensor's bytes in a torch.save
blob without unpickling it: the export's reads, export/sources.py).

One writer: DCP's own FileSystemWriter (fsspec writer for a URL: storage/safe_fsspec.py) with its file
system wrapped by hashing.DigestFileSystem, which records xxh3-64 over every byte written, the
digest the manifest records (docs/checkpoint-format.md). Nothing in it is tuned to a machine.

One reader: DCP's own FileSystemReader without its pickle (safe_io.py), or DCP's fsspec reader for a
URL (storage/safe_fsspec.py). It checks no checksum: a load that verifies files checks every file's
checksum in a pass of its own before it reads (resume.verify_files).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from fsdpkit.checkpoint.storage import RemotePath

if TYPE_CHECKING:
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    from fsdpkit.checkpoint.hashing import DigestFileSystem
    from fsdpkit.checkpoint.storage.mirror import Mirror

# The reader and the writer are imported where they are made: hashing.py (the core) reads through
# io/page_cache.py, so this package must not import hashing.py when it is itself imported.


def hashing_writer(into: Path | RemotePath, *, thread_count: int,
                   mirror: Mirror | None = None) -> tuple[FileSystemWriter, DigestFileSystem]:
    """(DCP writer into `into`, its file system): after dcp.save, `fs.files` holds every written
    file's size and checksum. A URL `into` takes DCP's fsspec writer (teed into `mirror`, the
    Checkpointer's checkpoint.local_dir, if given)."""
    if isinstance(into, RemotePath):
        from fsdpkit.checkpoint.storage.safe_fsspec import fsspec_writer

        return fsspec_writer(into, thread_count=thread_count, mirror=mirror)
    from torch.distributed.checkpoint import FileSystemWriter

    from fsdpkit.checkpoint.hashing import DigestFileSystem

    fs = DigestFileSystem()
    writer = FileSystemWriter(into, sync_files=True, thread_count=thread_count)
    writer.fs = fs
    return writer, fs


def safe_reader(ckpt_dir: Path | RemotePath) -> FileSystemReader:
    """A DCP reader of `ckpt_dir` that never runs code from its `.metadata`: local (safe_io.py) or
    a URL (DCP's fsspec reader, storage/safe_fsspec.py)."""
    if isinstance(ckpt_dir, RemotePath):
        from fsdpkit.checkpoint.storage.safe_fsspec import fsspec_reader

        return fsspec_reader(ckpt_dir)
    from fsdpkit.checkpoint.safe_io import SafeFileSystemReader

    return SafeFileSystemReader(ckpt_dir)
