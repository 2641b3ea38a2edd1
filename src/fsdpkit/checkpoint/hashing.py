"""Checksums: of files, computed while DCP writes them; of tensors, independent of sharding.

File checksums are xxh3-64 over every byte written, recorded by a stream wrapper installed in
DCP's FileSystemWriter (`DigestFileSystem`), so no second read is needed. The bytes go to the file
as DCP's own file system writes them (checkpoint/io/__init__.py).

Tensor checksums must come out the same for any world size, since a checkpoint saved on 4 ranks
is verified after loading on 3. FSDP2 shards dim 0, so each row lives whole on one rank; a sum
(mod 2**64) of per-part hashes bound to their global position is then independent of who holds
which rows and of summation order, and any changed, missing or moved part changes it (except with
~2**-64 probability). Two algorithms, recorded in the manifest as `tensor_hash`:

- `xxh3_64-rows` (tensors in host memory): xxh3-64 of each row's bytes, seeded by its global row
  index; tensors of fewer than 2 dims use the linear formula below. ~100x faster than `linear`
  on a CPU (xxh3 runs at memory speed; int64 tensor arithmetic does not). Computed by a small C
  extension (`_rowhash`, one call per tensor, GIL released) where it was built, else by a Python
  loop over python-xxhash, which gives the same sums but holds the GIL (bench/gil.py).
- `linear` (tensors on an accelerator, where it is fast): each element contributes
  `bits(value) * (2 * global_index + 1) * golden`, summed with int64 wrap-around.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist
import xxhash
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemBase
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from fsdpkit.checkpoint.settings import IOSettings
from fsdpkit.checkpoint.staging import copy_host, local_part
from fsdpkit.checkpoint.storage import StoragePath, open_storage
from fsdpkit.dist import group_rank, group_size

HASH_NAME = "xxh3_64"
ROWS, LINEAR = "xxh3_64-rows", "linear"  # tensor hash algorithms (see above)
MASK64 = (1 << 64) - 1
READ_CHUNK_BYTES = 8 << 20
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)  # as a signed int64

try:  # built by `pip install` where a C compiler is found (setup.py); optional
    from fsdpkit.checkpoint import _rowhash
except ImportError:
    _rowhash = None
_native_rows_sum = getattr(_rowhash, "rows_sum", None)
_native_copy_rows_sum = getattr(_rowhash, "copy_rows_sum", None)  # absent from a build older than it: copy, then hash


def _io(io: IOSettings | None) -> IOSettings:
    return IOSettings.from_environment() if io is None else io


def native_row_hash(io: IOSettings | None = None) -> bool:
    """Whether `xxh3_64-rows` runs in the C extension: it was built, and `io.python_row_hash` (default:
    the environment's, FSDPKIT_PYTHON_ROW_HASH) is off."""
    return _native_rows_sum is not None and not _io(io).python_row_hash


def name_the_file(exc: OSError, path: Any) -> OSError:
    """`exc` with a note naming the checkpoint file it failed to write (once): a write's OSError
    (ENOSPC) names no file, and a user must know which disk filled."""
    note = f"fsdpkit: while writing checkpoint file {path}"
    if note not in getattr(exc, "__notes__", ()):
        exc.add_note(note)
    return exc


class _DigestStream:
    """Passes writes to `raw` (the file DCP's file system opened) and hashes the bytes each write
    took; `size` and `digest()` after.

    A write that fails (a full disk) is kept and raised, with the file's name, at `fileno()` (DCP's
    fsync) or when the file ends; the writes after it are dropped. (A failure first seen by the
    close's flush is named by DigestFileSystem.create_stream.) Raised from inside torch.save,
    the error would come out as torch's "unexpected pos 628 vs 598" instead of itself."""

    def __init__(self, raw: Any, path: Any) -> None:
        self._raw, self._path, self._hash, self.size = raw, path, xxhash.xxh3_64(), 0
        self.error: OSError | None = None

    def write(self, b: Any) -> int:
        data = memoryview(b).cast("B")  # count bytes, whatever the buffer's item format
        if self.error is not None:
            return len(data)
        try:
            n = self._raw.write(data)
        except OSError as exc:
            self.error = name_the_file(exc, self._path)
            return len(data)
        n = len(data) if n is None else n
        self._hash.update(data[:n])
        self.size += n
        return n

    def digest(self) -> str:
        return self._hash.hexdigest()

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        """The file's descriptor, with every byte written so far handed to the kernel first: DCP
        fsyncs this descriptor before it closes the file, and bytes still in Python's buffer would
        miss that fsync (the last few KiB of every file, lost in a power cut after the commit)."""
        self.raise_error()
        try:
            self._raw.flush()
        except OSError as exc:  # a full disk found by this flush: the file is abandoned, named
            self.error = name_the_file(exc, self._path)
            raise self.error from None
        return self._raw.fileno()

    def flush(self) -> None:
        if self.error is None:  # after a failure, the file is abandoned
            self._raw.flush()

    def raise_error(self) -> None:
        if self.error is not None:
            raise self.error

    def __getattr__(self, name: str) -> Any:  # tell, close...: the file's own
        return getattr(self._raw, name)


class DigestFileSystem(FileSystemBase):
    """A DCP FileSystem (`base`: DCP's local one by default, or its fsspec one for URLs) that
    records size and xxh3-64 of every file it writes in `files`, by name (`.metadata.tmp` as
    `.metadata`, the name DCP renames it to); everything else is `base`'s."""

    def __init__(self, *, base: FileSystemBase | None = None) -> None:
        super().__init__()
        self.base = base if base is not None else FileSystem()
        self.files: dict[str, dict[str, int | str]] = {}
        self._lock = threading.Lock()

    def concat_path(self, path, suffix):
        return self.base.concat_path(path, suffix)

    def rename(self, path, new_path) -> None:
        self.base.rename(path, new_path)

    def init_path(self, path, **kwargs):
        return self.base.init_path(path, **kwargs)

    def mkdir(self, path) -> None:
        self.base.mkdir(path)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return FileSystem.validate_checkpoint_id(checkpoint_id)

    def exists(self, path) -> bool:
        return self.base.exists(path)

    def rm_file(self, path) -> None:
        self.base.rm_file(path)

    def ls(self, path) -> list[str]:
        return self.base.ls(path)

    @contextmanager
    def create_stream(self, path, mode: str) -> Iterator[Any]:
        if "w" not in mode:
            with self.base.create_stream(path, mode) as stream:
                yield stream
            return
        try:
            with self.base.create_stream(path, mode) as raw:
                stream = _DigestStream(raw, path)
                yield stream  # a stream for all DCP does with it (write, tell, fileno, flush, close)
                stream.raise_error()  # a failed write fails the file: the base abandons it, no checksum
        except OSError as exc:  # also a full disk found by the flush of the file's close (DCP's, or the base's)
            name_the_file(exc, path)
            raise
        name = Path(path).name.removesuffix(".tmp")
        with self._lock:  # only a file written to its end (no exception above) is recorded
            self.files[name] = {"size": stream.size, HASH_NAME: stream.digest()}


_crc_lock = threading.Lock()
_crc_users = 0
_crc_before = True


@contextmanager
def zip_crc32_off() -> Iterator[None]:
    """torch.save's CRC32 off while a checkpoint is written.

    DCP stores every tensor as a `torch.save` zip, and torch.save runs a CRC32 over every byte of
    it (as much CPU time as the kernel spends writing those bytes, on this project's CPU machines) that
    torch.load never checks; the xxh3 file checksums above cover the same bytes and are checked.
    torch's switch is process-wide: a torch.save elsewhere in the process during the save writes
    zero CRCs too (torch.load reads those files as usual). Nested and concurrent uses are counted;
    the last one out restores the setting found by the first.
    """
    global _crc_users, _crc_before
    with _crc_lock:
        if _crc_users == 0:
            _crc_before = torch.serialization.get_crc32_options()
            torch.serialization.set_crc32_options(False)
        _crc_users += 1
    try:
        yield
    finally:
        with _crc_lock:
            _crc_users -= 1
            if _crc_users == 0:
                torch.serialization.set_crc32_options(_crc_before)


def file_checksum(path: str | os.PathLike | StoragePath, *, io: IOSettings | None = None) -> tuple[int, str]:
    """(size, xxh3-64 hex digest) of a file, read once from start to end as its storage reads best
    (StoragePath.open_sequential: a local file through io/page_cache.py). `io`: default, the
    environment's."""
    h, size = xxhash.xxh3_64(), 0
    # One buffer, read into again and again: an anonymous mapping of its own. A bytearray comes from a
    # malloc arena once glibc has raised its mmap threshold (in a process that freed large blocks, such
    # as torch.load's storages), and reads into it took 2-3x the kernel time (profiled).
    source = open_storage(path).open_sequential(_io(io))
    with source as f, mmap.mmap(-1, READ_CHUNK_BYTES) as buf:
        view = memoryview(buf)
        try:
            while n := f.readinto(view):
                h.update(view[:n])
                size += n
        finally:
            view.release()
    return size, h.hexdigest()


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The element bit patterns of `t` as int64 (flattened)."""
    t = t.detach().reshape(-1)
    if t.dtype == torch.bool:
        return t.to(torch.int64)
    size = t.element_size()
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]
    return t.view(as_int).to(torch.int64) if t.dtype != as_int else t.to(torch.int64)


def _partial_hash(local: torch.Tensor, first_index: int, *, chunk_elems: int) -> int:
    """Sum over local elements of bits * (2 * global_index + 1) * golden, mod 2**64 (int64 wraps),
    `chunk_elems` elements at a time (bounds the memory of the products; the sum is the same)."""
    flat = local.detach().contiguous().reshape(-1)
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    step = chunk_elems
    for start in range(0, flat.numel(), step):
        chunk = _bits(flat[start : start + step])
        first = first_index + start
        idx = torch.arange(first, first + chunk.numel(), dtype=torch.int64, device=flat.device)
        total += (chunk * ((idx * 2 + 1) * _GOLDEN)).sum()
    return int(total)


def rows_sum_python(raw: memoryview, row_bytes: int, first_row: int) -> int:
    """The fallback of `_rowhash.rows_sum`: the same sum, one python-xxhash call per row (holds the GIL)."""
    total = 0
    for i in range(len(raw) // row_bytes):
        total += xxhash.xxh3_64_intdigest(raw[i * row_bytes : (i + 1) * row_bytes], seed=first_row + i)
    return total & MASK64


def _rows_hash(local: torch.Tensor, first_row: int, *, native: bool | None = None,
               copy_to: torch.Tensor | None = None) -> int:
    """Sum over rows of xxh3-64(row bytes, seed=global row index), mod 2**64, as a signed int64.
    `native`: use the C extension (default: where built, unless FSDPKIT_PYTHON_ROW_HASH=1).
    `copy_to`: also copy `local` there (see hash_part)."""
    t = local.detach().cpu().contiguous()
    native = native_row_hash() if native is None else native
    if copy_to is not None and not (native and _native_copy_rows_sum is not None and copy_to.device.type == "cpu"
                                    and copy_to.is_contiguous() and copy_to.dtype == t.dtype
                                    and copy_to.shape == t.shape):
        copy_host(copy_to, t)  # no single pass here: copy, then hash below
        copy_to = None
    rows = t.shape[0]
    if rows == 0 or t.numel() == 0:
        return 0
    raw = memoryview(t.reshape(-1).view(torch.uint8).numpy())
    row_bytes = len(raw) // rows
    if native and _native_rows_sum is None:
        raise RuntimeError("fsdpkit's C row hash (fsdpkit.checkpoint._rowhash) was not built; "
                           "reinstall fsdpkit where a C compiler is found")
    if copy_to is not None:
        out = memoryview(copy_to.reshape(-1).view(torch.uint8).numpy())
        total = _native_copy_rows_sum(out, raw, row_bytes, first_row)
    else:
        total = (_native_rows_sum if native else rows_sum_python)(raw, row_bytes, first_row)
    return total - (1 << 64) if total >= 1 << 63 else total


def hash_part(local: torch.Tensor, *, first_row: int, algorithm: str, copy_to: torch.Tensor | None = None,
              io: IOSettings | None = None) -> int:
    """This part's share of its tensor's checksum. With `copy_to` (a tensor of the part's shape and
    dtype), the part is also copied there, in the same pass over memory where the C row hash does
    both (its copy bypasses the CPU cache: a staging copy that checksums costs about what the copy
    alone does). `io`: python_row_hash and hash_chunk_elems (default: the environment's)."""
    io = _io(io)
    if algorithm == ROWS and local.dim() >= 2:
        return _rows_hash(local, first_row, copy_to=copy_to, native=native_row_hash(io))
    if algorithm not in (ROWS, LINEAR):
        raise ValueError(f"unknown tensor hash algorithm {algorithm!r} (known: {ROWS}, {LINEAR})")
    if copy_to is not None:
        copy_host(copy_to, local)
    row_elems = local[0].numel() if local.dim() and local.shape[0] else 0
    return _partial_hash(local, first_row * row_elems if local.dim() else 0, chunk_elems=io.hash_chunk_elems)


def hash_algorithm_for(tensors: dict[str, torch.Tensor]) -> str:
    """`linear` when any tensor lives on an accelerator (computed there), else `xxh3_64-rows`."""
    return LINEAR if any(t.device.type != "cpu" for t in tensors.values()) else ROWS


def _local_contribution(t: torch.Tensor, group: tdist.ProcessGroup | None, algorithm: str,
                        copy_to: torch.Tensor | None, io: IOSettings) -> int:
    """This rank's share of the hash; replicas (of plain tensors or Replicate dims) count once.
    `copy_to` (same kind of tensor as `t`): `t`'s local part is copied there in any case."""
    mine = True
    if not isinstance(t, DTensor):
        mine, first_row = group_rank(group) == 0, 0
    else:
        coord = t.device_mesh.get_coordinate()
        if coord is None or any(isinstance(p, Replicate) and c != 0 for p, c in zip(t.placements, coord, strict=True)):
            mine = False
        else:
            _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
            if any(offset[1:]):
                raise NotImplementedError(f"tensor hashing supports dim-0 sharding only, got {t.placements}")
            first_row = offset[0] if t.dim() else 0
    local, out = local_part(t), None if copy_to is None else local_part(copy_to)
    if not mine:
        if out is not None:
            copy_host(out, local)
        return 0
    return hash_part(local, first_row=first_row, algorithm=algorithm, copy_to=out, io=io)


def local_contributions(tensors: dict[str, torch.Tensor], *, group: tdist.ProcessGroup | None,
                        algorithm: str = ROWS, copy_to: dict[str, torch.Tensor] | None = None,
                        io: IOSettings | None = None) -> dict[str, int]:
    """This rank's share of every tensor's checksum (no collective: it may run on a worker thread
    while the files are written; `reduce_contributions` then sums the shares over ranks). With
    `copy_to` (the same keys: tensors shaped like these), each tensor is also copied into its
    counterpart, in the same pass where hash_part allows. `io`: as hash_part's."""
    io = _io(io)
    return {k: _local_contribution(tensors[k], group, algorithm, None if copy_to is None else copy_to[k], io)
            for k in sorted(tensors)}


def reduce_contributions(local: dict[str, int], *, group: tdist.ProcessGroup | None) -> dict[str, str]:
    """Hex checksums from every rank's `local_contributions` (collective over `group`)."""
    keys = sorted(local)
    vec = torch.tensor([local[k] for k in keys], dtype=torch.int64)
    if group_size(group) > 1:
        tdist.all_reduce(vec, group=group)  # integer sum: wraps mod 2**64, exact in any order
    return {k: f"{int(v) & 0xFFFFFFFFFFFFFFFF:016x}" for k, v in zip(keys, vec.tolist(), strict=True)}


def tensor_hashes(tensors: dict[str, torch.Tensor], *, group: tdist.ProcessGroup | None,
                  algorithm: str = ROWS, io: IOSettings | None = None) -> dict[str, str]:
    """World-size-independent hex checksums of tensors that every rank holds (as DTensor shards
    or as replicated plain tensors). Collective over `group`: every rank calls it, same keys.
    `io`: as hash_part's."""
    return reduce_contributions(local_contributions(tensors, group=group, algorithm=algorithm, io=io), group=group)
