"""Seeding and deterministic algorithms."""

from __future__ import annotations

import os
import random

import numpy as np
import torch


def seed_everything(seed: int, *, rank: int) -> None:
    """Seed every generator. Each rank gets its own stream (seed + rank) for anything random in
    the step; weights and data order are derived from `seed` alone elsewhere."""
    random.seed(seed + rank)
    np.random.seed((seed + rank) % 2**32)
    torch.manual_seed(seed + rank)


def enable_determinism() -> None:
    """Deterministic kernels everywhere; must run before the first CUDA call."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
