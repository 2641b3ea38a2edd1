"""The synthetic model of bench/checkpoint.py's phases: nn.Linear layers, each `fully_shard`-ed,
AdamW with its state, the trainer's step counter as a Stateful, and the fixed-cost training step
that B2 and B6 run while saves are in flight (see bench/checkpoint.py's docstring).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as tdist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from checkpoint_measure import rss, timed
from fsdpkit.checkpoint.manifest import model_fingerprint
from fsdpkit.checkpoint.state import CheckpointTarget, flatten

BATCH = 16  # rows per forward of the real step (only the setup step and its timing use it)
MATMUL = 512  # the fixed-cost step's burst is [512, 512] matmuls (~5 ms each): few GIL hand-offs per step


class TrainCounter:
    """The trainer's step counter, stored in the manifest as a Stateful (load verification
    compares it with the optimizer's step count, under the name "train")."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])


@dataclass
class Bench:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    counter: TrainCounter
    target: CheckpointTarget
    fingerprint: dict[str, Any]
    n_layers: int
    width: int
    sync_group: Any  # saves, loads and the benchmark's own barriers
    fsdpkit_async_group: Any  # AsyncSaver's background thread only
    dcp_async_group: Any  # dcp.async_save's background thread only
    base_rss: int  # RSS before the model existed (torch imported, process group up)
    state_bytes: int = 0  # this rank's model + optimizer tensor bytes
    real_step_s: float = 0.0

    @property
    def rank(self) -> int:
        return tdist.get_rank()


def build_bench(size_gib: float, width: int, *, warm_step: bool = True) -> Bench:
    """nn.Linear(width, width) layers, each fully_shard-ed, then the root; AdamW; one real step
    (unless not `warm_step`: a resumed run loads into an optimizer that never stepped).
    The layer count makes params + exp_avg + exp_avg_sq (fp32) total `size_gib` over all ranks."""
    groups = [tdist.new_group(backend="gloo") for _ in range(3)]
    base_rss = rss()
    n_layers = max(1, round(size_gib * 2**30 / (12 * width * width)))
    mesh = init_device_mesh("cpu", (tdist.get_world_size(),))
    with torch.device("meta"):
        model = nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(n_layers)))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(1234 + tdist.get_rank())
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().normal_(0.0, width**-0.5, generator=gen)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    counter = TrainCounter()
    target = CheckpointTarget(model=model, optimizer=optimizer, stateful={"train": counter})
    fingerprint = model_fingerprint(model, sharding={"wrap_policy": ["Linear"], "activation_checkpointing": [],
                                                     "mixed_precision": "fp32", "reshard_after_forward": True,
                                                     "compiled": False})
    b = Bench(model=model, optimizer=optimizer, counter=counter, target=target, fingerprint=fingerprint,
              n_layers=n_layers, width=width, sync_group=groups[0], fsdpkit_async_group=groups[1],
              dcp_async_group=groups[2], base_rss=base_rss)
    if warm_step:
        _, b.real_step_s = timed(lambda: real_step(b), b.sync_group)  # the AdamW state exists from here on
    b.state_bytes = sum(t.nbytes for t in local_tensors(b, with_steps=True))
    return b


def real_step(b: Bench) -> None:
    """One forward/backward/AdamW step of the synthetic model."""
    x = torch.randn(BATCH, b.width)
    b.model(x).pow(2).mean().backward()
    b.optimizer.step()
    b.optimizer.zero_grad(set_to_none=True)
    b.counter.step += 1


def local_tensors(b: Bench, *, with_steps: bool = False) -> list[torch.Tensor]:
    """This rank's shards of every model and optimizer tensor (the live storage a save reads)."""
    model_sd, optim_sd = get_state_dict(b.model, b.optimizer)
    flat = flatten({"model": model_sd, "optim": optim_sd})
    out = []
    for key, v in flat.items():
        if isinstance(v, torch.Tensor) and (with_steps or not key.endswith(".step")):
            out.append(v.to_local() if isinstance(v, DTensor) else v)
    return out


class FixedStep:
    """A fixed-cost training step: a matmul burst calibrated on rank 0 to `burst_ms`, an in-place
    add on every model and optimizer tensor shard (so an async snapshot really races with
    mutation, and the step streams the state through memory as AdamW does), and a one-element
    all-reduce that keeps the ranks in lockstep as a gradient reduction would."""

    def __init__(self, b: Bench, burst_ms: float):
        self.b, self.tensors = b, local_tensors(b)
        self.a = torch.randn(MATMUL, MATMUL)
        self.c = torch.empty(MATMUL, MATMUL)
        self.flag = torch.zeros(1)
        t0 = time.perf_counter()
        for _ in range(10):
            torch.mm(self.a, self.a, out=self.c)
        per_mm = (time.perf_counter() - t0) / 10
        n = torch.tensor([round(burst_ms / 1000 / per_mm)], dtype=torch.int64)
        tdist.broadcast(n, src=0, group=b.sync_group)
        self.n_mm = int(n)
        self.n = 0

    @torch.no_grad()
    def __call__(self) -> None:
        for _ in range(self.n_mm):
            torch.mm(self.a, self.a, out=self.c)
        # No gradients: AdamW updates nothing, but its step pre-hooks run as in a real step (an async
        # save staged in the background makes the loop wait there for the copy), then the update.
        self.b.optimizer.step()
        torch._foreach_add_(self.tensors, 1e-7)
        tdist.all_reduce(self.flag)
        self.n += 1  # not an optimizer step: the trainer's counter (checked against AdamW's on load) stays

    def median_s(self, n: int = 5) -> float:
        times = []
        for _ in range(n):
            _, dt = timed(self, self.b.sync_group)
            times.append(dt)
        return statistics.median(times)
