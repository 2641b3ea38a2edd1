"""Streaming export (`fsdpkit ckpt export`) versus the usual recipes, on a synthetic checkpoint.

1. Writes a Llama-shaped fp32 checkpoint of `--size-gib` with `dcp.save` from 2 gloo ranks
   (every weight a DTensor sharded on dim 0, as FSDP2 saves it), model weights only.
2. Measures this machine's disk ceilings in the same run: sequential write + fsync, a cold
   sequential read (the file's pages evicted first with posix_fadvise(DONTNEED)), and a copy: the
   same bytes read cold and written with fsync, which is what an export on one disk does. Before
   the runs, one stream each (a reader thread feeding the writer, and one thread reading then
   writing each 16 MiB, as dd), through the page cache (a new descriptor per 16 MiB read,
   256 KiB write calls: bench/raw_io.py) and with O_DIRECT; and in the rotation with the runs
   (drift hits both alike), the checkpoint's own files read, written and copied with the export's
   own parallelism (FSDPKIT_EXPORT_READ_AHEAD read threads, one writer), O_DIRECT where the file
   system takes it. Each
   ceiling is the fastest of these. Where reads and writes share the disk's budget, a copy moves
   about as many bytes per second (reads and writes together) as reading or writing alone, and no
   export beats the copy: the ratio to it is shown beside the target's, with the copy's reads +
   writes per second over the faster of the two alone. Code: bench/export_ceilings.py.
3. Runs each variant `--reps` times, in its own subprocess (peak RSS = the child's ru_maxrss),
   the checkpoint evicted from the page cache before every run, outputs fsynced:
     fsdpkit        export_checkpoint(...) fp32 (byte-range reader, FSDPKIT_EXPORT_READ_AHEAD read threads,
                    pread and ordinary writes through the page cache)
     fsdpkit-bf16   the same with dtype=bf16
     fsdpkit-dcp    export_checkpoint(..., reader="dcp"): one dcp.load per tensor
     baseline       dcp_to_torch_save -> torch.load(mmap=True, weights_only=True) -> safetensors.save_file
     accelerate     accelerate.utils.merge_fsdp_weights (only if accelerate is installed)
4. Runs fsdpkit and the baseline once more under an address-space limit (RLIMIT_AS = what the
   child has mapped after its imports + `--rlimit-gib`), smaller than the checkpoint: the
   streaming export completes, the baseline cannot.

Targets (issue 15, item 9): peak RSS <= 0.1 x model size + 512 MiB; throughput (model bytes / s)
>= 0.8 x min(disk read, disk write), and >= 0.8 x the copy ceiling. Prints a markdown table;
writes JSON to `--json`.

Usage: python bench/export.py [--size-gib 2.0] [--reps 5] [--rlimit-gib 0.5] [--work DIR] [--keep]
The defaults took about 6 minutes on this 2-core machine.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from export_ceilings import direct_ok, disk_ceilings, evict, parallel_seconds
from fsdpkit import tunables

RESULTS = Path(__file__).parent / "results" / "export.json"
HIDDEN, INTERMEDIATE, VOCAB, KV = 2048, 5632, 32000, 512
VARIANTS = ("fsdpkit", "fsdpkit-bf16", "fsdpkit-dcp", "baseline", "accelerate")
EXPORT_WRITERS = 1  # the export writes its output on one thread
MIB, GIB = 2**20, 2**30


def layer_shapes(layers: int) -> dict[str, tuple[int, ...]]:
    """A Llama-like set of weights (HF names)."""
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (HIDDEN, HIDDEN), p + "self_attn.k_proj.weight": (KV, HIDDEN),
                   p + "self_attn.v_proj.weight": (KV, HIDDEN), p + "self_attn.o_proj.weight": (HIDDEN, HIDDEN),
                   p + "mlp.gate_proj.weight": (INTERMEDIATE, HIDDEN), p + "mlp.up_proj.weight": (INTERMEDIATE, HIDDEN),
                   p + "mlp.down_proj.weight": (HIDDEN, INTERMEDIATE), p + "input_layernorm.weight": (HIDDEN,),
                   p + "post_attention_layernorm.weight": (HIDDEN,)}
    return shapes | {"model.norm.weight": (HIDDEN,), "lm_head.weight": (VOCAB, HIDDEN)}


def shapes_for(size_gib: float) -> dict[str, tuple[int, ...]]:
    """The fewest layers whose fp32 weights reach `size_gib`."""
    layers = 0
    while sum(math.prod(s) * 4 for s in layer_shapes(layers).values()) < size_gib * GIB:
        layers += 1
    return layer_shapes(layers)


# ---- the synthetic checkpoint --------------------------------------------------------------------

def _write_rank(rank: int, ckpt: str, port: int, size_gib: float) -> None:
    import torch
    import torch.distributed as tdist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    state = {}
    for i, (name, shape) in enumerate(shapes_for(size_gib).items()):
        rows = shape[0] // 2
        g = torch.Generator().manual_seed(1000 * i + rank)
        local = torch.randn((rows, *shape[1:]), generator=g)
        state[name] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)  # even split: shape inferred
    dcp.save({"model": state}, checkpoint_id=ckpt)
    tdist.barrier()
    tdist.destroy_process_group()


def write_checkpoint(ckpt: Path, size_gib: float) -> float:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.perf_counter()
    mp.start_processes(_write_rank, args=(str(ckpt), port, size_gib), nprocs=2, start_method="spawn")
    return time.perf_counter() - t0


# ---- one variant, in a child process -------------------------------------------------------------

def _vm_size() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def _fsync_tree(path: Path) -> None:
    for file in [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]:
        fd = os.open(file, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


def child(variant: str, ckpt: Path, out: Path, rlimit_extra: int | None) -> dict:
    import torch  # noqa: F401  (imported before the clock and the limit: every variant pays it)

    from fsdpkit.export.exporter import export_checkpoint

    if variant == "accelerate":
        from accelerate.utils import merge_fsdp_weights
    else:
        from safetensors.torch import save_file
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    rss_after_import = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if rlimit_extra is not None:
        limit = _vm_size() + rlimit_extra
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    t0 = time.perf_counter()
    try:
        if variant.startswith("fsdpkit"):
            export_checkpoint(ckpt, out, dtype="bf16" if variant == "fsdpkit-bf16" else None,
                              reader="dcp" if variant == "fsdpkit-dcp" else "direct")
        elif variant == "baseline":
            out.mkdir()
            dcp_to_torch_save(ckpt, out / "full.pt")
            state = torch.load(out / "full.pt", mmap=True, weights_only=True)["model"]
            save_file(state, out / "model.safetensors", metadata={"format": "pt"})
            del state
            (out / "full.pt").unlink()
            _fsync_tree(out)
        else:
            merge_fsdp_weights(str(ckpt), str(out), safe_serialization=True)
            _fsync_tree(out)
        error = None
    except BaseException as exc:  # MemoryError, RuntimeError (allocator), DCP's CheckpointException
        inner = next(iter(getattr(exc, "failures", {}).values()), (exc,))[0]  # DCP wraps the real error
        text = str(inner).strip().splitlines()
        error = (f"{type(exc).__name__}" + (f" wrapping {type(inner).__name__}" if inner is not exc else "")
                 + f": {text[0][:160] if text else ''}")
    seconds = time.perf_counter() - t0
    return {"ok": error is None, "error": error, "seconds": seconds,
            "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "rss_after_import": rss_after_import}


def run_child(variant: str, ckpt: Path, out: Path, *, rlimit_extra: int | None = None) -> dict:
    evict(ckpt)
    cmd = [sys.executable, __file__, "--_child", variant, "--_ckpt", str(ckpt), "--_out", str(out)]
    if rlimit_extra is not None:
        cmd += ["--_rlimit", str(rlimit_extra)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    shutil.rmtree(out, ignore_errors=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if not lines:
        return {"ok": False, "error": f"exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:] or ''}",
                "seconds": None, "peak_rss": None, "rss_after_import": None}
    return json.loads(lines[-1])


# ---- report --------------------------------------------------------------------------------------

def summarize(runs: list[dict], *, model_bytes: int, ceiling: float, copy: float) -> dict:
    ok = [r for r in runs if r["ok"]]
    if not ok:
        return {"ok": False, "error": runs[0]["error"] if runs else "not run", "runs": runs}
    seconds = statistics.median(r["seconds"] for r in ok)
    rss = max(r["peak_rss"] for r in ok)
    gbps = model_bytes / seconds / 1e9
    return {"ok": True, "median_s": seconds, "gb_per_s": gbps, "of_disk_ceiling": gbps / ceiling,
            "of_copy_ceiling": gbps / copy, "peak_rss": rss,
            "rss_over_model": rss / model_bytes,
            "rss_after_import": statistics.median(r["rss_after_import"] for r in ok),
            "runs": runs}


def markdown(result: dict) -> str:
    mb, disk = result["model_bytes"], result["disk"]
    ceiling = min(disk["write_fsync_gb_s"], disk["read_cold_gb_s"])
    rss_target = 0.1 * mb + 512 * MIB
    par = disk["parallel"]
    shared = 2 * disk["copy_gb_s"] / max(disk["write_fsync_gb_s"], disk["read_cold_gb_s"])
    lines = [f"model: {mb / GIB:.2f} GiB fp32, {result['tensors']} tensors, written by dcp.save from 2 gloo ranks "
             f"(in {result['write_s']:.1f} s); {result['reps']} runs each, medians; checkpoint evicted from the page "
             "cache before each run",
             "disk ceilings (medians), measured two ways, the faster counting: before the runs, one stream, through "
             "the page cache and with O_DIRECT ("
             + ", ".join(f"{k.replace('_', ' ')} {v:.2f}" for k, v in disk["medians"].items())
             + "); in the rotation with the runs, the checkpoint's own files with the export's parallelism "
               f"({par['readers']} "
             f"read threads, {par['writers']} write threads, 16 MiB blocks{', O_DIRECT' if par['direct'] else ''}): "
             + ", ".join(f"{k} {v:.2f}" for k, v in par["medians"].items()) + " GB/s",
             f"ceilings: write+fsync {disk['write_fsync_gb_s']:.2f} GB/s, cold read {disk['read_cold_gb_s']:.2f} GB/s "
             f"-> min {ceiling:.2f} GB/s; copy (read cold and written with fsync at once: what an export does) "
             f"{disk['copy_gb_s']:.2f} GB/s = {disk['copy_gb_s'] / ceiling:.2f} x min: the copy moves "
             f"{2 * disk['copy_gb_s']:.2f} GB/s of reads and writes together, {shared:.2f} x the faster of reading or "
             "writing alone"
             + (" (the copy, an export's ceiling, stays below 0.8 x min on this disk)"
                if disk["copy_gb_s"] < 0.8 * ceiling else ""),
             f"targets: throughput >= {0.8 * ceiling:.2f} GB/s (0.8 x min, issue 15) and >= "
             f"{0.8 * disk['copy_gb_s']:.2f} GB/s (0.8 x copy), peak RSS <= {rss_target / MIB:.0f} MiB (0.1 x model + "
             "512 MiB)",
             "",
             "| variant | median s | GB/s | x min(disk) | x copy | peak RSS MiB | RSS / model | RSS target | speed "
             "target (x min) | speed target (x copy) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name in VARIANTS:
        s = result["variants"].get(name)
        if s is None:
            continue
        if not s["ok"]:
            lines.append(f"| {name} | - | - | - | - | - | - | - | - | {s['error']} |")
            continue
        lines.append(f"| {name} | {s['median_s']:.2f} | {s['gb_per_s']:.3f} | {s['of_disk_ceiling']:.2f} | "
                     f"{s['of_copy_ceiling']:.2f} | {s['peak_rss'] / MIB:.0f} | "
                     f"{s['rss_over_model']:.2f} | {'yes' if s['peak_rss'] <= rss_target else 'no'} | "
                     f"{'yes' if s['of_disk_ceiling'] >= 0.8 else 'no'} | "
                     f"{'yes' if s['of_copy_ceiling'] >= 0.8 else 'no'} |")
    lines.append("")
    lines.append(f"GB/s = model bytes read / wall time (bf16 writes half as many bytes). RSS after imports alone: "
                 f"{result['variants']['fsdpkit']['rss_after_import'] / MIB:.0f} MiB.")
    if result.get("accelerate") is not None:
        lines.append(result["accelerate"])
    lim = result.get("rlimit")
    if lim:
        lines.append("")
        lines.append(f"address-space limit: imports + {lim['extra_bytes'] / GIB:.2f} GiB (checkpoint {mb / GIB:.2f} "
                     "GiB):")
        for name, r in lim["runs"].items():
            text = (f"completed in {r['seconds']:.2f} s, peak RSS {r['peak_rss'] / MIB:.0f} MiB" if r["ok"]
                    else f"failed: {r['error']}")
            lines.append(f"- {name}: {text}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gib", type=float, default=2.0,
                        help="size of the synthetic fp32 checkpoint (default 2.0)")
    parser.add_argument("--reps", type=int, default=5, help="runs per variant; medians are reported (default 5)")
    parser.add_argument("--rlimit-gib", type=float, default=0.5,
                        help="address space allowed beyond the imports in the RLIMIT_AS runs (default 0.5; 0 skips "
                             "them)")
    parser.add_argument("--disk-probe-gib", type=float, default=1.0,
                        help="size of the disk-ceiling probe file (default 1.0)")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma-separated subset of {', '.join(VARIANTS)}")
    parser.add_argument("--work", default=None,
                        help="directory for the checkpoint and outputs (default: a new temporary one)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument("--json", default=str(RESULTS), help=f"where to write the results (default {RESULTS})")
    parser.add_argument("--_child", help=argparse.SUPPRESS)
    parser.add_argument("--_ckpt", help=argparse.SUPPRESS)
    parser.add_argument("--_out", help=argparse.SUPPRESS)
    parser.add_argument("--_rlimit", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._child:
        print(json.dumps(child(args._child, Path(args._ckpt), Path(args._out), args._rlimit)))
        return

    work = Path(args.work or tempfile.mkdtemp(prefix="fsdpkit-bench-export-"))
    work.mkdir(parents=True, exist_ok=True)
    ckpt = work / "ckpt"
    try:
        shapes = shapes_for(args.size_gib)
        model_bytes = sum(math.prod(s) * 4 for s in shapes.values())
        print(f"writing a {model_bytes / GIB:.2f} GiB checkpoint ({len(shapes)} tensors) to {ckpt} ...", flush=True)
        write_s = write_checkpoint(ckpt, args.size_gib)
        print("measuring disk ceilings ...", flush=True)
        disk = disk_ceilings(work, nbytes=int(args.disk_probe_gib * GIB) // (16 * MIB) * 16 * MIB, reps=args.reps)
        wanted = [v for v in args.variants.split(",") if v]
        has_accelerate = importlib.util.find_spec("accelerate") is not None
        runs: dict[str, list[dict]] = {v: [] for v in wanted if v != "accelerate" or has_accelerate}
        sources = sorted(ckpt.glob("*.distcp"))
        data_bytes = sum(p.stat().st_size for p in sources)
        raw: dict[str, list[float]] = {"read": [], "write": [], "copy": []}
        direct = direct_ok(work)
        tuned = tunables.current()
        for rep in range(args.reps):  # interleaved, so that drift in the disk hits every variant alike
            for name in runs:
                r = run_child(name, ckpt, work / f"out_{name}")
                runs[name].append(r)
                print(f"  run {rep + 1}/{args.reps} {name}: " + (f"{r['seconds']:.2f} s, peak RSS "
                                                                 f"{r['peak_rss'] / MIB:.0f} MiB"
                                                             if r["ok"] else r["error"]), flush=True)
            for kind, src, dst in (("read", sources, None), ("write", [], work / "raw_write.bin"),
                                   ("copy", sources, work / "raw_copy.bin")):
                seconds = parallel_seconds(src, dst, nbytes=data_bytes, readers=tuned.export_read_ahead,
                                           writers=EXPORT_WRITERS, direct=direct)
                raw[kind].append(data_bytes / seconds / 1e9)
            print(f"  run {rep + 1}/{args.reps} raw at the export's parallelism: "
                  + ", ".join(f"{k} {v[-1]:.2f} GB/s" for k, v in raw.items()), flush=True)
        disk["parallel"] = {"readers": tuned.export_read_ahead, "writers": EXPORT_WRITERS,
                            "direct": direct, "bytes": data_bytes,
                            "runs": raw, "medians": {k: statistics.median(v) for k, v in raw.items()}}
        for kind, key in (("write", "write_fsync_gb_s"), ("read", "read_cold_gb_s"), ("copy", "copy_gb_s")):
            disk[key] = max(disk[key], disk["parallel"]["medians"][kind])  # the faster way is the ceiling
        ceiling = min(disk["write_fsync_gb_s"], disk["read_cold_gb_s"])
        result = {
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
            "model_bytes": model_bytes, "tensors": len(shapes), "reps": args.reps, "write_s": write_s, "disk": disk,
            "variants": {name: summarize(r, model_bytes=model_bytes, ceiling=ceiling, copy=disk["copy_gb_s"])
                         for name, r in runs.items()},
            "accelerate": None if has_accelerate else "accelerate is not installed here: merge_fsdp_weights was not "
                                                      "run (pip install accelerate to add it to the table)",
        }
        if args.rlimit_gib > 0:
            extra = int(args.rlimit_gib * GIB)
            print(f"runs under RLIMIT_AS = imports + {args.rlimit_gib} GiB ...", flush=True)
            result["rlimit"] = {"extra_bytes": extra, "runs": {
                name: run_child(name, ckpt, work / f"out_{name}_rlimit", rlimit_extra=extra)
                for name in ("fsdpkit", "baseline")}}
        text = markdown(result)
        print()
        print(text)
        result["markdown"] = text
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        print(f"\nresults: {args.json}")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
