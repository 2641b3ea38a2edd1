"""Resume across meshes as a user does it, through the CLI: a run started on two launchers under
HSDP 2x2 goes on under FULL_SHARD on 3 ranks, then NO_SHARD on 2, then HSDP 2x2 on two launchers
again; and `fsdpkit resume-check --resume-overrides` proves HSDP 2x2 -> FULL_SHARD 3 on its own."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import fsdpkit  # noqa: E402
from fsdpkit.train.metrics import read_records  # noqa: E402
from nodes import run_nodes  # noqa: E402

pytestmark = pytest.mark.multinode
RTOL = 1e-6
STEPS = 12
# global batch 12: 4 ranks x 3, 3 ranks x 4, 2 ranks x 6 samples, in micro-batches of 1 (accumulation)
ARGS = ["deterministic=true", f"train.max_steps={STEPS}", "train.global_batch_size=12", "train.micro_batch_size=1",
        "train.progress=false", "train.eval_every=0", "optim.warmup_steps=6", "model.vocab_size=1001",
        "checkpoint.every_steps=2"]
HSDP_2X2 = ["strategy.sharding_strategy=HYBRID_SHARD", "strategy.hsdp_shard_size=2"]


def test_hsdp_on_two_launchers_resumes_under_full_shard_3_no_shard_2_and_back(tmp_path):
    full, run = tmp_path / "full", tmp_path / "run"
    run_nodes([*ARGS, *HSDP_2X2, f"run_dir={full}"], logs=tmp_path / "logs_full")
    run_nodes([*ARGS, *HSDP_2X2, "train.stop_at=4", f"run_dir={run}"], logs=tmp_path / "logs_1")
    for nproc, strategy, stop_at in ((3, "FULL_SHARD", 6), (2, "NO_SHARD", 8)):
        proc = fsdpkit("train", "--nproc", str(nproc), *ARGS, f"strategy.sharding_strategy={strategy}",
                       f"train.stop_at={stop_at}", f"run_dir={run}")
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "post-load verification" in proc.stderr  # restored tensors re-hashed against the manifest
    last = run_nodes([*ARGS, *HSDP_2X2, f"run_dir={run}"], logs=tmp_path / "logs_4")
    assert "post-load verification" in "".join(n.stderr() for n in last)

    resumes = [e for e in read_records(run, events=True) if e["event"] == "resume"]
    assert [(e["step"], e["saved_world_size"]) for e in resumes] == [(4, 4), (6, 3), (8, 2)]
    ckpts = run / "checkpoints"
    meshes = {s: json.loads((ckpts / f"step_{s}" / "manifest.json").read_text())["mesh"]["shape"]
              for s in (4, 6, 8, 12)}
    assert meshes == {4: [2, 2], 6: [3], 8: [2, 1], 12: [2, 2]}
    want = {r["step"]: r for r in read_records(full)}
    got = {r["step"]: r for r in read_records(run)}  # a later record wins
    assert sorted(got) == list(range(1, STEPS + 1))
    assert all(got[s]["loss"] == want[s]["loss"] for s in range(1, 5))  # the same mesh: bit-identical
    for key in ("loss", "grad_norm"):
        worst = max(abs(got[s][key] - want[s][key]) / abs(want[s][key]) for s in range(5, STEPS + 1))
        print(f"chain HSDP 2x2 -> FULL_SHARD 3 -> NO_SHARD 2 -> HSDP 2x2: worst {key} rel diff {worst:.2e}")
        assert worst < RTOL, key


def test_resume_check_hsdp_2x2_resumed_under_full_shard_on_3(tmp_path):
    # as docs/how-to/resume-elsewhere.md writes it (resume-check sets its own steps and save cadence)
    proc = fsdpkit("resume-check", "--nproc", "4", "--resume-nproc", "3", "--steps", "8", "--save-at", "4",
                   *ARGS, *HSDP_2X2, "--resume-overrides", "strategy.sharding_strategy=FULL_SHARD",
                   "--work-dir", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    print(proc.stdout)
    assert "resumed on 3 rank(s) with strategy.sharding_strategy=FULL_SHARD" in proc.stdout
    assert "PASS" in proc.stdout and "tolerance 1e-06" in proc.stdout
    resumed = tmp_path / "resumed"
    assert json.loads((resumed / "checkpoints" / "step_4" / "manifest.json").read_text())["mesh"]["shape"] == [2, 2]
    resume = [e for e in read_records(resumed, events=True) if e["event"] == "resume"]
    assert [(e["step"], e["saved_world_size"]) for e in resume] == [(4, 4)]
    assert "FULL_SHARD" in (resumed / "config.yaml").read_text()  # the resumed run's config
