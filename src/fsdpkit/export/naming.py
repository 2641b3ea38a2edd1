"""The names an export writes: the model's tensors of a checkpoint (keys.py), cleaned of a prefix
that does not belong to the model (detected, with a line saying so), checked against the config's
model when one is given, and with a tied lm_head written once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from fsdpkit.checkpoint.errors import CheckpointMismatchError
from fsdpkit.export.expected_model import ExpectedModel, detect_prefix
from fsdpkit.export.hf_config import is_tied
from fsdpkit.export.keys import is_non_model_namespace, model_weights, split_namespace
from fsdpkit.export.sources import OpenedCheckpoint, iter_row_blocks
from fsdpkit.model.names import LEADING_WRAPPERS, WRAPPER_COMPONENTS

TIED_HEAD, TIED_EMBEDDING = "lm_head.weight", "model.embed_tokens.weight"
COMPARE_BLOCK_BYTES = 16 << 20
_LISTED = 8  # names shown per kind of mismatch


@dataclass
class NamePlan:
    names: dict[str, str]  # output name -> source key
    notes: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)


def plan_names(opened: OpenedCheckpoint, *, namespace: str | None, strip_prefixes: tuple[str, ...], add_prefix: str,
               expected_model: ExpectedModel | None) -> NamePlan:
    """Output name -> source key for the export of `opened`.

    A prefix is detected and stripped only when the user gave neither --strip-prefix nor
    --add-prefix; `--strip-prefix ''` turns detection off.
    Raises:
        ValueError: with a config whose model transformers builds: names missing, unexpected or
            of another shape (the message lists them and says what to pass).
        CheckpointMismatchError: tensors the config ties differ.
    """
    tensors = opened.source.tensors()
    keys = list(tensors)
    names = model_weights(keys, key_paths=opened.source.key_paths, namespace=namespace,
                          structured=opened.kind in ("fsdpkit", "dcp"), strip_prefixes=strip_prefixes,
                          add_prefix=add_prefix)
    plan = NamePlan(names)
    if wrappers := _wrapper_note(list(names.values()), opened):
        plan.notes.append(wrappers)
    expected = set(expected_model.shapes) if expected_model is not None and expected_model.shapes is not None else None
    if not strip_prefixes and not add_prefix and not (namespace and is_non_model_namespace(namespace)):
        prefix = detect_prefix(list(names), expected)
        if prefix:
            plan.names = {name[len(prefix):]: key for name, key in names.items()}
            why = f"the names of {expected_model.architecture}" if expected is not None else "a model's own names"
            plan.notes.append(f"stripped the prefix {prefix!r} from all {len(names)} names, to match {why} "
                              f"(e.g. {next(iter(names))} -> {next(iter(plan.names))}); --strip-prefix '' keeps them")
    plan.dropped = drop_tied(plan.names, opened, expected_model)
    if expected_model is not None and expected_model.shapes is not None:
        _check_against_config(plan.names, opened, expected_model)
    return plan


def _wrapper_note(keys: list[str], opened: OpenedCheckpoint) -> str:
    """Which wrapper components clean_name (fsdpkit.model.names) removed, if any (a line for the report)."""
    found: dict[str, int] = {}
    for key in keys:
        _, name = split_namespace(key, opened.source.key_paths) if opened.kind in ("fsdpkit", "dcp") else ("", key)
        parts = name.split(".")
        for part in {p for p in parts if p in WRAPPER_COMPONENTS} | ({parts[0]} & set(LEADING_WRAPPERS)):
            found[part] = found.get(part, 0) + 1
    if not found:
        return ""
    return "removed wrapper components from the names: " + ", ".join(f"{p}. ({n} "
                                                                     "names)" for p, n in sorted(found.items()))


def _check_against_config(names: dict[str, str], opened: OpenedCheckpoint, cfg: ExpectedModel) -> None:
    assert cfg.shapes is not None
    tensors = opened.source.tensors()
    aliases = {alias for group in cfg.tied for alias in group[1:]}
    missing = sorted(n for n in cfg.shapes if n not in names and n not in aliases)
    unexpected = sorted(n for n in names if n not in cfg.shapes)
    reshaped = sorted(f"{n} {list(tensors[k].shape)} (the config's model: {list(cfg.shapes[n])})"
                      for n, k in names.items() if n in cfg.shapes and tuple(tensors[k].shape) != cfg.shapes[n])
    if not (missing or unexpected or reshaped):
        return
    parts = [f"{what} ({len(items)}): {', '.join(items[:_LISTED])}{', ...' if len(items) > _LISTED else ''}"
             for what, items in (("missing", missing), ("unexpected", unexpected), ("other shape", reshaped)) if items]
    raise ValueError(f"{opened.path} does not hold the weights of {cfg.architecture} as {cfg.path} describes it; "
                     + "; ".join(parts) + ". Nothing was exported. Check that --config is the model that was trained; "
                     "adapt names with --strip-prefix/--add-prefix (or --namespace for the state-dict entry)")


def _equal(opened: OpenedCheckpoint, a: str, b: str) -> bool:
    """Whether two tensors hold the same values: by the manifest's checksums (fsdpkit), else
    compared a block at a time."""
    hashes = (opened.manifest or {}).get("tensors") or {}
    ha, hb = (hashes.get(a) or {}).get("hash"), (hashes.get(b) or {}).get("hash")
    if ha and hb:
        return ha == hb
    tensors = opened.source.tensors()
    if tensors[a].shape != tensors[b].shape or tensors[a].dtype != tensors[b].dtype:
        return False
    for start, stop in iter_row_blocks(tensors[a], block_bytes=COMPARE_BLOCK_BYTES):
        if not torch.equal(opened.source.read_rows(a, start, stop), opened.source.read_rows(b, start, stop)):
            return False
    return True


def _tied_groups(names: dict[str, str], opened: OpenedCheckpoint,
                 cfg: ExpectedModel | None) -> tuple[list[list[str]], str, bool]:
    """(groups [kept, *aliases], why, whether the config says so) for the export's tied tensors."""
    model_cfg = ((opened.manifest or {}).get("config") or {}).get("model")
    if cfg is not None and cfg.shapes is not None:
        return cfg.tied, f"tied in {cfg.path}", True
    if cfg is not None:
        tied = bool(cfg.config.get("tie_word_embeddings", False))
        return ([[TIED_EMBEDDING, TIED_HEAD]] if tied else []), f"tie_word_embeddings in {cfg.path}", True
    if model_cfg:
        return _manifest_groups(names, opened, model_cfg), "tied in the run config", True
    return [[TIED_EMBEDDING, TIED_HEAD]], "equal tensors", False


