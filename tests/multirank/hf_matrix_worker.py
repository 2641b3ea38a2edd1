"""Runs on 2 gloo ranks under torchrun: for each Hugging Face folder given, trains it from
`model=hf model.path=DIR` through fsdpkit's own run (fsdpkit.train.run.train, what `fsdpkit train`
runs in each rank), resumes it from its step-2 checkpoint, exports it, and records what the tests
compare with transformers itself: step 1's loss, every buffer, the trained logits, and a packed
sample's per-token losses (or the refusal to pack). Usage:
    hf_matrix_worker.py [--device cuda] OUT.json RUNS_DIR ARCH=DIR [ARCH=DIR ...]
(an ARCH ending in `+lora` trains LoRA adapters instead). With `--device cuda` (tests/cuda) the ranks
train on their GPU under NCCL, and transformers' reference runs on the same GPU."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as tdist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fsdpkit import dist  # noqa: E402
from fsdpkit.checkpoint.find import find_checkpoint  # noqa: E402
from fsdpkit.checkpoint.manager import CheckpointGroups  # noqa: E402
from fsdpkit.config import compose_config  # noqa: E402
from fsdpkit.data import GlobalSampler, build_datasets  # noqa: E402
from fsdpkit.data.datasets import Batch  # noqa: E402
from fsdpkit.model import logits as model_logits  # noqa: E402
from fsdpkit.model.document_attention import use_document_attention  # noqa: E402
from fsdpkit.model.isolation import packing_refusal  # noqa: E402
from fsdpkit.train.determinism import enable_determinism  # noqa: E402
from fsdpkit.train.loss import masked_loss_terms  # noqa: E402
from fsdpkit.train.metrics import read_records  # noqa: E402
from fsdpkit.train.run import attach_checkpointer, build_trainer, train  # noqa: E402
from hf_folders import reference_model  # noqa: E402

BASE = ["model=hf", "deterministic=true", "train.max_steps=3", "train.global_batch_size=4", "train.micro_batch_size=2",
        "data.seq_len=32", "data.num_samples=64", "train.eval_every=0", "train.eval_samples=4", "train.progress=false",
        "optim.warmup_steps=1", "optim.lr=1e-3", "checkpoint.every_steps=2", "diagnostics.memory_steps=0"]
LORA = ["model.peft.method=lora", "model.peft.r=4", "model.peft.alpha=8"]
CPU = torch.device("cpu")
DEVICE = CPU  # main() sets this rank's GPU for --device cuda


def first_batch(cfg) -> torch.Tensor:
    """The global batch of step 1 as token ids [B, L+1], from the run's own data and order."""
    data, _ = build_datasets(cfg.data, vocab_size=512, seed=cfg.seed)
    sampler = GlobalSampler(num_samples=len(data), global_batch_size=cfg.train.global_batch_size, seed=cfg.seed,
                            shuffle=cfg.data.shuffle, fingerprint=getattr(data, "fingerprint", ""))
    inputs, targets, _ = data.labeled_batch(sampler.next_global_batch())
    return torch.cat([inputs, targets[:, -1:]], dim=1)


DOC_LENGTHS = (5, 9, 7)  # three documents packed into one sample of PACKED_LEN positions, then padding
PACKED_LEN = 24


def packed_sample(batch: torch.Tensor) -> tuple[list[torch.Tensor], Batch]:
    """Three documents cut from step 1's tokens, packed into one sample as data.packing=true packs them:
    positions restart at 0 per document, targets stop at each document's end, the tail is padding."""
    flat, docs, at = batch.flatten(), [], 0
    for n in DOC_LENGTHS:
        docs.append(flat[at : at + n + 1])  # n inputs and the n-th target
        at += n + 1
    inputs = torch.ones(1, PACKED_LEN, dtype=torch.long)
    targets = torch.full((1, PACKED_LEN), -100)
    positions = torch.zeros(1, PACKED_LEN, dtype=torch.long)
    at = 0
    for doc in docs:
        n = len(doc) - 1
        inputs[0, at : at + n], targets[0, at : at + n] = doc[:-1], doc[1:]
        positions[0, at : at + n] = torch.arange(n)
        at += n
    positions[0, at:] = torch.arange(PACKED_LEN - at)
    return docs, Batch(inputs, targets, positions)


