"""What a corrupt newest checkpoint costs a resume (issue 56), on N gloo ranks under torchrun.

A run of --layers x Linear(--width, --width) (FSDP2, AdamW stepped once) saves step_1, changes its
weights, saves step_2. Then, in rotation, --runs times each, a Checkpointer with the default settings
(resume=auto) resumes into the same model after step_2 was damaged (rank 0 flips one byte, the
pages of both checkpoints evicted from the page cache), timed on every rank until resume() returned
(max over ranks):

- intact: nothing damaged (step_2 loads);
- element: one byte in the middle of the first weight's elements in __0_0.distcp: found after the
  load by the weight's checksum, then by its files' checksums; step_2 set aside, step_1 loaded;
- headers: one byte of the same item's data.pkl: found by its item checksum while loading;
- and the same three with checkpoint.verify_on_load=false, which checks every file in a pass first
  (the way every resume went before issue 56): damage is found before anything is loaded.
After each run rank 0 undoes the damage and moves step_2 back. Prints a markdown table.

Usage: torchrun --nproc-per-node 2 bench/corrupt_resume.py [--layers 17] [--width 2304] [--runs 3] [--dir D]
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import statistics
import struct
import sys
import tempfile
import time
import warnings
import zipfile
from pathlib import Path

import torch
import torch.distributed as tdist
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.fsdp import fully_shard

from checkpoint_measure import drop_page_cache
from fsdpkit import dist
from fsdpkit.checkpoint.manager import Checkpointer

warnings.filterwarnings("ignore")
SCENARIOS = ("intact", "element", "headers")


def build(layers: int, width: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(layers)))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def where(ckpt: Path, scenario: str) -> tuple[Path, int]:
    """The byte to flip: the middle of the first weight's elements, or of its data.pkl, in __0_0.distcp."""
    metadata = FileSystemReader(ckpt).read_metadata()  # the test's own, intact checkpoint
    info = next(i for idx, i in metadata.storage_data.items()
                if idx.fqn == "model.0.weight" and i.relative_path == "__0_0.distcp")
    path = ckpt / info.relative_path
    with open(path, "rb") as f:
        f.seek(info.offset)
        item = f.read(info.length)
    suffix = "/data.pkl" if scenario == "headers" else "/data/0"
    (record,) = [r for r in zipfile.ZipFile(io.BytesIO(item)).infolist() if r.filename.endswith(suffix)]
    name_len, extra_len = struct.unpack("<HH", item[record.header_offset + 26:record.header_offset + 30])
    start = record.header_offset + 30 + name_len + extra_len
    return path, info.offset + start + record.file_size // 2


def flip(path: Path, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x04]))
        os.fsync(f.fileno())




def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=17)
    p.add_argument("--width", type=int, default=2304)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--dir", default=None)
    args = p.parse_args()
    dist.init_process_group(backend="gloo")
    rank = tdist.get_rank()
    box = [tempfile.mkdtemp(prefix="corrupt_resume_", dir=args.dir or Path(__file__).parent) if rank == 0 else None]
    tdist.broadcast_object_list(box)
    root = Path(box[0]) / "ckpt"
    model, opt = build(args.layers, args.width)
    with Checkpointer(root, model=model, optimizer=opt) as ck:
        ck.resume()
        ck.save(1)
        with torch.no_grad():
            for param in model.parameters():
                param.add_(1.0)
        ck.save(2)
    size = sum(f.stat().st_size for f in (root / "step_2").iterdir() if f.name != "manifest.json")
    spots = {s: where(root / "step_2", s) for s in SCENARIOS[1:]} if rank == 0 else {}
    times: dict[tuple[str, str], list[float]] = {}
    resumed: dict[tuple[str, str], set[int]] = {}
    modes = {"one read (default)": {}, "pass first (verify_on_load=false)": {"verify_on_load": False}}
    for r in range(args.runs):
        for mode, settings in modes.items():
            for scenario in SCENARIOS if r % 2 == 0 else SCENARIOS[::-1]:
                if rank == 0:
                    if scenario in spots:
                        flip(*spots[scenario])
                    drop_page_cache(root)
                tdist.barrier()
                t0 = time.perf_counter()
                with Checkpointer(root, model=model, optimizer=opt, **settings) as ck:
                    step = ck.resume()
                dt = torch.tensor([time.perf_counter() - t0])
                tdist.all_reduce(dt, op=tdist.ReduceOp.MAX)
                times.setdefault((mode, scenario), []).append(float(dt))
                resumed.setdefault((mode, scenario), set()).add(step)
                if rank == 0:
                    for aside in root.glob("step_2.corrupt-*"):
                        aside.rename(root / "step_2")
                    (root / "latest").write_text("step_2\n")
                    if scenario in spots:
                        flip(*spots[scenario])
                tdist.barrier()
    if rank == 0:
        print(f"\n{args.layers} x Linear({args.width}, {args.width}) + AdamW on {tdist.get_world_size()} ranks: "
              f"{size / 2**30:.2f} GiB per checkpoint; resume=auto over step_2 (damaged) and step_1; pages evicted "
              f"before each; medians of {args.runs}\n")
        print("| resume | step_2 | resumed step | seconds (median) | min-max (n) |\n|---|---|---|---|---|")
        for (mode, scenario), xs in times.items():
            print(f"| {mode} | {scenario} | {sorted(resumed[mode, scenario])} | {statistics.median(xs):.2f} | "
                  f"{min(xs):.2f}-{max(xs):.2f} ({len(xs)}) |")
        shutil.rmtree(root.parent, ignore_errors=True)
    dist.shutdown()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
