"""The I/O seam: the DCP writer that moves a checkpoint's bytes, and the reader `checkpoint.io` chooses.

The checkpoint core (save.py, resume.py) asks this package for a writer and a reader and names no
I/O class itself. What is in it: this module (the choice), verified_read.py (the `fast` reader),
torch_save.py (its parser of torch.save's zip files) and page_cache.py (sequential reads; also used
by hashing.file_checksum).

One writer: DCP's own FileSystemWriter (fsspec writer for a URL: storage/safe_fsspec.py) with its file
system wrapped by hashing.DigestFileSystem, which records xxh3-64 over every byte written, the
digest the manifest records (docs/checkpoint-format.md). Nothing in it is tuned to a machine.

Two readers (`checkpoint.io`), the same checkpoint either way:

- `fast` (default): verified_read.VerifyingFileSystemReader, one read per file, each file's
  checksum computed from that read.
- `plain`: a load checks every file's checksum in a pass of its own first (resume.verify_files),
  then reads with fsdpkit's safe FileSystemReader (safe_io.py), DCP's reader without its pickle.

A URL checkpoint (object storage) takes DCP's fsspec reader (storage/safe_fsspec.py) with either choice.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from fsdpkit.checkpoint.storage import RemotePath, is_url

if TYPE_CHECKING:
    import torch.distributed as tdist
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    from fsdpkit.checkpoint.hashing import DigestFileSystem
    from fsdpkit.checkpoint.storage.mirror import Mirror

# The readers and the writer are imported where they are made: hashing.py (the core) reads through
# io/page_cache.py, so this package must not import hashing.py when it is itself imported.

PLAIN, FAST = "plain", "fast"
CHOICES = (PLAIN, FAST)  # checkpoint.io


def _check(io: str) -> None:
    if io not in CHOICES:
        raise ValueError(f"checkpoint.io is {io!r}; expected one of {', '.join(CHOICES)}")


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


def verifies_while_reading(ckpt_dir: Path | RemotePath, *, io: str = FAST) -> bool:
    """Whether `load_reader` checks file checksums from the load's own reads (`fast`, local); if
    not, the caller checks them in a pass before the load (resume.verify_files)."""
    _check(io)
    return io == FAST and not is_url(ckpt_dir)


def load_reader(ckpt_dir: Path | RemotePath, *, io: str = FAST, files: dict[str, Any], hash_files: bool,
                group: tdist.ProcessGroup | None) -> FileSystemReader:
    """The DCP reader of a sharded checkpoint: never runs code from its `.metadata`. Where
    `verifies_while_reading`, a VerifyingFileSystemReader (`files`: the manifest's list; with
    `hash_files`, its `digests` hold what it read), else the safe reader (`hash_files` must be
    False there: verify before the load)."""
    if verifies_while_reading(ckpt_dir, io=io):
        from fsdpkit.checkpoint.io.verified_read import VerifyingFileSystemReader

        return VerifyingFileSystemReader(ckpt_dir, sizes={n: i["size"] for n, i in files.items()},
                                         hash_files=hash_files, group=group)
    if hash_files:
        raise ValueError(f"checkpoint.io={io}: the reader of {ckpt_dir} does not check files as it reads; "
                         "verify them before the load (a bug: please report it)")
    return safe_reader(ckpt_dir)
