"""Checkpoint cost on one CUDA GPU: fsdpkit's Checkpointer against DCP, with the machine's ceilings.

The state lives on the GPU (FSDP2 over a one-rank NCCL mesh, AdamW fused, after one real step):
params + exp_avg + exp_avg_sq, fp32, `--size-gib` in all. Each figure is the median of `--runs`
saves (min-max beside it); the first save of each kind is a warm-up and not counted.

- async stall: `Checkpointer(async_save=True).save()` until the loop may go on (a copy into its
  reused pinned buffer), against `dcp.async_save()` until it returns, and against the ceiling, one
  device-to-host copy of the same bytes into pinned memory (one stream, as the save uses);
- sync save: `Checkpointer.save()` (checksums, manifest, commit; no retention) against `dcp.save()` of the same
  state, and against one stream writing the same bytes with fsync (the fastest of plain writes,
  writes that start their write-back every 64 MiB, and O_DIRECT writes from reused buffers: the
  ways fsdpkit's writer writes);
- resume: a fresh Checkpointer's `resume()` of the newest sync checkpoint (resolution, load with the
  file checksums taken from the load's own read, restored-tensor checksums) against `dcp.load` +
  `set_state_dict` of the same checkpoint (both from the page cache).

Usage (a GPU machine): torchrun --nproc-per-node 1 bench/gpu_checkpoint.py [--size-gib 2] [--runs 5]
Rank 0 prints a markdown table and writes bench/results/gpu_checkpoint.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as tdist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from fsdpkit.checkpoint import Checkpointer
from fsdpkit.checkpoint.dcp_storage import hashing_writer
from fsdpkit.checkpoint.direct_io import DirectWriter
from fsdpkit.checkpoint.hashing import DIRECT_BUFFER_BYTES, DIRECT_WRITERS
from fsdpkit.checkpoint.manifest import read_manifest
from fsdpkit.checkpoint.writeback import WriteBack

RESULTS = Path(__file__).parent / "results" / "gpu_checkpoint.json"
WIDTH = 4096


def build(size_gib: float, device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer]:
    n_layers = max(1, round(size_gib * 2**30 / (12 * WIDTH * WIDTH)))  # 3 fp32 copies of each weight
    mesh = init_device_mesh("cuda", (tdist.get_world_size(),))
    model = nn.Sequential(*(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(n_layers))).to(device)
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    model(torch.randn(8, WIDTH, device=device)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def timed(fn, runs: int, before=None) -> list[float]:
    out = []
    for i in range(runs + 1):
        if before is not None:
            before()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if i:  # the first is a warm-up (buffer allocation, planning caches)
            out.append(time.perf_counter() - t0)
    return out


def ceilings(nbytes: int, runs: int, scratch: Path, device: torch.device) -> dict[str, list[float]]:
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).normal_()
    pinned = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)

    def d2h():
        pinned.copy_(src, non_blocking=True)
        torch.cuda.synchronize()

    block = pinned.view(torch.uint8).numpy()

    def write(writeback: bool) -> None:  # with writeback: started every 64 MiB as it goes, as fsdpkit's writer does
        with open(scratch / "ceiling.bin", "wb") as f:
            wb = WriteBack(f.fileno(), (64 << 20) if writeback else 0)
            for i in range(0, len(block), 64 << 20):
                f.write(block[i:i + (64 << 20)])
                f.flush()
                wb.written_to(min(i + (64 << 20), len(block)))
            os.fsync(f.fileno())
        (scratch / "ceiling.bin").unlink()

    def write_direct() -> None:  # as fsdpkit's checkpoint writer does where O_DIRECT is taken
        writer = DirectWriter(scratch / "ceiling.bin", buffer_bytes=DIRECT_BUFFER_BYTES, writers=DIRECT_WRITERS)
        try:
            writer.write(block)
            writer.close()
        finally:
            writer.abort()
        (scratch / "ceiling.bin").unlink()

    ways = [timed(lambda: write(False), runs), timed(lambda: write(True), runs), timed(write_direct, runs)]
    faster = min(ways, key=statistics.median)  # the ceiling: the fastest way
    return {"d2h_pinned_s": timed(d2h, runs), "write_fsync_s": faster}


def summary(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-gib", type=float, default=2.0)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--dir", type=Path, default=None, help="scratch directory (default: a temporary one)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/gpu_checkpoint.py needs a CUDA GPU; bench/checkpoint.py measures the CPU path")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    tdist.init_process_group("cpu:gloo,cuda:nccl")  # dcp.async_save needs a CPU backend beside NCCL
    scratch = Path(tempfile.mkdtemp(prefix="fsdpkit-gpu-bench-", dir=args.dir))
    model, optimizer = build(args.size_gib, device)
    nbytes = sum(t.to_local().numel() * 4 for t in model.parameters()) * 3
    times = ceilings(nbytes, args.runs, scratch, device)
    state = lambda: dict(zip(("model", "optim"), get_state_dict(model, optimizer), strict=True))  # noqa: E731

    def resume(root: Path) -> None:
        """fsdpkit's whole checkpoint part of a resume: resolution, load with every file's checksum
        taken from the load's own read, the restored tensors' checksums against the manifest."""
        ckpt = Checkpointer(root, model=model, optimizer=optimizer)
        if ckpt.resume() != args.runs + 1:
            raise RuntimeError("the resume did not load the newest checkpoint")
        ckpt.close()

    def dcp_load(path: Path) -> None:
        sd = state()
        dcp.load(sd, checkpoint_id=path)
        set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

    for mode in ("async", "sync"):  # the stall each save reports: for async, until the loop may go on
        records: list[dict] = []
        root = scratch / f"fsdpkit-{mode}"
        ckpt = Checkpointer(root, model=model, optimizer=optimizer, async_save=mode == "async",
                            verify_checksums=False, on_event=records.append)  # no retention: nothing deleted in a save
        ckpt.resume()
        for step in range(1, args.runs + 2):
            ckpt.save(step, wait=True)  # async: waits for the commit after the stall, so no save waits for another
        ckpt.close()
        times[f"fsdpkit_{mode}_stall_s"] = [r["stall_s"] for r in records if r["event"] == "checkpoint"][1:]
        parts = [read_manifest(root / f"step_{step}")["timings"] for step in range(2, args.runs + 2)]
        times[f"fsdpkit_{mode}_dcp_write_s"] = [t["write_s"] for t in parts]  # DCP write + file-list gather
        if mode == "sync":
            times["fsdpkit_resume_s"] = timed(lambda r=root: resume(r), args.runs)
            times["dcp_load_s"] = timed(lambda r=root: dcp_load(r / f"step_{args.runs + 1}"), args.runs)
        shutil.rmtree(root)

    dcp_stalls: list[float] = []

    def dcp_async():
        t0 = time.perf_counter()
        future = dcp.async_save(state(), checkpoint_id=scratch / "dcp-async")
        dcp_stalls.append(time.perf_counter() - t0)
        future.result()
    timed(dcp_async, args.runs, before=lambda: shutil.rmtree(scratch / "dcp-async", ignore_errors=True))
    times["dcp_async_stall_s"] = dcp_stalls[1:]
    times["dcp_save_s"] = timed(lambda: dcp.save(state(), checkpoint_id=scratch / "dcp"), args.runs,
                                before=lambda: shutil.rmtree(scratch / "dcp", ignore_errors=True))
    times["dcp_save_hashing_writer_s"] = timed(  # the same dcp.save through fsdpkit's file-hashing writer alone
        lambda: dcp.save(state(), storage_writer=hashing_writer(scratch / "dcp-h", thread_count=1)[0]), args.runs,
        before=lambda: shutil.rmtree(scratch / "dcp-h", ignore_errors=True))
    times["fsdpkit_sync_save_s"] = times.pop("fsdpkit_sync_stall_s")

    if tdist.get_rank() == 0:
        med = {k: statistics.median(v) for k, v in times.items()}
        gb = nbytes / 1e9
        rows = [
            ("fsdpkit async stall", med["fsdpkit_async_stall_s"], "d2h pinned copy", med["d2h_pinned_s"]),
            ("dcp.async_save stall", med["dcp_async_stall_s"], "fsdpkit async stall", med["fsdpkit_async_stall_s"]),
            ("fsdpkit sync save", med["fsdpkit_sync_save_s"], "dcp.save", med["dcp_save_s"]),
            ("fsdpkit sync save", med["fsdpkit_sync_save_s"], "1-stream write+fsync", med["write_fsync_s"]),
            ("fsdpkit sync: DCP write + gather", med["fsdpkit_sync_dcp_write_s"], "dcp.save", med["dcp_save_s"]),
            ("dcp.save through fsdpkit's file-hashing writer", med["dcp_save_hashing_writer_s"], "dcp.save",
             med["dcp_save_s"]),
            ("fsdpkit resume (checkpoint part)", med["fsdpkit_resume_s"], "dcp.load + set_state_dict",
             med["dcp_load_s"]),
        ]
        print(f"\nstate on the GPU: {gb:.2f} GB ({torch.cuda.get_device_name(device)}), medians of {args.runs}\n")
        print("| figure | s | against | s | ratio |\n|---|---|---|---|---|")
        for a, ta, b, tb in rows:
            print(f"| {a} | {ta:.3f} | {b} | {tb:.3f} | {ta / tb:.2f} |")
        print("\nmin-max: " + ", ".join(f"{k} {min(v):.3f}-{max(v):.3f}" for k, v in times.items()))
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps({"bytes": nbytes, "device": torch.cuda.get_device_name(device),
                                       "torch": torch.__version__, **{k: summary(v) for k, v in times.items()}},
                                      indent=1))
    tdist.barrier()
    shutil.rmtree(scratch, ignore_errors=True)
    tdist.destroy_process_group()


if __name__ == "__main__":
    main()
