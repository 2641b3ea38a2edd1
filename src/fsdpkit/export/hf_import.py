"""Initialise an (already sharded) model from Hugging Face safetensors, each rank reading only
the slices it owns.

For every parameter and persistent buffer, a DTensor's local shard is located in the global
tensor (`compute_local_shape_and_global_offset`, any placements: Shard on any dim, Replicate,
2-D meshes) and exactly the rows that slice spans are read (`SafetensorsRows`), converted to the
parameter's dtype and copied in. No rank materialises the full model, and no collective runs,
so ranks may call it at different speeds. Everything is checked before the first copy.
"""

from __future__ import annotations

import copy
import math
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from fsdpkit.checkpoint.errors import CheckpointCorruptError, CheckpointMismatchError
from fsdpkit.checkpoint.manifest import dtype_name
from fsdpkit.checkpoint.storage import RangeReader, StoragePath, open_storage
from fsdpkit.export.keys import clean_name
from fsdpkit.export.safetensors_io import read_header, safetensors_files
from fsdpkit.model import reset_nonpersistent_buffers
from fsdpkit.model.hf import require_transformers, transformers_class

# Buffers that older transformers versions saved but that every model recomputes.
IGNORED_FILE_KEYS = ("rotary_emb.inv_freq",)


def _file_index(hf_dir: Path) -> dict[str, tuple[Path, torch.dtype, list[int]]]:
    files = [hf_dir] if hf_dir.is_file() else safetensors_files(hf_dir)
    index = {}
    for file in files:
        for name, (dtype, shape, _, _) in read_header(file).tensors.items():
            index[name] = (file, dtype, shape)
    return index


def _model_tensors(model: nn.Module, rename: Callable[[str], str | None] | None) -> dict[str, torch.Tensor]:
    """The model's parameters and persistent buffers by the name the file uses for them."""
    out = {}
    for key, t in model.state_dict(keep_vars=True).items():
        name = clean_name(key) if rename is None else rename(clean_name(key))
        if name is not None:
            out[name] = t
    return out


def _aliases(params: dict[str, torch.Tensor]) -> dict[str, list[str]]:
    """State-dict names of the same tensor (tied weights), each name -> all its names."""
    by_id: dict[int, list[str]] = {}
    for name, t in params.items():
        by_id.setdefault(id(t), []).append(name)
    return {n: names for names in by_id.values() for n in names}


@dataclass
class _Converted:
    """File tensors that one transformers WeightConverter turns into model tensors (fused MoE
    experts: many per-expert tensors on disk, one 3-D tensor in memory)."""

    converter: Any  # a fresh transformers WeightConverter for this group
    first: str  # the first target name (what `convert` is keyed by)
    sources: dict[str, str] = field(default_factory=dict)  # file key -> the converter's source pattern it matched
    targets: dict[str, list[int]] = field(default_factory=dict)  # model name -> the shape the conversion gives


def _conversions(model: nn.Module) -> tuple[list[Any], list[Any], dict[str, Any]]:
    """transformers' own renamings and converters for `model` (those `from_pretrained` applies,
    legacy names included), or none for a model transformers did not build."""
    if not hasattr(model, "base_model_prefix") or not hasattr(model, "config"):
        return [], [], {}
    require_transformers()
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming

    with transformers_class(model):  # the rules are looked up by class name
        mapping = get_model_conversion_mapping(model)
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    return renamings, converters, {pattern: c for c in converters for pattern in c.source_patterns}


def _plan(model: nn.Module, index: dict[str, tuple[Any, torch.dtype, list[int]]],
          params: dict[str, torch.Tensor]) -> tuple[dict[str, str], dict[str, _Converted], list[str]]:
    """(model name -> file key for tensors read as they are, converted groups, file keys that
    match no model tensor), by the rules `from_pretrained` follows."""
    renamings, converters, by_pattern = _conversions(model)
    if not renamings and not converters:
        return {k: k for k in index if k in params}, {}, [k for k in index if k not in params]
    from transformers.core_model_loading import dot_natural_key, rename_source_key

    prefix = getattr(model, "base_model_prefix", None) or None
    direct: dict[str, str] = {}
    groups: dict[str, _Converted] = {}
    unmatched = []
    for key in sorted(index, key=dot_natural_key):
        name, pattern = rename_source_key(key, renamings, converters, prefix, params)
        if name not in params and key in params:  # as from_pretrained: a key that needs no renaming
            name, pattern = key, None
        if name not in params:
            unmatched.append(key)
        elif pattern is None:
            direct[name] = key
        else:
            group = groups.setdefault(name, _Converted(copy.deepcopy(by_pattern[pattern]), name))
            group.converter.add_tensor(name, key, pattern, _meta(index[key]))
            group.sources[key] = pattern
    for group in groups.values():  # the shapes the conversion gives, computed on meta tensors
        out = group.converter.convert(group.first, model=model, config=model.config)
        group.targets = {k: list((v[0] if isinstance(v, list) else v).shape) for k, v in out.items()}
    return direct, groups, unmatched


