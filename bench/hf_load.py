"""Time to the first optimizer step, and peak RSS per rank, when training starts from a Hugging
Face model folder: fsdpkit (`model=hf model.path=DIR`) versus the loop a transformers user writes.

The folder (made once, cached in bench/.cache/hf_load/, not committed): a Llama-architecture model
with random weights, written in bf16 by transformers' own `save_pretrained` (full mode: hidden 1536,
16 layers, intermediate 4096, vocab 32000, untied head: 551M params, 1.03 GiB on disk).

Each run is a fresh `torchrun` launch of 2 gloo CPU ranks (OMP_NUM_THREADS=1) of one side:

- fsdpkit: compose_config(model=hf model.path=DIR ...), `build_trainer` (AutoConfig, model built on
  the meta device, fully_shard per decoder layer then the root, to_empty + buffers, each rank reads
  only its own rows of each safetensors tensor, fp32 masters, AdamW, data), one `trainer.train_step()`.
- baseline: `AutoModelForCausalLM.from_pretrained(DIR, dtype=torch.float32)` on every rank (the whole
  model on each), fully_shard per decoder layer then the root, AdamW (foreach), one step on a batch
  of the same shape (micro batch 1 x seq_len per rank, cross-entropy, clip_grad_norm_ 1.0).

Clock: the parent writes time.time() into BENCH_T0 just before it starts torchrun; each
rank's "launch -> first step" is time.time() at the end of its first optimizer step minus that
(so torchrun's start, the interpreter, the imports and the process group are all counted), and
the run's figure is the max over ranks. Each rank also records its phases (imports, process group,
build, load, optimizer + data, first step) and its peak RSS (getrusage ru_maxrss) after the load
and after the step. The folder's pages are evicted (posix_fadvise DONTNEED; on a VM the host may
still cache the disk) before every launch, so every run reads it cold-ish.

The sides alternate launch by launch, the order flipping every other pair (A B, B A, A B, ...).
Ceilings, measured in the same run: a plain sequential read of the folder's bytes in 16 MiB reads,
cold-ish (pages evicted first) and from the page cache, medians of 3 each.

Targets (issue: "time to first step <= baseline, peak RSS per rank <= model/2 + 512 MiB"): ratio
fsdpkit/baseline of the median launch -> first step <= 1.0; fsdpkit's peak RSS per rank (max over
ranks) <= model_bytes/2 + 512 MiB with model_bytes the fp32 size of the parameters (the masters are
fp32; the bf16 size on disk is shown beside it). The RSS target is checked on the peak through the
load (model built, sharded, loaded: what the target is about) and, as literally stated, on the
peak at the end of the first step, which also holds the gradients and AdamW's two moments (another
3 x model_bytes/2 per rank that no fp32 AdamW run avoids): both are reported, each met / NOT met.

Usage: python bench/hf_load.py [--runs 5] [--nproc 2] [--seq-len 128] [--quick]
rank 0 of each launch writes its ranks' figures to a temporary JSON; the parent prints a markdown
table and writes bench/results/hf_load.json (bench/results_md.py quotes its "markdown").
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

T_IMPORT = time.time()  # before `import torch`: what the imports cost is a phase of its own
import torch  # noqa: E402

HERE = Path(__file__).parent
RESULTS = HERE / "results" / "hf_load.json"
CACHE = HERE / ".cache" / "hf_load"
T0_ENV = "BENCH_T0"
CHUNK = 16 * 2**20
MiB = 2**20
SEQ_LEN = 128
FULL = {"hidden_size": 1536, "num_hidden_layers": 16, "intermediate_size": 4096, "vocab_size": 32000,
        "num_attention_heads": 12, "num_key_value_heads": 12}
QUICK = {"hidden_size": 512, "num_hidden_layers": 4, "intermediate_size": 1376, "vocab_size": 32000,
         "num_attention_heads": 8, "num_key_value_heads": 8}
SIDES = ("fsdpkit", "baseline")


# ---------------------------------------------------------------------------------------------
# the folder and the ceilings (parent process)


def make_folder(sizes: dict[str, int]) -> Path:
    """The cached Hugging Face folder for `sizes` (written by save_pretrained in bf16 once)."""
    name = "llama_" + "_".join(f"{v}" for v in sizes.values())
    folder = CACHE / name
    if (folder / "config.json").is_file():
        return folder
    from transformers import LlamaConfig, LlamaForCausalLM

    t0 = time.time()
    config = LlamaConfig(**sizes, max_position_embeddings=2048, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    tmp = folder.with_name(name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tmp.rename(folder)
    print(f"made {folder} in {time.time() - t0:.1f} s", flush=True)
    return folder


def folder_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file())


def evict(folder: Path) -> None:
    """Drop the folder's pages from the page cache (no root needed)."""
    for path in folder_files(folder):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_all(folder: Path, *, cold: bool) -> float:
    """Seconds for one plain sequential read of every file of the folder (16 MiB reads)."""
    if cold:
        evict(folder)
    buf = bytearray(CHUNK)
    t0 = time.perf_counter()
    for path in folder_files(folder):
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
    return time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------
