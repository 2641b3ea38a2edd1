"""The catalog of a checkpoints root: how checkpoints are named, which are there, which are
committed, and where `latest` points. Each question has its one answer here; resolution
(resolve.py), retention (retention.py), ownership (ownership.py), the save (save.py), the sweep of
shared frozen tensors (frozen.py), the local mirror (storage/mirror.py) and the offline tools
(export/locate.py) ask it.

- Names: `step_<N>` (step_dir_name, STEP_DIR), `on_exception`, and either's `.incoming` (a
  replacement committed beside the checkpoint it replaces): CHECKPOINT_NAME.
- Committed: a checkpoint-shaped directory whose manifest passes its seal and shape
  (manifest.read_manifest). Whether its files are all there is resolution's question.
- `latest`: one line naming the newest committed checkpoint, moved atomically after each commit.
  `read_latest` is lenient (None for anything unusable), `follow_latest` strict (it says what is wrong).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any

from fsdpkit.checkpoint.errors import CheckpointCorruptError
from fsdpkit.checkpoint.layout import ARCHIVE, INCOMING, LATEST, MANIFEST, ON_EXCEPTION, CkptPath, utc_stamp
from fsdpkit.checkpoint.manifest import read_manifest
from fsdpkit.checkpoint.storage import open_storage

STEP_DIR = re.compile(r"^step_(\d+)$")
CHECKPOINT_NAME = re.compile(r"^(step_\d+|on_exception)(\.incoming)?$")


def step_dir_name(step: int) -> str:
    """The directory name of the checkpoint of `step`: step_<step>."""
    return f"step_{step}"


@dataclass(frozen=True)
class Committed:
    """A committed checkpoint: its directory and its manifest (seal and shape checked)."""

    path: CkptPath
    manifest: dict[str, Any]

    @property
    def step(self) -> int:
        return self.manifest["step"]

    @property
    def is_step_dir(self) -> bool:
        """A step_<N> directory (not on_exception, not a replacement not yet swapped in)."""
        return bool(STEP_DIR.match(self.path.name))


@dataclass
class Scan:
    """What a checkpoints root holds, checkpoint-shaped directories only (one listing, one read of
    each manifest): `committed` newest first (see `newest_first`), `uncommitted` (no manifest: a
    save that was interrupted, or is being written), `unreadable` ((path, why): a manifest that
    fails its seal or shape)."""

    committed: list[Committed] = field(default_factory=list)
    uncommitted: list[CkptPath] = field(default_factory=list)
    unreadable: list[tuple[CkptPath, str]] = field(default_factory=list)


def candidates(root: CkptPath) -> list[CkptPath]:
    """Checkpoint-shaped directories under `root` (step_<N>, on_exception, either's .incoming),
    committed or not."""
    if not root.is_dir():
        return []
    return [p for p in root.iterdir() if p.is_dir() and CHECKPOINT_NAME.match(p.name)]


def every_dir(root: CkptPath, *, besides: tuple[str, ...] = ()) -> list[CkptPath]:
    """Every directory that holds or held a checkpoint under `root`, whatever its state: committed
    or not, moved aside (`<name>.corrupt-<time>`), archived (archive/<time>/<name>); the directories
    named in `besides` excepted. For the questions that must see all of them (which shared frozen
    tensors some manifest still names: frozen.referenced)."""
    dirs = [p for p in root.iterdir() if p.is_dir() and p.name not in besides] if root.is_dir() else []
    archive = root / ARCHIVE
    if archive.is_dir():
        dirs += [p for stamp in archive.iterdir() if stamp.is_dir() for p in stamp.iterdir() if p.is_dir()]
    return dirs


def newest_first(checkpoint: Committed) -> tuple[int, bool, bool]:
    """Sort key, with reverse=True: by step; at one step on_exception first (saved after it), and a
    committed replacement (`.incoming`) before the checkpoint it replaces."""
    name = checkpoint.path.name
    return checkpoint.step, name.startswith(ON_EXCEPTION), name.endswith(INCOMING)


def scan(root: CkptPath) -> Scan:
    """Every checkpoint-shaped directory under `root`, sorted into committed, uncommitted and unreadable."""
    found = Scan()
    for path in candidates(root):
        try:
            found.committed.append(Committed(path, read_manifest(path)))
        except FileNotFoundError:
            found.uncommitted.append(path)
        except CheckpointCorruptError as e:
            found.unreadable.append((path, str(e)))
    found.committed.sort(key=newest_first, reverse=True)
    return found


def committed(root: CkptPath) -> list[Committed]:
    """The committed checkpoints under `root`, newest first."""
    return scan(root).committed


def read_latest(root: CkptPath) -> str | None:
    """The name `root/latest` holds, or None when there is no readable one (nothing is checked
    about the name: `follow_latest` does)."""
    try:
        return (root / LATEST).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


class LatestPointerError(CheckpointCorruptError):
    """A `latest` pointer that is not one line naming a checkpoint directory beside it."""


def follow_latest(root: CkptPath) -> CkptPath:
    """The checkpoint directory that `root/latest` names.

    Raises:
        FileNotFoundError: there is no `latest`.
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
    if name in (".", "..") or PurePath(name).name != name:
        raise LatestPointerError(f"{pointer} names {name!r}, which lies outside {root}; {fix}")
    target = root / name
    if not target.is_dir():
        raise LatestPointerError(f"{pointer} names {name}, which does not exist in {root}; {fix}")
    return target


def publish_latest(ckpt_dir: CkptPath) -> None:
    """Point `latest` beside `ckpt_dir` at it (atomically: readers see the old name or the new)."""
    (open_storage(ckpt_dir).parent / LATEST).write_atomic(ckpt_dir.name + "\n")


def repair_latest(root: CkptPath) -> list[str]:
    """Point `latest` at the newest committed checkpoint if it is missing or names one that is not
    there (moved aside when none is left); returns what was done, for the log."""
    root = open_storage(root)
    latest = root / LATEST
    named = read_latest(root)
    if named and (root / named / MANIFEST).is_file():
        return []
    newest = max(committed(root), key=lambda c: c.step, default=None)
    if newest is not None:
        publish_latest(newest.path)
        return [f"{latest} named {named!r}, which is not a committed checkpoint; it now names {newest.path.name}"]
    if latest.exists():
        latest.move_to(latest.with_name(f"{LATEST}.stale-{utc_stamp()}"))
        return [f"{latest} named {named!r}, which is not a committed checkpoint, and none is left: moved it aside"]
    return []

