"""checkpoint.local_dir (storage/mirror.py) on fsspec's in-memory filesystem as the "bucket": which copy a
restart may read, pruning in step with the remote checkpoints, and the settings it refuses."""

from __future__ import annotations

import json
import uuid

import pytest

from fsdpkit.checkpoint.layout import MANIFEST
from fsdpkit.checkpoint.storage import mirror, open_storage
from fsdpkit.checkpoint.storage.mirror import Mirror
from fsdpkit.config import compose_config


@pytest.fixture
def mirrored(tmp_path):
    root = open_storage(f"memory://fsdpkit-mirror-{uuid.uuid4().hex}/checkpoints")
    return root, Mirror(tmp_path / "mirror", root=root)


def _commit(root, copy: Mirror, name: str, files: dict[str, bytes]) -> None:
    """What a save does: each file to the bucket and (tee) to the mirror, the remote manifest, then publish."""
    local = copy.start_writing(root / name)
    for fname, data in files.items():
        (root / name / fname).write_bytes(data)
        (local / fname).write_bytes(data)
    (root / name / MANIFEST).write_text(json.dumps({"files": {f: {"size": len(d)} for f, d in files.items()}}))
    copy.publish(root / name)


def test_a_restart_reads_the_copy_only_when_it_matches_the_bucket(mirrored):
    root, copy = mirrored
    local = copy.local
    _commit(root, copy, "step_2", {"__0_0.distcp": b"abc", ".metadata": b"m"})
    assert copy.mirror_dir(root / "step_2.incoming") == local / "step_2"  # a replacement lands on its name
    assert (local / "step_2" / MANIFEST).read_bytes() == (root / "step_2" / MANIFEST).read_bytes()
    assert copy.usable(root / "step_2") == (local / "step_2",
                                            "its manifest equals the remote one and every file is there")
    (local / "step_2" / "__0_0.distcp").write_bytes(b"ab")  # a truncated file
    found, why = copy.usable(root / "step_2")
    assert found is None and why.endswith("__0_0.distcp is missing or has the wrong size")
    (local / "step_2" / MANIFEST).write_text((root / "step_2" / MANIFEST).read_text() + "\n")  # one byte more
    assert copy.usable(root / "step_2")[0] is None
    assert copy.mirror_dir(open_storage("memory://elsewhere/checkpoints/step_2")) is None  # not this run's root


def test_pruning_follows_the_bucket_and_a_save_unpublishes_its_copy_first(mirrored):
    root, copy = mirrored
    local = copy.local
    _commit(root, copy, "step_2", {"a": b"1"})
    _commit(root, copy, "step_4", {"a": b"2"})
    (local / "notes").mkdir()  # not checkpoint-shaped: never touched
    (root / "step_2" / MANIFEST).unlink()  # retention in the bucket (manifest first)
    copy.start_writing(root / "step_4")  # a save of step 4 again: its copy is no checkpoint until committed
    assert not (local / "step_4" / MANIFEST).exists()
    _commit(root, copy, "step_6", {"a": b"3"})
    assert sorted(p.name for p in local.iterdir()) == [".mirror_of", "notes", "step_6"]


def test_local_dir_is_refused_where_it_cannot_work(tmp_path, mirrored, monkeypatch):
    root, copy = mirrored
    local = copy.local
    assert Mirror.open("", root=root) is None  # no checkpoint.local_dir: no mirror
    with pytest.raises(ValueError, match="mirrors memory://.*give each run its own local_dir"):
        Mirror(local, root=open_storage("memory://other-bucket/checkpoints"))
    with pytest.raises(ValueError, match="checkpoint.dir=.* is local; set checkpoint.dir to a URL"):
        Mirror(tmp_path / "m2", root=tmp_path / "checkpoints")
    theirs = tmp_path / "old-run-checkpoints"  # someone's checkpoints: pruning would delete them
    (theirs / "step_5").mkdir(parents=True)
    with pytest.raises(ValueError, match="already holds step_5, which no mirror wrote"):
        Mirror(theirs, root=root)
    assert (theirs / "step_5").is_dir() and not (theirs / mirror.MIRROR_OF).exists()
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    with pytest.raises(ValueError, match="16 ranks on several nodes"):
        mirror.check_single_node(str(local))
    run = tmp_path / "run"
    base = [f"run_dir={run}", "checkpoint.dir=s3://bucket/run/checkpoints"]
    for overrides, message in (
        ([f"run_dir={run}", f"checkpoint.local_dir={tmp_path / 'm'}"], "is local already; set checkpoint.dir to a URL"),
        ([*base, "checkpoint.local_dir=s3://bucket/mirror"],
         "checkpoint.local_dir='s3://bucket/mirror' is a s3:// URL"),
        ([*base, f"checkpoint.local_dir={run}"], "overlaps run_dir"),
        ([*base, f"checkpoint.local_dir={tmp_path}"], "overlaps run_dir"),
        ([*base, f"checkpoint.local_dir={run / 'export' / 'm'}"], "overlaps export.dir"),
    ):
        with pytest.raises(ValueError, match=message):
            compose_config(overrides)
    assert compose_config([*base, f"checkpoint.local_dir={run / 'mirror'}"]).checkpoint.local_dir == str(run / "mirror")
