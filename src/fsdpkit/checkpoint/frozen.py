"""Frozen weights written once: tensors a run cannot change are shared between its checkpoints.

A parameter with `requires_grad=False` that the optimizer does not hold (a LoRA base, a frozen
encoder) does not change by training. The first checkpoint of a run writes such tensors to a
directory of their own, `<checkpoints>/shared/<run id>-step_<N>-<random>/` (a DCP checkpoint:
`.distcp` files and `.metadata`, written through the same checksumming writer), and every
checkpoint references it in its manifest's `shared` field: the directory, the DCP keys it holds
and every file's size and checksum (the seal covers them). The tensors' own checksums stay in the
manifest's `tensors`, as for any tensor, so the post-load verification covers them too.

A later save computes the frozen tensors' checksums (a pass over memory, no write) and references
the same directory while they equal the ones it wrote. A frozen tensor that changed anyway (an
adapter merged in place, an edit by hand) changes its checksum, and that save writes a new
directory: a reference is never taken on trust. A run without an optimizer (an EMA copy, a frozen
teacher) shares nothing: what "frozen" means is defined by the optimizer.

Readers: resume.py (one DCP load per directory, resharding as any load), manifest.py's
completeness check and resume.verify_files (the referenced files too), the export and `ckpt
verify` (export/sources.py, export/verification.py), retention.py (a referenced directory is never
removed; this run's directories that nothing references any more are).
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fsdpkit.checkpoint.errors import CheckpointError
from fsdpkit.checkpoint.layout import ARCHIVE, MANIFEST, CkptPath
from fsdpkit.checkpoint.storage import open_storage

if TYPE_CHECKING:
    from fsdpkit.checkpoint.state import CheckpointTarget

log = logging.getLogger("fsdpkit.checkpoint")

SHARED = "shared"


def frozen_keys(target: CheckpointTarget) -> list[str]:
    """DCP keys (`model.<fqn>`) of the parameters the run cannot change: `requires_grad=False`
    and in none of the optimizer's param groups. None at all without an optimizer."""
    from torch.distributed.checkpoint.state_dict import _get_fqns  # the FQNs get_state_dict uses

    if target.optimizer is None:
        return []
    held = {id(p) for group in target.optimizer.param_groups for p in group["params"]}
    keys: set[str] = set()
    trained: set[str] = set()
    for name, param in target.model.named_parameters(remove_duplicate=False):
        fqns = {f"model.{fqn}" for fqn in _get_fqns(target.model, name)}
        (keys if not param.requires_grad and id(param) not in held else trained).update(fqns)
    return sorted(keys - trained)  # a tied weight trained under another name is not frozen


def shared_root(ckpt_dir: CkptPath) -> CkptPath:
    """The checkpoints root a checkpoint's references are relative to: its parent, or for a
    checkpoint moved to `archive/<time>/`, the root the archive is in."""
    parent = ckpt_dir.parent
    return parent.parent.parent if parent.parent.name == ARCHIVE else parent


def file_sets(ckpt_dir: CkptPath, manifest: dict[str, Any]) -> list[tuple[CkptPath, dict[str, Any]]]:
    """(directory, its files as the manifest records them): the checkpoint's own, then each
    referenced directory's."""
    root = shared_root(ckpt_dir)
    return [(ckpt_dir, manifest["files"])] + [(root / ref["dir"], ref["files"]) for ref in manifest.get(SHARED, [])]


def split_state(state: dict[str, Any], manifest: dict[str, Any], ckpt_dir: CkptPath,
                ) -> list[tuple[CkptPath, dict[str, Any]]]:
    """Take the referenced keys out of the DCP state dict `state` (in place): (directory, the
    state dict of the keys it holds) for each reference. The tensors are the same objects, so a
    load into the parts is a load into `state`'s tensors (merge_state puts them back)."""
    parts = []
    for ref in manifest.get(SHARED, []):
        part: dict[str, dict[str, Any]] = {}
        for key in ref["keys"]:
            section, _, name = key.partition(".")
            if section in state and name in state[section]:
                part.setdefault(section, {})[name] = state[section].pop(name)
        if part:
            parts.append((shared_root(ckpt_dir) / ref["dir"], part))
    return parts


