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
`latest` moves the same way, after the manifest.
"""

from __future__ import annotations

import os
import re
import shutil
from datetime import UTC, datetime
from pathlib import Path

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


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` to `path` so that readers see the old content or the new, never a mix."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with tmp.open("w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # e.g. ENOSPC: leave no half-written temporary behind
        raise
    fsync_dir(path.parent)


def publish_latest(ckpt_dir: Path) -> None:
    atomic_write_text(ckpt_dir.parent / LATEST, ckpt_dir.name + "\n")


def candidate_dirs(ckpt_root: Path) -> list[Path]:
    """Checkpoint-shaped directories (step_<N>, on_exception, and either's .incoming), committed or not."""
    if not ckpt_root.is_dir():
        return []
    return [p for p in ckpt_root.iterdir() if p.is_dir() and CHECKPOINT_NAME.match(p.name)]


def utc_stamp() -> str:
    return datetime.now(UTC).strftime("%Y%m%dT%H%M%S.%fZ")


def move_aside(path: Path, label: str) -> Path:
    """Rename `path` to `<name>.<label>-<UTC time>` beside it (never deleted); returns the new path."""
    new = path.with_name(f"{path.name}.{label}-{utc_stamp()}")
    os.rename(path, new)
    fsync_dir(path.parent)
    return new


def swap_in(incoming: Path, final: Path) -> None:
    """Make the committed `incoming` the checkpoint at `final`; the one it replaces is deleted
    only after the new one is in place. A crash in between leaves `incoming` (a committed
    candidate, see CHECKPOINT_NAME) or `final` in place: never neither."""
    replaced = final.with_name(final.name + REPLACED)
    if final.exists():
        if replaced.exists():
            shutil.rmtree(replaced)  # the predecessor of an earlier swap that was interrupted
        os.rename(final, replaced)
    os.rename(incoming, final)
    fsync_dir(final.parent)
    shutil.rmtree(replaced, ignore_errors=True)
