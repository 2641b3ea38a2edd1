"""`fsdpkit resume-check` on the demo config: passes when resume is seamless, fails with its table
when a piece of state is lost on resume, or when the run did not resume at all. (The command as a
user types it, with --resume-nproc 2,3, runs in tests/e2e/test_finetune.py.)"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import zygote  # noqa: E402
from faults import env as faults_env  # noqa: E402
from faults import fired, skip_restore  # noqa: E402
from fsdpkit.train.metrics import read_records  # noqa: E402

pytestmark = pytest.mark.e2e
ARGS = ["--steps", "8", "--save-at", "4", "experiment=demo", "train.global_batch_size=12", "train.micro_batch_size=2"]


def assert_resumed(work: Path, *, step: int, saved_world_size: int, run: str = "resumed") -> None:
    """The resumed run's own records say it loaded step `step`, saved on `saved_world_size` ranks."""
    resumes = [e for e in read_records(work / run, events=True) if e["event"] == "resume"]
    assert len(resumes) == 1, resumes
    assert (resumes[0]["step"], resumes[0]["saved_world_size"], resumes[0]["mode"]) == (step, saved_world_size, "full")
    assert Path(resumes[0]["path"]).resolve() == (work / run / "checkpoints" / f"step_{step}").resolve()


def test_passes_when_resume_is_seamless_and_fails_when_checkpoints_are_gone_or_state_is_left_out(
        tmp_path, capsys, monkeypatch):
    """One interrupted run on 2 ranks, resumed three times (one check, three verdicts):
    - on 2 ranks as it is: every loss and grad norm bit-identical, the resume of step 4 recorded;
    - on 3 ranks with the scheduler's state dropped on restore (injected: tests/faults): it did
      resume, and the LR, so the losses, differ;
    - on 1 rank after its checkpoints were deleted: a deterministic fresh start reproduces the
      losses within tolerance, and only the records can tell that it did not resume."""
    from fsdpkit.cli.resume_check import resume_check

    # its five `fsdpkit train` launchers and their ranks fork from the zygote, as the CLI's do (run_python)
    monkeypatch.setattr(sys, "executable", zygote.executable())
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    marker = tmp_path / "faults.jsonl"
    skipping = faults_env(skip_restore("scheduler"), marker=marker)

    def damage(run: Path) -> None:  # the resumed runs are `fsdpkit train` launches: they inherit os.environ
        for key, value in skipping.items():
            if run.name == "resumed-3":
                monkeypatch.setenv(key, value)
            else:
                monkeypatch.delenv(key, raising=False)
        if run.name == "resumed-1":
            shutil.rmtree(run / "checkpoints")

    code = resume_check(overrides=ARGS[4:], nproc=2, resume_nproc=[2, 3, 1], steps=8, save_at=4, work_dir=tmp_path,
                        before_resume=damage)
    out = capsys.readouterr().out
    assert code == 1, out
    assert out.rstrip().endswith("resume-check: 1 of 3 resumed runs passed"), out[-500:]
    same, rest = out.split("resume-check: resumed on 3 rank(s)")
    dropped, gone = rest.split("resume-check: resumed on 1 rank(s)")
    assert "resume-check: resumed on 2 rank(s)" in same
    assert same.count("the resumed run loaded the full state of step 4 (saved on 2 rank(s))") == 1
    assert "PASS: worst relative difference 0.000e+00, tolerance 0e+00" in same
    assert same.count("0.00e+00") >= 8  # 4 steps x (loss, grad norm)
    assert_resumed(tmp_path, step=4, saved_world_size=2, run="resumed-2")

    # the scheduler's restore was skipped on each of the 3 ranks of that run, and nowhere else
    landed = fired(marker)
    assert sorted(f["rank"] for f in landed) == [0, 1, 2], landed
    assert {(f["name"], Path(f["ckpt"]).parent.parent.name) for f in landed} == {("scheduler", "resumed-3")}
    assert "<-- beyond tolerance" in dropped and "FAIL: worst relative difference" in dropped
    assert "no proof of a resume" not in dropped
    assert_resumed(tmp_path, step=4, saved_world_size=2, run="resumed-3")  # it did resume: the lost state fails it

    assert "<-- beyond tolerance" not in gone  # the losses alone would have passed
    assert "FAIL: no proof of a resume from step 4" in gone and "recorded no `resume` event: it started fresh" in gone
    assert not (tmp_path / "resumed").exists()