# one rank of one launch


def rss_peak() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def fsdpkit_side(folder: Path, run_dir: Path, marks: dict[str, float]) -> dict:
    from fsdpkit import dist
    from fsdpkit.config import compose_config
    from fsdpkit.log import setup_logging
    from fsdpkit.train import run as fsdpkit_run
    from fsdpkit.train.determinism import seed_everything

    marks["imports"] = time.time()
    cfg = compose_config(["model=hf", f"model.path={folder}", "train.global_batch_size=2",
                          "train.micro_batch_size=1", f"data.seq_len={SEQ_LEN}", "train.max_steps=1",
                          "train.progress=false", "checkpoint.save_at_end=false", "diagnostics.enabled=false",
                          f"run_dir={run_dir}"])
    dist.init_process_group(backend="gloo")
    setup_logging("WARNING")
    seed_everything(cfg.seed, rank=dist.rank())
    run_dir.mkdir(parents=True, exist_ok=True)  # `fsdpkit train` makes it (check_directories) before the build
    marks["process_group"] = time.time()
    extra: dict = {}

    def timed(name, fn):  # the bench's own probes around build_trainer's pieces; no library change
        def wrapper(*a, **k):
            out = fn(*a, **k)
            marks[name] = time.time()
            if name == "load":
                extra["bytes_read"] = out["bytes_read"]
                extra["load_seconds_inside"] = out["seconds"]
                extra["rss_after_load"] = rss_peak()
            return out
        return wrapper

    fsdpkit_run.build_sharded_model = timed("build", fsdpkit_run.build_sharded_model)
    fsdpkit_run.load_hf_weights = timed("load", fsdpkit_run.load_hf_weights)
    trainer, _ = fsdpkit_run.build_trainer(cfg, device=torch.device("cpu"), run_dir=run_dir)
    marks["optimizer_data"] = time.time()
    record = trainer.train_step()
    marks["first_step"] = time.time()
    extra["loss"] = record["loss"]
    extra["params"] = sum(p.numel() for p in trainer.model.parameters())  # global sizes (DTensor)
    return extra


def baseline_side(folder: Path, marks: dict[str, float]) -> dict:
    import torch.distributed as tdist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    marks["imports"] = time.time()
    tdist.init_process_group(backend="gloo")
    rank, world = tdist.get_rank(), tdist.get_world_size()
    marks["process_group"] = time.time()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    marks["load"] = time.time()
    extra = {"rss_after_load": rss_peak()}
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    marks["build"] = time.time()  # here: the sharding of the loaded model
    extra["rss_after_load"] = max(extra["rss_after_load"], rss_peak())
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, foreach=True)
    g = torch.Generator().manual_seed(1234 + rank)
    batch = torch.randint(model.config.vocab_size, (1, SEQ_LEN + 1), generator=g)  # [micro 1, L + 1]
    marks["optimizer_data"] = time.time()
    logits = model(input_ids=batch[:, :-1]).logits  # [1, L, V]
    loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    marks["first_step"] = time.time()
    extra["loss"] = float(loss)
    extra["params"] = sum(p.numel() for p in model.parameters())
    return extra


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as tdist

    t0 = float(os.environ[T0_ENV])
    marks: dict[str, float] = {}
    folder = Path(args.folder)
    if args.side == "fsdpkit":
        extra = fsdpkit_side(folder, Path(args.run_dir), marks)
    else:
        extra = baseline_side(folder, marks)
    import psutil

    mine = {"start": psutil.Process().create_time() - t0, "import_torch_start": T_IMPORT - t0,
            **{k: v - t0 for k, v in marks.items()}, **extra, "rss_peak": rss_peak()}
    ranks = [None] * tdist.get_world_size()
    tdist.all_gather_object(ranks, mine)
    if tdist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(ranks))
    tdist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the measurement is over; skip the teardown of two models' worth of memory


