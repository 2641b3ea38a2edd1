"""Find a tensor's bytes inside a `torch.save` blob without loading it or running its pickle.

Why: DCP's FileSystemWriter stores every tensor chunk as one `torch.save` blob (an uncompressed
zip: `<prefix>/data.pkl` describes the tensor, `<prefix>/data/<key>` holds the raw storage bytes)
at a byte range of a `.distcp` file. Knowing where the raw bytes start lets the exporter read
any rows of a chunk with a plain `pread` into a reused buffer: no copy of the whole chunk, no
mmap (which would count the file against RLIMIT_AS and the process's RSS); and the resume's reader
(checked_read.py) read only the rows it needs. `storage_span` finds the raw bytes from the zip
headers alone, unpickling nothing: what an item checksum leaves out (items.py).

`data.pkl` is decoded by `_TensorRecordUnpickler`, which accepts exactly the globals a tensor
pickle names (`torch._utils._rebuild_tensor_v2/_v3`, storage classes, dtypes, OrderedDict) and
maps them to inert stand-ins that only record sizes and strides. Anything else is refused with
UnsafeCheckpointError before it could run; nothing in the blob is ever called.
"""

from __future__ import annotations

import io
import pickle
import struct
import zipfile
from collections import OrderedDict
from dataclasses import dataclass
from typing import IO, Any

import torch

from fsdpkit.checkpoint.errors import CheckpointCorruptError, UnsafeCheckpointError
from fsdpkit.fileio import pread_into

# The legacy typed-storage classes a tensor pickle names (torch.<Name>), by the dtype they hold.
_STORAGE_DTYPES: dict[str, torch.dtype] = {
    "DoubleStorage": torch.float64,
    "FloatStorage": torch.float32,
    "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16,
    "LongStorage": torch.int64,
    "IntStorage": torch.int32,
    "ShortStorage": torch.int16,
    "CharStorage": torch.int8,
    "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
    "ComplexDoubleStorage": torch.complex128,
    "ComplexFloatStorage": torch.complex64,
}
_ZIP_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")  # 30 bytes; the last two are name and extra lengths


@dataclass(frozen=True)
class TensorPayload:
    """Where the elements of one saved tensor lie, relative to the start of its blob."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int  # in elements, from `data_start`
    data_start: int  # byte offset of the storage record's first byte within the blob
    storage_bytes: int  # length of the storage record

    @property
    def is_contiguous(self) -> bool:
        expected, step = [], 1
        for size in reversed(self.shape):
            expected.append(step)
            step *= size
        return all(size <= 1 or s == e for size, s, e in zip(self.shape, self.stride, reversed(expected), strict=True))


@dataclass(frozen=True)
class _StorageRef:
    key: str
    dtype: torch.dtype | None  # None for UntypedStorage (the dtype comes from _rebuild_tensor_v3)
    numel: int


@dataclass(frozen=True)
class _TensorRecord:
    storage: _StorageRef
    storage_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


def _rebuild_v2(storage: _StorageRef, storage_offset: int, size: tuple, stride: tuple, *_: Any) -> _TensorRecord:
    if storage.dtype is None:
        raise pickle.UnpicklingError("an untyped storage without a dtype")
    return _TensorRecord(storage, int(storage_offset), tuple(size), tuple(stride), storage.dtype)


def _rebuild_v3(storage: _StorageRef, storage_offset: int, size: tuple, stride: tuple, _grad: bool, _hooks: Any,
                dtype: torch.dtype, *_: Any) -> _TensorRecord:
    if not isinstance(dtype, torch.dtype):
        raise pickle.UnpicklingError(f"{dtype!r} is not a dtype")
    return _TensorRecord(storage, int(storage_offset), tuple(size), tuple(stride), dtype)


class _UntypedStorageTag:
    """Stands for `torch.storage.UntypedStorage` in a persistent id; never instantiated."""


class _TensorRecordUnpickler(pickle.Unpickler):
    """Decodes a tensor's `data.pkl` into a _TensorRecord; refuses every other global."""

    def __init__(self, file: IO[bytes], *, source: str) -> None:
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild_v2
        if module == "torch._utils" and name == "_rebuild_tensor_v3":
            return _rebuild_v3
        if module == "collections" and name == "OrderedDict":
            return OrderedDict
        if module == "torch.storage" and name == "UntypedStorage":
            return _UntypedStorageTag
        if module == "torch" and name in _STORAGE_DTYPES:
            return _STORAGE_DTYPES[name]
        if module == "torch" and isinstance(vars(torch).get(name), torch.dtype):
            return vars(torch)[name]
        raise UnsafeCheckpointError(
            f"`{self.source}` asks to load `{module}.{name}`, which a saved tensor never needs; refusing to "
            "unpickle it (nothing was executed). The file is corrupt or was crafted"
        )

    def persistent_load(self, pid: Any) -> _StorageRef:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"unexpected persistent id {pid!r}")
        _, storage_type, key, _location, numel = pid
        dtype = None if storage_type is _UntypedStorageTag else storage_type
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise pickle.UnpicklingError(f"unexpected storage type {storage_type!r}")
        return _StorageRef(str(key), dtype, int(numel))


