"""Training throughput on one CUDA GPU: fsdpkit's trainer against a minimal hand-written FSDP2 loop.

The model is Llama-3.2-1B-shaped (hidden 2048, 16 layers, 32 query / 8 KV heads, MLP 8192, vocabulary
128256, tied embeddings), built two ways:

- `ref`: fsdpkit's reference Llama (`model=llama_1b`);
- `hf`: the same shape through transformers (`model=hf model.path=DIR model.pretrained=false`), DIR
  holding only a `config.json` written at start-up (a random init of the folder's architecture reads
  nothing else; writing ~2.5 GB of random weights would cost a good part of the time budget and does
  not change a step's speed). Llama 3.2's `rope_scaling` is left out: it changes no FLOP.

Every configuration trains with `policy.mixed_precision=bf16-mixed` (bf16 parameters in compute,
fp32 gradient reduction, fp32 logits, fp32 master weights and AdamW state), sequence length 2048,
one micro-batch per step (global batch = micro-batch), random token ids from a token file
(`data=tokens`: reading a sample is a memory-mapped slice, so the data costs nearly nothing), with
and without `train.compile=true`, with and without full activation checkpointing
(`experiment=activation_checkpointing`, every decoder layer recomputed in backward).

The two sides, both resident on the GPU at once, so that they alternate:

- fsdpkit: `build_trainer(cfg, ...)`, then per step `trainer.train_step()` and
  `trainer.metrics.step(record)`: what `Trainer.fit` does per step apart from evaluation and
  checkpoints (no checkpointer attached); its log lines go to a file. Its step reads the loss and
  the gradient norm back to the host (one sync per step).
- baseline, torchtitan's shape (no logging, no checkpoint, no host sync inside the step): the same
  model built on the meta device by the same builder, activation checkpointing as torchtitan applies
  it (`checkpoint_wrapper(block, preserve_rng_state=False)` on each decoder layer), then
  `block.compile()` per decoder layer when compiling, then `fully_shard` per decoder layer and on the
  root with the same MixedPrecisionPolicy (blocks: bf16 params, fp32 reduce; root: also fp32
  output), `to_empty` and the same seeded init; AdamW fused, cross-entropy (sum / tokens),
  `clip_grad_norm_`, step, zero_grad; a transformers model is called with `use_cache=False`. It reads
  the same samples from the same dataset.

After a first step of each from the same weights and samples (loss and gradient norm reported side
by side) and `--warmup` more steps each (compile happens here), the two alternate in `--rounds`
rounds, each timing `--steps` optimizer steps of each side between a device synchronisation and a
barrier, the order flipping every round (as bench/overhead.py does). Reported per side: the median
tokens/s (min-max over the rounds), MFU, and the peak memory of its own rounds: the peak allocated
while it ran minus what the other side keeps resident (its parameters, gradients and optimizer
state, counted from the tensors); fsdpkit / baseline is the ratio of the medians.

The micro-batch is the largest of `--batch`, `--batch`/2, ... that fits with BOTH sides resident
(an out-of-memory error tears the configuration down and retries with half; the size that fits is
remembered for the next configuration of the same model and AC setting). One side alone would fit
a larger batch.

FLOPs per token, as torchtitan counts them (`get_nparams_and_flops`):
    6 * N + 12 * L * H * Q * T
where N is the parameter count without the token embedding (torchtitan subtracts the embedding
table; with tied embeddings the output projection is the same matrix but still a matmul, so it is
counted here once as the output layer: N = all distinct parameters - embedding + output matrix),
L layers, H query heads, Q head dim, T the sequence length (attention counted as if not causal, as
torchtitan does). MFU = tokens/s * FLOPs per token / the GPU's dense bf16 peak (H100 SXM and H200:
989 TFLOP/s, H100 NVL 835, H100 PCIe 756; `--peak-tflops` overrides). torchtitan's published 33-39%
are for Llama 3.1 8B on 8 H100s; this is a 1B model on one GPU (smaller matmuls, no communication
to overlap): the figures are not directly comparable.

Usage (a GPU machine): python -m torch.distributed.run --standalone --nproc-per-node 1 bench/gpu_train.py
    [--out FILE] [--budget-s 230] [--models ref,hf] [--batch 8] [--rounds 5] [--steps 2]
On a CPU: the same with --cpu-smoke (gloo, tiny shapes, no compile, a few steps: checks the code runs).
Rank 0 prints a table per configuration and writes the JSON (default bench/results/gpu_train.json)
after every configuration, so a run stopped by its time limit keeps what finished.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np
import torch
import torch.distributed as tdist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from fsdpkit import dist
from fsdpkit.config import compose_config
from fsdpkit.data import GlobalSampler, build_datasets, rank_micro_batches
from fsdpkit.hf import build_model
from fsdpkit.log import LOGGER_NAME, setup_logging
from fsdpkit.model import vocab_size as model_vocab_size
from fsdpkit.parallel.fsdp import materialize
from fsdpkit.train.run import build_trainer

RESULTS = Path(__file__).parent / "results" / "gpu_train.json"
LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                rope_theta=500000.0, tie_word_embeddings=True, rms_norm_eps=1e-5)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rope_theta=10000.0, tie_word_embeddings=True,
            rms_norm_eps=1e-5)
PEAK_BF16_TFLOPS = [("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("H200", 989.0), ("GH200", 989.0),
                    ("B200", 2250.0), ("A100", 312.0)]  # dense, no sparsity; first match wins
SAMPLES = 1024  # in the token file; the sampler wraps around when it needs more


def peak_tflops(name: str) -> float | None:
    return next((v for key, v in PEAK_BF16_TFLOPS if key in name), None)


def write_inputs(work: Path, shape: dict, *, seq_len: int) -> tuple[Path, Path, float]:
    """The transformers folder (config.json only) and a token file of random ids; returns the
    seconds it took."""
    from transformers import LlamaConfig

    t0 = time.perf_counter()
    folder = work / "llama-1b-shape"
    cfg = LlamaConfig(**shape, head_dim=shape["hidden_size"] // shape["num_attention_heads"],
                      attention_bias=False, mlp_bias=False, hidden_act="silu", initializer_range=0.02)
    cfg.save_pretrained(folder)
    tokens = work / "tokens.bin"
    rng = np.random.default_rng(0)
    rng.integers(0, shape["vocab_size"], size=SAMPLES * seq_len + 1, dtype=np.uint32).tofile(tokens)
    return folder, tokens, time.perf_counter() - t0


def overrides(args, *, kind: str, compile_: bool, ac: bool, batch: int, folder: Path, tokens: Path,
              run_dir: Path, device: str) -> list[str]:
    shape = TINY if args.cpu_smoke else LLAMA_1B
    model = (["model=llama_1b", *(f"model.{k}={v}" for k, v in shape.items())] if kind == "ref"
             else ["model=hf", f"model.path={folder}", "model.pretrained=false"])
    return [*(["experiment=activation_checkpointing"] if ac else []), *model,
            "data=tokens", f"data.path={tokens}", "data.token_dtype=uint32", f"data.seq_len={args.seq_len}",
            "data.val_fraction=0.01", "policy.mixed_precision=bf16-mixed", f"train.compile={str(compile_).lower()}",
            f"train.global_batch_size={batch}", f"train.micro_batch_size={batch}", "train.eval_every=0",
            "train.progress=false", "train.max_steps=100000", "optim.warmup_steps=10", f"run_dir={run_dir}",
            f"train.compile_backend={args.compile_backend}",
            f"device={device}", f"backend={'nccl' if device == 'cuda' else 'gloo'}"]


class Baseline:
    """The minimal FSDP2 loop (torchtitan's shape; see the module docstring)."""

    def __init__(self, cfg, device: torch.device, *, weights: dict[str, torch.Tensor], compile_: bool, ac: bool,
                 backend: str = "inductor"):
        with torch.device("meta"):
            model = build_model(cfg.model)
        layers = model.model.layers  # reference and transformers Llama alike
        for i, block in enumerate(layers):
            if ac:
                block = checkpoint_wrapper(block, preserve_rng_state=False)
            if compile_:
                block.compile(backend=backend)
            layers[i] = block
        mesh = init_device_mesh(device.type, (tdist.get_world_size(),))
        block_mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        root_mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                       output_dtype=torch.float32)
        for block in layers:
            fully_shard(block, mesh=mesh, mp_policy=block_mp)
        fully_shard(model, mesh=mesh, mp_policy=root_mp, reshard_after_forward=False)
        for module in model.modules():  # loss / global tokens: grads are a plain SUM, as in fsdpkit
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
        materialize(model, device=device, seed=cfg.seed, init=False)  # buffers only; the weights come next
        load_weights(model, weights)  # the same weights as fsdpkit's side
        o = cfg.optim
        params = list(model.parameters())
        groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": o.weight_decay},
                  {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
        self.optimizer = torch.optim.AdamW(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                                           fused=device.type == "cuda", foreach=device.type != "cuda")
        self.data, _ = build_datasets(cfg.data, vocab_size=model_vocab_size(model), seed=cfg.seed)
        self.sampler = GlobalSampler(num_samples=len(self.data), global_batch_size=cfg.train.global_batch_size,
                                     seed=cfg.seed, shuffle=cfg.data.shuffle)
        self.model, self.micro_batch_size, self.grad_clip = model, cfg.train.micro_batch_size, cfg.train.grad_clip
        self.forward_kwargs = {} if cfg.model.kind == "llama" else {"use_cache": False}
        self.device = device
        self.rank, self.world_size = tdist.get_rank(), tdist.get_world_size()

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        global_batch = self.sampler.next_global_batch()
        micro = rank_micro_batches(global_batch, rank=self.rank, world_size=self.world_size,
                                   micro_batch_size=self.micro_batch_size)
        global_tokens = len(global_batch) * self.data.seq_len
        loss_sum = torch.zeros((), device=self.device)
        for i, indices in enumerate(micro):
            self.model.set_requires_gradient_sync(i == len(micro) - 1)
            batch = self.data.batch(indices).to(self.device)  # [B, T + 1]
            # a transformers model without its KV cache (built in every forward while use_cache is on)
            out = self.model(batch[:, :-1], **self.forward_kwargs)
            logits = out if isinstance(out, torch.Tensor) else out.logits  # [B, T, V] fp32
            loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten(), reduction="sum")
            (loss / global_tokens).backward()
            loss_sum += loss.detach()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip, foreach=True)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss_sum / global_tokens, norm


