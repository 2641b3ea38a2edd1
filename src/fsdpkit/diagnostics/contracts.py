"""Static contract checks of a sharded model and its optimizer: no collectives, no forward.

Each check returns Findings whose text says what is wrong, where, and the corrected call.
`check()` runs them all; the forward-time checks live in forward.py, the gradient-norm
check in grad_norm.py.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from fsdpkit.diagnostics.findings import (
    ERROR,
    MIXED_PRECISION_NOT_PROPAGATED,
    NOT_SHARDED,
    ONLY_ROOT_SHARDED,
    OPTIMIZER_BEFORE_SHARDING,
    PARAMS_NOT_IN_OPTIMIZER,
    PARAMS_OUTSIDE_UNITS,
    REGISTERED_TWICE,
    SHARED_ACROSS_UNITS,
    WARNING,
    Finding,
    report_findings,
)
from fsdpkit.diagnostics.fsdp_state import (
    class_name,
    fsdp_units,
    human_bytes,
    own_params,
    unit_settings,
)

SHARD_BLOCKS_HINT = ("apply fully_shard to each block first, then to the root: "
                     "`for block in model.layers: fully_shard(block)` then `fully_shard(model)` "
                     "(in fsdpkit: policy.auto_wrap_policy names the block class)")


def _names(items: list[str], limit: int = 4) -> str:
    shown = ", ".join(repr(n) for n in items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


def dtype_name(dtype: torch.dtype | None) -> str:
    return "unset" if dtype is None else str(dtype).removeprefix("torch.")


def check_sharding(model: nn.Module) -> list[Finding]:
    """The model is sharded at all, by more than its root, and the root covers the rest."""
    units = fsdp_units(model)
    if not units:
        return [Finding(ERROR, NOT_SHARDED,
                        f"{class_name(model)} is not sharded: no module has fully_shard applied, so every rank holds "
                        f"and trains a full, unsynchronised copy; {SHARD_BLOCKS_HINT}")]
    findings = []
    if not isinstance(model, FSDPModule):
        outside = [p.fqn for p in own_params(model)]
        if outside:
            findings.append(Finding(
                ERROR, PARAMS_OUTSIDE_UNITS,
                f"{len(outside)} parameters are outside every FSDP unit ({_names(outside)}): the root "
                f"{class_name(model)} has no fully_shard, so these stay plain tensors whose gradients are never "
                "reduced across ranks and the ranks drift apart silently; call fully_shard(model) on the root "
                "after sharding the blocks"))
    elif len(units) == 1:
        holders = [n for n, m in model.named_modules() if n and any(True for _ in m.parameters(recurse=False))]
        if len(holders) > 1:
            nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
            findings.append(Finding(
                WARNING, ONLY_ROOT_SHARDED,
                f"only the root module is sharded: fully_shard(model) made one FSDP unit holding all "
                f"{len(holders)} parameter-holding submodules ({human_bytes(nbytes)}), so every forward and backward "
                f"all-gathers the whole model at once and peak memory is that of an unsharded model (the wrap "
                f"policy matched nothing?); {SHARD_BLOCKS_HINT}"))
    return findings


def _unit_of(model: nn.Module, path: str) -> int | None:
    """id of the innermost FSDP unit whose subtree holds `path` (None: no unit)."""
    parts = path.split(".") if path else []
    for i in range(len(parts), -1, -1):
        module = model.get_submodule(".".join(parts[:i]))
        if isinstance(module, FSDPModule):
            return id(module)
    return None


def check_shared(model: nn.Module) -> list[Finding]:
    """Modules registered under two parents, and parameters shared by two FSDP units."""
    names_of: dict[int, list[str]] = defaultdict(list)
    module_by_id: dict[int, nn.Module] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        names_of[id(module)].append(name)
        module_by_id[id(module)] = module
    dup_groups = [names for key, names in names_of.items()
                  if len(names) > 1 and any(True for _ in module_by_id[key].parameters())]
    dup_names = {n for names in dup_groups for n in names}
    findings, covered = [], []
    for names in dup_groups:
        # Report only the outermost duplicate: the children of a module registered twice are too.
        if all(any(n.startswith(d + ".") for d in dup_names) for n in names):
            continue
        module = module_by_id[id(model.get_submodule(names[0]))]
        covered.extend(names)
        units = {_unit_of(model, n) for n in names}
        nbytes = sum(p.numel() * p.element_size() for p in module.parameters())
        where = f"{class_name(module)} is registered {len(names)} times, as {_names(names)}"
        if len(units) > 1:
            findings.append(Finding(
                ERROR, SHARED_ACROSS_UNITS,
                f"{where}, under different FSDP units: each unit would all-gather, shard and own its "
                f"{human_bytes(nbytes)} of parameters separately (FSDP2 refuses this with an obscure error); "
                "register the module once, or put every user of the shared weights in one unit: "
                "fully_shard([module_a, module_b])"))
        else:
            findings.append(Finding(
                WARNING, REGISTERED_TWICE,
                f"{where}: the same parameters are reachable under {len(names)} parents, so state_dict(), "
                f"checkpoints and full-state exports hold its {human_bytes(nbytes)} {len(names)} times; "
                "register it once (keep other references in a plain attribute or pass it as an argument), "
                "unless the sharing is intended"))
    fqns_of: dict[int, list[str]] = defaultdict(list)
    for fqn, p in model.named_parameters(remove_duplicate=False):
        fqns_of[id(p)].append(fqn)
    for fqns in fqns_of.values():
        if len(fqns) < 2 or any(f.startswith(c + ".") for f in fqns for c in covered):
            continue
        if len({_unit_of(model, f.rpartition(".")[0]) for f in fqns}) > 1:
            findings.append(Finding(
                ERROR, SHARED_ACROSS_UNITS,
                f"parameter {_names(fqns)} is shared by modules in different FSDP units, which would each "
                "shard and all-gather it; put the sharing modules in one unit: fully_shard([module_a, module_b]) "
                "(tied embeddings: leave embedding and output layer to the root unit)"))
    return findings


def check_mixed_precision(model: nn.Module, *, param_dtype: torch.dtype | None = None) -> list[Finding]:
    """Every unit computes with the same parameter dtype: the requested one, or the root's."""
    units = [u for u in fsdp_units(model) if u.params]
    if not units:
        return []
    effective: dict[str, torch.dtype] = {}
    for unit in units:
        mp = unit_settings(unit, is_root=unit.module is model).mp_policy
        stored = unit.params[0].current().dtype
        effective[unit.label] = mp.param_dtype if mp is not None and mp.param_dtype is not None else stored
    root = units[0] if units[0].module is model else None
    wanted = param_dtype or (effective[root.label] if root is not None else None)
    if wanted is None:
        return []
    wrong = [label for label, dtype in effective.items() if dtype != wanted]
    if not wrong:
        return []
    got = sorted({dtype_name(effective[w]) for w in wrong})
    source = "was requested" if param_dtype is not None else "is the root's param_dtype"
    return [Finding(
        ERROR, MIXED_PRECISION_NOT_PROPAGATED,
        f"mixed precision did not reach every FSDP unit: {dtype_name(wanted)} {source}, but {len(wrong)} of "
        f"{len(units)} units compute with {'/'.join(got)} parameters ({_names(wrong)}), which doubles their "
        "all-gather and activation memory; pass the same mp_policy to every fully_shard call, e.g. "
        f"mp = MixedPrecisionPolicy(param_dtype=torch.{dtype_name(wanted)}, reduce_dtype=torch.float32); "
        "fully_shard(block, mp_policy=mp) for each block, then fully_shard(model, mp_policy=mp)")]


