"""Runs on N gloo ranks under torchrun; trains several configs in one process group and writes
what the tests assert on to a JSON file (rank 0). Usage: train_worker.py OUT.json RUNS_DIR.
On 3 ranks only the uneven global batches run."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as tdist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fsdpkit import dist  # noqa: E402
from fsdpkit.config import compose_config  # noqa: E402
from fsdpkit.train.determinism import enable_determinism, seed_everything  # noqa: E402
from fsdpkit.train.metrics import read_records
from fsdpkit.train.run import build_trainer  # noqa: E402
from reference import reference_run  # noqa: E402

BASE = ["deterministic=true", "train.max_steps=10", "train.global_batch_size=16", "train.micro_batch_size=2",
        "train.grad_clip=0.5", "train.eval_samples=20", "train.progress=false", "optim.warmup_steps=3",
        "model.vocab_size=1001"]


def train(name: str, overrides: list[str], runs: Path) -> dict:
    cfg = compose_config(BASE + overrides + [f"run_dir={runs / name}"])
    if dist.is_main():
        (runs / name).mkdir(parents=True, exist_ok=True)
    tdist.barrier()
    seed_everything(cfg.seed, rank=dist.rank())  # as `fsdpkit train` does: no run inherits the last one's RNG
    trainer, plan = build_trainer(cfg, device=torch.device("cpu"), run_dir=runs / name)
    summary = trainer.fit()
    trainer.metrics.close()
    out = {"val_loss": summary["val_loss"], "local_mib": trainer.diagnostics.report["local_param_mib"],
           "mesh": list(plan.mesh.shape), "reshard_after_forward": plan.reshard_after_forward}
    out["local_shapes"] = {k: list(v.to_local().shape) for k, v in trainer.model.state_dict().items()}
    out["full_mib"] = sum(p.numel() * p.element_size() for p in trainer.model.parameters()) / 2**20
    if dist.is_main():
        records = read_records(runs / name)
        out["loss"] = [r["loss"] for r in records]
        out["grad_norm"] = [r["grad_norm"] for r in records]
    del trainer
    return out


# Global batches that divide neither 2 nor 3 ranks x micro-batches: 7 in micro-batches of at most 3
# (1 rank: 3+2+2; 2 ranks: 2+2 | 2+1; 3 ranks: 3 | 2 | 2), 5 in micro-batches of 1 (2 ranks: 1+1+1 |
# 1+1+empty; 3 ranks: 1+1 | 1+1 | 1+empty): uneven shares, unequal and empty micro-batches.
UNEVEN = {"uneven7": ["train.global_batch_size=7", "train.micro_batch_size=3", "train.max_steps=4"],
          "uneven5": ["train.global_batch_size=5", "train.micro_batch_size=1", "train.max_steps=4"]}


def main() -> None:
    out_path, runs = Path(sys.argv[1]), Path(sys.argv[2])
    enable_determinism()
    dist.init_process_group(backend="gloo")
    ws = dist.world_size()
    results: dict = {}
    for name, overrides in UNEVEN.items():
        results[name] = train(name, overrides, runs)
        if ws == 1:
            results[f"{name}_reference"] = reference_run(compose_config(BASE + overrides))
    if ws == 3:  # only the uneven batches
        finish(results, out_path)
    results["fp32"] = train("fp32", [], runs)
    if ws != 2:  # 1 rank x 8 micro-batches against 4 ranks x 2
        results["accum"] = train("accum", ["train.global_batch_size=8", "train.micro_batch_size=1"], runs)
    if ws == 1:
        results["reference"] = reference_run(compose_config(BASE))
        # inductor on one rank: each decoder block is compiled before fully_shard and FSDP's
        # all-gather and reduce-scatter run in hooks outside the compiled code, so the kernels are
        # the ones 2 ranks build, at half the (cold: minutes of C++ builds) cost. The compiled
        # wrapping on 2 sharded ranks is ckpt_worker's ac_compile (aot_eager: the same graphs).
        results["compile"] = train("compile", ["train.compile=true", "train.max_steps=5"], runs)
        results["compile_ref"] = train("compile_ref", ["train.max_steps=5"], runs)
    else:
        results["bf16"] = train("bf16", ["experiment=bf16"], runs)
    if ws == 4:  # every other strategy, with 2 micro-batches per rank (gradient accumulation)
        for strategy in ("SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"):
            results[strategy] = train(strategy,
                                      [f"strategy.sharding_strategy={strategy}", "strategy.hsdp_shard_size=2"], runs)
    if ws == 2:
        results["compile_ref"] = train("compile_ref", ["train.max_steps=5"], runs)
        results["ac"] = train("ac", ["experiment=activation_checkpointing", "train.max_steps=5"], runs)
        # attention dropout draws random numbers inside each decoder layer: with activation checkpointing
        # the recompute must replay them exactly (torch.utils.checkpoint restores the RNG state)
        hf = ["experiment=hf_llama", "train.max_steps=5", "model.vocab_size=512", "++model.hf_config.vocab_size=512",
              "++model.hf_config.attention_dropout=0.2"]
        results["hf"] = train("hf", hf, runs)
        results["hf_ac"] = train("hf_ac", [*hf, "policy.activation_checkpointing_policy=[auto]"], runs)
    finish(results, out_path)


def finish(results: dict, out_path: Path) -> None:
    gathered = [None] * dist.world_size()
    tdist.all_gather_object(gathered, {k: v.get("local_mib") for k, v in results.items() if isinstance(v, dict)})
    results["local_mib_by_rank"] = gathered
    if dist.is_main():
        out_path.write_text(json.dumps(results))
    dist.shutdown()
    os._exit(0)


if __name__ == "__main__":
    main()
