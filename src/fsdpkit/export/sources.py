"""Tensor sources: the tensors of a checkpoint, readable a few rows at a time.

Every tool here (export, diff, verify, inspect) reads through one small interface, whatever the
checkpoint is: an fsdpkit checkpoint or a plain DCP directory (`DcpSource`, which reads chunk
bytes straight from the `.distcp` files, or `DcpLoadSource`, which goes through `dcp.load`), an
fsdpkit `state_dict_type=full` checkpoint, a Hugging Face folder or a single `.safetensors` file
(`SafetensorsSource`). `read_rows(key, start, stop)` returns rows [start, stop) of dim 0 (a
0-dim tensor is one row), so memory is bounded by what the caller asks for, never by the model.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata

from fsdpkit.checkpoint.errors import CheckpointCorruptError, CheckpointError
from fsdpkit.checkpoint.frozen import SHARED, shared_root
from fsdpkit.checkpoint.io.torch_save import FileWindow, TensorPayload, locate_tensor
from fsdpkit.checkpoint.layout import MANIFEST
from fsdpkit.checkpoint.manifest import read_manifest
from fsdpkit.checkpoint.safe_io import (
    METADATA_FILENAME,
    SafeFileSystemReader,
    SafeLoadPlanner,
    read_dcp_metadata,
)
from fsdpkit.checkpoint.storage import RangeReader, StoragePath, open_storage
from fsdpkit.export.locate import (
    is_uncommitted_fsdpkit_dir,
    locate_checkpoint,
    not_committed_message,
)
from fsdpkit.hf.safetensors_reader import SafetensorsReader, safetensors_files

FULL_MODEL_FILE = "model.safetensors"  # what strategy.state_dict_type=full writes (checkpoint/full.py)


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def rows(self) -> int:
        """Rows of dim 0; a 0-dim tensor counts as one row."""
        return self.shape[0] if self.shape else 1

    @property
    def row_bytes(self) -> int:
        return self.nbytes // self.rows if self.rows else 0


class TensorSource(Protocol):
    """What every reader offers. `key_paths` maps DCP keys to their nested state-dict path
    (DCP's planner data, e.g. ('model', 'lm_head.weight')) when the source knows it."""

    path: Path
    kind: str
    key_paths: dict[str, tuple[Any, ...]] | None

    def tensors(self) -> dict[str, TensorInfo]: ...

    def read_rows(self, key: str, start: int, stop: int, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows [start, stop) of `key` in its stored dtype, into `out` (contiguous, that shape)
        if given, else into a new tensor."""
        ...

    def close(self) -> None: ...


def iter_row_blocks(info: TensorInfo, *, block_bytes: int):
    """(start, stop) row ranges of at most `block_bytes` each (at least one row)."""
    step = max(1, block_bytes // max(1, info.row_bytes))
    for start in range(0, info.rows, step):
        yield start, min(start + step, info.rows)


def _into(t: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return t
    out.copy_(t)
    return out


def _as_bytes(t: torch.Tensor):
    """A writable numpy uint8 view of a contiguous tensor's memory (for readinto/pread)."""
    return t.reshape(-1).view(torch.uint8).numpy()


@dataclass
class Chunk:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    storage: _StorageInfo


def chunk_problems(key: str, md: TensorStorageMetadata) -> list[str]:
    """Why the chunks of `key` do not tile its global shape exactly (empty: they do)."""
    size = tuple(md.size)
    total = 1
    for s in size:
        total *= s
    chunks = [(tuple(c.offsets), tuple(c.sizes)) for c in md.chunks]
    problems = []
    covered = 0
    for off, sz in chunks:
        if len(off) != len(size) or any(o < 0 or o + s > d for o, s, d in zip(off, sz, size, strict=True)):
            problems.append(f"{key}: chunk at {list(off)} of size {list(sz)} lies outside the tensor's shape "
                            f"{list(size)}")
        n = 1
        for s in sz:
            n *= s
        covered += n
    nonempty = [(o, s) for o, s in chunks if all(s)]
    for i, (oa, sa) in enumerate(nonempty):
        for ob, sb in nonempty[i + 1:]:
            if all(a < b + lb and b < a + la for a, la, b, lb in zip(oa, sa, ob, sb, strict=True)):
                problems.append(f"{key}: chunks at {list(oa)} and {list(ob)} overlap")
    if covered != total and not problems:
        problems.append(f"{key}: its chunks hold {covered} of {total} elements (a rank's shard is missing from the "
                        "metadata)")
    return problems


class DcpSource:
    """A DCP checkpoint read by byte ranges: each chunk's `torch.save` blob is located once
    (zip directory + a vetted data.pkl) and rows are `pread` into the caller's buffer.

    Fast path: chunks that split dim 0 only (FSDP's Shard(0)), read row range by row range.
    Other layouts (e.g. tensor-parallel Shard(1) blocks) are assembled whole, one tensor at a time.
    """

    kind = "dcp"

    def __init__(self, path: StoragePath, *, metadata: Metadata | None = None,
                 files: dict[str, StoragePath] | None = None) -> None:
        self.path = open_storage(path)  # a local Path, or a RemotePath: rows come by ranged GETs
        self.metadata = metadata if metadata is not None else read_dcp_metadata(self.path)
        self.elsewhere = files or {}  # relative paths of files outside `path` (with_shared): where they are
        planner_data = getattr(self.metadata, "planner_data", None)
        self.key_paths = dict(planner_data) if isinstance(planner_data, dict) else None
        self._tensors = {k: TensorInfo(tuple(md.size), md.properties.dtype)
                         for k, md in self.metadata.state_dict_metadata.items()
                         if isinstance(md, TensorStorageMetadata)}
        self._files: dict[str, Any] = {}
        self._ranges: dict[str, RangeReader] = {}
        self._payloads: dict[tuple[str, tuple[int, ...]], TensorPayload] = {}
        self._whole: tuple[str, torch.Tensor] | None = None  # the last tensor assembled whole
        # read_rows may run on several threads: data is read with pread (no shared file position),
        # but opening files, parsing a chunk's zip directory (seek + read) and assembling a whole
        # tensor take this lock.
        self._lock = threading.RLock()

    def tensors(self) -> dict[str, TensorInfo]:
        return self._tensors

    def chunks(self, key: str) -> list[Chunk]:
        md = self.metadata.state_dict_metadata[key]
        out = []
        for c in md.chunks:
            index = MetadataIndex(key, c.offsets)
            storage = self.metadata.storage_data.get(index)
            if storage is None:
                raise CheckpointCorruptError(f"{self.path}: the metadata lists a chunk of {key} at {list(c.offsets)} "
                                             "but no file holds it; the checkpoint is incomplete")
            out.append(Chunk(tuple(c.offsets), tuple(c.sizes), storage))
        return out

    def _file(self, relative: str) -> Any:
        with self._lock:
            return self._open(relative)

    def _open(self, relative: str) -> Any:
        if relative not in self._files:
            path = self.elsewhere.get(relative) or self.path / relative
            try:
                self._files[relative] = path.open("rb")  # noqa: SIM115 (closed in close())
            except FileNotFoundError:
                raise CheckpointCorruptError(f"{path} is missing; the checkpoint is incomplete") from None
        return self._files[relative]

    def payload(self, key: str, chunk: Chunk) -> TensorPayload:
        """Where the chunk's elements are (cached): parsed from its blob's zip directory."""
        cache_key = (key, chunk.offsets)
        if cache_key in self._payloads:
            return self._payloads[cache_key]
        with self._lock:
            return self._locate(key, chunk, cache_key)

    def _locate(self, key: str, chunk: Chunk, cache_key: tuple[str, tuple[int, ...]]) -> TensorPayload:
        if cache_key not in self._payloads:
            storage = chunk.storage
            where = f"{self.path / storage.relative_path} (chunk of {key} at {list(chunk.offsets)})"
            if storage.transform_descriptors:
                raise CheckpointError(f"{where} is stored through DCP extensions "
                                      f"{list(storage.transform_descriptors)}; this reader reads plain chunks only: "
                                      "use the `dcp` reader (--reader dcp)")
            f = self._file(storage.relative_path)
            payload = locate_tensor(FileWindow(f, storage.offset, storage.length), source=where)
            if payload.dtype != self._tensors[key].dtype or payload.shape != chunk.sizes:
                raise CheckpointCorruptError(f"{where} holds {payload.dtype} {list(payload.shape)}, the metadata says "
                                             f"{self._tensors[key].dtype} {list(chunk.sizes)}")
            self._payloads[cache_key] = payload
        return self._payloads[cache_key]

    def read_chunk(self, key: str, chunk: Chunk, *, rows: tuple[int, int] | None = None,
                   out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows [a, b) of a chunk (chunk-local row numbers; all rows by default), read straight
        into `out` (a contiguous tensor of that shape) when given."""
        payload = self.payload(key, chunk)
        a, b = rows if rows is not None else (0, chunk.sizes[0] if chunk.sizes else 1)
        shape = (b - a, *chunk.sizes[1:]) if chunk.sizes else ()
        if out is None:
            out = torch.empty(shape, dtype=payload.dtype)
        base = chunk.storage.offset + payload.data_start
        where = f"{self.path / chunk.storage.relative_path} (chunk of {key})"
        if payload.is_contiguous:
            row_elems = 1
            for s in shape[1:]:
                row_elems *= s
            if out.numel():
                self._read_into(chunk.storage.relative_path, out,
                                base + (payload.storage_offset + a * row_elems) * payload.dtype.itemsize, what=where)
            return out
        # A strided chunk (never written by DCP itself, which clones views): read its storage whole.
        storage = torch.empty(payload.storage_bytes, dtype=torch.uint8)
        self._read_into(chunk.storage.relative_path, storage, base, what=where)
        whole = storage.view(payload.dtype).as_strided(payload.shape, payload.stride, payload.storage_offset)
        out.copy_(whole[a:b] if chunk.sizes else whole)
        return out

    def _read_into(self, relative: str, t: torch.Tensor, offset: int, *, what: str) -> None:
        """Read `t.nbytes` bytes at `offset` of the file into contiguous `t` (positional reads
        locally, ranged GETs on object storage: threads may read one file at once)."""
        ranges = self._ranges_of(relative)
        view = memoryview(_as_bytes(t))
        missing = len(view) - ranges.read_into(view, offset)
        if missing:
            raise CheckpointCorruptError(f"{what}: the {ranges.noun} ends {missing} bytes early (truncated)")

    def _ranges_of(self, relative: str) -> RangeReader:
        with self._lock:
            if relative not in self._ranges:
                self._open(relative)  # a missing file fails here, named
                path = self.elsewhere.get(relative) or self.path / relative
                self._ranges[relative] = open_storage(path).open_ranges()
            return self._ranges[relative]

    def _is_row_split(self, key: str, chunks: list[Chunk]) -> bool:
        size = self._tensors[key].shape
        return all(c.offsets[1:] == (0,) * (len(size) - 1) and c.sizes[1:] == size[1:] for c in chunks)

    def read_rows(self, key: str, start: int, stop: int, *, out: torch.Tensor | None = None) -> torch.Tensor:
        info = self._tensors[key]
        chunks = [c for c in self.chunks(key) if all(c.sizes) or not c.sizes]
        if not info.shape:
            return self.read_chunk(key, chunks[0], out=out)
        if not self._is_row_split(key, chunks):
            return _into(self._read_whole(key, chunks)[start:stop], out)
        if out is None:
            out = torch.empty((stop - start, *info.shape[1:]), dtype=info.dtype)
        for c in chunks:  # each overlapping chunk's rows are read straight into their place in `out`
            lo, hi = max(start, c.offsets[0]), min(stop, c.offsets[0] + c.sizes[0])
            if lo < hi:
                self.read_chunk(key, c, rows=(lo - c.offsets[0], hi - c.offsets[0]), out=out[lo - start : hi - start])
        return out

    def _read_whole(self, key: str, chunks: list[Chunk]) -> torch.Tensor:
        with self._lock:
            return self._assemble(key, chunks)

    def _assemble(self, key: str, chunks: list[Chunk]) -> torch.Tensor:
        if self._whole is None or self._whole[0] != key:
            self._whole = None  # drop the previous tensor before allocating the next
            info = self._tensors[key]
            whole = torch.empty(info.shape, dtype=info.dtype)
            for c in chunks:
                whole[tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes, strict=True))] = self.read_chunk(key, c)
            self._whole = (key, whole)
        return self._whole[1]

    def close(self) -> None:
        for f in [*self._files.values(), *self._ranges.values()]:
            f.close()
        self._files.clear()
        self._ranges.clear()
        self._whole = None


class _CachedMetadataReader(SafeFileSystemReader):
    """SafeFileSystemReader that hands `dcp.load` the metadata read once, instead of re-reading
    (and re-unpickling) `.metadata` on every call."""

    def __init__(self, path: Path, metadata: Metadata) -> None:
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self._metadata


class DcpLoadSource:
    """A DCP checkpoint read through `dcp.load`, one whole tensor per call (no process group).

    The alternative to DcpSource's byte ranges (the benchmark compares them): it handles DCP
    storage extensions, but holds a whole tensor and a copy of each chunk while reading it.
    """

    kind = "dcp"

    def __init__(self, path: Path, *, metadata: Metadata | None = None) -> None:
        self._inner = DcpSource(path, metadata=metadata)
        self.path, self.key_paths, self.metadata = self._inner.path, self._inner.key_paths, self._inner.metadata
        self._reader = _CachedMetadataReader(self.path, self.metadata)
        self._whole: tuple[str, torch.Tensor] | None = None
        self._lock = threading.Lock()  # dcp.load and its reader are not meant for concurrent use

    def tensors(self) -> dict[str, TensorInfo]:
        return self._inner.tensors()

    def read_rows(self, key: str, start: int, stop: int, *, out: torch.Tensor | None = None) -> torch.Tensor:
        with self._lock:
            return self._read_rows(key, start, stop, out=out)

    def _read_rows(self, key: str, start: int, stop: int, *, out: torch.Tensor | None) -> torch.Tensor:
        if self._whole is None or self._whole[0] != key:
            self._whole = None
            info = self.tensors()[key]
            state = {key: torch.empty(info.shape, dtype=info.dtype)}
            try:
                dcp.load(state, storage_reader=self._reader, planner=SafeLoadPlanner(), no_dist=True)
            except CheckpointError:
                raise
            except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
                raise CheckpointCorruptError(self._load_failure(key, exc)) from exc
            self._whole = (key, state[key])
        whole = self._whole[1]
        return _into(whole if not whole.dim() else whole[start:stop], out)

    def _load_failure(self, key: str, exc: BaseException) -> str:
        """What failed, in which files: DCP's own message names only the ranks (`ranks:dict_keys([0])`)."""
        causes = [pair[0] for pair in exc.failures.values()] if isinstance(exc, CheckpointException) else [exc]
        why = "; ".join(f"{type(c).__name__}: {str(c).splitlines()[0] if str(c) else ''}" for c in causes)
        try:
            files = sorted({str(self.path / c.storage.relative_path) for c in self._inner.chunks(key)})
        except CheckpointError as missing:
            return f"{self.path}: dcp.load of {key} failed ({why}): {missing}"
        return (f"dcp.load of {key} from {', '.join(files)} failed: {why}; run `fsdpkit ckpt verify {self.path}` "
                "to check every file")

    def close(self) -> None:
        self._whole = None
        self._inner.close()


class SafetensorsSource:
    """A `.safetensors` file, a Hugging Face folder (with or without an index) or an fsdpkit
    `state_dict_type=full` checkpoint's model.safetensors, read through the one safetensors reader
    (fsdpkit.hf.safetensors_reader.SafetensorsReader, which loading a folder into a model uses too):
    rows are read straight into the caller's buffer, and a tensor name in two files is refused."""

    kind = "safetensors"
    key_paths = None

    def __init__(self, path: Path, *, files: list[Path] | None = None) -> None:
        self.path = Path(path)
        self._reader = SafetensorsReader(files if files is not None else safetensors_files(self.path))
        self._tensors = {name: TensorInfo(tuple(shape), dtype)
                         for name, (dtype, shape) in self._reader.tensors().items()}

    def tensors(self) -> dict[str, TensorInfo]:
        return self._tensors

    def file_of(self, key: str) -> Path:
        return self._reader.file_of(key)

    def read_rows(self, key: str, start: int, stop: int, *, out: torch.Tensor | None = None) -> torch.Tensor:
        return self._reader.read_rows(key, start, stop, out=out)

    def close(self) -> None:
        self._reader.close()


@dataclass
class OpenedCheckpoint:
    """A resolved checkpoint: where it is, what kind, its reader and (fsdpkit only) its manifest."""

    path: Path
    kind: str  # "fsdpkit", "fsdpkit-full", "dcp" or "safetensors"
    source: Any  # a TensorSource
    manifest: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)

    def close(self) -> None:
        self.source.close()

    def __enter__(self) -> OpenedCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_checkpoint(path: str | os.PathLike, *, reader: str = "direct", part: str = "model") -> OpenedCheckpoint:
    """Open any supported checkpoint for reading (nothing is unpickled except through the
    allow-lists of fsdpkit.checkpoint.safe_io and torch_save). `notes` say what was picked
    (an Accelerate folder's part, the newest of several step directories).

    Args:
        reader: for DCP checkpoints, `direct` (byte ranges, the default) or `dcp` (`dcp.load`).
        part: `model` or `optimizer`: which directory of an Accelerate save_state folder.
    Raises:
        FileNotFoundError: no checkpoint at `path`.
        CheckpointError: an fsdpkit checkpoint that was never committed, a `latest` pointer that
            cannot be followed, or unreadable metadata (UnsafeCheckpointError for a crafted one).
    """
    if reader not in ("direct", "dcp"):
        raise ValueError(f"reader must be `direct` or `dcp`, got {reader!r}")
    located = locate_checkpoint(path, part=part)
    p, notes = located.path, located.notes
    if is_uncommitted_fsdpkit_dir(p):
        raise CheckpointError(not_committed_message(p))
    if p.local_path() is None and not (p / METADATA_FILENAME).is_file():
        raise CheckpointError(f"{p}: only DCP checkpoints (fsdpkit's sharded ones included) are read from object "
                              "storage; copy safetensors and full-state checkpoints to a local directory first")
    if p.is_file():
        return OpenedCheckpoint(p, "safetensors", SafetensorsSource(p, files=[p]), notes=notes)
    if (p / MANIFEST).is_file():
        manifest = read_manifest(p)
        if manifest.get("state_dict_type", "sharded") == "full":
            return OpenedCheckpoint(p, "fsdpkit-full", SafetensorsSource(p, files=[p / FULL_MODEL_FILE]), manifest,
                                    notes=notes)
        return OpenedCheckpoint(p, "fsdpkit", _dcp_source(p, reader, manifest), manifest, notes=notes)
    if (p / METADATA_FILENAME).is_file():
        return OpenedCheckpoint(p, "dcp", _dcp_source(p, reader), notes=notes)
    return OpenedCheckpoint(p, "safetensors", SafetensorsSource(p), notes=notes)


def _dcp_source(p: StoragePath, reader: str, manifest: dict[str, Any] | None = None) -> Any:
    if reader == "dcp" and p.local_path() is None:
        raise ValueError(f"{p}: the `dcp` reader reads local checkpoints only; use the default `direct` reader")
    if manifest is not None and manifest.get(SHARED):
        if reader == "dcp":
            raise ValueError(f"{p} references frozen tensors in {', '.join(r['dir'] for r in manifest[SHARED])}; the "
                             "`dcp` reader reads one directory: use the default `direct` reader")
        return with_shared(p, manifest)
    return DcpSource(p) if reader == "direct" else DcpLoadSource(p)


def with_shared(p: StoragePath, manifest: dict[str, Any]) -> DcpSource:
    """A DcpSource of an fsdpkit checkpoint that references shared frozen tensors
    (checkpoint/frozen.py): its metadata with each referenced key's entries added, their files
    named `shared/<name>/<file>` and found in the referenced directory."""
    metadata = read_dcp_metadata(p)
    elsewhere: dict[str, StoragePath] = {}
    for ref in manifest[SHARED]:
        directory = shared_root(p) / ref["dir"]
        theirs = read_dcp_metadata(directory)
        keys = set(ref["keys"])
        if missing := sorted(keys - theirs.state_dict_metadata.keys()):
            raise CheckpointCorruptError(f"{directory} does not hold {missing[:3]}, which {p / MANIFEST} says it "
                                         "holds; the checkpoint is incomplete")
        for key in keys:
            metadata.state_dict_metadata[key] = theirs.state_dict_metadata[key]
        for index, info in theirs.storage_data.items():
            if index.fqn in keys:
                relative = f"{ref['dir']}/{info.relative_path}"
                metadata.storage_data[index] = dataclasses.replace(info, relative_path=relative)
                elsewhere[relative] = directory / info.relative_path
    return DcpSource(p, metadata=metadata, files=elsewhere)