def _meta(entry: tuple[Any, torch.dtype, list[int]]) -> torch.Tensor:
    return torch.empty(entry[2], dtype=entry[1], device="meta")


def load_hf_weights(model: nn.Module, hf_dir: str | os.PathLike, *,
                    rename: Callable[[str], str | None] | None = None, grow_rows: bool = False,
                    storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Fill `model`'s parameters and persistent buffers from safetensors in `hf_dir`.

    Works on FSDP2-sharded models (each rank reads its own slices; call it on every rank) and
    on plain modules. File names and layouts are mapped to the model's by transformers' own
    conversion rules (`get_model_conversion_mapping`: what `from_pretrained` applies, e.g. the
    per-expert tensors of Mixtral or Qwen3-MoE fused into one 3-D tensor, GPT-NeoX's `embed_out`
    as `lm_head`). A tensor read as it is costs each rank only its own rows; a tensor that a
    converter builds from several file tensors is read whole, one at a time, then cut. Coverage
    is proven both ways: every model tensor is loaded and every file tensor used, else nothing is
    loaded. Non-persistent buffers (RoPE tables) are not in the files: they are recomputed
    afterwards. A tied weight absent from the file (transformers writes `lm_head` once, as
    `model.embed_tokens.weight`) is filled from its twin.

    Args:
        hf_dir: a Hugging Face folder (model.safetensors, or shards with an index) or one file.
        rename: maps a model name to the file's name for it, or to None for tensors the file
            does not hold by design (LoRA adapters: fsdpkit.model.peft.peft_base_name).
        grow_rows: a model tensor with more dim-0 rows than the file's (a vocabulary grown to a
            tokenizer) takes the file's rows as its first rows; the others keep their values.
        storage_options: opens `hf_dir` when it is a URL (e.g. endpoint_url; the trainer passes
            checkpoint.storage_options).
    Returns:
        {"loaded", "converted", "grown", "ignored", "files", "conversions", "bytes_read", "seconds"}
        for this rank (`bytes_read` counts what it read).
    Raises:
        FileNotFoundError: no safetensors there.
        CheckpointMismatchError: shape mismatches, model tensors the folder lacks or folder tensors
            the model lacks, listing every one; nothing has been modified then.
    """
    t0 = time.perf_counter()
    hf_dir = open_storage(hf_dir, storage_options)  # a local folder, or an fsspec URL read by ranged GETs
    if not hf_dir.exists():
        raise FileNotFoundError(f"{hf_dir} does not exist")
    index = _file_index(hf_dir)
    params = _model_tensors(model, rename)
    aliases = _aliases(params)
    direct, groups, unmatched = _plan(model, index, params)
    converted = {name: group for group in groups.values() for name in group.targets}
    plan: dict[str, str] = {}  # model name -> file key
    missing, mismatched = [], []
    grown: dict[str, int] = {}  # model name -> the file's rows (fewer than the model's)
    for name, t in params.items():
        if name in converted:
            shape = converted[name].targets[name]
            if shape != list(t.shape):
                mismatched.append(f"{name}: {len(converted[name].sources)} file tensors give {shape} "
                                  f"({next(iter(converted[name].sources))}, ...), model {list(t.shape)}")
            continue
        source = next((direct[a] for a in [name, *aliases.get(name, [])] if a in direct), None)
        if source is None:
            if not any(a in converted for a in aliases.get(name, [])):
                missing.append(f"{name} {list(t.shape)}")
            continue
        shape = index[source][2]
        if grow_rows and len(shape) == t.ndim and shape[1:] == list(t.shape[1:]) and 0 < shape[0] < t.shape[0]:
            grown[name] = shape[0]
        elif list(t.shape) != shape:
            mismatched.append(f"{name}: file {shape} ({index[source][0].name}), model {list(t.shape)}")
            continue
        plan[name] = source
    ignored = sorted(k for k in unmatched if k.endswith(IGNORED_FILE_KEYS))
    unexpected = sorted(k for k in unmatched if k not in ignored)
    problems = [f"  shape differs: {m}" for m in mismatched]
    problems += [f"  missing from {hf_dir.name}: {m}" for m in missing]
    problems += [f"  not in the model: {u} {index[u][2]}" for u in unexpected]
    if problems:
        raise CheckpointMismatchError(
            f"{hf_dir} does not fit {type(model).__name__} ({len(problems)} problem(s)); nothing was loaded:\n"
            + "\n".join(problems[:60]) + ("\n  ..." if len(problems) > 60 else "")
            + "\ncheck that the model config is the folder's config.json (model.path builds the model from it); a "
              "tensor the model does not have, or lacks, would be left untrained or random"
        )
    conversions: Counter[str] = Counter()
    bytes_read = 0
    handles: dict[Path, SafetensorsRows] = {}

    def handle(file: Path) -> SafetensorsRows:
        if file not in handles:
            handles[file] = SafetensorsRows(file)
        return handles[file]

    try:
        done: set[int] = set()
        with torch.no_grad():
            for name, source in plan.items():
                target = params[name]
                if id(target) in done:  # the second name of a tied weight
                    continue
                done.add(id(target))
                local, piece = _local_piece(target)
                if name in grown:  # only the rows the file has: [0, its rows) of the global tensor
                    stop = min(piece[0].stop, grown[name])
                    local = local[: max(0, stop - piece[0].start)]
                    piece = (slice(piece[0].start, max(piece[0].start, stop)), *piece[1:])
                if local.numel() == 0:
                    continue
                file = handle(index[source][0])
                values = file.get_tensor(source) if not piece else file.get_slice(source)[piece]
                bytes_read += values.numel() * values.element_size()
                if values.dtype != local.dtype:
                    conversions[f"{dtype_name(values.dtype)}->{dtype_name(local.dtype)}"] += 1
                local.copy_(values.reshape(local.shape))
            for group in groups.values():
                for key in group.sources:
                    bytes_read += math.prod(index[key][2]) * index[key][1].itemsize
                tensors: dict[str, list[torch.Tensor]] = {}  # in the planned (transformers') order
                for key, pattern in group.sources.items():
                    tensors.setdefault(pattern, []).append(handle(index[key][0]).get_tensor(key))
                group.converter.collected_tensors = tensors
                out = group.converter.convert(group.first, model=model, config=model.config)
                for name, values in out.items():
                    values = values[0] if isinstance(values, list) else values
                    local, piece = _local_piece(params[name])
                    if values.dtype != local.dtype:
                        conversions[f"{dtype_name(values.dtype)}->{dtype_name(local.dtype)}"] += 1
                    if local.numel():
                        local.copy_(values[piece] if piece else values)
    finally:
        for h in handles.values():
            h.close()
    reset_nonpersistent_buffers(model, keep_persistent=True)  # the persistent ones were just loaded
    return {"loaded": len(plan) + len(converted), "converted": {n: list(g.sources) for n, g in converted.items()},
            "grown": grown, "ignored": ignored,
            "files": sorted({str(index[s][0]) for s in [*plan.values(),
                                                        *(k for g in groups.values() for k in g.sources)]}),
            "conversions": dict(conversions), "bytes_read": bytes_read, "seconds": time.perf_counter() - t0}


class SafetensorsRows:
    """The part of `safetensors.safe_open` that loading uses (`get_tensor`, `get_slice(name)[piece]`),
    read with plain reads instead of a memory map: a piece costs one read of the dim-0 rows it
    spans (the other dims are cut in memory) into a buffer of its own, so a rank reads its own
    shard's rows and holds no page of the file once they are copied (mapped file pages would stay
    resident, counted in its RSS, until the file is closed). Local files are read with `pread`,
    files in object storage with ranged GETs. Close it (or use it as a context manager)."""

    def __init__(self, path: StoragePath):
        self.path, self.header = path, read_header(path)
        self._ranges: RangeReader | None = open_storage(path).open_ranges()

    def close(self) -> None:
        if self._ranges is not None:
            self._ranges.close()
            self._ranges = None

    def __enter__(self) -> SafetensorsRows:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def get_tensor(self, name: str) -> torch.Tensor:
        return self.get_slice(name)[()]

    def get_slice(self, name: str) -> _RowSlice:
        return _RowSlice(self, name)

    def _read_into(self, view: memoryview, offset: int) -> int:
        assert self._ranges is not None, "read after close"
        return self._ranges.read_into(view, offset)

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        dtype, shape, begin, _ = self.header.tensors[name]
        row = dtype.itemsize * math.prod(shape[1:])
        data = bytearray((stop - start) * row)
        if not data:
            return torch.empty([max(0, stop - start), *shape[1:]], dtype=dtype)
        got = self._read_into(memoryview(data), self.header.data_start + begin + start * row)
        if got != len(data):
            raise CheckpointCorruptError(f"{self.path}: {name} ends early ({got} of {len(data)} bytes)")
        return torch.frombuffer(data, dtype=dtype).reshape([stop - start, *shape[1:]])


class _RowSlice:
    def __init__(self, file: SafetensorsRows, name: str):
        self.file, self.name = file, name

    def __getitem__(self, piece: tuple[slice, ...]) -> torch.Tensor:
        shape = self.file.header.tensors[self.name][1]
        if not shape:  # a 0-dim tensor: its bytes are one "row"
            dtype, _, begin, end = self.file.header.tensors[self.name]
            data = bytearray(end - begin)
            got = self.file._read_into(memoryview(data), self.file.header.data_start + begin)
            if got != len(data):
                raise CheckpointCorruptError(f"{self.file.path}: {self.name} ends early ({got} of {len(data)} bytes)")
            return torch.frombuffer(data, dtype=dtype).reshape([])
        piece = piece or tuple(slice(0, s) for s in shape)
        rows = self.file.rows(self.name, piece[0].start or 0, min(shape[0], piece[0].stop))
        return rows[(slice(None), *piece[1:])]


def _local_piece(t: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """(this rank's local tensor, the global slice it holds); an empty slice tuple for 0-dim."""
    if isinstance(t, DTensor):
        local = t.to_local()
        shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        return local, tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))
    data = t.data if isinstance(t, nn.Parameter) else t
    return data, tuple(slice(0, s) for s in t.shape)
