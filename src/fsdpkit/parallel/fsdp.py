"""Shard a model with FSDP2: build on meta, wrap bottom-up, materialise, initialise.

The order is fixed and matters (as in torchtitan):
  1. activation checkpointing on the modules the AC policy names: their forward runs under
     non-reentrant `torch.utils.checkpoint` (in place: parameter names are unchanged);
  2. `torch.compile` of each wrapped block's forward (in place: no `_orig_mod.` in names). The
     checkpoint is inside the compiled region, so inductor plans the recompute (and replays
     random ops such as dropout exactly), as torchtitan's AC-then-compile order has it; FSDP's
     hooks stay outside;
  3. `fully_shard` on every wrap-policy module, bottom-up, then on the root;
  4. `to_empty` on the target device, deterministic init, then every buffer's value (unless the
     weights of a Hugging Face folder are loaded next: their import gives the buffers theirs, once).
"""

from __future__ import annotations

import dataclasses
import types
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import checkpoint

from fsdpkit import dist
from fsdpkit.config.schema import Config
from fsdpkit.hf.buffers import init_buffers
from fsdpkit.hf.build import build_model
from fsdpkit.hf.library import is_hf_model
from fsdpkit.log import get_logger
from fsdpkit.model import init_std, param_init_std
from fsdpkit.parallel.init import init_weights
from fsdpkit.parallel.policies import (
    matching_modules,
    mesh_shape,
    mixed_precision_policy,
    offload_policy,
    reshard_after_forward,
)

log = get_logger("parallel")


@dataclass
class ShardingPlan:
    """What apply_fsdp did, for logs and diagnostics."""

    mesh: DeviceMesh
    units: list[str]
    checkpointed: list[str]
    unit_classes: list[str]  # dotted paths of the wrapped modules' classes (what `auto` resolved to)
    checkpointed_classes: list[str]
    compiled: list[str]
    mp_policy: MixedPrecisionPolicy
    reshard_after_forward: bool


def build_mesh(cfg: Config, device: torch.device) -> DeviceMesh:
    shape, names = mesh_shape(cfg.strategy, dist.world_size(), dist.local_world_size())
    return init_device_mesh(device.type, shape, mesh_dim_names=names)


def build_sharded_model(cfg: Config, device: torch.device, *, init: bool = True, buffers: bool = True,
                        hf_config: Any = None) -> tuple[nn.Module, ShardingPlan]:
    """The configured model, sharded with FSDP2 on `device` and initialised from cfg.seed.

    Args:
        init: False when a checkpoint or a folder will be loaded: the random init is skipped.
        buffers: False when a Hugging Face folder's weights are loaded next (load_hf_weights
            initialises the buffers after them).
        hf_config: the run's resolved transformers config (fsdpkit.hf.build.build_model).
    """
    with torch.device("meta"):
        model = build_model(cfg.model, hf_config=hf_config)
    plan = apply_fsdp(model, cfg, mesh=build_mesh(cfg, device))
    materialize(model, device=device, seed=cfg.seed, cpu_offload=cfg.strategy.cpu_offload, init=init, buffers=buffers)
    return model, plan


def apply_fsdp(model: nn.Module, cfg: Config, *, mesh: DeviceMesh) -> ShardingPlan:
    """Apply AC, compile and fully_shard in place (see the module docstring for the order)."""
    pol = cfg.policy
    units = matching_modules(model, pol.auto_wrap_policy, setting="policy.auto_wrap_policy")
    if not units:
        raise ValueError("policy.auto_wrap_policy is empty; name the decoder-layer class, e.g. "
                         "fsdpkit.model.llama.LlamaDecoderLayer")
    warn_if_root_heavy(model, units, policy=pol.auto_wrap_policy)
    ac = matching_modules(model, pol.activation_checkpointing_policy, setting="policy.activation_checkpointing_policy")
    for _, module in ac:
        checkpoint_activations(module)
    compiled = []
    if cfg.train.compile:
        backend = cfg.train.compile_backend
        known = torch._dynamo.list_backends(exclude_tags=())
        if backend not in known:
            raise ValueError(f"train.compile_backend={backend!r} is not a torch.compile backend; "
                             f"use one of {', '.join(b for b in known if 'TESTING' not in b)}")
        for name, module in units:
            module.forward = torch.compile(module.forward, backend=backend)
            compiled.append(name)
    unit_classes, checkpointed_classes = _class_paths(units), _class_paths(ac)  # before fully_shard renames classes
    mp = mixed_precision_policy(pol.mixed_precision)
    reshard = reshard_after_forward(cfg.strategy)
    kwargs = dict(mesh=mesh, offload_policy=offload_policy(cfg.strategy))
    # output_dtype is about the model's output: blocks hand activations on in param dtype.
    block_mp = dataclasses.replace(mp, output_dtype=None)
    # Bottom-up: named_modules() lists parents before children, so wrap in reverse.
    for _, module in reversed(units):
        fully_shard(module, reshard_after_forward=reshard, mp_policy=block_mp, **kwargs)
    fully_shard(model, reshard_after_forward=False, mp_policy=mp, **kwargs)
    # The trainer divides each rank's loss by the *global* token count, so the true gradient is
    # the plain sum over ranks: no averaging. Force-sum keeps this a SUM collective on gloo too.
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return ShardingPlan(
        mesh=mesh,
        units=[name for name, _ in units],
        checkpointed=[name for name, _ in ac],
        unit_classes=unit_classes,
        checkpointed_classes=checkpointed_classes,
        compiled=compiled,
        mp_policy=mp,
        reshard_after_forward=reshard,
    )


