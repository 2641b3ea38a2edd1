"""Your own FSDP2 loop, fsdpkit's checkpoints: a hand-written `fully_shard` loop on a Hugging Face
model with `fsdpkit.checkpoint.Checkpointer` (sharded DCP + checksums + atomic commit, auto-resume,
elastic resume, retention, preemption and on-exception saves).

    torchrun --nproc-per-node 2 examples/own_loop.py --ckpt-dir runs/own/checkpoints --steps 40
    # kill it at any point, run the same command again: it resumes where the last checkpoint left off,
    # on 2 ranks or on any other number that divides --global-batch.

Nothing here is fsdpkit-specific except the four Checkpointer calls marked below.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

from fsdpkit.checkpoint import EXIT_PREEMPTED, Checkpointer


class LossEMA:
    """A Stateful holding a tensor (as an EMA of weights would): saved in the DCP files, restored in place."""

    def __init__(self, decay: float = 0.9):
        self.decay, self.value = decay, torch.zeros(())

    def update(self, loss: float) -> None:
        self.value.mul_(self.decay).add_((1 - self.decay) * loss)

    def state_dict(self) -> dict:
        return {"decay": self.decay, "value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.decay = state["decay"]
        self.value.copy_(state["value"])


def global_batch(position: int, size: int, seq_len: int, vocab: int, seed: int) -> torch.Tensor:
    """The samples [position, position + size) of an endless synthetic corpus: the same at any world size."""
    rows = []
    for i in range(position, position + size):
        g = torch.Generator().manual_seed(seed * 1_000_003 + i)
        rows.append(torch.randint(0, vocab, (seq_len + 1,), generator=g))
    return torch.stack(rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--stop-at", type=int, default=0, help="stop after this step, as an interruption would")
    p.add_argument("--global-batch", type=int, default=6)
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--async-save", action="store_true")
    p.add_argument("--out", type=Path, help="write {step: loss} and the resume event here (rank 0)")
    args = p.parse_args()

    if torch.cuda.is_available():  # one GPU per rank, NCCL; else gloo ranks on the CPU
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, ws = dist.get_rank(), dist.get_world_size()
    if args.global_batch % ws:
        raise SystemExit(f"--global-batch {args.global_batch} must be divisible by the world size {ws}")
    torch.manual_seed(0)  # the same initial weights on every rank, before sharding
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(config).to(device)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, foreach=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 5))
    data = {"position": 0}  # the loader's cursor, in global samples: valid at any world size
    ema = LossEMA()

    # (1) one Checkpointer for everything that must survive a restart
    ckpt = Checkpointer(args.ckpt_dir, model=model, optimizer=optimizer, scheduler=scheduler,
                        state={"data": data, "loss_ema": ema}, every_steps=args.save_every, keep_last=2,
                        async_save=args.async_save)
    # (2) the newest intact committed checkpoint's step, or 0
    start = ckpt.resume()
    losses: dict[int, float] = {}
    preempted = False
    per_rank = args.global_batch // ws
    with ckpt:  # on an exception: an on_exception save if every rank can take part, then re-raise
        for step in range(start + 1, args.steps + 1):
            batch = global_batch(data["position"], args.global_batch, args.seq_len, config.vocab_size, seed=1)
            mine = batch[rank * per_rank:(rank + 1) * per_rank].to(device)
            logits = model(input_ids=mine[:, :-1]).logits
            loss_sum = F.cross_entropy(logits.flatten(0, 1).float(), mine[:, 1:].flatten(), reduction="sum")
            # FSDP averages gradients over ranks: scale so that they are those of the global mean loss
            (loss_sum * ws / batch[:, 1:].numel()).backward()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            data["position"] += args.global_batch
            total = loss_sum.detach().clone()
            dist.all_reduce(total)
            loss = float(total) / batch[:, 1:].numel()
            ema.update(loss)
            losses[step] = loss
            # (3) saves on the cadence (and at the end), or when a preemption signal arrived
            if ckpt.step(step, metrics={"loss": loss}, last=step == args.steps):
                preempted = True  # every rank: the state is committed; exit and be restarted
                break
            if step == args.stop_at:
                break
    # (4) `with` closed it: the last save (async or not) is committed
    if rank == 0 and args.out:
        resumed = ckpt.resumed.record() if ckpt.resumed else None  # a Resumed: step, path, saved_world_size...
        args.out.write_text(json.dumps({"losses": losses, "resumed": resumed, "ema": float(ema.value),
                                        "preempted": preempted}))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(EXIT_PREEMPTED if preempted else 0)


if __name__ == "__main__":
    sys.exit(main())
