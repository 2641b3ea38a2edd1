"""`fsdpkit ckpt inspect`: what a checkpoint holds, from its manifest and metadata alone.

Reads manifest.json (JSON) and DCP's `.metadata` through the allow-list unpickler; tensor data
and pickled non-tensor items are never loaded. Works on plain DCP directories and safetensors
folders too, with whatever they record.
"""

from __future__ import annotations

import os
import re
from collections import Counter, defaultdict
from typing import Any

from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from fsdpkit.checkpoint.hashing import HASH_NAME
from fsdpkit.checkpoint.manifest import check_files_present, dtype_name
from fsdpkit.export.keys import split_namespace
from fsdpkit.export.sources import (
    DcpLoadSource,
    DcpSource,
    OpenedCheckpoint,
    SafetensorsSource,
    open_checkpoint,
)

RANK_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")
_CONFIG_SUMMARY = {
    "model": ("kind", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "tie_word_embeddings"),
    "strategy": ("sharding_strategy", "state_dict_type", "cpu_offload"),
    "policy": ("mixed_precision", "auto_wrap_policy", "activation_checkpointing_policy"),
    "train": ("max_steps", "global_batch_size", "micro_batch_size", "grad_clip"),
    "optim": ("lr", "weight_decay", "warmup_steps", "schedule"),
    "data": ("kind", "seq_len"),
}


def describe_chunks(shape: tuple[int, ...], chunks: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> str:
    """How a tensor is split into DCP chunks, in words: `whole`, `dim 0: 256+256 rows`, `4 blocks`."""
    nonempty = [(o, s) for o, s in chunks if all(s)]
    if len(nonempty) <= 1:
        return "whole" if (not nonempty or nonempty[0][1] == shape) else "1 chunk (partial)"
    if shape and all(o[1:] == (0,) * (len(shape) - 1) and s[1:] == shape[1:] for o, s in nonempty):
        rows = [s[0] for _, s in sorted(nonempty)]
        text = f"{len(rows)} x {rows[0]}" if len(set(rows)) == 1 else "+".join(map(str, rows))
        return f"dim 0: {text} rows"
    shapes = ", ".join("x".join(map(str, s)) for _, s in nonempty[:4])
    return f"{len(nonempty)} blocks of " + shapes + (" ..." if len(nonempty) > 4 else "")


def _config_summary(config: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {k: config[k] for k in ("name", "seed", "deterministic") if k in config}
    for section, keys in _CONFIG_SUMMARY.items():
        values = config.get(section) or {}
        picked = {k: values[k] for k in keys if k in values}
        if section == "model" and values.get("kind") == "hf":
            picked["hf_config"] = values.get("hf_config")
        if picked:
            out[section] = picked
    return out


def _checksum_status(opened: OpenedCheckpoint) -> dict[str, Any]:
    manifest = opened.manifest
    if manifest is None:
        return {"recorded": False, "text": f"none recorded ({opened.kind} checkpoint): `fsdpkit ckpt verify` checks "
                                           "its structure only"}
    problems = check_files_present(opened.path, manifest)
    files, tensors = len(manifest.get("files", {})), len(manifest.get("tensors", {}))
    algorithm = manifest.get("tensor_hash", "linear")
    text = (f"recorded for {files} files ({HASH_NAME}) and {tensors} tensors ({algorithm}); "
            + ("every file is present with its recorded size (not recomputed: run `fsdpkit ckpt "
               "verify`)" if not problems
               else f"{len(problems)} problem(s): " + "; ".join(problems)))
    return {"recorded": True, "files": files, "tensors": tensors, "tensor_hash": algorithm, "problems": problems,
            "text": text}


def _dcp_tables(source: DcpSource) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, int]]:
    """(tensors, non-tensor items, bytes per file) from the metadata."""
    md = source.metadata
    per_file: Counter[str] = Counter()
    files_of: dict[str, set[str]] = defaultdict(set)
    for index, storage in md.storage_data.items():
        per_file[storage.relative_path] += storage.length
        files_of[index.fqn].add(storage.relative_path)
    tensors, others = [], []
    for key, item in md.state_dict_metadata.items():
        group = split_namespace(key, source.key_paths)[0] or "(top level)"
        if isinstance(item, TensorStorageMetadata):
            shape = tuple(item.size)
            chunks = [(tuple(c.offsets), tuple(c.sizes)) for c in item.chunks]
            numel = 1
            for s in shape:
                numel *= s
            tensors.append({"key": key, "group": group, "shape": list(shape),
                            "dtype": dtype_name(item.properties.dtype),
                            "numel": numel, "bytes": numel * item.properties.dtype.itemsize,
                            "sharding": describe_chunks(shape, chunks), "files": sorted(files_of[key])})
        elif isinstance(item, BytesStorageMetadata):
            others.append({"key": key, "group": group, "files": sorted(files_of[key]),
                           "note": "pickled object (listed, never loaded)"})
    return tensors, others, dict(sorted(per_file.items()))