# ---------------------------------------------------------------------------------------------
# the parent: launches, order, report


def launch(side: str, folder: Path, nproc: int, tmp: Path, i: int) -> list[dict]:
    """One fresh torchrun launch of `side` (the folder evicted first); its ranks' figures."""
    evict(folder)
    out = tmp / f"{side}_{i}.json"
    run_dir = tmp / f"run_{side}_{i}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", __file__,
           "--side", side, "--seq-len", str(SEQ_LEN), "--folder", str(folder), "--out", str(out), "--run-dir",
           str(run_dir)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", T0_ENV: repr(time.time())}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0 or not out.is_file():
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
        raise SystemExit(f"{side} launch {i} failed (exit {proc.returncode})")
    shutil.rmtree(run_dir, ignore_errors=True)
    return json.loads(out.read_text())


def med_range(values: list[float], fmt: str = "{:.2f}") -> str:
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}–{fmt.format(max(values))})"


PHASES = (  # (name, mark it ends at, mark it starts at)
    ("launch -> interpreter", "import_torch_start", None),
    ("imports", "imports", "import_torch_start"),
    ("process group", "process_group", "imports"),
    ("build (meta + fully_shard)", "build", "process_group"),
    ("load (per-rank rows)", "load", "build"),
    ("optimizer + data", "optimizer_data", "load"),
    ("first step", "first_step", "optimizer_data"),
)
BASELINE_PHASES = (
    ("launch -> interpreter", "import_torch_start", None),
    ("imports", "imports", "import_torch_start"),
    ("process group", "process_group", "imports"),
    ("load (from_pretrained, fp32)", "load", "process_group"),
    ("fully_shard", "build", "load"),
    ("optimizer + data", "optimizer_data", "build"),
    ("first step", "first_step", "optimizer_data"),
)


def phase_times(runs: list[list[dict]], phases) -> list[tuple[str, float]]:
    """Median over launches of each phase's length, max over ranks."""
    out = []
    for name, end, start in phases:
        per_run = [max(r[end] - (r[start] if start else 0.0) for r in ranks) for ranks in runs]
        out.append((name, statistics.median(per_run)))
    return out


