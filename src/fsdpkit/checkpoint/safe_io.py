"""Read DCP checkpoints without ever running code that the checkpoint brings with it.

Why this module exists: torch.distributed.checkpoint (DCP, torch 2.13) reads a checkpoint's
`.metadata` with plain `pickle.load` (`FileSystemReader.read_metadata`), and
`DefaultLoadPlanner.load_bytes` reads every non-tensor item (optimizer `param_groups`, step
counters, any plain Python value in the state dict) with `torch.load(weights_only=False)`. Both
execute whatever a crafted file asks for (`os.system`, `builtins.exec`, ...) before anything can
be checked. A checkpoint directory is data that may come from a shared filesystem, a bucket or a
colleague, so fsdpkit must treat it as untrusted.

The replacements here keep DCP's file format and loading machinery and change only how bytes
become objects:

* `SafeUnpickler` resolves only the globals that a genuine DCP `.metadata` contains (found by
  tracing real checkpoints: model + AdamW state, FSDP2 DTensors, plain Python values, tensors of
  every dtype) and refuses everything else with `UnsafeCheckpointError` before it is called.
* `read_dcp_metadata` and `SafeFileSystemReader` use it for `.metadata` files.
* `SafeLoadPlanner` loads non-tensor items with `torch.load(weights_only=True)`.

Tensor payloads need nothing here: `FileSystemReader.read_data` already loads them with
`torch.load(weights_only=True)`.
"""

from __future__ import annotations

import gc
import io
import os
import pathlib
import pickle
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, Any

import torch
import xxhash
from torch.distributed.checkpoint import metadata as _dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from fsdpkit.checkpoint.errors import CheckpointCorruptError, CheckpointError, UnsafeCheckpointError

__all__ = [
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "SafeUnpickler",
    "read_dcp_metadata",
    "unpickle_dcp_metadata",
]

METADATA_FILENAME = ".metadata"


def _layout_from_name(name: object) -> torch.layout:
    """Stand-in for `torch.serialization._get_layout`, which is how `torch.layout` pickles.

    Why a stand-in: the real function is a harmless lookup too, but this one accepts nothing
    except the `str()` of a layout that exists on the `torch` module, so a crafted argument
    cannot reach anything else.
    """
    if isinstance(name, str) and name.startswith("torch."):
        obj = vars(torch).get(name.removeprefix("torch."))
        if isinstance(obj, torch.layout):
            return obj
    raise pickle.UnpicklingError(f"{name!r} is not the name of a torch.layout")


# Every (module, name) that a genuine DCP `.metadata` asks pickle for, mapped to the object we
# hand back. Resolved here once, never by importing or getattr-ing what the file names, so a
# dotted name such as `Metadata.__init__` or a module attribute such as `metadata.os` cannot
# slip through.
_ALLOWED_GLOBALS: dict[tuple[str, str], Any] = {
    # The checkpoint's own schema: Metadata holds state_dict_metadata (Tensor/BytesStorageMetadata
    # per key), TensorProperties, chunk lists, MetadataIndex keys of storage_data and StorageMeta.
    # _MEM_FORMAT_ENCODING is how TensorProperties.__getstate__ stores the memory format.
    **{
        ("torch.distributed.checkpoint.metadata", cls.__name__): cls
        for cls in (
            _dcp_metadata.Metadata,
            _dcp_metadata.TensorStorageMetadata,
            _dcp_metadata.BytesStorageMetadata,
            _dcp_metadata.ChunkStorageMetadata,
            _dcp_metadata.TensorProperties,
            _dcp_metadata.MetadataIndex,
            _dcp_metadata.StorageMeta,
            _dcp_metadata._MEM_FORMAT_ENCODING,
        )
    },
    # FileSystemWriter's storage_data values: which file, offset and length hold each item.
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    # Tensor sizes and chunk offsets/sizes.
    ("torch", "Size"): torch.Size,
    # torch.layout pickles as `torch.serialization._get_layout("torch.strided")`.
    ("torch.serialization", "_get_layout"): _layout_from_name,
    # StorageMeta.checkpoint_id is the writer's path, a pathlib.Path (constructing one does no I/O).
    ("pathlib", "PosixPath"): pathlib.PosixPath,
    ("pathlib", "WindowsPath"): pathlib.WindowsPath,
    # Inert containers. Not produced by DCP's own planner at pickle protocol 4, but a model's
    # state_dict is an OrderedDict and older protocols spell sets as globals.
    ("collections", "OrderedDict"): OrderedDict,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
}

