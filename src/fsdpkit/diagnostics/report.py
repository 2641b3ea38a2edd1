"""The diagnostics report: FSDP2's settings as applied, the module tree after wrapping, and
every rank's local parameter size (gathered with one collective), for the log and for
diagnostics.json in the run directory."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from torch import nn

from fsdpkit import dist
from fsdpkit.diagnostics.contracts import dtype_name
from fsdpkit.diagnostics.findings import PARAM_SKEW, WARNING, Finding
from fsdpkit.diagnostics.fsdp_state import (
    checkpointed_modules,
    fsdp_units,
    global_nbytes,
    human_bytes,
    local_nbytes,
    mesh_and_placements,
    own_params,
    unit_settings,
)
from fsdpkit.diagnostics.gather import all_gather_floats

DIAGNOSTICS_FILE = "diagnostics.json"
SAMPLE_UNITS = 3


def _mib(nbytes: int) -> float:
    return nbytes / 2**20


def _h(mib: float) -> str:
    return human_bytes(mib * 2**20)


def infer_strategy(mesh_shape: tuple[int, ...], placements: tuple[str, ...], reshard: set) -> str:
    """The FSDP1-style strategy name for what FSDP2 applied: the mesh, its placements and the
    units' reshard_after_forward."""
    if len(mesh_shape) == 2 and placements and placements[0].startswith("Replicate"):
        return "NO_SHARD" if mesh_shape[1] == 1 else "HYBRID_SHARD"
    if reshard == {True}:
        return "FULL_SHARD"
    if reshard == {False}:
        return "SHARD_GRAD_OP"
    if reshard and all(isinstance(r, int) and not isinstance(r, bool) for r in reshard):
        return f"FULL_SHARD, resharded to {sorted(reshard)[0]} ranks after forward"
    return f"mixed (reshard_after_forward {sorted(map(str, reshard))})"


def describe_sharding(model: nn.Module, *, state_dict_type: str | None = None) -> dict[str, Any]:
    """This rank's view of what FSDP2 applied, read from the live modules; no collectives."""
    units = fsdp_units(model)
    settings = {u.label: unit_settings(u, is_root=u.module is model) for u in units}
    blocks = [u for u in units if u.module is not model]
    root = next((u for u in units if u.module is model), None)
    mesh = mesh_and_placements(units)
    shape, dim_names, placements = mesh or ((), (), ())
    block_reshard = {settings[u.label].reshard_after_forward for u in blocks if u.params} or (
        {settings[root.label].reshard_after_forward} if root is not None else set())
    head = settings[root.label] if root is not None else (settings[units[0].label] if units else None)
    mp = head.mp_policy if head is not None else None
    all_params = [p for u in units for p in u.params] + ([] if root is not None else own_params(model))
    ac = checkpointed_modules(model)
    return {
        "world_size": dist.world_size(),
        "mesh": {"shape": list(shape), "dim_names": list(dim_names), "placements": list(placements)},
        "sharding_strategy": infer_strategy(shape, placements, block_reshard) if mesh else "not sharded",
        "reshard_after_forward": {
            "units": sorted(block_reshard, key=str)[0] if len(block_reshard) == 1 else sorted(map(str, block_reshard)),
            "root": settings[root.label].reshard_after_forward if root is not None else None,
        },
        "mixed_precision": None if mp is None else {
            "param_dtype": dtype_name(mp.param_dtype), "reduce_dtype": dtype_name(mp.reduce_dtype),
            "output_dtype": dtype_name(mp.output_dtype), "cast_forward_inputs": mp.cast_forward_inputs,
        },
        "offload": sorted({s.offload for s in settings.values() if s.offload is not None}) or None,
        "state_dict": {"module": "sharded DTensors (FSDP2 model.state_dict())", "checkpoint": state_dict_type},
        "num_units": len(blocks),
        "root_sharded": root is not None,
        "sample_units": [u.name for u in blocks[:SAMPLE_UNITS]],
        "num_checkpointed": len(ac),
        "checkpointed": ac,
        "units": [_unit_row(u, settings[u.label]) for u in units],
        "total_param_mib": _mib(global_nbytes(all_params)),
        "local_param_mib": _mib(local_nbytes(all_params)),
    }


def _unit_row(unit, s) -> dict[str, Any]:
    mp = s.mp_policy
    return {
        "name": unit.name, "params": len(unit.params), "local_mib": _mib(local_nbytes(unit.params)),
        "reshard_after_forward": s.reshard_after_forward, "offload": s.offload,
        "param_dtype": dtype_name(mp.param_dtype) if mp else None,
        "reduce_dtype": dtype_name(mp.reduce_dtype) if mp else None,
        "output_dtype": dtype_name(mp.output_dtype) if mp else None,
    }


