"""Bytes a resume reads, counted through the storage layer, on N gloo ranks.
Usage: one_read_worker.py OUT_DIR

On 2 ranks (OUT_DIR/ckpt absent): an FSDP2 model with rows that 2 and 3 do not divide, AdamW, a
scheduler and a Stateful tensor, trained one step and saved (step_1) with the default settings;
rank 0 dumps the full state (saved.pt). On any number of ranks: that checkpoint is resumed by
two Checkpointers in turn, each into a model built from another seed:
- `one_read`: the default settings (checkpoint.verify_checksums, checkpoint.verify_on_load);
- `pass_first`: checkpoint.verify_on_load=false, which checks every file in a pass of its own first.
Every read of a checkpoint file is counted by file, on each rank: through DCP's file system (the
streams every DCP reader opens, fsdpkit's included) and through io.page_cache.SequentialReader
(the checksum pass). Rank 0 writes OUT_DIR/report_<ws>.json: the bytes read per mode, rank and
file, and whether the loaded state equals saved.pt (torch.equal), the RNG state each rank saved
included (same world size).
"""

from __future__ import annotations

import io
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as tdist
import torch.distributed.checkpoint.filesystem as dcp_fs
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.fsdp import fully_shard

from fsdpkit import dist
from fsdpkit.checkpoint.io import page_cache
from fsdpkit.checkpoint.manager import Checkpointer

READS: Counter = Counter()  # file name -> bytes read on this rank


class _Counted:
    """A read stream that counts what it returns (every other attribute is the stream's)."""

    def __init__(self, stream, name: str):
        self._stream, self._name = stream, name

    def read(self, *args):
        data = self._stream.read(*args)
        READS[self._name] += len(data)
        return data

    def readinto(self, buffer):
        n = self._stream.readinto(buffer)
        READS[self._name] += n or 0
        return n

    def fileno(self):  # a reader that read around the stream would not be counted: none may
        raise io.UnsupportedOperation("reads of checkpoint files go through the stream, where they are counted")

    def __getattr__(self, name):
        return getattr(self._stream, name)


def count_reads() -> None:
    opened = dcp_fs.FileSystem.create_stream

    class _Stream:
        def __init__(self, fs, path, mode):
            self._cm, self._path, self._mode = opened(fs, path, mode), path, mode

        def __enter__(self):
            stream = self._cm.__enter__()
            return _Counted(stream, Path(self._path).name) if "r" in self._mode else stream

        def __exit__(self, *exc):
            return self._cm.__exit__(*exc)

    dcp_fs.FileSystem.create_stream = lambda fs, path, mode: _Stream(fs, path, mode)
    sequential = page_cache.SequentialReader

    class CountedSequential(sequential):
        def __init__(self, path, **tuning):
            super().__init__(path, **tuning)
            self._name = Path(path).name

        def readinto(self, view):
            n = super().readinto(view)
            READS[self._name] += n
            return n

    page_cache.SequentialReader = CountedSequential  # local files' open_sequential (file checksums) reads through it


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(384, 1001), nn.ReLU(), nn.Linear(1001, 384), nn.ReLU(),
                                    nn.Linear(384, 1001))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, object, dict]:
    torch.manual_seed(seed)
    model = Net()
    for layer in model.layers:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    extra = {"ema": torch.randn(7, 5, generator=torch.Generator().manual_seed(seed)), "count": seed}
    model(torch.randn(4, 384)).square().mean().backward()
    opt.step()
    sched.step()
    opt.zero_grad()
    return model, opt, sched, extra


def full_state(model: nn.Module, opt: torch.optim.Optimizer, extra: dict) -> dict[str, torch.Tensor]:
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    out = {f"model.{k}": v.clone() for k, v in msd.items()}
    for fqn, state in osd.get("state", {}).items():
        out.update({f"optim.{fqn}.{name}": v.clone() for name, v in state.items() if isinstance(v, torch.Tensor)})
    out["state.extra.ema"] = extra["ema"].clone()
    return out