def load_weights(model: nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Copy a full state dict into a sharded model (names without wrapper prefixes; DCP's helpers
    strip checkpoint_wrapper's and compile's)."""
    set_model_state_dict(model, dict(weights), options=StateDictOptions(full_state_dict=True))  # it replaces values


def flops_per_token(model: nn.Module, *, seq_len: int) -> tuple[float, int]:
    """(torchtitan's FLOPs per token, N): see the module docstring."""
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()  # a DTensor's numel is the global one
    emb, out = model.model.embed_tokens.weight, model.lm_head.weight  # reference and transformers Llama alike
    n = total - emb.numel() + (out.numel() if out is emb else 0)
    c = getattr(model, "config", None) or model.args
    q = c.hidden_size // c.num_attention_heads
    return 6 * n + 12 * c.num_hidden_layers * c.num_attention_heads * q * seq_len, n


def resident_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of this side's parameters, gradients and optimizer state on this rank."""
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    n = 0
    for p in model.parameters():
        n += local(p).nbytes + (local(p.grad).nbytes if p.grad is not None else 0)
    for state in optimizer.state.values():
        n += sum(local(v).nbytes for v in state.values() if isinstance(v, torch.Tensor))
    return n


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_round(step, steps: int, device: torch.device) -> float:
    sync(device)
    tdist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync(device)
    tdist.barrier()
    return time.perf_counter() - t0


def run_config(args, cfg, device: torch.device, *, weights: dict[str, dict[str, torch.Tensor]], kind: str,
               compile_: bool, ac: bool, peak: float | None) -> dict:
    """Both sides of one configuration; raises torch.OutOfMemoryError when they do not fit.

    fsdpkit's seeded init draws every weight on the CPU (~9 s for 1.2B parameters), so it runs once
    per model (`weights[kind]` is empty the first time and filled here); every later build of
    either side gets a copy of those weights.
    """
    t_start = time.perf_counter()
    baseline = trainer = sides = None
    try:
        first = kind not in weights
        trainer, plan = build_trainer(cfg, device=device, run_dir=Path(cfg.run_dir), init=first)
        if first:
            full = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True))
            weights[kind] = {k: v.to("cpu", copy=True) for k, v in full.items()}  # may be views of the params
            del full
        else:
            load_weights(trainer.model, weights[kind])
        baseline = Baseline(cfg, device, weights=weights[kind], compile_=compile_, ac=ac,
                            backend=cfg.train.compile_backend)
        t_built = time.perf_counter()
        global_tokens = cfg.train.global_batch_size * cfg.data.seq_len

        def fsdpkit_step() -> None:
            trainer.metrics.step(trainer.train_step())

        # the first step of each, from the same weights and samples
        record = trainer.train_step()
        trainer.metrics.step(record)
        loss, norm = baseline.train_step()
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        check = {"fsdpkit_loss": record["loss"], "baseline_loss": float(loss),
                 "fsdpkit_grad_norm": record["grad_norm"], "baseline_grad_norm": float(norm)}
        sides = {"baseline": baseline.train_step, "fsdpkit": fsdpkit_step}
        for step in sides.values():
            timed_round(step, args.warmup, device)
        t_warm = time.perf_counter()
        resident = {"baseline": resident_bytes(baseline.model, baseline.optimizer),
                    "fsdpkit": resident_bytes(trainer.model, trainer.optimizer)}
        per_round: dict[str, list[float]] = {name: [] for name in sides}
        peak_mem: dict[str, int] = {name: 0 for name in sides}
        for r in range(args.rounds):
            for name in list(sides)[:: 1 if r % 2 == 0 else -1]:
                other = resident["fsdpkit" if name == "baseline" else "baseline"]
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                per_round[name].append(args.steps * global_tokens / timed_round(sides[name], args.steps, device))
                if device.type == "cuda":
                    peak_mem[name] = max(peak_mem[name], torch.cuda.max_memory_allocated(device) - other)
        fpt, n_params = flops_per_token(baseline.model, seq_len=cfg.data.seq_len)
        sides_out = {}
        for name, xs in per_round.items():
            med = statistics.median(xs)
            mfu = [x * fpt / (peak * 1e12) for x in xs] if peak else None
            sides_out[name] = {
                "tokens_per_s": xs, "median_tokens_per_s": med, "min_tokens_per_s": min(xs),
                "max_tokens_per_s": max(xs), "mfu": mfu, "median_mfu": statistics.median(mfu) if mfu else None,
                "peak_mem_gib": peak_mem[name] / 2**30 if device.type == "cuda" else None,
                "resident_gib": resident[name] / 2**30}
        ratios = [f / b for b, f in zip(per_round["baseline"], per_round["fsdpkit"], strict=True)]
        return {"sides": sides_out, "ratio": sides_out["fsdpkit"]["median_tokens_per_s"]
                / sides_out["baseline"]["median_tokens_per_s"],
                "round_ratios": ratios, "first_step_check": check, "flops_per_token": fpt, "n_params_counted": n_params,
                "tokens_per_step": global_tokens, "fsdpkit_compiled_blocks": len(plan.compiled),
                "fsdpkit_checkpointed_blocks": len(plan.checkpointed),
                "seconds": {"build": t_built - t_start, "first_and_warmup": t_warm - t_built,
                            "timed": time.perf_counter() - t_warm, "total": time.perf_counter() - t_start}}
    finally:
        if trainer is not None:
            trainer.metrics.close()
        trainer = baseline = sides = None  # noqa: F841 (drop both models; `release` frees them after an error too)


