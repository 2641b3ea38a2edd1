"""The Checkpointer API in a hand-written FSDP2 loop on a transformers model (examples/own_loop.py),
as a user runs it under torchrun: an interrupted run resumes bit-identically on 2 ranks and
elastically on 3, and the resume is the one the records say (step, saved world size)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import ROOT, run_python  # noqa: E402
from fsdpkit.checkpoint.manifest import read_manifest  # noqa: E402

pytestmark = pytest.mark.e2e
EXAMPLE = ROOT / "examples" / "own_loop.py"


def _run(nproc: int, ckpt_dir: Path, out: Path, *args: str) -> dict:
    proc = run_python("-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(EXAMPLE),
                      "--ckpt-dir", str(ckpt_dir), "--steps", "8", "--save-every", "4", "--out", str(out), *args)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def test_own_loop_resumes_bitwise_and_elastically(tmp_path):
    full = _run(2, tmp_path / "full", tmp_path / "full.json")
    assert full["resumed"] is None and sorted(map(int, full["losses"])) == list(range(1, 9))

    first = _run(2, tmp_path / "ckpt", tmp_path / "first.json", "--stop-at", "4")
    assert sorted(map(int, first["losses"])) == [1, 2, 3, 4]
    manifest = read_manifest(tmp_path / "ckpt" / "step_4")
    assert sorted(manifest["trainer"]) == ["data", "loss_ema", "scheduler"]
    assert manifest["trainer"]["data"] == {"position": 24}
    assert manifest["trainer"]["loss_ema"]["value"] == {"__tensor__": "state.loss_ema.value"}
    assert "state.loss_ema.value" in manifest["tensors"]  # checksummed like the model
    shutil.copytree(tmp_path / "ckpt", tmp_path / "elastic")

    same = _run(2, tmp_path / "ckpt", tmp_path / "same.json")
    assert (same["resumed"]["step"], same["resumed"]["saved_world_size"]) == (4, 2)
    assert {k: v for k, v in same["losses"].items()} == {k: full["losses"][k] for k in same["losses"]}
    assert sorted(map(int, same["losses"])) == [5, 6, 7, 8]
    assert same["ema"] == full["ema"]  # a tensor in the user's state came back exactly

    elastic = _run(3, tmp_path / "elastic", tmp_path / "elastic.json")
    assert (elastic["resumed"]["step"], elastic["resumed"]["saved_world_size"]) == (4, 2)
    for step, loss in elastic["losses"].items():
        assert abs(loss - full["losses"][step]) <= 1e-6 * abs(full["losses"][step]), step
    assert read_manifest(tmp_path / "elastic" / "step_8")["world_size"] == 3
