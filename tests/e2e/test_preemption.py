"""Preemption signals, a failure on one rank, and retention, through `fsdpkit train` as a user
(or SLURM, or Kubernetes) runs it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import ROOT, fsdpkit  # noqa: E402
from faults import env as faults_env  # noqa: E402
from faults import fired, raise_at  # noqa: E402
from fsdpkit.checkpoint.preemption import EXIT_PREEMPTED  # noqa: E402
from fsdpkit.train.metrics import read_records  # noqa: E402

pytestmark = pytest.mark.e2e
ARGS = ["--nproc", "2", "experiment=demo", "deterministic=true", "train.max_steps=60", "train.eval_every=0",
        "checkpoint.every_steps=0", "checkpoint.async=true"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def start(run: Path, *extra: str, env: dict | None = None, launcher: list[str] | None = None) -> subprocess.Popen:
    launcher = launcher or [sys.executable, "-m", "fsdpkit", "train"]
    return subprocess.Popen([*launcher, *ARGS, *extra, f"run_dir={run}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env or ENV, cwd=ROOT)


def wait_for_step(proc: subprocess.Popen, run: Path, step: int, timeout: float = 300) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the run ended before step {step}:\n{proc.stderr.read()[-3000:]}")
        try:
            steps = [r["step"] for r in read_records(run)]
        except FileNotFoundError:
            steps = []
        if steps and steps[-1] >= step:
            return steps[-1]
        time.sleep(0.02)
    raise AssertionError(f"step {step} not reached in {timeout} s")


def rank_process(launcher: subprocess.Popen, rank: int) -> psutil.Process:
    for child in psutil.Process(launcher.pid).children(recursive=True):
        try:
            if child.environ().get("RANK") == str(rank) and "fsdpkit" in " ".join(child.cmdline()):
                return child
        except psutil.Error:
            continue
    raise AssertionError(f"no rank {rank} process under the launcher")


def latest(run: Path) -> dict:
    ckpts = run / "checkpoints"
    return json.loads((ckpts / (ckpts / "latest").read_text().strip() / "manifest.json").read_text())


def test_preemption_saves_commits_exits_75_and_resume_is_bit_identical(tmp_path):
    full = tmp_path / "full"
    assert fsdpkit("train", *ARGS, f"run_dir={full}").returncode == 0
    run = tmp_path / "run"

    # Kubernetes: SIGTERM to the launcher (PID 1), which passes it to every rank.
    proc = start(run)
    wait_for_step(proc, run, 8)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_PREEMPTED, err[-3000:]
    first = latest(run)
    assert first["reason"] == "preempted" and 8 <= first["step"] < 60
    assert "received SIGTERM: saving a checkpoint at the end of this step" in err

    # SLURM --signal: SIGUSR1 reaches one rank only; the other learns it in the step's all-reduce.
    proc = start(run)
    wait_for_step(proc, run, first["step"] + 10)
    rank_process(proc, 1).send_signal(signal.SIGUSR1)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_PREEMPTED, err[-3000:]
    second = latest(run)
    assert second["reason"] == "preempted" and first["step"] < second["step"] < 60
    assert f"stopped at step {second['step']} after a preemption signal on another rank" in err

    resumed = fsdpkit("train", *ARGS, f"run_dir={run}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    # Each restart resumed from the preemption checkpoint before it (equal losses alone would not
    # show it: a deterministic fresh start reproduces them too).
    resumes = [e for e in read_records(run, events=True) if e["event"] == "resume"]
    assert [(e["step"], e["saved_world_size"], e["mode"], Path(e["path"]).name) for e in resumes] == [
        (first["step"], 2, "full", f"step_{first['step']}"), (second["step"], 2, "full", f"step_{second['step']}")]
    want = {r["step"]: (r["loss"], r["grad_norm"]) for r in read_records(full)}
    got = {r["step"]: (r["loss"], r["grad_norm"]) for r in read_records(run)}  # a later record wins
    assert sorted(got) == list(range(1, 61)) and got == want


def test_failure_on_one_rank_ends_every_rank_with_the_original_traceback(tmp_path):
    run, marker = tmp_path / "run", tmp_path / "faults.jsonl"
    env = {**ENV, **faults_env(raise_at(step=5, rank=1), marker=marker)}
    t0 = time.monotonic()
    proc = start(run, "checkpoint.exception_timeout_s=5", "checkpoint.every_steps=2", env=env)
    _, err = proc.communicate(timeout=180)
    elapsed = time.monotonic() - t0
    assert proc.returncode == 1
    assert [(f["step"], f["rank"]) for f in fired(marker)] == [(5, 1)]  # raised there, and only there
    assert "Traceback (most recent call last)" in err
    assert "RuntimeError: injected failure at step 5 on rank 1" in err
    assert "not saving on_exception" in err
    assert elapsed < 90, f"ranks took {elapsed:.0f} s to exit"
    assert not (run / "checkpoints" / "on_exception").exists()
    assert latest(run)["step"] == 4  # the last regular checkpoint is untouched


def test_retention_keeps_exactly_what_the_policy_says_over_30_saves(tmp_path):
    run = tmp_path / "run"
    proc = fsdpkit("train", "experiment=demo", "train.max_steps=30", "train.eval_every=0", "checkpoint.every_steps=1",
                   "checkpoint.async=true", "checkpoint.keep_last=3", "checkpoint.keep_every=10",
                   "checkpoint.keep_best=2", "checkpoint.keep_best_metric=loss", "checkpoint.keep_best_mode=max",
                   f"run_dir={run}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    saves = [e for e in read_records(run, events=True) if e["event"] == "checkpoint"]
    assert [e["step"] for e in saves] == list(range(1, 31))
    losses = {r["step"]: r["loss"] for r in read_records(run)}
    highest = sorted(losses, key=lambda s: -losses[s])[:2]
    expected = {28, 29, 30} | {10, 20} | set(highest)
    kept = {int(p.name.removeprefix("step_")) for p in (run / "checkpoints").glob("step_*")}
    assert kept == expected
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_30"


def test_ranks_die_with_a_launcher_killed_hard(tmp_path):
    run = tmp_path / "run"
    proc = start(run)
    wait_for_step(proc, run, 3)
    ranks = [rank_process(proc, r) for r in (0, 1)]
    proc.kill()  # SIGKILL to the launcher only: the ranks live in sessions of their own
    proc.wait()
    gone, alive = psutil.wait_procs(ranks, timeout=3)  # without the fix they train on for seconds
    assert not alive, f"ranks {[p.pid for p in alive]} outlived their launcher"
