"""Read what FSDP2 actually applied, from the live modules rather than from any config.

The mesh and placements come from the parameters themselves (public DTensor API). The
per-unit settings (`reshard_after_forward`, mixed precision, offload) live only in FSDP2's
private state (`FSDPModule._get_fsdp_state()` and its parameter groups). This module is the
one place in fsdpkit that reads that state, and every read degrades to None ("unknown")
instead of raising, so a torch upgrade that moves an attribute costs a report field, never a run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

try:  # the registry of composable APIs (fully_shard, checkpoint) applied to a module
    from torch.distributed._composable.contract import _get_registry
except ImportError:  # pragma: no cover - a torch without it reports no composable AC
    def _get_registry(module: nn.Module) -> dict | None:
        return None


@dataclass(frozen=True)
class OwnParam:
    """A parameter an FSDP unit manages: its FQN from the model root, and where it is registered
    (FSDP2 swaps sharded and unsharded tensors in `owner._parameters[attr]`)."""

    fqn: str
    owner: nn.Module
    attr: str

    def current(self) -> torch.Tensor:
        """The tensor registered right now: the sharded DTensor when idle, the unsharded
        (param-dtype) tensor between FSDP's pre- and post-forward."""
        return self.owner._parameters[self.attr]


@dataclass(frozen=True)
class Unit:
    """One FSDP unit: a module with `fully_shard` applied. name is its FQN ('' for the root)."""

    name: str
    module: nn.Module
    params: tuple[OwnParam, ...]

    @property
    def label(self) -> str:
        return self.name or f"the root ({class_name(self.module)})"


def class_name(module: nn.Module) -> str:
    """The module's own class name (fully_shard swaps in a subclass named FSDP<name>)."""
    name = type(module).__name__
    return name.removeprefix("FSDP") if isinstance(module, FSDPModule) and name != "FSDPModule" else name


def python_path(fqn: str, *, root: str = "model") -> str:
    """How user code spells a module FQN: 'layers.0.mlp' -> 'model.layers[0].mlp'."""
    out = root
    for part in fqn.split(".") if fqn else []:
        out += f"[{part}]" if part.isdigit() else f".{part}"
    return out


def human_bytes(nbytes: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{int(nbytes)} B"


@dataclass(frozen=True)
class UnitSettings:
    """FSDP2's settings of one unit as applied; None where FSDP2's state did not say."""

    reshard_after_forward: bool | int | None
    mp_policy: MixedPrecisionPolicy | None
    offload: str | None  # "none", "cpu", "cpu (pinned)"


def fsdp_units(model: nn.Module) -> list[Unit]:
    """Every module with fully_shard applied, in definition order (the root first when it is
    one), each with the parameters it manages itself (not those of nested units)."""
    units = []
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            units.append(Unit(name=name, module=module, params=tuple(own_params(module, prefix=name))))
    return units


def own_params(unit: nn.Module, *, prefix: str = "") -> list[OwnParam]:
    """Parameters under `unit` that no nested FSDP unit manages (shared ones listed once)."""
    found: list[OwnParam] = []
    seen_params: set[int] = set()
    seen_modules: set[int] = set()

    def visit(module: nn.Module, path: str) -> None:
        seen_modules.add(id(module))
        for attr, p in module._parameters.items():
            if p is not None and id(p) not in seen_params:
                seen_params.add(id(p))
                found.append(OwnParam(fqn=f"{path}.{attr}" if path else attr, owner=module, attr=attr))
        for child_name, child in module.named_children():
            if isinstance(child, FSDPModule) or id(child) in seen_modules:
                continue
            visit(child, f"{path}.{child_name}" if path else child_name)

    visit(unit, prefix)
    return found


def _state(module: nn.Module):
    try:
        return module._get_fsdp_state()
    except (AttributeError, AssertionError):
        return None


def _param_groups(module: nn.Module) -> list:
    state = _state(module)
    return list(getattr(state, "_fsdp_param_groups", None) or [])


def unit_settings(unit: Unit, *, is_root: bool) -> UnitSettings:
    state = _state(unit.module)
    groups = _param_groups(unit.module)
    mp = getattr(state, "_mp_policy", None)
    if mp is None and groups:
        mp = getattr(groups[0], "mp_policy", None)
    reshard: bool | int | None = None
    offload = None
    if groups:
        group = groups[0]
        post = getattr(group, "post_forward_mesh_info", None)
        mesh_info = getattr(group, "mesh_info", None)
        if post is None:
            reshard = False
        elif mesh_info is not None and getattr(post, "shard_mesh_size", None) != getattr(mesh_info, "shard_mesh_size",
                                                                                         None):
            reshard = int(post.shard_mesh_size)  # resharded to a smaller group after forward
        else:
            reshard = True
        # Until the first forward, an automatic choice still reads True for the root; FSDP2's
        # lazy init turns it off there (the root's params are needed first in backward).
        if is_root and reshard is True and getattr(state, "_is_root", None) is None \
                and getattr(state, "_auto_reshard_after_forward", False):
            reshard = False
        policy = getattr(group, "offload_policy", None)
        if policy is not None:
            if isinstance(policy, CPUOffloadPolicy):
                offload = "cpu (pinned)" if policy.pin_memory else "cpu"
            else:
                offload = "none"
    return UnitSettings(reshard_after_forward=reshard, mp_policy=mp, offload=offload)


def mesh_and_placements(units: list[Unit]) -> tuple[tuple[int, ...], tuple[str, ...], tuple[str, ...]] | None:
    """(mesh shape, mesh dim names, placements) of the first sharded parameter, or None."""
    for unit in units:
        for p in unit.params:
            t = p.current()
            if isinstance(t, DTensor):
                mesh = t.device_mesh
                return tuple(mesh.shape), tuple(mesh.mesh_dim_names or ()), tuple(repr(pl) for pl in t.placements)
    return None


def checkpointed_modules(model: nn.Module) -> list[str]:
    """Modules that recompute activations in backward: fsdpkit's `checkpoint_activations`,
    composable `checkpoint`, torch's CheckpointWrapper, or a Hugging Face module with
    gradient_checkpointing switched on. (fsdpkit's mark, fsdpkit.parallel.fsdp.RECOMPUTES, is
    spelled out here: the diagnostics serve any FSDP2 loop and import nothing of the trainer.)"""
    names = []
    for name, module in model.named_modules():
        registry = _get_registry(module) or {}
        if "checkpoint" in registry or type(module).__name__ == "CheckpointWrapper" \
                or getattr(module, "_fsdpkit_recomputes_activations", False) is True \
                or getattr(module, "gradient_checkpointing", False) is True:
            names.append(name or type(module).__name__)
    return names


def local_nbytes(params: list[OwnParam] | tuple[OwnParam, ...]) -> int:
    """Bytes of this rank's shards of the given parameters (to_local for DTensors)."""
    total = 0
    for p in params:
        t = p.current()
        local = t.to_local() if isinstance(t, DTensor) else t
        total += local.numel() * local.element_size()
    return total


def global_nbytes(params: list[OwnParam] | tuple[OwnParam, ...]) -> int:
    """Bytes of the full (unsharded) parameters, in their stored dtype."""
    return sum(p.current().numel() * p.current().element_size() for p in params)
