"""Where an export may be written, and what it may replace.

Two rules keep an export from destroying what it did not write:

1. `out` may not overlap its input: it may not be, contain or lie inside the source checkpoint
   or its checkpoints root (the directory with `latest` and the step_<N> directories), nor be or
   contain the run directory (symlinks resolved). An export *inside* the run directory, beside
   `checkpoints/` (the default `export.dir` is `<run_dir>/export`), is allowed: rule 2 keeps
   metrics.jsonl, config.yaml and the rest from being replaced.
2. An existing `out` is replaced only when it is an earlier fsdpkit export (and only with
   `overwrite`): a safetensors file whose header metadata carries `exported_by: fsdpkit ...`, or
   a directory holding nothing but what an export writes (model*.safetensors, each carrying that
   marker, the index, config.json, generation_config.json, the tokenizer's files and its
   additional_chat_templates/*.jinja). An empty directory may be used too.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path

from fsdpkit.checkpoint.errors import CheckpointError
from fsdpkit.checkpoint.layout import CHECKPOINTS, LATEST
from fsdpkit.checkpoint.storage import open_storage
from fsdpkit.export.hf_folder import CHAT_TEMPLATES_DIR, TOKENIZER_FILES
from fsdpkit.hf.safetensors_reader import INDEX_FILE, SINGLE_FILE, read_header

EXPORTED_BY = "exported_by"  # the safetensors metadata key every exported file carries
EXPORT_FILES = re.compile(r"^(model\.safetensors|model-\d{5}-of-\d{5}\.safetensors|model\.safetensors\.index\.json"
                          r"|config\.json|generation_config\.json|"
                          + "|".join(re.escape(f) for f in TOKENIZER_FILES) + r")$")


def exported_by_value(version: str) -> str:
    """The marker the exporter writes into every safetensors file's metadata."""
    return f"fsdpkit {version}"


def protected_paths(source: str | os.PathLike, *, run_dirs: Sequence[Path] = ()) -> list[tuple[str, Path, bool]]:
    """(what, path, inside_allowed) for everything an export of the checkpoint `source` must not
    overlap: the checkpoint itself, its checkpoints root when it lies in one (a parent holding
    `latest` or named `checkpoints`), the run directory above a `checkpoints` root, and the run
    directories the caller knows (training passes its own)."""
    known = [("the run directory", Path(d), True) for d in run_dirs]
    source = open_storage(source).local_path()
    if source is None:
        return known  # a checkpoint on object storage: no local output can overlap it
    found = [("the source checkpoint", source, False)]
    root = source.parent
    if (root / LATEST).is_file() or root.name == CHECKPOINTS:
        found.append(("its checkpoints root", root, False))
        if root.name == CHECKPOINTS:
            found.append(("the run directory", root.parent, True))
    return found + known


def check_no_overlap(out: Path, protected: list[tuple[str, Path, bool]]) -> None:
    """Raises ValueError when `out` is, contains or (unless allowed) lies inside a protected path."""
    target = out.resolve()
    found = []
    for what, path, inside_allowed in protected:
        p = path.resolve()
        if target == p:
            found.insert(0, ("is", what, p, inside_allowed))  # the most telling relation first
        elif p in target.parents and not inside_allowed:
            found.append(("lies inside", what, p, inside_allowed))
        elif target in p.parents:
            found.append(("contains", what, p, inside_allowed))
    if found:
        relation, what, p, inside_allowed = found[0]
        fix = (f"an output that neither is nor contains {p} (a new directory inside it, beside checkpoints/, is "
               f"fine, e.g. {p / 'export'})" if inside_allowed else "an output that neither is, contains nor lies "
                                                                    f"inside {p}")
        raise ValueError(f"refusing to export to {out}: it {relation} {what} {p}; an export there could overwrite "
                         f"or delete it. Choose {fix}")


def not_an_export(out: Path) -> str | None:
    """Why the existing `out` is not an earlier fsdpkit export that may be replaced (None: it is)."""
    if out.is_symlink():
        return "it is a symbolic link"
    if out.is_file():
        return _unmarked(out)
    entries = sorted(out.iterdir())
    foreign = [e.name for e in entries if not (_is_chat_templates(e) or (e.is_file() and not e.is_symlink()
                                                                          and EXPORT_FILES.match(e.name)))]
    if foreign:
        return (f"it holds {', '.join(foreign[:5])}{' ...' if len(foreign) > 5 else ''}, which an export does not "
                f"write (an export writes {SINGLE_FILE} or its shards, {INDEX_FILE}, config.json, "
                "generation_config.json and tokenizer files)")
    weights = [e for e in entries if e.name.endswith(".safetensors")]
    if not weights:
        return "it holds no safetensors file written by fsdpkit"
    return next((why for why in map(_unmarked, weights) if why), None)


def _is_chat_templates(entry: Path) -> bool:
    """The tokenizer's named chat templates: a directory of .jinja files, as save_pretrained writes it."""
    return (entry.name == CHAT_TEMPLATES_DIR and entry.is_dir() and not entry.is_symlink()
            and all(p.is_file() and not p.is_symlink() and p.suffix == ".jinja" for p in entry.iterdir()))


def _unmarked(file: Path) -> str | None:
    try:
        marker = read_header(file).metadata.get(EXPORTED_BY, "")
    except (CheckpointError, OSError):
        return f"{file} is not a safetensors file"
    if not marker.startswith(exported_by_value("")):
        return f"{file} was not written by fsdpkit's export (its metadata has no `{EXPORTED_BY}: fsdpkit ...`)"
    return None


def check_replaceable(out: Path, *, overwrite: bool) -> bool:
    """Whether `out` holds something to replace; raises ValueError when it may not be replaced."""
    if not (out.is_symlink() or out.is_file() or (out.is_dir() and any(out.iterdir()))):
        return False
    if not overwrite:
        raise ValueError(f"{out} already exists; pass --overwrite to replace it (only an earlier fsdpkit export is "
                         "replaced, and only once the new export is complete)")
    why = not_an_export(out)
    if why:
        raise ValueError(f"refusing to replace {out}: {why}. --overwrite (and export.on_finish) replace only an "
                         "earlier fsdpkit export, never anything else: choose another output, or move it away yourself")
    return True