def fall_back(root: Path, damage: str) -> dict:
    """resume=auto over step_2 (damaged: a byte of its `.metadata`, or of a weight's elements) and
    step_1: every rank must load step_1, whichever rank finds the damage first. Rank 1 reads
    `.metadata` a second late, so that rank 0, which finds it corrupt at once, would have moved the
    checkpoint aside under it if the ranks did not agree first."""
    model, opt, sched, extra = build(3)
    with Checkpointer(root, model=model, optimizer=opt, scheduler=sched, state={"extra": extra}) as ck:
        ck.resume()
        ck.save(1)
        saved = full_state(model, opt, extra)
        with torch.no_grad():
            for param in model.parameters():
                param.add_(1.0)
        ck.save(2)
    if tdist.get_rank() == 0:
        path = root / "step_2" / (".metadata" if damage == "metadata" else "__1_0.distcp")
        data = bytearray(path.read_bytes())
        data[len(data) // 2 if damage == "metadata" else len(data) - 4096] ^= 0x10  # an element of the last weight
        path.write_bytes(bytes(data))
    tdist.barrier()
    from fsdpkit.checkpoint import safe_io

    read = safe_io.SafeMetadataReading.read_metadata
    if tdist.get_rank() == 1:
        safe_io.SafeMetadataReading.read_metadata = lambda *a, **k: time.sleep(1) or read(*a, **k)
    try:
        model, opt, sched, extra = build(4)
        with Checkpointer(root, model=model, optimizer=opt, scheduler=sched, state={"extra": extra}) as ck:
            step = ck.resume()
    finally:
        safe_io.SafeMetadataReading.read_metadata = read
    steps = [None] * tdist.get_world_size()
    tdist.all_gather_object(steps, step)
    loaded = full_state(model, opt, extra)
    return {"steps": steps, "aside": sorted(p.name.split(".")[0] for p in root.iterdir() if ".corrupt-" in p.name),
            "different": sorted(k for k in saved if not torch.equal(saved[k], loaded[k]))}


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group(backend="gloo")
    ws, rank = tdist.get_world_size(), tdist.get_rank()
    ckpt = out / "ckpt" / "step_1"
    if not ckpt.is_dir():
        model, opt, sched, extra = build(0)
        with Checkpointer(out / "ckpt", model=model, optimizer=opt, scheduler=sched, state={"extra": extra}) as ck:
            ck.resume()
            ck.save(1)
        torch.save(torch.get_rng_state(), out / f"rng_{rank}.pt")
        saved = full_state(model, opt, extra)
        if rank == 0:
            torch.save(saved, out / "saved.pt")
        tdist.barrier()
    count_reads()
    saved = torch.load(out / "saved.pt", weights_only=True)
    report: dict = {"world_size": ws, "modes": {}}
    for mode, settings in (("one_read", {}), ("pass_first", {"verify_on_load": False})):
        model, opt, sched, extra = build(10 + ws)
        READS.clear()
        with Checkpointer(out / f"resumed_{mode}_{ws}", model=model, optimizer=opt, scheduler=sched,
                          state={"extra": extra}, resume=str(ckpt), **settings) as ck:
            step = ck.resume()
        reads = [None] * ws
        tdist.all_gather_object(reads, dict(READS))
        rng_ok = ws != 2 or torch.equal(torch.get_rng_state(), torch.load(out / f"rng_{rank}.pt", weights_only=True))
        rng_all = [None] * ws
        tdist.all_gather_object(rng_all, rng_ok)
        loaded = full_state(model, opt, extra)
        if rank == 0:
            report["modes"][mode] = {
                "step": step, "reads": reads, "rng_restored": all(rng_all), "count": extra["count"],
                "different": sorted(k for k in saved if k not in loaded or not torch.equal(saved[k], loaded[k]))}
    if ws == 2:
        report["fallback"] = {damage: fall_back(out / f"auto_{damage}", damage) for damage in ("metadata", "element")}
    if rank == 0:
        manifest = json.loads((ckpt / "manifest.json").read_text())
        report["files"] = {name: info["size"] for name, info in manifest["files"].items()}
        (out / f"report_{ws}.json").write_text(json.dumps(report))
    dist.shutdown()
    os._exit(0)


if __name__ == "__main__":
    main()
