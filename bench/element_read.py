"""The resume reader's element reads: through a stream opened anew every 16 MiB, or through one.

fsdpkit's resume reads a tensor's elements straight into the tensor that loads them
(checkpoint/io/checked_read.py), through a stream opened anew every FSDPKIT_READ_RESTART_BYTES (16
MiB), as the checksum pass reads whole files (io/page_cache.py says why: on a VM that hands free
memory back to its host, large page-cache folios are slow to fault in). Issue 35's rule: that stays
only if it beats the plain way beyond the spread of the same run; the plain way here is the same
reader with read_restart_bytes=0. DCP's own load (dcp.load + set_state_dict) runs in the same
rotation as a reference.

One process, no process group: --layers x Linear(--width, --width) with AdamW state, saved once by
fsdpkit; each run evicts the checkpoint's pages (posix_fadvise DONTNEED), rests --idle seconds, then
loads it (fsdpkit: load_checkpoint(verify=True, verify_files=True), what a resume does). The modes
alternate, the order reversed every other run; medians of --runs, min-max beside. Prints a markdown
table; not part of `make bench`.

Usage: python bench/element_read.py [--width 8192] [--layers 2] [--runs 6] [--idle 3] [--dir D]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from checkpoint_measure import drop_page_cache
from fsdpkit import tunables
from fsdpkit.checkpoint.manifest import model_fingerprint
from fsdpkit.checkpoint.resume import load_checkpoint
from fsdpkit.checkpoint.save import save_checkpoint
from fsdpkit.checkpoint.state import CheckpointTarget

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def build(width: int, layers: int) -> CheckpointTarget:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    opt.zero_grad()
    return CheckpointTarget(model=model, optimizer=opt)




def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=8192)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--runs", type=int, default=6)
    p.add_argument("--idle", type=float, default=3.0, help="seconds of rest after the eviction")
    p.add_argument("--dir", default=None, help="where the checkpoint goes (default: a temporary directory in bench/)")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="element_read_", dir=args.dir or Path(__file__).parent))
    try:
        target = build(args.width, args.layers)
        fingerprint = model_fingerprint(target.model, sharding={})
        ckpt = work / "step_1"
        save_checkpoint(target, ckpt_dir=ckpt, step=1, group=None,
                        meta={"run_id": "bench", "fingerprint": fingerprint, "metrics": {}})

        def fsdpkit() -> None:
            load_checkpoint(target, ckpt, fingerprint=fingerprint, group=None, verify=True, verify_files=True)

        def one_stream() -> None:
            with tunables.override(read_restart_bytes=0):
                fsdpkit()

        def dcp_load() -> None:
            model_sd, optim_sd = get_state_dict(target.model, target.optimizer)
            state = {"model": model_sd, "optim": optim_sd}
            dcp.load(state, storage_reader=dcp.FileSystemReader(ckpt), no_dist=True)
            set_state_dict(target.model, target.optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optim"])

        modes = {"stream renewed every 16 MiB (default)": fsdpkit, "one stream per file": one_stream,
                 "dcp.load + set_state_dict": dcp_load}
        times: dict[str, list[float]] = {m: [] for m in modes}
        for r in range(args.runs):
            for name in (list(modes) if r % 2 == 0 else list(modes)[::-1]):
                drop_page_cache(ckpt)
                time.sleep(args.idle)
                t0 = time.perf_counter()
                modes[name]()
                times[name].append(time.perf_counter() - t0)
        size = sum(f.stat().st_size for f in ckpt.iterdir()) / 2**30
        print(f"{args.layers} x Linear({args.width}, {args.width}) + AdamW: {size:.2f} GiB, items of "
              f"{args.width ** 2 * 4 / 2**20:.0f} MiB; evicted, {args.idle:g} s idle before each load; "
              f"medians of {args.runs}, modes alternating\n")
        print("| mode | median s | min-max (n) |\n|---|---|---|")
        for name, xs in times.items():
            print(f"| {name} | {statistics.median(xs):.2f} | {min(xs):.2f}-{max(xs):.2f} ({len(xs)}) |")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
