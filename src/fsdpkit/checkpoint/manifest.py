"""manifest.json: what a committed checkpoint is, written last, read first.

It records everything needed to trust and interpret the DCP files beside it: format version,
step, run identity, world size and mesh, versions, the resolved config, the model fingerprint
(tensor names, shapes and dtypes; vocabulary size and embedding tying), an optimizer summary
(null for a model saved without an optimizer), the small Stateful pieces (trainer counters,
scheduler, data cursor), per-tensor checksums, per-file sizes and checksums, and timings.

The manifest carries state that changes training (the data cursor, the schedule, the counters), so
it is sealed by a checksum of its own: `manifest_sha256`, the SHA-256 of its canonical JSON (keys
sorted, no whitespace) without that field. `read_manifest` checks the seal, then the shape, before
any field is used; a manifest that fails either is a corrupt checkpoint.

Formats 2 and 3 are read (3 adds the `shared` references of frozen.py; a checkpoint that shares
nothing is written as 2, which older fsdpkit reads). Format 1 (before seals) is not read at all:
the version is a field of the manifest, so honouring an unsealed format would let any edited
manifest switch its own seal off by claiming it.
"""

from __future__ import annotations

import hashlib
import json
import platform
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fsdpkit import __version__
from fsdpkit.checkpoint.embeddings import tying_words, vocab_and_tie
from fsdpkit.checkpoint.errors import CheckpointCorruptError, CheckpointMismatchError
from fsdpkit.checkpoint.frozen import file_sets
from fsdpkit.checkpoint.layout import MANIFEST
from fsdpkit.checkpoint.manifest_schema import manifest_problems
from fsdpkit.checkpoint.storage import open_storage

FORMAT = "fsdpkit-checkpoint"
FORMAT_VERSION = 3  # 3: may reference shared frozen tensors (`shared`, frozen.py); written when it does
FORMAT_VERSION_UNSHARED = 2  # 2: sealed by manifest_sha256, carries run_id; written when nothing is shared
OLDEST_READ = 2  # 1 had no seal: never read
SEAL = "manifest_sha256"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def model_fingerprint(model: nn.Module, *, sharding: dict[str, Any]) -> dict[str, Any]:
    """Every parameter and persistent buffer FQN with its global shape and dtype; the vocabulary
    size and whether the input embedding and output head are tied (`vocab_size`,
    `tied_embeddings`; absent for a model without a recognisable embedding); plus how the model
    was sharded (informational: a different wrap policy must not break loading)."""
    tensors = {}
    for name, t in model.state_dict().items():
        tensors[name] = {"shape": list(t.shape), "dtype": dtype_name(t.dtype)}
    return {"tensors": tensors, **vocab_and_tie(model), **sharding}