def merge_state(state: dict[str, Any], parts: list[tuple[CkptPath, dict[str, Any]]]) -> None:
    for _, part in parts:
        for section, tensors in part.items():
            state.setdefault(section, {}).update(tensors)


@dataclass
class SharedDir:
    """A directory of frozen tensors written by this run, and what it holds."""

    dir: str  # relative to the checkpoints root: shared/<name>
    files: dict[str, Any]  # name: {size, xxh3_64}
    tensors: dict[str, Any]  # DCP key: {shape, dtype, hash}
    algorithm: str  # of the tensor hashes

    def reference(self) -> dict[str, Any]:
        """The manifest's entry in `shared`."""
        return {"dir": self.dir, "keys": sorted(self.tensors), "files": dict(sorted(self.files.items()))}


def adoptable(ckpt_dir: CkptPath, manifest: dict[str, Any], root: CkptPath) -> SharedDir | None:
    """The shared directory a checkpoint of `root` references, for a run that resumed from it in
    full to keep referencing (the load verified its tensors); None if there is none, or the
    checkpoint lies elsewhere (its references are relative to another root)."""
    refs = manifest.get(SHARED, [])
    if len(refs) != 1 or str(shared_root(ckpt_dir)) != str(root):
        return None
    ref = refs[0]
    return SharedDir(ref["dir"], ref["files"], {k: manifest["tensors"][k] for k in ref["keys"]},
                     manifest.get("tensor_hash", ""))


def referenced(root: CkptPath) -> set[str]:
    """Every `shared/<name>` that some manifest under `root` names: committed checkpoints, ones
    moved aside and archived ones, sealed or not (a damaged manifest still protects what it names).

    Raises:
        CheckpointError: a manifest that exists cannot be read or parsed: what it names is unknown,
            so nothing may be removed.
    """
    from fsdpkit.checkpoint import catalog  # here: catalog reads manifests, and manifest.py imports this module

    names: set[str] = set()
    for path in catalog.every_dir(root, besides=(SHARED,)):
        try:
            manifest = json.loads((path / MANIFEST).read_bytes())
        except FileNotFoundError:
            continue  # no manifest: references nothing
        except (OSError, ValueError) as e:
            raise CheckpointError(f"cannot read {path / MANIFEST} ({e}); shared directories are kept until every "
                                  "manifest can be read") from e
        refs = manifest.get(SHARED) if isinstance(manifest, dict) else None
        for ref in refs if isinstance(refs, list) else []:
            if isinstance(ref, dict) and isinstance(ref.get("dir"), str):
                names.add(ref["dir"])
    return names


def sweep(root: CkptPath, *, run_id: str, in_use: str | None) -> list[str]:
    """Rank 0, after retention: remove this run's shared directories that no manifest under
    `root` references any more (superseded frozen tensors, or an interrupted first save), except
    `in_use`. Another run's are never touched. Returns what was removed."""
    root = open_storage(root)
    shared = root / SHARED
    ours = [p for p in shared.iterdir() if p.name.startswith(f"{run_id}-") and f"{SHARED}/{p.name}" != in_use] \
        if shared.is_dir() else []
    if not ours:  # the usual case: no manifest needs reading
        return []
    keep = referenced(root)
    removed = []
    for path in ours:
        name = f"{SHARED}/{path.name}"
        if name not in keep:
            path.remove_tree()
            removed.append(name)
    if removed:
        log.info("retention: removed %s (no checkpoint references them)", ", ".join(removed))
    return removed


def new_dir_name(*, run_id: str, step: int) -> str:
    return f"{SHARED}/{run_id}-step_{step}-{uuid.uuid4().hex[:8]}"


def stale_problem(shared: SharedDir, root: CkptPath) -> str | None:
    """Rank 0: why `shared` can no longer be referenced (a file missing or of another size), or None."""
    from fsdpkit.checkpoint.manifest import check_files_present

    problems = check_files_present(root / shared.dir, {"files": shared.files})
    return "; ".join(problems) if problems else None