# torch.dtype objects pickle as the global `torch.<name>` (e.g. `torch.bfloat16`); layouts and
# memory formats would too. Allowed by the type of the object found, not by a list of names, so
# new dtypes keep working.
_TORCH_CONSTANT_TYPES = (torch.dtype, torch.layout, torch.memory_format)

# Allowed objects whose attributes a crafted pickle could overwrite: pickle's BUILD opcode applied
# to a class (rather than an instance) sets class attributes, which would change DCP for the rest
# of the process. Snapshotted before and restored after every load. (C types such as torch.Size
# and dtype objects are immutable; snapshotting them anyway is cheap and keeps this simple.)
_SNAPSHOTTED = tuple(obj for obj in _ALLOWED_GLOBALS.values() if hasattr(obj, "__dict__"))


def _refusal(source: str, what: str) -> str:
    return (
        f"`{source}` asks to load `{what}`, which a DCP checkpoint never needs; refusing to "
        "unpickle it (nothing was executed). The file is corrupt or was crafted; do not load it "
        "with plain pickle or torch.load(weights_only=False)"
    )


class SafeUnpickler(pickle.Unpickler):
    """An unpickler for DCP `.metadata` files that refuses every global a genuine one never needs.

    Why: pickle runs code through the globals a stream names (`posix.system`, `builtins.exec`,
    `subprocess.run`, ...). Overriding `find_class` is the one point where every such global
    passes before it can be called; refusing there means nothing from the file ever runs.
    Persistent ids are refused by `pickle.Unpickler` itself, since no `persistent_load` is set.

    Use `load()` as usual; it additionally undoes and refuses any attempt to overwrite attributes
    of the allowed classes (pickle's BUILD opcode applied to a class object).
    """

    def __init__(self, file: IO[bytes], *, source: str | os.PathLike | None = None) -> None:
        super().__init__(file)
        self.source = str(source if source is not None else getattr(file, "name", "<stream>"))

    def find_class(self, module: str, name: str) -> Any:
        """Return the allowed object for `module.name`; raise UnsafeCheckpointError otherwise."""
        obj = _ALLOWED_GLOBALS.get((module, name))
        if obj is not None:
            return obj
        if module == "torch" and isinstance(name, str) and name.isidentifier():
            # vars(), not getattr(): torch's module __getattr__ imports submodules lazily.
            obj = vars(torch).get(name)
            if isinstance(obj, _TORCH_CONSTANT_TYPES):
                return obj
        raise UnsafeCheckpointError(_refusal(self.source, f"{module}.{name}"))

    def load(self) -> Any:
        """Unpickle, then make sure no allowed class or function had its attributes changed."""
        before = [(obj, dict(vars(obj))) for obj in _SNAPSHOTTED]
        try:
            return super().load()
        finally:
            tampered = _restore(before)
            if tampered:
                raise UnsafeCheckpointError(
                    f"`{self.source}` tries to overwrite attributes of {', '.join(tampered)}, which "
                    "a DCP checkpoint never does; refused and undone (nothing was executed). The "
                    "file is corrupt or was crafted; do not load it with plain pickle or "
                    "torch.load(weights_only=False)"
                )


