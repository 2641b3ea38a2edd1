"""`fsdpkit train` as a user runs it: through the launcher, with its files and its errors."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import fsdpkit  # noqa: E402
from fsdpkit.train.metrics import read_records

pytestmark = pytest.mark.e2e


def read_metrics(run_dir: Path) -> list[dict]:
    return read_records(run_dir)


def test_train_nproc_2_writes_run_directory(tmp_path):
    run_dir = tmp_path / "run"
    proc = fsdpkit("train", "--nproc", "2", "experiment=demo", "train.max_steps=12", "train.eval_every=6",
                   f"run_dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "world size 2" in proc.stderr and f"run directory: {run_dir}" in proc.stderr
    assert "global batch: 16 samples per step over 2 rank(s), 2 micro-batch(es) per rank of at most 4" in proc.stderr
    assert "resolved config" in proc.stderr and "sharding_strategy: FULL_SHARD" in proc.stderr
    assert "precision: policy.mixed_precision='fp32'" in proc.stderr
    assert {p.name for p in run_dir.iterdir()} >= {"config.yaml", "metrics.jsonl", "summary.json"}
    assert "max_steps: 12" in (run_dir / "config.yaml").read_text()
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, 13))
    assert {"loss", "grad_norm", "lr", "tokens_per_s", "step_time_s", "peak_mem_mib"} <= records[0].keys()
    assert [r["step"] for r in records if "val_loss" in r] == [6, 12]
    assert records[-1]["loss"] < records[0]["loss"] - 0.3
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 12 and summary["last_loss"] == records[-1]["loss"]


def test_config_errors_fail_before_any_process_starts(tmp_path):
    proc = fsdpkit("train", "--nproc", "2", "train.bogus=1")
    assert proc.returncode == 2
    assert "unknown config key 'train.bogus'" in proc.stderr
    assert "torch.distributed" not in proc.stderr and "OMP_NUM_THREADS" not in proc.stderr
    proc = fsdpkit("train", "--nproc", "3", "train.global_batch_size=2", "train.micro_batch_size=4")
    assert proc.returncode == 2 and "train.global_batch_size=2 is smaller than the world size (3 ranks)" in proc.stderr
    # packing a model that carries state across tokens outside attention (Falcon-H1's Mamba mixers)
    proc = fsdpkit("train", "--nproc", "2", "model=hf", "+model.hf_config.model_type=falcon_h1", "data=hf",
                   "data.files=[chats.jsonl]", f"data.tokenizer={tmp_path}", f"run_dir={tmp_path / 'run'}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "FalconH1ForCausalLM has layers that carry state" in proc.stderr and "FalconH1Mixer" in proc.stderr
    assert "data.packing=false" in proc.stderr and "torch.distributed" not in proc.stderr


def test_wrap_policy_typo_fails_with_the_model_classes(tmp_path):
    proc = fsdpkit("train", "policy.auto_wrap_policy=[torch.nn.Linearr]", f"run_dir={tmp_path}")
    assert proc.returncode == 2
    assert "policy.auto_wrap_policy: cannot import 'torch.nn.Linearr'" in proc.stderr


def test_single_process_run_on_text_and_token_files(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    proc = fsdpkit("train", "data=text", f"data.path={text}", "train.max_steps=3", "data.seq_len=32",
                   f"run_dir={tmp_path / 'text'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(read_metrics(tmp_path / "text")) == 3
    tokens = tmp_path / "train.bin"
    (np.arange(40_000, dtype=np.uint32) * 7 % 500).astype(np.uint32).tofile(tokens)
    proc = fsdpkit("train", "data=tokens", f"data.path={tokens}", "data.token_dtype=uint32", "data.seq_len=32",
                   "train.max_steps=3", f"run_dir={tmp_path / 'tokens'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(read_metrics(tmp_path / "tokens")) == 3


def test_config_show_and_docs():
    proc = fsdpkit("config", "show", "experiment=[demo,bf16]")
    assert proc.returncode == 0 and "mixed_precision: bf16-mixed" in proc.stdout and "name: demo" in proc.stdout
    proc = fsdpkit("config", "docs")
    assert proc.returncode == 0 and "strategy.sharding_strategy" in proc.stdout
