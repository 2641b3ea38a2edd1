"""Hugging Face model folders: their config, the model transformers builds from it, its buffers,
and its safetensors weights loaded into a (sharded) model, each rank reading its own slices.

    resolve_hf_config(model_cfg) -> (transformers config, override lines)   folder_config.py
    build_model(model_cfg, *, hf_config=None) -> nn.Module                   build.py
    init_buffers(model, *, also_params=..., keep_persistent=False)           buffers.py
    load_hf_weights(model, hf_dir, *, rename=None, grow_rows=False) -> report weights.py

Reading order: folder_config.py (config.json as transformers reads it, model.hf_config over it),
build.py (the configured model, any kind, on the meta device), buffers.py (every buffer's value
after to_empty, from the model's own init hooks), weights.py (the import: what is read, checked
and copied) with conversions.py (transformers' renamings and converters, the rules
from_pretrained follows) and safetensors_reader.py (headers, a folder's files, and the one reader
of their rows, which the export reads through too). Then library.py (the transformers version,
the class transformers built), config_json.py (JSON as transformers reads it) and
vocab_and_tie.py (a folder's vocabulary and tying against the model's).

Layering (tests/unit/test_import_layers.py keeps it acyclic): this package sits above
fsdpkit.model (plain modules), fsdpkit.checkpoint (errors, storage for hf: URLs read by ranged
GETs, dtype names) and fsdpkit.config's schema, and below fsdpkit.parallel, fsdpkit.export,
fsdpkit.train and fsdpkit.cli, which import it; it imports none of those four. model/ imports
nothing of this package.

Names resolve lazily: fsdpkit.parallel imports the builder and buffers without the storage layer.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "resolve_hf_config": "fsdpkit.hf.folder_config",
    "build_model": "fsdpkit.hf.build",
    "init_buffers": "fsdpkit.hf.buffers",
    "load_hf_weights": "fsdpkit.hf.weights",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
