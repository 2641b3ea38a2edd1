"""Which committed checkpoints to keep: the newest `keep_last`, every `keep_every`-th step, and the
`keep_best` by a logged metric. A policy, applied by the Checkpointer on rank 0 after each
commit (never inside it), so a checkpoint is only ever deleted once a newer one is committed.
Only this run's checkpoints are considered (see ownership.py). Never deleted: the checkpoint
just committed, the one `latest` names, the newest committed checkpoint, any directory without a
manifest (one being written, or debris for a person to look at), and `on_exception`.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from fsdpkit.checkpoint import catalog
from fsdpkit.checkpoint.layout import CkptPath, remove_checkpoint
from fsdpkit.checkpoint.storage import open_storage

log = logging.getLogger("fsdpkit.checkpoint")


@dataclass(frozen=True)
class RetentionPolicy:
    keep_last: int = 0  # 0: keep every checkpoint (the policy is off)
    keep_every: int = 0
    keep_best: int = 0
    metric: str = "val_loss"
    mode: str = "min"

    @property
    def active(self) -> bool:
        return self.keep_last > 0 or self.keep_best > 0 or self.keep_every > 0


@dataclass(frozen=True)
class Candidate:
    """A committed step_<N> checkpoint as the policy sees it: its step and its metric value."""

    path: CkptPath
    step: int
    metric: float | None


def policy_view(ckpt_root: CkptPath, *, metric: str, run_id: str | None = None) -> list[Candidate]:
    """This run's committed step_<N> checkpoints (the catalog's; of `run_id` when given), oldest
    first, with their `metric` value (None if unlogged)."""
    found = []
    for c in catalog.committed(ckpt_root):
        if not c.is_step_dir:
            continue  # on_exception, and a replacement not yet swapped in: never touched here
        if run_id is not None and c.manifest.get("run_id") not in (None, run_id):
            continue  # another run's: never touched here
        value = c.manifest.get("metrics", {}).get(metric)
        found.append(Candidate(c.path, c.step, None if value is None or math.isnan(value) else float(value)))
    return sorted(found, key=lambda c: c.step)


def to_keep(checkpoints: list[Candidate], policy: RetentionPolicy) -> set[int]:
    """Steps the policy keeps among `checkpoints` (oldest first). Pure: tested on its own."""
    if not checkpoints:
        return set()
    keep = {checkpoints[-1].step}  # the newest committed, always
    if policy.keep_last:
        keep |= {c.step for c in checkpoints[-policy.keep_last:]}
    if policy.keep_every:
        keep |= {c.step for c in checkpoints if c.step % policy.keep_every == 0}
    if policy.keep_best:
        scored = [c for c in checkpoints if c.metric is not None]
        scored.sort(key=lambda c: (c.metric if policy.mode == "min" else -c.metric, -c.step))
        keep |= {c.step for c in scored[: policy.keep_best]}
    return keep


def apply_retention(ckpt_root: CkptPath, policy: RetentionPolicy, *, run_id: str | None = None,
                    just_committed: CkptPath | None = None) -> list[CkptPath]:
    """Delete this run's committed checkpoints the policy does not keep; returns what was deleted."""
    if not policy.active:
        return []
    ckpt_root = open_storage(ckpt_root)
    checkpoints = policy_view(ckpt_root, metric=policy.metric, run_id=run_id)
    keep = to_keep(checkpoints, policy)
    protected = {just_committed.name if just_committed else None, catalog.read_latest(ckpt_root)}
    deleted = []
    for c in checkpoints:
        if c.step in keep or c.path.name in protected:
            continue
        remove_checkpoint(c.path)  # the manifest first (on object storage too)
        deleted.append(c.path)
    if deleted:
        log.info("retention: deleted %s (keeping %s)", ", ".join(p.name for p in deleted),
                 ", ".join(f"step_{s}" for s in sorted(keep)))
    return deleted