def check_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[Finding]:
    """The optimizer updates the sharded DTensor parameters the model actually uses."""
    model_params = {id(p): name for name, p in model.named_parameters()}
    held = [p for group in optimizer.param_groups for p in group["params"]]
    stale = [p for p in held if id(p) not in model_params]
    if stale:
        kinds = sorted({type(p).__name__ for p in stale})
        example = f"a {kinds[0]} of shape {list(stale[0].shape)}"
        dtensors = any(isinstance(p, DTensor) for p in model.parameters())
        why = ("fully_shard replaced every parameter with a sharded DTensor, so optimizer.step() updates the old "
               "tensors and the model never changes" if dtensors else
               "optimizer.step() updates tensors the model does not use")
        return [Finding(
            ERROR, OPTIMIZER_BEFORE_SHARDING,
            f"the optimizer holds {len(stale)} of {len(held)} tensors that are not parameters of the model "
            f"(e.g. {example}); it was built before sharding: {why}. Create the optimizer after fully_shard: "
            "`fully_shard(model)` first, then `optimizer = torch.optim.AdamW(model.parameters(), ...)`")]
    held_ids = {id(p) for p in held}
    missing = [name for name, p in model.named_parameters() if p.requires_grad and id(p) not in held_ids]
    if missing:
        return [Finding(
            WARNING, PARAMS_NOT_IN_OPTIMIZER,
            f"{len(missing)} trainable parameters are not in the optimizer ({_names(missing)}) and will never be "
            "updated; build the optimizer from model.parameters(), or set requires_grad=False on frozen ones")]
    return []


def run_static_checks(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                      param_dtype: torch.dtype | None = None) -> list[Finding]:
    """Every static check; returns the findings without logging or raising."""
    findings = check_sharding(model)
    if any(f.code == NOT_SHARDED for f in findings):
        return findings + (check_optimizer(model, optimizer) if optimizer is not None else [])
    findings += check_shared(model)
    findings += check_mixed_precision(model, param_dtype=param_dtype)
    if optimizer is not None:
        findings += check_optimizer(model, optimizer)
    return findings


def check(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
          param_dtype: torch.dtype | None = None, strict: bool = True) -> list[Finding]:
    """Check a model sharded with FSDP2 (and its optimizer) for the setup mistakes that make
    training silently wrong. Call it on every rank after sharding and building the optimizer;
    it runs no collectives. Warnings are logged on rank 0.

    Args:
        model: the root module after fully_shard.
        optimizer: the optimizer that will step the model, if built.
        param_dtype: the parameter dtype you asked mixed precision for (None: the root's policy).
        strict: raise on errors (True) or only log them (False).

    Returns:
        Every finding (errors included when strict=False).

    Raises:
        FSDPContractError: strict and a check failed; the message says how to fix it.
    """
    return report_findings(run_static_checks(model, optimizer, param_dtype=param_dtype), strict=strict)
