"""A checkpoint of format version 3 (its manifest references a shared directory of frozen
tensors), written once by fsdpkit and checked in (tests/fixtures/ckpt_format3, made by
tests/fixtures/make_ckpt_format3.py), that every later version must keep reading: `fsdpkit ckpt
verify --tensors` says OK and checks the shared files, and resuming it (2 gloo ranks) restores bit
for bit the model (frozen base included) and AdamW state that the maker dumped from memory, and
trains the next step to the maker's loss. The fixture is copied first: nothing writes into tests/.

A failure here means checkpoints users already have no longer load as they did. Never make the
fixture again to pass it (see tests/multirank/test_format_fixture.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_format_fixture import FP32_RTOL, verify_and_resume

from conftest import ROOT

pytestmark = pytest.mark.dist
FIXTURE = ROOT / "tests" / "fixtures" / "ckpt_format3"
WORKER = ROOT / "tests" / "multirank" / "format3_fixture_worker.py"


@pytest.fixture(scope="module")
def resumed(tmp_path_factory) -> tuple[Path, dict, dict]:
    return verify_and_resume(FIXTURE, WORKER, tmp_path_factory.mktemp("format3"), checkpoints="checkpoints")


def test_the_fixture_is_the_format_it_claims():
    manifest = json.loads((FIXTURE / "checkpoints" / "step_2" / "manifest.json").read_text())
    assert (manifest["format"], manifest["format_version"], manifest["step"]) == ("fsdpkit-checkpoint", 3, 2)
    (ref,) = manifest["shared"]
    assert ref["keys"] == ["model.base.0.bias", "model.base.0.weight", "model.base.2.bias", "model.base.2.weight"]
    shared = FIXTURE / "checkpoints" / ref["dir"]
    assert sorted(p.name for p in shared.iterdir()) == sorted(ref["files"]) == [".metadata", "__0_0.distcp",
                                                                                 "__1_0.distcp"]
    assert sorted(p.name for p in (FIXTURE / "checkpoints").iterdir()) == ["latest", "shared", "step_2"]


def test_ckpt_verify_says_ok_and_checks_the_shared_files(resumed):
    verify = resumed[2]["verify"]
    assert verify["returncode"] == 0, verify
    assert "recomputed for 6 files (3 of them shared: frozen tensors) and" in verify["stdout"], verify


def test_resume_restores_the_saved_state_bitwise_and_trains_on(resumed):
    copy, expected, report = resumed
    assert report["start"] == report["resumed"] == expected["saved_step"]
    saved, loaded = load_file(str(copy / "expected_state.safetensors")), load_file(report["loaded_state"])
    assert saved.keys() == loaded.keys() and "model.base.0.weight" in saved and "optim.head.weight.exp_avg" in saved
    for key in saved:
        assert saved[key].dtype == loaded[key].dtype and torch.equal(saved[key], loaded[key]), key
    want = expected["next_step"]["loss"]
    assert abs(report["loss"] - want) <= FP32_RTOL * abs(want), (report["loss"], want)