def _restore(before: list[tuple[Any, dict[str, Any]]]) -> list[str]:
    """Put back any attribute of the allowed objects that changed; return which objects changed."""
    tampered = []
    for obj, saved in before:
        now = vars(obj)
        changed = [k for k in now if k not in saved or now[k] is not saved[k]]
        missing = [k for k in saved if k not in now]
        if not changed and not missing:
            continue
        tampered.append(getattr(obj, "__qualname__", repr(obj)))
        for key in changed:
            if key in saved:
                setattr(obj, key, saved[key])
            else:
                delattr(obj, key)
        for key in missing:
            setattr(obj, key, saved[key])
    return tampered


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector for one `.metadata` unpickle; restored after, also on error.

    Why: a cluster-sized `.metadata` unpickles into millions of small objects that all survive, and
    the collector's allocation-triggered passes keep traversing them: a 22 MiB file (1,024 ranks)
    reads in 3.6-4.1 s with the collector on and 1.6-1.8 s paused (bench/metadata_read.py, two
    runs). In a process that already holds many objects the cost is a lottery: in B9 at 1,024
    simulated ranks the same file took 32.6 s in one read and 0.96 s in another
    (bench/RESULTS-coordinator.md). A genuine file makes no garbage; whatever a refused or garbled
    one leaves behind is collected once the collector runs again. A collector that was off stays off.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def unpickle_dcp_metadata(stream: IO[bytes], *, source: str | os.PathLike) -> Metadata:
    """Unpickle a DCP `.metadata` from an open binary stream with `SafeUnpickler`.

    Why separate from `read_dcp_metadata`: storage readers open files through their own
    filesystem layer (local, fsspec); they share this one decoding step. `source` names the file
    in error messages. Raises UnsafeCheckpointError for a refused global and CheckpointCorruptError
    when the bytes are not a complete DCP Metadata pickle.
    """
    try:
        with _gc_paused():
            metadata = SafeUnpickler(stream, source=source).load()
    except CheckpointError:
        raise
    except Exception as exc:  # any decoding failure of untrusted bytes means "corrupt"
        raise CheckpointCorruptError(
            f"`{source}` is not a readable DCP metadata file ({type(exc).__name__}: {exc}); it is "
            "truncated or garbled. Re-copy the checkpoint, or resume from an earlier one"
        ) from exc
    if not isinstance(metadata, Metadata):
        raise CheckpointCorruptError(
            f"`{source}` holds a {type(metadata).__name__}, not DCP Metadata; it is not a DCP "
            "checkpoint's metadata file"
        )
    return metadata


def read_dcp_metadata(path: str | os.PathLike) -> Metadata:
    """Read a DCP checkpoint's metadata without executing anything it contains.

    Why: to inspect or validate a checkpoint (keys, shapes, dtypes) before loading it, without
    trusting it. `path` is the checkpoint directory (its `.metadata` is read) or the metadata file
    itself. The returned Metadata is exactly what was saved (no load_id is stamped on it).

    Raises FileNotFoundError naming the missing file, UnsafeCheckpointError when the file asks
    for anything outside the allow-list, CheckpointCorruptError when it is truncated or garbled.
    """
    from fsdpkit.checkpoint.storage import open_storage  # (storage imports nothing from here)

    path = open_storage(path)  # a local Path, or a RemotePath for a URL
    file = path / METADATA_FILENAME if path.is_dir() else path
    try:
        stream = file.open("rb")
    except FileNotFoundError:
        raise FileNotFoundError(
            f"No DCP metadata at `{file}`: not a checkpoint directory, or the save never finished"
        ) from None
    with stream:
        return unpickle_dcp_metadata(stream, source=file)


class SafeMetadataReading:
    """Mixin for a DCP FileSystemReader (local or fsspec) that reads `.metadata` with
    `SafeUnpickler` instead of `pickle.load`. Mirrors `FileSystemReader.read_metadata` exactly,
    except for the unpickling; `self.fs` decides where the bytes come from.

    With `expected_files` (the manifest's `files` of the directory), `.metadata` is read whole
    and its size and xxh3-64 checked against its entry before it is unpickled
    (CheckpointCorruptError naming the file otherwise).

    A reader parses its file once: fsdpkit reads the metadata before `dcp.load` (to check what the
    checkpoint holds), and `dcp.load` reads it again on every rank; the second read is the first's
    object (keyed by file and load id, so a `reset` to another checkpoint reads that one)."""

    expected_files: dict[str, Any] | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        path = self._get_metadata_path(rank)
        parsed = self.__dict__.setdefault("_parsed_metadata", {})
        key = (str(path), self.load_id)
        if key in parsed:
            return parsed[key]
        expected = (self.expected_files or {}).get(METADATA_FILENAME) if rank is None else None
        with self.fs.create_stream(path, "rb") as metadata_file:
            if expected is None:
                metadata = unpickle_dcp_metadata(metadata_file, source=path)
            else:
                metadata = unpickle_dcp_metadata(io.BytesIO(_checked(metadata_file.read(), expected, path)),
                                                 source=path)

        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        parsed[key] = metadata
        return metadata


