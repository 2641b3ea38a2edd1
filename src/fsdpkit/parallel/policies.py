"""Config → FSDP2 policy objects: wrap/AC class lists, mixed precision, offload, mesh shape."""

from __future__ import annotations

import importlib
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

from fsdpkit.config.schema import StrategyConfig

AUTO = "auto"  # a policy entry: the model's own block classes (_no_split_modules)
PRESETS: dict[str, MixedPrecisionPolicy] = {
    "fp32": MixedPrecisionPolicy(),
    # bf16 compute, fp32 gradient reduction, fp32 outputs; buffers are never cast by FSDP2.
    "bf16-mixed": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                       output_dtype=torch.float32),
    "bf16-true": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16,
                                      output_dtype=torch.float32),
}


def import_class(path: str, *, setting: str) -> type:
    module_name, _, cls_name = path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), cls_name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{setting}: cannot import {path!r} ({e}); give a dotted path such as "
                         "fsdpkit.model.llama.LlamaDecoderLayer") from None
    if not isinstance(cls, type) or not issubclass(cls, nn.Module):
        raise ValueError(f"{setting}: {path!r} is not an nn.Module class")
    return cls


def auto_classes(model: nn.Module, *, setting: str) -> list[type]:
    """The classes the model names in `_no_split_modules` (its decoder layers: what transformers and
    Accelerate keep whole), as found among its modules.

    Raises:
        ValueError: the model names none, or none of them is among its modules.
    """
    names = set(getattr(model, "_no_split_modules", None) or ())
    found = list({type(m): None for m in model.modules() if type(m).__name__ in names})
    if not found:
        raise ValueError(f"{setting}=auto: {type(model).__name__} names no block class in _no_split_modules "
                         f"({sorted(names) or 'none'}) that is among its modules; give the decoder-layer class as a "
                         "dotted path, e.g. transformers.models.llama.modeling_llama.LlamaDecoderLayer")
    return found


def matching_modules(model: nn.Module, paths: list[str], *, setting: str) -> list[tuple[str, nn.Module]]:
    """Modules of the model that are instances of any listed class, in definition order. `auto`
    in the list stands for the model's own block classes (`auto_classes`).

    Raises:
        ValueError: the list is non-empty and matches nothing; names what was looked for and
            which classes the model has.
    """
    if not paths:
        return []
    classes = tuple(c for p in paths
                    for c in (auto_classes(model, setting=setting) if p == AUTO
                              else [import_class(p, setting=setting)]))
    found = [(name, m) for name, m in model.named_modules() if name and isinstance(m, classes)]
    if not found:
        have = sorted({f"{type(m).__module__}.{type(m).__qualname__}" for m in model.modules()})
        raise ValueError(
            f"{setting} = {paths} matches no module of {type(model).__name__}; "
            f"the model's module classes are: {', '.join(have)}"
        )
    return found


def mixed_precision_policy(spec: Any) -> MixedPrecisionPolicy:
    if isinstance(spec, str):
        return PRESETS[spec]
    from hydra.utils import instantiate

    policy = instantiate(spec)
    if not isinstance(policy, MixedPrecisionPolicy):
        raise ValueError(f"policy.mixed_precision._target_ returned {type(policy).__name__}, not a "
                         "MixedPrecisionPolicy")
    return policy


def offload_policy(strategy: StrategyConfig) -> OffloadPolicy:
    if not strategy.cpu_offload:
        return OffloadPolicy()
    # Pinned memory needs an accelerator; CPUOffloadPolicy's default would fail on CPU-only hosts.
    return CPUOffloadPolicy(pin_memory=torch.cuda.is_available())


def reshard_after_forward(strategy: StrategyConfig) -> bool:
    if strategy.reshard_after_forward is not None:
        return strategy.reshard_after_forward
    return strategy.sharding_strategy in ("FULL_SHARD", "HYBRID_SHARD")


def mesh_shape(strategy: StrategyConfig, world_size: int, local_world_size: int) -> tuple[tuple[int, ...],
                                                                                          tuple[str, ...]]:
    """FULL_SHARD/SHARD_GRAD_OP: 1-D (shard,). HYBRID_SHARD: (replicate, shard).
    NO_SHARD: (world, 1), i.e. replicate everywhere, shard over a group of one."""
    if strategy.sharding_strategy == "HYBRID_SHARD":
        shard = strategy.hsdp_shard_size or local_world_size
        return (world_size // shard, shard), ("replicate", "shard")
    if strategy.sharding_strategy == "NO_SHARD":
        return (world_size, 1), ("replicate", "shard")
    return (world_size,), ("shard",)
