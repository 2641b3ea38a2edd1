"""On-disk layout and the atomic-commit primitives.

    <run_dir>/checkpoints/
        step_<N>/            DCP files (*.distcp, .metadata) + manifest.json (the commit marker)
        on_exception/        same layout, written when the loop fails and every rank agrees (manager.py)
        latest               text file naming the newest committed checkpoint directory
        <name>.incoming/     a checkpoint that replaces a committed <name> (on_exception, or a step
                             saved again): written and committed beside it, then swapped in
        <name>.corrupt-<t>/  a checkpoint that failed verification, moved aside (never deleted)
        archive/<t>/         checkpoints moved out of the way by checkpoint.existing=archive, or
                             newer than the one a run explicitly resumed from
        .lock                held (flock) by the rank 0 of the run that uses this directory

A directory without a readable manifest.json is never a checkpoint. The manifest is written by
one rank after every rank finished writing: temporary name, fsync, rename, fsync of the directory.
`latest` moves the same way, after the manifest. On object storage (storage/) the same names are
key prefixes; the manifest and `latest` are each one PUT, after every shard object is uploaded.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from pathlib import Path

from fsdpkit.checkpoint.storage import RemotePath, move_tree, remove_tree, write_atomic

CkptPath = Path | RemotePath  # a local directory or an object-store prefix (see storage/__init__.py)

CHECKPOINTS = "checkpoints"
MANIFEST = "manifest.json"
LATEST = "latest"
ON_EXCEPTION = "on_exception"
ARCHIVE = "archive"
INCOMING = ".incoming"
REPLACED = ".replaced"
STEP_DIR = re.compile(r"^step_(\d+)$")
CHECKPOINT_NAME = re.compile(r"^(step_\d+|on_exception)(\.incoming)?$")


def step_dir_name(step: int) -> str:
    return f"step_{step}"


def publish_latest(ckpt_dir: CkptPath) -> None:
    write_atomic(ckpt_dir.parent / LATEST, ckpt_dir.name + "\n")


def remove_checkpoint(path: CkptPath) -> None:
    """Delete a checkpoint directory, its manifest first: from then on it is no checkpoint, even if
    the removal of the rest is interrupted."""
    remove_tree(path, first=MANIFEST)


def candidate_dirs(ckpt_root: CkptPath) -> list[CkptPath]:
    """Checkpoint-shaped directories (step_<N>, on_exception, and either's .incoming), committed or not."""
    if not ckpt_root.is_dir():
        return []
    return [p for p in ckpt_root.iterdir() if p.is_dir() and CHECKPOINT_NAME.match(p.name)]


def utc_stamp() -> str:
    return datetime.now(UTC).strftime("%Y%m%dT%H%M%S.%fZ")


def move_aside(path: CkptPath, label: str) -> CkptPath:
    """Rename `path` to `<name>.<label>-<UTC time>` beside it (never deleted); returns the new path."""
    new = path.with_name(f"{path.name}.{label}-{utc_stamp()}")
    move_tree(path, new, last=MANIFEST)
    return new


def swap_in(incoming: CkptPath, final: CkptPath) -> None:
    """Make the committed `incoming` the checkpoint at `final`; the one it replaces is deleted
    only after the new one is in place. A crash in between leaves `incoming` (a committed
    candidate, see CHECKPOINT_NAME) or `final` in place: never neither. On object storage the
    old `final` is removed (manifest first) and `incoming` copied in (manifest last), so the
    committed `incoming` is the checkpoint until the copy is committed."""
    if isinstance(final, RemotePath):
        remove_checkpoint(final)
        move_tree(incoming, final, last=MANIFEST)
        return
    replaced = final.with_name(final.name + REPLACED)
    if final.exists():
        if replaced.exists():
            remove_tree(replaced)  # the predecessor of an earlier swap that was interrupted
        move_tree(final, replaced)
    move_tree(incoming, final)
    remove_tree(replaced)
