"""DCP's fsspec reader and writer wired to fsdpkit's `RemotePath` filesystems: the reader with the
safe `.metadata` unpickling of safe_io.py, the writer with per-file checksums (hashing.py).
Imported only for URLs: it needs fsspec (the `remote` extra)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

from torch.distributed.checkpoint._fsspec_filesystem import FileSystem as DcpFsspecFileSystem
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

from fsdpkit.checkpoint.hashing import DigestFileSystem
from fsdpkit.checkpoint.safe_io import SafeMetadataReading
from fsdpkit.checkpoint.storage import RemotePath
from fsdpkit.checkpoint.storage.mirror import Mirror, TeeStream
from fsdpkit.checkpoint.storage.multipart import OverlappedUpload, is_s3


class SafeFsspecReader(SafeMetadataReading, FsspecReader):
    """`FsspecReader` reading `.metadata` through `SafeUnpickler`. Tensor items are read as DCP
    reads them from any file: per file, a seek and a read of each item's byte range, which an
    fsspec object-store file turns into ranged GETs (with read-ahead of the filesystem's block size)."""


def fsspec_reader(ckpt_dir: RemotePath) -> SafeFsspecReader:
    reader = SafeFsspecReader(ckpt_dir.url)
    reader.fs.fs = ckpt_dir.fs  # ours: configured with checkpoint.storage_options, no listing cache
    return reader


class UploadingFileSystem(DcpFsspecFileSystem):
    """DCP's fsspec filesystem whose S3 writes overlap their multipart parts (multipart.py) and,
    with `checkpoint.local_dir`, leave a copy of every file in `mirror` (mirror.py). Reads and
    other schemes' writes are DCP's."""

    mirror: Path | None = None

    @contextmanager
    def create_stream(self, path, mode: str) -> Iterator:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        local = (self.mirror / Path(str(path)).name).open("wb") if self.mirror is not None else nullcontext()
        with local as copy:  # a partial copy left by an error is no checkpoint (mirror.py: no manifest)
            if not is_s3(self.fs):
                with super().create_stream(path, mode) as stream:
                    yield stream if copy is None else TeeStream(stream, copy)
                return
            upload = OverlappedUpload(self.fs, str(path))
            try:
                yield upload if copy is None else TeeStream(upload, copy)
                upload.commit()
            except BaseException:
                upload.abort()
                raise

    def rename(self, path, new_path) -> None:
        super().rename(path, new_path)  # DCP's .metadata.tmp -> .metadata
        if self.mirror is not None:
            os.replace(self.mirror / Path(str(path)).name, self.mirror / Path(str(new_path)).name)


def fsspec_writer(into: RemotePath, *, thread_count: int,
                  mirror: Mirror | None = None) -> tuple[FsspecWriter, DigestFileSystem]:
    """A DCP writer into `into` whose files are checksummed as they stream out. sync_files=False:
    an object is durable once its upload completes (on close); DCP would otherwise call os.sync()
    for every file, since a network stream has no fileno to fsync. S3 files upload several parts at
    once (multipart.py), as `s3fs.put` does; with a `mirror` (the Checkpointer's
    `checkpoint.local_dir`) each file is also written to its local copy (mirror.py)."""
    writer = FsspecWriter(into.url, sync_files=False, thread_count=thread_count)
    uploads = UploadingFileSystem()
    uploads.fs, uploads.mirror = into.fs, (mirror.start_writing(into) if mirror is not None else None)
    fs = DigestFileSystem(base=uploads)
    writer.fs = fs
    return writer, fs
