"""Frozen weights written once (checkpoint/frozen.py), the parts that need no ranks: which tensors
are frozen, how a reference is checked, and which shared directories retention may remove."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from fsdpkit.checkpoint.errors import CheckpointCorruptError, CheckpointError
from fsdpkit.checkpoint.frozen import file_sets, frozen_keys, referenced, shared_root, sweep
from fsdpkit.checkpoint.manifest import FORMAT, check_files_present, read_manifest, write_manifest
from fsdpkit.checkpoint.state import CheckpointTarget

RUN = "a" * 32
HASH = "0123456789abcdef"


def manifest(*, shared: list | None = None, version: int = 3, step: int = 1) -> dict:
    m = {"format": FORMAT, "format_version": version, "run_id": RUN, "step": step, "world_size": 1,
         "state_dict_type": "sharded", "fingerprint": {"tensors": {}}, "trainer": {},
         "tensors": {"model.base.weight": {"shape": [2], "dtype": "float32", "hash": HASH}},
         "files": {".metadata": {"size": 1, "xxh3_64": HASH}}}
    if shared is not None:
        m["shared"] = shared
    return m


def ref(name: str, keys=("model.base.weight",), files=None) -> dict:
    files = files or {"__0_0.distcp": {"size": 3, "xxh3_64": HASH}}
    return {"dir": f"shared/{name}", "keys": list(keys), "files": files}


def commit(path: Path, m: dict) -> Path:
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"x")
    write_manifest(path, m)
    return path


@pytest.mark.parametrize("bad, why", [
    ({"shared": [ref("../../etc")]}, "shared/<name>"),
    ({"shared": [{**ref("x"), "dir": "shared/x/../../y"}]}, "shared/<name>"),
    ({"shared": [ref("x", keys=["model.not_there"])]}, "no checksum in `tensors`"),
    ({"shared": [ref("x", files={"../__0_0.distcp": {"size": 3, "xxh3_64": HASH}})]}, "must be a file name"),
    ({"shared": [ref("x")], "version": 2}, "format_version 2 cannot"),
])
def test_a_malformed_reference_is_a_corrupt_checkpoint(tmp_path, bad, why):
    version = bad.pop("version", 3)
    commit(tmp_path / "step_1", manifest(version=version, **bad))
    with pytest.raises(CheckpointCorruptError, match="malformed") as info:
        read_manifest(tmp_path / "step_1")
    assert why in str(info.value)


def test_references_resolve_against_the_checkpoints_root_also_from_the_archive(tmp_path):
    m = manifest(shared=[ref("r")])
    assert shared_root(tmp_path / "step_1") == tmp_path
    archived = tmp_path / "archive" / "20261128T000000.000000Z" / "step_1"
    assert shared_root(archived) == tmp_path
    assert [d for d, _ in file_sets(archived, m)] == [archived, tmp_path / "shared" / "r"]


def test_a_missing_or_truncated_shared_file_is_named_with_its_directory(tmp_path):
    ckpt = commit(tmp_path / "step_1", manifest(shared=[ref(f"{RUN}-step_1-0")]))
    m = read_manifest(ckpt)
    assert check_files_present(ckpt, m) == [f"{tmp_path}/shared/{RUN}-step_1-0/__0_0.distcp is missing"]
    (tmp_path / "shared" / f"{RUN}-step_1-0").mkdir(parents=True)
    (tmp_path / "shared" / f"{RUN}-step_1-0" / "__0_0.distcp").write_bytes(b"xy")
    assert "has 2 bytes, the manifest says 3" in check_files_present(ckpt, m)[0]


def test_retention_sweeps_only_this_runs_unreferenced_shared_directories(tmp_path):
    names = {k: f"{RUN}-step_{i}-0" for i, k in enumerate("abcde")}
    for name in [*names.values(), f"{'b' * 32}-step_1-0"]:
        (tmp_path / "shared" / name).mkdir(parents=True)
    commit(tmp_path / "step_1", manifest(shared=[ref(names["a"])]))
    commit(tmp_path / "step_2.corrupt-20261128T000000.000000Z", manifest(shared=[ref(names["b"])], step=2))
    commit(tmp_path / "archive" / "20261128T000000.000000Z" / "step_3", manifest(shared=[ref(names["c"])], step=3))
    broken = tmp_path / "step_4"  # a damaged manifest still protects what it names
    broken.mkdir()
    (broken / "manifest.json").write_text(json.dumps({"shared": [ref(names["d"])], "step": "garbled"}))
    assert referenced(tmp_path) == {f"shared/{names[k]}" for k in "abcd"}
    assert sweep(tmp_path, run_id=RUN, in_use=f"shared/{names['e']}") == []
    assert sweep(tmp_path, run_id=RUN, in_use=None) == [f"shared/{names['e']}"]
    left = sorted(p.name for p in (tmp_path / "shared").iterdir())
    assert left == sorted([*(names[k] for k in "abcd"), f"{'b' * 32}-step_1-0"])  # another run's: untouched
    (tmp_path / "shared" / f"{RUN}-step_9-0").mkdir()
    (tmp_path / "step_5").mkdir()
    (tmp_path / "step_5" / "manifest.json").write_bytes(b'{"shared": [{"dir": "shar')  # unknown: nothing goes
    with pytest.raises(CheckpointError, match="shared directories are kept"):
        sweep(tmp_path, run_id=RUN, in_use=None)
    assert (tmp_path / "shared" / f"{RUN}-step_9-0").is_dir()


def test_frozen_means_no_gradient_and_not_in_the_optimizer():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
    model[0].requires_grad_(False)
    model[1].weight.requires_grad_(False)  # frozen, but the optimizer holds it: it may change
    opt = torch.optim.SGD([model[1].weight, model[1].bias, *model[2].parameters()], lr=0.1)
    assert frozen_keys(CheckpointTarget(model, opt)) == ["model.0.bias", "model.0.weight"]
    assert frozen_keys(CheckpointTarget(model, None)) == []  # no optimizer: nothing is known to be frozen
    tied = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 8, bias=False))
    tied[1].weight = tied[0].weight
    tied[0].weight.requires_grad_(False)
    assert frozen_keys(CheckpointTarget(tied, torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1))) == [
        "model.0.weight", "model.1.weight"]


def test_a_failed_write_of_the_frozen_tensors_commits_nothing_and_leaves_no_debris(tmp_path, monkeypatch):
    import errno

    from fsdpkit.checkpoint import save
    from fsdpkit.checkpoint.errors import CheckpointSaveError
    from fsdpkit.checkpoint.manager import Checkpointer

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    model[0].requires_grad_(False)
    opt = torch.optim.SGD(model[1].parameters(), lr=0.1)
    ck = Checkpointer(tmp_path, model=model, optimizer=opt)
    ck.resume()
    ck.save(1)
    (first,) = (tmp_path / "shared").iterdir()
    real = save.hashing_writer

    def disk_full(into, **kwargs):  # the test's fault: the new shared directory's first write fails
        if into.parent.name == "shared":
            into.mkdir()
            (into / "__0_0.distcp").write_bytes(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(into, **kwargs)

    monkeypatch.setattr(save, "hashing_writer", disk_full)
    with torch.no_grad():
        model[0].weight.data.mul_(2.0)  # a frozen tensor changed: the save must write it again
    with pytest.raises(CheckpointSaveError, match="writing the frozen tensors to .* failed .*No space left"):
        ck.save(2)
    assert (tmp_path / "latest").read_text() == "step_1\n" and not (tmp_path / "step_2").exists()
    assert list((tmp_path / "shared").iterdir()) == [first]  # the partial directory was removed
    monkeypatch.setattr(save, "hashing_writer", real)
    ck.save(2)
    ck.close()
    written = read_manifest(tmp_path / "step_2")["shared"][0]["dir"]
    assert written != f"shared/{first.name}" and (tmp_path / written).is_dir()
