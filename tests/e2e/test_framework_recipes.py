"""The Checkpointer inside other frameworks' FSDP2 recipes, run as users run them (CPU/gloo): the Accelerate
script (examples/accelerate_fsdp2.py) and the Lightning ModelParallelStrategy module
(examples/lightning_fsdp2.py), each resumed elastically 2 -> 3 from its step-2 checkpoint and
exported with --config into a folder transformers loads (Accelerate: with the live model's logits)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import ROOT, torchrun  # noqa: E402
from fsdpkit.checkpoint.manifest import read_manifest  # noqa: E402
from fsdpkit.cli.main import main  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.filterwarnings("ignore::UserWarning")]


def _run_then_resume_on_3(script: Path, tmp_path: Path) -> tuple[dict, dict]:
    """4 steps on 2 ranks saving every 2 (into a/), then steps 3-4 on 3 ranks resumed from a/step_2
    (into b/); the records each run wrote. Losses after the resume match within 1e-6."""
    common = ["--steps", "4", "--save-every", "2"]  # under torch.distributed.run, as the examples say to run them
    torchrun(2, script, "--ckpt-dir", str(tmp_path / "a"), "--hf-config", str(tmp_path / "hf"),
             "--out", str(tmp_path / "a.json"), *common, elastic=True)
    torchrun(3, script, "--ckpt-dir", str(tmp_path / "b"), "--resume", str(tmp_path / "a" / "step_2"),
             "--out", str(tmp_path / "b.json"), *common, elastic=True)
    first, second = (json.loads((tmp_path / f"{run}.json").read_text()) for run in ("a", "b"))
    assert sorted(map(int, second["losses"])) == [3, 4]
    for step, loss in second["losses"].items():
        assert abs(loss - first["losses"][step]) <= 1e-6 * abs(loss), step
    manifest = read_manifest(tmp_path / "a" / "step_2")
    assert manifest["world_size"] == 2 and manifest["trainer"]["data"] == {"position": 12}
    assert read_manifest(tmp_path / "b" / "step_4")["world_size"] == 3
    return first, second


def _export_and_load(tmp_path: Path, capsys):
    """`fsdpkit ckpt export a/ out --config hf` and transformers' load of it (no missing or unexpected keys)."""
    from transformers import AutoModelForCausalLM

    code = main(["ckpt", "export", str(tmp_path / "a"), str(tmp_path / "out"), "--config", str(tmp_path / "hf")])
    assert code == 0, capsys.readouterr().err
    loaded, info = AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert (info["missing_keys"], info["unexpected_keys"]) == (set(), set())
    return loaded.eval()


def test_accelerate_fsdp2_script_resumes_elastically_and_exports(tmp_path, capsys):
    pytest.importorskip("accelerate")
    first, second = _run_then_resume_on_3(ROOT / "examples" / "accelerate_fsdp2.py", tmp_path)
    assert first["resumed"] is None and first["world_size"] == 2 and sorted(map(int, first["losses"])) == [1, 2, 3, 4]
    assert first["sharding"]["all_dtensor"] is True
    assert first["sharding"]["fsdp_units"] >= 3  # Accelerate applied fully_shard per decoder layer and the root
    assert (second["resumed"]["step"], second["resumed"]["saved_world_size"], second["world_size"]) == (2, 2, 3)
    loaded = _export_and_load(tmp_path, capsys)
    with torch.no_grad():
        logits = loaded(input_ids=torch.arange(12).reshape(1, 12)).logits
    torch.testing.assert_close(logits, torch.tensor(first["probe"]), rtol=1e-5, atol=1e-5)


def test_lightning_model_parallel_module_resumes_elastically_and_exports(tmp_path, capsys):
    pytest.importorskip("lightning")
    first, second = _run_then_resume_on_3(ROOT / "examples" / "lightning_fsdp2.py", tmp_path)
    assert (first["resumed_step"], first["global_step"], first["world_size"]) == (0, 4, 2)
    assert first["sharding"] == {"fsdp_units": 3, "dtensor_layers": True}  # configure_model's fully_shard
    assert "model.embed_tokens.weight" in read_manifest(tmp_path / "a" / "step_2")["fingerprint"]["tensors"]
    assert (second["resumed_step"], second["global_step"], second["world_size"]) == (2, 4, 3)
    _export_and_load(tmp_path, capsys)
