"""Is the gradient norm a loop computed (and clipped to) the global one, over every shard?

With FSDP2 each rank holds a shard of every gradient. `clip_grad_norm_(model.parameters(), m)`
over the DTensor gradients reduces across the mesh and returns the global norm, but a norm
taken over local tensors (`p.grad.to_local()`, a hand-written sum of squares) is a per-shard
norm: every rank clips by a different factor and nothing fails. Two cheap, patch-free signals
catch it after the fact: a global norm is identical on every rank (one all-gather of a float),
and after clipping to max_norm the true global norm of the gradients cannot exceed max_norm.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor

from fsdpkit import tunables
from fsdpkit.diagnostics.findings import (
    ERROR,
    GRAD_NORM_MISMATCH,
    PER_SHARD_GRAD_NORM,
    Finding,
    report_findings,
)
from fsdpkit.diagnostics.gather import all_gather_floats

CLIP_HINT = ("clip the DTensor gradients themselves: norm = torch.nn.utils.clip_grad_norm_(model.parameters(), "
             "max_norm) reduces over every shard and returns the global norm as a DTensor "
             "(use float(norm.full_tensor())); never pass p.grad.to_local() or local shards")


def global_grad_norm(parameters: Iterable[torch.Tensor]) -> float | None:
    """The L2 norm of all gradients over every shard (collectives on DTensor meshes), or None
    when no parameter has a gradient. Call on every rank."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return None
    total = torch.nn.utils.get_total_norm(grads, foreach=True)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    return float(total)


def grad_norm_findings(norm: float | torch.Tensor, *, parameters: Iterable[torch.Tensor], max_norm: float = 0.0,
                       rtol: float | None = None) -> list[Finding]:
    """The checks of `check_grad_norm`, returned instead of reported."""
    if rtol is None:  # covers foreach and summation-order rounding
        rtol = tunables.current().diag_grad_norm_rtol
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    norm = float(norm)
    post = global_grad_norm(list(parameters))
    per_rank = [row[0] for row in all_gather_floats([norm])]
    spread = max(per_rank) - min(per_rank)
    if spread > rtol * max(abs(x) for x in per_rank):
        shown = ", ".join(f"rank {r}: {x:.6g}" for r, x in enumerate(per_rank[:4]))
        return [Finding(ERROR, PER_SHARD_GRAD_NORM,
                        f"the gradient norm differs across ranks ({shown}): it was computed over each rank's local "
                        f"shards, so every rank clipped its gradients by a different factor; {CLIP_HINT}")]
    if post is None:
        return []
    clipping = max_norm > 0 and math.isfinite(max_norm)
    if clipping and post > max_norm * (1 + rtol):
        return [Finding(ERROR, PER_SHARD_GRAD_NORM,
                        f"after clipping to max_norm={max_norm:g} the global gradient norm is {post:.6g}: the "
                        f"gradients were clipped per shard (each shard to max_norm, not the whole); {CLIP_HINT}")]
    expected = norm * min(1.0, max_norm / (norm + 1e-6)) if clipping else norm
    if abs(post - expected) > rtol * max(expected, 1e-12):
        state = "after clipping " if clipping else ""
        return [Finding(ERROR, GRAD_NORM_MISMATCH,
                        f"the reported gradient norm {norm:.6g} is not the global norm of the gradients (they have "
                        f"{post:.6g} {state}over every shard, {expected:.6g} expected); {CLIP_HINT}")]
    return []


def check_grad_norm(norm: float | torch.Tensor, *, parameters: Iterable[torch.Tensor], max_norm: float = 0.0,
                    rtol: float | None = None, strict: bool = True) -> list[Finding]:
    """Check that `norm` is the global gradient norm and that clipping was global. Call on every
    rank right after clipping, before optimizer.zero_grad() (once is enough: the first step).
    Two small collectives.

    Args:
        norm: the (pre-clip) norm your clipping computed or returned.
        parameters: the model's parameters (their .grad are read, not changed).
        max_norm: the clipping threshold you used; 0 or inf when you only measured.
        rtol: relative tolerance for norms that should agree (default FSDPKIT_DIAG_GRAD_NORM_RTOL, 1e-3).
        strict: raise on a failed check (True) or only log it.

    Raises:
        FSDPContractError: strict and the norm or clipping was per shard.
    """
    return report_findings(grad_norm_findings(norm, parameters=parameters, max_norm=max_norm, rtol=rtol), strict=strict)
