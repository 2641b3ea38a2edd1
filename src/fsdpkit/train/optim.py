"""AdamW, the warmup + cosine schedule, and global gradient-norm clipping."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fsdpkit.config.schema import OptimConfig


def build_optimizer(model: nn.Module, cfg: OptimConfig, *, device: torch.device) -> torch.optim.AdamW:
    """AdamW over the model's (already sharded) parameters; weight decay on matrices only."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    impl = cfg.impl if cfg.impl != "auto" else ("fused" if device.type == "cuda" else "foreach")
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=tuple(cfg.betas),
        eps=cfg.eps,
        fused=impl == "fused",
        foreach=impl == "foreach",
    )


class WarmupCosine:
    """LR multiplier for optimizer step `step` (0-based): linear warmup, then cosine or constant."""

    def __init__(self, *, warmup_steps: int, max_steps: int, schedule: str, min_lr_ratio: float):
        self.warmup_steps, self.max_steps = warmup_steps, max_steps
        self.schedule, self.min_lr_ratio = schedule, min_lr_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.max_steps - self.warmup_steps))
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, *,
                    max_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    fn = WarmupCosine(warmup_steps=cfg.warmup_steps, max_steps=max_steps, schedule=cfg.schedule,
                      min_lr_ratio=cfg.min_lr_ratio)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)


def clip_grad_norm(params: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Clip to the true global L2 norm over every shard of every gradient; returns that norm, a
    0-d tensor on the gradients' device (not read back here: the step reads it with its other
    values, in one device-to-host copy).

    With DTensor gradients `clip_grad_norm_` reduces across the mesh and returns a replicated
    DTensor, so the norm (and the clipping) is global, never per shard. max_norm 0 measures only.
    """
    total = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else math.inf, foreach=True)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    return total
