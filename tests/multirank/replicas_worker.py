"""Replicas read once (checkpoint/replicas.py), on N gloo ranks. Usage: replicas_worker.py PHASE OUT.json WORK_DIR
[BUCKET]

Phases:
  hsdp (4 ranks): a model under HYBRID_SHARD 2x2 (AdamW, a persistent buffer, a Stateful tensor, each rank's
       own RNG) is saved, then loaded three times into scrambled state: through today's path (every rank
       reads; the replication finder patched out, from here) and read once, each time compared bitwise
       with the state dumped at save time; the bytes every rank read from the checkpoint's files are
       counted here, by wrapping DCP's file system (nothing in fsdpkit counts), and
       each stored item read (file, offset, length) is recorded. Then a checkpoint saved
       under FULL_SHARD on 4 is loaded under HSDP 2x2 (elastic), and a data file that a reader reads is
       truncated, then removed, and `.metadata` replaced by a crafted pickle: every rank must raise one
       error naming the file.
       Last, a model with a frozen first layer saved twice (the second checkpoint references the shared
       directory of frozen tensors the first wrote) and loaded read-once; with BUCKET, a checkpoint on
       moto's S3 server (AWS_ENDPOINT_URL) loaded read-once.
  noshard (2 ranks): NO_SHARD's (2, 1) mesh, saved and loaded read-once; then the hsdp phase's
       HSDP checkpoint loaded under NO_SHARD on 2 (elastic).
Rank 0 writes what every rank saw to OUT.json.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import random
import shutil
import struct
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import torch
import torch.distributed as tdist
from torch import nn
from torch.distributed.checkpoint import filesystem as dcp_fs
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from fsdpkit import dist
from fsdpkit.checkpoint import resume
from fsdpkit.checkpoint.errors import CheckpointError
from fsdpkit.checkpoint.frozen import SHARED
from fsdpkit.checkpoint.manifest import model_fingerprint, read_manifest
from fsdpkit.checkpoint.resume import load_checkpoint
from fsdpkit.checkpoint.save import FrozenShare, save_checkpoint
from fsdpkit.checkpoint.state import CheckpointTarget, DictState, capture_rng, flatten

READS: dict[str, int] = {}  # file name -> bytes this rank read through DCP's file system
ITEMS: list[tuple[str, int, int]] = []  # (directory/file, offset, length) of each stored item this rank read


class CountingStream:
    """A DCP read stream that adds every byte it returns to READS[name]."""

    def __init__(self, stream, name: str):
        self._stream, self._name = stream, name

    def read(self, *args):
        data = self._stream.read(*args)
        READS[self._name] = READS.get(self._name, 0) + len(data)
        return data

    def readinto(self, buffer):
        n = self._stream.readinto(buffer)
        READS[self._name] = READS.get(self._name, 0) + (n or 0)
        return n

    def __getattr__(self, name):
        return getattr(self._stream, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._stream.close()


def install_counter() -> None:
    original = dcp_fs.FileSystem.create_stream

    def create_stream(self, path, mode):
        cm = original(self, path, mode)

        class Wrapped:
            def __enter__(self_inner):
                self_inner.stream = cm.__enter__()
                return CountingStream(self_inner.stream, Path(path).name) if "r" in mode else self_inner.stream

            def __exit__(self_inner, *exc):
                return cm.__exit__(*exc)

        return Wrapped()

    dcp_fs.FileSystem.create_stream = create_stream
    slice_file = dcp_fs.FileSystemReader._slice_file

    def record_item(self, file, sinfo):
        ITEMS.append((f"{Path(self.path).name}/{Path(sinfo.relative_path).name}", sinfo.offset, sinfo.length))
        return slice_file(self, file, sinfo)

    dcp_fs.FileSystemReader._slice_file = record_item


class Scaled(nn.Module):
    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.lin = nn.Linear(n_in, n_out)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, n_out))  # a plain tensor on every rank

    def forward(self, x):
        return self.lin(x) * self.scale


def build(mesh, *, seed: int = 0) -> tuple[CheckpointTarget, dict]:
    torch.manual_seed(seed)
    model = nn.Sequential(Scaled(48, 67), nn.ReLU(), Scaled(67, 33), nn.ReLU(), Scaled(33, 8))
    for layer in model:
        if isinstance(layer, Scaled):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    extra = {"ema": torch.randn(5, 3, generator=torch.Generator().manual_seed(7)), "count": 3}
    return CheckpointTarget(model=model, optimizer=opt, stateful={"extra": DictState(extra)}), extra


def train(target: CheckpointTarget, steps: int = 2) -> None:
    gen = torch.Generator().manual_seed(1000 + tdist.get_rank())  # different data on every rank
    for _ in range(steps):
        target.model(torch.randn(4, 48, generator=gen)).pow(2).mean().backward()
        target.optimizer.step()
        target.optimizer.zero_grad()


def seed_rank(offset: int) -> None:
    r = tdist.get_rank() + offset
    torch.manual_seed(r)
    np.random.seed(r)
    random.seed(r)


def full_state(target: CheckpointTarget) -> dict[str, torch.Tensor]:
    """Every tensor gathered (collective), the Stateful pieces, and this rank's RNG."""
    out = {}
    for key, value in flatten(target.tensor_state(rank=tdist.get_rank())).items():
        if key.startswith("rng."):
            continue
        if isinstance(value, torch.Tensor):
            out[key] = (value.full_tensor() if isinstance(value, DTensor) else value).detach().clone()
        else:
            out[key] = value  # optimizer param_groups
    out |= {f"live_rng.{k}": v.clone() for k, v in capture_rng().items()}
    return out


