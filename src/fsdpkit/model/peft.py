"""LoRA adapters through the `peft` library, injected into a plain transformers model.

`inject_adapter_in_model` keeps the model what it was (a LlamaForCausalLM, say; no PeftModel
wrapper), so wrapping, logits and vocabulary lookups work unchanged. Parameter names gain
`.base_layer.` (frozen originals) and `.lora_A.default.` / `.lora_B.default.` (trained), which is
what the checkpoint stores; `peft_base_name` maps them back to the model's own names (for
`model.init_from=hf:`), and fsdpkit.export.adapter to PEFT's adapter names.
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn

ADAPTER = "default"  # peft's adapter name
_BASE_LAYER = re.compile(r"\.base_layer(?=\.)")
_LORA = re.compile(r"\.lora_(A|B)\.")


def lora_config(peft_cfg: Any) -> Any:
    """A `peft.LoraConfig` from fsdpkit's `model.peft` settings (gaussian init: the init rule
    fsdpkit reproduces shard by shard, see `lora_init_std`)."""
    try:
        from peft import LoraConfig
    except ImportError:
        raise ImportError("model.peft.method=lora needs peft: pip install 'fsdpkit[hf]' (with -c "
                          "constraints.txt)") from None
    return LoraConfig(r=peft_cfg.r, lora_alpha=peft_cfg.alpha, lora_dropout=peft_cfg.dropout,
                      target_modules=list(peft_cfg.target_modules), init_lora_weights="gaussian", bias="none")


def apply_lora(model: nn.Module, peft_cfg: Any) -> nn.Module:
    """Inject LoRA adapters (on whatever device the model is, meta included) and freeze the rest.

    Raises:
        ValueError: no module matches model.peft.target_modules.
    """
    from peft import inject_adapter_in_model

    try:
        model = inject_adapter_in_model(lora_config(peft_cfg), model)
    except ValueError as e:
        names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
        raise ValueError(f"model.peft.target_modules={list(peft_cfg.target_modules)}: {e}; the model's linear layers "
                         f"are named {names}") from None
    for name, p in model.named_parameters():
        p.requires_grad_(is_lora_name(name))
    return model


def is_lora_name(name: str) -> bool:
    return bool(_LORA.search(name))


def peft_base_name(name: str) -> str | None:
    """The base model's own name for a parameter of the LoRA-injected model; None for adapters."""
    if is_lora_name(name):
        return None
    return _BASE_LAYER.sub("", name)


def lora_init_std(model: nn.Module):
    """Per-parameter init std for a LoRA-injected model: lora_A ~ N(0, 1/r) (peft's gaussian
    init), lora_B = 0 (so the adapted model starts equal to the base); None for the rest."""
    ranks = {name: module.r[ADAPTER] for name, module in model.named_modules() if hasattr(module, "lora_A")}

    def std_of(fqn: str) -> float | None:
        m = _LORA.search(fqn)
        if not m:
            return None
        return 1.0 / ranks[fqn[: m.start()]] if m.group(1) == "A" else 0.0

    return std_of