def _read_record(source: str, pickled: bytes) -> _TensorRecord:
    try:
        record = _TensorRecordUnpickler(io.BytesIO(pickled), source=source).load()
    except UnsafeCheckpointError:
        raise
    except Exception as exc:  # any decoding failure of untrusted bytes means "corrupt"
        raise CheckpointCorruptError(f"`{source}` does not hold a readable saved tensor ({type(exc).__name__}: "
                                     f"{exc})") from exc
    if not isinstance(record, _TensorRecord):
        raise CheckpointCorruptError(f"`{source}` holds a {type(record).__name__}, not a tensor")
    return record


def locate_tensor(blob: IO[bytes], *, source: str) -> TensorPayload:
    """Parse the `torch.save` zip in `blob` (a seekable view of exactly that blob).

    Reads only the zip directory, `data.pkl`, `byteorder` and their local file headers (a few
    hundred bytes).

    Raises:
        UnsafeCheckpointError: data.pkl names a global outside the tensor allow-list.
        CheckpointCorruptError: not a zip, compressed, big-endian, or the storage record is short.
    """
    infos, prefix = _directory(blob, source)
    pkl = infos[f"{prefix}data.pkl"]
    # Records are read raw, not with archive.read: that checks each record's CRC32, which
    # checkpoints written with torch.save's CRC32 off (fsdpkit writes them so) leave at 0.
    order = infos.get(f"{prefix}byteorder")
    if order is not None and _stored_bytes(blob, order, source) != b"little":
        raise CheckpointCorruptError(f"`{source}` was saved big-endian; only little-endian checkpoints are supported")
    record = _read_record(source, _stored_bytes(blob, pkl, source))
    name = f"{prefix}data/{record.storage.key}"
    info = infos.get(name)
    if info is None:
        raise CheckpointCorruptError(f"`{source}` lacks the storage record {name}")
    data_start = _data_start(blob, info, source)
    itemsize = record.dtype.itemsize
    needed = (record.storage_offset + _extent(record.shape, record.stride)) * itemsize
    if info.file_size < needed:
        raise CheckpointCorruptError(f"`{source}`: storage record holds {info.file_size} bytes, the tensor needs "
                                     f"{needed}")
    blob.seek(0, io.SEEK_END)
    if data_start + info.file_size > blob.tell():
        raise CheckpointCorruptError(f"`{source}`: storage record runs past the end of the blob (truncated)")
    return TensorPayload(dtype=record.dtype, shape=record.shape, stride=record.stride,
                         storage_offset=record.storage_offset, data_start=data_start, storage_bytes=info.file_size)


def storage_span(blob: IO[bytes], *, source: str) -> tuple[int, int]:
    """[start, end) of the one storage record (`<prefix>/data/<key>`: the tensor's elements) of the
    `torch.save` archive of a tensor in `blob` (a seekable view of exactly that archive).

    Reads the zip directory and that record's local header only: nothing is unpickled, so it may
    run on bytes not yet checked (io/items.py leaves the span out of a tensor item's checksum).

    Raises:
        CheckpointCorruptError: not a zip archive, no data.pkl, not exactly one storage record, a
            compressed record, or a record that runs past the end of the blob.
    """
    infos, prefix = _directory(blob, source)
    records = [info for name, info in infos.items() if name.startswith(f"{prefix}data/")]
    if len(records) != 1:
        raise CheckpointCorruptError(f"`{source}` holds {len(records)} storage records, a saved tensor one: the file "
                                     "is truncated or garbled")
    start = _data_start(blob, records[0], source)
    end = start + records[0].file_size
    if end > blob.seek(0, io.SEEK_END):
        raise CheckpointCorruptError(f"`{source}`: storage record runs past the end of the blob (truncated)")
    return start, end


