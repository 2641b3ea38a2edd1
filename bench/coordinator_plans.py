"""B9's simulated ranks: rank 0's real DCP state and plans at N ranks, and every other rank's plans
built from them, so that the coordinator's own code can run on the inputs N ranks would send.

Rank 0's state dict at N ranks is built under torch's fake process group (one process, world size
N): the model's get_state_dict keys and values, each parameter and AdamW moment turned into a
DTensor holding rank 0's Shard(0) rows (FSDP2's layout: torch.chunk rows, empty past the last
chunk). DCP plans it for real (DefaultSavePlanner / DefaultLoadPlanner). Another rank's plan
differs from rank 0's only in its shard offsets and sizes and in its RNG keys (rng.rank<r>):
`save_plan_for_rank` and `load_plan_for_rank` rewrite exactly those, with DTensor's own shard
arithmetic (`_compute_local_shape_and_global_offset`, a private torch function).
tests/unit/test_coordinator_bench.py holds both to the plans DCP makes from FSDP2's real shards.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

RNG0 = "rng.rank0."


def shard_of(shape: torch.Size, *, rank: int, world: int) -> tuple[torch.Size, torch.Size]:
    """(local shape, global offset) of `rank`'s Shard(0) piece of a tensor of `shape`."""
    local, offset = _compute_local_shape_and_global_offset(shape, (world,), [rank], [Shard(0)])
    return torch.Size(local), torch.Size(offset)


def rank0_state(*, world: int, layers: int) -> dict[str, Any]:
    """Rank 0's DCP state dict (what CheckpointTarget.tensor_state returns) at `world` ranks.
    Needs a process group of that world size (the fake backend)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import DeviceMesh

    from coordinator_state import Llama70BShape
    from fsdpkit.checkpoint.state import capture_rng

    model = Llama70BShape(layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    msd, osd = get_state_dict(model, opt)
    mesh = DeviceMesh("cpu", list(range(world)))

    def shard(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 0:  # AdamW's step: a plain tensor on every rank under FSDP2
            return t
        local, offset = shard_of(t.shape, rank=0, world=world)
        piece = t.narrow(0, offset[0], local[0]).clone()
        return DTensor.from_local(piece, mesh, [Shard(0)], run_check=False, shape=t.shape, stride=t.stride())

    optim = {"state": {fqn: {k: shard(v) for k, v in s.items()} for fqn, s in osd["state"].items()},
             "param_groups": osd["param_groups"]}
    return {"model": {k: shard(v) for k, v in msd.items()}, "optim": optim, "rng": {"rank0": capture_rng()}}


def _rank_key(fqn: str, rank: int) -> str:
    return f"rng.rank{rank}.{fqn[len(RNG0):]}" if fqn.startswith(RNG0) else fqn


def save_plan_for_rank(plan0: SavePlan, *, rank: int, world: int) -> SavePlan:
    """The local SavePlan DefaultSavePlanner makes on `rank`, from rank 0's (`plan0`)."""
    items = []
    for item in plan0.items:
        fqn = item.index.fqn
        if item.type == WriteItemType.SHARD:
            data = item.tensor_data
            local, offset = shard_of(data.size, rank=rank, world=world)
            items.append(WriteItem(index=MetadataIndex(fqn, offset), type=WriteItemType.SHARD,
                                   tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=offset, sizes=local),
                                                               properties=data.properties, size=data.size)))
        elif fqn.startswith(RNG0):
            items.append(dataclasses.replace(item, index=dataclasses.replace(item.index, fqn=_rank_key(fqn, rank))))
        else:
            items.append(item)
    def renamed(key: str, path: Any) -> Any:
        return tuple(f"rank{rank}" if p == "rank0" else p for p in path) if key.startswith(RNG0) else path

    mappings = {_rank_key(k, rank): renamed(k, v) for k, v in plan0.planner_data.items()}
    return dataclasses.replace(plan0, items=items, planner_data=mappings)


def load_plan_for_rank(plan0: LoadPlan, *, rank: int, world: int) -> LoadPlan:
    """The local LoadPlan DefaultLoadPlanner makes on `rank` when it resumes the checkpoint saved
    at the same `world` size, from rank 0's (`plan0`): each shard read whole from its own chunk."""
    items = []
    for item in plan0.items:
        fqn = item.dest_index.fqn
        if fqn in _global_sizes:  # a sharded tensor
            local, offset = shard_of(_global_sizes[fqn], rank=rank, world=world)
            if local.numel() == 0:
                continue  # an empty shard reads nothing
            items.append(dataclasses.replace(
                item, dest_index=MetadataIndex(fqn, offset, item.dest_index.index),
                storage_index=MetadataIndex(fqn, offset, _chunk_index[fqn][offset]), lengths=local))
        elif fqn.startswith(RNG0):
            key = _rank_key(fqn, rank)
            items.append(dataclasses.replace(item, dest_index=dataclasses.replace(item.dest_index, fqn=key),
                                             storage_index=dataclasses.replace(item.storage_index, fqn=key)))
        else:
            items.append(item)
    return dataclasses.replace(plan0, items=items)


_global_sizes: dict[str, torch.Size] = {}
_chunk_index: dict[str, dict[torch.Size, int]] = {}


def remember_sizes(metadata: Any) -> None:
    """Call before load_plan_for_rank. Note every sharded tensor's global size and where each chunk
    sits in the metadata (the `index` DCP's read items carry)."""
    _global_sizes.clear()
    _chunk_index.clear()
    for fqn, md in metadata.state_dict_metadata.items():
        if len(getattr(md, "chunks", ())) > 1:  # saved in shards (AdamW's step and RNG are whole)
            _global_sizes[fqn] = md.size
            _chunk_index[fqn] = {c.offsets: i for i, c in enumerate(md.chunks)}


def write_results(plan: SavePlan, *, rank: int) -> list[WriteResult]:
    """What rank `rank`'s write_data returns for its (global) plan: every item in one file."""
    out, offset = [], 0
    prefix = plan.storage_data.prefix if plan.storage_data is not None else f"__{rank}_"
    for item in plan.items:
        if item.type == WriteItemType.BYTE_IO:
            n = 64
        else:
            n = item.tensor_data.chunk.sizes.numel() * item.tensor_data.properties.dtype.itemsize
        out.append(WriteResult(index=item.index, size_in_bytes=n,
                               storage_data=_StorageInfo(relative_path=f"{prefix}0.distcp", offset=offset, length=n)))
        offset += n
    return out


def read_items_equal(a: list[ReadItem], b: list[ReadItem]) -> bool:
    return sorted(map(repr, a)) == sorted(map(repr, b))
