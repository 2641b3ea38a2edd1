"""Any transformers causal LM, from a Hugging Face model folder or a config (the optional `hf` extra).

The config is what transformers itself reads (`AutoConfig.from_pretrained(model.path)`), with
`model.hf_config` fields laid over it one by one. The model is built by transformers
(`AutoModelForCausalLM.from_config`) on whatever device the caller set (the meta device, so
nothing is allocated), always with fp32 parameters: the folder's `dtype` is how its weights are
stored, not what fsdpkit trains in (that is `policy.mixed_precision`).

After `to_empty()` every buffer holds garbage. `init_hf_buffers` gives each one the value
transformers' own construction gives it, by running the model's own `_init_weights` hooks (the
mechanism `from_pretrained` uses after it builds on the meta device), with every parameter
marked as initialised so that only buffers, and parameters left to the model on purpose, are
touched. Nothing is listed per architecture.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from fsdpkit.export.model_config import CONFIG_FILE, decode_special_floats, read_json_object

# Keys of PretrainedConfig.to_dict() that describe the file, not the model.
_BOOKKEEPING = frozenset({"transformers_version", "_name_or_path", "architectures", "dtype", "torch_dtype"})

log = logging.getLogger("fsdpkit.model")


# The oldest transformers fsdpkit is tested with (tests/cuda ran on 5.17, CI on the newest): reading and
# writing hub folders goes through transformers 5's weight conversions (transformers.core_model_loading),
# whose helpers change between releases.
MIN_TRANSFORMERS = "5.17"


def require_transformers():
    """The transformers module, or an ImportError that says which version to install."""
    try:
        import transformers
    except ImportError:
        raise ImportError("model.kind=hf needs transformers: pip install 'fsdpkit[hf]' (with -c constraints.txt "
                          "here)") from None
    from packaging.version import Version

    if Version(transformers.__version__).release < Version(MIN_TRANSFORMERS).release:
        raise ImportError(f"fsdpkit reads and writes Hugging Face folders through transformers>={MIN_TRANSFORMERS}'s "
                          f"weight conversions, and this environment has transformers {transformers.__version__}: "
                          f"pip install -U 'transformers>={MIN_TRANSFORMERS}'")
    return transformers


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


def hf_config(model_cfg: Any) -> tuple[Any, list[str]]:
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


def resolved_hf_config(model_cfg: Any) -> dict[str, Any]:
    """The whole config a run trains with, as a plain dict (`to_dict()`): what the run records in
    `model.hf_config`, so that its checkpoints and exports carry it."""
    config, _ = hf_config(model_cfg)
    return config.to_dict()


def build_hf_model(model_cfg: Any) -> nn.Module:
    """`AutoModelForCausalLM.from_config` of `hf_config(model_cfg)`, fp32 parameters, with
    `model.attn_implementation` (empty: transformers' choice for the model)."""
    transformers = require_transformers()
    config, _ = hf_config(model_cfg)
    attn = model_cfg.attn_implementation or None
    try:
        return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attn)
    except (ValueError, ImportError) as e:
        if attn is None:
            raise
        raise ValueError(f"model.attn_implementation={attn}: {e}; leave it empty for transformers' choice, or use "
                         "eager") from None


def is_hf_model(model: nn.Module) -> bool:
    return hasattr(model, "_init_weights") and hasattr(model, "initialize_weights") and hasattr(model, "config")


@contextlib.contextmanager
def transformers_class(model: nn.Module) -> Iterator[nn.Module]:
    """`model` seen, inside the block, with the class transformers built. fully_shard gives a root
    the class FSDP<Name>, defined in a torch module: transformers looks conversion rules up by
    class name, and treats a class defined outside `transformers.` as custom code, whose
    `initialize_weights` skips every module whose own tensors are flagged initialised (so a hook
    that sets a child's buffer from the parent, as FalconH1Model's does, would never run)."""
    wrapped = type(model)
    if isinstance(model, FSDPModule):
        model.__class__ = next(c for c in wrapped.__mro__[1:] if not issubclass(c, FSDPModule))
    try:
        yield model
    finally:
        model.__class__ = wrapped


@torch.no_grad()
def init_hf_buffers(model: nn.Module, *, leave_to_model: frozenset[int] = frozenset(),
                    keep_persistent: bool = False) -> None:
    """Give every buffer (and the parameters whose id is in `leave_to_model`) the value the model's
    own `_init_weights` gives it; no other parameter is touched. keep_persistent: buffers in the
    state dict keep their current (loaded) values, as from_pretrained keeps what the file holds
    (MiniMax's decay tables are persistent, and its hooks would recompute them in full precision).

    transformers' init functions skip tensors flagged `_is_hf_initialized`: every other parameter
    is flagged, and the modules' own flags (set when the model was built) are cleared so that the
    hooks run again.
    """
    kept = {}
    if keep_persistent:  # restored after the hooks, whichever way a hook writes (not all use init.*)
        kept = {id(b): (b, b.detach().clone()) for m in model.modules() for n, b in m.named_buffers(recurse=False)
                if n not in m._non_persistent_buffers_set}
    for module in model.modules():
        if "_is_hf_initialized" in module.__dict__:
            del module._is_hf_initialized
    left = {name: p for name, p in model.named_parameters() if id(p) in leave_to_model}
    for p in model.parameters():
        p._is_hf_initialized = id(p) not in leave_to_model
    for p in left.values():  # what no hook sets stays NaN, and is caught below
        _local(p).fill_(float("nan"))
    with transformers_class(model):
        model.initialize_weights()
    for buffer, value in kept.values():
        buffer.copy_(value)
    for p in model.parameters():
        p._is_hf_initialized = True
    unset = [f"{name} of {type(model.get_submodule(name.rpartition('.')[0])).__name__}"
             for name, p in left.items() if _local(p).isnan().any()]
    if unset:
        raise NotImplementedError(
            f"{type(model).__name__}'s own _init_weights sets no value for {', '.join(unset)}, and fsdpkit has no rule "
            "for a 1-D parameter that is neither a bias nor a norm weight. Start from trained weights (model.path with "
            "model.pretrained=true, or model.init_from=hf:DIR)")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t.data
