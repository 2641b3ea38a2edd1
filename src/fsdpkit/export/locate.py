"""Which checkpoint a path names, as the offline tools (export, inspect, verify, diff) see it.

A path is a checkpoint directory, a `.safetensors` file, or a checkpoints root or run directory
whose `latest` pointer names the checkpoint. `latest` is checked before it is followed: it must be
one line of text naming a directory beside it. A directory that fsdpkit would have committed but
that has no manifest.json is an uncommitted fsdpkit checkpoint, never a plain DCP one.
"""

from __future__ import annotations

import os
from pathlib import Path

from fsdpkit.checkpoint.errors import CheckpointCorruptError
from fsdpkit.checkpoint.layout import CHECKPOINTS, LATEST, MANIFEST, ON_EXCEPTION, STEP_DIR
from fsdpkit.checkpoint.safe_io import METADATA_FILENAME


class LatestPointerError(CheckpointCorruptError):
    """A `latest` pointer that is not one line naming a checkpoint directory beside it."""


def read_latest(root: Path) -> Path:
    """The checkpoint directory that `root/latest` names.

    Raises:
        LatestPointerError: `latest` is empty, binary, more than one name, names something outside
            `root`, or names a directory that does not exist; the message names the file, what
            is wrong with it and how to fix it.
    """
    pointer = root / LATEST
    raw = pointer.read_bytes()
    fix = (f"it should hold the name of a checkpoint directory in {root} (such as step_200): write the right "
           f"name into it (echo step_N > {pointer}) or pass a checkpoint directory instead of {root}")
    try:
        name = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise LatestPointerError(f"{pointer} is not text ({len(raw)} bytes of binary data); {fix}") from None
    if not name:
        raise LatestPointerError(f"{pointer} is empty; {fix}")
    if not name.isprintable():
        raise LatestPointerError(f"{pointer} holds {name[:80]!r}, not one directory name; {fix}")
    if name in (".", "..") or Path(name).name != name:
        raise LatestPointerError(f"{pointer} names {name!r}, which lies outside {root}; {fix}")
    target = root / name
    if not target.is_dir():
        raise LatestPointerError(f"{pointer} names {name}, which does not exist in {root}; {fix}")
    return target


def is_uncommitted_fsdpkit_dir(p: Path) -> bool:
    """True for a directory without manifest.json that fsdpkit wrote or would have written: one
    beside a `latest` pointer, or a `step_<N>`/`on_exception` directory under a `checkpoints`
    directory or holding no DCP `.metadata` either. (A `step_<N>` directory with `.metadata` but
    no `latest` beside it elsewhere may be another tool's DCP checkpoint; it is read as such.)"""
    if not p.is_dir() or (p / MANIFEST).exists():
        return False
    shaped = bool(STEP_DIR.match(p.name)) or p.name == ON_EXCEPTION
    return ((p.parent / LATEST).is_file()
            or (shaped and (p.parent.name == CHECKPOINTS or not (p / METADATA_FILENAME).is_file())))


def not_committed_message(p: Path) -> str:
    return (f"NOT COMMITTED: {p} has no {MANIFEST}: it is an fsdpkit checkpoint that was never committed (its save "
            "was interrupted, or a rank failed), so nothing in it can be trusted; use an earlier step (`latest` names "
            "the newest committed one)")


def resolve_checkpoint_dir(path: str | os.PathLike) -> Path:
    """The checkpoint `path` names: itself, or what a `latest` pointer under it names.

    Accepts a checkpoint directory (committed or not: callers report an uncommitted one), a
    checkpoints root (with `latest`), a run directory (with `checkpoints/latest`) or a
    `.safetensors` file.

    Raises:
        FileNotFoundError: nothing checkpoint-like there; says what was expected.
        LatestPointerError: a `latest` pointer that cannot be followed.
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{p} does not exist")
    if p.is_file():
        return p
    if (p / MANIFEST).is_file() or (p / METADATA_FILENAME).is_file() or any(p.glob("*.safetensors")):
        return p
    for root in (p, p / CHECKPOINTS):
        if (root / LATEST).is_file():
            return read_latest(root)
    if is_uncommitted_fsdpkit_dir(p):
        return p
    raise FileNotFoundError(
        f"{p} is not a checkpoint: expected a directory with manifest.json or .metadata (DCP), a checkpoints "
        "directory or run directory with a `latest` pointer, a Hugging Face folder or a .safetensors file"
    )
