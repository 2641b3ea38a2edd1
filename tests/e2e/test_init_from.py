"""export.on_finish and model.init_from through `fsdpkit train`: the exported weights, read back
slice by slice on each rank, are exactly the checkpoint's."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import fsdpkit  # noqa: E402
from fsdpkit.train.metrics import read_records  # noqa: E402

pytestmark = pytest.mark.e2e
ARGS = ["experiment=demo", "deterministic=true", "train.eval_every=0"]


def test_export_on_finish_then_init_from_equals_loading_the_checkpoint(tmp_path):
    src = tmp_path / "src"
    proc = fsdpkit("train", "--nproc", "2", *ARGS, "train.max_steps=4", "export.on_finish=true", "export.dtype=fp32",
                   f"run_dir={src}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    export = src / "export"
    assert {p.name for p in export.iterdir()} == {"config.json", "generation_config.json", "model.safetensors"}
    assert "exported the final weights to" in proc.stderr

    first_loss = {}
    for name, how in (("from_hf", f"model.init_from=hf:{export}"),
                      ("model_only", f"checkpoint.resume={src / 'checkpoints' / 'step_4'}")):
        run = tmp_path / name
        extra = ["checkpoint.resume_mode=model_only"] if name == "model_only" else ["checkpoint.resume=none"]
        proc = fsdpkit("train", "--nproc", "2", *ARGS, "train.max_steps=1", how, *extra, f"run_dir={run}")
        assert proc.returncode == 0, proc.stderr[-3000:]
        first_loss[name] = read_records(run)[0]["loss"]
    assert first_loss["from_hf"] == first_loss["model_only"]
    assert first_loss["from_hf"] < json.loads((src / "summary.json").read_text())["first_loss"]  # trained weights
