"""A causal LM's vocabulary size and whether its input embedding and output head are tied,
read from the model itself (not from its config, which a resize or an override can outrun).

Checkpoint manifests record both (fsdpkit.checkpoint.manifest.model_fingerprint) and a resume
across a change is refused: a tied model takes an untied checkpoint's two matrices into one
parameter (the last one loaded wins) without any shape mismatch to stop it. A Hugging Face
folder's two facts, and the check before its weights load, are fsdpkit.hf.vocab_and_tie's.

Any model that names its embedding and head as transformers models do (`get_input_embeddings`,
`get_output_embeddings`; fsdpkit's reference Llama does too) is read; the checkpoint package needs
no model class for it.
"""

from __future__ import annotations

from typing import Any

from torch import nn


def _module(model: nn.Module, getter: str) -> nn.Module | None:
    """`model.<getter>()` (transformers models, PEFT-injected and FSDP-sharded ones too, fsdpkit's
    Llama), or None where the model has no such method or it has nothing to give."""
    get = getattr(model, getter, None)
    if not callable(get):
        return None
    try:
        found = get()
    except (AttributeError, NotImplementedError):
        return None
    return found if isinstance(found, nn.Module) else None


def vocab_and_tie(model: nn.Module) -> dict[str, Any]:
    """`{"vocab_size": rows of the input embedding (global rows for a sharded one),
    "tied_embeddings": whether the output head's weight is the embedding's Parameter}`;
    `{}` for a model with no recognisable embedding (unknown, never a mismatch)."""
    weight = getattr(_module(model, "get_input_embeddings"), "weight", None)
    if weight is None:
        return {}
    head = _module(model, "get_output_embeddings")
    return {"vocab_size": int(weight.shape[0]), "tied_embeddings": getattr(head, "weight", None) is weight}


def tying_words(tied: bool) -> str:
    """How messages describe an embedding/head pair."""
    return "tied (one matrix)" if tied else "untied (two matrices)"
