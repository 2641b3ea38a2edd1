"""What a checkpoint holds, gathered from (and restored into) a training run.

- DCP tensors: `model.*` and `optim.*` (sharded, from torch's `get_state_dict`, whose keys are
  wrapper-free FQNs) and `rng.rank<r>.*` (each rank's generators);
- the manifest (JSON): the `Stateful` pieces that are small and the same on every rank — trainer
  counters, LR scheduler, data cursor.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class CheckpointTarget:
    """The live objects a checkpoint is taken from and restored into."""

    model: nn.Module
    optimizer: torch.optim.Optimizer | None
    stateful: dict[str, Stateful] = field(default_factory=dict)
    """Small, rank-identical state stored in the manifest as JSON (train counters, scheduler, data)."""

    def tensor_state(self, *, rank: int, with_optimizer: bool = True) -> dict[str, Any]:
        """The DCP state dict: model and optimizer shards plus this rank's RNG state."""
        if self.optimizer is not None and with_optimizer:
            model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
            return {"model": model_sd, "optim": optim_sd, "rng": {f"rank{rank}": capture_rng()}}
        return {"model": get_model_state_dict(self.model)}

    def restore_tensors(self, state: dict[str, Any]) -> None:
        if "optim" in state:
            set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        else:
            set_model_state_dict(self.model, state["model"])

    def json_state(self) -> dict[str, Any]:
        return {name: obj.state_dict() for name, obj in self.stateful.items()}


def capture_rng() -> dict[str, torch.Tensor]:
    """Every generator a step may use, as tensors (nothing pickled)."""
    np_state = np.random.get_state()
    py_version, py_internal, _ = random.getstate()
    out = {
        "torch_cpu": torch.get_rng_state(),
        "numpy_keys": torch.from_numpy(np_state[1].astype(np.int64)),
        "numpy_meta": torch.tensor([np_state[2], np_state[3]], dtype=torch.int64),
        "numpy_gauss": torch.tensor([np_state[4]], dtype=torch.float64),
        "python": torch.tensor([py_version, *py_internal], dtype=torch.int64),
    }
    if torch.cuda.is_available():
        out["torch_cuda"] = torch.cuda.get_rng_state()
    return out


def restore_rng(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["torch_cpu"])
    np.random.set_state(("MT19937", state["numpy_keys"].numpy().astype(np.uint32),
                         int(state["numpy_meta"][0]), int(state["numpy_meta"][1]), float(state["numpy_gauss"][0])))
    py = state["python"].tolist()
    random.setstate((py[0], tuple(py[1:]), None))
    if "torch_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["torch_cuda"])


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts to dotted keys, as DCP names them (lists are leaves)."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, f"{key}."))
        else:
            out[key] = v
    return out
