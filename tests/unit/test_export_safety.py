"""What export, verify and the checkpoint resolver refuse, on plain DCP checkpoints written by
`dcp.save` (as Lightning or a hand-written loop writes them): truncated files, outputs that
overlap their input, outputs that are not an earlier export, junk `latest` pointers and
uncommitted fsdpkit directories. No process group."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import save_file

from fsdpkit.checkpoint.errors import CheckpointCorruptError, CheckpointError
from fsdpkit.checkpoint.safe_io import read_dcp_metadata
from fsdpkit.export.exporter import export_checkpoint
from fsdpkit.export.sources import open_checkpoint
from fsdpkit.export.verification import verify_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def save_plain_dcp(path: Path) -> Path:
    """A model and its optimizer state in one plain DCP checkpoint (one `__0_0.distcp`)."""
    g = torch.Generator().manual_seed(0)
    model = {"w": torch.randn(8, 4, generator=g), "b": torch.randn(8, generator=g)}
    optim = {"state": {"w": {"exp_avg": torch.randn(8, 4, generator=g), "step": torch.tensor(3.0)}},
             "param_groups": [{"lr": 0.1}]}
    dcp.save({"model": model, "optimizer": optim}, checkpoint_id=path, no_dist=True)
    return path


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    return save_plain_dcp(tmp_path_factory.mktemp("dcp") / "ckpt")


@pytest.fixture
def ckpt(pristine, tmp_path) -> Path:
    return Path(shutil.copytree(pristine, tmp_path / "ckpt"))


def _last_item(ckpt: Path) -> tuple[str, int]:
    """(key, byte length) of the item stored last in __0_0.distcp."""
    storage = read_dcp_metadata(ckpt).storage_data
    index = max(storage, key=lambda i: storage[i].offset)
    assert storage[index].relative_path == "__0_0.distcp"
    return index.fqn, storage[index].length


@pytest.mark.parametrize("reader", ["direct", "dcp"])
def test_a_file_truncated_in_optimizer_bytes_is_refused_by_export(ckpt, tmp_path, reader):
    key, length = _last_item(ckpt)
    assert key.startswith("optimizer.") and length > 64  # the 64 bytes cut hold optimizer state only
    shard = ckpt / "__0_0.distcp"
    os.truncate(shard, shard.stat().st_size - 64)
    with pytest.raises(CheckpointCorruptError, match=rf"(?s)nothing was exported.*{shard} is truncated.*first {key}"):
        export_checkpoint(ckpt, tmp_path / "out", reader=reader)
    assert not (tmp_path / "out").exists()
    report = verify_checkpoint(ckpt)
    assert not report["ok"] and report["bad_files"] == ["__0_0.distcp"]


def test_dcp_reader_errors_name_the_file(ckpt, tmp_path):
    storage = read_dcp_metadata(ckpt).storage_data
    where = next(s for i, s in storage.items() if i.fqn == "model.w")
    shard = ckpt / where.relative_path
    data = bytearray(shard.read_bytes())
    end = where.offset + where.length
    data[end - 40 : end] = bytes(b ^ 0xFF for b in data[end - 40 : end])  # the chunk's zip directory
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptError) as raised:
        export_checkpoint(ckpt, tmp_path / "out", reader="dcp")
    text = str(raised.value)
    assert f"dcp.load of model.w from {shard} failed: RuntimeError: " in text and "ranks:" not in text
    assert f"fsdpkit ckpt verify {ckpt}" in text


def test_export_refuses_outputs_that_overlap_its_source(ckpt, tmp_path):
    before = sorted(p.name for p in ckpt.iterdir())
    (tmp_path / "alias").symlink_to(ckpt)
    cases = {ckpt: "is the source checkpoint", tmp_path / "alias": "is the source checkpoint",
             ckpt / "hf": "lies inside the source checkpoint",
             tmp_path / "alias" / "hf": "lies inside the source checkpoint",
             tmp_path: "contains the source checkpoint"}
    for out, relation in cases.items():
        with pytest.raises(ValueError, match=f"refusing to export to {out}: it {relation} {ckpt}"):
            export_checkpoint(ckpt, out, overwrite=True)
    with pytest.raises(ValueError, match="it is the run directory"):
        export_checkpoint(ckpt, tmp_path / "run", overwrite=True, run_dirs=[tmp_path / "run"])
    assert sorted(p.name for p in ckpt.iterdir()) == before
    export_checkpoint(ckpt, tmp_path / "run" / "export", run_dirs=[tmp_path / "run"])  # inside the run: allowed


def test_overwrite_replaces_only_an_earlier_export(ckpt, tmp_path):
    out = tmp_path / "hf"
    export_checkpoint(ckpt, out)
    with safe_open(out / "model.safetensors", framework="pt") as f:
        assert f.metadata()["exported_by"].startswith("fsdpkit ")
    export_checkpoint(ckpt, out, dtype="bf16", overwrite=True)  # an earlier export: replaced
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"refusing to replace .*hf: it holds notes.txt, which an export does not "
                                         r"write"):
        export_checkpoint(ckpt, out, overwrite=True)
    assert (out / "notes.txt").read_text() == "mine"

    foreign = tmp_path / "theirs"
    foreign.mkdir()
    save_file({"x": torch.ones(2)}, foreign / "model.safetensors")
    with pytest.raises(ValueError, match="was not written by fsdpkit's export"):
        export_checkpoint(ckpt, foreign, overwrite=True)
    with pytest.raises(ValueError, match="was not written by fsdpkit's export"):
        export_checkpoint(ckpt, foreign / "model.safetensors", fmt="single", overwrite=True)
    log = tmp_path / "metrics.jsonl"
    log.write_text('{"step": 1}\n')
    with pytest.raises(ValueError, match="is not a safetensors file"):
        export_checkpoint(ckpt, log, fmt="single", overwrite=True)
    assert log.read_text() == '{"step": 1}\n' and sorted(p.name for p in foreign.iterdir()) == ["model.safetensors"]
    export_checkpoint(ckpt, tmp_path / "one.safetensors", fmt="single")
    export_checkpoint(ckpt, tmp_path / "one.safetensors", fmt="single", overwrite=True)


@pytest.mark.parametrize(("content", "what"), [
    (b"\xff\xfe\x00junk", "is not text"),
    (b"", "is empty"),
    (b" \n", "is empty"),
    (b"step_9\n", "names step_9, which does not exist in"),
    (b"../elsewhere\n", "names '../elsewhere', which lies outside"),
    (b"/etc\n", "names '/etc', which lies outside"),
    (b"step_1\nstep_2\n", "holds 'step_1\\nstep_2', not one directory name"),
])
def test_a_junk_latest_is_named_with_what_is_wrong(pristine, tmp_path, content, what):
    root = tmp_path / "checkpoints"
    root.mkdir()
    (root / "step_1").mkdir()
    (tmp_path / "elsewhere").mkdir()
    (root / "latest").write_bytes(content)
    for path in (root, tmp_path):  # a checkpoints root, a run directory
        with pytest.raises(CheckpointError, match=re.escape(f"{root / 'latest'} {what}")):
            open_checkpoint(path)
        report = verify_checkpoint(path)
        assert not report["ok"] and report["bad_files"] == ["latest"] and what in report["problems"][0]
    from fsdpkit.checkpoint.catalog import LatestPointerError, follow_latest  # new with this test

    with pytest.raises(LatestPointerError, match=re.escape(f"{root / 'latest'} {what}")):
        follow_latest(root)


def test_uncommitted_fsdpkit_directories_are_named_not_verified_as_plain_dcp(pristine, tmp_path):
    root = tmp_path / "run" / "checkpoints"
    shutil.copytree(pristine, root / "step_4")  # DCP files, no manifest.json: a save that never committed
    (root / "step_8").mkdir()  # a save that died before writing anything
    for ckpt in (root / "step_4", root / "step_8"):
        report = verify_checkpoint(ckpt)
        assert not report["ok"] and report["kind"] == "fsdpkit" and report["bad_files"] == ["manifest.json"]
        assert report["problems"] == [f"NOT COMMITTED: {ckpt} has no manifest.json: it is an fsdpkit checkpoint that "
                                      "was never committed" + report["problems"][0].split("was never committed")[1]]
        with pytest.raises(CheckpointError, match="NOT COMMITTED"):
            export_checkpoint(ckpt, tmp_path / "out")
    (root / "latest").write_text("step_4\n")
    assert "NOT COMMITTED" in verify_checkpoint(root)["problems"][0]
    shutil.copytree(pristine, tmp_path / "theirs" / "step_7")  # another tool's DCP checkpoint, named alike
    report = verify_checkpoint(tmp_path / "theirs" / "step_7")
    assert report["ok"] and report["kind"] == "dcp"
