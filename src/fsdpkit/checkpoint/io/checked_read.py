"""The resume's reader: DCP's FileSystemReader (without its pickle, safe_io.py) that checks every
item against the manifest as it reads it, and reads of a tensor only the rows this rank needs.

Given the manifest's `files` for the directory (`files`) and the keys of its `tensors` (`covered`):

- `.metadata` is checked against its size and checksum from the one read that parses it
  (safe_io.SafeMetadataReading), before it is unpickled;
- each item of a file whose entry has `items` (io/items.py) is checked before anything decodes it:
  a non-tensor item or an RNG state whole, then decoded as DCP decodes it (torch.load with
  weights_only=True, safe_io.SafeLoadPlanner for values); a tensor without its elements, which
  are then read straight into the tensor DCP loads them into (only the rows it needs when the
  load reshards: each byte of the checkpoint is read about once over all ranks). The elements
  are proven after the load by the tensors' own checksums (resume.verify_restored);
- the items of a file without `items` (written before them, or to object storage) are read as
  DCP reads them: the caller checks such a file whole before the load (resume.py).

A failed check raises CheckpointCorruptError naming the file, the item and both checksums; DCP
gathers it from the rank that raised it and fails the load on every rank.
"""

from __future__ import annotations

import dataclasses
import io
import os
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager as ContextManager
from math import prod
from typing import IO, Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from fsdpkit.checkpoint.errors import CheckpointCorruptError
from fsdpkit.checkpoint.io.items import ITEMS, FrameView, file_items, read_item, split_digests
from fsdpkit.checkpoint.io.torch_save import TensorPayload, locate_tensor
from fsdpkit.checkpoint.safe_io import SafeFileSystemReader
from fsdpkit.checkpoint.settings import IOSettings


