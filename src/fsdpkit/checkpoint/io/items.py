"""Item checksums: every item of a DCP data file checked as a load reads it (docs/checkpoint-format.md 4.4).

A `.distcp` file holds DCP's items back to back: for each chunk of a tensor a `torch.save` archive
of it, for each non-tensor value a `torch.save` of the value. A manifest's `files.<name>.items`
holds one XXH3-64 per item of that file, in the order of their offsets, 16 hex digits each, so that a
load checks each item's bytes from the one read that loads them, before anything decodes them:

- a non-tensor item, or a tensor that the manifest's `tensors` does not list (the RNG states):
  every byte of the item;
- a tensor that `tensors` lists: every byte but its storage record (its elements,
  `torch_save.storage_span`), so the zip headers, `data.pkl` and the zip directory. Its elements
  are proven after the load by the tensor's own checksum (4.2), whatever rows each rank read, so
  a load at another world size reads only the rows it needs.

`digest_files` computes them after a save, from the files the rank wrote; `read_item` is the read
that both sides share (the load's reader: io/checked_read.py).
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

from fsdpkit.checkpoint.errors import CheckpointCorruptError
from fsdpkit.checkpoint.io.torch_save import Window, storage_span

ITEMS = "items"  # the field of a `files` entry
DIGEST_HEX = 16  # hex digits per item
SMALL_ITEM_BYTES = 64 << 10  # items up to this size are read whole (one read); larger ones piece by piece

ReadAt = Callable[[int, int], bytes]
"""(offset within the item, length) -> exactly those bytes of the item."""


@dataclass(frozen=True)
class ItemBytes:
    """One item as its checksum reads it: whole (`data`), or, for a tensor whose elements are
    proven by its own checksum, without its storage record (`head` and `tail` around `span`)."""

    digest: str  # the item checksum of the bytes read
    length: int
    span: tuple[int, int] | None  # the storage record left out; None: every byte counted
    data: bytes | None = None  # every byte, when read whole
    head: bytes = b""  # bytes [0, span[0]) when not read whole
    tail: bytes = b""  # bytes [span[1], length) when not read whole


def read_item(read_at: ReadAt, length: int, *, whole: bool, source: str) -> ItemBytes:
    """Read one item of `length` bytes and compute its checksum. `whole`: every byte counts (a
    non-tensor item, a tensor `tensors` does not list); else the storage record is left out and,
    for an item over SMALL_ITEM_BYTES, not read. Nothing is unpickled here: the record is found
    from the zip headers alone.

    Raises:
        CheckpointCorruptError: the item is not a torch.save archive of one tensor (when not
            `whole`), or the file ends inside it.
    """
    if whole or length <= SMALL_ITEM_BYTES:
        data = read_at(0, length)
        if whole:
            return ItemBytes(digest=xxhash.xxh3_64_hexdigest(data), length=length, span=None, data=data)
        start, end = storage_span(io.BytesIO(data), source=source)
        return ItemBytes(digest=_frame_digest(data[:start], data[end:]), length=length, span=(start, end), data=data)
    start, end = storage_span(_Window(read_at, length), source=source)
    head, tail = read_at(0, start), read_at(end, length - end)
    return ItemBytes(digest=_frame_digest(head, tail), length=length, span=(start, end), head=head, tail=tail)


def _frame_digest(head: bytes, tail: bytes) -> str:
    h = xxhash.xxh3_64()
    h.update(head)
    h.update(tail)
    return h.hexdigest()


def file_items(storage_data: dict[Any, Any], name: str) -> list[tuple[int, int, str]]:
    """(offset, length, key) of every item of data file `name` in `.metadata`'s storage_data, by offset."""
    return sorted((info.offset, info.length, index.fqn) for index, info in storage_data.items()
                  if info.relative_path == name)


def split_digests(items: str, *, count: int, where: str) -> list[str]:
    """The `items` field as one digest per item; raises CheckpointCorruptError when it does not
    hold `count` of them (the manifest and `.metadata` disagree)."""
    if len(items) != count * DIGEST_HEX:
        raise CheckpointCorruptError(f"{where}: .metadata lists {count} items in it, the manifest's `items` "
                                     f"{len(items) // DIGEST_HEX}; the checkpoint cannot be trusted")
    return [items[i:i + DIGEST_HEX] for i in range(0, len(items), DIGEST_HEX)]


def counts_whole(key: str, metadata: Metadata, *, covered: Iterable[str] | frozenset[str]) -> bool:
    """Whether every byte of `key`'s items counts: a non-tensor value, or a tensor not in `covered`
    (the manifest's `tensors`)."""
    return isinstance(metadata.state_dict_metadata.get(key), BytesStorageMetadata) or key not in covered


def digest_files(directory: Path, names: Iterable[str], metadata: Metadata, *,
                 covered: frozenset[str]) -> dict[str, str]:
    """The `items` field of each data file in `names` under `directory` (files this rank just
    wrote, in the page cache), from `metadata` (what dcp.save returned) and `covered` (the keys
    of the manifest's `tensors`)."""
    out = {}
    for name in names:
        items = file_items(metadata.storage_data, name)
        fd = os.open(directory / name, os.O_RDONLY)
        try:
            digests = []
            for offset, length, key in items:
                read_at = _pread_at(fd, offset, where=f"{directory / name}")
                item = read_item(read_at, length, whole=counts_whole(key, metadata, covered=covered),
                                 source=f"{directory / name} (item {key} at byte {offset})")
                digests.append(item.digest)
        finally:
            os.close(fd)
        out[name] = "".join(digests)
    return out


def _pread_at(fd: int, base: int, *, where: str) -> ReadAt:
    def read_at(offset: int, length: int) -> bytes:
        data = os.pread(fd, length, base + offset)
        if len(data) != length:
            raise CheckpointCorruptError(f"{where} ends inside an item (byte {base + offset + len(data)}): truncated")
        return data
    return read_at


class _Window(Window):
    """An item as a file, each read through `read_at` (for zipfile)."""

    def __init__(self, read_at: ReadAt, length: int) -> None:
        super().__init__(length)
        self._read_at = read_at

    def _fill(self, view: memoryview, pos: int) -> int:
        view[:] = self._read_at(pos, len(view))
        return len(view)


class FrameView(_Window):
    """An item read without its storage record (`ItemBytes` with `head` and `tail`), as a file:
    reading inside the record raises (the zip directory that was checked never points there)."""

    def __init__(self, item: ItemBytes, *, source: str) -> None:
        assert item.span is not None and item.data is None
        start, end = item.span

        def read_at(offset: int, length: int) -> bytes:
            if offset + length <= start:
                return item.head[offset:offset + length]
            if offset >= end:
                return item.tail[offset - end:offset - end + length]
            raise CheckpointCorruptError(f"`{source}`: its zip headers point into the tensor's elements")

        super().__init__(read_at, item.length)
