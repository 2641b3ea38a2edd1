"""DCP's fsspec reader and writer wired to fsdpkit's `RemotePath` filesystems (RemotePath.dcp_reader
and dcp_writer make them): the reader with the
safe `.metadata` unpickling of safe_io.py, the writer with per-file checksums (hashing.py).
Imported only for URLs: it needs fsspec (the `remote` extra)."""

from __future__ import annotations

import dataclasses
import io
import os
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from torch.distributed.checkpoint._fsspec_filesystem import FileSystem as DcpFsspecFileSystem
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner

from fsdpkit.checkpoint.hashing import DigestFileSystem
from fsdpkit.checkpoint.safe_io import SafeMetadataReading
from fsdpkit.checkpoint.storage.mirror import Mirror, TeeStream
from fsdpkit.checkpoint.storage.multipart import OverlappedUpload, is_s3
from fsdpkit.checkpoint.storage.remote import RemotePath
from fsdpkit.tunables import DEFAULTS

if TYPE_CHECKING:
    from fsdpkit.checkpoint.settings import IOSettings


class SafeFsspecReader(SafeMetadataReading, FsspecReader):
    """`FsspecReader` reading `.metadata` through `SafeUnpickler`, and the items of this rank's plan
    in ranged GETs of exactly their bytes: each file's items in the order of their bytes, a run of
    adjacent items in one GET of at most `range_bytes` (IOSettings.remote_range_bytes) (an item longer than that: in
    GETs of that size), held in memory while its items load. Through DCP's open file, s3fs's
    read-ahead (its block size after every seek) and torch.load's seeks inside an item fetched 2.2x
    an HSDP checkpoint's bytes from moto's S3 server for a load that reads each item once, and one GET
    per item was 5x slower there (bench/RESULTS-replicas.md)."""

    range_bytes: int = DEFAULTS.remote_range_bytes  # fsspec_reader sets it from IOSettings
    _wanted: dict[str, list[tuple[int, int]]] | None = None  # file -> its items' [start, end), by start
    _window: tuple[str, int, memoryview] | None = None  # (file, its first byte, the bytes)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """DCP's read, each file's items in the order of their bytes (DCP's own order is the plan's)."""
        def where(item: Any) -> tuple[str, int]:
            info = self.storage_data[item.storage_index]
            return info.relative_path, info.offset

        items = sorted(plan.items, key=where)
        self._wanted = {}
        for item in items:
            info = self.storage_data[item.storage_index]
            self._wanted.setdefault(info.relative_path, []).append((info.offset, info.offset + info.length))
        try:
            return super().read_data(dataclasses.replace(plan, items=items), planner)
        finally:
            self._wanted = self._window = None

    def _slice_file(self, file: Any, sinfo: Any) -> IO[bytes]:
        fs, path = getattr(file, "fs", None), getattr(file, "path", None)
        if fs is None or path is None or self._wanted is None:  # not an fsspec file: DCP's own view of it
            return super()._slice_file(file, sinfo)
        start, end = sinfo.offset, sinfo.offset + sinfo.length
        window = self._window
        if window is None or window[0] != sinfo.relative_path or not window[1] <= start < end <= window[1] + len(
                window[2]):
            most, stop = self.range_bytes, end
            for first, last in self._wanted.get(sinfo.relative_path, []):  # the adjacent items that follow
                if first == stop and last - start <= most:
                    stop = last
                elif first >= stop:
                    break
            self._window = window = (sinfo.relative_path, start, _fetch(fs, path, start, stop, most=most))
        return _Bytes(window[2][start - window[1]:end - window[1]])


def _fetch(fs: Any, path: str, start: int, stop: int, *, most: int) -> memoryview:
    """Bytes [start, stop) of `path` in ranged GETs of at most `most` bytes."""
    view, done = memoryview(bytearray(stop - start)), 0
    while done < len(view):
        piece = fs.cat_file(path, start=start + done, end=start + min(len(view), done + most))
        if not piece:
            raise EOFError(f"{path} ends at byte {start + done}, before byte {stop} of a checkpoint item: truncated")
        view[done:done + len(piece)] = piece
        done += len(piece)
    return view


class _Bytes(io.RawIOBase):
    """A read-only, seekable file over bytes in memory (io.BytesIO would copy them)."""

    def __init__(self, data: memoryview) -> None:
        self._view, self._pos = data, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        n = min(len(buffer), len(self._view) - self._pos)
        memoryview(buffer).cast("B")[:n] = self._view[self._pos:self._pos + n]
        self._pos += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos


def fsspec_reader(ckpt_dir: RemotePath, *, io: IOSettings) -> SafeFsspecReader:
    reader = SafeFsspecReader(ckpt_dir.url)
    reader.fs.fs = ckpt_dir.fs  # ours: configured with checkpoint.storage_options, no listing cache
    reader.range_bytes = io.remote_range_bytes
    return reader


class UploadingFileSystem(DcpFsspecFileSystem):
    """DCP's fsspec filesystem whose S3 writes overlap their multipart parts (multipart.py) and,
    with `checkpoint.local_dir`, leave a copy of every file in `mirror` (mirror.py). Reads and
    other schemes' writes are DCP's."""

    mirror: Path | None = None
    part_bytes: int | None = None  # an S3 upload's parts (IOSettings.remote_part_bytes; None: OverlappedUpload's)
    in_flight: int | None = None  # parts of one object uploaded at once (IOSettings.remote_parts_in_flight)

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
            upload = OverlappedUpload(self.fs, str(path), part_bytes=self.part_bytes, in_flight=self.in_flight)
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


def fsspec_writer(into: RemotePath, *, thread_count: int, io: IOSettings,
                  mirror: Mirror | None = None) -> tuple[FsspecWriter, DigestFileSystem]:
    """A DCP writer into `into` whose files are checksummed as they stream out. sync_files=False:
    an object is durable once its upload completes (on close); DCP would otherwise call os.sync()
    for every file, since a network stream has no fileno to fsync. S3 files upload several parts at
    once (multipart.py), as `s3fs.put` does; with a `mirror` (the Checkpointer's
    `checkpoint.local_dir`) each file is also written to its local copy (mirror.py)."""
    writer = FsspecWriter(into.url, sync_files=False, thread_count=thread_count)
    uploads = UploadingFileSystem()
    uploads.fs, uploads.mirror = into.fs, (mirror.start_writing(into) if mirror is not None else None)
    uploads.part_bytes, uploads.in_flight = io.remote_part_bytes, io.remote_parts_in_flight
    fs = DigestFileSystem(base=uploads)
    writer.fs = fs
    return writer, fs
