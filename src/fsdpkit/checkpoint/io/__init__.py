"""The I/O seam: the DCP writer that moves a checkpoint's bytes, and the reader that loads them.

The checkpoint core (save.py, resume.py) asks this package for a writer and a reader and names no
I/O class itself. What is in it: this module (the writer and the reader), items.py (the per-item
checksums a save records and a load checks), checked_read.py (the reader that checks them as it
reads), page_cache.py (files read from start to end: hashing.file_checksum) and torch_save.py (finds
a tensor's bytes in a torch.save blob without unpickling it: the export's reads and the checked reader).

One writer: DCP's own FileSystemWriter (fsspec writer for a URL: storage/safe_fsspec.py) with its file
system wrapped by hashing.DigestFileSystem, which records xxh3-64 over every byte written, the
digest the manifest records (docs/checkpoint-format.md). After a local save, `record_items` adds
each data file's item checksums (items.py). Nothing in it is tuned to a machine.

One reader: DCP's own FileSystemReader without its pickle (safe_io.py), or DCP's fsspec reader for a
URL (storage/safe_fsspec.py). Given the manifest's files, the local one checks `.metadata` and every
item of a file with item checksums from its own read (checked_read.py); a file without them is
checked whole in a pass of its own before the load reads it (resume.verify_files).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fsdpkit.checkpoint.storage import RemotePath

if TYPE_CHECKING:
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import Metadata

    from fsdpkit.checkpoint.hashing import DigestFileSystem
    from fsdpkit.checkpoint.storage.mirror import Mirror

log = logging.getLogger("fsdpkit.checkpoint")

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


def record_items(into: Path | RemotePath, files: dict[str, dict[str, Any]], metadata: Metadata, *,
                 covered: frozenset[str]) -> None:
    """After dcp.save wrote `into`: add to each of this rank's data files in `files` (the writer's
    `fs.files`) its item checksums (items.py), from `metadata` (dcp.save's result) and `covered` (the
    keys the manifest's `tensors` will hold). Not on object storage: re-reading there costs a GET per
    item, and a resume there checks whole files anyway (resolve_checkpoint)."""
    if isinstance(into, RemotePath):
        return
    from fsdpkit.checkpoint.errors import CheckpointCorruptError
    from fsdpkit.checkpoint.io.items import ITEMS, digest_files

    names = [name for name in files if name.endswith(".distcp")]
    try:
        digests = digest_files(into, names, metadata, covered=covered)
    except (OSError, CheckpointCorruptError) as e:  # the files stand; a resume then checks them whole
        log.warning("checkpoint %s: could not read back its items to checksum them (%s); a resume checks its "
                    "files whole instead", into, e)
        return
    for name, items in digests.items():
        files[name][ITEMS] = items


def safe_reader(ckpt_dir: Path | RemotePath, *, files: dict[str, Any] | None = None,
                covered: Iterable[str] = ()) -> FileSystemReader:
    """A DCP reader of `ckpt_dir` that never runs code from its `.metadata`: local (safe_io.py) or
    a URL (DCP's fsspec reader, storage/safe_fsspec.py). With `files` (the manifest's entries of the
    directory) and `covered` (its `tensors` keys), it checks `.metadata` before unpickling it and,
    locally, every item of a file with item checksums as it reads it (checked_read.py)."""
    if isinstance(ckpt_dir, RemotePath):
        from fsdpkit.checkpoint.storage.safe_fsspec import fsspec_reader

        reader = fsspec_reader(ckpt_dir)
        reader.expected_files = files
        return reader
    if files is not None:
        from fsdpkit.checkpoint.io.checked_read import CheckedFileSystemReader

        return CheckedFileSystemReader(ckpt_dir, files=files, covered=covered)
    from fsdpkit.checkpoint.safe_io import SafeFileSystemReader

    return SafeFileSystemReader(ckpt_dir)
