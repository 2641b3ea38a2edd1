"""The I/O seam (checkpoint/io/): every save writes through DCP's own writer with fsdpkit's file
checksums, and the manifest records the digest of every file's bytes and of every item in it; a
resume reads each file once, through DCP's reader without its pickle that checks every item as it
reads it (io.safe_reader with the manifest's files), and the tensors' checksums after the load; a
load without those checks (checkpoint.verify_on_load=false) checks every file in a pass of its own
first. Either refuses a damaged file naming it. One process, a gloo world of one: the collectives
of save and load run for real.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystemReader

from fsdpkit.checkpoint import Checkpointer, io, resume
from fsdpkit.checkpoint.errors import CheckpointCorruptError
from fsdpkit.checkpoint.hashing import DigestFileSystem
from fsdpkit.checkpoint.io.checked_read import CheckedFileSystemReader
from fsdpkit.checkpoint.manifest import read_manifest
from fsdpkit.checkpoint.resume import verify_files
from fsdpkit.checkpoint.safe_io import SafeFileSystemReader

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _trained(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.randn(4, 8)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _tensors(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, state in opt.state_dict()["state"].items():
        out.update({f"optim.{i}.{k}": torch.as_tensor(v).clone() for k, v in state.items()})
    return out


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def _save(root: Path, model: nn.Module, opt: torch.optim.Optimizer, **settings) -> Path:
    for seed in (torch.manual_seed, random.seed, np.random.seed):  # the RNG state is saved too
        seed(7)
    with Checkpointer(root, model=model, optimizer=opt, **settings) as ckpt:
        assert ckpt.resume() == 0
        ckpt.save(2)
    return root / "step_2"


def _resume(ckpt: Path, model: nn.Module | None = None, opt: torch.optim.Optimizer | None = None,
            **settings) -> dict[str, torch.Tensor]:
    if model is None:
        model, opt = _trained(seed=99)  # other weights: the load must replace them all
    root = ckpt.parent.parent / f"{ckpt.parent.name}-resumed"
    with Checkpointer(root, model=model, optimizer=opt, resume=str(ckpt), **settings) as c:
        assert c.resume() == 2
        return _tensors(model, opt)


@pytest.fixture
def saved(tmp_path, world_of_one, monkeypatch) -> tuple[dict[str, torch.Tensor], Path]:
    """One state saved by a Checkpointer through the one writer, io.hashing_writer: (its tensors, the
    checkpoint)."""
    from fsdpkit.checkpoint import save

    model, opt = _trained(seed=0)
    real, made = save.hashing_writer, []
    monkeypatch.setattr(save, "hashing_writer", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    ckpt = _save(tmp_path / "ckpt", model, opt)
    assert [(type(w), type(fs)) for w, fs in made] == [(FileSystemWriter, DigestFileSystem)]
    return _tensors(model, opt), ckpt


def test_the_manifest_records_the_digest_of_every_file_as_written(saved):
    _, ckpt = saved
    files = read_manifest(ckpt)["files"]
    assert "__0_0.distcp" in files and ".metadata" in files
    assert files.keys() == {p.name for p in ckpt.iterdir()} - {"manifest.json"}
    for name, info in files.items():  # an independent xxh3-64 of the bytes on disk
        data = (ckpt / name).read_bytes()
        assert (info["size"], info["xxh3_64"]) == (len(data), xxhash.xxh3_64_hexdigest(data)), name
    assert verify_files(ckpt, read_manifest(ckpt)) == []


def _spy_reads(m: pytest.MonkeyPatch) -> list[str]:
    """In order: `verify` for each checksum pass, `.metadata` for each parse of it, `checked` for each
    read by the checking reader, `data` for each read as DCP's own reader reads."""
    from fsdpkit.checkpoint import safe_io

    events: list[str] = []
    full, unpickle = resume.verify_files, safe_io.unpickle_dcp_metadata
    m.setattr(resume, "verify_files", lambda *a, **k: events.append("verify") or full(*a, **k))
    m.setattr(safe_io, "unpickle_dcp_metadata", lambda *a, **k: events.append(".metadata") or unpickle(*a, **k))
    for reader, event in ((FileSystemReader, "data"), (CheckedFileSystemReader, "checked")):
        m.setattr(reader, "read_data", lambda *a, real=reader.read_data, event=event, **k:
                  events.append(event) or real(*a, **k))
    return events


