"""B10: frozen weights written once. A LoRA-shaped state on 2 gloo ranks: a frozen base of ~1 GiB
(16 fp32 Linear 4096x4096 layers, requires_grad=False, not in the optimizer) and rank-8 adapters
on each (with AdamW state: ~12 MiB), FSDP2-sharded per layer.

Two Checkpointers save the same state at every step, side by side in the same run: one with
checkpoint.share_frozen (the default: the base goes to shared/ once, later checkpoints reference
it) and one with share_frozen=false (every checkpoint holds every tensor: a full save). Between
saves an AdamW step changes the adapters. Per save: wall time of the save call on rank 0 (after a
barrier) and the bytes it wrote (its checkpoint's files, plus a shared directory it created).
Medians and min-max of the saves after the first. Then a fresh model resumes the shared run's
last checkpoint (every local tensor compared with torch.equal) and `verify_checkpoint` checks it,
shared files included. Target (issue 36): a later save's bytes and time <= 3% of a full save's.

Usage: python bench/frozen.py [--repeats 5] [--layers 16]
Writes bench/results/frozen.json (markdown included; results_md.py quotes it as B10).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
RESULTS = HERE / "results" / "frozen.json"
WIDTH, RANK = 4096, 8


def _spread(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as tdist
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from fsdpkit.checkpoint.manager import Checkpointer

    tdist.init_process_group("gloo", rank=args.rank, world_size=2, init_method=f"tcp://127.0.0.1:{args.port}")

    class Layer(nn.Module):
        def __init__(self, base: bool) -> None:
            super().__init__()
            self.base = nn.Linear(WIDTH, WIDTH, bias=False) if base else None
            self.lora_a = nn.Linear(WIDTH, RANK, bias=False)
            self.lora_b = nn.Linear(RANK, WIDTH, bias=False)

    def build(seed: int, *, base: bool = True) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = nn.Sequential(*(Layer(base) for _ in range(args.layers)))
        for layer in model:
            if base:
                layer.base.requires_grad_(False)
            fully_shard(layer)
        fully_shard(model)
        return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)

    def step(opt: torch.optim.Optimizer) -> None:
        for group in opt.param_groups:
            for p in group["params"]:
                p.grad = torch.full_like(p, 1e-3)
        opt.step()
        opt.zero_grad()

    def local(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
        tensors = [p.to_local().clone() for p in model.parameters()]
        return tensors + [v.to_local().clone() if hasattr(v, "to_local") else v.clone()
                          for s in opt.state.values() for v in s.values()]

    root = Path(args.dir)
    model, opt = build(0)
    floor_model, floor_opt = build(0, base=False)  # the adapters alone: what any save of them costs here
    runs = {"shared": Checkpointer(root / "shared_run", model=model, optimizer=opt, keep_last=2),
            "full": Checkpointer(root / "full_run", model=model, optimizer=opt, keep_last=2, share_frozen=False),
            "adapters": Checkpointer(root / "adapters_run", model=floor_model, optimizer=floor_opt, keep_last=2)}
    for ck in runs.values():
        ck.resume()
    saves: dict[str, list[dict[str, Any]]] = {name: [] for name in runs}
    for n in range(1, args.repeats + 2):
        step(opt)
        step(floor_opt)
        for name, ck in runs.items():
            before = set((root / f"{name}_run" / "shared").glob("*"))
            tdist.barrier()
            t0 = time.perf_counter()
            path = ck.save(n)
            seconds = time.perf_counter() - t0
            if args.rank == 0:
                manifest = json.loads((path / "manifest.json").read_text())
                written = sum(f["size"] for f in manifest["files"].values())
                new = set((root / f"{name}_run" / "shared").glob("*")) - before
                written += sum(f.stat().st_size for d in new for f in d.iterdir())
                saves[name].append({"step": n, "seconds": seconds, "bytes": written, "new_shared_dirs": len(new),
                                    "frozen_s": manifest["timings"].get("frozen_s")})
    last = runs["shared"].last_saved_step
    expected = local(model, opt)
    for ck in runs.values():
        ck.close()
    fresh, fresh_opt = build(1)
    resumer = Checkpointer(root / "shared_run", model=fresh, optimizer=fresh_opt)
    t0 = time.perf_counter()
    resumed_step = resumer.resume()
    resume_s = time.perf_counter() - t0
    got = local(fresh, fresh_opt)
    resumer.close()
    same = len(got) == len(expected) and all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    verdict = [None, None]
    tdist.all_gather_object(verdict, same)
    if args.rank == 0:
        Path(args.out).write_text(json.dumps({
            "saves": saves, "last": last,
            "resume": {"step": resumed_step, "seconds": resume_s, "bitwise": all(verdict)}}))
    tdist.barrier()
    tdist.destroy_process_group()
    os._exit(0)


def render(data: dict[str, Any]) -> tuple[str, dict[str, bool]]:
    shared, full = data["saves"]["shared"], data["saves"]["full"]
    later = {name: {"seconds": _spread([s["seconds"] for s in runs[1:]]),
                    "bytes": _spread([s["bytes"] for s in runs[1:]])} for name, runs in data["saves"].items()}
    check = _spread([s["frozen_s"] for s in shared[1:]])
    ratio_t = later["shared"]["seconds"]["median"] / later["full"]["seconds"]["median"]
    ratio_b = later["shared"]["bytes"]["median"] / later["full"]["bytes"]["median"]
    targets = {"bytes <= 3% of a full save": ratio_b <= 0.03, "time <= 3% of a full save": ratio_t <= 0.03,
               "resume bitwise": data["resume"]["bitwise"], "verify checks the shared files": data["verify"]["ok"]
               and "shared" in data["verify"]["checksums"]}

    def row(name: str, runs: list[dict[str, Any]]) -> str:
        t, b = later[name]["seconds"], later[name]["bytes"]
        return (f"| {name} | {runs[0]['seconds']:.3f} | {runs[0]['bytes'] / 2**20:,.1f} | {t['median']:.3f} "
                f"({t['min']:.3f}-{t['max']:.3f}) | {b['median'] / 2**20:,.1f} |")

    lines = [
        f"State: {data['state']}. Machine note: {data['machine_note']}. Saves after the first: {len(shared) - 1}.",
        "",
        "| checkpoints | first save (s) | first save (MiB) | later saves, median (min-max) (s) | later saves (MiB) |",
        "|---|---|---|---|---|",
        row("shared", shared),
        row("full", full),
        row("adapters", data["saves"]["adapters"]),
        "",
        "shared: share_frozen (the default); full: share_frozen=false, the same state; adapters: a model of the "
        "adapters alone, saved the same way (the floor: what committing any checkpoint of them costs here).",
        "",
        f"- later save, shared / full: time {ratio_t:.4f}x, bytes {ratio_b:.4f}x",
        f"- of a later shared save, checking the frozen tensors (their checksums, one pass over memory; manifest "
        f"`timings.frozen_s`, rank 0): {check['median']:.3f} s ({check['min']:.3f}-{check['max']:.3f}); the "
        f"adapters-alone floor: {later['adapters']['seconds']['median']:.3f} s, "
        f"{later['adapters']['seconds']['median'] / later['full']['seconds']['median']:.4f}x a full save",
        f"- resume of step {data['resume']['step']} (shared run, 2 ranks): {data['resume']['seconds']:.2f} s, every "
        f"local tensor equal to the saved state: {data['resume']['bitwise']}",
        f"- `verify_checkpoint` of that checkpoint: ok={data['verify']['ok']}, {data['verify']['checksums']}",
        "",
        "Targets of issue 36 (B10):",
        "",
        *(f"- {name}: {'met' if ok else 'NOT met'}" for name, ok in targets.items()),
    ]
    return "\n".join(lines), targets


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--note", default="2-core VM, nothing else running")
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--dir", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank is not None:
        return worker(args)
    with tempfile.TemporaryDirectory(prefix="b10_") as tmp, socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        out = Path(tmp) / "rank0.json"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent / "src"), os.environ.get("PYTHONPATH", "")]),
                   OMP_NUM_THREADS="1")
        procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--port", str(port), "--dir",
                                   str(Path(tmp) / "ckpt"), "--out", str(out), "--repeats", str(args.repeats),
                                   "--layers", str(args.layers)], env=env) for r in range(2)]
        codes = [proc.wait(timeout=3600) for proc in procs]
        if any(codes):
            raise SystemExit(f"B10: a rank failed (exit codes {codes})")
        data = json.loads(out.read_text())
        from fsdpkit.export.verification import verify_checkpoint  # one process, as `fsdpkit ckpt verify` runs

        report = verify_checkpoint(Path(tmp) / "ckpt" / "shared_run" / f"step_{data['last']}")
        data["verify"] = {k: report[k] for k in ("ok", "checked", "checksums", "problems")}
    base_mib = args.layers * WIDTH * WIDTH * 4 / 2**20
    data["state"] = (f"{args.layers} frozen fp32 Linear {WIDTH}x{WIDTH} ({base_mib:,.0f} MiB) + rank-{RANK} adapters "
                     "with AdamW state; 2 gloo ranks, FSDP2 per layer, keep_last=2")
    data["machine_note"] = args.note
    data["markdown"], data["targets"] = render(data)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(data, indent=1))
    print(data["markdown"])


if __name__ == "__main__":
    main()
