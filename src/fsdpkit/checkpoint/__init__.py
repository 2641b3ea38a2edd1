"""Checkpoints: sharded save with atomic commit, resolution, safe and verified load.

The public API for any FSDP2 loop is `Checkpointer` (see manager.py); `find_checkpoint` lets a
loop learn before building its model whether it will resume. Errors derive from `CheckpointError`.
The names below load on first use, so that `fsdpkit.checkpoint.errors` stays free of torch.

What a checkpoint is on disk (every file, every manifest field, what each checksum covers and how
it is computed, the format versions) is written down in docs/checkpoint-format.md, the normative
description; manifest.py, hashing.py and save.py implement it, and tests/unit/test_known_answers.py
and tests/multirank/test_format_fixture.py hold them to it.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "Checkpointer": "manager", "CheckpointGroups": "manager", "Resumed": "manager", "find_checkpoint": "manager",
    "EXIT_PREEMPTED": "preemption", "CheckpointError": "errors", "CheckpointSaveError": "errors",
    "CheckpointCorruptError": "errors", "CheckpointMismatchError": "errors", "UnsafeCheckpointError": "errors",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'fsdpkit.checkpoint' has no attribute {name!r}")
    return getattr(importlib.import_module(f"fsdpkit.checkpoint.{_WHERE[name]}"), name)
