"""A causal LM's vocabulary size and whether its input embedding and output head are tied,
read from the model itself (not from its config, which a resize or an override can outrun).

Checkpoint manifests record both (fsdpkit.checkpoint.manifest.model_fingerprint) and a resume
across a change is refused: a tied model takes an untied checkpoint's two matrices into one
parameter (the last one loaded wins) without any shape mismatch to stop it. A Hugging Face
folder's two facts, and the check before its weights load, are fsdpkit.hf.vocab_and_tie's.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from fsdpkit.model.llama import LlamaForCausalLM


def input_embedding(model: nn.Module) -> nn.Module | None:
    """The token embedding: `get_input_embeddings()` of transformers models (PEFT-injected and
    FSDP-sharded ones too), `model.embed_tokens` of fsdpkit's reference Llama; None if neither."""
    if isinstance(model, LlamaForCausalLM):
        return model.model.embed_tokens
    getter = getattr(model, "get_input_embeddings", None)
    if callable(getter):
        try:
            return getter()
        except (AttributeError, NotImplementedError):
            return None
    return None


def output_head(model: nn.Module) -> nn.Module | None:
    """The vocabulary projection: `get_output_embeddings()` of transformers models, `lm_head`
    of fsdpkit's reference Llama; None if the model has none."""
    getter = getattr(model, "get_output_embeddings", None)
    if callable(getter) and not isinstance(model, LlamaForCausalLM):
        try:
            return getter()
        except (AttributeError, NotImplementedError):
            return None
    head = getattr(model, "lm_head", None)
    return head if isinstance(head, nn.Module) else None


def vocab_and_tie(model: nn.Module) -> dict[str, Any]:
    """`{"vocab_size": rows of the input embedding (global rows for a sharded one),
    "tied_embeddings": whether the output head's weight is the embedding's Parameter}`;
    `{}` for a model with no recognisable embedding (unknown, never a mismatch)."""
    embedding = input_embedding(model)
    weight = getattr(embedding, "weight", None)
    if weight is None:
        return {}
    head = output_head(model)
    return {"vocab_size": int(weight.shape[0]), "tied_embeddings": getattr(head, "weight", None) is weight}


def tying_words(tied: bool) -> str:
    """How messages describe an embedding/head pair."""
    return "tied (one matrix)" if tied else "untied (two matrices)"
