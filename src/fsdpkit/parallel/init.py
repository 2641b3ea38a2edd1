"""Weight initialisation that gives the same weights at any world size, without any rank
ever materialising a full parameter it does not own.

Each parameter's dim-0 rows are split into fixed blocks of `ROWS_PER_BLOCK`; block b of the
parameter named `fqn` is drawn from its own generator seeded by (seed, fqn, b). A rank draws
only the blocks overlapping its local shard and keeps the rows it owns, so the values depend on
the seed and the name alone, never on how the parameter is sharded.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

ROWS_PER_BLOCK = 64
"""Part of the init's definition, not a tunable: another block size draws other weights from the
same seed (and the config saved with a run would not say so)."""


def _block_seed(seed: int, fqn: str, block: int) -> int:
    return zlib.crc32(f"{seed}:{fqn}:{block}".encode()) | ((seed & 0xFFFF) << 32)


def _rows(fqn: str, *, seed: int, shape: torch.Size, start: int, stop: int, std: float) -> torch.Tensor:
    """Rows [start, stop) of the N(0, std) tensor of `shape` named `fqn`, on CPU in fp32."""
    rest = tuple(shape[1:])
    out = torch.empty((stop - start, *rest))
    first, last = start // ROWS_PER_BLOCK, (stop - 1) // ROWS_PER_BLOCK if stop > start else -1
    for b in range(first, last + 1):
        b0, b1 = b * ROWS_PER_BLOCK, min((b + 1) * ROWS_PER_BLOCK, shape[0])
        g = torch.Generator().manual_seed(_block_seed(seed, fqn, b))
        block = torch.randn((b1 - b0, *rest), generator=g) * std
        lo, hi = max(b0, start), min(b1, stop)
        out[lo - start : hi - start] = block[lo - b0 : hi - b0]
    return out


def _local_view(param: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(local tensor, global row offset of its first row)."""
    if isinstance(param, DTensor):
        local = param.to_local()
        _, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        if any(offset[1:]):
            raise NotImplementedError("deterministic init supports dim-0 sharding only, got placements "
                                      f"{param.placements}")
        return local, offset[0]
    return param, 0


def _is_norm(module: nn.Module) -> bool:
    return "norm" in type(module).__name__.lower()


@torch.no_grad()
def init_weights(model: nn.Module, *, seed: int, std: float,
                 std_of: Callable[[str], float | None] | None = None,
                 leave_to_model: bool = False) -> set[int]:
    """Initialise parameters deterministically from (seed, name): normal(0, std) for every
    parameter of two or more dimensions (linear, embedding, GPT-2's Conv1D, fused MoE experts,
    routers), ones for norm weights, zeros for biases. `std_of(fqn)`, when it returns a number,
    overrides that: normal(0, that std), or zeros for 0 (LoRA adapters).

    With `leave_to_model` (transformers models), norm weights, biases and every other 1-D parameter
    are left alone: their values are constants that the model's own `_init_weights` decides (Gemma's
    norms start at 0, since they scale by 1 + weight), see fsdpkit.hf.buffers.init_buffers.

    Works on plain tensors and on FSDP2 DTensor shards alike (tied weights are visited once).
    Returns:
        The ids of the parameters left to the model.
    Raises:
        NotImplementedError: without `leave_to_model`, a 1-D parameter that is neither a bias nor a
            norm weight (no rule says what it should start at).
    """
    seen: set[int] = set()
    left: set[int] = set()
    for mod_name, module in model.named_modules():
        for p_name, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            fqn = f"{mod_name}.{p_name}" if mod_name else p_name
            local, row0 = _local_view(param)
            special = std_of(fqn) if std_of is not None else None
            if special == 0.0:
                local.zero_()
            elif special is not None or param.ndim >= 2:
                if local.numel():
                    rows = _rows(fqn, seed=seed, shape=param.shape, start=row0, stop=row0 + local.shape[0],
                                 std=std if special is None else special)
                    local.copy_(rows)
            elif leave_to_model:
                left.add(id(param))
            elif p_name == "bias":
                local.zero_()
            elif _is_norm(module):
                local.fill_(1.0)
            else:
                raise NotImplementedError(
                    f"no deterministic init rule for parameter {fqn!r} ({list(param.shape)}) of "
                    f"{type(module).__name__}: fsdpkit draws every matrix from the seed and starts biases at 0 and "
                    "norm weights at 1, but cannot tell what this 1-D parameter should start at. Start from trained "
                    "weights instead (model.path or model.init_from=hf:DIR)"
                )
    return left
