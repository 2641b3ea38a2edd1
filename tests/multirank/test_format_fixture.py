"""A checkpoint of format version 2, written once by fsdpkit and checked in
(tests/fixtures/ckpt_format2, made by tests/fixtures/make_ckpt_format2.py), that every later
version must keep reading: `fsdpkit ckpt verify` says OK, and resuming it (one torchrun launch, 2
gloo ranks) restores bit for bit the model and AdamW state that the maker dumped from memory
(expected_state.safetensors, not read back through fsdpkit) and trains the next two steps to
the maker's figures (the first follows from the weights and the data cursor, the second from the
AdamW state too). The fixture is copied to a temporary directory first: nothing writes into tests/.

A failure here means checkpoints users already have no longer load as they did. Never make the
fixture again to pass it: fix the reader, or, for a deliberate format change, keep this fixture,
add one for the new version, and describe the change in docs/checkpoint-format.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import ROOT, torchrun  # noqa: E402
from fsdpkit.cli.main import main as fsdpkit_main  # noqa: E402

pytestmark = pytest.mark.dist
FIXTURE = ROOT / "tests" / "fixtures" / "ckpt_format2"
WORKER = ROOT / "tests" / "multirank" / "format_fixture_worker.py"
# Where the maker ran, the resumed steps' figures were bit for bit its own; another CPU may round the matmuls
# differently (other kernels), as runs at different world sizes do (tests/multirank/test_checkpoint.py).
FP32_RTOL = 1e-6


def tree_digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def verify_and_resume(fixture: Path, worker: Path, tmp: Path, *, checkpoints: str = "") -> tuple[Path, dict, dict]:
    """Copy `fixture` into `tmp`, run `fsdpkit ckpt verify --tensors` on the copy's saved step (under
    `checkpoints`, if given) and `worker` on 2 ranks: (the copy, expected.json, the worker's report
    with `verify` and `loaded_state` added); the fixture unchanged after both."""
    before = tree_digest(fixture)
    copy = tmp / fixture.name
    shutil.copytree(fixture, copy)
    expected = json.loads((copy / "expected.json").read_text())
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):  # `fsdpkit ckpt verify`, in this process (no interpreter start)
        code = fsdpkit_main(["ckpt", "verify", "--tensors", str(copy / checkpoints / f"step_{expected['saved_step']}")])
    (tmp / "work").mkdir()
    torchrun(2, worker, str(copy), str(tmp / "report.json"), str(tmp / "work"))
    report = json.loads((tmp / "report.json").read_text())
    report["verify"] = {"returncode": code, "stdout": printed.getvalue()}
    report["loaded_state"] = str(tmp / "work" / "loaded_state.safetensors")
    assert tree_digest(fixture) == before, f"something wrote into {fixture}"
    return copy, expected, report


@pytest.fixture(scope="module")
def resumed(tmp_path_factory) -> tuple[Path, dict, dict]:
    return verify_and_resume(FIXTURE, WORKER, tmp_path_factory.mktemp("format2"))


def test_the_fixture_is_the_format_it_claims():
    expected = json.loads((FIXTURE / "expected.json").read_text())
    manifest = json.loads((FIXTURE / f"step_{expected['saved_step']}" / "manifest.json").read_text())
    assert (manifest["format"], manifest["format_version"]) == ("fsdpkit-checkpoint", 2) == \
        ("fsdpkit-checkpoint", expected["format_version"])
    assert (manifest["step"], manifest["world_size"], manifest["tensor_hash"]) == (2, 2, "xxh3_64-rows")
    on_disk = sorted(p.name for p in (FIXTURE / "step_2").iterdir())
    assert on_disk == sorted([*manifest["files"], "manifest.json"]) == \
        [".metadata", "__0_0.distcp", "__1_0.distcp", "manifest.json"]


def test_ckpt_verify_says_ok(resumed):
    _, _, report = resumed
    verify = report["verify"]
    assert verify["returncode"] == 0, verify
    assert "OK: every file and chunk is present and intact" in verify["stdout"]
    assert "recomputed for 3 files and" in verify["stdout"]  # file and tensor checksums, --tensors


def test_resume_restores_the_saved_state_bitwise(resumed):
    copy, expected, report = resumed
    assert report["start"] == expected["saved_step"] == report["resumed"]["step"]
    saved = load_file(str(copy / "expected_state.safetensors"))
    loaded = load_file(report["loaded_state"])
    assert saved.keys() == loaded.keys()
    assert any(k.endswith(".exp_avg_sq") for k in saved) and "model.model.embed_tokens.weight" in saved
    assert saved["model.model.embed_tokens.weight"].shape[0] == 65  # rows split unevenly over 2 ranks
    for key in saved:  # model parameters, AdamW exp_avg, exp_avg_sq and step
        assert saved[key].dtype == loaded[key].dtype and torch.equal(saved[key], loaded[key]), key


def test_the_next_steps_match_the_makers(resumed):
    _, expected, report = resumed
    got = {r["step"]: r for r in report["records"]}
    assert sorted(got) == [want["step"] for want in expected["next_steps"]] == [3, 4]
    for want in expected["next_steps"]:
        step = want["step"]
        assert got[step]["lr"] == want["lr"], step  # the schedule, restored exactly
        for key in ("loss", "grad_norm"):
            assert abs(got[step][key] - want[key]) <= FP32_RTOL * abs(want[key]), (step, key, got[step][key], want[key])
