"""The object-storage seam on fsspec's in-memory filesystem (no server): RemotePath, the moves that
replace renames, and the lock object that replaces flock."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import uuid

import pytest

from fsdpkit.checkpoint.catalog import publish_latest
from fsdpkit.checkpoint.errors import CheckpointError
from fsdpkit.checkpoint.layout import MANIFEST, swap_in
from fsdpkit.checkpoint.storage import RemotePath, open_storage
from fsdpkit.checkpoint.storage.object_lock import ObjectLock


@pytest.fixture
def root() -> RemotePath:
    path = open_storage(f"memory://fsdpkit-test-{uuid.uuid4().hex}/checkpoints")
    assert isinstance(path, RemotePath)
    return path


def test_open_storage_keeps_local_paths_local(tmp_path):
    assert open_storage(tmp_path) == tmp_path and open_storage(f"file://{tmp_path}") == tmp_path
    assert isinstance(open_storage("s3://bucket/x"), RemotePath)


def test_remote_path_behaves_like_the_pathlib_subset(root):
    (root / "step_1" / "a.distcp").write_bytes(b"0123456789")
    step = root / "step_1"
    assert step.is_dir() and not step.is_file() and (step / "a.distcp").is_file()
    assert [p.name for p in root.iterdir()] == ["step_1"] and step.parent == root and step.with_name("x").name == "x"
    assert (step / "a.distcp").stat().st_size == 10 and (step / "a.distcp").read_range(2, 5) == b"234"
    view = memoryview(bytearray(6))
    assert (step / "a.distcp").read_range_into(view, 7) == 3 and bytes(view[:3]) == b"789"  # ends early
    with pytest.raises(FileNotFoundError, match="does not exist"):
        (step / "missing").read_bytes()


def test_swap_in_on_object_storage_replaces_the_checkpoint_manifest_last(root):
    for name, content in (("step_2", b"old"), ("step_2.incoming", b"new")):
        (root / name / "__0_0.distcp").write_bytes(content)
        (root / name / MANIFEST).write_text(name)
    swap_in(root / "step_2.incoming", root / "step_2")
    assert (root / "step_2" / "__0_0.distcp").read_bytes() == b"new"
    assert (root / "step_2" / MANIFEST).read_text() == "step_2.incoming"
    assert not (root / "step_2.incoming").exists()
    publish_latest(root / "step_2")
    assert (root / "latest").read_text() == "step_2\n"


def _holder(root: RemotePath, **fields) -> None:
    record = {"owner": "other", "host": socket.gethostname(), "pid": os.getppid(), "heartbeat": time.time()} | fields
    (root / ".lock").write_text(json.dumps(record))


def test_lock_object_refuses_a_live_run_and_takes_over_a_dead_or_silent_one(root):
    _holder(root)  # a live process on this host (our parent), beating now
    with pytest.raises(CheckpointError, match=r"is in use by another run \(lock .*/.lock: host"):
        ObjectLock(root).acquire(wait_s=0.3)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    _holder(root, pid=int(dead.stdout))  # its process is gone: a killed run on this node
    lock = ObjectLock(root).acquire(wait_s=0.3)
    assert json.loads((root / ".lock").read_bytes())["owner"] == lock.owner
    lock.release()
    assert not (root / ".lock").exists()
    _holder(root, host="another-node", heartbeat=time.time() - 10_000)  # silent far past the stale limit
    lock = ObjectLock(root).acquire(wait_s=0.3)
    lock.release()
