"""Reading safetensors files: a header without touching tensor data, the weight files of a Hugging
Face folder, and `SafetensorsReader`, the one reader of their rows (model import and checkpoint
export both read through it).

The format (https://huggingface.co/docs/safetensors, "Format"):

    8 bytes   N, little-endian u64: length of the header
    N bytes   JSON: {"__metadata__": {str: str}, name: {"dtype": "F32", "shape": [..],
              "data_offsets": [begin, end]}, ...}, padded with spaces to a multiple of 8
    ...       the tensors' bytes, little-endian, row-major, at data_offsets (relative to the
              end of the header), back to back with no gaps
"""

from __future__ import annotations

import json
import math
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from fsdpkit.checkpoint.errors import CheckpointCorruptError
from fsdpkit.checkpoint.storage import RangeReader, StoragePath, open_storage

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
MAX_HEADER_BYTES = 100 << 20  # what the safetensors library itself accepts

DTYPE_CODES: dict[torch.dtype, str] = {
    torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16", torch.uint16: "U16",
    torch.float16: "F16", torch.bfloat16: "BF16", torch.int32: "I32", torch.uint32: "U32",
    torch.float32: "F32", torch.float64: "F64", torch.int64: "I64", torch.uint64: "U64",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.complex64: "C64",
}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


@dataclass(frozen=True)
class Header:
    tensors: dict[str, tuple[torch.dtype, list[int], int, int]]  # name -> (dtype, shape, begin, end)
    metadata: dict[str, str]
    data_start: int


