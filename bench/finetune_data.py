"""Fine-tuning on data shaped like real chat corpora: packing that keeps documents apart, and the
chunked loss (issue 52). Writes bench/results/finetune_data.json and bench/RESULTS-data.md.

1. Throughput, 2 gloo ranks (torchrun, model=hf): trained tokens/s of data.packing=false (one
   conversation per sample), true (packed, each kept apart; its attention one document at a time,
   and again with transformers' block-diagonal mask: the A/B of per-document attention) and concat
   (run together), at seq 2048 and 4096, on a long-tailed chat corpus the bench generates (token
   counts drawn from a log-normal of median ~400 and mean ~900, p99 ~7k, as real conversation
   datasets). The four trainers live in one process group and take turns: rounds of --steps steps
   of each, the order reversed every other round, so that all meet the machine's load of the same
   minutes; a round's figure is its trained targets (the trainer's own count) over its wall time;
   figures are the median over rounds with the min-max. The padding share of each mode's samples
   comes from the data's own start-up report; the ceiling of packing's gain over one conversation
   per sample is the ratio of their sample counts (the same trained tokens in fewer samples), at
   the fill reached and at a 95% fill.
2. Loss memory, one process per case: the peak RSS added by the output projection, cross-entropy
   and backward of 2,048 tokens (hidden 256) at vocab 32k, 128k and 256k, full logits against the
   chunked loss, and the time of that step (median of 5, min-max).
3. The trainer at the issue's shape (vocab 131,072, seq 2,048, 2 ranks): the largest phase of
   fsdpkit's own "peak memory per phase" line at micro-batch 4, chunked (its own `fsdpkit train`
   launch); and the chunked loss against the full logits at micro-batch --full-micro (the full
   logits at micro-batch 4 need ~13 GB per rank, more than this machine has for two ranks), taking
   turns as in 1.

Usage: python bench/finetune_data.py [--conversations 3000] [--rounds 5] [--steps 4]
                                     [--only throughput|loss|trainer]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).parent
ROOT = HERE.parent
RESULTS = HERE / "results" / "finetune_data.json"
REPORT = HERE / "RESULTS-data.md"
WARMUP = 2
MODES = ("false", "true", "concat")
# The launches: each packing mode, and packing with transformers' block-diagonal mask instead of one
# document at a time (model.attn_implementation=sdpa): the A/B of per-document attention.
VARIANTS = {"false": ["data.packing=false"], "true": ["data.packing=true"],
            "true-masked": ["data.packing=true", "model.attn_implementation=sdpa"], "concat": ["data.packing=concat"]}
MODEL = ["experiment=hf_llama", "model.hf_config.max_position_embeddings=8192",  # hidden 128, 2 layers
         "policy.mixed_precision=fp32"]  # bf16 matmuls are slower than fp32 on this CPU
RUN = ["train.eval_samples=0", "train.progress=false", "checkpoint.every_steps=0", "checkpoint.save_at_end=false",
       "diagnostics.memory_steps=3", "optim.warmup_steps=1"]
SYLLABLES = ["ka", "lo", "mi", "ne", "ru", "ta", "shi", "po", "ve", "zu", "an", "el", "or", "is", "um", "de", "ga",
             "fi"]


# -- the corpus ------------------------------------------------------------------------------------------

def make_corpus(work: Path, n: int, *, seed: int = 0) -> tuple[Path, Path]:
    """`n` conversations (user and assistant turns) whose token counts follow a log-normal with median
    ~400 and mean ~900, and a BPE tokenizer (vocab 4,096) trained on them."""
    from fsdpkit.data.tokenizer import train_bpe_tokenizer

    rng = np.random.default_rng(seed)
    words = ["".join(rng.choice(SYLLABLES, size=rng.integers(1, 4))) for _ in range(3000)]
    zipf = 1 / np.arange(1, len(words) + 1)
    zipf /= zipf.sum()
    target = np.clip(rng.lognormal(np.log(400), 1.27, size=n), 24, 30_000)  # tokens per conversation
    rows = []
    for t in target:
        turns, n_words = [], max(8, int(t / 1.25))  # ~1.25 tokens per word with this tokenizer
        while n_words > 0:
            k = int(min(n_words, max(4, rng.lognormal(np.log(60), 0.8))))
            turns.append(" ".join(rng.choice(words, size=k, p=zipf)))
            n_words -= k
        if len(turns) % 2:
            turns.append(" ".join(rng.choice(words, size=8, p=zipf)))
        rows.append({"messages": [{"role": "user" if i % 2 == 0 else "assistant", "content": c}
                                  for i, c in enumerate(turns)]})
    corpus = work / "chats.jsonl"
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows))
    train_bpe_tokenizer([m["content"] for r in rows[:500] for m in r["messages"]], vocab_size=4096,
                        out_dir=work / "tokenizer")
    return corpus, work / "tokenizer"


def corpus_stats(data_args: list[str], seq_len: int) -> dict:
    """Token counts of the conversations, and each mode's samples and padding (the data's own report)."""
    from fsdpkit.config import compose_config
    from fsdpkit.data import build_datasets

    out: dict = {}
    for mode in MODES:
        cfg = compose_config([*MODEL, *data_args, f"data.seq_len={seq_len}", f"data.packing={mode}"])
        train, _ = build_datasets(cfg.data, vocab_size=4096, seed=0)
        r = train.report
        out[mode] = {"samples": r.samples, "trained_tokens": r.trained_tokens, "padding": r.padding,
                     "truncated": r.truncated}
        lengths = np.diff(train.corpus.offsets)
    out["lengths"] = {"median": float(np.median(lengths)), "mean": float(lengths.mean()),
                      "p99": float(np.percentile(lengths, 99)), "documents": int(len(lengths)),
                      "over_window": int((lengths > seq_len + 1).sum())}
    positions = out["true"]["samples"] * seq_len * (1 - out["true"]["padding"])  # filled input positions
    out["ceiling_at_fill"] = out["false"]["samples"] / out["true"]["samples"]
    out["ceiling_95"] = out["false"]["samples"] / (positions / (0.95 * seq_len))
    return out


# -- launches --------------------------------------------------------------------------------------------

def launch(args: list[str], work: Path, name: str, *, timeout: float = 3600) -> dict:
    """One `fsdpkit train --nproc 2` run: its per-step records and its peak-memory line."""
    run_dir = work / name
    cmd = [sys.executable, "-m", "fsdpkit", "train", "--nproc", "2", *args, f"run_dir={run_dir}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        return {"error": f"exit {proc.returncode}: {proc.stderr[-1500:]}"}
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "tokens_per_s" in r]
    measured = steps[WARMUP:]
    trained = sum(r["tokens_per_s"] * r["step_time_s"] for r in measured)  # the steps' trained tokens
    peak = re.search(r"peak memory per phase.*", proc.stderr)
    over_ranks = [float(x) for x in re.findall(r"max over ranks ([\d.]+)", peak.group(0))] if peak else []
    return {"tokens_per_s": trained / sum(r["step_time_s"] for r in measured), "first_loss": steps[0]["loss"],
            "peak_mib": max(over_ranks) if over_ranks else None, "peak_line": peak.group(0) if peak else None}


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def alternate(variants: dict[str, list[str]], *, common: list[str], work: Path, rounds: int, steps: int) -> dict:
    """Every variant's trainer built in one 2-rank process group (torchrun), then WARMUP steps each, then
    `rounds` rounds of `steps` steps of each variant in turn (the order reversed every other round), so that
    every variant meets the machine's load of the same minutes. Returns each variant's trained tokens/s per
    round (the trained targets of its steps over their wall time) and its first step's loss."""
    spec = work / f"alternate-{len(list(work.glob('alternate-*.json')))}.json"
    out = spec.with_suffix(".out.json")
    spec.write_text(json.dumps({"variants": variants, "common": common, "work": str(work), "rounds": rounds,
                                "steps": steps, "out": str(out)}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__,
           "--worker", str(spec)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        raise RuntimeError(f"the alternating trainers failed (exit {proc.returncode}): {proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def worker(spec_path: str) -> None:
    """torchrun's rank: see `alternate`."""
    import torch
    import torch.distributed as tdist

    from fsdpkit import dist
    from fsdpkit.config import compose_config
    from fsdpkit.train.run import build_trainer

    spec = json.loads(Path(spec_path).read_text())
    dist.init_process_group(backend="gloo")
    trainers = {}
    for name, extra in spec["variants"].items():
        cfg = compose_config([*spec["common"], *extra, f"run_dir={spec['work']}/{Path(spec_path).stem}-{name}"])
        Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
        trainers[name], _ = build_trainer(cfg, device=torch.device("cpu"), run_dir=Path(cfg.run_dir))

    def timed(trainer, n: int) -> tuple[float, float]:
        tdist.barrier()
        t0 = time.perf_counter()
        tokens = sum(r["tokens_per_s"] * r["step_time_s"] for r in (trainer.train_step() for _ in range(n)))
        tdist.barrier()
        return tokens, time.perf_counter() - t0

    first_loss = {name: t.train_step()["loss"] for name, t in trainers.items()}
    for t in trainers.values():
        timed(t, WARMUP - 1)
    per_round: dict[str, list[float]] = {name: [] for name in trainers}
    for r in range(spec["rounds"]):
        for name in list(trainers)[:: 1 if r % 2 == 0 else -1]:
            tokens, seconds = timed(trainers[name], spec["steps"])
            per_round[name].append(tokens / seconds)
    if dist.is_main():
        Path(spec["out"]).write_text(json.dumps({"tokens_per_s": per_round, "first_loss": first_loss}))
    trainers = None
    dist.shutdown()


def bench_throughput(args: argparse.Namespace, work: Path) -> dict:
    corpus, tok = make_corpus(work, args.conversations)
    data = ["data=hf", f"data.files=[{corpus}]", f"data.tokenizer={tok}", f"data.cache_dir={work / 'cache'}",
            "data.messages_field=messages", "data.overlong=truncate", "model.vocab_size=4096",
            "model.hf_config.vocab_size=4096"]
    out: dict = {}
    for seq in (2048, 4096):
        stats = corpus_stats(data, seq)
        got = alternate(VARIANTS, common=[*MODEL, *RUN, *data, f"data.seq_len={seq}", "train.micro_batch_size=2",
                                          "train.global_batch_size=8", "train.max_steps=1000"],
                        work=work, rounds=args.rounds, steps=args.steps)
        out[str(seq)] = {"stats": stats, "tokens_per_s": {m: summary(v) for m, v in got["tokens_per_s"].items()},
                         "first_loss": got["first_loss"]}
    return out


# -- the loss alone, one process per case ----------------------------------------------------------------

LOSS_CASE = r"""
import json, os, statistics, sys, time
import torch, torch.nn.functional as F
from fsdpkit.train.chunked_loss import linear_cross_entropy
vocab, chunked, tokens, hidden = int(sys.argv[1]), sys.argv[2] == "chunked", 2048, 256
torch.manual_seed(0)
h = torch.randn(tokens, hidden, requires_grad=True)
w = (torch.randn(vocab, hidden) * 0.02).requires_grad_()
t = torch.randint(0, vocab, (tokens,))
def rss(key):
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(key)) / 1024
def step():
    if chunked:
        loss = linear_cross_entropy(h, w, None, t)
    else:
        loss = F.cross_entropy(F.linear(h, w).float(), t, reduction="sum")
    loss.backward()  # into the gradients' buffers, which exist from the first step on
    h.grad.zero_(); w.grad.zero_()
step()  # allocator and kernels warm; the gradients' buffers are in the baseline below
base = rss("VmRSS:")
open("/proc/self/clear_refs", "w").write("5")
step()
peak = rss("VmHWM:") - base
times = []
for _ in range(5):
    t0 = time.perf_counter(); step(); times.append(time.perf_counter() - t0)
print(json.dumps({"peak_mib": peak, "seconds": times}))
"""


def bench_loss(args: argparse.Namespace) -> dict:
    out: dict = {}
    for vocab in (32_768, 131_072, 262_144):
        for way in ("full", "chunked"):
            proc = subprocess.run([sys.executable, "-c", LOSS_CASE, str(vocab), way], capture_output=True, text=True,
                                  env={**os.environ, "OMP_NUM_THREADS": "2"})
            if proc.returncode != 0:
                out[f"{vocab}/{way}"] = {"error": proc.stderr[-800:]}
                continue
            got = json.loads(proc.stdout.strip().splitlines()[-1])
            out[f"{vocab}/{way}"] = {"peak_mib": got["peak_mib"], "seconds": summary(got["seconds"])}
    return out


# -- the trainer at the shape --------------------------------------------------------------------

def bench_trainer(args: argparse.Namespace, work: Path) -> dict:
    shape = ["model.vocab_size=131072", "model.hidden_size=64", "model.intermediate_size=172", "data.seq_len=2048",
             "data.num_samples=256", "train.global_batch_size=8", *RUN]
    out = {"chunked_micro4": launch([*shape, "train.micro_batch_size=4", f"train.max_steps={WARMUP + 2}"], work,
                                    "trainer-chunked-4")}
    got = alternate({"chunked": ["train.chunked_loss=true"], "full": ["train.chunked_loss=false"]},
                    common=[*shape, f"train.micro_batch_size={args.full_micro}", "train.max_steps=1000"],
                    work=work, rounds=args.rounds, steps=max(1, args.steps // 4))
    out["ab"] = {"micro_batch": args.full_micro,
                 "tokens_per_s": {k: summary(v) for k, v in got["tokens_per_s"].items()},
                 "first_loss": got["first_loss"]}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--conversations", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=4, help="steps per round of each variant")
    p.add_argument("--full-micro", type=int, default=1, help="micro-batch of the chunked/full A/B in the trainer")
    p.add_argument("--only", choices=["throughput", "loss", "trainer"])
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args.worker)
    from finetune_data_report import render
    from results_md import publish

    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="fsdpkit-bench-ft-") as tmp:
        work = Path(tmp)
        data = {"args": vars(args)}
        if args.only in (None, "throughput"):
            data["throughput"] = bench_throughput(args, work)
        if args.only in (None, "loss"):
            data["loss"] = bench_loss(args)
        if args.only in (None, "trainer"):
            data["trainer"] = bench_trainer(args, work)
    data["minutes"] = (time.time() - t0) / 60
    data["markdown"] = render(data)
    publish(RESULTS, data)
    REPORT.write_text(data["markdown"])


if __name__ == "__main__":
    main()
