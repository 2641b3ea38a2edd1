"""`fsdpkit resume-check` on the demo config, as the README's line writes it (`experiment=demo
--resume-nproc 2,3`: a global batch of 16 in micro-batches of 4, which 3 ranks share as 6, 5 and
5): passes when resume is seamless, bitwise on 2 ranks and elastically on 3; fails with its table
when a piece of state is lost on resume, or when the run did not resume at all."""

from __future__ import annotations

import shlex
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import zygote  # noqa: E402
from conftest import ROOT  # noqa: E402
from faults import env as faults_env  # noqa: E402
from faults import fired, skip_restore  # noqa: E402
from fsdpkit.cli.main import _parse  # noqa: E402
from fsdpkit.train.metrics import read_records  # noqa: E402

pytestmark = pytest.mark.e2e


def readme_resume_check() -> list[str]:
    """The arguments of the README's `fsdpkit resume-check` line as a user copies it (its comment dropped)."""
    lines = [line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("fsdpkit resume-check")]
    assert len(lines) == 1, lines
    return shlex.split(lines[0], comments=True)[1:]


def assert_resumed(work: Path, *, step: int, saved_world_size: int, run: str = "resumed") -> None:
    """The resumed run's own records say it loaded step `step`, saved on `saved_world_size` ranks."""
    resumes = [e for e in read_records(work / run, events=True) if e["event"] == "resume"]
    assert len(resumes) == 1, resumes
    assert (resumes[0]["step"], resumes[0]["saved_world_size"], resumes[0]["mode"]) == (step, saved_world_size, "full")
    assert Path(resumes[0]["path"]).resolve() == (work / run / "checkpoints" / f"step_{step}").resolve()


def test_the_readmes_command_passes_bitwise_and_on_3_ranks_and_fails_when_state_is_left_out_or_checkpoints_are_gone(
        tmp_path, capsys, monkeypatch):
    """The README's check (2 ranks, 12 steps, saved at 6, resumed on 2 and 3) with two more resumed
    copies of the same interrupted run, damaged (one check, four verdicts):
    - on 2 ranks as it is: every loss and grad norm bit-identical, the resume of step 6 recorded;
    - on 3 ranks as it is: within the fp32 tolerance (1e-6), the resume recorded;
    - on 4 ranks with the scheduler's state dropped on restore (injected: tests/faults): it did
      resume, and the LR, so the losses, differ;
    - on 1 rank after its checkpoints were deleted: a deterministic fresh start reproduces the
      losses within tolerance, and only the records can tell that it did not resume."""
    from fsdpkit.cli.resume_check import resume_check

    args = _parse(readme_resume_check())
    assert (args.overrides, args.nproc, args.resume_nproc, args.steps, args.save_at) == (
        ["experiment=demo"], 2, [2, 3], 12, 6)
    # its six `fsdpkit train` launchers and their ranks fork from the zygote, as the CLI's do (run_python)
    monkeypatch.setattr(sys, "executable", zygote.executable())
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    marker = tmp_path / "faults.jsonl"
    skipping = faults_env(skip_restore("scheduler"), marker=marker)

    def damage(run: Path) -> None:  # the resumed runs are `fsdpkit train` launches: they inherit os.environ
        for key, value in skipping.items():
            if run.name == "resumed-4":
                monkeypatch.setenv(key, value)
            else:
                monkeypatch.delenv(key, raising=False)
        if run.name == "resumed-1":
            shutil.rmtree(run / "checkpoints")

    code = resume_check(overrides=args.overrides, nproc=args.nproc, resume_nproc=[*args.resume_nproc, 4, 1],
                        steps=args.steps, save_at=args.save_at, work_dir=tmp_path, before_resume=damage)
    out = capsys.readouterr().out
    assert code == 1, out
    assert out.rstrip().endswith("resume-check: 2 of 4 resumed runs passed"), out[-500:]
    same, rest = out.split("resume-check: resumed on 3 rank(s)")
    elastic, rest = rest.split("resume-check: resumed on 4 rank(s)")
    dropped, gone = rest.split("resume-check: resumed on 1 rank(s)")
    assert "resume-check: resumed on 2 rank(s)" in same
    assert same.count("the resumed run loaded the full state of step 6 (saved on 2 rank(s))") == 1
    assert "PASS: worst relative difference 0.000e+00, tolerance 0e+00" in same
    assert same.count("0.00e+00") >= 12  # 6 steps x (loss, grad norm)
    assert_resumed(tmp_path, step=6, saved_world_size=2, run="resumed-2")

    assert "the resumed run loaded the full state of step 6 (saved on 2 rank(s))" in elastic
    assert "PASS" in elastic and "tolerance 1e-06" in elastic and "<-- beyond tolerance" not in elastic
    assert_resumed(tmp_path, step=6, saved_world_size=2, run="resumed-3")

    # the scheduler's restore was skipped on each of the 4 ranks of that run, and nowhere else
    landed = fired(marker)
    assert sorted(f["rank"] for f in landed) == [0, 1, 2, 3], landed
    assert {(f["name"], Path(f["ckpt"]).parent.parent.name) for f in landed} == {("scheduler", "resumed-4")}
    assert "<-- beyond tolerance" in dropped and "FAIL: worst relative difference" in dropped
    assert "no proof of a resume" not in dropped
    assert_resumed(tmp_path, step=6, saved_world_size=2, run="resumed-4")  # it did resume: the lost state fails it

    assert "<-- beyond tolerance" not in gone  # the losses alone would have passed
    assert "FAIL: no proof of a resume from step 6" in gone and "recorded no `resume` event: it started fresh" in gone
    assert not (tmp_path / "resumed").exists()
