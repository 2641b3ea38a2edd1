"""`fsdpkit resume-check` on the demo config: passes when resume is seamless, fails with its table
when a piece of state is lost on resume."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import fsdpkit  # noqa: E402
from fsdpkit.train.metrics import read_records  # noqa: E402

pytestmark = pytest.mark.e2e
ARGS = ["--steps", "8", "--save-at", "4", "experiment=demo", "train.global_batch_size=12", "train.micro_batch_size=2"]


def assert_resumed(work: Path, *, step: int, saved_world_size: int, run: str = "resumed") -> None:
    """The resumed run's own records say it loaded step `step`, saved on `saved_world_size` ranks."""
    resumes = [e for e in read_records(work / run, events=True) if e["event"] == "resume"]
    assert len(resumes) == 1, resumes
    assert (resumes[0]["step"], resumes[0]["saved_world_size"], resumes[0]["mode"]) == (step, saved_world_size, "full")
    assert Path(resumes[0]["path"]).resolve() == (work / run / "checkpoints" / f"step_{step}").resolve()


def test_passes_at_the_same_world_size_bitwise_and_at_another_within_tolerance(tmp_path):
    """One interrupted run, resumed on 2 ranks and (a copy of it) on 3."""
    proc = fsdpkit("resume-check", "--resume-nproc", "2,3", *ARGS, "--work-dir", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    out = proc.stdout
    assert "resumed on 2 and on 3 rank(s)" in out and "2 of 2 resumed runs passed" in out
    same, other = out.split("resume-check: resumed on 3 rank(s)")
    assert "resume-check: resumed on 2 rank(s)" in same
    for part in (same, other):
        assert part.count("the resumed run loaded the full state of step 4 (saved on 2 rank(s))") == 1
    assert "PASS: worst relative difference 0.000e+00, tolerance 0e+00" in same
    assert same.count("0.00e+00") >= 8  # 4 steps x (loss, grad norm)
    assert "PASS: worst relative difference" in other and "tolerance 1e-06" in other
    for m in (2, 3):
        assert_resumed(tmp_path, step=4, saved_world_size=2, run=f"resumed-{m}")
    assert not (tmp_path / "resumed").exists()


def test_fails_when_the_checkpoints_are_gone_or_state_is_left_out(tmp_path, capsys, monkeypatch):
    """One interrupted run, resumed twice, each failing for its own reason:
    - on 2 ranks after its checkpoints were deleted: a deterministic fresh start reproduces every
      loss, and only the records can tell it did not resume;
    - on 1 rank with the scheduler's state dropped on restore (a test hook): it did resume, and the
      LR, so the losses, differ."""
    from fsdpkit.cli.resume_check import resume_check

    def damage(run: Path) -> None:
        if run.name == "resumed-2":
            shutil.rmtree(run / "checkpoints")
        else:  # resumed-1, after resumed-2 ran: its subprocesses inherit the hook
            monkeypatch.setenv("FSDPKIT_TEST_SKIP_RESTORE", "scheduler")

    code = resume_check(overrides=ARGS[4:], nproc=2, resume_nproc=[2, 1], steps=8, save_at=4, work_dir=tmp_path,
                        before_resume=damage)
    out = capsys.readouterr().out
    assert code == 1, out
    assert "0 of 2 resumed runs passed" in out and "resume-check: PASS" not in out
    gone, dropped = out.split("resume-check: resumed on 1 rank(s)")
    assert "worst relative difference 0.000e+00" in gone  # the losses alone would have passed
    assert "FAIL: no proof of a resume from step 4" in gone and "recorded no `resume` event: it started fresh" in gone
    assert "<-- beyond tolerance" in dropped and "FAIL: worst relative difference" in dropped
    assert "no proof of a resume" not in dropped
    assert_resumed(tmp_path, step=4, saved_world_size=2, run="resumed-1")  # it did resume: the lost state fails it
