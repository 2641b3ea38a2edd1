"""Reading a cluster-sized DCP `.metadata`: DCP's reader, fsdpkit's, and fsdpkit's without its GC pause.

Resume's metadata handling at scale (issue 36, B9) is mostly one unpickle of `.metadata`, whose size grows
with tensors x ranks. fsdpkit reads it with its allow-list unpickler (safe_io.SafeUnpickler) and pauses
Python's cyclic garbage collector for that unpickle (safe_io._gc_paused). This is that pause's A/B, with
DCP's own `FileSystemReader.read_metadata` (plain `pickle.load`, collector on) as the baseline:

- dcp: `FileSystemReader(dir).read_metadata()`;
- fsdpkit: `SafeFileSystemReader(dir).read_metadata()` (what a resume runs);
- fsdpkit, GC on: the same allow-list unpickler without the pause.

The file: a DCP Metadata of --tensors tensors, each sharded by rows over --ranks ranks (one chunk per rank
and its storage entry), pickled as DCP pickles it. Two heaps: "fresh" (the process holds little) and
"large" (it first loads two more copies and keeps them, as a training process holds its model's Python
objects and DCP's plans). The readers alternate, the first one swapped every run; medians of --runs,
min-max beside; every read is checked equal to the first.

Usage: python bench/metadata_read.py [--ranks 1024] [--tensors 170] [--runs 5] [--dir D]
Writes bench/results/metadata_read.json (markdown included; results_md.py quotes it).
"""

from __future__ import annotations

import argparse
import gc
import pickle
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from fsdpkit.checkpoint.safe_io import METADATA_FILENAME, SafeFileSystemReader, SafeUnpickler
from results_md import publish

HERE = Path(__file__).parent
RESULTS = HERE / "results" / "metadata_read.json"
ROWS, COLS = 2, 32  # each rank's shard of each tensor


def write_metadata(path: Path, *, ranks: int, tensors: int) -> None:
    state, storage = {}, {}
    for t in range(tensors):
        fqn = f"optim.state.model.layers.{t // 9}.param_{t % 9}.exp_avg"
        chunks = []
        for r in range(ranks):
            offsets = torch.Size([r * ROWS, 0])
            chunks.append(ChunkStorageMetadata(offsets=offsets, sizes=torch.Size([ROWS, COLS])))
            storage[MetadataIndex(fqn, offsets)] = _StorageInfo(f"__{r}_0.distcp", t * ROWS * COLS * 4, ROWS * COLS * 4)
        state[fqn] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([ranks * ROWS, COLS]),
                                           chunks)
    with open(path, "wb") as f:
        pickle.dump(Metadata(state_dict_metadata=state, storage_data=storage), f)


def _safe_gc_on(ckpt: Path) -> Metadata:
    with open(ckpt / METADATA_FILENAME, "rb") as f:
        return SafeUnpickler(f, source=f.name).load()


READERS = {
    "dcp (FileSystemReader)": lambda ckpt: FileSystemReader(ckpt).read_metadata(),
    "fsdpkit (SafeFileSystemReader)": lambda ckpt: SafeFileSystemReader(ckpt).read_metadata(),
    "fsdpkit's unpickler, GC on": _safe_gc_on,
}


def same(a: Metadata, b: Metadata) -> bool:
    return a.state_dict_metadata == b.state_dict_metadata and a.storage_data == b.storage_data


def measure(ckpt: Path, runs: int, reference: Metadata) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in READERS}
    for run in range(runs):
        order = list(READERS) if run % 2 == 0 else list(READERS)[::-1]
        for name in order:
            t0 = time.perf_counter()
            got = READERS[name](ckpt)
            times[name].append(time.perf_counter() - t0)
            if not same(got, reference):
                raise SystemExit(f"metadata_read: {name} read something else than was written")
            del got
    return times


def render(data: dict) -> str:
    lines = [f"A DCP `.metadata` of {data['tensors']} tensors x {data['ranks']} ranks (one chunk each): "
             f"{data['file_mib']:.1f} MiB; medians of {data['runs']}, readers alternating.", "",
             "| heap | reader | median s | min-max (n) | / dcp |", "|---|---|---|---|---|"]
    for heap, times in data["times"].items():
        base = statistics.median(times[next(iter(READERS))])
        for name, ts in times.items():
            med = statistics.median(ts)
            lines.append(f"| {heap} ({data['live_objects'][heap]:,} GC-tracked objects) | {name} | {med:.3f} | "
                         f"{min(ts):.3f}-{max(ts):.3f} ({len(ts)}) | {med / base:.2f} |")
    lines.append("")
    for heap, times in data["times"].items():
        paused, on = times["fsdpkit (SafeFileSystemReader)"], times["fsdpkit's unpickler, GC on"]
        lines.append(f"- {heap} heap: the GC pause beats the same unpickler with GC on beyond the spread (its "
                     f"slowest read faster than the other's fastest): {'yes' if max(paused) < min(on) else 'no'}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=1024)
    p.add_argument("--tensors", type=int, default=170, help="170 x 1,024 ranks: ~22 MiB, B9's file at 1,024")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--dir", default=None, help="where the file goes (default: a temporary directory under bench/)")
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="metadata_read_", dir=args.dir or HERE))
    try:
        write_metadata(root / METADATA_FILENAME, ranks=args.ranks, tensors=args.tensors)
        gc.collect()
        reference = FileSystemReader(root).read_metadata()
        data = {"ranks": args.ranks, "tensors": args.tensors, "runs": args.runs,
                "file_mib": (root / METADATA_FILENAME).stat().st_size / 2**20, "times": {}, "live_objects": {}}
        held = []
        for heap in ("fresh", "large"):
            if heap == "large":
                held = [FileSystemReader(root).read_metadata() for _ in range(2)]
            gc.collect()
            data["live_objects"][heap] = len(gc.get_objects())
            data["times"][heap] = measure(root, args.runs, reference)
            print(f"{heap}: " + ", ".join(f"{n} {statistics.median(t):.3f} s" for n, t in data["times"][heap].items()),
                  flush=True)
        del held
        data["markdown"] = render(data)
        publish(RESULTS, data)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
