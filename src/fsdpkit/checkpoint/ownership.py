"""One run per checkpoint directory.

Every checkpoint records the id of the run that wrote it (`run_id` in its manifest). A run that
resumes in full continues the run it resumed from and keeps its id; any other start (resume=none,
resume_mode=model_only, nothing to resume) is a new run with a new id. Before the first step, rank 0
of every run:

1. locks the directory (`.lock`, flock: released by the kernel when the process dies), so two live
   runs never write into one directory;
2. claims it: committed checkpoints of another run are refused (`checkpoint.existing=error`, the
   default) or moved to `archive/<time>/` (`existing=archive`); checkpoints of this run newer than
   the one it resumed from (an explicit resume from an older step) are moved there too, since the
   run continues from the older state and would otherwise mix two histories;
3. repairs `latest` if it names a checkpoint that is no longer there.

From then on the directory holds one history, in which step order is commit order: "newest"
means the newest of this run. Nothing is ever deleted here.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import time
import uuid
from pathlib import Path
from typing import Any

from fsdpkit import tunables
from fsdpkit.checkpoint.errors import CheckpointCorruptError, CheckpointError
from fsdpkit.checkpoint.layout import (
    ARCHIVE,
    LATEST,
    MANIFEST,
    CkptPath,
    candidate_dirs,
    publish_latest,
    utc_stamp,
)
from fsdpkit.checkpoint.manifest import read_manifest
from fsdpkit.checkpoint.storage import RemotePath, fsync_path, move_tree
from fsdpkit.checkpoint.storage.object_lock import ObjectLock

log = logging.getLogger("fsdpkit.checkpoint")
LOCK = ".lock"
EXISTING_POLICIES = ("error", "archive")


def new_run_id() -> str:
    return uuid.uuid4().hex


class DirectoryLock:
    """An exclusive flock on `<root>/.lock`, held for a run's life by its rank 0."""

    def __init__(self, root: Path):
        self.root, self._fd = root, None

    def acquire(self, *, wait_s: float | None = None) -> DirectoryLock:
        """Raises CheckpointError when another live process holds the lock after `wait_s` (default
        FSDPKIT_LOCK_WAIT_S: time for a just-killed predecessor to exit)."""
        path = self.root / LOCK
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + (tunables.current().lock_wait_s if wait_s is None else wait_s)
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "unknown"
                    os.close(fd)
                    raise CheckpointError(
                        f"checkpoint.dir={self.root} is in use by another run ({holder}): two runs must never write "
                        "into one checkpoint directory. Wait for it to end, stop it, or set checkpoint.dir (or "
                        "run_dir) to another directory") from None
                time.sleep(0.2)
            except OSError as e:  # a filesystem without flock: say so and go on unprotected
                log.warning("cannot lock %s (%s): nothing stops a second run from using this directory", path, e)
                os.close(fd)
                return self
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock
            self._fd = None


def lock_for(root: CkptPath) -> DirectoryLock | ObjectLock:
    """The lock for a checkpoints root: flock locally, a heartbeat object on object storage."""
    return ObjectLock(root) if isinstance(root, RemotePath) else DirectoryLock(root)


def committed_in(root: CkptPath) -> list[tuple[CkptPath, dict[str, Any]]]:
    """(path, manifest) of the committed, readable checkpoints directly under `root`."""
    found = []
    for path in candidate_dirs(root):
        try:
            found.append((path, read_manifest(path)))
        except (FileNotFoundError, CheckpointCorruptError):
            continue  # uncommitted or corrupt: resolution deals with those, never this module
    return found


def claim(root: CkptPath, *, run_id: str, resumed: dict[str, Any] | None, existing: str,
          start: str) -> tuple[list[str], dict[str, str]]:
    """Rank 0: make `root` hold this run's history only (see the module docstring).

    Args:
        resumed: the manifest this run resumed from in full, or None (a new run).
        existing: `error` or `archive`, for committed checkpoints of another run.
        start: how this run started, for messages (e.g. "a new run: checkpoint.resume=none").
    Returns: log lines describing what was moved, and where each moved checkpoint went.
    Raises:
        CheckpointError: `root` holds another run's checkpoints and `existing` is `error`.
    """
    if existing not in EXISTING_POLICIES:
        raise ValueError(f"checkpoint.existing={existing!r}: expected one of {', '.join(EXISTING_POLICIES)}")
    foreign, newer = [], []
    for path, manifest in committed_in(root):
        owner = manifest.get("run_id")  # None: written before run ids; cannot be told apart, so kept
        if owner is not None and owner != run_id:
            foreign.append((path, manifest))
        elif resumed is not None and manifest["step"] > resumed["step"]:
            newer.append((path, manifest))
    lines: list[str] = []
    moved: dict[str, str] = {}
    if foreign:
        names = ", ".join(f"{p.name} (step {m['step']}, run {m['run_id'][:8]})" for p, m in sorted(foreign))
        if existing == "error":
            raise CheckpointError(
                f"checkpoint.dir={root} holds committed checkpoints of another run: {names}. This run "
                f"({start}) would mix its checkpoints with them, and a later "
                "auto-resume could pick theirs. Choose one: checkpoint.resume=auto to continue that run; "
                "checkpoint.dir=<a new directory> (or another run_dir) to start beside it; or "
                f"checkpoint.existing=archive to move them to {root / ARCHIVE}/<time>/ (nothing is deleted)")
        lines.append(_archive(root, [p for p, _ in foreign], moved, why="of another run (checkpoint.existing=archive)"))
    if newer:
        lines.append(_archive(root, [p for p, _ in newer], moved,
                              why=f"newer than step {resumed['step']}, which this run resumed from"))
    lines += repair_latest(root)
    return lines, moved


def _archive(root: CkptPath, paths: list[CkptPath], moved: dict[str, str], *, why: str) -> str:
    """Move `paths` (and `latest`, when it names one of them) into a new archive/<time>/."""
    dest = root / ARCHIVE / utc_stamp()
    dest.mkdir(parents=True)
    try:
        latest_names = (root / LATEST).read_text().strip()
    except (OSError, UnicodeDecodeError):
        latest_names = None
    for p in sorted(paths):
        move_tree(p, dest / p.name, last=MANIFEST)
        moved[str(p)] = str(dest / p.name)
    if latest_names in {p.name for p in paths}:
        move_tree(root / LATEST, dest / LATEST)
    if not isinstance(root, RemotePath):
        fsync_path(root)
    return f"moved {', '.join(p.name for p in sorted(paths))} ({why}) to {dest}"


def repair_latest(root: CkptPath) -> list[str]:
    """Point `latest` at the newest committed checkpoint if it is missing or names one that is not there."""
    latest = root / LATEST
    try:
        named = latest.read_text().strip()
    except (OSError, UnicodeDecodeError):
        named = None
    if named and (root / named / MANIFEST).is_file():
        return []
    committed = sorted(committed_in(root), key=lambda pm: pm[1]["step"])
    if committed:
        publish_latest(committed[-1][0])
        return [f"{latest} named {named!r}, which is not a committed checkpoint; it now names {committed[-1][0].name}"]
    if latest.exists():
        move_tree(latest, latest.with_name(f"{LATEST}.stale-{utc_stamp()}"))
        return [f"{latest} named {named!r}, which is not a committed checkpoint, and none is left: moved it aside"]
    return []
