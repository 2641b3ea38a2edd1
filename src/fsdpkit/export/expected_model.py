"""What the target model expects, from a `config.json` given with `--config`: its file(s) to copy
into the export, its parameter names and shapes, and which of them are tied.

Names and ties come from the model transformers builds from the config on the meta device (no
memory, no weights); without transformers only the files are copied and names are judged by
prefixes alone (`detect_prefix`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fsdpkit.hf.config_json import CONFIG_FILE, GENERATION_FILE, read_json_object

CONFIG_HINT = ("pass --config with the model's config.json or its Hugging Face folder (the one it was trained "
               "from), copy that config.json into {out}, or run model.config.save_pretrained('{out}') in Python")


@dataclass
class ExpectedModel:
    """The model a config given with --config describes: the config's JSON, the generation config
    beside it (if any), and the model's expected tensors (None without transformers)."""

    path: Path
    config: dict[str, Any]
    generation: dict[str, Any] | None
    shapes: dict[str, tuple[int, ...]] | None = None  # name -> shape, every tensor of the model's state dict
    tied: list[list[str]] = field(default_factory=list)  # each group: the name written first, then its aliases
    model_class: str = ""  # the class transformers built (empty without transformers)
    note: str = ""
    model: Any = field(default=None, repr=False)  # that model, on the meta device (its save layout: hub_layout.py)

    @property
    def architecture(self) -> str:
        return self.model_class or ", ".join(self.config.get("architectures") or []) or self.config.get("model_type",
                                                                                                        "?")


def load_expected_model(path: str | os.PathLike) -> ExpectedModel:
    """Read `path` (a config.json, or a folder holding one) and describe the model it builds.

    Raises:
        FileNotFoundError: no config.json there.
        ValueError: not a JSON object, or transformers cannot build a model from it.
    """
    p = Path(path)
    file = p / CONFIG_FILE if p.is_dir() else p
    if not file.is_file():
        raise FileNotFoundError(f"--config {p}: no {CONFIG_FILE} there; give a config.json or a Hugging Face model "
                                "folder that holds one")
    config = read_json_object(file, where=f"--config {file}")
    generation_file = file.parent / GENERATION_FILE
    generation = read_json_object(generation_file,
                                  where=f"--config {generation_file}") if generation_file.is_file() else None
    found = ExpectedModel(path=file, config=config, generation=generation)
    _describe_model(found)
    return found


def _describe_model(found: ExpectedModel) -> None:
    """Fill `shapes` and `tied` from the model transformers builds on the meta device."""
    try:
        import transformers
    except ImportError:
        found.note = "transformers is not installed: names are not checked against the config"
        return
    try:
        config = transformers.AutoConfig.from_pretrained(str(found.path.parent))
    except Exception as e:  # noqa: BLE001 - any failure: a config transformers does not know
        raise ValueError(f"--config {found.path}: transformers {transformers.__version__} cannot read it "
                         f"({e})") from None
    archs = config.architectures or []
    cls = getattr(transformers, archs[0], None) if archs else None
    if cls is None:  # a config saved on its own has no `architectures`: the causal LM of its model_type
        cls = transformers.AutoModelForCausalLM._model_mapping.get(type(config), None)
    if cls is None:
        found.note = (f"transformers {transformers.__version__} knows no model class for {found.path} (no "
                      "`architectures`, no causal LM for its model_type): names are not checked against the config")
        return
    with torch.device("meta"):
        model = cls._from_config(config)
    found.shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    found.tied = [names for names in groups.values() if len(names) > 1]
    found.model_class = cls.__name__
    found.model = model
    found.note = f"names checked against {cls.__name__} built from the config (transformers {transformers.__version__})"


def config_files(found: ExpectedModel, *, dtype: torch.dtype) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(config.json, generation_config.json) to write: the given ones, with the dtype the export wrote."""
    config = dict(found.config)
    key = "torch_dtype" if "torch_dtype" in config else "dtype"  # transformers 4.x wrote torch_dtype, 5.x dtype
    config[key] = str(dtype).removeprefix("torch.")
    return config, found.generation


def detect_prefix(names: list[str], expected: set[str] | None) -> str:
    """The leading components to strip so that `names` become the model's, or ''.

    With `expected` (the config's names): the prefix, among the leading components all names
    share, that makes the most names expected, if that beats stripping nothing. Without it: the
    first component, when every name shares it (a model's own state dict has several top-level
    entries: `model` and `lm_head`, or `layers`, `norm` and `output`; one entry holding all of
    them is a wrapper: a LightningModule attribute, DDP's `module`).
    """
    if len(names) < 2:
        return ""
    split = [n.split(".") for n in names]
    common: list[str] = []
    for parts in zip(*(s[:-1] for s in split), strict=False):  # never a whole name (shortest decides)
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    if not common:
        return ""
    if expected is None:
        return common[0] + "."
    best, best_hits = "", sum(n in expected for n in names)
    for i in range(1, len(common) + 1):
        prefix = ".".join(common[:i]) + "."
        hits = sum(n[len(prefix):] in expected for n in names)
        if hits > best_hits:
            best, best_hits = prefix, hits
    return best
