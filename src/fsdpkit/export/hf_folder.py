"""The files beside the weights in an exported Hugging Face folder: config.json,
generation_config.json and the run's tokenizer (tokenizer.json, tokenizer_config.json, the chat
template), so that `from_pretrained(OUT)` of the model, its tokenizer and its generation config
all work. Shared by the plain export (exporter.py) and the merged LoRA export (adapter.py).

Where each comes from:
- config.json: `--config`, else the run config (`config.model`, fsdpkit.export.hf_config), with
  the dtype the export wrote.
- generation_config.json: `--config`'s folder; else, for a run built from a Hugging Face folder
  (`model.kind=hf`, `model.path`), that folder's own file, copied as is; else transformers'
  default for the config.
- the tokenizer: the run's `data.tokenizer`, else `model.path` when it holds tokenizer files;
  loaded with `AutoTokenizer.from_pretrained(dir, local_files_only=True)` and written by its own
  `save_pretrained`, so the files are what transformers writes.

A recorded folder that no longer exists does not fail the export: the report lists the files
that could not be added, and the command that adds them.
"""

from __future__ import annotations

import json
import os
import shutil
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fsdpkit.checkpoint.storage import fsync_path
from fsdpkit.export.expected_model import CONFIG_HINT, ExpectedModel, config_files
from fsdpkit.export.hf_config import hf_configs
from fsdpkit.export.sources import OpenedCheckpoint
from fsdpkit.hf.config_json import GENERATION_FILE

TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer_config.json")  # a folder holding one of these holds a tokenizer
# what a tokenizer's save_pretrained may write (fast and slow tokenizers); destination.py accepts them in an export
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "vocab.json", "vocab.txt", "merges.txt",
                   "tokenizer.model", "spiece.model", "sentencepiece.bpe.model")
CHAT_TEMPLATES_DIR = "additional_chat_templates"  # named chat templates beyond the default: <name>.jinja


@dataclass
class FolderFiles:
    """What `write_folder_files` wrote, and what it could not add (each line says how to add it)."""

    config: str = ""  # a line about config.json / generation_config.json
    added: list[str] = field(default_factory=list)  # lines: files added and where from
    not_added: list[str] = field(default_factory=list)  # lines: files missing and the command that adds them


def write_folder_files(folder: Path, opened: OpenedCheckpoint, *, target: torch.dtype | None,
                       out_dtypes: dict[str, torch.dtype], expected_model: ExpectedModel | None, out: Path,
                       write_config: bool = True) -> FolderFiles:
    """Write config.json, generation_config.json and the run's tokenizer into `folder` (the
    export's temporary folder, published afterwards), each fsynced.

    Args:
        target: the export's --dtype (None: as stored); `out_dtypes` decide the dtype otherwise.
        expected_model: what --config gave (its config.json and generation_config.json win).
        out: the final output, named in the hints.
        write_config: False: write nothing but the tokenizer (--no-config).
    """
    found = FolderFiles()
    run = (opened.manifest or {}).get("config") or {}
    model_cfg = run.get("model") or {}
    if write_config:
        found.config = _write_configs(folder, opened, target=target, out_dtypes=out_dtypes,
                                      expected_model=expected_model, out=out)
        if expected_model is None and model_cfg.get("kind") == "hf":
            _copy_generation_config(folder, model_cfg.get("path") or "", out=out, found=found)
    else:
        found.config = "config.json not written (write_config=False)"
    _write_tokenizer(folder, run, out=out, found=found)
    return found


def _write_configs(folder: Path, opened: OpenedCheckpoint, *, target: torch.dtype | None,
                   out_dtypes: dict[str, torch.dtype], expected_model: ExpectedModel | None, out: Path) -> str:
    floating = [d for d in out_dtypes.values() if d.is_floating_point]
    dtype = target or (Counter(floating).most_common(1)[0][0] if floating else torch.float32)
    if expected_model is not None:
        config, generation = config_files(expected_model, dtype=dtype)
        note = f"config.json{' and generation_config.json' if generation else ''} written from {expected_model.path}"
    else:
        model_cfg = ((opened.manifest or {}).get("config") or {}).get("model")
        if not model_cfg:
            return ("config.json not written: this checkpoint carries no model config, so transformers cannot load "
                    "the export yet; " + CONFIG_HINT.format(out=out))
        config, generation, note = hf_configs(model_cfg, dtype=dtype)
    if config is not None:
        write_json(folder / "config.json", config)
    if generation is not None:
        write_json(folder / GENERATION_FILE, generation)
    return note


