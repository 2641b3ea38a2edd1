"""`fsdpkit train model=hf model.path=DIR` as a user runs it: a Gemma 3 folder written by
save_pretrained (bf16), chat data tokenized with the folder's own tokenizer (no data.tokenizer), one
field overridden; the log says what was overridden and what governs each dtype, and the run records
the config it trained with."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import EXAMPLE_DATA, fsdpkit  # noqa: E402
from fsdpkit.train.metrics import read_records  # noqa: E402
from hf_folders import make_folder  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.filterwarnings("ignore::UserWarning")]


def test_one_flag_from_a_folder_to_a_trained_run(tmp_path, hf_tokenizer_dir):
    folder = make_folder("gemma3_text", tmp_path / "gemma3", tokenizer_dir=hf_tokenizer_dir)
    run = tmp_path / "run"
    proc = fsdpkit("train", "--nproc", "2", "model=hf", f"model.path={folder}", "+model.hf_config.rms_norm_eps=1e-5",
                   "data=hf", f"data.files={EXAMPLE_DATA / 'chat.jsonl'}", "data.messages_field=messages",
                   "data.packing=false", "data.overlong=drop", "data.seq_len=32",
                   f"data.cache_dir={tmp_path / 'cache'}",
                   "train.max_steps=3", "train.global_batch_size=4", "train.micro_batch_size=2", "train.progress=false",
                   f"run_dir={run}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    log = proc.stderr
    assert f"model.hf_config overrides {folder}/config.json: rms_norm_eps: 1e-06 -> 1e-05" in log
    assert "master weights are float32 (the sharded parameters) and AdamW state float32" in log
    assert f"{folder}/config.json's dtype bfloat16 is how the folder stores its weights" in log
    recorded = yaml.safe_load((run / "config.yaml").read_text())
    assert recorded["data"]["tokenizer"] == str(folder)  # the folder's own tokenizer
    hf = recorded["model"]["hf_config"]
    assert hf["model_type"] == "gemma3_text" and hf["rms_norm_eps"] == 1e-5 and hf["sliding_window"] == 32
    losses = [r["loss"] for r in read_records(run)]
    assert len(losses) == 3 and losses[0] != losses[-1]
