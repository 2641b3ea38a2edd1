"""Typed configuration: the schema (schema.py) and its Hydra composition (compose.py).

`Config` is the schema; the composition functions load on first use, so that importing the schema
(as fsdpkit.model does for its ModelConfig) never imports Hydra or OmegaConf.
"""

from __future__ import annotations

import importlib
from typing import Any

from fsdpkit.checkpoint.settings import validate_checkpoint
from fsdpkit.config.schema import Config

_COMPOSE = ("check_world_size", "compose_config", "to_yaml")
__all__ = ["Config", "check_world_size", "compose_config", "to_yaml", "validate_checkpoint"]


def __getattr__(name: str) -> Any:
    if name not in _COMPOSE:
        raise AttributeError(f"module 'fsdpkit.config' has no attribute {name!r}")
    return getattr(importlib.import_module("fsdpkit.config.compose"), name)
