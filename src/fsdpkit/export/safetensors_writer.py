"""Writing safetensors as a stream: the header first, then each tensor's bytes piece by piece.

Why not `safetensors.torch.save_file`: it needs every tensor of a file in memory at once. The
format (fsdpkit.hf.safetensors_reader describes it) is simple enough to stream: every shape and
dtype is known before the first byte is written (from the checkpoint's metadata), so the header
goes first and the tensors follow piece by piece.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import sys
from collections.abc import Iterable
from pathlib import Path

import torch

from fsdpkit.hf.safetensors_reader import DTYPE_CODES


def shard_file_name(index: int, count: int) -> str:
    """Hugging Face's name for shard `index` (1-based) of `count`."""
    return f"model-{index:05d}-of-{count:05d}.safetensors"


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
