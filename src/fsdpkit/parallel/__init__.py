"""FSDP2 sharding: policies, mesh, deterministic init."""

from fsdpkit.parallel.fsdp import ShardingPlan, apply_fsdp, build_sharded_model, materialize
from fsdpkit.parallel.init import init_weights

__all__ = ["ShardingPlan", "apply_fsdp", "build_sharded_model", "init_weights", "materialize"]
