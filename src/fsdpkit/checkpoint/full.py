"""`strategy.state_dict_type: full`: the whole state gathered to rank 0 in CPU memory
(`full_state_dict=True, cpu_offload=True`) and written by rank 0 as safetensors; loading reads
it on rank 0 and broadcasts, each rank keeping only its shard. Only rank 0 ever holds the full
model; choose it for small models or for a single-file artefact, and `sharded` otherwise.

    step_<N>/model.safetensors       model tensors by FQN (tied weights stored once per name)
    step_<N>/optimizer.safetensors   `<fqn>.<state>` tensors (exp_avg, exp_avg_sq, step); absent without an optimizer
    step_<N>/rng.safetensors         `rank<r>.<generator>` tensors, gathered from every rank
    step_<N>/manifest.json           param groups in `optimizer_param_groups` ([] without an optimizer);
                                     the usual fields
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from fsdpkit.checkpoint.hashing import HASH_NAME, file_checksum
from fsdpkit.checkpoint.settings import IOSettings
from fsdpkit.checkpoint.state import CheckpointTarget, capture_rng
from fsdpkit.dist import group_size

MODEL_FILE, OPTIM_FILE, RNG_FILE = "model.safetensors", "optimizer.safetensors", "rng.safetensors"
GATHER = StateDictOptions(full_state_dict=True, cpu_offload=True)
SCATTER = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)


def _save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """safetensors refuses tensors sharing memory (tied weights): give each name its own copy."""
    seen: set[int] = set()
    out = {}
    for k, t in tensors.items():
        t = t.detach().contiguous()
        out[k] = t.clone() if t.data_ptr() in seen else t
        seen.add(t.data_ptr())
    save_file(out, str(path))


def write_full(target: CheckpointTarget, ckpt_dir: Path, *, rank: int, group: tdist.ProcessGroup | None,
               io: IOSettings | None = None) -> dict[str, Any]:
    """Gather and write; collective. Returns (on rank 0) the manifest's `files` and param groups
    (the files' checksums read back with `io`, default the environment's)."""
    if target.optimizer is not None:
        model_sd, optim_sd = get_state_dict(target.model, target.optimizer, options=GATHER)
    else:  # an EMA copy, a frozen teacher: the model and the RNG only
        model_sd, optim_sd = get_model_state_dict(target.model, options=GATHER), None
    rng = capture_rng()
    everyone = [None] * group_size(group)
    if tdist.is_initialized():
        tdist.all_gather_object(everyone, rng, group=group)
    else:
        everyone = [rng]
    if rank != 0:
        return {}
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    _save(model_sd, ckpt_dir / MODEL_FILE)
    if optim_sd is not None:
        _save({f"{fqn}.{k}": v for fqn, st in optim_sd["state"].items() for k, v in st.items()}, ckpt_dir / OPTIM_FILE)
    _save({f"rank{r}.{k}": v for r, state in enumerate(everyone) for k, v in state.items()}, ckpt_dir / RNG_FILE)
    files = {}
    for name in (MODEL_FILE, OPTIM_FILE, RNG_FILE) if optim_sd is not None else (MODEL_FILE, RNG_FILE):
        size, digest = file_checksum(ckpt_dir / name, io=io)
        files[name] = {"size": size, HASH_NAME: digest}
    return {"files": files, "optimizer_param_groups": optim_sd["param_groups"] if optim_sd is not None else []}


def read_full(target: CheckpointTarget, ckpt_dir: Path, manifest: dict[str, Any], *, rank: int,
              model_only: bool) -> dict[str, torch.Tensor] | None:
    """Rank 0 reads, every rank receives its shard; returns this rank's RNG state if saved."""
    # Non-zero ranks receive by broadcast. They must still pass a non-empty model dict: torch reads
    # an empty one as "optimizer only" and would skip the model broadcast rank 0 is sending.
    model_sd: dict[str, Any] = dict(target.model.state_dict())
    optim_sd: dict[str, Any] = {}
    if rank == 0:
        model_sd = load_file(str(ckpt_dir / MODEL_FILE))
        if not model_only and target.optimizer is not None:
            state: dict[str, dict[str, torch.Tensor]] = {}
            for key, t in load_file(str(ckpt_dir / OPTIM_FILE)).items():
                fqn, _, name = key.rpartition(".")
                state.setdefault(fqn, {})[name] = t
            optim_sd = {"state": state, "param_groups": manifest["optimizer_param_groups"]}
    if model_only or target.optimizer is None:
        set_model_state_dict(target.model, model_sd, options=SCATTER)
        if model_only:
            return None
    else:
        set_state_dict(target.model, target.optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd,
                       options=SCATTER)
    rngs = load_file(str(ckpt_dir / RNG_FILE))
    prefix = f"rank{rank}."
    mine = {k.removeprefix(prefix): v for k, v in rngs.items() if k.startswith(prefix)}
    return mine or None
