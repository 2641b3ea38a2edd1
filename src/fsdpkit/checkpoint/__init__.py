"""Checkpoints: sharded save with atomic commit, resolution, safe and verified load.

The public API for any FSDP2 loop is `Checkpointer` (see manager.py); `find_checkpoint` lets a
loop learn before building its model whether it will resume. Errors derive from `CheckpointError`.
The names below load on first use, so that `fsdpkit.checkpoint.errors` stays free of torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "Checkpointer": "manager", "CheckpointGroups": "manager", "find_checkpoint": "manager",
    "EXIT_PREEMPTED": "preemption", "CheckpointError": "errors", "CheckpointSaveError": "errors",
    "CheckpointCorruptError": "errors", "CheckpointMismatchError": "errors", "UnsafeCheckpointError": "errors",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'fsdpkit.checkpoint' has no attribute {name!r}")
    return getattr(importlib.import_module(f"fsdpkit.checkpoint.{_WHERE[name]}"), name)
