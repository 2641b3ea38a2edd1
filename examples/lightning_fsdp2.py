"""A Lightning module with FSDP2 in `configure_model` (Lightning's ModelParallelStrategy) and
fsdpkit's checkpoints: a small Callback hands the sharded Hugging Face model, the optimizer, the
scheduler and the data position to `fsdpkit.checkpoint.Checkpointer`, which saves on its cadence
and resumes (the newest intact committed checkpoint, at any world size) when training starts.

    torchrun --nproc-per-node 2 examples/lightning_fsdp2.py --ckpt-dir runs/pl/checkpoints --hf-config runs/pl/hf
    fsdpkit ckpt export runs/pl/checkpoints runs/pl/export --config runs/pl/hf

The Callback saves `pl_module.model` (the Hugging Face model itself), so the checkpoint's names are
the model's own (no `model.` prefix). Lightning's own checkpointing is turned off
(`enable_checkpointing=False`): one writer of checkpoints. On CPU, ModelParallelStrategy runs on
gloo ranks as it is (a `cpu` device mesh).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import ModelParallelStrategy
from own_loop import global_batch  # the same synthetic corpus as examples/own_loop.py
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, IterableDataset
from transformers import LlamaConfig, LlamaForCausalLM

from fsdpkit.checkpoint import Checkpointer

CONFIG = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


class Corpus(IterableDataset):
    """This rank's rows of global batches, from `cursor["position"]` (global samples) when
    iteration starts. The cursor counts the samples *trained on* (advanced in training_step, not
    here: Lightning fetches a batch ahead), it is what the checkpoint stores, so a resumed run
    continues with the next batch at any world size."""

    def __init__(self, cursor: dict, *, global_batch: int, seq_len: int):
        self.cursor, self.global_batch, self.seq_len = cursor, global_batch, seq_len

    def __iter__(self):
        rank, ws = torch.distributed.get_rank(), torch.distributed.get_world_size()
        per_rank = self.global_batch // ws
        position = self.cursor["position"]
        while True:
            batch = global_batch(position, self.global_batch, self.seq_len, CONFIG.vocab_size, seed=1)
            position += self.global_batch
            yield from batch[rank * per_rank:(rank + 1) * per_rank]


class LitLlama(L.LightningModule):
    def __init__(self, cursor: dict, *, global_batch: int):
        super().__init__()
        self.cursor, self.global_batch = cursor, global_batch
        self.model: LlamaForCausalLM | None = None
        self.losses: dict[int, float] = {}

    def configure_model(self) -> None:
        if self.model is not None:
            return
        torch.manual_seed(0)  # the same initial weights on every rank, before sharding
        self.model = LlamaForCausalLM(CONFIG)
        mesh = self.device_mesh["data_parallel"]
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        logits = self.model(input_ids=batch[:, :-1]).logits
        loss_sum = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten(), reduction="sum")
        total = loss_sum.detach().clone()
        torch.distributed.all_reduce(total)
        tokens = self.global_batch * (batch.shape[1] - 1)
        self.losses[self.trainer.global_step + 1] = float(total) / tokens
        self.cursor["position"] += self.global_batch  # consumed: saved with this step's checkpoint
        return loss_sum * self.trainer.world_size / tokens  # FSDP averages over ranks: the global mean's gradients

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.model.parameters(), lr=3e-3, foreach=True)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class FsdpkitCheckpoint(L.Callback):
    """fsdpkit's Checkpointer as a Lightning Callback: resume when fitting starts, `step` after
    every optimizer step, `close` at the end (waits for an async save)."""

    def __init__(self, ckpt_dir: str, *, cursor: dict, **settings):
        self.ckpt_dir, self.cursor, self.settings = ckpt_dir, cursor, settings
        self.ckpt: Checkpointer | None = None
        self.resumed_step = 0

    def on_fit_start(self, trainer: L.Trainer, pl_module: LitLlama) -> None:
        # on_fit_start: the model is sharded and the optimizer built, and the data loader has not
        # been iterated yet (on_train_start is too late: Lightning prefetches a batch before it)
        self.ckpt = Checkpointer(self.ckpt_dir, model=pl_module.model, optimizer=trainer.optimizers[0],
                                 scheduler=trainer.lr_scheduler_configs[0].scheduler, state={"data": self.cursor},
                                 **self.settings)
        self.resumed_step = self.ckpt.resume()
        # Lightning counts optimizer steps itself: continue its count where the checkpoint left off.
        progress = trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress
        progress.optimizer.step.total.completed = self.resumed_step

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: LitLlama, outputs, batch, batch_idx: int) -> None:
        step = trainer.global_step
        if self.ckpt.step(step, metrics={"loss": pl_module.losses.get(step)}, last=step == trainer.max_steps):
            trainer.should_stop = True  # a preemption signal: the state at `step` is committed

    def on_train_end(self, trainer: L.Trainer, pl_module: LitLlama) -> None:
        self.ckpt.close()


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
    p.add_argument("--out", type=Path, help="write {step: loss}, the resumed step and the sharding seen here (rank 0)")
    args = p.parse_args()

    ws = int(os.environ.get("WORLD_SIZE", "1"))
    cursor = {"position": 0}
    callback = FsdpkitCheckpoint(args.ckpt_dir, cursor=cursor, every_steps=args.save_every, keep_last=2,
                                resume=args.resume)
    module = LitLlama(cursor, global_batch=args.global_batch)
    trainer = L.Trainer(accelerator="cuda" if torch.cuda.is_available() else "cpu", devices=ws,
                        strategy=ModelParallelStrategy(data_parallel_size=ws, tensor_parallel_size=1),
                        max_steps=args.steps, callbacks=[callback], enable_checkpointing=False, logger=False,
                        enable_progress_bar=False, enable_model_summary=False)
    loader = DataLoader(Corpus(cursor, global_batch=args.global_batch, seq_len=args.seq_len),
                        batch_size=args.global_batch // ws, num_workers=0)  # in-process: the cursor is shared
    trainer.fit(module, loader)
    if trainer.global_rank == 0:
        if args.hf_config:
            CONFIG.save_pretrained(args.hf_config)
        if args.out:
            sharding = {"fsdp_units": sum(isinstance(m, FSDPModule) for m in module.model.modules()),
                        "dtensor_layers": all(isinstance(t, DTensor) for t in module.model.model.layers.parameters())}
            args.out.write_text(json.dumps({"losses": module.losses, "resumed_step": callback.resumed_step,
                                            "global_step": trainer.global_step, "sharding": sharding,
                                            "world_size": trainer.world_size}))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