def _manifest_groups(names: dict[str, str], opened: OpenedCheckpoint, model_cfg: dict[str, Any]) -> list[list[str]]:
    """fsdpkit runs: the twin is `model.embed_tokens.weight` (Llama) or, for other architectures,
    the tensor with lm_head's shape and checksum in the manifest."""
    if not is_tied(model_cfg) or TIED_HEAD not in names:
        return []
    hashes = (opened.manifest or {}).get("tensors") or {}
    head = hashes.get(names[TIED_HEAD], {})
    twin = TIED_EMBEDDING if TIED_EMBEDDING in names else next(
        (n for n, k in names.items() if n != TIED_HEAD and head and hashes.get(k) == head), None)
    return [[twin, TIED_HEAD]] if twin else []


def drop_tied(names: dict[str, str], opened: OpenedCheckpoint, cfg: ExpectedModel | None) -> list[str]:
    """Write each tied tensor once, under the name transformers keeps (the embedding's): when the
    config (or the run's) ties them, after checking that they are equal; without a config, when
    lm_head equals the embedding."""
    groups, why, declared = _tied_groups(names, opened, cfg)
    dropped = []
    for kept, *aliases in groups:
        for alias in aliases:
            if kept not in names or alias not in names:
                continue
            if not _equal(opened, names[kept], names[alias]):
                if declared:
                    raise CheckpointMismatchError(
                        f"{opened.path}: {names[alias]} and {names[kept]} are {why} but hold different values; the "
                        "checkpoint does not match its config (pass the config the model was trained with)")
                continue
            del names[alias]
            dropped.append(f"{alias} ({why}: the same tensor as {kept}, written once, as transformers expects)")
    return dropped