def scramble(target: CheckpointTarget, extra: dict) -> None:
    with torch.no_grad():
        for p in target.model.parameters():
            p.zero_()
        for buf in target.model.buffers():
            buf.fill_(-1)
        for st in target.optimizer.state.values():
            for v in st.values():
                v.fill_(-3)
    extra["ema"] = torch.zeros(5, 3)
    extra["count"] = -1
    seed_rank(5000)


def local_shards(target: CheckpointTarget) -> dict[str, torch.Tensor]:
    flat = flatten(target.tensor_state(rank=tdist.get_rank()))
    return {k: (v.to_local() if isinstance(v, DTensor) else v).clone() for k, v in flat.items()
            if isinstance(v, torch.Tensor) and not k.startswith("rng.")}


def compare(a: dict, b: dict) -> list[str]:
    if a.keys() != b.keys():
        return [f"keys differ: {sorted(a.keys() ^ b.keys())}"]
    return [k for k in a if not same(a[k], b[k])]


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def everyone(value):
    out = [None] * tdist.get_world_size()
    tdist.all_gather_object(out, value)
    return out


def load(target: CheckpointTarget, ckpt: Path, *, today: bool = False) -> dict:
    """One load into `target`, every rank's read bytes and seconds, or its error."""
    saved_finder = resume.find_replication
    if today:  # the path every load took before replicas.py: every rank reads its own shards
        resume.find_replication = lambda state, group: None
    READS.clear()
    ITEMS.clear()
    tdist.barrier()
    t0 = time.perf_counter()
    error = None
    try:
        load_checkpoint(target, ckpt, fingerprint=model_fingerprint(target.model, sharding={}), group=None,
                        verify=True, verify_files=False)
    except CheckpointError as e:
        error = f"{type(e).__name__}: {e}"
    finally:
        resume.find_replication = saved_finder
    seconds = time.perf_counter() - t0
    return {"reads": everyone(dict(READS)), "items": everyone(list(ITEMS)), "seconds": everyone(seconds),
            "errors": everyone(error)}


def save(target: CheckpointTarget, ckpt: Path, step: int, frozen: FrozenShare | None = None) -> None:
    meta = {"run_id": "replicas", "fingerprint": model_fingerprint(target.model, sharding={}), "metrics": {}}
    save_checkpoint(target, ckpt_dir=ckpt, step=step, meta=meta, group=None, frozen=frozen)


