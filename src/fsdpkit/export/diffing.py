"""`fsdpkit ckpt diff A B`: which tensors differ between two checkpoints, and by how much.

A and B may be any mix of fsdpkit checkpoints, plain DCP directories, Hugging Face folders and
safetensors files (e.g. a checkpoint against its own export). By default the model weights are
compared under their exported names; `all_tensors` compares every tensor under its raw key.
Values are streamed block by block (both sides read the same rows), in float64.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch

from fsdpkit import tunables
from fsdpkit.checkpoint.manifest import dtype_name
from fsdpkit.export.keys import model_weights
from fsdpkit.export.sources import OpenedCheckpoint, TensorInfo, iter_row_blocks, open_checkpoint


def _view(opened: OpenedCheckpoint, *, all_tensors: bool, namespace: str | None) -> dict[str, str]:
    keys = list(opened.source.tensors())
    if all_tensors:
        return {k: k for k in keys}
    return model_weights(keys, key_paths=opened.source.key_paths, namespace=namespace,
                         structured=opened.kind in ("fsdpkit", "dcp"))


def _compare(a: OpenedCheckpoint, ka: str, b: OpenedCheckpoint, kb: str, info: TensorInfo, *,
             block_bytes: int) -> dict[str, Any]:
    """max |a-b|, ||a-b|| / ||a|| and bitwise-equal values, over row blocks."""
    max_abs, diff_sq, ref_sq, equal = 0.0, 0.0, 0.0, True
    wide = torch.complex128 if info.dtype.is_complex else torch.float64
    for start, stop in iter_row_blocks(info, block_bytes=block_bytes):
        x = a.source.read_rows(ka, start, stop).to(wide)
        y = b.source.read_rows(kb, start, stop).to(wide)
        equal = equal and torch.equal(x, y)
        d = (x - y).abs()
        if d.numel():
            max_abs = max(max_abs, float(d.max()))
            diff_sq += float((d * d).sum())
            ref_sq += float((x.abs() ** 2).sum())
    rel = 0.0 if diff_sq == 0 else (math.sqrt(diff_sq) / math.sqrt(ref_sq) if ref_sq else math.inf)
    return {"max_abs": max_abs, "rel": rel, "equal": equal}


def diff_checkpoints(a: str | os.PathLike, b: str | os.PathLike, *, all_tensors: bool = False,
                     namespace: str | None = None, block_bytes: int | None = None) -> dict[str, Any]:
    """Compare two checkpoints tensor by tensor, `block_bytes` at a time (default FSDPKIT_EXPORT_BLOCK_BYTES).

    Returns:
        {"a", "b", "only_in_a", "only_in_b", "shape_changed", "dtype_changed", "tensors": {name:
        {"max_abs", "rel", "equal"}}, "identical"}; `rel` is ||a-b||_2 / ||a||_2 over the tensor.
    Raises:
        FileNotFoundError / CheckpointError: as `open_checkpoint`.
    """
    block_bytes = block_bytes or tunables.current().export_block_bytes
    with open_checkpoint(a) as ca, open_checkpoint(b) as cb:
        va, vb = _view(ca, all_tensors=all_tensors, namespace=namespace), _view(cb, all_tensors=all_tensors,
                                                                                namespace=namespace)
        ta, tb = ca.source.tensors(), cb.source.tensors()
        shape_changed, dtype_changed, stats = [], [], {}
        for name in [n for n in va if n in vb]:
            ia, ib = ta[va[name]], tb[vb[name]]
            if ia.shape != ib.shape:
                shape_changed.append({"name": name, "a": list(ia.shape), "b": list(ib.shape)})
                continue
            if ia.dtype != ib.dtype:
                dtype_changed.append({"name": name, "a": dtype_name(ia.dtype), "b": dtype_name(ib.dtype)})
            stats[name] = _compare(ca, va[name], cb, vb[name], ia, block_bytes=block_bytes)
        only_a, only_b = [n for n in va if n not in vb], [n for n in vb if n not in va]
        identical = not (only_a or only_b or shape_changed or dtype_changed) and all(s["equal"] for s in stats.values())
        return {"a": str(ca.path), "b": str(cb.path), "only_in_a": only_a, "only_in_b": only_b,
                "shape_changed": shape_changed, "dtype_changed": dtype_changed, "tensors": stats,
                "identical": identical}


def render_text(report: dict[str, Any], *, limit: int = 30) -> str:
    """Human-readable summary: key differences, then the most different tensors first."""
    lines = [f"A: {report['a']}", f"B: {report['b']}"]
    for label, key in (("only in A", "only_in_a"), ("only in B", "only_in_b")):
        for name in report[key]:
            lines.append(f"{label}: {name}")
    for item in report["shape_changed"]:
        lines.append(f"shape changed: {item['name']}: A {item['a']}, B {item['b']}")
    for item in report["dtype_changed"]:
        lines.append(f"dtype changed: {item['name']}: A {item['a']}, B {item['b']} (values compared after upcasting)")
    stats = report["tensors"]
    differing = sorted((n for n, s in stats.items() if not s["equal"]), key=lambda n: -stats[n]["rel"])
    lines.append(f"{len(stats)} tensors compared: {len(stats) - len(differing)} equal, {len(differing)} differ")
    if differing:
        width = max(len(n) for n in differing[:limit])
        lines.append(f"  {'tensor':<{width}}  {'max abs diff':>12}  {'rel (L2)':>10}")
        for name in differing[:limit]:
            lines.append(f"  {name:<{width}}  {stats[name]['max_abs']:>12.4e}  {stats[name]['rel']:>10.3e}")
        if len(differing) > limit:
            lines.append(f"  ... {len(differing) - limit} more (--json lists all)")
    lines.append("identical" if report["identical"] else "different")
    return "\n".join(lines)
