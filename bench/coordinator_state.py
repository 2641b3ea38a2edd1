"""B9's state: a Llama-70B-shaped model with tiny tensors, sharded by FSDP2, with AdamW state.

The names and the tensor count are those of a 70B Llama (80 decoder layers of 9 parameters, the
embedding, the final norm and an untied head: 723 parameters; AdamW adds exp_avg, exp_avg_sq and
step for each: 2,892 tensors, plus the param-group entries and each rank's RNG state that fsdpkit
saves). Every dimension is the 70B's divided by SCALE, so the whole state is ~13 MB: what DCP's
planning and fsdpkit's manifest cost depends on the number of tensors and ranks, not their bytes.

Shared by the real-rank worker (gloo), the one-process simulation (fake process group) and the
unit test that holds the simulation to DCP.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

SCALE = 256  # every 70B dimension divided by this
HIDDEN, INTERMEDIATE, KV, VOCAB, LAYERS = 8192 // SCALE, 28672 // SCALE, 1024 // SCALE, 128256 // SCALE, 80


class Norm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.k_proj = nn.Linear(HIDDEN, KV, bias=False)
        self.v_proj = nn.Linear(HIDDEN, KV, bias=False)
        self.o_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj = nn.Linear(HIDDEN, INTERMEDIATE, bias=False)
        self.up_proj = nn.Linear(HIDDEN, INTERMEDIATE, bias=False)
        self.down_proj = nn.Linear(INTERMEDIATE, HIDDEN, bias=False)


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn = Attention()
        self.mlp = Mlp()
        self.input_layernorm = Norm(HIDDEN)
        self.post_attention_layernorm = Norm(HIDDEN)


class Body(nn.Module):
    def __init__(self, layers: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(Layer() for _ in range(layers))
        self.norm = Norm(HIDDEN)


class Llama70BShape(nn.Module):
    """Parameter names as Hugging Face's LlamaForCausalLM (no forward: only its state is saved)."""

    def __init__(self, layers: int = LAYERS):
        super().__init__()
        self.model = Body(layers)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)


def build(*, layers: int = LAYERS, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model, fully_shard per decoder layer and at the root (built on meta, materialised on
    CPU), and AdamW after one step (its state exists). Needs an initialised process group (gloo,
    or the fake backend for the simulation)."""
    import torch.distributed as tdist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    # built here rather than by fully_shard (init_device_mesh): a cached mesh would outlive the
    # process group when the unit test builds one rank after another in a process (fully_shard
    # reuses an equal mesh, and meshes are equal by ranks and names: the name carries the rank)
    mesh = DeviceMesh("cpu", list(range(tdist.get_world_size())), mesh_dim_names=(f"dp_as_rank{tdist.get_rank()}",))
    with torch.device("meta"):
        model = Llama70BShape(layers)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local()
            local.copy_(torch.rand(local.shape, generator=gen))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def manifest_meta(model: nn.Module, opt: torch.optim.Optimizer, *, step: int) -> dict[str, Any]:
    """The manifest fields a Checkpointer adds (manager.Checkpointer._meta), built from the same
    public functions."""
    from fsdpkit.checkpoint.manifest import model_fingerprint, optimizer_summary

    return {"run_id": "b9-bench", "fingerprint": model_fingerprint(model, sharding={}),
            "optimizer": optimizer_summary(opt, step=step), "metrics": {}}
