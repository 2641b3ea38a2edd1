"""config.json and generation_config.json for an export, from the run config in the manifest.

`model.kind=llama` (fsdpkit's reference Llama, whose names and arithmetic are transformers'
LlamaForCausalLM) is written by hand, so exporting needs no transformers. `model.kind=hf` is
written by transformers itself from `model.hf_config` (it was needed to train that model).
"""

from __future__ import annotations

from typing import Any

import torch

from fsdpkit.checkpoint.manifest import dtype_name
from fsdpkit.hf.config_json import decode_special_floats

# LlamaConfig fields our reference Llama fixes (see fsdpkit.model.llama): SwiGLU with SiLU, no
# biases, no rope scaling. `rope_theta` at the top level is read by transformers 4.x and 5.x.
_LLAMA_FIXED = {"hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False,
                "pretraining_tp": 1, "rope_scaling": None, "use_cache": True}
_LLAMA_FROM_CONFIG = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                      "num_key_value_heads", "max_position_embeddings", "rope_theta", "rms_norm_eps",
                      "tie_word_embeddings", "initializer_range")


def is_tied(model_cfg: dict[str, Any] | None) -> bool:
    """Whether the run's model shares embed_tokens and lm_head (decides what an export writes once)."""
    if not model_cfg:
        return False
    if model_cfg.get("kind") == "hf":
        return bool((model_cfg.get("hf_config") or {}).get("tie_word_embeddings", False))
    return bool(model_cfg.get("tie_word_embeddings", False))


def hf_configs(model_cfg: dict[str, Any], *, dtype: torch.dtype) -> tuple[dict[str, Any] | None, dict[str, Any] | None,
                                                                          str]:
    """(config.json, generation_config.json, note) for the manifest's `config.model` section.

    Returns (None, None, why) when no config can be written (an hf model without transformers).
    """
    if model_cfg.get("kind", "llama") == "llama":
        config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                  **{k: model_cfg[k] for k in _LLAMA_FROM_CONFIG if k in model_cfg},
                  "head_dim": model_cfg["hidden_size"] // model_cfg["num_attention_heads"],
                  **_LLAMA_FIXED, "torch_dtype": dtype_name(dtype)}
        return config, {"_from_model_config": True, "use_cache": True}, "config.json written for LlamaForCausalLM"
    try:
        import transformers
    except ImportError:
        return None, None, "config.json not written: model.kind=hf needs transformers to describe the model"
    config = transformers_config(model_cfg)
    mapping = transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    config.architectures = [mapping[config.model_type]] if config.model_type in mapping else None
    as_dict = config.to_dict()
    as_dict["dtype" if "dtype" in as_dict else "torch_dtype"] = dtype_name(dtype)
    generation = transformers.GenerationConfig.from_model_config(config).to_dict()
    source = f"config.json written by transformers {transformers.__version__} for {config.architectures}"
    return as_dict, generation, source


def transformers_config(model_cfg: dict[str, Any]) -> Any:
    """The transformers config a `model.kind=hf` run trained with (`model.hf_config`, the whole
    `PretrainedConfig.to_dict()` or the kwargs of `AutoConfig.for_model`, model_type included).

    Raises:
        ValueError: `model.hf_config` has no model_type.
    """
    import transformers

    kwargs = decode_special_floats(dict(model_cfg.get("hf_config") or {}))
    if "model_type" not in kwargs:
        raise ValueError("the run config's model.hf_config has no model_type, so transformers cannot describe the "
                         "model; pass --config with the model's config.json or Hugging Face folder")
    return transformers.AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
