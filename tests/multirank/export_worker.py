"""Export/import scenarios on N gloo ranks under torchrun. Usage: export_worker.py PHASE WORK_DIR

Phases (run in this order by tests/multirank/test_export_multirank.py, sharing WORK_DIR):
  train:  on 2 ranks, trains each variant of VARIANTS a few steps and commits its checkpoint to
          WORK_DIR/<variant>/checkpoints (fsdpkit's own trainer and Checkpointer).
  import: on 3 ranks (uneven shards of every 512- and 344-row weight), builds each variant's
          sharded model without initialising it, loads every export listed in
          WORK_DIR/imports.json with load_hf_weights, and writes the logits on a fixed batch
          and each rank's import report to WORK_DIR/imported/.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as tdist

from fsdpkit import dist
from fsdpkit.checkpoint.manager import CheckpointGroups
from fsdpkit.config import compose_config
from fsdpkit.hf import load_hf_weights
from fsdpkit.model import logits
from fsdpkit.parallel import build_sharded_model
from fsdpkit.train.determinism import enable_determinism
from fsdpkit.train.run import attach_checkpointer, build_trainer

COMMON = ["train.max_steps=3", "train.global_batch_size=8", "train.micro_batch_size=4", "train.eval_samples=4",
          "train.progress=false", "log_level=WARNING", "checkpoint.save_at_end=true"]
VARIANTS = {
    "llama": ["experiment=demo"],
    "llama_tied": ["experiment=demo", "model.tie_word_embeddings=true"],
    "hf": ["experiment=[demo,hf_llama]"],
    "hf_tied": ["experiment=[demo,hf_llama]", "++model.hf_config.tie_word_embeddings=true"],
}


def overrides(variant: str, work: Path) -> list[str]:
    return VARIANTS[variant] + COMMON + [f"run_dir={work / variant}"]


def fixed_batch() -> torch.Tensor:
    return torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))  # [B, T]


def phase_train(work: Path) -> None:
    groups = None
    for variant in VARIANTS:
        cfg = compose_config(overrides(variant, work))
        if groups is None:
            groups = CheckpointGroups.create(cfg.checkpoint)
        if dist.is_main():
            Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
        tdist.barrier()
        trainer, plan = build_trainer(cfg, device=torch.device("cpu"), run_dir=Path(cfg.run_dir))
        attach_checkpointer(trainer, cfg, plan, groups=groups).resume()
        trainer.fit()
        trainer.metrics.close()
        del trainer


def phase_import(work: Path) -> None:
    jobs = json.loads((work / "imports.json").read_text())  # [{"variant", "tag", "path"}]
    out = work / "imported"
    if dist.is_main():
        out.mkdir(exist_ok=True)
    tdist.barrier()
    for job in jobs:
        cfg = compose_config(overrides(job["variant"], work))
        model, _ = build_sharded_model(cfg, torch.device("cpu"), init=False)
        report = load_hf_weights(model, job["path"])
        with torch.no_grad():
            result = logits(model, fixed_batch())
        reports = [None] * dist.world_size()
        tdist.all_gather_object(reports, report)
        if dist.is_main():
            torch.save(result, out / f"{job['tag']}.pt")
            (out / f"{job['tag']}.json").write_text(json.dumps(reports))
        del model, result


def main() -> None:
    phase, work = sys.argv[1], Path(sys.argv[2])
    enable_determinism()
    dist.init_process_group(backend="gloo")
    {"train": phase_train, "import": phase_import}[phase](work)
    dist.shutdown()
    os._exit(0)


if __name__ == "__main__":
    main()