def report(args, sizes, folder: Path, runs: dict[str, list[list[dict]]], ceil: dict, load_avg) -> None:
    disk_bytes = sum(p.stat().st_size for p in folder_files(folder))
    st_bytes = sum(p.stat().st_size for p in folder_files(folder) if p.suffix == ".safetensors")
    n_params = runs["fsdpkit"][0][0]["params"]
    model_bytes = 4 * n_params  # fp32 masters
    bound = model_bytes / 2 + 512 * MiB
    first = {s: [max(r["first_step"] for r in ranks) for ranks in runs[s]] for s in SIDES}
    load = {"fsdpkit": [max(r["load"] - r["build"] for r in ranks) for ranks in runs["fsdpkit"]],
            "baseline": [max(r["load"] - r["process_group"] for r in ranks) for ranks in runs["baseline"]]}
    ready = {s: [max(r["optimizer_data"] for r in ranks) for ranks in runs[s]] for s in SIDES}
    rss_load = {s: [max(r["rss_after_load"] for r in ranks) / MiB for ranks in runs[s]] for s in SIDES}
    rss_end = {s: [max(r["rss_peak"] for r in ranks) / MiB for ranks in runs[s]] for s in SIDES}
    med = {k: {s: statistics.median(v[s]) for s in SIDES} for k, v in
           {"first": first, "load": load, "ready": ready, "rss_load": rss_load, "rss_end": rss_end}.items()}
    ratio = med["first"]["fsdpkit"] / med["first"]["baseline"]
    paired = statistics.median(f / b for f, b in zip(first["fsdpkit"], first["baseline"], strict=True))
    targets = {
        "time_ratio": {"value": ratio, "bound": 1.0, "met": ratio <= 1.0},
        "rss_through_load_MiB": {"value": med["rss_load"]["fsdpkit"], "bound": bound / MiB,
                                 "met": max(rss_load["fsdpkit"]) <= bound / MiB},
        "rss_end_of_first_step_MiB": {"value": med["rss_end"]["fsdpkit"], "bound": bound / MiB,
                                      "met": max(rss_end["fsdpkit"]) <= bound / MiB},
    }
    cold, warm = statistics.median(ceil["cold_s"]), statistics.median(ceil["warm_s"])
    mark = {True: "met", False: "**NOT met**"}
    n = len(first["fsdpkit"])
    lines = [
        f"{args.nproc} gloo CPU ranks x 1 thread, {os.cpu_count()} CPUs (load {load_avg[0]:.2f} -> {load_avg[1]:.2f}), "
        f"torch {torch.__version__}; {n} fresh torchrun launches per side, alternating (A B, B A, A B, ...), "
        "the folder's pages evicted before each; medians (min–max)",
        f"folder: Llama {sizes['hidden_size']} hidden x {sizes['num_hidden_layers']} layers, intermediate "
        f"{sizes['intermediate_size']}, vocab {sizes['vocab_size']}, untied head, {n_params / 1e6:.1f}M params, "
        f"written by save_pretrained in bf16: {st_bytes / 2**30:.3f} GiB of safetensors ({disk_bytes / MiB:.0f} MiB in "
        f"all); model_bytes = fp32 size of the parameters = {model_bytes / 2**30:.3f} GiB",
        f"ceiling, a plain sequential read of the folder (16 MiB reads, medians of {len(ceil['cold_s'])}): cold-ish "
        f"(pages evicted) {cold:.2f} s = {disk_bytes / cold / 1e9:.2f} GB/s; from the page cache {warm:.2f} s = "
        f"{disk_bytes / warm / 1e9:.2f} GB/s",
        f"batch: 1 x {SEQ_LEN} tokens per rank (global batch 2), fp32, AdamW; clock from the parent's time.time() "
        "just before torchrun starts to the end of the first optimizer step, max over ranks",
        "",
        "| measure | fsdpkit | baseline (from_pretrained on every rank) | fsdpkit / baseline | target | met |",
        "|---|---|---|---|---|---|",
        f"| launch -> end of first step s | {med_range(first['fsdpkit'])} | {med_range(first['baseline'])} | "
        f"{ratio:.3f} (per-pair median {paired:.3f}) | <= 1.0 | {mark[targets['time_ratio']['met']]} |",
        f"| launch -> ready to step s | {med_range(ready['fsdpkit'])} | {med_range(ready['baseline'])} | "
        f"{med['ready']['fsdpkit'] / med['ready']['baseline']:.3f} | | |",
        f"| load phase s (fsdpkit: load_hf_weights; baseline: from_pretrained) | {med_range(load['fsdpkit'])} | "
        f"{med_range(load['baseline'])} | {med['load']['fsdpkit'] / med['load']['baseline']:.3f} | "
        f"(cold read of the folder {cold:.2f} s) | |",
        f"| peak RSS per rank through the load MiB (max over ranks) | {med_range(rss_load['fsdpkit'], '{:.0f}')} | "
        f"{med_range(rss_load['baseline'], '{:.0f}')} | {med['rss_load']['fsdpkit'] / med['rss_load']['baseline']:.3f} "
        f"| <= {bound / MiB:.0f} (model_bytes/2 + 512 MiB) | {mark[targets['rss_through_load_MiB']['met']]} |",
        f"| peak RSS per rank at the end of the first step MiB | {med_range(rss_end['fsdpkit'], '{:.0f}')} | "
        f"{med_range(rss_end['baseline'], '{:.0f}')} | {med['rss_end']['fsdpkit'] / med['rss_end']['baseline']:.3f} | "
        f"<= {bound / MiB:.0f} (as stated; AdamW's state alone is model_bytes per rank) | "
        f"{mark[targets['rss_end_of_first_step_MiB']['met']]} |",
        "",
        "phases (medians over launches of the max over ranks, s): "
        + "; ".join(f"{s}: " + ", ".join(f"{name} {t:.2f}" for name, t in phase_times(runs[s], ph))
                    for s, ph in (("fsdpkit", PHASES), ("baseline", BASELINE_PHASES))),
        f"fsdpkit's load read {statistics.median(r[0]['bytes_read'] for r in runs['fsdpkit']) / MiB:.0f} MiB on rank 0 "
        f"(its own rows); first-step loss fsdpkit {runs['fsdpkit'][0][0]['loss']:.3f}, baseline "
        f"{runs['baseline'][0][0]['loss']:.3f} (different batches, same shape)",
    ]
    result = {
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "torch": torch.__version__, "world_size": args.nproc, "loadavg_1min_before_after": load_avg},
        "quick": args.quick, "seq_len": SEQ_LEN, "sizes": sizes, "params": n_params, "model_bytes_fp32": model_bytes,
        "safetensors_bytes_bf16": st_bytes, "folder_bytes": disk_bytes, "rss_bound_bytes": bound,
        "ceiling_read_s": ceil, "runs": runs, "medians": med, "time_ratio": ratio, "paired_time_ratio": paired,
        "targets": targets,
        "phases": {s: dict(phase_times(runs[s], ph)) for s, ph in (("fsdpkit", PHASES), ("baseline", BASELINE_PHASES))},
    }
    result["markdown"] = "\n".join(lines)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print("\n".join([*lines, f"written to {RESULTS}"]), flush=True)


