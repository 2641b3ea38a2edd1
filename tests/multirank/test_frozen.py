"""Frozen weights written once (checkpoint/frozen.py): later checkpoints reference the frozen base
instead of writing it, a frozen tensor changed on purpose is written again, retention keeps what
is referenced, and resume (same and other world size), verify and export follow the references.
The scenario runs once on 2 gloo ranks (tests/multirank/frozen_worker.py); the checks here compare
with the worker's own full state dicts (torch.equal), not with fsdpkit's checksums."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import torchrun

pytestmark = pytest.mark.dist
WORKER = Path(__file__).with_name("frozen_worker.py")
BASE = ["model.base.0.bias", "model.base.0.weight", "model.base.2.bias", "model.base.2.weight"]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("frozen")
    torchrun(2, WORKER, str(out))
    return out, json.loads((out / "report.json").read_text())


def _copy(run, tmp_path) -> Path:
    root = tmp_path / "ckpt"
    shutil.copytree(run[0] / "ckpt", root)
    return root


def _base_file(root: Path) -> Path:
    (shared,) = (root / "shared").iterdir()
    return shared / "__0_0.distcp"


def test_later_checkpoints_reference_the_frozen_base_instead_of_writing_it(run):
    saves = run[1]["saves"]
    first = saves[0]["shared"]
    assert len(first) == 1 and first[0].startswith("shared/")
    for save in saves[:4]:
        assert save["shared"] == first and save["format_version"] == 3
        assert save["shared_keys"] == [BASE]
        assert not set(BASE) & set(save["metadata_keys"])  # the step's own files hold no frozen tensor
        assert "model.head.weight" in save["metadata_keys"]
    # one shared directory for four saves
    assert saves[3]["shared_on_disk"] == [first[0].removeprefix("shared/")]
    # a step's own files are the same size at every save: the base is in none of them
    assert len({s["bytes"] for s in saves[1:4]}) == 1


def test_a_frozen_tensor_changed_on_purpose_is_written_again(run):
    out, report = run
    saves = report["saves"]
    assert saves[4]["shared"] != saves[3]["shared"]  # step 5 saw the change through `.data` and wrote anew
    before, after = torch.load(out / "dump_4.pt"), torch.load(out / "dump_5.pt")
    assert not torch.equal(before["model.base.0.weight"], after["model.base.0.weight"])
    assert torch.equal(before["model.base.2.weight"], after["model.base.2.weight"])


def test_retention_removes_a_shared_directory_only_when_nothing_references_it(run):
    saves = run[1]["saves"]
    # keep_last=2: step_4 went at step 6, and with it the last reference to the first directory
    both = saves[3]["shared"] + saves[4]["shared"]
    assert saves[4]["shared_on_disk"] == sorted(d.removeprefix("shared/") for d in both)
    assert saves[5]["shared_on_disk"] == [saves[5]["shared"][0].removeprefix("shared/")]
    assert saves[5]["shared"] == saves[4]["shared"]
    assert [n for n in saves[5]["on_disk"] if n.startswith("step_")] == ["step_5", "step_6"]


def test_resume_restores_every_tensor_bitwise(run):
    out, report = run
    assert report["resumed_step"] == 6
    saved, resumed = torch.load(out / "dump_6.pt"), torch.load(out / "resumed.pt")
    assert saved.keys() == resumed.keys() and set(BASE) <= saved.keys()
    for key in saved:
        assert torch.equal(saved[key], resumed[key]), key


def test_async_saves_share_the_base_too(run):
    saves = run[1]["async"]
    assert saves[0]["shared"] == saves[1]["shared"] and len(saves[0]["shared"]) == 1
    assert not set(BASE) & set(saves[1]["metadata_keys"])


def test_a_checkpoint_resumes_on_one_process_and_exports_with_its_shared_tensors(run, tmp_path):
    from frozen_worker import LoraNet

    from fsdpkit.checkpoint.manager import Checkpointer
    from fsdpkit.export.exporter import export_checkpoint

    out, _ = run
    root = _copy(run, tmp_path)
    saved = torch.load(out / "dump_6.pt")
    model = LoraNet()
    model.base.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ck = Checkpointer(root, model=model, optimizer=opt)  # 1 process: an elastic resume of a 2-rank save
    assert ck.resume() == 6
    ck.close()
    for key, value in model.state_dict().items():
        assert torch.equal(value, saved[f"model.{key}"]), key
    export_checkpoint(root / "step_6", tmp_path / "export.safetensors", dtype="fp32", fmt="single")
    exported = load_file(tmp_path / "export.safetensors")
    assert set(exported) == {k.removeprefix("model.") for k in saved if k.startswith("model.")}
    for key, value in exported.items():
        assert torch.equal(value, saved[f"model.{key}"]), key


def test_verify_follows_the_references_and_names_a_damaged_shared_file(run, tmp_path):
    from fsdpkit.export.verification import verify_checkpoint

    root = _copy(run, tmp_path)
    good = verify_checkpoint(root / "step_6", tensors=True)
    assert good["ok"], good["problems"]
    assert "shared" in good["checksums"] and good["checked"]["tensor_checksums"] == len(
        json.loads((root / "step_6" / "manifest.json").read_text())["tensors"])
    base = _base_file(root)
    data = bytearray(base.read_bytes())
    data[len(data) // 2] ^= 0x01
    base.write_bytes(bytes(data))
    bad = verify_checkpoint(root / "step_6")
    assert not bad["ok"]
    assert bad["bad_files"] == [f"shared/{base.parent.name}/{base.name}"], bad
    base.unlink()
    gone = verify_checkpoint(root / "step_6")
    assert not gone["ok"] and any("missing" in p for p in gone["problems"])


def test_auto_resume_skips_every_checkpoint_whose_shared_file_is_corrupt(run, tmp_path):
    from fsdpkit.checkpoint.frozen import referenced, sweep
    from fsdpkit.checkpoint.resolve import resolve_checkpoint

    root = _copy(run, tmp_path)
    base = _base_file(root)
    data = bytearray(base.read_bytes())
    data[-100] ^= 0x10
    base.write_bytes(bytes(data))
    assert resolve_checkpoint("auto", ckpt_root=root, group=None) is None  # step_5 and step_6 both reference it
    aside = sorted(p.name for p in root.iterdir() if ".corrupt-" in p.name)
    assert [n.split(".")[0] for n in aside] == ["step_5", "step_6"]
    # the moved-aside manifests still protect the directory they name
    assert f"shared/{base.parent.name}" in referenced(root)
    run_id = base.parent.name.split("-")[0]
    assert sweep(root, run_id=run_id, in_use=None) == [] and base.parent.is_dir()


def test_on_object_storage_the_base_is_written_once_and_read_back(tmp_path):
    """One process against moto's S3 server: the shared directory is an object prefix; retention,
    resume, verify and export go through the bucket."""
    import boto3
    from frozen_worker import LoraNet

    from fsdpkit.checkpoint.manager import Checkpointer
    from fsdpkit.checkpoint.safe_io import read_dcp_metadata
    from fsdpkit.export.exporter import export_checkpoint
    from fsdpkit.export.verification import verify_checkpoint
    from s3_server import s3_server

    def build(seed: int) -> tuple[LoraNet, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = LoraNet()
        model.base.requires_grad_(False)
        return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)

    import fsspec

    with s3_server() as server:
        fsspec.get_filesystem_class("s3").clear_instance_cache()  # no s3fs of another server's endpoint
        bucket = server.new_bucket()
        url = f"s3://{bucket}/run"
        model, opt = build(0)
        ck = Checkpointer(url, model=model, optimizer=opt, keep_last=1)
        ck.resume()
        for step in (1, 2, 3):
            model(torch.randn(4, 16)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            ck.save(step)
        ck.close()
        keys = [o["Key"] for o in boto3.client("s3", endpoint_url=server.endpoint).list_objects_v2(
            Bucket=bucket)["Contents"]]
        shared = sorted({k.split("/")[2] for k in keys if k.startswith("run/shared/")})
        assert len(shared) == 1  # written by step 1, referenced by steps 2 and 3
        assert sorted({k.split("/")[1] for k in keys if k.startswith("run/step_")}) == ["step_3"]  # keep_last=1
        own = read_dcp_metadata(f"{url}/step_3").state_dict_metadata
        assert "model.head.weight" in own and not set(BASE) & set(own)
        fresh, fresh_opt = build(1)
        again = Checkpointer(url, model=fresh, optimizer=fresh_opt)
        assert again.resume() == 3
        again.close()
        for key, value in model.state_dict().items():
            assert torch.equal(value, fresh.state_dict()[key]), key
        report = verify_checkpoint(f"{url}/step_3")
        assert report["ok"] and "shared" in report["checksums"], report
        export_checkpoint(f"{url}/step_3", tmp_path / "out.safetensors", dtype="fp32", fmt="single")
        exported = load_file(tmp_path / "out.safetensors")
        for key, value in model.state_dict().items():
            assert torch.equal(exported[key], value), key
        fsspec.get_filesystem_class("s3").clear_instance_cache()  # nor one of this server's, once it stops


def test_inspect_names_the_shared_directory(run, capsys):
    from fsdpkit.cli.main import main

    root = run[0] / "ckpt"
    (shared,) = (root / "shared").iterdir()
    assert main(["ckpt", "inspect", str(root / "step_6")]) == 0
    out = capsys.readouterr().out
    assert "4 frozen tensors" in out and f"shared/{shared.name}, written once and referenced" in out
    assert "model.base.0.weight" in out  # listed among the checkpoint's tensors
