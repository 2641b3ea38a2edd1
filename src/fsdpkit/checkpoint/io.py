"""The I/O seam: which DCP writer and reader move a checkpoint's bytes (`checkpoint.io`).

Two choices, the same files and checksums either way (docs/checkpoint-format.md):

- `plain`: DCP's own FileSystemWriter and file system, each written stream wrapped only by
  `_DigestStream` (xxh3-64 over every byte written, the digest the manifest records). A load
  checks every file's checksum in a pass of its own first (resume.verify_files), then reads with
  fsdpkit's safe FileSystemReader (safe_io.py). Nothing here is tuned to a machine.
- `fast` (default): the local fast paths. Writing through hashing.HashingFileSystem (O_DIRECT
  via direct_io.py, or page-cache pieces with write-back hints: page_cache.py, writeback.py);
  reading through verified_read.VerifyingFileSystemReader (one read per file, hashed as it is read).

A URL checkpoint (object storage) takes DCP's fsspec writer and reader (safe_fsspec.py) with
either choice. save.py and resume.py ask this module; they name no fast path themselves.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch.distributed as tdist
import xxhash
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader

from fsdpkit.checkpoint.dcp_storage import hashing_writer as fast_writer
from fsdpkit.checkpoint.dcp_storage import safe_reader
from fsdpkit.checkpoint.hashing import HASH_NAME
from fsdpkit.checkpoint.mirror import Mirror
from fsdpkit.checkpoint.storage import RemotePath, is_url
from fsdpkit.checkpoint.verified_read import VerifyingFileSystemReader

PLAIN, FAST = "plain", "fast"
CHOICES = (PLAIN, FAST)  # checkpoint.io


def _check(io: str) -> None:
    if io not in CHOICES:
        raise ValueError(f"checkpoint.io is {io!r}; expected one of {', '.join(CHOICES)}")


class _DigestStream:
    """Passes writes to `raw` and hashes the bytes each write took; `size` and `digest()` after."""

    def __init__(self, raw: Any) -> None:
        self._raw, self._hash, self.size = raw, xxhash.xxh3_64(), 0

    def write(self, b: Any) -> int:
        data = memoryview(b).cast("B")  # count bytes, whatever the buffer's item format
        n = self._raw.write(data)
        n = len(data) if n is None else n
        self._hash.update(data[:n])
        self.size += n
        return n

    def digest(self) -> str:
        return self._hash.hexdigest()

    def writable(self) -> bool:
        return True

    def __getattr__(self, name: str) -> Any:  # tell, fileno (DCP's fsync), flush...: the file's own
        return getattr(self._raw, name)


class DigestFileSystem(FileSystem):
    """DCP's local FileSystem that records size and xxh3-64 of every file it writes in `files`
    (by name; `.metadata.tmp` is recorded as `.metadata`, the name DCP renames it to)."""

    def __init__(self) -> None:
        super().__init__()
        self.files: dict[str, dict[str, int | str]] = {}
        self._lock = threading.Lock()

    @contextmanager
    def create_stream(self, path: str | Path, mode: str) -> Iterator[Any]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with super().create_stream(path, mode) as raw:
            stream = _DigestStream(raw)
            yield stream  # a stream for all DCP does with it (write, tell, fileno, flush)
        name = Path(path).name.removesuffix(".tmp")
        with self._lock:  # only a file written to its end (no exception above) is recorded
            self.files[name] = {"size": stream.size, HASH_NAME: stream.digest()}


def hashing_writer(into: Path | RemotePath, *, io: str = FAST, thread_count: int,
                   mirror: Mirror | None = None) -> tuple[FileSystemWriter, Any]:
    """(DCP writer into `into`, its file system): after dcp.save, `fs.files` holds every written
    file's size and checksum. `io`: `plain` or `fast` (module docstring); a URL `into` takes the
    fsspec writer either way (teed into `mirror`, if given)."""
    _check(io)
    if io == FAST or isinstance(into, RemotePath):
        return fast_writer(into, thread_count=thread_count, mirror=mirror)
    fs = DigestFileSystem()
    writer = FileSystemWriter(into, sync_files=True, thread_count=thread_count)
    writer.fs = fs
    return writer, fs


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
        return VerifyingFileSystemReader(ckpt_dir, sizes={n: i["size"] for n, i in files.items()},
                                         hash_files=hash_files, group=group)
    if hash_files:
        raise ValueError(f"checkpoint.io={io}: the reader of {ckpt_dir} does not check files as it reads; "
                         "verify them before the load (a bug: please report it)")
    return safe_reader(ckpt_dir)
