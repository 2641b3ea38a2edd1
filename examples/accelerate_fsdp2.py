"""An Accelerate FSDP2 script with fsdpkit's checkpoints: Accelerate shards the Hugging Face model
with FSDP2 (`fully_shard` per LlamaDecoderLayer) in `accelerator.prepare`, and
`fsdpkit.checkpoint.Checkpointer` saves and resumes it (sharded DCP + checksums + atomic commit,
auto-resume, elastic resume, retention, preemption and on-exception saves) instead of
`accelerator.save_state`.

    accelerate launch --num-processes 2 examples/accelerate_fsdp2.py --ckpt-dir runs/acc/checkpoints   # GPUs
    torchrun --nproc-per-node 2 examples/accelerate_fsdp2.py --ckpt-dir runs/acc/checkpoints           # CPU too
    fsdpkit ckpt export runs/acc/checkpoints runs/acc/hf --config runs/acc/hf_config

CPU: Accelerate 1.15 turns its FSDP plugin off without an accelerator (it runs plain multi-CPU
DDP); this script then switches its state to FSDP (`force_fsdp_on_cpu`, a documented two-line
override), after which `prepare` applies the same FSDP2 it applies on GPUs. Nothing else changes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from own_loop import global_batch  # the same synthetic corpus as examples/own_loop.py
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from transformers import LlamaConfig, LlamaForCausalLM

from fsdpkit.checkpoint import EXIT_PREEMPTED, Checkpointer


def force_fsdp_on_cpu(accelerator: Accelerator, plugin: FullyShardedDataParallelPlugin) -> None:
    """Accelerate drops its FSDP plugin on CPU-only machines (MULTI_CPU); FSDP2 itself runs on
    CPU/gloo, so put the plugin back. A no-op where Accelerate already chose FSDP (GPUs)."""
    if accelerator.state.distributed_type == DistributedType.MULTI_CPU:
        accelerator.state.distributed_type = DistributedType.FSDP
        accelerator.state.fsdp_plugin = plugin


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--resume", default="auto", help="auto (the newest checkpoint in --ckpt-dir), none, or a path")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--global-batch", type=int, default=6)
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--hf-config", type=Path,
                   help="write the model's config.json here (rank 0), for `fsdpkit ckpt export --config`")
    p.add_argument("--out", type=Path, help="write {step: loss}, the resume event and probe logits here (rank 0)")
    args = p.parse_args()

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                            transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
                                            state_dict_type="SHARDED_STATE_DICT", cpu_ram_efficient_loading=False)
    accelerator = Accelerator(fsdp_plugin=plugin, cpu=not torch.cuda.is_available())  # cpu: gloo ranks under torchrun
    force_fsdp_on_cpu(accelerator, plugin)
    rank, ws = accelerator.process_index, accelerator.num_processes
    if args.global_batch % ws:
        raise SystemExit(f"--global-batch {args.global_batch} must be divisible by the world size {ws}")
    torch.manual_seed(0)  # the same initial weights on every rank, before sharding
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, foreach=True)
    model, optimizer = accelerator.prepare(model, optimizer)  # FSDP2: fully_shard per decoder layer, then the root
    sharding = {"fsdp_units": sum(isinstance(m, FSDPModule) for m in model.modules()),
                "all_dtensor": all(isinstance(t, DTensor) for t in model.parameters())}
    # The scheduler is not prepared: AcceleratedScheduler steps once per process, which would make the
    # schedule depend on the world size and an elastic resume differ.
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer.optimizer, lambda s: min(1.0, (s + 1) / 5))
    data = {"position": 0}  # the loader's cursor, in global samples: valid at any world size
    if rank == 0 and args.hf_config:
        config.save_pretrained(args.hf_config)

    # fsdpkit: the torch optimizer under Accelerate's wrapper (its state is what must survive)
    ckpt = Checkpointer(args.ckpt_dir, model=model, optimizer=optimizer.optimizer, scheduler=scheduler,
                        state={"data": data}, every_steps=args.save_every, keep_last=2, resume=args.resume)
    start = ckpt.resume()
    losses: dict[int, float] = {}
    preempted = False
    per_rank = args.global_batch // ws
    with ckpt:
        for step in range(start + 1, args.steps + 1):
            batch = global_batch(data["position"], args.global_batch, args.seq_len, config.vocab_size, seed=1)
            mine = batch[rank * per_rank:(rank + 1) * per_rank].to(accelerator.device)
            logits = model(input_ids=mine[:, :-1]).logits
            loss_sum = F.cross_entropy(logits.flatten(0, 1).float(), mine[:, 1:].flatten(), reduction="sum")
            accelerator.backward(loss_sum * ws / batch[:, 1:].numel())  # the global mean loss's gradients
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            data["position"] += args.global_batch
            loss = float(accelerator.reduce(loss_sum.detach(), reduction="sum")) / batch[:, 1:].numel()
            losses[step] = loss
            if ckpt.step(step, metrics={"loss": loss}, last=step == args.steps):
                preempted = True
                break
    with torch.no_grad():  # probe logits of the final weights (a collective forward under FSDP2)
        probe = model(input_ids=torch.arange(12, device=accelerator.device).reshape(1, 12)).logits
    if rank == 0 and args.out:
        resumed = ckpt.resumed.record() if ckpt.resumed else None
        args.out.write_text(json.dumps({"losses": losses, "resumed": resumed, "world_size": ws,
                                        "sharding": sharding, "probe": probe.tolist()}))
    accelerator.wait_for_everyone()
    accelerator.end_training()  # destroys the process group
    sys.stdout.flush()
    os._exit(EXIT_PREEMPTED if preempted else 0)


if __name__ == "__main__":
    sys.exit(main())
