"""Which checkpoint a path names, as the offline tools (export, inspect, verify, diff) see it.

A path is a checkpoint directory, a `.safetensors` file, or a checkpoints root or run directory
whose `latest` pointer names the checkpoint. `latest` is checked before it is followed
(catalog.follow_latest): it must be one line of text naming a directory beside it. A directory
that fsdpkit would have committed but that has no manifest.json is an uncommitted fsdpkit
checkpoint, never a plain DCP one.

Other tools' folders are found too, each with a note saying what was picked: Accelerate's
`save_state` folder (the model in `pytorch_model_fsdp_0/`, the optimizer in `optimizer_0/`) and
a folder of step directories without a `latest` pointer (Lightning's `epoch=0-step=100.ckpt/`,
Accelerate's `checkpoint_3/`, torchtitan's `step-100/`): the newest by the number in its name.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from fsdpkit.checkpoint.catalog import STEP_DIR, follow_latest
from fsdpkit.checkpoint.layout import CHECKPOINTS, LATEST, MANIFEST, ON_EXCEPTION
from fsdpkit.checkpoint.safe_io import METADATA_FILENAME
from fsdpkit.checkpoint.storage import open_storage


def is_uncommitted_fsdpkit_dir(p: Path) -> bool:
    """True for a directory without manifest.json that fsdpkit wrote or would have written: one
    beside a `latest` pointer, or a `step_<N>`/`on_exception` directory under a `checkpoints`
    directory or holding no DCP `.metadata` either. (A `step_<N>` directory with `.metadata` but
    no `latest` beside it elsewhere may be another tool's DCP checkpoint; it is read as such.)"""
    if not p.is_dir() or (p / MANIFEST).exists():
        return False
    shaped = bool(STEP_DIR.match(p.name)) or p.name == ON_EXCEPTION
    return ((p.parent / LATEST).is_file()
            or (shaped and (p.parent.name == CHECKPOINTS or not (p / METADATA_FILENAME).is_file())))


def not_committed_message(p: Path) -> str:
    return (f"NOT COMMITTED: {p} has no {MANIFEST}: it is an fsdpkit checkpoint that was never committed (its save "
            "was interrupted, or a rank failed), so nothing in it can be trusted; use an earlier step (`latest` names "
            "the newest committed one)")


# Accelerate's `save_state` (accelerate.utils.constants): FSDP's sharded model and optimizer.
ACCELERATE_MODEL = "pytorch_model_fsdp_{}"
ACCELERATE_OPTIMIZER = "optimizer_{}"
PARTS = ("model", "optimizer")
_LAST_NUMBER = re.compile(r"(\d+)(?!.*\d)")


@dataclass
class Located:
    """The checkpoint a path names, and what was decided to find it (one line each)."""

    path: Path
    notes: list[str] = field(default_factory=list)


def _is_checkpoint_dir(p: Path) -> bool:
    return (p / MANIFEST).is_file() or (p / METADATA_FILENAME).is_file() or any(p.glob("*.safetensors"))


def accelerate_part(p: Path, part: str = "model") -> Path | None:
    """In an Accelerate `save_state` folder, the DCP directory of `part` (model or optimizer)."""
    name = (ACCELERATE_MODEL if part == "model" else ACCELERATE_OPTIMIZER).format(0)
    return p / name if (p / name / METADATA_FILENAME).is_file() else None


def _accelerate(p: Path, part: str) -> Located | None:
    if accelerate_part(p, "model") is None and accelerate_part(p, "optimizer") is None:
        return None
    chosen = accelerate_part(p, part)
    if chosen is None:
        raise FileNotFoundError(f"{p} is an Accelerate save_state folder without {part} state "
                                f"({(ACCELERATE_MODEL if part == 'model' else ACCELERATE_OPTIMIZER).format(0)}/)")
    other = "optimizer" if part == "model" else "model"
    beside = accelerate_part(p, other)
    return Located(chosen, [f"an Accelerate save_state folder: using {chosen.name}/ ({part})"
                            + (f"; {beside.name}/ holds the {other}" if beside else "")])


def _step_dirs(root: Path) -> list[Path]:
    """Subdirectories of `root` that are committed checkpoints of some tool."""
    if not root.is_dir():
        return []
    return sorted(d for d in root.iterdir() if d.is_dir() and not d.name.startswith(".")
                  and not is_uncommitted_fsdpkit_dir(d) and (_is_checkpoint_dir(d) or accelerate_part(d) is not None))


def _newest(root: Path, dirs: list[Path]) -> Path:
    numbers = {d: _LAST_NUMBER.search(d.name) for d in dirs}
    steps = {d: int(m.group(1)) for d, m in numbers.items() if m}
    if len(dirs) == 1:
        return dirs[0]
    if len(steps) < len(dirs) or len(set(steps.values())) < len(dirs):
        raise FileNotFoundError(f"{root} holds {len(dirs)} checkpoints and their names do not say which is newest: "
                                f"{', '.join(d.name for d in dirs)}; pass one of them")
    return max(dirs, key=steps.__getitem__)


def locate_checkpoint(path: str | os.PathLike, *, part: str = "model") -> Located:
    """The checkpoint `path` names, with notes on what was picked.

    Accepts a checkpoint directory (committed or not: callers report an uncommitted one), a
    checkpoints root (with `latest`), a run directory (with `checkpoints/latest`), a
    `.safetensors` file, an Accelerate `save_state` folder (`part` picks `pytorch_model_fsdp_0/`
    or `optimizer_0/`) or a folder of step directories (the newest by the number in its name).

    Raises:
        FileNotFoundError: nothing checkpoint-like there, or step directories whose names do not
            order them; says what was expected or lists them.
        LatestPointerError: a `latest` pointer that cannot be followed.
    """
    if part not in PARTS:
        raise ValueError(f"part must be one of {PARTS}, got {part!r}")
    p = open_storage(path)  # a local Path, or a RemotePath for a URL (s3://...)
    if not p.exists():
        raise FileNotFoundError(f"{p} does not exist")
    if p.is_file() or _is_checkpoint_dir(p):
        return Located(p)
    if (found := _accelerate(p, part)) is not None:
        return found
    for root in (p, p / CHECKPOINTS):
        if (root / LATEST).is_file():
            return Located(follow_latest(root))
    if is_uncommitted_fsdpkit_dir(p):
        return Located(p)
    for root in (p, p / CHECKPOINTS):
        if dirs := _step_dirs(root):
            newest = _newest(root, dirs)
            found = _accelerate(newest, part) or Located(newest)
            note = (f"{root} holds {len(dirs)} checkpoints ({', '.join(d.name for d in dirs)}): using the newest by "
                    f"the number in its name, {newest.name} (pass a checkpoint directory to choose another)"
                    if len(dirs) > 1 else f"using {newest}, the one checkpoint in {root}")
            return Located(found.path, [note, *found.notes])
    raise FileNotFoundError(
        f"{p} is not a checkpoint: expected a directory with manifest.json or .metadata (DCP), a checkpoints "
        "directory or run directory with a `latest` pointer, an Accelerate save_state folder "
        "(pytorch_model_fsdp_0/), a folder of checkpoint directories, a Hugging Face folder or a .safetensors file"
    )

