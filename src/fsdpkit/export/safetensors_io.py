"""The safetensors format, written as a stream; headers read without touching tensor data.

Why not `safetensors.torch.save_file`: it needs every tensor of a file in memory at once. The
format is simple enough to stream (https://huggingface.co/docs/safetensors, "Format"):

    8 bytes   N, little-endian u64: length of the header
    N bytes   JSON: {"__metadata__": {str: str}, name: {"dtype": "F32", "shape": [..],
              "data_offsets": [begin, end]}, ...}, padded with spaces to a multiple of 8
    ...       the tensors' bytes, little-endian, row-major, at data_offsets (relative to the
              end of the header), back to back with no gaps

Every shape and dtype is known before the first byte is written (from the checkpoint's
metadata), so the header goes first and the tensors follow piece by piece.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from fsdpkit.checkpoint.errors import CheckpointCorruptError

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


def shard_file_name(index: int, count: int) -> str:
    """Hugging Face's name for shard `index` (1-based) of `count`."""
    return f"model-{index:05d}-of-{count:05d}.safetensors"


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
    with path.open("rb") as f:  # a local Path, or a RemotePath (two ranged reads)
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


def plan_shards(sizes: list[tuple[str, int]], *, max_shard_size: int) -> list[list[str]]:
    """Split tensors (in order) into files of at most `max_shard_size` bytes each, greedily; a
    tensor larger than the limit gets a file of its own (as transformers does)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, nbytes in sizes:
        if shards[-1] and used + nbytes > max_shard_size:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += nbytes
    return shards


class StreamingSafetensorsWriter:
    """Writes one safetensors file: the header at once, then each tensor's bytes piece by piece,
    in the order given. `close()` checks that every byte arrived, then fsyncs."""

    def __init__(self, path: Path, layout: list[tuple[str, tuple[int, ...], torch.dtype]], *,
                 metadata: dict[str, str] | None = None) -> None:
        if sys.byteorder != "little":
            raise RuntimeError("safetensors is little-endian; writing it on a big-endian host is not supported")
        self.path = path
        self._sizes: list[tuple[str, int]] = []
        header: dict[str, object] = {"__metadata__": dict(metadata or {})}
        position = 0
        for name, shape, dtype in layout:
            if dtype not in DTYPE_CODES:
                raise ValueError(f"{name}: safetensors cannot store {dtype}")
            nbytes = dtype.itemsize
            for s in shape:
                nbytes *= s
            header[name] = {"dtype": DTYPE_CODES[dtype], "shape": list(shape),
                            "data_offsets": [position, position + nbytes]}
            self._sizes.append((name, nbytes))
            position += nbytes
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)
        self.data_bytes = position
        self.file_bytes = 8 + len(encoded) + position
        self._next = 0
        self._out = path.open("wb")  # noqa: SIM115 (closed by close() or abort())
        self._out.write(struct.pack("<Q", len(encoded)) + encoded)

    def write_tensor(self, name: str, pieces: Iterable[torch.Tensor]) -> None:
        """Append `name`'s bytes; `pieces` are consecutive row blocks (already in the file's dtype)."""
        expected_name, expected = self._sizes[self._next]
        if name != expected_name:
            raise AssertionError(f"tensors must be written in header order: expected {expected_name}, got {name}")
        written = 0
        for piece in pieces:
            flat = piece.detach().contiguous().reshape(-1).view(torch.uint8)
            self._out.write(memoryview(flat.numpy()))
            written += flat.numel()
        if written != expected:
            raise AssertionError(f"{name}: wrote {written} bytes, the header promised {expected}")
        self._next += 1

    def close(self) -> None:
        """Check completeness, fsync and close. Raises AssertionError if a tensor is missing."""
        if self._next != len(self._sizes):
            self._out.close()
            raise AssertionError(f"{self.path}: {len(self._sizes) - self._next} tensor(s) were never written")
        try:
            self._out.flush()
            os.fsync(self._out.fileno())
        finally:
            self._out.close()

    def abort(self) -> None:
        """Close without checks (the caller is failing and removes the file)."""
        with contextlib.suppress(OSError):  # what is left unwritten (a full disk) goes with the file
            self._out.close()
