"""What a checkpoint holds, gathered from (and restored into) a training run.

- DCP tensors: `model.*` and `optim.*` (sharded, from torch's `get_state_dict`, whose keys are
  wrapper-free FQNs), `rng.rank<r>.*` (each rank's generators), and `state.<name>.<path>`: tensors
  inside the `Stateful` pieces (an EMA, a loader's buffers);
- the manifest (JSON): everything else in the `Stateful` pieces, which are the same on every rank —
  trainer counters, LR scheduler, data cursor — with each tensor replaced by a reference
  `{"__tensor__": "<DCP key>"}`.
"""

from __future__ import annotations

import logging
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

log = logging.getLogger(__name__)


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


TENSOR_REF = "__tensor__"


class DictState:
    """A plain dict as a Stateful: saved as it is, restored in place (the caller's dict object)."""

    def __init__(self, data: dict[str, Any]):
        self.data = data

    def state_dict(self) -> dict[str, Any]:
        return dict(self.data)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.data.clear()
        self.data.update(state)


def as_stateful(obj: Any, *, name: str) -> Stateful:
    if isinstance(obj, dict):
        return DictState(obj)
    if callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)):
        return obj
    raise TypeError(f"checkpoint state {name!r} is a {type(obj).__name__}: pass a dict or an object with "
                    "state_dict() and load_state_dict() (a Stateful)")


def split_tensors(tree: Any, prefix: str) -> tuple[Any, dict[str, torch.Tensor]]:
    """`tree` with each tensor replaced by {TENSOR_REF: key}, and the tensors by key."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(node: Any, path: str) -> Any:
        if isinstance(node, torch.Tensor):
            tensors[path] = node
            return {TENSOR_REF: path}
        if isinstance(node, dict):
            return {k: walk(v, f"{path}.{k}") for k, v in node.items()}
        if isinstance(node, list | tuple):
            return [walk(v, f"{path}.{i}") for i, v in enumerate(node)]
        return node

    return walk(tree, prefix), tensors


def join_tensors(tree: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Undo split_tensors: references replaced by the (loaded) tensors."""
    if isinstance(tree, dict):
        if set(tree) == {TENSOR_REF}:
            return tensors[tree[TENSOR_REF]]
        return {k: join_tensors(v, tensors) for k, v in tree.items()}
    if isinstance(tree, list):
        return [join_tensors(v, tensors) for v in tree]
    return tree


@dataclass
class CheckpointTarget:
    """The live objects a checkpoint is taken from and restored into."""

    model: nn.Module
    optimizer: torch.optim.Optimizer | None
    """None: a model trained by no optimizer of its own (an EMA copy, a frozen teacher); its
    checkpoints hold no `optim.*` tensors and their manifest records `"optimizer": null`."""
    stateful: dict[str, Stateful] = field(default_factory=dict)
    """Rank-identical state (train counters, scheduler, data cursor, an EMA...): JSON in the
    manifest, and its tensors, if any, in the DCP files under `state.<name>.`."""

    def tensor_state(self, *, rank: int, model_only: bool = False) -> dict[str, Any]:
        """The DCP state dict: model and optimizer shards (no `optim` without an optimizer), the
        Stateful pieces' tensors, and this rank's RNG state; with `model_only`, the model alone."""
        if model_only:
            return {"model": get_model_state_dict(self.model)}
        if self.optimizer is not None:
            model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
            out = {"model": model_sd, "optim": optim_sd}
        else:
            out = {"model": get_model_state_dict(self.model)}
        out["rng"] = {f"rank{rank}": capture_rng()}
        if tensors := self._stateful_tensors():
            out["state"] = tensors
        return out

    def restore_tensors(self, state: dict[str, Any]) -> None:
        if "optim" in state:
            set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        else:
            set_model_state_dict(self.model, state["model"])

    def json_state(self) -> dict[str, Any]:
        return {name: split_tensors(obj.state_dict(), f"state.{name}")[0] for name, obj in self.stateful.items()}

    def _stateful_tensors(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for name, obj in self.stateful.items():
            out.update(split_tensors(obj.state_dict(), f"state.{name}")[1])
        return {k.removeprefix("state."): v for k, v in out.items()}


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
    elif torch.cuda.is_available():
        log.warning("the checkpoint holds no CUDA RNG state (saved without CUDA): CUDA's generator keeps this "
                    "run's seed, so dropout and other CUDA randomness will not continue the saved run's stream")


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
