"""Framework overhead of fsdpkit's trainer versus a hand-written minimal FSDP2 loop.

Both sides train the same model on the same samples with the same math, in one process group:

- baseline: a loop written directly against torch (meta-device build, `fully_shard` per
  LlamaDecoderLayer then the root, `to_empty` + fsdpkit's deterministic init, AdamW foreach;
  per micro-batch cross-entropy sum / global tokens, gradient sync on the last micro-batch only,
  `clip_grad_norm_`, step, zero_grad). Gradients are SUM-reduced, as in fsdpkit.
- fsdpkit: `build_trainer(cfg, ...)`, then per step `trainer.train_step()` followed by
  `trainer.metrics.step(record)`, i.e. everything `Trainer.fit` does per step apart from the
  periodic evaluation and checkpointing (no checkpointer is attached) and the disabled progress
  bar. Its per-step log lines (log_every=1) go to a file in the run directory.

After a few warm-up steps each, the two alternate in rounds; each round times `--steps` optimizer
steps of each side between barriers on rank 0, the order within a round flipping every round
(baseline then fsdpkit, then fsdpkit then baseline, ...) so that neither always runs second.
We report the median tokens/s of each, their ratio and the overhead, (1 - fsdpkit/baseline) * 100%
(also the median of per-round ratios, and the ratio of the best rounds). The first step of each
side is compared too (loss and gradient norm must agree): the math is the same.

Usage: python bench/overhead.py [--nproc 2] [--rounds 5] [--steps 10] [--quick]
Without RANK in the environment it relaunches itself under torchrun (OMP_NUM_THREADS=1 per rank);
rank 0 prints a markdown table and writes bench/results/overhead.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as tdist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

import fsdpkit
from fsdpkit import dist
from fsdpkit.config import compose_config
from fsdpkit.data import GlobalSampler, build_datasets, rank_micro_batches
from fsdpkit.hf import build_model, init_buffers
from fsdpkit.log import LOGGER_NAME, setup_logging
from fsdpkit.model.llama import LlamaDecoderLayer
from fsdpkit.parallel import init_weights
from fsdpkit.train.determinism import enable_determinism, seed_everything
from fsdpkit.train.run import build_trainer

RESULTS = Path(__file__).parent / "results" / "overhead.json"
SIZES = ["model.hidden_size=256", "model.num_hidden_layers=4", "model.intermediate_size=688",
         "data.seq_len=96"]  # ~270 ms per step on 2 single-threaded CPU ranks
QUICK_SIZES = ["data.seq_len=32"]  # the stock llama_tiny model
WARMUP = 3


def overrides(quick: bool, total_steps: int) -> list[str]:
    return ["experiment=demo", "train.progress=false", "train.eval_every=0", "run_dir=runs/bench_overhead",
            f"train.max_steps={total_steps}", *(QUICK_SIZES if quick else SIZES)]


class Baseline:
    """The minimal FSDP2 loop."""

    def __init__(self, cfg, device: torch.device):
        with torch.device("meta"):
            model = build_model(cfg.model)
        mesh = init_device_mesh(device.type, (tdist.get_world_size(),))
        for module in model.modules():
            if isinstance(module, LlamaDecoderLayer):
                fully_shard(module, mesh=mesh)
        fully_shard(model, mesh=mesh, reshard_after_forward=False)
        for module in model.modules():  # loss / global tokens on each rank: grads are a plain SUM
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)
        model.to_empty(device=device)
        init_weights(model, seed=cfg.seed, std=cfg.model.initializer_range)
        init_buffers(model)
        o = cfg.optim
        params = list(model.parameters())
        groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": o.weight_decay},
                  {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
        self.optimizer = torch.optim.AdamW(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps, foreach=True)
        self.data, _ = build_datasets(cfg.data, vocab_size=cfg.model.vocab_size, seed=cfg.seed)
        self.sampler = GlobalSampler(num_samples=len(self.data), global_batch_size=cfg.train.global_batch_size,
                                     seed=cfg.seed, shuffle=cfg.data.shuffle)
        self.model, self.micro_batch_size, self.grad_clip = model, cfg.train.micro_batch_size, cfg.train.grad_clip
        self.rank, self.world_size = tdist.get_rank(), tdist.get_world_size()

    def train_step(self) -> tuple[list[torch.Tensor], torch.Tensor]:
        global_batch = self.sampler.next_global_batch()
        micro = rank_micro_batches(global_batch, rank=self.rank, world_size=self.world_size,
                                   micro_batch_size=self.micro_batch_size)
        global_tokens = len(global_batch) * self.data.seq_len
        losses = []
        for i, indices in enumerate(micro):
            self.model.set_requires_gradient_sync(i == len(micro) - 1)
            batch = self.data.batch(indices)
            logits = self.model(batch[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten(), reduction="sum")
            (loss / global_tokens).backward()
            losses.append(loss.detach())
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip, foreach=True)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return losses, norm


def first_step_check(baseline: Baseline, trainer, global_tokens: int) -> dict[str, float]:
    """One step of each from the same weights and samples: loss and grad norm must agree."""
    losses, norm = baseline.train_step()
    (loss,) = dist.all_reduce_sum([float(sum(losses))], device=torch.device("cpu"))
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    record = trainer.train_step()
    trainer.metrics.step(record)
    return {"baseline_loss": loss / global_tokens, "fsdpkit_loss": record["loss"],
            "baseline_grad_norm": float(norm), "fsdpkit_grad_norm": record["grad_norm"]}


def timed_round(step, steps: int) -> float:
    """Seconds for `steps` calls of `step`, all ranks done (rank 0's clock)."""
    tdist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    tdist.barrier()
    return time.perf_counter() - t0


def worker(args: argparse.Namespace) -> None:
    device = torch.device("cpu")
    total = 1 + WARMUP + args.rounds * args.steps
    cfg = compose_config(overrides(args.quick, total))
    if cfg.deterministic:
        enable_determinism()
    dist.init_process_group(backend="gloo")
    rank = dist.rank()
    run_dir = Path(cfg.run_dir)
    if rank == 0:  # fsdpkit's per-step log lines go to a file, formatted as on stderr
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "metrics.jsonl").unlink(missing_ok=True)
        handler = logging.FileHandler(run_dir / "train.log", mode="w")
        handler.setFormatter(logging.Formatter("[%(asctime)s rank0 %(levelname)s] %(message)s", "%H:%M:%S"))
        logging.getLogger(LOGGER_NAME).addHandler(handler)
    setup_logging(cfg.log_level)
    seed_everything(cfg.seed, rank=rank)
    tdist.barrier()

    baseline = Baseline(cfg, device)
    trainer, _ = build_trainer(cfg, device=device, run_dir=run_dir)
    global_tokens = cfg.train.global_batch_size * cfg.data.seq_len
    check = first_step_check(baseline, trainer, global_tokens)

    def fsdpkit_step() -> None:  # what Trainer.fit does per step (no eval, no progress bar)
        trainer.metrics.step(trainer.train_step())

    sides = {"baseline": baseline.train_step, "fsdpkit": fsdpkit_step}
    for step in sides.values():
        timed_round(step, WARMUP)
    per_round: dict[str, list[float]] = {name: [] for name in sides}
    load = [os.getloadavg()[0]]
    for r in range(args.rounds):  # A B, B A, A B, ...: neither side always runs second
        for name in list(sides)[:: 1 if r % 2 == 0 else -1]:
            per_round[name].append(args.steps * global_tokens / timed_round(sides[name], args.steps))

    load.append(os.getloadavg()[0])
    if rank == 0:
        n_params = sum(p.numel() for p in baseline.model.parameters())
        report(args, check, per_round, global_tokens, n_params, load)
    trainer.metrics.close()
    trainer = baseline = sides = None  # drop model and optimizer references before teardown
    dist.shutdown()  # collect, barrier, destroy
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def report(args, check, per_round, global_tokens: int, n_params: int, load: list[float]) -> None:
    b, f = per_round["baseline"], per_round["fsdpkit"]
    med = {"baseline": statistics.median(b), "fsdpkit": statistics.median(f)}
    ratio = med["fsdpkit"] / med["baseline"]
    paired = statistics.median(y / x for x, y in zip(b, f, strict=True))
    best = max(f) / max(b)  # the least disturbed round of each: contention only ever slows a round
    result = {
        "machine": {"cpu_count": os.cpu_count(), "cpus_usable": len(os.sched_getaffinity(0)),
                    "platform": platform.platform(), "python": platform.python_version(),
                    "torch": torch.__version__, "fsdpkit": fsdpkit.__version__,
                    "world_size": tdist.get_world_size(), "threads_per_rank": torch.get_num_threads(),
                    "loadavg_1min_before_after": load},
        "overrides": [o for o in overrides(args.quick, 0) if not o.startswith("train.max_steps")],
        "model_params": n_params, "tokens_per_step": global_tokens,
        "rounds": args.rounds, "steps_per_round": args.steps, "warmup_steps": WARMUP,
        "tokens_per_s": per_round, "median_tokens_per_s": med,
        "ratio": ratio, "overhead_pct": (1 - ratio) * 100,
        "median_round_ratio": paired, "median_round_overhead_pct": (1 - paired) * 100,
        "best_round_ratio": best, "best_round_overhead_pct": (1 - best) * 100,
        "first_step_check": check,
    }
    m = result["machine"]
    lines = [
        f"fsdpkit {m['fsdpkit']} vs a minimal FSDP2 loop: {m['world_size']} gloo CPU ranks x "
        f"{m['threads_per_rank']} thread, {m['cpu_count']} CPUs (load {load[0]:.2f} -> {load[1]:.2f}), "
        f"torch {m['torch']}",
        f"model {n_params / 1e6:.2f}M params, {global_tokens} tokens/step, "
        f"{args.rounds} rounds x {args.steps} steps each (after {WARMUP} warm-up steps)",
        f"first step: loss {check['baseline_loss']:.6f} vs {check['fsdpkit_loss']:.6f}, "
        f"grad norm {check['baseline_grad_norm']:.6f} vs {check['fsdpkit_grad_norm']:.6f}",
        "",
        "| round | baseline tok/s | fsdpkit tok/s | fsdpkit/baseline |",
        "|---|---|---|---|",
        *(f"| {i + 1} | {x:,.0f} | {y:,.0f} | {y / x:.4f} |" for i, (x, y) in enumerate(zip(b, f, strict=True))),
        f"| **median** | **{med['baseline']:,.0f}** | **{med['fsdpkit']:,.0f}** | **{ratio:.4f}** |",
        f"| best | {max(b):,.0f} | {max(f):,.0f} | {best:.4f} |",
        "",
        f"overhead: {(1 - ratio) * 100:+.2f}% (medians); per-round ratios' median {(1 - paired) * 100:+.2f}%, "
        f"best rounds {(1 - best) * 100:+.2f}%",
    ]
    result["markdown"] = "\n".join(lines)  # bench/results_md.py quotes it in bench/RESULTS.md
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print("\n".join([*lines, f"written to {RESULTS}"]), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per side (default 5)")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per round (default 10)")
    parser.add_argument("--quick", action="store_true", help="tiny model, for a smoke run")
    args = parser.parse_args()
    if "RANK" in os.environ:
        worker(args)
        return
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
           __file__, *sys.argv[1:]]
    sys.exit(subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}).returncode)


if __name__ == "__main__":
    main()
