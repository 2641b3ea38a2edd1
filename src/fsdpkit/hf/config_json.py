"""A Hugging Face folder's JSON files (config.json, generation_config.json), read as transformers
reads them: the floats JSON cannot hold come back as floats."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CONFIG_FILE, GENERATION_FILE = "config.json", "generation_config.json"

# transformers writes the floats JSON cannot hold as tagged objects (PreTrainedConfig's
# `_encode_special_floats`: inf as {"__float__": "Infinity"}) and decodes them when it reads a config.
_FLOAT_TAG = "__float__"
_FLOAT_VALUES = {"Infinity": float("inf"), "-Infinity": float("-inf"), "NaN": float("nan")}


def decode_special_floats(obj: Any) -> Any:
    """`obj` with transformers' tagged floats ({"__float__": "Infinity"}, "-Infinity", "NaN") made
    floats again, at any depth, as transformers does when it reads a config.json."""
    if isinstance(obj, dict):
        if obj.keys() == {_FLOAT_TAG} and obj[_FLOAT_TAG] in _FLOAT_VALUES:
            return _FLOAT_VALUES[obj[_FLOAT_TAG]]
        return {k: decode_special_floats(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(decode_special_floats(v) for v in obj)
    return obj


def read_json_object(path: Path, *, where: str) -> dict[str, Any]:
    """The JSON object in `path` (a Hugging Face config.json or generation_config.json), its tagged
    floats decoded; `where` names it in the error (the flag or option that pointed there)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{where}: cannot read it as JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a JSON object (a Hugging Face {path.name}), found {type(data).__name__}")
    return decode_special_floats(data)