RECOMPUTES = "_fsdpkit_recomputes_activations"  # set on a module by checkpoint_activations (read by diagnostics)


def _recomputed_in_backward(self: nn.Module, *args, **kwargs):
    """`self`'s class forward under non-reentrant `torch.utils.checkpoint` (checkpoint_activations)."""
    return checkpoint(type(self).forward, self, *args, use_reentrant=False, **kwargs)


def checkpoint_activations(module: nn.Module) -> None:
    """Keep only `module`'s inputs in forward and recompute the rest in backward: its forward (an
    instance attribute, so names, hooks and the class stay) runs under non-reentrant
    `torch.utils.checkpoint`, which restores the RNG state for the recompute. A bound method, not
    a closure: a deep copy of the model (an EMA, a teacher) recomputes its own layers."""
    module.forward = types.MethodType(_recomputed_in_backward, module)
    setattr(module, RECOMPUTES, True)


def _class_paths(modules: list[tuple[str, nn.Module]]) -> list[str]:
    return list({f"{type(m).__module__}.{type(m).__qualname__}": None for _, m in modules})


def warn_if_root_heavy(model: nn.Module, units: list[tuple[str, nn.Module]], *, policy: list[str]) -> None:
    """Warn when the wrap policy leaves most parameters in the root unit: the root's parameters
    are all-gathered whole for the whole forward and backward, so its memory does not shard."""
    total = sum(p.numel() for p in model.parameters())
    in_units = {id(p): p.numel() for _, unit in units for p in unit.parameters()}
    root = total - sum(in_units.values())
    if total and root / total > 0.5 and dist.is_main():
        log.warning("policy.auto_wrap_policy=%s leaves %.0f%% of the parameters (%s of %s) in the root FSDP unit, "
                    "which is gathered whole for every forward and backward: name the model's block class (the decoder "
                    "layer) so that each block is its own unit (%d units now: %s)", policy, 100 * root / total,
                    f"{root:,}", f"{total:,}", len(units), ", ".join(sorted({type(u).__name__ for _, u in units})))


def materialize(model: nn.Module, *, device: torch.device, seed: int, cpu_offload: bool = False,
                init: bool = True, buffers: bool = True) -> None:
    """Allocate the sharded model and initialise it, identically at any world size.

    With CPU offload the sharded parameters live in CPU memory; buffers (not managed by FSDP2)
    still belong on the compute device.

    Args:
        init: draw the parameters from `seed` (False: a checkpoint or folder is loaded next).
        buffers: give every buffer, and the parameters the init leaves to a transformers model,
            their values (fsdpkit.hf.buffers.init_buffers). False only when a Hugging Face
            folder's weights are loaded next: their import does it after them, and every
            parameter left to the model is in the folder.
    """
    model.to_empty(device="cpu" if cpu_offload else device)
    left: set[int] = set()
    if init:
        left = init_weights(model, seed=seed, std=init_std(model), std_of=param_init_std(model),
                            leave_to_model=is_hf_model(model))
    if buffers:
        init_buffers(model, also_params=frozenset(left))
    if cpu_offload:
        for module in model.modules():
            for name, buf in module.named_buffers(recurse=False):
                module._buffers[name] = buf.to(device)
