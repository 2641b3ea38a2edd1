"""The configured model, built on the current default device (callers use the meta device).

`model.kind=llama` is fsdpkit's reference Llama. `model.kind=hf` is the model transformers builds
(`AutoModelForCausalLM.from_config`) from the run's transformers config (folder_config.py), always
with fp32 parameters: a folder's `dtype` is how its weights are stored, not what fsdpkit trains in
(that is `policy.mixed_precision`). LoRA adapters are injected when `model.peft` asks for them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fsdpkit.config.schema import ModelConfig
from fsdpkit.hf.folder_config import resolve_hf_config
from fsdpkit.hf.library import require_transformers
from fsdpkit.model import build_llama


def build_model(model_cfg: ModelConfig, *, hf_config: Any = None) -> nn.Module:
    """The model `model_cfg` describes.

    Args:
        hf_config: for model.kind=hf, the run's resolved transformers config (what
            `resolve_hf_config(model_cfg)` returns, with what the run changed since: a grown
            vocabulary); resolved here when not given.
    Raises:
        ValueError: as resolve_hf_config; a model.attn_implementation transformers refuses; no
            module matching model.peft.target_modules.
    """
    if model_cfg.kind == "llama":
        return build_llama(model_cfg)
    config = hf_config if hf_config is not None else resolve_hf_config(model_cfg)[0]
    model = _from_config(config, attn=model_cfg.attn_implementation or None)
    if model_cfg.peft.method == "lora":
        from fsdpkit.model.peft import apply_lora

        model = apply_lora(model, model_cfg.peft)
    return model


def _from_config(config: Any, *, attn: str | None) -> nn.Module:
    """`AutoModelForCausalLM.from_config`, fp32 parameters, with `attn` (None: transformers' choice)."""
    transformers = require_transformers()
    try:
        return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attn)
    except (ValueError, ImportError) as e:
        if attn is None:
            raise
        raise ValueError(f"model.attn_implementation={attn}: {e}; leave it empty for transformers' choice, or use "
                         "eager") from None