def per_token_losses(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none")[targets.flatten() != -100]


def packing_results(model, ref, batch: torch.Tensor) -> dict:
    """fsdpkit's forward of a packed sample against transformers' forward of each document alone,
    per token, and the chunked loss's sum; also the same sample run together (concat)."""
    docs, packed = packed_sample(batch)
    on = Batch(*(t.to(DEVICE) for t in packed))
    out = {}
    with torch.no_grad():
        mine = per_token_losses(model_logits(model, on.inputs, positions=on.positions), on.targets).cpu()
        if use_document_attention(model):  # what packed runs use with sdpa: one document at a time
            out["per_document"] = per_token_losses(model_logits(model, on.inputs, positions=on.positions),
                                                   on.targets).cpu().tolist()
        concat = per_token_losses(model_logits(model, on.inputs), on.targets).cpu()
        chunked = float(masked_loss_terms(model, on, chunk_tokens=4).ce_sum)
        alone = torch.cat([per_token_losses(ref(doc[None, :-1].to(DEVICE)).logits, doc[None, 1:].to(DEVICE)).cpu()
                           for doc in docs])
    return {**out, "packed": mine.tolist(), "concat": concat.tolist(), "alone": alone.tolist(),
            "chunked_sum": chunked}


def trained_model(cfg, ckpt: Path):
    """fsdpkit's model as it resumes from `ckpt` (sharded, on every rank)."""
    trainer, plan = build_trainer(cfg, device=DEVICE, run_dir=Path(cfg.run_dir), init=False)
    groups = CheckpointGroups.create(cfg.checkpoint)
    found = find_checkpoint(cfg.checkpoint, group=groups.sync)
    assert found.path is not None and Path(found.path).name == ckpt.name, found.path
    attach_checkpointer(trainer, cfg, plan, groups=groups).resume(found)
    trainer.checkpointer.close(wait=False)
    return trainer


def one(arch: str, folder: Path, runs: Path) -> dict:
    lora = arch.endswith("+lora")
    target_modules = "[c_attn]" if arch.startswith("gpt2") else "[q_proj,v_proj]"
    extra = LORA + [f"model.peft.target_modules={target_modules}"] if lora else []
    on_gpu = ["device=cuda", "backend=nccl"] if DEVICE.type == "cuda" else []
    args = BASE + extra + on_gpu + [f"model.path={folder}"]
    out: dict = {}
    full = compose_config(args + [f"run_dir={runs / arch / 'full'}"])
    train(full, device=DEVICE)
    tdist.barrier()
    resumed = compose_config(args + [f"run_dir={runs / arch / 'resumed'}",
                                     f"checkpoint.resume={runs / arch / 'full' / 'checkpoints' / 'step_2'}"])
    train(resumed, device=DEVICE)
    tdist.barrier()
    again = compose_config(args + [f"run_dir={runs / arch / 'full'}"])
    trainer = trained_model(again, runs / arch / "full" / "checkpoints" / "step_3")
    model = trainer.model.eval()
    batch = first_batch(full)
    with torch.no_grad():
        logits = model_logits(model, batch[:, :-1].to(DEVICE)).float().cpu()  # [B, L, V], every rank runs it
    ref = reference_model(folder).to(DEVICE)  # built on the CPU, as from_pretrained builds it, then moved
    # the folder's weights as fsdpkit starts from them (those of transformers' reference), sharded
    start = compose_config(args + [f"run_dir={runs / arch / 'start'}"])
    Path(start.run_dir).mkdir(parents=True, exist_ok=True)
    fresh = build_trainer(start, device=DEVICE, run_dir=Path(start.run_dir))[0].model.eval()
    refusal = packing_refusal(fresh)
    packing = {"refused": refusal} if refusal else packing_results(fresh, ref, batch)  # every rank runs the forwards
    del fresh
    if dist.is_main():
        records = {name: read_records(runs / arch / name) for name in ("full", "resumed")}
        out["loss"] = [r["loss"] for r in records["full"]]
        out["grad_norm"] = [r["grad_norm"] for r in records["full"]]
        out["resumed"] = [(r["step"], r["loss"], r["grad_norm"]) for r in records["resumed"]]
        out["resume_events"] = [json.loads(line) for line in open(runs / arch / "resumed" / "metrics.jsonl")
                                if '"event": "resume"' in line]
        with torch.no_grad():  # transformers' own loss of step 1's batch: labels shift inside
            on = batch.to(DEVICE)
            out["reference_loss"] = float(ref(input_ids=on, labels=on).loss)
        mine = {name: b.cpu() for name, b in model.named_buffers()}
        out["buffers"] = {name: bool(name in mine and mine[name].shape == b.shape and torch.equal(mine[name], b.cpu()))
                          for name, b in ref.named_buffers()}
        out["buffers_extra"] = sorted(set(mine) - {n for n, _ in ref.named_buffers()})
        out["param_dtypes"] = sorted({str(p.dtype) for p in model.parameters()})
        torch.save(logits, runs / arch / "trained_logits.pt")
        torch.save(batch, runs / arch / "batch.pt")
        out["packing"] = packing
        out["attn"] = ref.config._attn_implementation
        out["mine_attn"] = model.config._attn_implementation
    del trainer, model, ref
    tdist.barrier()
    return out


def main() -> None:
    global DEVICE
    enable_determinism()
    args = sys.argv[1:]
    if args[:2] == ["--device", "cuda"]:
        args = args[2:]
        DEVICE = dist.pick_device("cuda")
    out_path, runs = Path(args[0]), Path(args[1])
    dist.init_process_group(backend="nccl" if DEVICE.type == "cuda" else "gloo")
    results = {}
    for spec in args[2:]:
        arch, folder = spec.split("=", 1)
        results[arch] = one(arch, Path(folder), runs)
    if dist.is_main():
        out_path.write_text(json.dumps(results))
    tdist.barrier()
    tdist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
