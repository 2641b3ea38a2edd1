"""A stopped rank (SIGSTOP: a hung driver, a swapped-out host) ends the job within the configured
bounds, and the log names the rank that stopped answering; a killed rank is named by the launcher."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import psutil
import pytest

from fsdpkit.train.metrics import read_records

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_preemption import latest, rank_process, start, wait_for_step  # noqa: E402

pytestmark = pytest.mark.e2e
TIMEOUT_S, EXCEPTION_TIMEOUT_S = 10, 5
# torch's launcher: SIGTERM, then SIGKILL 30 s later (a stopped rank ignores SIGTERM). torch 2.13 stops a
# failed worker group with its default 30 s whatever --shutdown-timeout says (LocalElasticAgent._stop_workers).
LAUNCHER_GRACE_S = 30
SLACK_S = 40  # start-up of the report, teardown and a loaded 2-core machine


def test_stopped_rank_ends_the_job_within_the_bound_and_is_named(tmp_path):
    run = tmp_path / "run"
    proc = start(run, "checkpoint.async=false", "checkpoint.every_steps=5", f"dist.timeout_s={TIMEOUT_S}",
                 f"checkpoint.timeout_s={TIMEOUT_S}", f"checkpoint.exception_timeout_s={EXCEPTION_TIMEOUT_S}")
    wait_for_step(proc, run, 7)
    ranks = [rank_process(proc, r) for r in (0, 1)]
    ranks[1].send_signal(signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        _, err = proc.communicate(timeout=300)
    finally:
        for p in ranks:  # never leave a stopped process behind, whatever happened
            try:
                p.kill()
            except psutil.Error:
                pass
    gone, alive = psutil.wait_procs(ranks, timeout=5)
    elapsed = time.monotonic() - t0
    bound = TIMEOUT_S + EXCEPTION_TIMEOUT_S + LAUNCHER_GRACE_S + SLACK_S
    assert proc.returncode == 1, err[-3000:]
    assert not alive
    assert elapsed < bound, f"the job took {elapsed:.0f} s to end (bound {bound} s)"
    # one line names the stopped rank and what each rank was doing
    lines = [ln for ln in err.splitlines() if "rank 1 stopped answering" in ln]
    assert len(lines) == 1, err[-4000:]
    # its last heartbeat names a phase ("step N: ..." or, when rank 1 had not yet published a step
    # within heartbeat_s of starting, "starting"), and rank 0 says what it was doing
    assert "its last heartbeat: " in lines[0] and "rank 0: failed at step" in lines[0], lines[0]
    # the launcher names what happened and where a rerun resumes
    assert "rank 0 (pid" in err and "exited with code 1" in err
    step = latest(run)["step"]
    assert f"a rerun resumes from {run / 'checkpoints' / f'step_{step}'} (step {step})" in err, err[-2000:]


def test_launcher_names_the_killed_rank_and_the_checkpoint_a_rerun_takes(tmp_path):
    run = tmp_path / "run"
    proc = start(run, "checkpoint.async=false", "checkpoint.every_steps=3")
    wait_for_step(proc, run, 7)
    rank_process(proc, 1).send_signal(signal.SIGKILL)
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 1, err[-3000:]
    step = latest(run)["step"]
    message = err[err.index("fsdpkit train: "):]
    assert "rank 1 (pid" in message and "was killed by SIGKILL" in message, message
    assert "no traceback" in message
    assert f"a rerun resumes from {run / 'checkpoints' / f'step_{step}'} (step {step})" in message, message
    assert "their tracebacks are above" not in err


def test_max_restarts_restarts_a_killed_rank_and_the_job_resumes_and_finishes(tmp_path):
    run = tmp_path / "run"
    launcher = [sys.executable, "-m", "fsdpkit", "train", "--max-restarts", "1"]
    proc = start(run, "checkpoint.async=false", "checkpoint.every_steps=3", "train.max_steps=16", launcher=launcher)
    wait_for_step(proc, run, 7)
    committed = latest(run)["step"]
    rank_process(proc, 0).send_signal(signal.SIGKILL)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    events = read_records(run, events=True)
    assert [e["step"] for e in events if e["event"] == "resume"] == [committed]
    assert sorted({r["step"] for r in read_records(run)}) == list(range(1, 17))
    assert latest(run)["step"] == 16