def _copy_generation_config(folder: Path, path: str, *, out: Path, found: FolderFiles) -> None:
    """The model folder's own generation_config.json replaces the default one written from the config."""
    if not path:
        return
    source = Path(path) / GENERATION_FILE
    if source.is_file():
        shutil.copyfile(source, folder / GENERATION_FILE)
        fsync_path(folder / GENERATION_FILE)
        found.added.append(f"{GENERATION_FILE} copied from the run's model folder {path} (model.path)")
    elif not Path(path).is_dir():
        found.not_added.append(
            f"{GENERATION_FILE}: the run's model folder {path} (model.path) no longer exists, so its generation "
            f"settings could not be copied; the export holds transformers' defaults for the config instead. If that "
            f"folder had a {GENERATION_FILE}, copy it into {out}: cp ORIGINAL_FOLDER/{GENERATION_FILE} {out}/")


def tokenizer_source(run: dict[str, Any]) -> tuple[str, str]:
    """(folder or hub id, the setting that names it) of the run's tokenizer; ('', '') when none.

    `data.tokenizer` when set; else `model.path` of a `model.kind=hf` run when that folder holds
    tokenizer files (or no longer exists: it may have held them).
    """
    spec = str((run.get("data") or {}).get("tokenizer") or "")
    if spec:
        return spec, "data.tokenizer"
    model_cfg = run.get("model") or {}
    path = str(model_cfg.get("path") or "") if model_cfg.get("kind") == "hf" else ""
    if path and (not Path(path).is_dir() or any((Path(path) / m).is_file() for m in TOKENIZER_MARKERS)):
        return path, "model.path"
    return "", ""


def _write_tokenizer(folder: Path, run: dict[str, Any], *, out: Path, found: FolderFiles) -> None:
    spec, setting = tokenizer_source(run)
    if not spec:
        return
    how = (f"python -c \"from transformers import AutoTokenizer; "
           f"AutoTokenizer.from_pretrained('TOKENIZER_FOLDER').save_pretrained('{out}')\"")
    local = Path(spec).expanduser().is_dir()
    if not local and (spec.startswith((".", "/", "~")) or setting == "model.path"):
        found.not_added.append(f"tokenizer files (tokenizer.json, tokenizer_config.json, chat template): the run's "
                               f"tokenizer folder {spec} ({setting}) no longer exists; add them with {how}")
        return
    staging = folder / ".tokenizer"
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(Path(spec).expanduser()) if local else spec,
                                                  local_files_only=True)
        tokenizer.save_pretrained(str(staging))
    except Exception as e:  # noqa: BLE001 - any failure to load it: the export stands, the report says why
        shutil.rmtree(staging, ignore_errors=True)
        found.not_added.append(f"tokenizer files: transformers could not load the run's tokenizer {spec} ({setting}) "
                               f"from local files ({type(e).__name__}: {e}); add them with {how}")
        return
    written = _move_tokenizer_files(staging, folder)
    chat = " with its chat template" if getattr(tokenizer, "chat_template", None) else ""
    found.added.append(f"tokenizer{chat} from {spec} ({setting}): {', '.join(written)}")


def _move_tokenizer_files(staging: Path, folder: Path) -> list[str]:
    """Move what the tokenizer's save_pretrained wrote into `folder`; never over the export's own files."""
    written = []
    for entry in sorted(staging.iterdir()):
        if (folder / entry.name).exists():
            raise ValueError(f"the tokenizer's save_pretrained wrote {entry.name}, which the export holds already; "
                             "export without the tokenizer (move data.tokenizer aside) and add it yourself")
        for file in ([entry] if entry.is_file() else sorted(p for p in entry.rglob("*") if p.is_file())):
            fsync_path(file)
        os.replace(entry, folder / entry.name)
        written.append(entry.name + ("/" if (folder / entry.name).is_dir() else ""))
    staging.rmdir()
    return written


def write_json(path: Path, obj: dict[str, Any]) -> None:
    """`obj` as indented JSON at `path`, fsynced."""
    with open(path, "w") as f:
        f.write(json.dumps(obj, indent=2) + "\n")
        f.flush()
        os.fsync(f.fileno())
