"""One rank of B9's real-rank runs (gloo on this host): save and resume the 70B-shaped state with
fsdpkit (save_checkpoint / resolve_checkpoint + load_checkpoint, as a Checkpointer calls them) and
with plain dcp.save / dcp.load, the first save apart, then `repeats` timed saves and resumes each,
then one untimed save and resume with the collective byte counters on. Rank 0 writes its
measurements as JSON to --out.

Usage (launched by bench/coordinator.py, one process per rank):
  python bench/coordinator_worker.py --rank R --world W --port P --dir D --repeats N --out F
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import traceback
from pathlib import Path
from typing import Any

import torch.distributed as tdist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from coordinator_probe import CollectiveBytes, install_io_clock, measured
from coordinator_state import build, manifest_meta
from fsdpkit.checkpoint.catalog import step_dir_name
from fsdpkit.checkpoint.layout import MANIFEST
from fsdpkit.checkpoint.resolve import resolve_checkpoint
from fsdpkit.checkpoint.resume import load_checkpoint
from fsdpkit.checkpoint.safe_io import METADATA_FILENAME
from fsdpkit.checkpoint.save import PlanCache, save_checkpoint
from fsdpkit.checkpoint.state import CheckpointTarget


def median(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


class Rank:
    def __init__(self, *, rank: int, root: Path) -> None:
        self.rank, self.root = rank, root
        self.clock = install_io_clock()
        self.counter = CollectiveBytes()
        self.counter.install()
        self.model, self.opt = build()
        self.target = CheckpointTarget(self.model, self.opt)
        self.meta = manifest_meta(self.model, self.opt, step=1)
        self.fingerprint = self.meta["fingerprint"]
        self.step = 0
        self.plans = PlanCache()  # a Checkpointer's: its saves after the first reuse the plan

    def timed(self, fn) -> dict[str, float]:
        tdist.barrier()
        out: dict[str, float] = {}
        with measured(out, self.clock):
            extra = fn()
        tdist.barrier()
        out.update(extra or {})
        return out

    # -- fsdpkit -------------------------------------------------------------------------------------
    def fsdpkit_save(self) -> dict[str, float]:
        self.step += 1
        save_checkpoint(self.target, ckpt_dir=self.root / "fsdpkit" / step_dir_name(self.step), step=self.step,
                        meta=self.meta, group=None, plans=self.plans)
        return {}

    def fsdpkit_resume(self) -> dict[str, float]:
        path = resolve_checkpoint("auto", ckpt_root=self.root / "fsdpkit", group=None, verify_checksums=False)
        report = load_checkpoint(self.target, path, fingerprint=self.fingerprint, group=None, verify=True,
                                 verify_files=True)
        return {"verify_s": report.verify_s or 0.0}

    # -- plain DCP -----------------------------------------------------------------------------------
    def dcp_save(self) -> dict[str, float]:
        self.step += 1
        state = self.target.tensor_state(rank=self.rank)
        dcp.save(state, storage_writer=FileSystemWriter(self.root / "dcp" / step_dir_name(self.step)))
        return {}

    def dcp_resume(self) -> dict[str, float]:
        state = self.target.tensor_state(rank=self.rank)
        dcp.load(state, storage_reader=FileSystemReader(self.root / "dcp" / step_dir_name(self.step)))
        self.target.restore_tensors(state)
        return {}

    def run(self, method: str, repeats: int) -> dict[str, Any]:
        save, resume = getattr(self, f"{method}_save"), getattr(self, f"{method}_resume")
        first = self.timed(save)
        saves = [self.timed(save) for _ in range(repeats)]
        resumes = [self.timed(resume) for _ in range(repeats)]
        self.counter.on = True
        self.timed(save)
        save_bytes = self.counter.take()
        self.timed(resume)
        resume_bytes = self.counter.take()
        self.counter.on = False
        last = self.root / method / step_dir_name(self.step)
        return {"save_first": first, "save": median(saves), "resume": median(resumes),
                "save_runs": [r["coord_s"] for r in saves], "resume_runs": [r["coord_s"] for r in resumes],
                "save_bytes": save_bytes, "resume_bytes": resume_bytes,
                "metadata_bytes": (last / METADATA_FILENAME).stat().st_size,
                "manifest_bytes": (last / MANIFEST).stat().st_size if (last / MANIFEST).is_file() else 0,
                "files": len(os.listdir(last))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name in ("--rank", "--world", "--port", "--repeats"):
        p.add_argument(name, type=int, required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
                             world_size=args.world)
    code = 0
    try:
        rank = Rank(rank=args.rank, root=Path(args.dir))
        result = {"world": args.world, "dcp": rank.run("dcp", args.repeats),
                  "fsdpkit": rank.run("fsdpkit", args.repeats)}
        if args.rank == 0:
            Path(args.out).write_text(json.dumps(result, indent=1))
        del rank
        gc.collect()
    except BaseException:  # noqa: BLE001 (CheckpointException is a BaseException)
        traceback.print_exc()
        code = 1
    finally:
        # FIELD-NOTES: barrier, destroy, os._exit avoids the sporadic abort at exit
        try:
            tdist.barrier()
            tdist.destroy_process_group()
        finally:
            os._exit(code)


if __name__ == "__main__":
    main()
