"""Checkpoints through `fsdpkit train` as a user runs it: a rank killed mid-save, auto-resume,
corrupt files, a malicious checkpoint."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import ROOT, fsdpkit  # noqa: E402
from faults import env as faults_env  # noqa: E402
from faults import fired, kill_mid_write, mid_tensor_bytes  # noqa: E402
from fsdpkit.checkpoint.errors import CheckpointCorruptError  # noqa: E402
from fsdpkit.checkpoint.hashing import file_checksum  # noqa: E402
from fsdpkit.checkpoint.manifest import SEAL, manifest_digest  # noqa: E402
from fsdpkit.checkpoint.resolve import resolve_checkpoint  # noqa: E402
from fsdpkit.checkpoint.resume import verify_files  # noqa: E402
from fsdpkit.train.metrics import read_records

pytestmark = pytest.mark.e2e
ARGS = ["--nproc", "2", "experiment=demo", "train.max_steps=12", "checkpoint.every_steps=4", "train.eval_every=0"]


def metrics_by_step(run_dir: Path) -> dict[int, dict]:
    """Last record per step (a resumed run re-logs the steps after its checkpoint)."""
    return {r["step"]: r for r in read_records(run_dir)}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("full") / "run"
    proc = fsdpkit("train", *ARGS, f"run_dir={run}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_rank_killed_mid_save_keeps_latest_and_auto_resume_is_exact(uninterrupted, tmp_path, mode):
    run, marker = tmp_path / "run", tmp_path / "faults.jsonl"
    # rank 1 dies halfway through the tensor bytes of its step-8 shard (its size: the uninterrupted run's)
    first_tensor, size, after = mid_tensor_bytes(uninterrupted / "checkpoints" / "step_8", rank=1)
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           **faults_env(kill_mid_write(step=8, rank=1, after_bytes=after), marker=marker)}
    extra = ["checkpoint.async=true", "checkpoint.exception_timeout_s=5",
             "checkpoint.timeout_s=30"] if mode == "async" else []
    killed = subprocess.run([sys.executable, "-m", "fsdpkit", "train", *ARGS, *extra, f"run_dir={run}"],
                            capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert killed.returncode != 0
    (kill,) = fired(marker)  # it landed where it should: in rank 1's shard of step 8, past the first tensor's start
    assert (kill["step"], kill["rank"], kill["file"]) == (8, 1, "__1_0.distcp"), kill
    assert first_tensor < kill["bytes_written"] == after < size, (kill, first_tensor, size)
    assert "rank0 ERROR] lost rank(s) 1: no answer" in killed.stderr  # the survivor names the rank it lost
    if mode == "async":  # rank 1 died in the background write of step 8, while training ran on
        assert "checkpoint step_4 (async" in killed.stderr
    ckpts = run / "checkpoints"
    assert (ckpts / "step_4" / "manifest.json").is_file()
    assert (ckpts / "step_8").is_dir() and not (ckpts / "step_8" / "manifest.json").exists()
    assert (ckpts / "latest").read_text().strip() == "step_4"

    resumed = fsdpkit("train", *ARGS, f"run_dir={run}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"skipping {ckpts / 'step_8'}" in resumed.stderr and "never committed" in resumed.stderr
    assert f"resumed full state from {ckpts / 'step_4'}" in resumed.stderr
    full, mine = metrics_by_step(uninterrupted), metrics_by_step(run)
    for step in range(5, 13):
        assert (mine[step]["loss"], mine[step]["grad_norm"]) == (full[step]["loss"], full[step]["grad_norm"])
    assert (ckpts / "latest").read_text().strip() == "step_12"


@pytest.fixture
def damaged(uninterrupted, tmp_path) -> Path:
    """A private copy of the uninterrupted run's checkpoints."""
    root = tmp_path / "checkpoints"
    shutil.copytree(uninterrupted / "checkpoints", root)
    return root


def _manifest(path: Path) -> dict:
    return json.loads((path / "manifest.json").read_text())


def test_flipped_byte_truncation_and_missing_file_are_named(damaged):
    ckpt = damaged / "step_12"
    shard = ckpt / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    problems = verify_files(ckpt, _manifest(ckpt))
    assert problems == [f"{shard} fails its checksum " + problems[0].split("fails its checksum ")[1]]
    with open(ckpt / "__0_0.distcp", "r+b") as f:
        f.truncate(1000)
    (ckpt / ".metadata").unlink()
    problems = "\n".join(verify_files(ckpt, _manifest(ckpt)))
    assert f"{ckpt / '__0_0.distcp'} has 1000 bytes" in problems and f"{ckpt / '.metadata'} is missing" in problems
    with pytest.raises(CheckpointCorruptError, match="step_12 is incomplete: .metadata is missing"):
        resolve_checkpoint(str(ckpt), ckpt_root=damaged, group=None)


def test_auto_resume_skips_a_corrupt_newest_checkpoint(damaged, caplog):
    shard = damaged / "step_12" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert resolve_checkpoint("auto", ckpt_root=damaged, group=None) == damaged / "step_8"
    assert "step_12 failed verification" in caplog.text and "__0_0.distcp fails its checksum" in caplog.text


class _Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_malicious_metadata_is_refused_without_running_it(uninterrupted, tmp_path):
    ckpt = tmp_path / "evil"
    shutil.copytree(uninterrupted / "checkpoints" / "step_12", ckpt)
    marker = tmp_path / "pwned"
    (ckpt / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    manifest = _manifest(ckpt)  # a careful attacker also fixes the file's checksum and reseals the manifest
    size, digest = file_checksum(ckpt / ".metadata")
    manifest["files"][".metadata"] = {"size": size, "xxh3_64": digest}
    manifest[SEAL] = manifest_digest(manifest)
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    proc = fsdpkit("train", *ARGS, f"run_dir={tmp_path / 'run'}", f"checkpoint.resume={ckpt}")
    assert proc.returncode != 0
    assert "refusing to unpickle" in proc.stderr
    assert not marker.exists()


def test_explicit_resume_of_an_uncommitted_directory_says_what_is_missing(tmp_path):
    (tmp_path / "step_3").mkdir()
    proc = fsdpkit("train", "train.max_steps=1", f"run_dir={tmp_path / 'run'}",
                   f"checkpoint.resume={tmp_path / 'step_3'}")
    assert proc.returncode == 2
    assert "is not a committed checkpoint" in proc.stderr and "has no manifest.json" in proc.stderr
