"""The transformers config of a `model.kind=hf` run (fsdpkit.train.run resolves it once per run, and
the model is built from that one object).

The config is what transformers itself reads (`AutoConfig.from_pretrained(model.path)`: no code
from the folder runs, nothing is downloaded), with `model.hf_config` fields laid over it one by
one; without `model.path`, what `AutoConfig.for_model(**model.hf_config)` builds. Quantized
folders and architectures that are not causal LMs are refused by name before any model is built.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from fsdpkit.hf.config_json import CONFIG_FILE, decode_special_floats, read_json_object
from fsdpkit.hf.library import require_transformers

# Keys of PretrainedConfig.to_dict() that describe the file, not the model.
_BOOKKEEPING = frozenset({"transformers_version", "_name_or_path", "architectures", "dtype", "torch_dtype"})

log = logging.getLogger("fsdpkit.model")


def _read_folder_config(path: str) -> dict[str, Any]:
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise FileNotFoundError(f"model.path={path} is not a directory; point it at a Hugging Face model folder "
                                "(config.json and *.safetensors, as save_pretrained writes them)")
    file = folder / CONFIG_FILE
    if not file.is_file():
        raise FileNotFoundError(f"model.path={path} has no {CONFIG_FILE}; point it at a Hugging Face model folder "
                                "(what save_pretrained writes: config.json beside the *.safetensors weights), not at a "
                                "tokenizer or checkpoint folder")
    return read_json_object(file, where=f"model.path={path}: {CONFIG_FILE}")


def _refuse_unsupported(raw: dict[str, Any], *, path: str) -> None:
    """Quantized folders and folders that need code from the hub, by name, before transformers runs."""
    quant = raw.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"
        raise ValueError(
            f"model.path={path} holds quantized weights (config.json quantization_config.quant_method={method!r}); "
            "fsdpkit trains full-precision weights and does not dequantize on import. Use the unquantized (bf16) "
            "release of the model, or dequantize it first, e.g. with transformers: from_pretrained(..., "
            "dequantize=True) where the quantizer supports it, then save_pretrained")
    if raw.get("auto_map"):
        log.warning("model.path=%s: config.json names custom code (auto_map); fsdpkit never runs code from a model "
                    "folder and builds the model transformers itself has for model_type=%r", path,
                    raw.get("model_type"))


def _merge(base: Any, override: Any) -> Any:
    if isinstance(base, dict) and isinstance(override, dict):
        return {**base, **{k: _merge(base.get(k), v) for k, v in override.items()}}
    return override


def resolve_hf_config(model_cfg: Any) -> tuple[Any, list[str]]:
    """The transformers config of `model_cfg` and the lines that say what `model.hf_config` changed.

    With `model.path`: `AutoConfig.from_pretrained(path)` (no code from the folder runs, nothing is
    downloaded), each `model.hf_config` field that differs from it set on it. Without: the config
    `AutoConfig.for_model(**model.hf_config)` builds.

    Raises:
        FileNotFoundError: no folder or no config.json there.
        ValueError: a quantized folder, a config transformers cannot read, an override of a field
            the config does not have, or an architecture that is not a causal LM.
    """
    transformers = require_transformers()
    overrides = dict(model_cfg.hf_config or {})
    if not model_cfg.path:
        kwargs = decode_special_floats(dict(overrides))
        config = transformers.AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
        _check_causal_lm(config, where=f"model.hf_config (model_type={config.model_type})")
        return config, []
    path = model_cfg.path
    raw = _read_folder_config(path)
    _refuse_unsupported(raw, path=path)
    try:
        config = transformers.AutoConfig.from_pretrained(str(Path(path).expanduser()), local_files_only=True,
                                                         trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 - any failure: a config this transformers cannot read
        raise ValueError(f"model.path={path}: transformers {transformers.__version__} cannot read its config.json "
                         f"(model_type={raw.get('model_type')!r}): {type(e).__name__}: {e}. A newer transformers may "
                         "know the architecture (pip install -U transformers, with -c constraints.txt)") from None
    _check_causal_lm(config, where=f"model.path={path}")
    current = config.to_dict()
    changed = []
    for key, value in overrides.items():
        if key in _BOOKKEEPING or key.startswith("_"):
            continue
        if key not in current:
            raise ValueError(f"model.hf_config.{key}: {type(config).__name__} has no field {key!r} (the folder's "
                             f"config.json at {path} has: "
                             f"{', '.join(sorted(k for k in current if not k.startswith('_')))})")
        new = _merge(current[key], value)
        if new != current[key]:
            setattr(config, key, new)
            changed.append(f"{key}: {current[key]!r} -> {new!r}")
    return config, changed


def _check_causal_lm(config: Any, *, where: str) -> None:
    transformers = require_transformers()
    if type(config) not in transformers.MODEL_FOR_CAUSAL_LM_MAPPING:
        arch = ", ".join(getattr(config, "architectures", None) or []) or config.model_type
        raise ValueError(f"{where}: {arch} ({type(config).__name__}) is not a causal language model that transformers "
                         "can build with AutoModelForCausalLM; fsdpkit trains decoder-only causal LMs (Llama, Qwen, "
                         "Mistral, Gemma, Phi, GPT-2, Mixtral, ...). Use such a model's folder")
