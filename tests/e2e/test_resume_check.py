"""`fsdpkit resume-check` on the demo config: passes when resume is seamless, fails with its table
when a piece of state is lost on resume."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import ROOT, fsdpkit  # noqa: E402

pytestmark = pytest.mark.e2e
ARGS = ["--steps", "8", "--save-at", "4", "experiment=demo", "train.global_batch_size=12", "train.micro_batch_size=2"]


def test_passes_at_same_world_size_bitwise(tmp_path):
    proc = fsdpkit("resume-check", *ARGS, "--work-dir", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "PASS: worst relative difference 0.000e+00, tolerance 0e+00" in proc.stdout
    assert proc.stdout.count("0.00e+00") >= 8  # 4 steps x (loss, grad norm)


def test_passes_at_another_world_size(tmp_path):
    proc = fsdpkit("resume-check", "--resume-nproc", "3", *ARGS, "--work-dir", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "resumed on 3 rank(s)" in proc.stdout and "tolerance 1e-06" in proc.stdout


@pytest.mark.parametrize("dropped", ["scheduler", "data"])
def test_fails_when_state_is_left_out(tmp_path, dropped):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FSDPKIT_TEST_SKIP_RESTORE": dropped}
    proc = subprocess.run([sys.executable, "-m", "fsdpkit", "resume-check", *ARGS, "--work-dir", str(tmp_path)],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    assert "<-- beyond tolerance" in proc.stdout and "FAIL" in proc.stdout
