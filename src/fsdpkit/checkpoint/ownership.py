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

import logging
import uuid
from typing import Any

from fsdpkit.checkpoint import catalog
from fsdpkit.checkpoint.errors import CheckpointError
from fsdpkit.checkpoint.layout import ARCHIVE, LATEST, MANIFEST, CkptPath, utc_stamp
from fsdpkit.checkpoint.storage import open_storage

log = logging.getLogger("fsdpkit.checkpoint")
EXISTING_POLICIES = ("error", "archive")


def new_run_id() -> str:
    return uuid.uuid4().hex


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
    root = open_storage(root)
    foreign, newer = [], []
    for path, manifest in ((c.path, c.manifest) for c in catalog.committed(root)):
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
    lines += catalog.repair_latest(root)
    return lines, moved


def _archive(root: CkptPath, paths: list[CkptPath], moved: dict[str, str], *, why: str) -> str:
    """Move `paths` (and `latest`, when it names one of them) into a new archive/<time>/."""
    dest = root / ARCHIVE / utc_stamp()
    dest.mkdir(parents=True)
    latest_names = catalog.read_latest(root)
    for p in sorted(paths):
        p.move_to(dest / p.name, last=MANIFEST)
        moved[str(p)] = str(dest / p.name)
    if latest_names in {p.name for p in paths}:
        (root / LATEST).move_to(dest / LATEST)
    root.fsync()
    return f"moved {', '.join(p.name for p in sorted(paths))} ({why}) to {dest}"

