"""One all-gather of a few floats per rank, for figures every rank computes for itself."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as tdist


def collective_device() -> torch.device:
    """Where a small tensor must live for the default group's backend: CUDA for NCCL, else CPU."""
    if tdist.is_initialized() and tdist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_floats(values: Sequence[float]) -> list[list[float]]:
    """Every rank's `values` (same length on all ranks), indexed by rank; one collective on the
    default group, none in a world of one."""
    mine = torch.tensor(list(values), dtype=torch.float64, device=collective_device())
    if not (tdist.is_initialized() and tdist.get_world_size() > 1):
        return [mine.tolist()]
    out = [torch.empty_like(mine) for _ in range(tdist.get_world_size())]
    tdist.all_gather(out, mine)
    return [t.tolist() for t in out]
