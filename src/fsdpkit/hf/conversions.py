"""Which file tensor fills which model tensor, by the rules `from_pretrained` follows: transformers'
own renamings and converters for the model (`get_model_conversion_mapping`: legacy names such as
GPT-NeoX's `embed_out` for `lm_head`, Mixtral's and Qwen3-MoE's per-expert tensors fused into one
3-D tensor). The plan is made on meta tensors: no data is read.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fsdpkit.hf.library import require_transformers, transformers_class


@dataclass
class ConverterGroup:
    """File tensors that one transformers WeightConverter turns into model tensors (fused MoE
    experts: many per-expert tensors on disk, one 3-D tensor in memory)."""

    converter: Any  # a fresh transformers WeightConverter for this group
    first: str  # the first target name (what `convert` is keyed by)
    sources: dict[str, str] = field(default_factory=dict)  # file key -> the converter's source pattern it matched
    targets: dict[str, list[int]] = field(default_factory=dict)  # model name -> the shape the conversion gives


def _conversion_rules(model: nn.Module) -> tuple[list[Any], list[Any], dict[str, Any]]:
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


def plan_conversions(model: nn.Module, files: dict[str, tuple[torch.dtype, list[int]]],
                     params: dict[str, torch.Tensor]) -> tuple[dict[str, str], dict[str, ConverterGroup], list[str]]:
    """(model name -> file key for tensors read as they are, converted groups, file keys that
    match no model tensor), by the rules `from_pretrained` follows.

    Args:
        files: the file's tensors, key -> (dtype, shape).
        params: the model's tensors by the name the file would use for them.
    """
    renamings, converters, by_pattern = _conversion_rules(model)
    if not renamings and not converters:
        return {k: k for k in files if k in params}, {}, [k for k in files if k not in params]
    from transformers.core_model_loading import dot_natural_key, rename_source_key

    prefix = getattr(model, "base_model_prefix", None) or None
    direct: dict[str, str] = {}
    groups: dict[str, ConverterGroup] = {}
    unmatched = []
    for key in sorted(files, key=dot_natural_key):
        name, pattern = rename_source_key(key, renamings, converters, prefix, params)
        if name not in params and key in params:  # as from_pretrained: a key that needs no renaming
            name, pattern = key, None
        if name not in params:
            unmatched.append(key)
        elif pattern is None:
            direct[name] = key
        else:
            group = groups.setdefault(name, ConverterGroup(copy.deepcopy(by_pattern[pattern]), name))
            dtype, shape = files[key]
            group.converter.add_tensor(name, key, pattern, torch.empty(shape, dtype=dtype, device="meta"))
            group.sources[key] = pattern
    for group in groups.values():  # the shapes the conversion gives, computed on meta tensors
        out = group.converter.convert(group.first, model=model, config=model.config)
        group.targets = {k: list((v[0] if isinstance(v, list) else v).shape) for k, v in out.items()}
    return direct, groups, unmatched