class CheckedFileSystemReader(SafeFileSystemReader):
    """SafeFileSystemReader that checks `.metadata` and every item against `files` (the manifest's
    entries of this directory) and `covered` (its `tensors` keys) as it reads them; see above."""

    def __init__(self, path: str | os.PathLike, *, files: dict[str, Any], covered: Iterable[str],
                 restart_bytes: int | None = None) -> None:
        """`restart_bytes`: a tensor's elements are read through a stream opened anew this often
        (0: one stream; see `_read_span`); default: the environment's IOSettings.read_restart_bytes."""
        super().__init__(path)
        self.expected_files = files
        self.covered = frozenset(covered)
        if restart_bytes is None:
            restart_bytes = IOSettings.from_environment().read_restart_bytes
        self.restart_bytes = restart_bytes
        self._digests: dict[tuple[str, int], str] = {}

    def set_up_storage_reader(self, metadata: Any, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._digests = {}
        for name, info in self.expected_files.items():
            if ITEMS not in info:
                continue
            items = file_items(self.storage_data, name)
            digests = split_digests(info[ITEMS], count=len(items), where=str(self.fs.concat_path(self.path, name)))
            self._digests.update({(name, offset): d for (offset, _, _), d in zip(items, digests, strict=True)})

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Every item of `plan`: checked ones here, each file's in the order of their bytes; the
        others (files without `items`) as DCP reads them."""
        checked: dict[str, list[ReadItem]] = {}
        rest = []
        for req in plan.items:
            info = self.storage_data[req.storage_index]
            if (info.relative_path, info.offset) in self._digests:
                checked.setdefault(info.relative_path, []).append(req)
            else:
                rest.append(req)
        if rest:
            super().read_data(dataclasses.replace(plan, items=rest), planner).wait()
        for name, reqs in checked.items():
            path = self.fs.concat_path(self.path, name)
            with self.fs.create_stream(path, "rb") as stream:
                for req in sorted(reqs, key=lambda r: self.storage_data[r.storage_index].offset):
                    self._load(stream, req, planner, path=str(path))
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _load(self, stream: IO[bytes], req: ReadItem, planner: LoadPlanner, *, path: str) -> None:
        info = self.storage_data[req.storage_index]
        key = req.storage_index.fqn
        whole = req.type == LoadItemType.BYTE_IO or key not in self.covered  # as items.counts_whole
        source = f"{path} (item {key} at byte {info.offset})"
        item = read_item(_reader(stream, info.offset, path=path), info.length, whole=whole, source=source)
        expected = self._digests[(info.relative_path, info.offset)]
        if item.digest != expected:
            raise CheckpointCorruptError(
                f"{path} fails its checksum at item {key} (bytes {info.offset}-{info.offset + info.length}: xxh3_64 "
                f"{item.digest}, expected {expected}): the file is corrupt; nothing was decoded from it")
        if req.type == LoadItemType.BYTE_IO:
            assert item.data is not None
            planner.load_bytes(req, io.BytesIO(item.data))
            return
        target = planner.resolve_tensor(req).detach()
        if item.data is not None:  # read whole: decoded as DCP decodes it
            saved = torch.load(io.BytesIO(item.data), map_location="cpu", weights_only=True)
            _copy(target, narrow_tensor_by_index(saved, req.storage_offsets, req.lengths), source=source)
        else:
            payload = locate_tensor(FrameView(item, source=source), source=source)
            if (payload.data_start, payload.data_start + payload.storage_bytes) != item.span:
                raise CheckpointCorruptError(f"`{source}`: its data.pkl names another storage record than its zip "
                                             "directory")
            _read_elements(lambda: self.fs.create_stream(path, "rb"), info.offset, payload, req, target, path=path,
                           source=source, restart_bytes=self.restart_bytes)
        planner.commit_tensor(req, target)


def _reader(stream: IO[bytes], base: int, *, path: str):
    def read_at(offset: int, length: int) -> bytes:
        out = bytearray(length)
        _read_into(stream, memoryview(out), base + offset, path=path)
        return bytes(out)
    return read_at


def _read_into(stream: IO[bytes], view: memoryview, position: int, *, path: str) -> None:
    """Fill `view` from `position` of `stream` (through its own seek and readinto: the storage layer's)."""
    stream.seek(position)
    done = 0
    while done < len(view):
        n = stream.readinto(view[done:])
        if not n:
            raise CheckpointCorruptError(f"{path} ends at byte {position + done}, inside an item: the file is "
                                         "truncated")
        done += n


def _read_elements(open_file: Callable[[], ContextManager[IO[bytes]]], base: int, payload: TensorPayload,
                   req: ReadItem, target: torch.Tensor, *, path: str, source: str, restart_bytes: int) -> None:
    """The elements `req` needs of a saved tensor, read into `target`: only their bytes where they
    lie together (a contiguous tensor cut along dim 0, as FSDP shards), straight into `target`
    where it takes them as they are; else the whole record, cut in memory. `open_file` opens the
    file anew (`_read_span`)."""
    offsets, lengths, shape = list(req.storage_offsets), list(req.lengths), payload.shape
    if list(target.shape) != lengths or any(o + n > s for o, n, s in zip(offsets, lengths, shape, strict=True)):
        raise CheckpointCorruptError(f"`{source}`: a saved chunk of shape {list(shape)} cannot give rows "
                                     f"{offsets} + {lengths}")
    itemsize = payload.dtype.itemsize
    rows_only = payload.is_contiguous and all(o == 0 and n == s for o, n, s in
                                              zip(offsets[1:], lengths[1:], shape[1:], strict=True))
    if rows_only:
        row = prod(shape[1:])
        first = payload.storage_offset + (offsets[0] * row if shape else 0)
        into = target if _takes_bytes(target, payload.dtype) else torch.empty(lengths, dtype=payload.dtype)
        if into.numel():
            _read_span(open_file, _bytes_of(into), base + payload.data_start + first * itemsize, path=path,
                       restart_bytes=restart_bytes)
        if into is not target:
            target.copy_(into)
        return
    record = torch.empty(payload.storage_bytes, dtype=torch.uint8)
    _read_span(open_file, _bytes_of(record), base + payload.data_start, path=path, restart_bytes=restart_bytes)
    saved = record.view(payload.dtype).as_strided(shape, payload.stride, payload.storage_offset)
    _copy(target, narrow_tensor_by_index(saved, offsets, lengths), source=source)


def _read_span(open_file: Callable[[], ContextManager[IO[bytes]]], view: memoryview, position: int, *,
               path: str, restart_bytes: int) -> None:
    """Fill `view` from `position` of the file, through a stream opened anew for every
    `restart_bytes` (FSDPKIT_READ_RESTART_BYTES, 16 MiB; 0: one stream): a fresh kernel readahead each time, as
    io/page_cache.py reads files start to end, for the reason measured there (large page-cache
    folios are slow to fault in on a VM that hands free memory back to its host). Measured here
    (the 2-core VM, one process, pages evicted and 3 s idle before each load, modes alternating,
    bench/element_read.py): 2 x Linear(8192, 8192) + AdamW, items of 256 MiB: 1.71-2.56 s (6 runs)
    against 4.15-8.73 s through one stream (dcp.load 4.75-11.05 s); two earlier runs of the same
    measurement 1.53-1.97 s against 2.40-6.48 s, and 1.18-2.04 s against 1.42-4.08 s. With items of
    21 MiB, which the reader reaches by seeks, no difference (0.61-0.76 s against 0.54-0.78 s)."""
    step = restart_bytes or len(view)
    for start in range(0, len(view), step):
        with open_file() as stream:
            _read_into(stream, view[start:start + step], position + start, path=path)


def _takes_bytes(t: torch.Tensor, dtype: torch.dtype) -> bool:
    return t.device.type == "cpu" and t.dtype == dtype and t.is_contiguous()


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


def _copy(target: torch.Tensor, saved: torch.Tensor, *, source: str) -> None:
    if target.size() != saved.size():
        raise CheckpointCorruptError(f"`{source}`: the saved chunk gives {list(saved.size())}, the load needs "
                                     f"{list(target.size())}")
    target.copy_(saved)
