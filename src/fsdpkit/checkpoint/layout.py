"""On-disk layout: the names of a checkpoints root, and the moves of whole checkpoints.

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
Which of these directories are committed checkpoints, and `latest` itself: catalog.py.
"""

from __future__ import annotations

from datetime import UTC, datetime

from fsdpkit.checkpoint.storage import StoragePath, open_storage

CkptPath = StoragePath  # a local directory or an object-store prefix (see storage/protocol.py)

CHECKPOINTS = "checkpoints"
MANIFEST = "manifest.json"
LATEST = "latest"
ON_EXCEPTION = "on_exception"
ARCHIVE = "archive"
INCOMING = ".incoming"


def remove_checkpoint(path: CkptPath) -> None:
    """Delete a checkpoint directory, its manifest first: from then on it is no checkpoint, even if
    the removal of the rest is interrupted."""
    open_storage(path).remove_tree(first=MANIFEST)


def utc_stamp() -> str:
    return datetime.now(UTC).strftime("%Y%m%dT%H%M%S.%fZ")


def move_aside(path: CkptPath, label: str) -> CkptPath:
    """Rename `path` to `<name>.<label>-<UTC time>` beside it (never deleted); returns the new path."""
    path = open_storage(path)
    new = path.with_name(f"{path.name}.{label}-{utc_stamp()}")
    path.move_to(new, last=MANIFEST)
    return new


def swap_in(incoming: CkptPath, final: CkptPath) -> None:
    """Make the committed `incoming` the checkpoint at `final`; the one it replaces is deleted
    only after the new one is in place. A crash in between leaves `incoming` (a committed
    candidate, see catalog.CHECKPOINT_NAME) or `final` in place: never neither (StoragePath.replace_with)."""
    open_storage(final).replace_with(open_storage(incoming), marker=MANIFEST)
