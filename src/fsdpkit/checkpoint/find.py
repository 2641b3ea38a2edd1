"""Before the model is built: lock the checkpoints root and find the checkpoint a run resumes from.

`find_checkpoint` is what `Checkpointer.resume()` does first; a loop that wants to know whether it
will resume before it builds its model (to skip the random initialisation) calls it itself, with
the same settings as its Checkpointer, and hands the `Found` on: `Checkpointer.resume(found)`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch.distributed as tdist

from fsdpkit.checkpoint.errors import CheckpointError
from fsdpkit.checkpoint.layout import CkptPath
from fsdpkit.checkpoint.resolve import resolve_checkpoint
from fsdpkit.checkpoint.settings import CheckpointConfig, IOSettings
from fsdpkit.checkpoint.storage import LocalPath, Lock, open_storage
from fsdpkit.checkpoint.storage.mirror import Mirror
from fsdpkit.dist import on_main

log = logging.getLogger("fsdpkit.checkpoint")


@dataclass
class Found:
    """What `find_checkpoint` found: the checkpoint to resume from (None: start fresh) and rank 0's
    lock on the directory, handed on to the Checkpointer."""

    path: CkptPath | None
    lock: Lock | None
    verify_while_loading: bool = False  # its checksums are still to check, by the load (resume.load_checkpoint)
    mirror_of: CkptPath | None = None  # `path` is checkpoint.local_dir's copy of this remote checkpoint


def find_checkpoint(settings: CheckpointConfig, *, group: tdist.ProcessGroup | None,
                    io_settings: IOSettings | None = None) -> Found:
    """Collective: lock `settings.dir` (rank 0) and resolve `settings.resume` (the newest committed,
    complete checkpoint; with `verify_checksums` its checksums are checked by `Checkpointer.resume`,
    as the load reads it (resume.load_checkpoint), where re-reading is cheap, else by resolution in a
    pass). `settings` and `io_settings` (default: the environment's) are those of the Checkpointer
    that resumes. With `local_dir`, the local copy of the resolved checkpoint replaces it when it
    matches (storage/mirror.py)."""
    io = io_settings or IOSettings.from_environment()
    held: list[Lock] = []
    root = open_storage(settings.dir, settings.storage_options)
    # a resume path is opened the same way, with the same options, where resolution opens it
    source = root if settings.resume in ("auto", "none") else open_storage(settings.resume, settings.storage_options)
    checked_by_load = root.checks_items and source.checks_items
    mirror = Mirror.open(settings.local_dir, root=root)

    def acquire() -> None:
        root.mkdir(parents=True, exist_ok=True)
        held.append(root.lock(io).acquire())

    on_main(acquire, group=group, errors=(CheckpointError, OSError))
    lock = held[0] if held else None
    try:
        # with a mirror, the remote copy's checksums are streamed only when the mirror is not used
        path = resolve_checkpoint(settings.resume, ckpt_root=root, group=group,
                                  storage_options=settings.storage_options, io=io,
                                  verify_checksums=settings.verify_checksums and not checked_by_load and mirror is None)
        local = _agreed_mirror(path, mirror, group=group) if mirror is not None and path is not None else None
        if local is not None:
            return Found(path=local, lock=lock, verify_while_loading=settings.verify_checksums, mirror_of=path)
        if mirror is not None and settings.verify_checksums and path is not None:
            path = resolve_checkpoint(settings.resume, ckpt_root=root, group=group,
                                      storage_options=settings.storage_options, verify_checksums=True, io=io)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    return Found(path=path, lock=lock,
                 verify_while_loading=settings.verify_checksums and path is not None and checked_by_load)


def _agreed_mirror(remote: CkptPath, mirror: Mirror, *, group: tdist.ProcessGroup | None) -> LocalPath | None:
    """Collective: the local copy of `remote` every rank reads instead (rank 0 decides: the mirror
    is one node's, every rank sees the same directory), or None."""
    def decide() -> str | None:
        local, why = mirror.usable(remote)
        log.info("checkpoint.local_dir: %s %s (%s)", "reading" if local else "not reading",
                 local or "the local copy", why)
        return None if local is None else str(local)

    chosen = on_main(decide, group=group, errors=(OSError,))
    return None if chosen is None else LocalPath(chosen)
