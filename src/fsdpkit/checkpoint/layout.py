"""On-disk layout and the atomic-commit primitives.

    <run_dir>/checkpoints/
        step_<N>/            DCP files (*.distcp, .metadata) + manifest.json (the commit marker)
        on_exception/        same layout, written when the loop fails and every rank agrees (manager.py)
        latest               text file naming the newest committed checkpoint directory

A directory without a readable manifest.json is never a checkpoint. The manifest is written by
one rank after every rank finished writing: temporary name, fsync, rename, fsync of the directory.
`latest` moves the same way, after the manifest.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

CHECKPOINTS = "checkpoints"
MANIFEST = "manifest.json"
LATEST = "latest"
ON_EXCEPTION = "on_exception"
STEP_DIR = re.compile(r"^step_(\d+)$")


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
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def publish_latest(ckpt_dir: Path) -> None:
    atomic_write_text(ckpt_dir.parent / LATEST, ckpt_dir.name + "\n")


def candidate_dirs(ckpt_root: Path) -> list[Path]:
    """Checkpoint-shaped directories (step_<N>, on_exception), committed or not."""
    if not ckpt_root.is_dir():
        return []
    return [p for p in ckpt_root.iterdir() if p.is_dir() and (STEP_DIR.match(p.name) or p.name == ON_EXCEPTION)]
