"""Which checkpoint a run resumes from: `checkpoint.resume` resolved over the catalog.

`auto` takes the newest committed checkpoint (catalog.py) whose files are all there with their
sizes and, with `verify_checksums`, whose files pass their checksums; a checkpoint that fails is
moved aside (never deleted) and the next older one tried. A path names one checkpoint, which must
be committed and intact. Rank 0 lists, every rank verifies its share, every rank gets one answer.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from typing import Any

import torch.distributed as tdist

from fsdpkit.checkpoint import catalog
from fsdpkit.checkpoint.errors import CheckpointCorruptError, CheckpointError
from fsdpkit.checkpoint.layout import CkptPath, move_aside
from fsdpkit.checkpoint.manifest import check_files_present, read_manifest
from fsdpkit.checkpoint.resume import verify_files
from fsdpkit.checkpoint.settings import IOSettings
from fsdpkit.checkpoint.storage import open_storage
from fsdpkit.dist import group_rank

log = logging.getLogger("fsdpkit.checkpoint")


def committed_candidates(ckpt_root: CkptPath, *,
                         corrupt: list[tuple[CkptPath, str]] | None = None) -> list[tuple[CkptPath, int]]:
    """(path, step) of the committed checkpoints whose files are all there, newest first (on_exception
    first when it is at least as new, and a committed replacement `.incoming` before the checkpoint it
    replaces: catalog.newest_first). Directories never committed are skipped quietly (an interrupted
    save); corrupt or incomplete ones are skipped with a warning and, if `corrupt` is given, appended
    to it with the reason."""
    found = catalog.scan(open_storage(ckpt_root))
    for path in found.uncommitted:
        log.info("skipping %s: never committed (an interrupted save)", path)
    problems = dict(found.unreadable)
    for c in found.committed:
        if missing := check_files_present(c.path, c.manifest):
            problems[c.path] = "; ".join(missing)
    for path, why in problems.items():
        log.warning("skipping %s: %s", path, why)
        if corrupt is not None:
            corrupt.append((path, why))
    return [(c.path, c.step) for c in found.committed if c.path not in problems]


def set_aside(path: CkptPath, why: str) -> None:
    """Rank 0: move a checkpoint that failed verification out of the way (never deleted), so
    that its step is saved again and nothing resolves to it."""
    try:
        new = move_aside(path, "corrupt")
    except OSError as e:
        log.warning("could not move %s aside (%s); it stays, and stays skipped", path, e)
        return
    # Every line of `why`: a failure found at load time puts the damaged files on the lines after the first.
    reason = " ".join(line.strip() for line in why.splitlines() if line.strip())
    log.warning("moved %s to %s: it failed verification (%s); inspect or delete it yourself", path.name, new.name,
                reason[:1000])


def resolve_checkpoint(resume: str, *, ckpt_root: CkptPath, group: tdist.ProcessGroup | None,
                       verify_checksums: bool = True, storage_options: Mapping[str, Any] | None = None,
                       skip: Collection[str] = (), io: IOSettings | None = None) -> CkptPath | None:
    """The checkpoint every rank resumes from (rank 0 decides, all ranks verify together).

    `none`: None. `auto`: the newest committed checkpoint under `ckpt_root` that passes
    verification (complete; with `verify_checksums`, every file's checksum too, read with `io`), or
    None; names in `skip` are passed over (found corrupt already, and not moved aside). A path: that
    checkpoint, which must be committed and intact (a URL is opened with `storage_options`).
    """
    if resume == "none":
        return None
    ckpt_root, rank = open_storage(ckpt_root), group_rank(group)
    if resume == "auto":
        candidates, explicit = None, False
        if rank == 0:
            corrupt: list[tuple[CkptPath, str]] = []
            candidates = [p.name for p, _ in committed_candidates(ckpt_root, corrupt=corrupt) if p.name not in skip]
            for path, why in corrupt:
                set_aside(path, why)
    else:
        candidates, explicit = [resume], True
    if tdist.is_initialized():
        box = [candidates]
        tdist.broadcast_object_list(box, src=0, group=group)
        candidates = box[0]
    for candidate in candidates:
        # auto's candidates are names under ckpt_root, which keeps its filesystem (storage options)
        path = open_storage(candidate, storage_options) if explicit else ckpt_root / candidate
        try:
            manifest = read_manifest(path)
            missing = check_files_present(path, manifest)
            if missing:
                raise CheckpointCorruptError(f"{path} is incomplete: " + "; ".join(missing))
        except FileNotFoundError as e:
            if not path.exists():
                raise FileNotFoundError(f"checkpoint.resume={resume!r}: {path} does not exist") from None
            raise CheckpointError(f"checkpoint.resume={resume!r} is not a committed checkpoint: {e}") from None
        problems = verify_files(path, manifest, group=group, io=io) if verify_checksums else []
        if not problems:
            return path
        message = f"{path} failed verification:\n  " + "\n  ".join(problems)
        if explicit:
            raise CheckpointCorruptError(message)
        log.warning("skipping %s", message)
        if rank == 0:
            set_aside(path, problems[0])
        _barrier(group)  # nobody looks at the next candidate while rank 0 still moves this one
    return None


def _barrier(group: tdist.ProcessGroup | None) -> None:
    if tdist.is_initialized():
        tdist.barrier(group=group)