def main() -> None:
    global SEQ_LEN  # the ranks read it; set once from --seq-len
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=None, help="launches per side (default 5; --quick 1)")
    parser.add_argument("--nproc", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--seq-len", type=int, default=SEQ_LEN,
                        help=f"tokens per rank in the step (default {SEQ_LEN}); the step is the same work on both "
                             "sides")
    parser.add_argument("--quick", action="store_true", help="a 0.1 GiB model, one launch per side (smoke run)")
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)  # set in the ranks
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    SEQ_LEN = args.seq_len
    if "RANK" in os.environ:
        worker(args)
        return
    runs_per_side = args.runs or (1 if args.quick else 5)
    sizes = QUICK if args.quick else FULL
    folder = make_folder(sizes)
    load_avg = [os.getloadavg()[0]]
    ceil = {"cold_s": [], "warm_s": []}
    for _ in range(3):
        ceil["cold_s"].append(read_all(folder, cold=True))
        ceil["warm_s"].append(read_all(folder, cold=False))
    runs: dict[str, list[list[dict]]] = {s: [] for s in SIDES}
    with tempfile.TemporaryDirectory(prefix="hf_load_") as tmp:
        for i in range(runs_per_side):  # A B, B A, A B, ...
            for side in SIDES[:: 1 if i % 2 == 0 else -1]:
                ranks = launch(side, folder, args.nproc, Path(tmp), i)
                runs[side].append(ranks)
                print(f"run {i + 1} {side}: first step at {max(r['first_step'] for r in ranks):.2f} s, peak RSS "
                      f"{max(r['rss_peak'] for r in ranks) / MiB:.0f} MiB", flush=True)
    load_avg.append(os.getloadavg()[0])
    report(args, sizes, folder, runs, ceil, load_avg)


if __name__ == "__main__":
    main()