def _safetensors_tables(source: SafetensorsSource) -> tuple[list[dict[str, Any]], dict[str, int]]:
    tensors = []
    for key, info in source.tensors().items():
        tensors.append({"key": key, "group": "model", "shape": list(info.shape), "dtype": dtype_name(info.dtype),
                        "numel": info.numel, "bytes": info.nbytes, "sharding": "whole",
                        "files": [source.file_of(key).name]})
    sizes = {f: os.path.getsize(source.path / f if source.path.is_dir() else source.path)
             for f in sorted({t["files"][0] for t in tensors})}
    return tensors, sizes


def _optimizer_states(tensors: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """exp_avg / exp_avg_sq / step ...: how many tensors, bytes and dtypes each (from `optim*` keys)."""
    states: dict[str, dict[str, Any]] = {}
    for t in tensors:
        if not t["group"].startswith("optim"):
            continue
        name = t["key"].rsplit(".", 1)[-1]
        entry = states.setdefault(name, {"tensors": 0, "bytes": 0, "dtypes": set()})
        entry["tensors"] += 1
        entry["bytes"] += t["bytes"]
        entry["dtypes"].add(t["dtype"])
    return {k: {**v, "dtypes": sorted(v["dtypes"])} for k, v in states.items()}


def inspect_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Everything `fsdpkit ckpt inspect` shows, as a JSON-able dict.

    Raises:
        FileNotFoundError: no checkpoint there.
        CheckpointError: unreadable or crafted metadata (UnsafeCheckpointError: refused, nothing run).
    """
    with open_checkpoint(path) as opened:
        manifest = opened.manifest or {}
        source = opened.source
        if isinstance(source, DcpSource | DcpLoadSource):
            tensors, others, per_file = _dcp_tables(source if isinstance(source, DcpSource) else source._inner)
        else:
            tensors, per_file = _safetensors_tables(source)
            others = []
        per_rank: dict[str, int] = defaultdict(int)
        for name, size in per_file.items():
            match = RANK_FILE.match(name)
            per_rank[f"rank {match.group(1)}" if match else name] += size
        groups: dict[str, dict[str, int]] = {}
        for t in tensors:
            g = groups.setdefault(t["group"], {"tensors": 0, "numel": 0, "bytes": 0})
            g["tensors"] += 1
            g["numel"] += t["numel"]
            g["bytes"] += t["bytes"]
        trainer = manifest.get("trainer") or {}
        report: dict[str, Any] = {
            "path": str(opened.path),
            "notes": opened.notes,
            "kind": opened.kind,
            "committed": opened.manifest is not None,
            "format_version": manifest.get("format_version"),
            "step": manifest.get("step"),
            "committed_at": manifest.get("committed_at"),
            "world_size": manifest.get("world_size"),
            "mesh": manifest.get("mesh"),
            "state_dict_type": manifest.get("state_dict_type"),
            "versions": manifest.get("versions"),
            "config": _config_summary(manifest.get("config") or {}),
            "counters": trainer.get("train"),
            "data_cursor": trainer.get("data"),
            "optimizer": manifest.get("optimizer"),
            # a Checkpointer without an optimizer (an EMA copy, a frozen teacher) records "optimizer": null
            "saved_without_optimizer": "optimizer" in manifest and manifest["optimizer"] is None,
            "optimizer_states": _optimizer_states(tensors),
            "checksums": _checksum_status(opened),
            "groups": groups,
            "bytes_per_file": per_file,
            "bytes_per_rank": dict(per_rank) if opened.kind in ("fsdpkit", "dcp") else None,
            "tensors": tensors,
            "non_tensor_items": others,
            # frozen tensors held by a shared directory (checkpoint/frozen.py), not by the checkpoint's own files
            "shared": [{"dir": ref["dir"], "tensors": len(ref["keys"]),
                        "bytes": sum(f["size"] for f in ref["files"].values())} for ref in manifest.get("shared", [])],
        }
        if opened.kind in ("fsdpkit", "dcp") and isinstance(source, DcpSource | DcpLoadSource):
            report["dcp_version"] = getattr(source.metadata, "version", None)
        return report


def render_text(report: dict[str, Any], *, all_tensors: bool = False) -> str:
    """The human-readable form of `inspect_checkpoint`'s report."""
    lines = [*report.get("notes", []), f"checkpoint  {report['path']}",
             f"kind        {report['kind']}" + ("" if report["committed"] or report["kind"] != "dcp"
                                                                              else " (no fsdpkit manifest)")]
    for label, key in (("step", "step"), ("committed", "committed_at"), ("world size", "world_size"),
                       ("state dict", "state_dict_type"), ("format", "format_version"), ("dcp version", "dcp_version")):
        if report.get(key) is not None:
            lines.append(f"{label:<12}{report[key]}")
    if report.get("mesh"):
        lines.append(f"{'mesh':<12}shape {report['mesh'].get('shape')} dims {report['mesh'].get('dim_names')}")
    if report.get("versions"):
        lines.append(f"{'versions':<12}" + ", ".join(f"{k} {v}" for k, v in report["versions"].items()))
    if report.get("counters"):
        lines.append(f"{'counters':<12}" + ", ".join(f"{k}={v}" for k, v in report["counters"].items()))
    if report.get("data_cursor"):
        lines.append(f"{'data cursor':<12}" + ", ".join(f"{k}={v}" for k, v in report["data_cursor"].items()))
    lines.append(f"{'checksums':<12}{report['checksums']['text']}")
    for ref in report.get("shared", []):
        lines.append(f"{'shared':<12}{ref['tensors']} frozen tensors ({_mib(ref['bytes'])}) in {ref['dir']}, written "
                     "once and referenced")
    if report["config"]:
        lines.append("config")
        for section, values in report["config"].items():
            text = ", ".join(f"{k}={v}" for k, v in values.items()) if isinstance(values, dict) else values
            lines.append(f"  {section:<14}{text}")
    opt = report.get("optimizer")
    if report.get("saved_without_optimizer") and not report["optimizer_states"]:
        lines.append(f"{'optimizer':<12}none: saved without an optimizer (model, RNG and state only)")
    elif opt or report["optimizer_states"]:
        lines.append("optimizer")
        if opt:
            groups = opt.get("param_groups") or []
            lines.append(f"  {opt.get('class')} step {opt.get('step')}, {len(groups)} param group(s): "
                         + "; ".join(f"lr={g.get('lr')} weight_decay={g.get('weight_decay')} "
                                     f"params={g.get('num_params')}" for g in groups))
        for name, st in report["optimizer_states"].items():
            lines.append(f"  {name:<12}{st['tensors']} tensors, {_mib(st['bytes'])}, {'/'.join(st['dtypes'])}")
    lines.append("contents")
    for group, g in report["groups"].items():
        lines.append(f"  {group:<12}{g['tensors']} tensors, {g['numel']:,} elements, {_mib(g['bytes'])}")
    if report["non_tensor_items"]:
        lines.append(f"  {'objects':<12}{len(report['non_tensor_items'])} pickled items (listed, never loaded)")
    if report.get("bytes_per_rank"):
        lines.append("bytes per rank  " + ", ".join(f"{k}: {_mib(v)}" for k, v in report["bytes_per_rank"].items()))
    shown = [t for t in report["tensors"] if all_tensors or t["group"] in ("model", "(top level)")]
    if shown:
        width = max(len(t["key"]) for t in shown)
        lines.append(f"tensors ({len(shown)} of {len(report['tensors'])}; --all lists every one)" if not all_tensors
                     else f"tensors ({len(shown)})")
        lines.append(f"  {'key':<{width}}  {'shape':<16} {'dtype':<9} {'bytes':>12}  sharding")
        for t in shown:
            lines.append(f"  {t['key']:<{width}}  {str(t['shape']):<16} {t['dtype']:<9} {t['bytes']:>12,}  "
                         f"{t['sharding']}")
    return "\n".join(lines)


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"