def read_header(path: Path) -> Header:
    """Parse and check a safetensors header (offsets tile the data, the file is long enough).

    Raises:
        FileNotFoundError: no such file.
        CheckpointCorruptError: not a safetensors file, or truncated.
    """
    with path.open("rb") as f:  # a local file, or an object (two ranged reads)
        head = f.read(8)
        if len(head) != 8:
            raise CheckpointCorruptError(f"{path} is not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES:
            raise CheckpointCorruptError(f"{path} is not a safetensors file (header length {n})")
        raw = f.read(n)
    size = path.stat().st_size
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointCorruptError(f"{path} has an unreadable safetensors header ({exc})") from None
    if not isinstance(header, dict):
        raise CheckpointCorruptError(f"{path} has an unreadable safetensors header")
    metadata = header.pop("__metadata__", None) or {}
    tensors, spans = {}, []
    for name, info in header.items():
        try:
            dtype = CODE_DTYPES[info["dtype"]]
            begin, end = (int(x) for x in info["data_offsets"])
            shape = [int(s) for s in info["shape"]]
        except (KeyError, TypeError, ValueError):
            raise CheckpointCorruptError(f"{path}: unreadable header entry for {name!r}: {info!r}") from None
        numel = 1
        for s in shape:
            numel *= s
        if end - begin != numel * dtype.itemsize:
            raise CheckpointCorruptError(f"{path}: {name} spans {end - begin} bytes, its shape needs "
                                         f"{numel * dtype.itemsize}")
        tensors[name] = (dtype, shape, begin, end)
        spans.append((begin, end))
    position = 0
    for begin, end in sorted(spans):
        if begin != position:
            raise CheckpointCorruptError(f"{path}: the header's data offsets leave a gap or overlap at byte {begin}")
        position = end
    if 8 + n + position != size:
        raise CheckpointCorruptError(f"{path} has {size} bytes, its header describes {8 + n + position} (truncated or "
                                     "padded)")
    return Header(tensors, metadata, 8 + n)


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files of a Hugging Face folder: those its index names, else model.safetensors,
    else every *.safetensors file (sorted)."""
    if (folder / INDEX_FILE).is_file():
        try:
            weight_map = json.loads((folder / INDEX_FILE).read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointCorruptError(f"{folder / INDEX_FILE} is not a valid index ({exc})") from None
        return [folder / name for name in sorted(set(weight_map.values()))]
    if (folder / SINGLE_FILE).is_file():
        return [folder / SINGLE_FILE]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} holds no .safetensors file and no {INDEX_FILE}")
    return files


class SafetensorsReader:
    """The tensors of one or more safetensors files (a Hugging Face folder's shards), read a piece
    at a time with plain reads instead of a memory map: a piece costs one read of the dim-0 rows it
    spans (other dims are cut in memory), straight into the caller's buffer when given one, so a
    rank reads only its own shard's rows and holds no page of the file once they are copied (mapped
    pages would stay resident, counted in its RSS, until the file is closed). Local files are read
    with `pread` (threads may read at once), files in object storage with ranged GETs. Each header
    is read once, when the reader opens. Close it (or use it as a context manager).

    Raises:
        CheckpointCorruptError: a file is not safetensors or is truncated, or two files hold a
            tensor of the same name (which one a loader took would depend on the order it read them).
    """

    def __init__(self, files: Sequence[Path | StoragePath]) -> None:
        self._headers: dict[Path | StoragePath, Header] = {}
        self._where: dict[str, Path | StoragePath] = {}
        for file in files:
            self._headers[file] = header = read_header(file)
            for name in header.tensors:
                if name in self._where:
                    raise CheckpointCorruptError(
                        f"{name} is in both {self._where[name]} and {file}; a model folder holds each tensor once: "
                        "remove the stale file (or the index entry that names it)")
                self._where[name] = file
        self._ranges: dict[Path | StoragePath, RangeReader] = {}
        self._lock = threading.Lock()  # opening a file; reads themselves are positional

    def tensors(self) -> dict[str, tuple[torch.dtype, list[int]]]:
        """name -> (dtype, shape) of every tensor, file by file in the order given."""
        return {name: self._entry(name)[:2] for name in self._where}

    def file_of(self, name: str) -> Path | StoragePath:
        return self._where[name]

    def read_rows(self, name: str, start: int, stop: int, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows [start, stop) of `name`'s dim 0 in its stored dtype (a 0-dim tensor is one row and
        comes back 0-dim), read into `out` when given (that shape), else into a new tensor."""
        dtype, shape, begin, _ = self._entry(name)
        rows = [stop - start, *shape[1:]] if shape else []
        into = out if out is not None and out.is_contiguous() and out.dtype == dtype else torch.empty(rows, dtype=dtype)
        if into.numel():
            view = memoryview(into.reshape(-1).view(torch.uint8).numpy())
            offset = self._headers[self._where[name]].data_start + begin + start * dtype.itemsize * math.prod(shape[1:])
            got = self._read_into(self._where[name], view, offset)
            if got != len(view):
                raise CheckpointCorruptError(f"{self._where[name]}: {name} ends early ({got} of {len(view)} bytes)")
        if out is not None and into is not out:
            out.copy_(into.reshape(out.shape))
            return out
        return into

    def read(self, name: str, piece: tuple[slice, ...] = ()) -> torch.Tensor:
        """The part of `name` that `piece` (one slice per dim, steps of 1) selects, or all of it."""
        shape = self._entry(name)[1]
        if not shape:
            return self.read_rows(name, 0, 1)
        first = piece[0] if piece else slice(0, shape[0])
        start = first.start or 0
        rows = self.read_rows(name, start, max(start, min(shape[0], shape[0] if first.stop is None else first.stop)))
        return rows[(slice(None), *piece[1:])]

    def _entry(self, name: str) -> tuple[torch.dtype, list[int], int, int]:
        return self._headers[self._where[name]].tensors[name]

    def _read_into(self, file: Path | StoragePath, view: memoryview, offset: int) -> int:
        with self._lock:
            if file not in self._ranges:
                self._ranges[file] = open_storage(file).open_ranges()
            ranges = self._ranges[file]
        return ranges.read_into(view, offset)

    def close(self) -> None:
        with self._lock:
            for ranges in self._ranges.values():
                ranges.close()
            self._ranges.clear()

    def __enter__(self) -> SafetensorsReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