@pytest.mark.parametrize(("settings", "expected"), [
    ({}, [".metadata", "checked"]),  # each file read once; .metadata parsed once (fsdpkit's read and dcp.load's)
    ({"verify_on_load": False}, ["verify", ".metadata", "data"]),  # no tensor checks: a pass first
], ids=["one-read", "pass-first"])
def test_a_resume_checks_every_file_then_loads_bitwise(saved, monkeypatch, settings, expected):
    tensors, ckpt = saved
    events = _spy_reads(monkeypatch)
    assert _same(_resume(ckpt, **settings), tensors)
    assert events == expected
    events.clear()
    root = ckpt.parent  # the same with resume=auto
    model, opt = _trained(seed=99)
    with Checkpointer(root, model=model, optimizer=opt, **settings) as c:
        assert c.resume() == 2
    assert _same(_tensors(model, opt), tensors)
    assert events == expected


def test_a_resume_refuses_a_flipped_tensor_byte_naming_the_file(saved, monkeypatch):
    """In the one read, the tensor's checksum after the load finds it, then its file's: the error names
    the file (the state holds part of the checkpoint). In a pass first: before anything is loaded."""
    _, ckpt = saved
    model, opt = _trained(seed=0)
    _flip_weight_byte(ckpt, model)
    events = _spy_reads(monkeypatch)
    fresh, fresh_opt = _trained(seed=99)
    with pytest.raises(CheckpointCorruptError, match=r"failed verification after loading: 1 tensor\(s\) differ from "
                                                     r"their checksums \(model.0.weight\), and the files they were "
                                                     r"read from fail theirs; .*\n  .*__0_0\.distcp fails its "
                                                     r"checksum"):
        _resume(ckpt, fresh, fresh_opt)
    assert events == [".metadata", "checked", "verify"]
    events.clear()
    fresh, fresh_opt = _trained(seed=99)
    before = _tensors(fresh, fresh_opt)
    with pytest.raises(CheckpointCorruptError, match=r"__0_0\.distcp fails its checksum"):
        _resume(ckpt, fresh, fresh_opt, verify_on_load=False)
    assert events == ["verify"] and _same(_tensors(fresh, fresh_opt), before)  # nothing was read or loaded


def test_the_seam_hands_out_dcp_own_writer_and_reader(tmp_path):
    writer, fs = io.hashing_writer(tmp_path, thread_count=1)
    assert type(writer) is FileSystemWriter and type(fs) is DigestFileSystem and writer.fs is fs
    reader = io.safe_reader(tmp_path)
    assert type(reader) is SafeFileSystemReader
    checking = io.safe_reader(tmp_path, files={}, covered=())
    assert type(checking) is CheckedFileSystemReader and isinstance(checking, SafeFileSystemReader)


def _flip_weight_byte(ckpt: Path, model: nn.Module) -> None:
    """Flip one bit in the middle of the first layer's weight bytes in the checkpoint's shard."""
    shard = ckpt / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    weight = model[0].weight.detach().numpy().tobytes()
    at = data.find(weight)
    assert at > 0, "the first layer's weight bytes are stored as they are in memory"
    data[at + len(weight) // 2] ^= 0x01
    shard.write_bytes(bytes(data))


def test_auto_resume_sets_a_corrupt_newest_aside_and_loads_the_one_before(tmp_path, world_of_one):
    model, opt = _trained(seed=0)
    root = tmp_path / "run"
    with Checkpointer(root, model=model, optimizer=opt) as ckpt:
        assert ckpt.resume() == 0
        ckpt.save(1)
        at_1 = _tensors(model, opt)
        with torch.no_grad():
            model[0].weight.add_(1.0)
        ckpt.save(2)
    _flip_weight_byte(root / "step_2", model)
    model2, opt2 = _trained(seed=99)
    with Checkpointer(root, model=model2, optimizer=opt2) as ckpt:
        assert ckpt.resume() == 1
    assert _same(_tensors(model2, opt2), at_1)
    assert not (root / "step_2").exists() and any("corrupt" in p.name for p in root.iterdir())


def test_auto_resume_checks_the_files_of_a_full_checkpoint_too(tmp_path, world_of_one):
    """strategy.state_dict_type=full (safetensors written by rank 0): the same pass before the load,
    here on the RNG file, which post-load verification (tensor checksums) does not cover."""
    model, opt = _trained(seed=0)
    root = tmp_path / "run"
    with Checkpointer(root, model=model, optimizer=opt, state_dict_type="full") as ckpt:
        assert ckpt.resume() == 0
        ckpt.save(1)
        ckpt.save(2)
    rng = root / "step_2" / "rng.safetensors"
    data = bytearray(rng.read_bytes())
    data[-3] ^= 0x01  # in the last tensor's bytes
    rng.write_bytes(bytes(data))
    model2, opt2 = _trained(seed=99)
    with Checkpointer(root, model=model2, optimizer=opt2, state_dict_type="full") as ckpt:
        assert ckpt.resume() == 1
    assert _same(_tensors(model2, opt2), _tensors(model, opt))  # step 2 saved the same weights
    assert [p.name for p in root.iterdir() if "corrupt" in p.name] and not (root / "step_2").exists()
