"""Initialise an (already sharded) model from Hugging Face safetensors, each rank reading only
the slices it owns.

For every parameter and persistent buffer, a DTensor's local shard is located in the global
tensor (`compute_local_shape_and_global_offset`, any placements: Shard on any dim, Replicate,
2-D meshes) and exactly the rows that slice spans are read (safetensors_reader.py), converted to
the parameter's dtype and copied in. No rank materialises the full model, and no collective runs,
so ranks may call it at different speeds. Everything is checked before the first copy; the
buffers are initialised after the last (buffers.py).
"""

from __future__ import annotations

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

from fsdpkit.checkpoint.errors import CheckpointMismatchError
from fsdpkit.checkpoint.manifest import dtype_name
from fsdpkit.checkpoint.storage import StoragePath, open_storage
from fsdpkit.hf.buffers import init_buffers
from fsdpkit.hf.conversions import ConverterGroup, plan_conversions
from fsdpkit.hf.safetensors_reader import SafetensorsReader, safetensors_files
from fsdpkit.model.names import clean_name

# Buffers that older transformers versions saved but that every model recomputes.
IGNORED_FILE_KEYS = ("rotary_emb.inv_freq",)
_LISTED = 60  # problems shown in a refusal


def load_hf_weights(model: nn.Module, hf_dir: str | os.PathLike, *,
                    rename: Callable[[str], str | None] | None = None, grow_rows: bool = False,
                    storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Fill `model`'s parameters and persistent buffers from safetensors in `hf_dir`, then give
    its other buffers their values (buffers.init_buffers: the one time a run initialises them).

    Works on FSDP2-sharded models (each rank reads its own slices; call it on every rank) and
    on plain modules. File names and layouts are mapped to the model's by transformers' own
    conversion rules (conversions.py: what `from_pretrained` applies, e.g. the per-expert tensors
    of Mixtral or Qwen3-MoE fused into one 3-D tensor, GPT-NeoX's `embed_out` as `lm_head`). A
    tensor read as it is costs each rank only its own rows; a tensor that a converter builds from
    several file tensors is read whole, one at a time, then cut. Coverage is proven both ways:
    every model tensor is loaded and every file tensor used, else nothing is loaded.
    Non-persistent buffers (RoPE tables) are not in the files: they are computed afterwards. A
    tied weight absent from the file (transformers writes `lm_head` once, as
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
        CheckpointCorruptError: a file that is not safetensors or is truncated, or a tensor name
            in two files (naming both).
        CheckpointMismatchError: shape mismatches, model tensors the folder lacks or folder tensors
            the model lacks, listing every one; nothing has been modified then.
    """
    t0 = time.perf_counter()
    hf_dir = open_storage(hf_dir, storage_options)  # a local folder, or an fsspec URL read by ranged GETs
    if not hf_dir.exists():
        raise FileNotFoundError(f"{hf_dir} does not exist")
    with SafetensorsReader([hf_dir] if hf_dir.is_file() else safetensors_files(hf_dir)) as reader:
        match = _match(model, reader, _model_tensors(model, rename), grow_rows=grow_rows, where=hf_dir)
        conversions: Counter[str] = Counter()
        with torch.no_grad():
            bytes_read = _copy_direct(match, reader, conversions) + _copy_converted(match, reader, model, conversions)
        files = sorted({str(reader.file_of(k)) for k in [*match.plan.values(), *match.converted_keys()]})
    init_buffers(model, keep_persistent=True)  # the persistent ones were just loaded
    return {"loaded": len(match.plan) + len(match.converted),
            "converted": {n: list(g.sources) for n, g in match.converted.items()},
            "grown": match.grown, "ignored": match.ignored, "files": files, "conversions": dict(conversions),
            "bytes_read": bytes_read, "seconds": time.perf_counter() - t0}


@dataclass
class _Match:
    """Where each model tensor comes from, checked both ways."""

    params: dict[str, torch.Tensor]  # the model's tensors by the file's name for them
    plan: dict[str, str] = field(default_factory=dict)  # model name -> file key, read as stored
    groups: dict[str, ConverterGroup] = field(default_factory=dict)  # built by transformers' converters
    converted: dict[str, ConverterGroup] = field(default_factory=dict)  # model name -> its group
    grown: dict[str, int] = field(default_factory=dict)  # model name -> the file's rows (fewer than the model's)
    ignored: list[str] = field(default_factory=list)  # file keys no model needs (IGNORED_FILE_KEYS)

    def converted_keys(self) -> list[str]:
        return [k for g in self.groups.values() for k in g.sources]


def _match(model: nn.Module, reader: SafetensorsReader, params: dict[str, torch.Tensor], *, grow_rows: bool,
           where: Path | StoragePath) -> _Match:
    """The plan of every copy, or CheckpointMismatchError listing every problem (nothing loaded)."""
    files = reader.tensors()
    aliases = _aliases(params)
    direct, groups, unmatched = plan_conversions(model, files, params)
    match = _Match(params, groups=groups, converted={n: g for g in groups.values() for n in g.targets})
    missing, mismatched = [], []
    for name, t in params.items():
        if name in match.converted:
            group = match.converted[name]
            if group.targets[name] != list(t.shape):
                mismatched.append(f"{name}: {len(group.sources)} file tensors give {group.targets[name]} "
                                  f"({next(iter(group.sources))}, ...), model {list(t.shape)}")
            continue
        source = next((direct[a] for a in [name, *aliases.get(name, [])] if a in direct), None)
        if source is None:
            if not any(a in match.converted for a in aliases.get(name, [])):
                missing.append(f"{name} {list(t.shape)}")
            continue
        shape = files[source][1]
        if grow_rows and len(shape) == t.ndim and shape[1:] == list(t.shape[1:]) and 0 < shape[0] < t.shape[0]:
            match.grown[name] = shape[0]
        elif list(t.shape) != shape:
            mismatched.append(f"{name}: file {shape} ({reader.file_of(source).name}), model {list(t.shape)}")
            continue
        match.plan[name] = source
    match.ignored = sorted(k for k in unmatched if k.endswith(IGNORED_FILE_KEYS))
    unexpected = sorted(k for k in unmatched if k not in match.ignored)
    problems = [f"  shape differs: {m}" for m in mismatched]
    problems += [f"  missing from {where.name}: {m}" for m in missing]
    problems += [f"  not in the model: {u} {files[u][1]}" for u in unexpected]
    if problems:
        raise CheckpointMismatchError(
            f"{where} does not fit {type(model).__name__} ({len(problems)} problem(s)); nothing was loaded:\n"
            + "\n".join(problems[:_LISTED]) + ("\n  ..." if len(problems) > _LISTED else "")
            + "\ncheck that the model config is the folder's config.json (model.path builds the model from it); a "
              "tensor the model does not have, or lacks, would be left untrained or random"
        )
    return match


def _copy_direct(match: _Match, reader: SafetensorsReader, conversions: Counter[str]) -> int:
    """Copy the tensors read as stored, each rank its own rows; returns the bytes read."""
    bytes_read = 0
    done: set[int] = set()
    for name, source in match.plan.items():
        target = match.params[name]
        if id(target) in done:  # the second name of a tied weight
            continue
        done.add(id(target))
        local, piece = _local_piece(target)
        if name in match.grown:  # only the rows the file has: [0, its rows) of the global tensor
            stop = min(piece[0].stop, match.grown[name])
            local = local[: max(0, stop - piece[0].start)]
            piece = (slice(piece[0].start, max(piece[0].start, stop)), *piece[1:])
        if local.numel() == 0:
            continue
        values = reader.read(source, piece)
        bytes_read += values.numel() * values.element_size()
        if values.dtype != local.dtype:
            conversions[f"{dtype_name(values.dtype)}->{dtype_name(local.dtype)}"] += 1
        local.copy_(values.reshape(local.shape))
    return bytes_read


def _copy_converted(match: _Match, reader: SafetensorsReader, model: nn.Module, conversions: Counter[str]) -> int:
    """Build each converted group's tensors from its file tensors (read whole, one group at a
    time) by transformers' converter, and copy each rank's slice; returns the bytes read."""
    bytes_read = 0
    files = reader.tensors()
    for group in match.groups.values():
        tensors: dict[str, list[torch.Tensor]] = {}  # in the planned (transformers') order
        for key, pattern in group.sources.items():
            dtype, shape = files[key]
            bytes_read += math.prod(shape) * dtype.itemsize
            tensors.setdefault(pattern, []).append(reader.read(key))
        group.converter.collected_tensors = tensors
        out = group.converter.convert(group.first, model=model, config=model.config)
        for name, values in out.items():
            values = values[0] if isinstance(values, list) else values
            local, piece = _local_piece(match.params[name])
            if values.dtype != local.dtype:
                conversions[f"{dtype_name(values.dtype)}->{dtype_name(local.dtype)}"] += 1
            if local.numel():
                local.copy_(values[piece] if piece else values)
    return bytes_read


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


def _local_piece(t: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """(this rank's local tensor, the global slice it holds); an empty slice tuple for 0-dim."""
    if isinstance(t, DTensor):
        local = t.to_local()
        shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        return local, tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))
    data = t.data if isinstance(t, nn.Parameter) else t
    return data, tuple(slice(0, s) for s in t.shape)
