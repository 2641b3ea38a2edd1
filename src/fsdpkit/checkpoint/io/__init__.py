"""The I/O seam: the DCP writer that moves a checkpoint's bytes, and the reader that loads them.

The checkpoint core (save.py, resume.py) asks this package for a writer and a reader and names no
I/O class itself. What is in it: this module (the writer and the reader), items.py (the per-item
checksums a save records and a load checks), checked_read.py (the reader that checks them as it
reads), page_cache.py (files read from start to end: hashing.file_checksum) and torch_save.py (finds
a tensor's bytes in a torch.save blob without unpickling it: the export's reads and the checked reader).

Each StoragePath makes its own (storage/protocol.py: `dcp_writer`, `dcp_reader`); this module asks
it for them. One writer: DCP's own FileSystemWriter (fsspec writer for a URL: storage/safe_fsspec.py)
with its file system wrapped by hashing.DigestFileSystem, which records xxh3-64 over every byte written, the
digest the manifest records (docs/checkpoint-format.md). After a local save, `record_items` adds
each data file's item checksums (items.py). Nothing in it is tuned to a machine.

One reader: DCP's own FileSystemReader without its pickle (safe_io.py), or DCP's fsspec reader for a
URL (storage/safe_fsspec.py). Given the manifest's files, the local one checks `.metadata` and every
item of a file with item checksums from its own read (checked_read.py); a file without them is
checked whole in a pass of its own before the load reads it (resume.verify_files).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from fsdpkit.checkpoint.settings import IOSettings
from fsdpkit.checkpoint.storage import StoragePath, open_storage

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

    from fsdpkit.checkpoint.hashing import DigestFileSystem
    from fsdpkit.checkpoint.storage.mirror import Mirror

log = logging.getLogger("fsdpkit.checkpoint")

# The reader and the writer are imported where they are made: hashing.py (the core) reads through
# io/page_cache.py, so this package must not import hashing.py when it is itself imported.


def hashing_writer(into: str | os.PathLike | StoragePath, *, thread_count: int, io: IOSettings | None = None,
                   mirror: Mirror | None = None) -> tuple[Any, DigestFileSystem]:
    """(DCP writer into `into`, its file system): after dcp.save, `fs.files` holds every written
    file's size and checksum. On object storage the writer is DCP's fsspec one (teed into `mirror`,
    the Checkpointer's checkpoint.local_dir, if given). `io`: default, the environment's."""
    return open_storage(into).dcp_writer(thread_count=thread_count, io=io or IOSettings.from_environment(),
                                         mirror=mirror)


def record_items(into: str | os.PathLike | StoragePath, files: dict[str, dict[str, Any]], metadata: Metadata, *,
                 covered: frozenset[str]) -> None:
    """After dcp.save wrote `into`: add to each of this rank's data files in `files` (the writer's
    `fs.files`) its item checksums (items.py), from `metadata` (dcp.save's result) and `covered` (the
    keys the manifest's `tensors` will hold). Only where re-reading is cheap (`StoragePath.checks_items`):
    on object storage it costs a GET per item, and a resume there checks whole files anyway
    (resolve.resolve_checkpoint)."""
    into = open_storage(into)
    if not into.checks_items:
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


def safe_reader(ckpt_dir: str | os.PathLike | StoragePath, *, files: dict[str, Any] | None = None,
                covered: Iterable[str] = (), io: IOSettings | None = None) -> Any:
    """A DCP reader of `ckpt_dir` that never runs code from its `.metadata` (safe_io.py; DCP's
    fsspec reader for a URL, storage/safe_fsspec.py). With `files` (the manifest's entries of the
    directory) and `covered` (its `tensors` keys), it checks `.metadata` before unpickling it and,
    where re-reading is cheap, every item of a file with item checksums as it reads it
    (checked_read.py). `io`: default, the environment's."""
    return open_storage(ckpt_dir).dcp_reader(io=io or IOSettings.from_environment(), files=files, covered=covered)
