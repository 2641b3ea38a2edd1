"""Plain single-device models, and what any causal LM is asked (its forward, logits, vocabulary,
init scale). Nothing here knows about distribution, checkpoints or files: a model built from a
config, which may name a Hugging Face folder, is fsdpkit.hf.build_model's, and that package
initialises the buffers and loads a folder's weights (see its docstring for the layering).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable

import torch
from torch import nn

from fsdpkit.config.schema import ModelConfig
from fsdpkit.model.llama import LlamaArgs, LlamaForCausalLM


def build_llama(cfg: ModelConfig) -> LlamaForCausalLM:
    """fsdpkit's reference Llama (`model.kind=llama`) on the current default device."""
    # Every LlamaArgs field has the same name in ModelConfig.
    return LlamaForCausalLM(LlamaArgs(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(LlamaArgs)}))


def param_init_std(model: nn.Module) -> Callable[[str], float | None] | None:
    """Per-parameter init std that overrides `init_std` (None: none does); LoRA adapters have their own."""
    if any(".lora_A." in name for name, _ in model.named_parameters()):
        from fsdpkit.model.peft import lora_init_std

        return lora_init_std(model)
    return None


def init_std(model: nn.Module) -> float:
    """Standard deviation of the normal init of linear/embedding weights for this model."""
    if isinstance(model, LlamaForCausalLM):
        return model.args.initializer_range
    return float(getattr(getattr(model, "config", None), "initializer_range", 0.02))


def vocab_size(model: nn.Module) -> int:
    if isinstance(model, LlamaForCausalLM):
        return model.args.vocab_size
    return int(model.config.vocab_size)


@functools.cache
def _takes_use_cache(cls: type) -> bool:
    params = inspect.signature(cls.forward).parameters
    return "use_cache" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def _flash_attention(model: nn.Module) -> bool:
    return str(getattr(getattr(model, "config", None), "_attn_implementation", "")).startswith("flash")


def forward(model: nn.Module, input_ids: torch.Tensor, *, positions: torch.Tensor | None = None,
            logits_to_keep: int = 0):
    """The model's training forward of input_ids [B, T]: a tensor of logits (our models) or
    transformers' output.

    positions [B, T]: each token's position in its own document, restarting at 0 where a document
    starts; every document then attends only to itself. transformers models build block-diagonal
    masks from them (sdpa, eager, flex); flash-attention's varlen kernels read them from a single
    row, so for those the micro-batch runs as one row [1, B * T] (the output is in that shape).
    fsdpkit's Llama builds a document mask.

    logits_to_keep: the logits of the last positions only (0: every position), transformers' argument.

    A transformers model runs with `use_cache=False`: its configs default to `use_cache=True`, which
    builds a KV cache in every forward, training included; that cache keeps every layer's keys and
    values alive, and under activation checkpointing the recomputed layer writes into it a second
    time (with torch.compile the recompute then replays a different graph and fails
    torch.utils.checkpoint's metadata check)."""
    if isinstance(model, LlamaForCausalLM):
        return model(input_ids, positions, logits_to_keep)
    kwargs: dict = {"logits_to_keep": logits_to_keep} if logits_to_keep else {}
    if positions is not None:
        if _flash_attention(model):
            input_ids, positions = input_ids.reshape(1, -1), positions.reshape(1, -1)
        kwargs["position_ids"] = positions
    if _takes_use_cache(type(model)):
        kwargs["use_cache"] = False
    return model(input_ids, **kwargs)


def logits(model: nn.Module, input_ids: torch.Tensor, *, positions: torch.Tensor | None = None) -> torch.Tensor:
    """input_ids [B, T] -> logits [B, T, vocab] for our models and transformers models alike."""
    out = forward(model, input_ids, positions=positions)
    out = out if isinstance(out, torch.Tensor) else out.logits
    return out.reshape(*input_ids.shape, out.shape[-1])
