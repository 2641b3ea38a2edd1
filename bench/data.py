"""The data path of data.kind=hf: tokenization throughput and training step time.

1. Tokenization (one process): fsdpkit's cache build (`datasets.load_dataset` + batched
   `Dataset.map` with the fast tokenizer + writing the flat token arrays) against the plain
   recipe with the same tokenizer, `load_dataset(...).map(lambda b: tok(b["text"]), batched=True)`,
   on the same jsonl corpus. Each run starts from empty caches (both sides convert the jsonl to
   Arrow and tokenize everything); the sides alternate, --runs runs each; tokens/s medians.
2. Step time (2 gloo ranks, one process group): two trainers on the same model config, one with
   data=synthetic and one with data=hf (packed documents, same seq_len and batch), alternating in
   rounds of --steps optimizer steps after warm-up; medians of the per-round mean step time.

Usage: python bench/data.py [--runs 5] [--rounds 5] [--steps 10] [--docs 20000] [--only tokenize|steps]
Writes bench/results/data.json and prints markdown tables.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "data.json"
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "finetune"))
from make_data import text_documents  # noqa: E402  (the example's document generator)

MODEL = ["model.hidden_size=256", "model.num_hidden_layers=4", "model.intermediate_size=688", "data.seq_len=96"]
WARMUP = 3


def make_corpus(work: Path, docs: int) -> tuple[Path, Path]:
    """A jsonl corpus of `docs` documents and a BPE tokenizer (vocab 512) trained on part of it."""
    from fsdpkit.data.tokenizer import train_bpe_tokenizer

    rows = text_documents(docs, random.Random(0))
    corpus = work / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows))
    train_bpe_tokenizer([r["text"] for r in rows[:2000]], vocab_size=512, out_dir=work / "tokenizer")
    return corpus, work / "tokenizer"


def bench_tokenize(args: argparse.Namespace, work: Path, corpus: Path, tok_dir: Path) -> dict:
    import datasets

    from fsdpkit.data.token_cache import TokenizeSpec, tokenized_corpus
    from fsdpkit.data.tokenizer import load_tokenizer, tokenizer_fingerprint

    datasets.disable_progress_bars()
    tok = load_tokenizer(str(tok_dir))
    spec = TokenizeSpec(files=(str(corpus),), builder="json", text_field="text", messages_field="")

    def fsdpkit_side(cache: Path) -> int:
        got = tokenized_corpus(spec, tok, tokenizer_fingerprint=tokenizer_fingerprint(tok), cache_dir=str(cache),
                               num_proc=args.num_proc)
        assert got.built
        return int(got.info["tokens"])

    def plain_side(cache: Path) -> int:
        ds = datasets.load_dataset("json", data_files=str(corpus), split="train", cache_dir=str(cache))
        mapped = ds.map(lambda b: tok(b["text"], add_special_tokens=False), batched=True,
                        num_proc=args.num_proc if args.num_proc > 1 else None)
        return sum(len(x) for x in mapped["input_ids"]) + len(mapped)  # + one EOS per document, as fsdpkit adds

    sides = {"datasets.map": plain_side, "fsdpkit": fsdpkit_side}
    per_run: dict[str, list[float]] = {name: [] for name in sides}
    tokens = {}
    for r in range(args.runs):
        for name in list(sides)[:: 1 if r % 2 == 0 else -1]:
            cache = work / f"cache-{name}-{r}"
            t0 = time.perf_counter()
            tokens[name] = sides[name](cache)
            per_run[name].append(tokens[name] / (time.perf_counter() - t0))
            shutil.rmtree(cache, ignore_errors=True)
    assert tokens["fsdpkit"] == tokens["datasets.map"], tokens  # the same tokens on both sides
    med = {k: statistics.median(v) for k, v in per_run.items()}
    return {"tokens": tokens["fsdpkit"], "documents": args.docs, "num_proc": args.num_proc, "tokens_per_s": per_run,
            "median_tokens_per_s": med, "ratio": med["fsdpkit"] / med["datasets.map"]}


def step_worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as tdist

    from fsdpkit import dist
    from fsdpkit.config import compose_config
    from fsdpkit.train.run import build_trainer

    total = 1 + WARMUP + args.rounds * args.steps
    common = ["experiment=demo", "train.progress=false", "train.eval_every=0", f"train.max_steps={total}",
              "log_level=WARNING", "diagnostics.enabled=false", *MODEL]
    hf = ["data=hf", f"data.files=[{args.corpus}]", f"data.tokenizer={args.tokenizer}", f"data.cache_dir={args.cache}"]
    dist.init_process_group(backend="gloo")
    trainers = {}
    for name, extra in (("synthetic", []), ("hf", hf)):
        cfg = compose_config([*common, *extra, f"run_dir={args.work}/{name}"])
        Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
        trainers[name], _ = build_trainer(cfg, device=torch.device("cpu"), run_dir=Path(cfg.run_dir))

    def timed(trainer, steps: int) -> float:
        tdist.barrier()
        t0 = time.perf_counter()
        for _ in range(steps):
            trainer.train_step()
        tdist.barrier()
        return (time.perf_counter() - t0) / steps

    def data_time(trainer, batches: int = 20) -> float:
        """Seconds per step spent producing this rank's micro-batches and the global target count
        (what the data path adds to a step), timed alone."""
        t0 = time.perf_counter()
        for i in range(batches):
            indices = list(range(i * 16, (i + 1) * 16))
            trainer.train_data.target_count(indices)
            for j in range(0, 8, trainer.micro_batch_size):
                trainer.train_data.labeled_batch(indices[j : j + trainer.micro_batch_size])
        return (time.perf_counter() - t0) / batches

    for t in trainers.values():
        timed(t, WARMUP)
    per_round: dict[str, list[float]] = {name: [] for name in trainers}
    for r in range(args.rounds):
        for name in list(trainers)[:: 1 if r % 2 == 0 else -1]:
            per_round[name].append(timed(trainers[name], args.steps))
    if dist.is_main():
        med = {k: statistics.median(v) for k, v in per_round.items()}
        paired = statistics.median(h / s for s, h in zip(per_round["synthetic"], per_round["hf"], strict=True))
        Path(args.out).write_text(json.dumps({"overrides": MODEL, "world_size": dist.world_size(),
                                              "step_time_s": per_round, "median_step_time_s": med,
                                              "ratio": med["hf"] / med["synthetic"], "median_round_ratio": paired,
                                              "data_s_per_step": {k: data_time(t) for k, t in trainers.items()}}))
    trainers = None
    dist.shutdown()
    os._exit(0)


def bench_steps(args: argparse.Namespace, work: Path, corpus: Path, tok_dir: Path) -> dict:
    out = work / "steps.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}", __file__,
           "--worker", "--rounds", str(args.rounds), "--steps", str(args.steps), "--corpus", str(corpus),
           "--tokenizer", str(tok_dir), "--cache", str(work / "step-cache"), "--work", str(work), "--out", str(out)]
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.loads(out.read_text())


def print_table(title: str, header: tuple[str, str, str], per_run: dict[str, list[float]], medians: dict[str, float],
                fmt: str, verdict: str) -> str:
    """A markdown table: one row per run or round, the two sides side by side, then the medians (printed, returned)."""
    a, b = per_run
    lines = [f"{title}:", "", f"| {' | '.join(header)} |", "|---|---|---|"]
    lines += [f"| {i + 1} | {fmt.format(x)} | {fmt.format(y)} "
              "|" for i, (x, y) in enumerate(zip(per_run[a], per_run[b], strict=True))]
    lines += [f"| **median** | **{fmt.format(medians[a])}** | **{fmt.format(medians[b])}** |", "", verdict, ""]
    print("\n".join(lines), flush=True)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="tokenization runs per side (default 5)")
    parser.add_argument("--docs", type=int, default=20000, help="documents in the tokenization corpus")
    parser.add_argument("--num-proc", type=int, default=1, help="tokenizing processes on both sides (default 1)")
    parser.add_argument("--nproc", type=int, default=2, help="ranks for the step-time part")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per side (default 5)")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per round (default 10)")
    parser.add_argument("--only", choices=["tokenize", "steps"], default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for hidden in ("--corpus", "--tokenizer", "--cache", "--work", "--out"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        step_worker(args)
        return
    work = Path(tempfile.mkdtemp(prefix="fsdpkit-bench-data-"))
    try:
        corpus, tok_dir = make_corpus(work, args.docs)
        result = {"loadavg_1min_before": os.getloadavg()[0], "cpu_count": os.cpu_count()}
        if args.only in (None, "tokenize"):
            result["tokenize"] = t = bench_tokenize(args, work, corpus, tok_dir)
            result["markdown"] = print_table(f"tokenization, {t['documents']} documents, {t['tokens']:,} tokens, "
                                             f"num_proc={t['num_proc']}, "
                        f"{args.runs} runs each", ("run", "datasets.map tok/s", "fsdpkit tok/s"),
                        t["tokens_per_s"], t["median_tokens_per_s"], "{:,.0f}",
                        f"fsdpkit / datasets.map: {t['ratio']:.3f}x (target >= 1)")
        if args.only in (None, "steps"):
            result["steps"] = s = bench_steps(args, work, corpus, tok_dir)
            result["markdown"] = result.get("markdown",
                                            "") + print_table(f"step time, {s['world_size']} gloo ranks, "
                                                              f"{' '.join(s['overrides'])}, {args.rounds} rounds x "
                        f"{args.steps} steps", ("round", "synthetic s/step", "hf s/step"), s["step_time_s"],
                        s["median_step_time_s"], "{:.4f}",
                        f"hf / synthetic: {s['ratio']:.3f}x of the medians, {s['median_round_ratio']:.3f}x the median "
                        f"per-round ratio (target <= 1.05); the data path alone per step and rank: hf "
                        f"{s['data_s_per_step']['hf'] * 1e3:.2f} ms, synthetic "
                        f"{s['data_s_per_step']['synthetic'] * 1e3:.2f} ms")
        result["loadavg_1min_after"] = os.getloadavg()[0]
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps(result, indent=2) + "\n")
        print(f"written to {RESULTS}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
