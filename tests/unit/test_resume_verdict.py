"""`fsdpkit resume-check`'s two judgements without running anything: did the run resume (from its
own records), and which tolerance applies to the configured mixed precision."""

from __future__ import annotations

from pathlib import Path

import pytest

from fsdpkit.cli import resume_check as rc

ROOT = Path("/runs/resumed/checkpoints")


def resume_event(**changes) -> dict:
    event = {"event": "resume", "step": 4, "path": str(ROOT / "step_4"), "load_s": 0.1, "saved_world_size": 2,
             "mode": "full"}
    return {**event, **changes}


def problems(events: list[dict]) -> str:
    return "\n".join(rc.resume_problems(events, step=4, saved_world_size=2, ckpt_root=ROOT))


def test_a_recorded_resume_from_the_step_and_world_size_passes():
    saves = [{"event": "checkpoint", "step": 4, "path": str(ROOT / "step_4")}]
    assert problems([*saves, resume_event()]) == ""


def test_no_resume_event_fails_even_when_losses_would_match():
    # what a run records when its checkpoints were deleted and it started fresh
    saves = [{"event": "checkpoint", "step": 4, "path": str(ROOT / "step_4")}]
    assert "recorded no `resume` event: it started fresh" in problems(saves)
    assert "recorded no `resume` event" in problems([])


@pytest.mark.parametrize(("event", "why"), [
    (resume_event(step=2, path=str(ROOT / "step_2")), "resumed from step 2, expected step 4"),
    (resume_event(saved_world_size=3), "saved on 3 rank(s), expected 2"),
    (resume_event(path="/elsewhere/checkpoints/step_4"), "resumed from /elsewhere/checkpoints/step_4, expected"),
    (resume_event(mode="model_only"), "restored 'model_only' state"),
])
def test_a_resume_from_anything_else_fails(event, why):
    assert why in problems([event])


def test_two_resumes_in_one_run_directory_fail():
    assert "records 2 resumes" in problems([resume_event(), resume_event()])


@pytest.mark.parametrize(("precision", "rtol"), [
    ("fp32", 1e-6),  # the documented tolerances
    ("bf16-mixed", 5e-4),
    ("{_target_: torch.distributed.fsdp.MixedPrecisionPolicy}", 1e-6),  # all dtypes default: fp32
    ("{_target_: fsdpkit.parallel.policies.mixed_precision_policy, spec: bf16-true}", 5e-4),
])
def test_tolerance_follows_the_policy_a_target_mapping_included(precision, rtol):
    overrides = ["experiment=demo", f"policy.mixed_precision={precision}"]
    assert rc.tolerance(overrides, same_world_size=False, config_dirs=[]) == rtol
    assert rc.tolerance([*overrides, "deterministic=true"], same_world_size=True, config_dirs=[]) == 0.0