def _directory(blob: IO[bytes], source: str) -> tuple[dict[str, zipfile.ZipInfo], str]:
    """The records of a `torch.save` archive by name, and their common prefix (`<name>/`)."""
    try:
        archive = zipfile.ZipFile(blob)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as exc:
        raise CheckpointCorruptError(f"`{source}` is not a torch.save archive ({exc}); the file is truncated or "
                                     "garbled") from None
    with archive:
        infos = {i.filename: i for i in archive.infolist()}
    pkl = next((name for name in infos if name.endswith("/data.pkl") or name == "data.pkl"), None)
    if pkl is None:
        raise CheckpointCorruptError(f"`{source}` has no data.pkl: not a torch.save archive")
    return infos, pkl[: -len("data.pkl")]


def _data_start(blob: IO[bytes], info: zipfile.ZipInfo, source: str) -> int:
    """Offset of the first byte of the stored (uncompressed) record `info` within `blob`."""
    if info.compress_type != zipfile.ZIP_STORED:
        raise CheckpointCorruptError(f"`{source}`: record {info.filename} is compressed; torch.save never does that")
    blob.seek(info.header_offset)
    header = blob.read(_ZIP_LOCAL_HEADER.size)
    if len(header) != _ZIP_LOCAL_HEADER.size or header[:4] != b"PK\x03\x04":
        raise CheckpointCorruptError(f"`{source}`: bad zip local header for {info.filename}")
    fields = _ZIP_LOCAL_HEADER.unpack(header)
    return info.header_offset + _ZIP_LOCAL_HEADER.size + fields[-2] + fields[-1]


def _stored_bytes(blob: IO[bytes], info: zipfile.ZipInfo, source: str) -> bytes:
    blob.seek(_data_start(blob, info, source))
    data = blob.read(info.file_size)
    if len(data) != info.file_size:
        raise CheckpointCorruptError(f"`{source}`: record {info.filename} runs past the end of the blob (truncated)")
    return data


def _extent(shape: tuple[int, ...], stride: tuple[int, ...]) -> int:
    """Elements spanned by a strided tensor (0 when it is empty)."""
    if any(s == 0 for s in shape):
        return 0
    return 1 + sum((size - 1) * st for size, st in zip(shape, stride, strict=True))


class Window(io.RawIOBase):
    """A read-only, seekable file of `length` bytes whose bytes a subclass supplies (`_fill`):
    what zipfile needs of a blob inside a larger file.

    Why not DCP's `_create_file_view`: zipfile seeks relative to the end of the archive, which
    that view does not support.
    """

    def __init__(self, length: int) -> None:
        super().__init__()
        self._length, self._pos = length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        n = max(0, min(len(view), self._length - self._pos))
        if n == 0:
            return 0
        got = self._fill(view[:n], self._pos)
        self._pos += got
        return got

    def _fill(self, view: memoryview, pos: int) -> int:
        """Fill `view` with the bytes at `pos`; returns how many it could (fewer at a file's end)."""
        raise NotImplementedError


class FileWindow(Window):
    """Bytes [start, start + length) of an open binary file, as a file.

    On a file with a descriptor, reads are positional (pread): the file's own position is neither
    used nor moved, so windows on one file may be read from several threads at once. Other file
    objects (object storage through fsspec) are read by seeking them: one thread at a time.
    """

    def __init__(self, raw: IO[bytes], start: int, length: int) -> None:
        super().__init__(length)
        self._raw, self._start = raw, start
        try:
            self._fd: int | None = raw.fileno()
        except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both of the latter
            self._fd = None

    def _fill(self, view: memoryview, pos: int) -> int:
        if self._fd is not None:
            return pread_into(self._fd, view, self._start + pos)
        self._raw.seek(self._start + pos)
        return self._raw.readinto(view) or 0