def frozen_base(mesh, work: Path) -> dict:
    """The first layer frozen (no gradient, not in the optimizer): the second checkpoint references
    the shared directory the first one wrote; loaded read-once, from both directories."""
    target, extra = build(mesh)
    for param in target.model[0].parameters():
        param.requires_grad_(False)
    target.optimizer = torch.optim.AdamW([p for p in target.model.parameters() if p.requires_grad], lr=1e-2)
    share, root = FrozenShare(work / "frozen"), work / "frozen"
    train(target)
    save(target, root / "step_1", step=1, frozen=share)
    train(target, steps=1)
    seed_rank(100)
    saved = full_state(target)
    save(target, root / "step_2", step=2, frozen=share)
    manifest = json.loads((root / "step_2" / "manifest.json").read_text())
    shared = [root / ref["dir"] for ref in manifest.get(SHARED, [])]
    scramble(target, extra)
    res = load(target, root / "step_2")
    res["differ"] = everyone(compare(saved, full_state(target)))
    res["sizes"] = {k: v for d in [root / "step_2", *shared] for k, v in sizes(d).items()}
    res["shared"] = [d.name for d in shared]
    return res


def save_and_check(mesh, work: Path, name: str) -> tuple[dict, Path]:
    """Save a trained model under `mesh`; load it through today's path and read-once, each compared
    with the state at save time."""
    target, extra = build(mesh)
    train(target)
    seed_rank(100)
    ckpt = work / name / "step_2"
    saved = full_state(target)  # no RNG draw between this capture and the save's
    save(target, ckpt, step=2)
    res = {"sizes": sizes(ckpt), "saved": saved, "rng_items": rng_items(ckpt)}
    for mode in ("today", "once"):
        scramble(target, extra)
        res[mode] = load(target, ckpt, today=mode == "today")
        restored = full_state(target)
        res[mode]["differ"] = everyone(compare(saved, restored))
        res[mode]["count"] = everyone(extra["count"])
        if mode == "once":  # each replica's local shards against its reader's
            shards = everyone(local_shards(target))
            peers = [mesh.mesh[:, c].tolist() for c in range(mesh.mesh.shape[1])]
            res["replica_differs"] = {str(p): compare(shards[group[0]], shards[p]) for group in peers for p in group}
            res["peers"] = peers
    return res, ckpt


def sizes(ckpt: Path) -> dict[str, int]:
    return {f"{ckpt.name}/{p.name}": p.stat().st_size for p in ckpt.iterdir() if p.is_file()}


def rng_items(ckpt: Path) -> list[tuple[str, int, int]]:
    """(file, offset, length) of every stored item of the ranks' RNG state."""
    from fsdpkit.checkpoint.safe_io import read_dcp_metadata

    return [(f"{ckpt.name}/{Path(info.relative_path).name}", info.offset, info.length)
            for index, info in read_dcp_metadata(ckpt).storage_data.items() if index.fqn.startswith("rng.")]


def flip_tensor_bytes(ckpt: Path, victim: str) -> None:
    """Flip 8 bytes in the middle of the values of the largest tensor item in `victim` (its torch.save
    zip's data record, found with zipfile): bytes no header check sees, only the values' checksums."""
    from fsdpkit.checkpoint.safe_io import read_dcp_metadata

    items = [(info.offset, info.length) for info in read_dcp_metadata(ckpt).storage_data.values()
             if Path(info.relative_path).name == victim]
    offset, length = max(items, key=lambda item: item[1])
    with open(ckpt / victim, "r+b") as f:
        f.seek(offset)
        raw = f.read(length)
        archive = zipfile.ZipFile(io.BytesIO(raw))
        record = archive.getinfo(next(n for n in archive.namelist() if "/data/" in n))
        name_len, extra_len = struct.unpack("<HH", raw[record.header_offset + 26:record.header_offset + 30])
        at = offset + record.header_offset + 30 + name_len + extra_len + record.file_size // 2
        f.seek(at)
        chunk = f.read(8)
        f.seek(at)
        f.write(bytes(b ^ 0xFF for b in chunk))


