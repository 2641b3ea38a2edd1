"""Checkpoints: sharded save with atomic commit, resolution, safe and verified load.

The public API for any FSDP2 loop is `Checkpointer` (see manager.py), configured by a
`CheckpointConfig` and an `IOSettings` (settings.py); `find_checkpoint` (with the same settings)
lets a loop learn before building its model whether it will resume, and returns a `Found`. Errors
derive from `CheckpointError`. The names below load on first use, so that
`fsdpkit.checkpoint.errors` stays free of torch.

What a checkpoint is on disk (every file, every manifest field, what each checksum covers and how
it is computed, the format versions) is written down in docs/checkpoint-format.md, the normative
description; manifest.py, hashing.py and save.py implement it, and tests/unit/test_known_answers.py
and tests/multirank/test_format_fixture.py hold them to it.

Reading order for a newcomer. The core, first (this directory):
  manager.py      the Checkpointer: cadence, retention after each commit, preemption, on_exception, resume
  settings.py     its settings: CheckpointConfig (when and how; validate_checkpoint) and IOSettings (tunables)
  catalog.py      what a checkpoints root holds: step names, which are committed, where `latest` points
  save.py         one save: DCP write, the gathered file list, the manifest commit
  find.py         before the model is built: the lock and the checkpoint to resume from (`Found`)
  resolve.py      which checkpoint `checkpoint.resume` names, verified
  resume.py       the load, and the checks during and after it
  manifest.py     manifest.json (with manifest_schema.py, its shape); layout.py, the names and moves
  state.py        what a checkpoint holds, gathered from and restored into the run
  hashing.py      file and tensor checksums (row hash: _rowhash.c)
  safe_io.py      loading without running a checkpoint's code (DCP's reader and planner, no pickle)
Then, as needed: ownership.py (one run per directory), retention.py, preemption.py, async_save.py
and staging.py (background saves), full.py (`state_dict_type: full`), frozen.py (frozen weights
written once), embeddings.py (the model's vocabulary and tying, as a manifest records them),
replicas.py (a load under HYBRID_SHARD or NO_SHARD: one replica group reads, the others receive).
Two layers below it, each behind one seam:
  io/             the I/O seam (io/__init__.py: DCP's own writer with file checksums, DCP's own reader
                  without its pickle), page_cache.py (files read start to end, for checksums) and
                  torch_save.py (a tensor's bytes in a torch.save blob, for the export)
  storage/        where checkpoints live, behind one protocol (storage/protocol.py: StoragePath):
                  local.py (local paths), remote.py (fsspec URLs); object storage's multipart.py,
                  safe_fsspec.py and object_lock.py, the local mirror (mirror.py), urls.py
Nothing here imports the trainer's configuration machinery (Hydra, OmegaConf) or any layer above it:
tests/unit/test_checkpoint_standalone.py.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "Checkpointer": "manager", "CheckpointGroups": "manager", "Resumed": "manager", "find_checkpoint": "find",
    "Found": "find", "CheckpointConfig": "settings", "IOSettings": "settings", "validate_checkpoint": "settings",
    "EXIT_PREEMPTED": "preemption", "CheckpointError": "errors", "CheckpointSaveError": "errors",
    "CheckpointCorruptError": "errors", "CheckpointMismatchError": "errors", "UnsafeCheckpointError": "errors",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'fsdpkit.checkpoint' has no attribute {name!r}")
    return getattr(importlib.import_module(f"fsdpkit.checkpoint.{_WHERE[name]}"), name)
