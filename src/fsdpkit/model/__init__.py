"""Plain single-device models. Nothing here knows about distribution or checkpoints."""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable

import torch
from torch import nn

from fsdpkit.config.schema import ModelConfig
from fsdpkit.model.llama import LlamaArgs, LlamaForCausalLM


def build_model(cfg: ModelConfig) -> nn.Module:
    """Construct the model on the current default device (callers use the meta device)."""
    if cfg.kind == "llama":
        # Every LlamaArgs field has the same name in ModelConfig.
        return LlamaForCausalLM(LlamaArgs(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(LlamaArgs)}))
    from fsdpkit.model.hf import build_hf_model

    model = build_hf_model(cfg)
    if cfg.peft.method == "lora":
        from fsdpkit.model.peft import apply_lora

        model = apply_lora(model, cfg.peft)
    return model


def param_init_std(model: nn.Module) -> Callable[[str], float | None] | None:
    """Per-parameter init std that overrides `init_std` (None: none does); LoRA adapters have their own."""
    if any(".lora_A." in name for name, _ in model.named_parameters()):
        from fsdpkit.model.peft import lora_init_std

        return lora_init_std(model)
    return None


def grow_vocab(cfg: ModelConfig, size: int) -> bool:
    """Set the model config's vocabulary to `size` if that is larger; returns whether it grew."""
    if cfg.kind == "hf" and "vocab_size" not in cfg.hf_config:
        from fsdpkit.model.hf import hf_config

        cfg.hf_config["vocab_size"] = hf_config(cfg)[0].vocab_size
    current = int(cfg.hf_config["vocab_size"]) if cfg.kind == "hf" else cfg.vocab_size
    if size <= current:
        return False
    cfg.vocab_size = size
    if cfg.kind == "hf":
        cfg.hf_config["vocab_size"] = size
    return True


def init_std(model: nn.Module) -> float:
    """Standard deviation of the normal init of linear/embedding weights for this model."""
    if isinstance(model, LlamaForCausalLM):
        return model.args.initializer_range
    return float(getattr(getattr(model, "config", None), "initializer_range", 0.02))


def vocab_size(model: nn.Module) -> int:
    if isinstance(model, LlamaForCausalLM):
        return model.args.vocab_size
    return int(model.config.vocab_size)


@torch.no_grad()
def reset_nonpersistent_buffers(model: nn.Module, *, leave_to_model: frozenset[int] = frozenset(),
                                keep_persistent: bool = False) -> None:
    """Give every buffer the value the model's construction gives it, after to_empty() (RoPE
    tables, embedding scales, ...), and the parameters in `leave_to_model` (ids; transformers
    models only) what the model's own init gives them; no other parameter is touched.
    keep_persistent: the persistent buffers were just loaded (they are in the state dict, so in
    the weights file): they keep the loaded values, as from_pretrained keeps them."""
    if isinstance(model, LlamaForCausalLM):
        model.reset_nonpersistent_buffers()
    else:
        from fsdpkit.model.hf import init_hf_buffers

        init_hf_buffers(model, leave_to_model=leave_to_model, keep_persistent=keep_persistent)


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
