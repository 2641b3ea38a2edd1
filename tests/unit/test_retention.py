"""Retention policy: which committed checkpoints survive (pure rules, then on disk)."""

from __future__ import annotations

import json
from pathlib import Path

from fsdpkit.checkpoint.layout import MANIFEST, ON_EXCEPTION
from fsdpkit.checkpoint.manifest import FORMAT, FORMAT_VERSION, write_manifest
from fsdpkit.checkpoint.retention import Candidate, RetentionPolicy, apply_retention, to_keep


def ckpts(metrics: dict[int, float | None]) -> list[Candidate]:
    return [Candidate(Path(f"step_{s}"), s, m) for s, m in sorted(metrics.items())]


def test_rules_combine_and_the_newest_always_survives():
    cs = ckpts({s: (10.0 - s if s % 3 == 0 else None) for s in range(1, 13)})
    assert to_keep(cs, RetentionPolicy()) == {12}  # off: apply_retention never calls it, but the newest is kept
    assert to_keep(cs, RetentionPolicy(keep_last=2)) == {11, 12}
    assert to_keep(cs, RetentionPolicy(keep_every=5)) == {5, 10, 12}
    # only checkpoints with the metric compete; min: the lowest values (steps 12 and 9)
    assert to_keep(cs, RetentionPolicy(keep_best=2)) == {9, 12}
    assert to_keep(cs, RetentionPolicy(keep_best=2, mode="max")) == {3, 6, 12}
    assert to_keep(cs, RetentionPolicy(keep_last=1, keep_every=4, keep_best=1, mode="max")) == {3, 4, 8, 12}
    assert to_keep([], RetentionPolicy(keep_last=3)) == set()


def test_ties_prefer_the_newer_checkpoint():
    cs = ckpts({1: 1.0, 2: 1.0, 3: 5.0})
    assert to_keep(cs, RetentionPolicy(keep_best=1)) == {2, 3}


def _commit(root: Path, step: int, **metrics: float) -> None:
    d = root / f"step_{step}"
    d.mkdir(parents=True)
    (d / "__0_0.distcp").write_bytes(b"x")
    write_manifest(d, {"format": FORMAT, "format_version": FORMAT_VERSION, "run_id": "r", "step": step,
                       "world_size": 1, "state_dict_type": "sharded", "fingerprint": {"tensors": {}},
                       "trainer": {}, "tensors": {}, "files": {}, "metrics": metrics})


def test_apply_deletes_only_committed_checkpoints_outside_the_policy(tmp_path):
    for step in range(1, 6):
        _commit(tmp_path, step, val_loss=float(step))
    (tmp_path / "step_6").mkdir()  # being written (no manifest): never touched
    (tmp_path / ON_EXCEPTION).mkdir()
    (tmp_path / ON_EXCEPTION / MANIFEST).write_text(json.dumps({"step": 2}))
    deleted = apply_retention(tmp_path, RetentionPolicy(keep_last=2, keep_best=1))
    assert sorted(p.name for p in deleted) == ["step_2", "step_3"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [ON_EXCEPTION, "step_1", "step_4", "step_5", "step_6"]
    assert apply_retention(tmp_path, RetentionPolicy()) == []  # all zero: off