def _checked(data: bytes, expected: dict[str, Any], path: Any) -> bytes:
    """`data` if its size and xxh3-64 are the manifest's `expected`; else CheckpointCorruptError."""
    if len(data) != expected["size"]:
        raise CheckpointCorruptError(f"{path} has {len(data)} bytes, expected {expected['size']} (truncated or "
                                     "overwritten); nothing was unpickled from it")
    digest = xxhash.xxh3_64_hexdigest(data)
    if digest != expected["xxh3_64"]:
        raise CheckpointCorruptError(f"{path} fails its checksum (xxh3_64 {digest}, expected {expected['xxh3_64']}): "
                                     "the file is corrupt; nothing was unpickled from it")
    return data


class SafeFileSystemReader(SafeMetadataReading, FileSystemReader):
    """`FileSystemReader` that reads `.metadata` with `SafeUnpickler` instead of `pickle.load`.

    Why: DCP calls `read_metadata` before anything else in `dcp.load`; the stock reader would run
    a crafted file's code right there. Everything else (file layout, slicing, tensor reads, which
    already use `torch.load(weights_only=True)`) is inherited unchanged. (`storage/safe_fsspec.py` has the
    same for URLs.)

    Note: `dcp.load` catches any exception from `read_metadata()` and retries with
    `read_metadata(rank=...)` (the `__<rank>.metadata` file); both go through this method, and the
    refusal text survives in the final error, but its type does not. Call `read_metadata()` (or
    `read_dcp_metadata`) yourself first if you need the exception type.
    """


class SafeLoadPlanner(DefaultLoadPlanner):
    """`DefaultLoadPlanner` that loads non-tensor items with `torch.load(weights_only=True)`.

    Why: DCP stores every non-tensor value of the state dict (optimizer `param_groups`, counters,
    config) as a `torch.save` blob and the stock planner reads it with `weights_only=False`, which
    runs any `__reduce__` the blob carries. `weights_only=True` accepts plain data (numbers,
    strings, bytes, lists, tuples, dicts, OrderedDicts, sets, tensors, dtypes) and nothing else.
    """

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """Mirror `DefaultLoadPlanner.load_bytes` exactly, except for `weights_only=True`."""
        fqn = read_item.dest_index.fqn
        obj = _load_plain_bytes(value, fqn=fqn)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def _load_plain_bytes(value: io.BytesIO, *, fqn: str) -> Any:
    """torch.load one BYTE_IO item with weights_only=True, naming the key in any error."""
    try:
        return torch.load(value, weights_only=True)
    except pickle.UnpicklingError as exc:
        # torch's message is a page of advice to retry with weights_only=False; keep only the
        # line that says what was refused ("... GLOBAL posix.system ..." in its two wordings).
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        reason = next((line for line in lines if "GLOBAL" in line), lines[0] if lines else "")
        reason = reason.split(" Please use `torch.serialization.add_safe_globals")[0]
        raise UnsafeCheckpointError(
            f"Checkpoint item `{fqn}` holds pickled objects that torch.load(weights_only=True) "
            f"refuses ({reason}); refusing to load it (nothing was executed). The checkpoint is "
            "corrupt or was crafted; do not load it with torch.load(weights_only=False)"
        ) from exc
    except (RuntimeError, EOFError, ValueError) as exc:
        raise CheckpointCorruptError(
            f"Checkpoint item `{fqn}` is not a readable torch.save payload "
            f"({type(exc).__name__}: {exc}); the checkpoint's data file is truncated or garbled"
        ) from exc