def damaged_loads(mesh, ckpt: Path, reads: list[dict]) -> dict:
    """A data file that reader 1 reads, truncated, flipped, then removed, and a crafted `.metadata`: every
    rank's error."""
    target, _ = build(mesh)
    victim = sorted(name for name in reads[1] if name.endswith(".distcp"))[0]
    path = ckpt / victim
    keep = ckpt.parent / f"{victim}.keep"
    res = {"victim": victim}
    if tdist.get_rank() == 0:
        shutil.copyfile(path, keep)
        with open(path, "r+b") as f:
            f.truncate(path.stat().st_size // 2)
    tdist.barrier()
    res["truncated"] = load(target, ckpt)
    if tdist.get_rank() == 0:
        shutil.copyfile(keep, path)
        flip_tensor_bytes(ckpt, victim)
    tdist.barrier()
    res["flipped"] = load(target, ckpt)
    if tdist.get_rank() == 0:
        path.unlink()
    tdist.barrier()
    res["removed"] = load(target, ckpt)
    metadata = ckpt / ".metadata"
    if tdist.get_rank() == 0:
        shutil.move(keep, path)
        shutil.copyfile(metadata, keep)
        metadata.write_bytes(pickle.dumps(Crafted()))  # unpickled with plain pickle, it would run a command
    tdist.barrier()
    res["refused"] = load(target, ckpt)
    if tdist.get_rank() == 0:
        shutil.move(keep, metadata)
    tdist.barrier()
    return res


class Crafted:
    def __reduce__(self):
        return os.system, ("echo the crafted .metadata ran",)


def elastic(mesh, ckpt: Path, saved: dict | None) -> dict:
    """Load `ckpt` (saved under another mesh) into a fresh model under `mesh`."""
    target, extra = build(mesh, seed=99)
    extra["count"] = -1
    res = load(target, ckpt)
    restored = full_state(target)
    if saved is not None:
        res["differ"] = everyone([k for k in saved if not same(saved[k], restored[k])])
    res["count"] = everyone(extra["count"])
    return res


def phase_hsdp(work: Path, bucket: str | None) -> dict:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    res, ckpt = save_and_check(mesh, work, "hsdp")
    if tdist.get_rank() == 0:  # for the noshard phase's elastic load
        torch.save({k: v for k, v in res.pop("saved").items() if not k.startswith("live_rng.")}, work / "hsdp.pt")
    res.pop("saved", None)
    res["damaged"] = damaged_loads(mesh, ckpt, res["once"]["reads"])
    flat = init_device_mesh("cpu", (4,))
    source, _ = build(flat)
    train(source)
    saved = full_state(source)
    save(source, work / "fs4" / "step_2", step=2)
    res["fs4_to_hsdp"] = elastic(mesh, work / "fs4" / "step_2", saved)
    res["frozen"] = frozen_base(mesh, work)
    if bucket:
        res["s3"] = s3_leg(mesh, bucket)
    return res


def s3_leg(mesh, bucket: str) -> dict:
    """Save to moto's S3 server and load read-once: bitwise, and only the readers fetch bytes
    (counted around s3fs's ranged reads, which the object-store reader fetches items with)."""
    import s3fs

    from fsdpkit.checkpoint.storage import open_storage

    fetched = [0]
    original = s3fs.S3FileSystem._cat_file

    async def counted(self, path, *args, **kwargs):
        data = await original(self, path, *args, **kwargs)
        if str(path).endswith(".distcp"):  # not manifest.json, which every rank reads first
            fetched[0] += len(data)
        return data

    s3fs.S3FileSystem._cat_file = counted
    target, extra = build(mesh)
    train(target)
    seed_rank(100)
    saved = full_state(target)
    ckpt = open_storage(f"s3://{bucket}/hsdp") / "step_2"
    save(target, ckpt, step=2)
    scramble(target, extra)
    fetched[0] = 0
    res = load(target, ckpt)
    res["fetched"] = everyone(fetched[0])
    res["differ"] = everyone(compare(saved, full_state(target)))
    files = read_manifest(ckpt)["files"]
    res["data_bytes"] = sum(info["size"] for name, info in files.items() if name.endswith(".distcp"))
    return res


def phase_noshard(work: Path) -> dict:
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    res, _ = save_and_check(mesh, work, "noshard")
    res.pop("saved")
    res["hsdp_to_noshard"] = elastic(mesh, work / "hsdp" / "step_2", torch.load(work / "hsdp.pt"))
    return res


def main() -> None:
    phase, out, work = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    bucket = sys.argv[4] if len(sys.argv) > 4 else None
    dist.init_process_group(backend="gloo")
    install_counter()
    res = phase_hsdp(work, bucket) if phase == "hsdp" else phase_noshard(work)
    if tdist.get_rank() == 0:
        out.write_text(json.dumps(res))
    dist.shutdown()
    os._exit(0)


if __name__ == "__main__":
    main()
