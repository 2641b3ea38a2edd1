"""Ordinary misuse and damage through `fsdpkit train`, as a user meets them: a checkpoint
directory reused by a new run, unusable directories, a corrupt newest checkpoint, a full disk
when the manifest is written."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import fsdpkit, run_python  # noqa: E402
from faults import env as faults_env  # noqa: E402
from faults import fired, manifest_enospc  # noqa: E402
from fsdpkit.checkpoint.manifest import read_manifest  # noqa: E402
from fsdpkit.train.metrics import read_records  # noqa: E402

pytestmark = pytest.mark.e2e
DEMO = ["experiment=demo", "train.eval_every=0", "train.progress=false"]


def _train(run: Path, *overrides: str, nproc: int | None = None,
           env: dict | None = None) -> subprocess.CompletedProcess:
    launch = ["--nproc", str(nproc)] if nproc else []
    return fsdpkit("train", *launch, *DEMO, f"run_dir={run}", *overrides, env=env)


def _resumes(run: Path) -> list[dict]:
    return [r for r in read_records(run, events=True) if r.get("event") == "resume"]


def test_a_new_run_never_mixes_with_another_runs_checkpoints(tmp_path):
    run = tmp_path / "run"
    ckpts = run / "checkpoints"
    first = _train(run, "train.max_steps=12", "checkpoint.every_steps=6")
    assert first.returncode == 0, first.stderr[-3000:]
    old_id = read_manifest(ckpts / "step_12")["run_id"]

    for start in (["checkpoint.resume=none"], ["checkpoint.resume_mode=model_only"]):
        refused = _train(run, "train.max_steps=3", "checkpoint.every_steps=3", "checkpoint.keep_last=1", *start)
        assert refused.returncode == 2, refused.stderr[-3000:]
        assert (f"checkpoint.dir={ckpts} holds committed checkpoints of another run: step_12 (step 12, run "
                f"{old_id[:8]}), step_6 (step 6, run {old_id[:8]})") in refused.stderr
        assert "checkpoint.existing=archive" in refused.stderr and "Traceback" not in refused.stderr
    assert "resume_mode=model_only" in refused.stderr
    assert sorted(p.name for p in ckpts.iterdir()) == [".lock", "latest", "step_12", "step_6"]

    fresh = _train(run, "train.max_steps=3", "checkpoint.every_steps=3", "checkpoint.keep_last=1",
                   "checkpoint.resume=none", "checkpoint.existing=archive")
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    (archive,) = (ckpts / "archive").iterdir()
    assert sorted(p.name for p in archive.iterdir()) == ["latest", "step_12", "step_6"]
    assert read_manifest(archive / "step_12")["step"] == 12  # moved intact, nothing deleted
    new_id = read_manifest(ckpts / "step_3")["run_id"]
    assert new_id != old_id and (ckpts / "latest").read_text().strip() == "step_3"

    resumed = _train(run, "train.max_steps=6", "checkpoint.every_steps=3", "checkpoint.keep_last=1")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [(r["step"], r["saved_world_size"]) for r in _resumes(run)] == [(3, 1)]
    assert read_manifest(ckpts / "step_6")["run_id"] == new_id
    assert sorted(p.name for p in ckpts.iterdir() if p.name.startswith("step")) == ["step_6"]  # keep_last=1


def test_a_corrupt_newest_checkpoint_is_moved_aside_and_its_step_saved_again(tmp_path):
    run = tmp_path / "run"
    ckpts = run / "checkpoints"
    assert _train(run, "train.max_steps=6", "checkpoint.every_steps=3").returncode == 0
    shard = ckpts / "step_6" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 3] ^= 0x10
    shard.write_bytes(bytes(data))
    rerun = _train(run, "train.max_steps=6", "checkpoint.every_steps=3")
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    (aside,) = ckpts.glob("step_6.corrupt-*")
    assert f"moved step_6 to {aside.name}: it failed verification" in rerun.stderr
    assert (aside / "__0_0.distcp").read_bytes() == bytes(data)  # kept for a person to look at
    assert [r["step"] for r in _resumes(run)] == [3]
    assert read_manifest(ckpts / "step_6")["step"] == 6 and (ckpts / "latest").read_text().strip() == "step_6"
    verify = fsdpkit("ckpt", "verify", str(ckpts / "step_6"))
    assert verify.returncode == 0, verify.stdout + verify.stderr


def test_unusable_directories_stop_before_the_first_step(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("mine, not fsdpkit's\n")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine\n")
    cases = [
        ([f"run_dir={tmp_path / 'run'}", "export.on_finish=true", f"export.dir={tmp_path / 'mine'}"],
         f"export.dir={tmp_path / 'mine'} (export.on_finish): refusing to replace"),
        ([f"run_dir={a_file}"], f"run_dir={a_file} is an existing file, not a directory"),
        ([f"run_dir={tmp_path / 'run'}", f"checkpoint.dir={a_file / 'ckpts'}"],
         f"checkpoint.dir={a_file / 'ckpts'} cannot be written: Not a directory"),
    ]
    for i, (overrides, message) in enumerate(cases):
        for launch in ([], ["--nproc", "2"]) if i == 0 else ([],):  # the same check runs on every launch path
            proc = fsdpkit("train", *launch, "train.max_steps=1", *overrides)
            assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
            assert proc.stderr.count(message) == 1
    # Under torchrun directly, every rank stops at the same check and rank 0 alone says why.
    proc = run_python("-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "fsdpkit", "train",
                      "train.max_steps=1", f"run_dir={a_file}", timeout=300)
    assert proc.returncode != 0 and proc.stderr.count(cases[1][1]) == 1
    assert "fsdpkit/" not in proc.stderr.replace(str(tmp_path), "")  # torchrun's own traceback only, no rank's
    assert a_file.read_text() == "mine, not fsdpkit's\n" and (tmp_path / "mine" / "notes.txt").is_file()


def test_a_full_disk_at_the_manifest_fails_the_save_on_every_rank_at_once(tmp_path):
    run, marker = tmp_path / "run", tmp_path / "faults.jsonl"
    t0 = time.monotonic()
    proc = _train(run, "train.max_steps=8", "checkpoint.every_steps=4", "checkpoint.exception_timeout_s=300",
                  "checkpoint.timeout_s=300", nproc=2, env=faults_env(manifest_enospc(step=4), marker=marker))
    elapsed = time.monotonic() - t0
    assert proc.returncode != 0
    # the disk filled in the fsync of step 4's manifest, on rank 0 (the one that commits); the
    # on_exception save of the same step that may follow finds it full too
    ckpts = run / "checkpoints"
    landed = [(f["op"], f["path"], f["rank"]) for f in fired(marker)]
    assert landed[0] == ("fsync", str(ckpts / "step_4" / ".manifest.json.tmp"), 0), proc.stderr[-3000:]
    assert set(landed[1:]) <= {("fsync", str(ckpts / "on_exception" / ".manifest.json.tmp"), 0)}, landed
    for rank in (0, 1):  # each rank logs it before the on_exception vote, which needs them all
        assert f"rank {rank}: training failed with CheckpointSaveError: saving" in proc.stderr, proc.stderr[-4000:]
    assert "could not write" in proc.stderr and "No space left on device" in proc.stderr
    assert elapsed < 240, f"ranks waited for a timeout ({elapsed:.0f} s) instead of learning of the failure at once"
    assert not (ckpts / "step_4").exists() and not (ckpts / "latest").exists()
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert not any(e.get("event") == "checkpoint" for e in events)
