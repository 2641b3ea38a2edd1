"""Any transformers causal LM, built from a config (the optional `hf` extra)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def build_hf_model(hf_config: dict[str, Any]) -> nn.Module:
    try:
        import transformers
    except ImportError:
        raise ImportError(
            "model.kind=hf needs transformers: pip install 'fsdpkit[hf]' (with -c constraints.txt here)"
        ) from None
    kwargs = dict(hf_config)
    config = transformers.AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    # sdpa and eager agree numerically here, and sdpa is what our reference Llama uses.
    config._attn_implementation = "sdpa"
    return transformers.AutoModelForCausalLM.from_config(config)


@torch.no_grad()
def reset_hf_nonpersistent_buffers(model: nn.Module) -> None:
    """Recompute RoPE tables that to_empty() left uninitialised."""
    for module in model.modules():
        init_fn = getattr(module, "rope_init_fn", None) or getattr(module, "compute_default_rope_parameters", None)
        if init_fn is not None and hasattr(module, "inv_freq"):
            inv_freq, scaling = init_fn(module.config)
            module.inv_freq.copy_(inv_freq)
            if hasattr(module, "original_inv_freq"):
                module.original_inv_freq.copy_(inv_freq)
            module.attention_scaling = scaling
