"""Forward-time checks for the first step: FSDP's hooks ran, and parameters had the dtype mixed
precision asked for.

FSDP2 all-gathers a unit's parameters in a forward pre-hook, so `unit.forward(x)` called
directly (instead of `unit(x)`) computes with sharded DTensors (an obscure "mixed torch.Tensor
and DTensor" error) or, worse, with stale unsharded copies whose gradients are never
reduce-scattered. Hooks alone cannot see such a call (it skips them too), so for the watched
step each unit's `forward` is wrapped by a guard that only lets calls through that came via
`nn.Module.__call__` (our pre-hook, registered after FSDP's, arms it). The pre-hook also
records the dtype of the unit's parameters as FSDP2 unsharded them. `finish()` removes the
hooks and restores `forward`: after the first step the model runs exactly as before.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fsdpkit.diagnostics.contracts import dtype_name
from fsdpkit.diagnostics.findings import (
    ERROR,
    FORWARD_BYPASSED_HOOKS,
    FP32_IN_FORWARD,
    NO_FORWARD_SEEN,
    WARNING,
    Finding,
    FSDPContractError,
    report_findings,
)
from fsdpkit.diagnostics.fsdp_state import Unit, fsdp_units, python_path, unit_settings


def bypass_message(unit: Unit) -> str:
    call = python_path(unit.name)
    return (f"{unit.label}.forward() was called directly, which skips FSDP's pre-forward hook: its parameters "
            "are not all-gathered (they are still sharded DTensors, or stale copies from an earlier step) and its "
            f"gradients would never be reduce-scattered; call the module instead: {call}(x), not {call}.forward(x)")


@dataclass
class _Watched:
    unit: Unit
    expected_dtype: torch.dtype | None
    armed: bool = False
    calls: int = 0
    wrong_dtype: list[str] = field(default_factory=list)  # "fqn (dtype)" seen in the first call
    still_sharded: list[str] = field(default_factory=list)
    had_forward_attr: bool = False
    prior_forward: Any = None
    handle: Any = None


class ForwardWatch:
    """Guards and hooks on every FSDP unit until `finish()`; built by `watch_forward`.
    Also a context manager: `with watch_forward(model): <one training step>` checks on exit."""

    def __init__(self, watched: list[_Watched]):
        self._watched = watched
        self._active = False

    def _install(self) -> None:
        for w in self._watched:
            module = w.unit.module
            w.had_forward_attr = "forward" in module.__dict__  # e.g. torch.compile'd in place
            w.prior_forward = module.__dict__.get("forward")
            inner = module.forward
            w.handle = module.register_forward_pre_hook(functools.partial(_pre_forward, w))
            module.forward = functools.update_wrapper(functools.partial(_guarded_forward, w, inner), inner)
        self._active = True

    def remove(self) -> None:
        """Remove hooks and guards (idempotent); the model runs as if never watched."""
        if not self._active:
            return
        for w in self._watched:
            w.handle.remove()
            if w.had_forward_attr:
                w.unit.module.forward = w.prior_forward
            else:
                del w.unit.module.forward
        self._active = False

    def findings(self) -> list[Finding]:
        """What the watched forward passes showed (call after at least one step)."""
        called = [w for w in self._watched if w.calls]
        if not called:
            return [Finding(WARNING, NO_FORWARD_SEEN,
                            "no FSDP unit ran forward through nn.Module.__call__ while watched; run one training "
                            "step between watch_forward(model) and finish(), calling model(x)")]
        out = []
        wrong = [w for w in called if w.wrong_dtype]
        if wrong:
            want = dtype_name(wrong[0].expected_dtype)
            examples = [f"{w.unit.label}: {w.wrong_dtype[0]}" for w in wrong]
            out.append(Finding(
                ERROR, FP32_IN_FORWARD,
                f"mixed precision asks for {want} parameters in forward, but {len(wrong)} FSDP units computed with "
                f"other dtypes ({'; '.join(examples[:3])}{'; ...' if len(examples) > 3 else ''}): their memory and "
                "compute are those of full precision; give every fully_shard call "
                f"mp_policy=MixedPrecisionPolicy(param_dtype=torch.{want}, ...) and do not cast parameters "
                "(model.float(), .to(dtype)) after sharding"))
        sharded = [e for w in called for e in w.still_sharded]
        if sharded:
            out.append(Finding(
                ERROR, FORWARD_BYPASSED_HOOKS,
                f"parameters were still sharded DTensors inside forward ({', '.join(sharded[:3])}): something "
                "replaced or skipped FSDP's pre-forward all-gather; call units through module(x) and do not "
                "reassign their parameters after fully_shard"))
        return out

    def finish(self, *, strict: bool = True) -> list[Finding]:
        """Remove the hooks, then report what the watched step showed.

        Raises:
            FSDPContractError: strict and a forward-time check failed.
        """
        self.remove()
        return report_findings(self.findings(), strict=strict)

    def __enter__(self) -> ForwardWatch:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finish()
        else:
            self.remove()


def _pre_forward(w: _Watched, module: nn.Module, args: tuple) -> None:
    # Registered after FSDP's (prepended) pre-hook, so the parameters are unsharded here.
    w.armed = True
    w.calls += 1
    if w.calls > 1:
        return
    for p in w.unit.params:
        t = p.current()
        if isinstance(t, DTensor):
            w.still_sharded.append(p.fqn)
        elif w.expected_dtype is not None and t.is_floating_point() and t.dtype != w.expected_dtype:
            w.wrong_dtype.append(f"{p.fqn} {dtype_name(t.dtype)}")


def _guarded_forward(w: _Watched, inner: Any, *args: Any, **kwargs: Any) -> Any:
    if not w.armed:
        raise FSDPContractError([Finding(ERROR, FORWARD_BYPASSED_HOOKS, bypass_message(w.unit))])
    w.armed = False
    return inner(*args, **kwargs)


def watch_forward(model: nn.Module, *, param_dtype: torch.dtype | None = None) -> ForwardWatch:
    """Watch the next forward passes of every FSDP unit of `model` (call on every rank, after
    sharding, before the first step; then `finish()` after it).

    A unit whose `.forward()` is called directly raises FSDPContractError at that call. The
    dtype check expects `param_dtype`, or else each unit's own MixedPrecisionPolicy
    param_dtype (units without one are not dtype-checked).

    Args:
        model: the root module after fully_shard.
        param_dtype: the parameter dtype mixed precision was asked for.

    Returns:
        The installed ForwardWatch.
    """
    watched = []
    for unit in fsdp_units(model):
        mp = unit_settings(unit, is_root=unit.module is model).mp_policy
        expected = param_dtype or (mp.param_dtype if mp is not None else None)
        watched.append(_Watched(unit=unit, expected_dtype=expected))
    watch = ForwardWatch(watched)
    watch._install()
    return watch
