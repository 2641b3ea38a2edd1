"""DCP's fsspec reader and writer wired to fsdpkit's `RemotePath` filesystems: the reader with the
safe `.metadata` unpickling of safe_io.py, the writer with per-file checksums (hashing.py).
Imported only for URLs: it needs fsspec (the `remote` extra)."""

from __future__ import annotations

from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

from fsdpkit.checkpoint.hashing import HashingFileSystem
from fsdpkit.checkpoint.safe_io import SafeMetadataReading
from fsdpkit.checkpoint.storage import RemotePath


class SafeFsspecReader(SafeMetadataReading, FsspecReader):
    """`FsspecReader` reading `.metadata` through `SafeUnpickler`. Tensor items are read as DCP
    reads them from any file: per file, a seek and a read of each item's byte range, which an
    fsspec object-store file turns into ranged GETs (with read-ahead of the filesystem's block size)."""


def fsspec_reader(ckpt_dir: RemotePath) -> SafeFsspecReader:
    reader = SafeFsspecReader(ckpt_dir.url)
    reader.fs.fs = ckpt_dir.fs  # ours: configured with checkpoint.storage_options, no listing cache
    return reader


def fsspec_writer(into: RemotePath, *, thread_count: int, die_mid_write: bool) -> tuple[FsspecWriter, HashingFileSystem]:
    """A DCP writer into `into` whose files are checksummed as they stream out. sync_files=False:
    an object is durable once its upload completes (on close); DCP would otherwise call os.sync()
    for every file, since a network stream has no fileno to fsync."""
    writer = FsspecWriter(into.url, sync_files=False, thread_count=thread_count)
    writer.fs.fs = into.fs
    fs = HashingFileSystem(die_mid_write=die_mid_write, base=writer.fs)
    writer.fs = fs
    return writer, fs
