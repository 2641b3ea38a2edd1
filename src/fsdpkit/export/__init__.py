"""Export and inspection of checkpoints.

    export_checkpoint(ckpt, out, *, dtype=None, max_shard_size="5GB", fmt="hf", ...) -> report
        streaming safetensors export of the model weights (Hugging Face folder or one file)
    inspect_checkpoint(path) -> report;  verify_checkpoint(path, *, threads, tensors) -> report
    diff_checkpoints(a, b, *, all_tensors=False) -> report

Names resolve lazily, so that importing the `fsdpkit` CLI (which registers `fsdpkit ckpt`)
does not import torch.distributed.checkpoint for every other command.

Layering: export sits above fsdpkit.hf (a Hugging Face folder's JSON files, the one safetensors
reader, transformers' version), checkpoint and model, and below train and cli
(tests/unit/test_import_layers.py). Loading a folder into a model is fsdpkit.hf's
(`load_hf_weights`), not this package's.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "export_checkpoint": "fsdpkit.export.exporter",
    "inspect_checkpoint": "fsdpkit.export.inspection",
    "verify_checkpoint": "fsdpkit.export.verification",
    "diff_checkpoints": "fsdpkit.export.diffing",
    "open_checkpoint": "fsdpkit.export.sources",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
