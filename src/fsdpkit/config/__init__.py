"""Typed configuration: the schema and its Hydra composition."""

from fsdpkit.config.compose import (
    check_world_size,
    compose_config,
    to_yaml,
    validate_checkpoint,
)
from fsdpkit.config.schema import Config

__all__ = ["Config", "check_world_size", "compose_config", "to_yaml", "validate_checkpoint"]