def release(device: torch.device) -> None:
    """Free what the last configuration held (called after its exception, if any, is gone)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    torch._dynamo.reset()


def worker(args: argparse.Namespace) -> None:
    smoke = args.cpu_smoke
    device_name = "cpu" if smoke else "cuda"
    device = dist.pick_device(device_name)
    dist.init_process_group(backend="gloo" if smoke else "nccl")
    rank = dist.rank()
    t_begin = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="fsdpkit-gpu-train-"))
    shape = TINY if smoke else LLAMA_1B
    folder, tokens, t_inputs = write_inputs(work, shape, seq_len=args.seq_len) if rank == 0 else (None, None, 0.0)
    obj = [folder, tokens]
    tdist.broadcast_object_list(obj, src=0)
    folder, tokens = obj
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    peak = args.peak_tflops or (peak_tflops(gpu) if device.type == "cuda" else None)
    run_dir = work / "run"
    if rank == 0:  # fsdpkit's per-step log lines go to a file, formatted as on stderr
        run_dir.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(run_dir / "train.log", mode="w")
        handler.setFormatter(logging.Formatter("[%(asctime)s rank0 %(levelname)s] %(message)s", "%H:%M:%S"))
        logging.getLogger(LOGGER_NAME).addHandler(handler)
        logging.getLogger(LOGGER_NAME).propagate = False
    setup_logging("INFO")  # fsdpkit's default log_level: its per-step lines are formatted and written
    result = {"machine": {"device": gpu, "torch": torch.__version__, "cuda": torch.version.cuda,
                          "python": platform.python_version(), "cpu_count": os.cpu_count(),
                          "world_size": tdist.get_world_size(), "peak_bf16_tflops": peak,
                          "commit": os.environ.get("COMMIT", "")},
              "seq_len": args.seq_len, "rounds": args.rounds, "steps_per_round": args.steps,
              "warmup_steps": args.warmup,
              "cpu_smoke": smoke, "inputs_written_s": t_inputs, "configs": []}
    fits: dict[tuple[str, bool], int] = {}
    weights: dict[str, dict[str, torch.Tensor]] = {}  # by model kind: fsdpkit's seeded init, on the CPU
    spent: dict[bool, float] = {}  # seconds the last configuration took, by compile
    compiles = (False,) if smoke and args.compile_backend == "inductor" else (False, True)
    plan = [(kind, c, ac) for kind in args.models.split(",") for c in compiles for ac in (False, True)]
    for kind, compile_, ac in plan:
        entry = {"model": kind, "compile": compile_, "activation_checkpointing": ac}
        estimate = spent.get(compile_, 75.0 if compile_ else 35.0)
        elapsed = time.perf_counter() - t_begin
        if elapsed + estimate > args.budget_s:
            entry["skipped"] = (f"time budget: {elapsed:.0f} s spent, ~{estimate:.0f} s needed, "
                                f"--budget-s {args.budget_s:.0f}")
            result["configs"].append(entry)
            if rank == 0:
                print(f"{kind} compile={compile_} ac={ac}: skipped ({entry['skipped']})", flush=True)
            continue
        batch = fits.get((kind, ac), args.batch)
        entry["oom_at"] = []
        t0 = time.perf_counter()
        while batch >= 1:
            cfg = compose_config(overrides(args, kind=kind, compile_=compile_, ac=ac, batch=batch, folder=folder,
                                           tokens=tokens, run_dir=run_dir, device=device_name))
            oom = False
            try:
                entry.update(micro_batch=batch, **run_config(args, cfg, device, weights=weights, kind=kind,
                                                             compile_=compile_, ac=ac, peak=peak))
                fits[(kind, ac)] = batch
            except torch.OutOfMemoryError:
                oom = True
                entry["oom_at"].append(batch)
                if rank == 0:
                    print(f"{kind} compile={compile_} ac={ac}: out of memory at micro-batch {batch}; halving",
                          flush=True)
            except Exception as e:  # one configuration failing must not lose the others
                entry["error"] = f"{type(e).__name__}: {e}"[:2000]
                if rank == 0:
                    traceback.print_exc()
            release(device)  # the exception (and the models its traceback held) is gone by now
            if not oom:
                break
            batch //= 2
        spent[compile_] = time.perf_counter() - t0
        result["configs"].append(entry)
        if rank == 0:
            print_config(entry, flush_json=lambda: write(args.out, result))
    result["total_s"] = time.perf_counter() - t_begin
    if rank == 0:
        write(args.out, result)
        print(f"written to {args.out} ({result['total_s']:.0f} s)", flush=True)
    dist.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def write(path: Path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.replace(path)


def print_config(e: dict, *, flush_json) -> None:
    flush_json()
    head = f"{e['model']} compile={e['compile']} ac={e['activation_checkpointing']}"
    if "sides" not in e:
        why = e.get("error") or e.get("skipped") or "nothing fitted (out of memory at " + str(e["oom_at"]) + ")"
        print(f"{head}: {why}", flush=True)
        return
    s = e["sides"]
    pct = lambda v: f"{v * 100:.1f}%" if v is not None else "n/a"  # noqa: E731
    gib = lambda v: f"{v:.1f}" if v is not None else "n/a"  # noqa: E731
    print(f"{head}: micro-batch {e['micro_batch']}, {e['seconds']['total']:.0f} s "
          f"(build {e['seconds']['build']:.0f}, first+warm-up {e['seconds']['first_and_warmup']:.0f})", flush=True)
    for name in ("baseline", "fsdpkit"):
        x = s[name]
        print(f"  {name:8s} {x['median_tokens_per_s']:,.0f} tok/s "
              f"({x['min_tokens_per_s']:,.0f}-{x['max_tokens_per_s']:,.0f}) MFU {pct(x['median_mfu'])} peak "
              f"{gib(x['peak_mem_gib'])} GiB", flush=True)
    c = e["first_step_check"]
    print(f"  fsdpkit/baseline {e['ratio']:.4f}; first step loss {c['fsdpkit_loss']:.5f} vs {c['baseline_loss']:.5f}, "
          f"grad norm {c['fsdpkit_grad_norm']:.4f} vs {c['baseline_grad_norm']:.4f}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--models", default="ref,hf", help="comma-separated: ref (fsdpkit's Llama), hf (transformers')")
    p.add_argument("--batch", type=int, default=8, help="largest micro-batch to try (halved on out-of-memory)")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=2, help="optimizer steps per side per round")
    p.add_argument("--warmup", type=int, default=2, help="warm-up steps per side after the first step")
    p.add_argument("--budget-s", type=float, default=230.0,
                   help="skip a configuration that would not finish within this many seconds of the start")
    p.add_argument("--peak-tflops", type=float, default=None, help="the GPU's dense bf16 peak (default: from its name)")
    p.add_argument("--compile-backend", default="inductor",
                   help="torch.compile backend of both sides; with --cpu-smoke, anything but inductor (e.g. aot_eager) "
                        "adds the compiled configurations")
    p.add_argument("--cpu-smoke", action="store_true", help="gloo on the CPU, tiny shapes, no compile: the code runs")
    args = p.parse_args()
    if args.cpu_smoke:
        args.seq_len, args.batch = min(args.seq_len, 32), min(args.batch, 2)
        args.rounds, args.steps, args.warmup = min(args.rounds, 2), 1, 1
    if "RANK" not in os.environ:
        raise SystemExit("launch with: python -m torch.distributed.run --standalone --nproc-per-node 1 "
                         "bench/gpu_train.py [--cpu-smoke]")
    worker(args)


if __name__ == "__main__":
    main()