def vocab_diff(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Differences in vocabulary size and embedding tying, each with the setting to change; a
    fact that either side lacks (a manifest written before fsdpkit recorded it) is unknown, not
    a difference."""
    lines = []
    a, b = saved.get("vocab_size"), current.get("vocab_size")
    if a is not None and b is not None and a != b:
        lines.append(f"  vocabulary: checkpoint vocab_size {a}, model {b}: set model.hf_config.vocab_size={a} "
                     f"(model.vocab_size={a} for model.kind=llama), or use the tokenizer the checkpoint was trained "
                     "with (model.resize_to_tokenizer grows the model to data.tokenizer's size)")
    a, b = saved.get("tied_embeddings"), current.get("tied_embeddings")
    if a is not None and b is not None and a != b:
        lines.append(f"  embeddings: the checkpoint's input embedding and lm_head are {tying_words(a)}, the model's "
                     f"{tying_words(b)}: set model.hf_config.tie_word_embeddings={str(a).lower()} "
                     f"(model.tie_word_embeddings={str(a).lower()} for model.kind=llama)")
    return lines


def fingerprint_diff(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Human-readable differences in names, shapes and dtypes (empty: compatible)."""
    a, b = saved["tensors"], current["tensors"]
    lines = [f"  only in checkpoint: {k} {a[k]['shape']} {a[k]['dtype']}" for k in sorted(a.keys() - b.keys())]
    lines += [f"  only in model:      {k} {b[k]['shape']} {b[k]['dtype']}" for k in sorted(b.keys() - a.keys())]
    for k in sorted(a.keys() & b.keys()):
        if a[k] != b[k]:
            lines.append(f"  changed: {k}: checkpoint {a[k]['shape']} {a[k]['dtype']}, model {b[k]['shape']} "
                         f"{b[k]['dtype']}")
    return lines


def sharding_notes(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Differences that loading tolerates but the user should know about."""
    return [f"{key} changed: checkpoint {saved.get(key)!r}, now {current.get(key)!r}"
            for key in ("wrap_policy", "activation_checkpointing", "mixed_precision", "reshard_after_forward",
                        "compiled")
            if saved.get(key) != current.get(key)]


def check_fingerprint(saved: dict[str, Any], current: dict[str, Any], *, ckpt_dir: Path) -> list[str]:
    """Raise CheckpointMismatchError on incompatible tensors, vocabulary size or embedding tying;
    return notes for tolerated changes."""
    if vocab := vocab_diff(saved, current):
        # Before the tensor diff: a tie change leaves every name and shape as it was (a tied
        # lm_head.weight is still in the state dict), and a vocabulary change is one setting.
        raise CheckpointMismatchError(
            f"checkpoint {ckpt_dir} does not fit this model; nothing was loaded:\n" + "\n".join(vocab)
            + "\nthe checkpoint's config.yaml holds the settings it was trained with; or start fresh with "
            "checkpoint.resume=none")
    diff = fingerprint_diff(saved, current)
    if diff:
        raise CheckpointMismatchError(
            f"checkpoint {ckpt_dir} does not fit this model ({len(diff)} difference(s)); nothing was loaded:\n"
            + "\n".join(diff[:40]) + ("\n  ..." if len(diff) > 40 else "")
            + "\ncheck the model.* settings against the checkpoint's config.yaml, or start fresh with resume=none"
        )
    return sharding_notes(saved, current)


def optimizer_summary(optimizer: torch.optim.Optimizer | None, *, step: int) -> dict[str, Any] | None:
    """The manifest's `optimizer`: class, hyper-parameters per param group, state keys and step;
    None (`"optimizer": null`) records a checkpoint saved without an optimizer (an EMA, a teacher)."""
    if optimizer is None:
        return None
    groups = [{k: v for k, v in g.items() if k != "params"} | {"num_params": len(g["params"])}
              for g in optimizer.param_groups]
    state_keys = sorted({k for s in optimizer.state.values() for k in s})
    return {"class": type(optimizer).__name__, "param_groups": groups, "state_keys": state_keys, "step": step}


def versions() -> dict[str, str]:
    return {"fsdpkit": __version__, "torch": torch.__version__, "python": platform.python_version()}


def manifest_digest(manifest: dict[str, Any]) -> str:
    """SHA-256 of the canonical JSON of `manifest` without its seal."""
    body = {k: v for k, v in manifest.items() if k != SEAL}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def write_manifest(ckpt_dir: Path, manifest: dict[str, Any]) -> None:
    """Seal `manifest` and commit it: tmp + fsync + rename + directory fsync (one PUT on object storage)."""
    sealed = {**{k: v for k, v in manifest.items() if k != SEAL}, SEAL: manifest_digest(manifest)}
    (open_storage(ckpt_dir) / MANIFEST).write_atomic(json.dumps(sealed, indent=1) + "\n")


def read_manifest(ckpt_dir: Path) -> dict[str, Any]:
    """The committed manifest of `ckpt_dir`, its seal and shape checked.

    Raises:
        FileNotFoundError: no manifest: the directory was never committed.
        CheckpointCorruptError: unreadable, not sealed or wrongly sealed, malformed, or of a
            format version other than 2 and 3 (an older one would carry no seal to check).
    """
    path = ckpt_dir / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{ckpt_dir} has no {MANIFEST}: it was never committed (a save was interrupted)")
    try:
        manifest = json.loads(path.read_bytes().decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise CheckpointCorruptError(f"{path} is not valid JSON ({e}); the checkpoint cannot be trusted") from None
    except OSError as e:
        raise CheckpointCorruptError(f"{path} cannot be read ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        what = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise CheckpointCorruptError(f"{path} is not an fsdpkit manifest (format={what!r}); the checkpoint cannot be "
                                     "trusted")
    version = manifest.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise CheckpointCorruptError(f"{path} has no valid format_version ({version!r}); the checkpoint cannot be "
                                     "trusted")
    if version > FORMAT_VERSION:
        raise CheckpointCorruptError(
            f"{path} has format_version {version}; this fsdpkit reads up to {FORMAT_VERSION}: upgrade fsdpkit"
        )
    if version < OLDEST_READ:
        edited = f", yet it carries a {SEAL}: its format_version was edited" if SEAL in manifest else ""
        raise CheckpointCorruptError(
            f"{path} claims format_version {version}, which has no seal{edited}; fsdpkit reads only sealed manifests "
            f"(formats {OLDEST_READ} to {FORMAT_VERSION}), so the step, data position and schedule it records cannot "
            "be trusted"
        )
    if manifest.get(SEAL) != manifest_digest(manifest):
        raise CheckpointCorruptError(
            f"{path} fails its own checksum ({SEAL} {str(manifest.get(SEAL))[:16]}..., content "
            f"{manifest_digest(manifest)[:16]}...): it was edited or corrupted after the commit, and the step, "
            "data position and schedule it records cannot be trusted"
        )
    problems = manifest_problems(manifest)
    if not problems and not isinstance(manifest.get("run_id"), str):
        problems.append("lacks `run_id`")
    if not problems and "shared" in manifest and version < 3:
        problems.append(f"references shared files (`shared`), which format_version {version} cannot")
    counters = manifest.get("trainer", {}).get("train") if not problems else None
    if isinstance(counters, dict) and counters.get("step", manifest["step"]) != manifest["step"]:
        problems.append(f"`step` {manifest['step']} differs from the trainer counters' step {counters.get('step')!r}")
    if problems:
        raise CheckpointCorruptError(f"{path} is malformed: " + "; ".join(problems)
                                     + "; the checkpoint cannot be trusted")
    return manifest


def check_files_present(ckpt_dir: Path, manifest: dict[str, Any]) -> list[str]:
    """Cheap completeness check (existence and size of every listed file, the shared files it
    references included): problems, if any."""
    problems = []
    for directory, files in file_sets(ckpt_dir, manifest):
        where = "" if directory == ckpt_dir else f"{directory}/"  # a shared file: named with its directory
        for name, info in files.items():
            path = directory / name
            if not path.is_file():
                problems.append(f"{where}{name} is missing")
            elif path.stat().st_size != info["size"]:
                problems.append(f"{where}{name} has {path.stat().st_size} bytes, the manifest says {info['size']} "
                                "(truncated or overwritten)")
    return problems
