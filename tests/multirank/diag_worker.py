"""Runs on 2 gloo ranks under torchrun: a correctly configured fsdpkit model with the full
diagnostics session (report, memory per phase, first-step checks), then each FSDP setup
mistake committed on purpose in a small model, recording what diagnostics said. Rank 0 writes
the results as JSON. Usage: diag_worker.py OUT.json RUN_DIR."""

from __future__ import annotations

import gc
import json
import logging
import os
import sys
from pathlib import Path

import torch
import torch.distributed as tdist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from fsdpkit import diagnostics, dist
from fsdpkit.config import compose_config
from fsdpkit.diagnostics import BACKWARD, BATCH_START, FORWARD, OPTIMIZER_STEP
from fsdpkit.diagnostics.findings import FSDPContractError
from fsdpkit.log import setup_logging
from fsdpkit.model import logits
from fsdpkit.parallel import build_sharded_model

BF16_MIXED = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


class Block(nn.Module):
    def __init__(self, width: int = 16):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x))


class Toy(nn.Module):
    def __init__(self, *, direct_child: bool = False):
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(16, 2)
        self.direct_child = direct_child

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block.forward(h) if self.direct_child else block(h)  # the mistake, on purpose
        return self.head(h)


def shard(model: Toy, mesh, *, blocks: bool = True, root: bool = True, block_mp=None, root_mp=None) -> Toy:
    if blocks:
        for block in dict.fromkeys(model.blocks):  # a block registered twice is wrapped once
            fully_shard(block, mesh=mesh, mp_policy=block_mp or MixedPrecisionPolicy())
    if root:
        fully_shard(model, mesh=mesh, mp_policy=root_mp or MixedPrecisionPolicy())
    return model


def batch() -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(dist.rank()))


def raised(fn) -> dict:
    """Run fn; the FSDPContractError it raised (codes and text), or what it returned."""
    try:
        found = fn()
    except FSDPContractError as e:
        return {"raised": True, "codes": [f.code for f in e.findings], "text": str(e)}
    return {"raised": False, "codes": [f.code for f in found or []], "text": "\n".join(f.message for f in found or [])}