def build_report(model: nn.Module, *, state_dict_type: str | None = None,
                 skew_warn_ratio: float = 1.25) -> tuple[dict[str, Any], list[Finding]]:
    """describe_sharding plus every rank's local parameter MiB (one all-gather: call on every
    rank) and a PARAM_SKEW warning when max/min across ranks exceeds skew_warn_ratio."""
    report = describe_sharding(model, state_dict_type=state_dict_type)
    per_rank = [row[0] for row in all_gather_floats([report["local_param_mib"]])]
    shard_ranks = report["mesh"]["shape"][-1] if report["mesh"]["shape"] else 1
    report["local_param_mib_per_rank"] = per_rank
    report["expected_local_param_mib"] = report["total_param_mib"] / shard_ranks
    low, high = min(per_rank), max(per_rank)
    report["param_skew"] = high / low if low > 0 else (1.0 if high == 0 else float("inf"))
    findings = []
    if report["param_skew"] > skew_warn_ratio:
        findings.append(Finding(
            WARNING, PARAM_SKEW,
            f"ranks hold unequal parameter shards: rank {per_rank.index(high)} {human_bytes(high * 2**20)}, rank "
            f"{per_rank.index(low)} {human_bytes(low * 2**20)} (ratio {report['param_skew']:.2f} > "
            f"diagnostics.skew_warn_ratio {skew_warn_ratio:g}); FSDP2 splits dim 0 of every parameter into "
            f"{shard_ranks} chunks, so dims that are small or not divisible by {shard_ranks} leave the last ranks with "
            "less: pad such sizes (e.g. the vocabulary) to a multiple of the shard group size, or raise "
            "diagnostics.skew_warn_ratio"))
    return report, findings


def format_report(report: dict[str, Any]) -> str:
    """Plain-words lines for the log."""
    mesh = report["mesh"]
    mp = report["mixed_precision"]
    ra = report["reshard_after_forward"]
    precision = ("none (fp32 everywhere)"
                 if mp is None or mp["param_dtype"] == "unset" and mp["reduce_dtype"] == "unset"
                 else f"params {mp['param_dtype']}, gradient reduction {mp['reduce_dtype']}, outputs "
                      f"{mp['output_dtype']}")
    per_rank = report.get("local_param_mib_per_rank") or [report["local_param_mib"]]
    ac = report["checkpointed"]
    lines = [
        "FSDP2 as applied (read from the modules, not the config):",
        f"  mesh {tuple(mesh['shape'])} {tuple(mesh['dim_names'])}, placements {', '.join(mesh['placements']) or '-'}: "
        f"{report['sharding_strategy']}; reshard_after_forward: units {ra['units']}, root {ra['root']}",
        f"  mixed precision: {precision}; offload: {', '.join(report['offload'] or ['none'])}; "
        f"state dict: {report['state_dict']['checkpoint'] or report['state_dict']['module']}",
        f"  units: {report['num_units']} besides the root ({', '.join(report['sample_units']) or '-'}"
        f"{', ...' if report['num_units'] > len(report['sample_units']) else ''}); root sharded: "
        f"{report['root_sharded']}; activation checkpointing: {len(ac)} "
        f"modules{' (' + ', '.join(ac[:3]) + (', ...' if len(ac) > 3 else '') + ')' if ac else ''}",
        f"  local parameters: {', '.join(f'rank {r} {_h(m)}' for r, m in enumerate(per_rank[:8]))}"
        f"{', ...' if len(per_rank) > 8 else ''} (total {_h(report['total_param_mib'])}, "
        f"{_h(report.get('expected_local_param_mib', report['local_param_mib']))} expected per rank)",
    ]
    return "\n".join(lines)


def format_memory(memory: dict[str, Any]) -> str:
    peaks = memory["peak_mib"]
    worst = memory.get("max_over_ranks_mib") or {}
    parts = [f"{p} {v:.1f}" + (f" (max over ranks {worst[p]:.1f})" if p in worst and len(memory.get("per_rank_mib",
                                                                                                    [])) > 1 else "")
             for p, v in peaks.items()]
    return (f"peak memory per phase over the first {memory['steps']} steps, rank 0, MiB ({memory['method']}): "
            f"{', '.join(parts)}; largest: {memory['largest_phase']} ({memory['largest_mib']:.1f} MiB)")


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write `data` as indented JSON atomically (temporary name, then rename)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    os.replace(tmp, path)
