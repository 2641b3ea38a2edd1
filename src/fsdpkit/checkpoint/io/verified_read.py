"""Load a DCP checkpoint in one sequential read per file, verifying the files' checksums from that read.

Why: checking every file's xxh3 before loading (`resolve_checkpoint(verify_checksums=True)`)
reads the whole checkpoint once, then DCP reads it again to load it; on a cold cache that doubles
the I/O of a resume. Here each rank reads every file it reads whole in offset order (hashing it as
it goes when asked): a large tensor (or the rows of it the rank holds) whose target lives in host
memory straight into the target, everything else into one reused buffer, from which each tensor is
copied into its target. One read, and no copy or one where DCP makes two (into torch.load's own
storage, then into the target). At the same world size that covers every data file. Of a file a
rank needs only part of (a load at another world size: some of its items, or some rows of each),
it reads just the rows its targets need, straight into them (DCP reads every item whole and copies
it twice), unless the ranks of its host need at least half of it: then one of them reads it whole
first and the others take their rows from the page cache. Files no rank read whole are hashed
afterwards, split over ranks. `fsdpkit ckpt verify` keeps the separate, complete verification.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import math
import mmap
import os
import socket
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, closing
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as tdist
import xxhash
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from fsdpkit import tunables
from fsdpkit.checkpoint.errors import CheckpointCorruptError
from fsdpkit.checkpoint.hashing import HASH_NAME
from fsdpkit.checkpoint.io.page_cache import SequentialReader
from fsdpkit.checkpoint.io.torch_save import (
    FileWindow,
    MemoryReader,
    SplitBlob,
    TensorPayload,
    locate_tensor,
    predict_tensor,
    tensor_in_blob,
)
from fsdpkit.checkpoint.safe_io import SafeFileSystemReader

ROW_READ_THREADS = 4
"""Threads that read row ranges at once in a load at another world size."""

WHOLE_FILE_THREADS = 2
"""Files a rank that reads several whole files (fewer ranks than saved) streams at once."""

GAP_BYTES = 16 << 20
"""Bytes of a file outside every item it lists are read (and hashed) this many at a time."""

# Items of at least FSDPKIT_DIRECT_READ_BYTES (1 MiB) whose target is a host tensor are read
# straight into it (smaller ones cost more in parsing than the copy they spare).

HEAD_BYTES = 4096
"""Bytes of an item read before its tensor (torch.save's data.pkl and local headers: < 1 KiB)."""


def assign_whole_readers(needs: list[Any], sizes: dict[str, int], *, hash_files: bool) -> tuple[list[set[str]], bool]:
    """Which rank reads which file whole, from each rank's `{"host", "partial": {file: bytes it
    needs}}` (its files read in part): (the files per rank, whether every rank must wait for them).

    Where the ranks of one host need parts of a file that together make at least half of it,
    the one needing most (then the least loaded) reads it whole in one sequential pass; when
    others of the host need parts too, they wait for it, then read their parts from the page
    cache. (A rank alone: e.g. 1 rank loading a checkpoint of 2, whose second file holds the
    other rank's RNG state besides the tensors it needs.) With `hash_files`, every file read in
    part gets such a reader on each host (its checksum comes from that read). Elsewhere a rank
    reads just its parts.
    """
    readers: dict[tuple[str, str], list[tuple[int, int]]] = {}
    for rank, need in enumerate(needs):
        if isinstance(need, dict):
            for name, nbytes in need.get("partial", {}).items():
                readers.setdefault((str(need.get("host")), name), []).append((rank, nbytes))
    whole: list[set[str]] = [set() for _ in needs]
    load = [0] * len(needs)
    wait = False
    for (_, name), ranks in sorted(readers.items()):
        shared = len(ranks) > 1
        if not hash_files and not 2 * sum(n for _, n in ranks) >= sizes.get(name, 0) > 0:
            continue
        rank = max(ranks, key=lambda rn: (rn[1], -load[rn[0]], -rn[0]))[0]
        whole[rank].add(name)
        load[rank] += sizes.get(name, 0)
        wait = wait or shared
    return whole, wait


class VerifyingFileSystemReader(SafeFileSystemReader):
    """`SafeFileSystemReader` that reads each file this rank reads whole in one sequential pass
    and copies every tensor from the read buffer into its target; with `hash_files`, it also
    hashes (xxh3-64) those files as it reads them.

    At another world size, ranks on one host that each need part of a file share the reading
    (`assign_whole_readers`): one of them streams the file whole, the others wait for it (a
    barrier on `group`) and then read their rows from the page cache. Several ranks reading
    interleaved slices of one file at once left the disk at half its speed (3 ranks from 2:
    1.1 s against 0.5 s for the same bytes read in order).

    After `dcp.load`, `digests` holds {file name: (size, hex digest)} for the files hashed; other
    files were read as DCP reads them (slices) and are not in it.
    """

    def __init__(self, path: str | os.PathLike, *, sizes: dict[str, int], hash_files: bool = True,
                 group: tdist.ProcessGroup | None = None) -> None:
        super().__init__(path)
        self.sizes = sizes  # file name -> size recorded in the manifest
        self.hash_files = hash_files
        self.group = group  # the load's process group (the barrier after shared whole reads)
        self.digests: dict[str, tuple[int, str]] = {}
        self._planner_lock = threading.Lock()  # files read side by side call the planner one at a time

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._chunk_sizes = {MetadataIndex(fqn, chunk.offsets): tuple(chunk.sizes)
                             for fqn, md in metadata.state_dict_metadata.items()
                             if isinstance(md, TensorStorageMetadata)
                             for chunk in md.chunks}
        self._file_items: dict[str, list[tuple[MetadataIndex, _StorageInfo]]] = {}
        for index, info in self.storage_data.items():
            self._file_items.setdefault(info.relative_path, []).append((index, info))
        for items in self._file_items.values():
            items.sort(key=lambda item: item[1].offset)

    def _needed_whole(self, req: ReadItem) -> bool:
        """True when `req` takes its saved item entire (bytes, or every element of the chunk)."""
        if req.type == LoadItemType.BYTE_IO:
            return True
        sizes = self._chunk_sizes.get(req.storage_index)
        return sizes is not None and tuple(req.lengths) == sizes and not any(req.storage_offsets)

    def _per_file(self, items: list[ReadItem]) -> dict[str, list[ReadItem]]:
        per_file: dict[str, list[ReadItem]] = {}
        for item in items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        return per_file

    def _takes_whole(self, name: str, reqs: list[ReadItem]) -> bool:
        """True when `reqs` take every item of file `name`, each entire (a load at the saved world size)."""
        taken = {r.storage_index for r in reqs if self._needed_whole(r)}
        return all(index in taken for index, _ in self._file_items.get(name, ()))

    def _needed_bytes(self, req: ReadItem) -> int:
        info: _StorageInfo = self.storage_data[req.storage_index]
        sizes = self._chunk_sizes.get(req.storage_index)
        if req.type == LoadItemType.BYTE_IO or not sizes:
            return info.length
        return info.length * math.prod(req.lengths) // max(math.prod(sizes), 1)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """Tell the coordinator this rank's host and how many bytes it needs of each file it reads in part."""
        plan = super().prepare_local_plan(plan)
        partial = {name: sum(self._needed_bytes(r) for r in reqs) for name, reqs in self._per_file(plan.items).items()
                   if not self._takes_whole(name, reqs)}
        return dataclasses.replace(plan, storage_data={"host": socket.gethostname(), "partial": partial})

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """(The coordinator) which rank reads which of those files whole (`assign_whole_readers`)."""
        plans = super().prepare_global_plan(plans)
        whole, wait = assign_whole_readers([p.storage_data for p in plans], self.sizes, hash_files=self.hash_files)
        return [dataclasses.replace(p, storage_data={"read_whole": sorted(w), "wait": wait})
                for p, w in zip(plans, whole, strict=True)]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        assigned = plan.storage_data if isinstance(plan.storage_data, dict) else {}
        in_part: dict[str, list[ReadItem]] = {}
        try:
            whole: list[tuple[str, list[ReadItem]]] = []
            for name, reqs in self._per_file(plan.items).items():
                if name in assigned.get("read_whole", ()) or self._takes_whole(name, reqs):
                    whole.append((name, reqs))
                else:
                    in_part[name] = reqs
            if len(whole) == 1:
                self._load_whole(*whole[0], planner)
            elif whole:  # e.g. fewer ranks than saved: a rank's files stream side by side
                with ThreadPoolExecutor(max_workers=min(len(whole), WHOLE_FILE_THREADS),
                                        thread_name_prefix="fsdpkit-load-file") as files:
                    for done in [files.submit(self._load_whole, name, reqs, planner) for name, reqs in whole]:
                        done.result()
        finally:  # reached on every rank, an error or not: the others wait here for the files read whole
            if assigned.get("wait") and tdist.is_initialized():
                tdist.barrier(group=self.group)
        partial = self._read_rows(in_part, planner) if in_part else []
        if partial:  # DCP's own reads for what _read_rows left
            super().read_data(LoadPlan(partial, plan.storage_data, plan.planner_data), planner).wait()
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _load_whole(self, name: str, reqs: list[ReadItem], planner: LoadPlanner) -> None:
        with closing(self._read_in_order(name, reqs, planner)) as items:  # closes the file at once on an error
            for req, info, data in items:
                if isinstance(data, torch.Tensor):  # read straight into its target
                    with self._planner_lock:
                        planner.commit_tensor(req, data)
                else:
                    self._consume(req, info, data, planner)

    def _read_in_order(self, name: str, reqs: list[ReadItem], planner: LoadPlanner,
                       ) -> Iterator[tuple[ReadItem, _StorageInfo, memoryview | torch.Tensor]]:
        """(request, storage info, its item's bytes, or its target already filled) for `reqs`,
        reading file `name` whole in offset order on the calling thread. An item's bytes go to one
        buffer reused from item to item (a view is valid until the next is asked for), except the
        bytes one request takes from an item of at least FSDPKIT_DIRECT_READ_BYTES into a host tensor of
        their dtype (the whole tensor, or whole rows of it): those are read straight into the
        target, the item's other bytes into the buffer (`_read_into_target`). Items no request
        takes are read too (into the page cache other ranks of this host read them from); with
        `hash_files`, every byte is hashed as read and the file's (size, digest) recorded once
        read to the end.

        One thread, as DCP's own reader: the kernel's read-ahead streams the file meanwhile
        (restarted every FSDPKIT_READ_RESTART_BYTES by SequentialReader). A
        read-ahead thread of our own (reading and hashing while the caller copies) was no faster:
        1 GiB on 2 ranks on 2 cores, cold pages, alternating in one process, 0.75 s against this
        version's 0.76 s (medians of 10); with a third thread hashing apart, slower."""
        wanted: dict[MetadataIndex, list[ReadItem]] = {}
        for req in reqs:
            wanted.setdefault(req.storage_index, []).append(req)
        items = self._file_items.get(name, [])
        end = max([self.sizes.get(name, 0)] + [info.offset + info.length for _, info in items])
        digest, position = xxhash.xxh3_64(), 0
        buffer = _Buffer()
        path = self.fs.concat_path(self.path, name)
        with SequentialReader(path) as stream:

            def fill(view: memoryview) -> int:
                nonlocal position
                got = 0
                while got < len(view) and (n := stream.readinto(view[got:])):
                    got += n
                position += got
                if self.hash_files:
                    digest.update(view[:got])
                return got

            def read(length: int) -> memoryview:
                view = buffer.view(length)
                return view[: fill(view)]

            for index, info in items:
                if info.offset < position:
                    raise CheckpointCorruptError(f"{path}: the metadata's items overlap at byte {info.offset}")
                while position < info.offset and read(min(info.offset - position, GAP_BYTES)):
                    pass  # bytes between items (none in a file DCP wrote)
                here = wanted.get(index, [])
                target = self._direct_target(here, info, planner)
                if target is not None:
                    got = self._read_into_target(target, here[0], info, buffer.view(info.length), fill,
                                                 source=f"{path} at byte {info.offset}")
                    if isinstance(got, torch.Tensor):
                        yield here[0], info, got
                        continue
                    data = got if got is not None else _pread_item(path, info, buffer.view(info.length))
                else:
                    data = read(info.length)
                for req in here:
                    yield req, info, data
            while position < end and read(min(end - position, GAP_BYTES)):
                pass
            if self.hash_files:
                longer = stream.readinto(bytearray(1))  # more than the manifest says: not the file written
                self.digests[name] = (position + longer, digest.hexdigest())

    def _direct_target(self, reqs: list[ReadItem], info: _StorageInfo, planner: LoadPlanner) -> torch.Tensor | None:
        """The target to read item `info`'s bytes straight into, if the item has at least
        FSDPKIT_DIRECT_READ_BYTES and one request takes a tensor from it into a contiguous host tensor
        (`_read_into_target` then checks that it takes whole rows of the stored dtype)."""
        if len(reqs) != 1 or info.transform_descriptors or info.length < tunables.current().direct_read_bytes:
            return None
        req = reqs[0]
        if req.type != LoadItemType.TENSOR:
            return None
        with self._planner_lock:
            target = planner.resolve_tensor(req).detach()
        if target.device.type != "cpu" or not target.is_contiguous() or tuple(target.size()) != tuple(req.lengths):
            return None
        return target

    @staticmethod
    def _read_into_target(target: torch.Tensor, req: ReadItem, info: _StorageInfo, view: memoryview,
                          fill: Callable[[memoryview], int], *, source: str) -> torch.Tensor | memoryview | None:
        """Read item `info` (the next bytes `fill` reads) with the bytes `req` takes straight into
        `target`: the item's whole tensor at the saved world size, its rows for this rank at another
        (a slice of whole rows is one byte range). The first HEAD_BYTES go to `view`
        (`predict_tensor` finds the tensor there), so do the bytes before and after the target's
        (other ranks' rows, the zip directory), kept back to back. Then the directory must agree
        with the prediction (`locate_tensor` over what `view` kept). Returns the target once it
        holds its bytes. Where the head shows no tensor of the target's dtype of which `req` takes
        whole rows, the rest of the item goes to `view` too and the item's bytes are returned,
        for `_consume` to copy or to say what is wrong. None when the directory disagrees with the
        head (not laid out as torch.save lays it out): the item was read in order (and hashed),
        and the caller reads it again into the buffer."""
        head = view[: fill(view[:HEAD_BYTES])]
        payload = predict_tensor(head, source=source)
        span = None
        if payload is not None and payload.dtype == target.dtype:
            span = _row_span(payload, tuple(req.storage_offsets), tuple(req.lengths))
        start, count = (payload.data_start + span[0], span[1]) if payload is not None and span is not None else (0, 0)
        if span is None or count != target.nbytes or not len(head) < start + count <= info.length:
            return view[: len(head) + fill(view[len(head):])]
        front = max(start, len(head))  # the item's bytes [0, front) stay in view
        have = len(head) + fill(view[len(head) : front])
        tail = view[front : front + info.length - start - count]
        if have == front:
            out = memoryview(target.reshape(-1).view(torch.uint8).numpy())
            out[: front - start] = view[start:front]
            got = fill(out[front - start :])
            have += got
            if front - start + got == count:
                have += fill(tail)
        if have != info.length:
            raise CheckpointCorruptError(f"{source}: the file ends {info.length - have} bytes before the end of this "
                                         "item (truncated)")
        try:
            found = locate_tensor(SplitBlob(view[:front], tail, info.length), source=source)
        except (CheckpointCorruptError, SplitBlob.MissingBytes):
            return None
        return target if found == payload else None

    def _read_rows(self, in_part: dict[str, list[ReadItem]], planner: LoadPlanner) -> list[ReadItem]:
        """Items of files this rank needs only part of (a load at another world size): each
        item's torch.save header is parsed (a few hundred bytes), then only the rows its target
        needs are read, straight into the target where it can be. Both run on ROW_READ_THREADS
        threads with positional reads: a header sits at both ends of its item, so parsing them one
        after another costs two disk round trips per item (0.8 s of a 1.1 s load at 3 ranks from 2,
        profiled), and the rows want a deeper queue too. DCP reads every item whole (the rows of
        other ranks too), then copies it twice. Returns the items left to DCP: byte items,
        transformed ones and slices that are not whole rows of a contiguous tensor."""
        rest: list[ReadItem] = []
        located: list[tuple[ReadItem, int, str, futures.Future]] = []
        done: list[tuple[ReadItem, torch.Tensor, futures.Future]] = []
        # The pool is left first (its reads finished, even on an error), then the files are closed.
        with ExitStack() as files, ThreadPoolExecutor(max_workers=ROW_READ_THREADS,
                                                      thread_name_prefix="fsdpkit-load-rows") as pool:
            for name, reqs in in_part.items():
                path = self.fs.concat_path(self.path, name)
                file = files.enter_context(open(path, "rb"))  # noqa: SIM115
                fd = file.fileno()
                for req in sorted(reqs, key=lambda r: self.storage_data[r.storage_index].offset):
                    info: _StorageInfo = self.storage_data[req.storage_index]
                    if req.type == LoadItemType.BYTE_IO or info.transform_descriptors:
                        rest.append(req)
                        continue
                    where = f"{path} at byte {info.offset}"
                    window = FileWindow(file, info.offset, info.length)  # positional reads: shared safely
                    located.append((req, fd, where, pool.submit(locate_tensor, window, source=where)))
            for req, fd, where, parsed in located:
                payload: TensorPayload = parsed.result()
                span = _row_span(payload, tuple(req.storage_offsets), tuple(req.lengths))
                if span is None:
                    rest.append(req)
                    continue
                target = planner.resolve_tensor(req).detach()
                if tuple(target.size()) != tuple(req.lengths):
                    raise ValueError(f"{req.storage_index}: the checkpoint holds {tuple(req.lengths)}, "
                                     f"the target expects {tuple(target.size())}")
                info = self.storage_data[req.storage_index]
                straight = target.is_contiguous() and target.dtype == payload.dtype
                out = target if straight else torch.empty(tuple(req.lengths), dtype=payload.dtype)
                start, nbytes = span
                job = functools.partial(_pread_exactly, fd, out, info.offset + payload.data_start + start, nbytes,
                                        where=where)
                if straight:
                    done.append((req, target, pool.submit(job)))
                else:  # a cast: one temporary at a time
                    job()
                    target.copy_(out)
                    planner.commit_tensor(req, target)
            for req, target, read in done:
                read.result()
                planner.commit_tensor(req, target)
        return rest

    def _consume(self, req: ReadItem, info: _StorageInfo, data: memoryview, planner: LoadPlanner) -> None:
        """What FileSystemReader.read_data does with one item's bytes (torch 2.13), except that a
        tensor is copied into its target straight from the read buffer: torch.load would first
        copy it into a storage of its own."""
        if req.type == LoadItemType.BYTE_IO or info.transform_descriptors:
            stream = self.transforms.transform_load_stream(req, info.transform_descriptors or (), MemoryReader(data))
            if req.type == LoadItemType.BYTE_IO:
                value = io.BytesIO(stream.read(-1))
                with self._planner_lock:
                    planner.load_bytes(req, value)
                return
            tensor = cast(torch.Tensor, torch.load(io.BytesIO(stream.read(-1)), map_location="cpu", weights_only=True))
        else:
            tensor = tensor_in_blob(data, source=f"{self.fs.concat_path(self.path, info.relative_path)} "
                                                 f"at byte {info.offset}")
        tensor = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
        with self._planner_lock:
            target = planner.resolve_tensor(req).detach()
        if target.size() != tensor.size():
            raise ValueError(f"{req.storage_index}: the checkpoint holds {tuple(tensor.size())}, "
                             f"the target expects {tuple(target.size())}")
        target.copy_(tensor)
        with self._planner_lock:
            planner.commit_tensor(req, target)


def _pread_item(path: str | os.PathLike, info: _StorageInfo, view: memoryview) -> memoryview:
    """Item `info`'s bytes, read again with positional reads into `view` (its length)."""
    with open(path, "rb") as file:
        return view[: _pread_into(file.fileno(), view, info.offset)]


def _pread_into(fd: int, view: memoryview, offset: int) -> int:
    """Positional reads into `view` from `offset` until it is full or the file ends; the bytes read."""
    done = 0
    while done < len(view) and (n := os.preadv(fd, [view[done:]], offset + done)):
        done += n
    return done


def _row_span(payload: TensorPayload, offsets: tuple[int, ...], lengths: tuple[int, ...]) -> tuple[int, int] | None:
    """(first byte after the payload's data start, byte count) of the slice [offsets, offsets +
    lengths) of a contiguous saved tensor when it is whole rows (full in every dim but the first),
    else None."""
    shape = payload.shape
    if not payload.is_contiguous or len(offsets) != len(shape) or len(lengths) != len(shape):
        return None
    if any(o != 0 for o in offsets[1:]) or tuple(lengths[1:]) != tuple(shape[1:]):
        return None
    if shape and not 0 <= offsets[0] <= offsets[0] + lengths[0] <= shape[0]:
        return None  # outside the saved chunk: DCP's own path reports it
    row = 1
    for size in shape[1:]:
        row *= size
    count = (lengths[0] if shape else 1) * row
    first = payload.storage_offset + (offsets[0] * row if shape else 0)
    return first * payload.dtype.itemsize, count * payload.dtype.itemsize


def _pread_exactly(fd: int, out: torch.Tensor, offset: int, nbytes: int, *, where: str) -> None:
    view = memoryview(out.reshape(-1).view(torch.uint8).numpy()) if out.numel() else memoryview(b"")
    if len(view) != nbytes:
        raise CheckpointCorruptError(f"{where}: the stored slice has {nbytes} bytes, the target {len(view)}")
    done = _pread_into(fd, view, offset)
    if done < nbytes:
        raise CheckpointCorruptError(f"{where}: the file ends {nbytes - done} bytes early (truncated)")


class _Buffer:
    """One byte buffer, reused from item to item and grown to the largest item.

    An anonymous mapping of its own, not a malloc'd bytearray: glibc raises its mmap threshold to
    the size of each large block freed (torch.load's storages, in a process that ran `dcp.load`
    before), after which an item-sized bytearray comes from a malloc arena. In such processes the
    reads took 2-3x the kernel time and the loads ~1.5x as long, and a fixed MALLOC_MMAP_THRESHOLD_
    removed the difference (profiled in the bench's resume launches). A mapping of its own does not
    depend on what the process did before, and Python does not zero it first (the kernel zeroes
    each page as it is first touched); reusing it spares a page fault per 4 KiB per item."""

    def __init__(self) -> None:
        self._map: mmap.mmap | None = None

    def view(self, length: int) -> memoryview:
        if self._map is None or len(self._map) < length:
            # The old mapping is unmapped once the last view of it is gone (a tensor may still hold one).
            self._map = mmap.mmap(-1, max(length, 1))
        return memoryview(self._map)[:length]


def file_problems(ckpt_dir: Path, manifest: dict[str, Any], digests: dict[str, tuple[int, str]], *,
                  group: tdist.ProcessGroup | None,
                  verify_rest: Callable[[Path, dict[str, Any]], list[str]]) -> list[str]:
    """Every file's checksum problems (collective): the digests every rank took while loading,
    and `verify_rest(ckpt_dir, {"files": rest})` (a full read, split over ranks) for the files
    no rank read whole. Every rank gets the same list."""
    everyone: list[dict[str, tuple[int, str]]] = [digests]
    if tdist.is_initialized() and tdist.get_world_size(group) > 1:
        everyone = [{} for _ in range(tdist.get_world_size(group))]
        tdist.all_gather_object(everyone, digests, group=group)
    seen = {name: got for d in everyone for name, got in d.items()}
    problems = []
    for name, (size, digest) in sorted(seen.items()):
        info = manifest["files"].get(name)
        if info is None:
            continue
        path = ckpt_dir / name
        if size != info["size"]:
            problems.append(f"{path} has {size} bytes, expected {info['size']} (truncated or overwritten)")
        elif digest != info[HASH_NAME]:
            problems.append(f"{path} fails its checksum ({HASH_NAME} {digest}, expected {info[HASH_NAME]}): "
                            "the file is corrupt")
    rest = {n: i for n, i in manifest["files"].items() if n not in seen}
    return problems + (verify_rest(ckpt_dir, {"files": rest}) if rest else [])