def correct_run(run_dir: Path, log_lines: list[str]) -> dict:
    """fsdpkit's own sharding of the reference Llama (bf16-mixed, activation checkpointing),
    diagnostics wired the way the trainer wires them, 4 steps with phase marks."""
    cfg = compose_config(["device=cpu", "experiment=[bf16,activation_checkpointing]", "model.vocab_size=1024"])
    device = torch.device("cpu")
    model, plan = build_sharded_model(cfg, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # the forwards the model had before the watch (activation checkpointing sets the decoder layers' own)
    forwards_before = {name: m.__dict__.get("forward") for name, m in model.named_modules()}
    diag = diagnostics.start_diagnostics(model, optimizer, device=device, run_dir=run_dir, memory_steps=3,
                                         param_dtype=plan.mp_policy.param_dtype, state_dict_type="sharded")
    data = torch.randint(0, 1024, (4, 33), generator=torch.Generator().manual_seed(dist.rank()))
    norms = []
    for step in range(4):
        diag.memory.mark(BATCH_START)
        for micro in data.split(2):  # two micro-batches: forward/backward marks alternate
            out = logits(model, micro[:, :-1])
            loss = F.cross_entropy(out.float().flatten(0, 1), micro[:, 1:].flatten())
            diag.memory.mark(FORWARD)
            loss.backward()
            diag.memory.mark(BACKWARD)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        diag.check_grad_norm(norm, parameters=model.parameters(), max_norm=0.5)
        norms.append(float(norm.full_tensor()))
        optimizer.step()
        diag.memory.mark(OPTIMIZER_STEP)
        optimizer.zero_grad(set_to_none=True)
        diag.after_step(last=step == 3)
    forward_attr_restored = {name: m.__dict__.get("forward") for name, m in model.named_modules()} == forwards_before
    forward_attr_restored &= sum(f is not None for f in forwards_before.values()) == len(plan.checkpointed) > 0
    return {"report": diag.report, "memory_after": diag.memory.summary(), "norms": norms,
            "forward_attr_restored": forward_attr_restored, "log": "\n".join(log_lines),
            "full_mib": sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20}


def mistakes(mesh) -> dict:
    out = {}

    def optimizer_before_sharding():
        model = Toy()
        optimizer = torch.optim.AdamW(model.parameters())
        return diagnostics.check(shard(model, mesh), optimizer)
    out["optimizer_before_sharding"] = raised(optimizer_before_sharding)

    def direct_root_forward():
        model = shard(Toy(), mesh)
        with diagnostics.watch_forward(model):
            model.forward(batch()).sum().backward()
    out["direct_root_forward"] = raised(direct_root_forward)

    def direct_child_forward():
        model = shard(Toy(direct_child=True), mesh)
        with diagnostics.watch_forward(model):
            model(batch()).sum().backward()
    out["direct_child_forward"] = raised(direct_child_forward)

    def correct_forward():
        model = shard(Toy(), mesh)
        watch = diagnostics.watch_forward(model)
        model(batch()).sum().backward()
        return watch.finish()
    out["correct_forward"] = raised(correct_forward)

    out["only_root"] = raised(lambda: diagnostics.check(shard(Toy(), mesh, blocks=False)))
    out["root_not_sharded"] = raised(lambda: diagnostics.check(shard(Toy(), mesh, root=False)))
    out["not_sharded"] = raised(lambda: diagnostics.check(Toy()))

    def registered_twice():
        model = Toy()
        model.blocks.append(model.blocks[0])
        return diagnostics.check(shard(model, mesh))
    out["registered_twice"] = raised(registered_twice)

    def per_shard_clipping():
        model = shard(Toy(), mesh)
        model(batch()).pow(2).sum().backward()
        local = [p.grad.to_local() for p in model.parameters()]
        norm = torch.nn.utils.get_total_norm(local)  # the mistake: this rank's shards only
        torch.nn.utils.clip_grads_with_norm_(local, 1e-3, norm)
        return diagnostics.check_grad_norm(norm, parameters=model.parameters(), max_norm=1e-3)
    out["per_shard_clipping"] = raised(per_shard_clipping)

    def global_clipping():
        model = shard(Toy(), mesh)
        model(batch()).pow(2).sum().backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
        return diagnostics.check_grad_norm(norm, parameters=model.parameters(), max_norm=1e-3)
    out["global_clipping"] = raised(global_clipping)

    out["mp_not_propagated"] = raised(lambda: diagnostics.check(shard(Toy(), mesh, root_mp=BF16_MIXED)))

    def fp32_in_forward():
        model = shard(Toy(), mesh)
        with diagnostics.watch_forward(model, param_dtype=torch.bfloat16):
            model(batch()).sum().backward()
    out["fp32_in_forward"] = raised(fp32_in_forward)

    def skew():
        model = Toy()
        model.head = nn.Linear(16, 1)  # one output row: rank 1 holds none of it
        report, findings = diagnostics.build_report(shard(model, mesh), skew_warn_ratio=1.01)
        return findings
    out["skew"] = raised(skew)
    return out


def main() -> None:
    out_path, run_dir = Path(sys.argv[1]), Path(sys.argv[2])
    dist.init_process_group(backend="gloo")
    setup_logging("INFO")
    log_lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: log_lines.append(record.getMessage())
    logging.getLogger("fsdpkit").addHandler(handler)
    if dist.is_main():
        run_dir.mkdir(parents=True, exist_ok=True)
    tdist.barrier()
    torch.manual_seed(0)
    results = {"correct": correct_run(run_dir, log_lines)}
    mesh = init_device_mesh("cpu", (dist.world_size(),), mesh_dim_names=("shard",))
    results["mistakes"] = mistakes(mesh)
    gathered = [None] * dist.world_size()
    tdist.all_gather_object(gathered, results["correct"]["report"]["local_param_mib"])
    results["local_mib_by_rank"] = gathered
    if dist.is_main():
        out_path.write_text(json.dumps(results, default=str))
    gc.collect()
    tdist.barrier()
    tdist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
