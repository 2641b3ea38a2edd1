"""The I/O seam (checkpoint/io/): every save writes through DCP's own writer with fsdpkit's file
checksums, whatever `checkpoint.io`, and the manifest records the digest of every file's bytes; `checkpoint.io`
picks the reader (`fast`: the verifying reader, `plain`: DCP's reader after a checksum pass), both
load the same state and both refuse a damaged file. One process, a gloo world of one: the
collectives of save and load run for real.
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

from fsdpkit.checkpoint import Checkpointer, io
from fsdpkit.checkpoint.errors import CheckpointCorruptError
from fsdpkit.checkpoint.hashing import DigestFileSystem
from fsdpkit.checkpoint.io import safe_reader, verified_read
from fsdpkit.checkpoint.manifest import read_manifest
from fsdpkit.checkpoint.resume import verify_files
from fsdpkit.config import compose_config

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


def _save(root: Path, model: nn.Module, opt: torch.optim.Optimizer, *, io_: str) -> Path:
    for seed in (torch.manual_seed, random.seed, np.random.seed):  # the RNG state is saved too
        seed(7)
    with Checkpointer(root, model=model, optimizer=opt, io=io_) as ckpt:
        assert ckpt.resume() == 0
        ckpt.save(2)
    return root / "step_2"


def _resume(ckpt: Path, *, io_: str) -> dict[str, torch.Tensor]:
    model, opt = _trained(seed=99)  # other weights: the load must replace them all
    root = ckpt.parent.parent / f"{ckpt.parent.name}-resumed-with-{io_}"
    with Checkpointer(root, model=model, optimizer=opt, io=io_, resume=str(ckpt)) as c:
        assert c.resume() == 2
        return _tensors(model, opt)


@pytest.fixture
def both(tmp_path, world_of_one, monkeypatch) -> tuple[dict[str, torch.Tensor], Path, Path]:
    """One state saved by a Checkpointer with io=plain and with io=fast: (its tensors, plain ckpt,
    fast ckpt). Both saves go through the one writer, io.hashing_writer."""
    from fsdpkit.checkpoint import save

    model, opt = _trained(seed=0)
    real, made = save.hashing_writer, []
    monkeypatch.setattr(save, "hashing_writer", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    plain = _save(tmp_path / "plain", model, opt, io_="plain")
    fast = _save(tmp_path / "fast", model, opt, io_="fast")
    assert [(type(w), type(fs)) for w, fs in made] == [(FileSystemWriter, DigestFileSystem)] * 2
    return _tensors(model, opt), plain, fast


def test_the_manifest_records_the_digest_of_every_file_as_written(both):
    _, plain, fast = both
    for ckpt in (plain, fast):
        files = read_manifest(ckpt)["files"]
        assert "__0_0.distcp" in files and ".metadata" in files
        assert files.keys() == {p.name for p in ckpt.iterdir()} - {"manifest.json"}
        for name, info in files.items():  # an independent xxh3-64 of the bytes on disk
            data = (ckpt / name).read_bytes()
            assert (info["size"], info["xxh3_64"]) == (len(data), xxhash.xxh3_64_hexdigest(data)), name
        assert verify_files(ckpt, read_manifest(ckpt)) == []


def test_checkpoint_io_does_not_change_what_a_save_writes(both):
    _, plain, fast = both
    files_plain, files_fast = read_manifest(plain)["files"], read_manifest(fast)["files"]
    assert files_plain.keys() == files_fast.keys()
    for name in sorted(files_plain.keys() - {".metadata"}):
        assert files_plain[name] == files_fast[name], name  # size and xxh3: the same bytes
    # .metadata never repeats between two saves (DCP pickles a random save_id and the checkpoint's
    # path into it); what it says about the state is the same
    a, b = safe_reader(plain).read_metadata(), safe_reader(fast).read_metadata()
    assert a.state_dict_metadata == b.state_dict_metadata and a.storage_data == b.storage_data


def _no_fast_reader(m: pytest.MonkeyPatch) -> None:
    m.setattr(verified_read, "VerifyingFileSystemReader",
              lambda *a, **k: pytest.fail("io=plain read through the fast path"))


def test_each_loads_under_the_other_setting_bitwise(both, monkeypatch):
    saved, plain, fast = both
    from fsdpkit.checkpoint import safe_io

    real, parsed = safe_io.unpickle_dcp_metadata, []
    monkeypatch.setattr(safe_io, "unpickle_dcp_metadata", lambda *a, **k: parsed.append(1) or real(*a, **k))
    assert _same(_resume(plain, io_="fast"), saved)
    # fsdpkit reads .metadata before dcp.load, and dcp.load again: one parse per load on a rank
    assert len(parsed) == 1
    with monkeypatch.context() as m:
        _no_fast_reader(m)
        assert _same(_resume(fast, io_="plain"), saved)
        assert _same(_resume(plain, io_="plain"), saved)


@pytest.mark.parametrize("io_", ["plain", "fast"])
def test_each_reader_refuses_a_flipped_tensor_byte_naming_the_file(tmp_path, world_of_one, monkeypatch, io_):
    readers: list[object] = []
    if io_ == "plain":
        _no_fast_reader(monkeypatch)
    else:  # the verifying reader finds it from its own read
        real = verified_read.VerifyingFileSystemReader
        monkeypatch.setattr(verified_read, "VerifyingFileSystemReader",
                            lambda *a, **k: readers.append(real(*a, **k)) or readers[-1])
    model, opt = _trained(seed=0)
    ckpt = _save(tmp_path / "ckpt", model, opt, io_=io_)
    _flip_weight_byte(ckpt, model)
    with pytest.raises(CheckpointCorruptError, match=r"__0_0\.distcp fails its checksum"):
        _resume(ckpt, io_=io_)
    assert len(readers) == (io_ == "fast")


def test_a_bad_io_setting_names_the_key_and_the_choices(tmp_path):
    with pytest.raises(ValueError, match=r"config key 'checkpoint.io' is 'direct'; expected one of plain, fast"):
        compose_config(["checkpoint.io=direct"])
    with pytest.raises(ValueError, match=r"checkpoint.io"):
        Checkpointer(tmp_path, model=nn.Linear(2, 2), io="odirect")
    assert compose_config([]).checkpoint.io == "fast"  # the default: existing runs unchanged


def test_the_seam_hands_out_dcp_own_writer_and_the_reader_checkpoint_io_names(tmp_path):
    writer, fs = io.hashing_writer(tmp_path, thread_count=1)
    assert type(writer) is FileSystemWriter and type(fs) is DigestFileSystem and writer.fs is fs
    assert not io.verifies_while_reading(tmp_path, io="plain") and io.verifies_while_reading(tmp_path)


def _flip_weight_byte(ckpt: Path, model: nn.Module) -> None:
    """Flip one bit in the middle of the first layer's weight bytes in the checkpoint's shard."""
    shard = ckpt / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    weight = model[0].weight.detach().numpy().tobytes()
    at = data.find(weight)
    assert at > 0, "the first layer's weight bytes are stored as they are in memory"
    data[at + len(weight) // 2] ^= 0x01
    shard.write_bytes(bytes(data))


def test_plain_auto_resume_sets_a_corrupt_newest_aside_and_loads_the_one_before(tmp_path, world_of_one,
                                                                                 monkeypatch):
    _no_fast_reader(monkeypatch)
    model, opt = _trained(seed=0)
    root = tmp_path / "run"
    with Checkpointer(root, model=model, optimizer=opt, io="plain") as ckpt:
        assert ckpt.resume() == 0
        ckpt.save(1)
        at_1 = _tensors(model, opt)
        with torch.no_grad():
            model[0].weight.add_(1.0)
        ckpt.save(2)
    _flip_weight_byte(root / "step_2", model)
    model2, opt2 = _trained(seed=99)
    with Checkpointer(root, model=model2, optimizer=opt2, io="plain") as ckpt:
        assert ckpt.resume() == 1
    assert _same(_tensors(model2, opt2), at_1)
    assert not (root / "step_2").exists() and any("corrupt" in p.name for p in root.iterdir())
