"""A causal LM's vocabulary size and whether its input embedding and output head are tied,
read from the model itself (not from its config, which a resize or an override can outrun).

Checkpoint manifests record both (fsdpkit.checkpoint.manifest.model_fingerprint) and a resume
across a change is refused: a tied model takes an untied checkpoint's two matrices into one
parameter (the last one loaded wins) without any shape mismatch to stop it.
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


def folder_vocab_and_tie(folder_config: dict[str, Any]) -> dict[str, Any]:
    """The same two facts from a Hugging Face folder's parsed config.json, as transformers reads
    it: the vocabulary of its text config (multimodal models keep it in `text_config`), the tying
    of the top-level config (what `tie_weights` reads), with the model type's defaults for what
    the file leaves out (`save_pretrained` writes only non-default fields). Without transformers
    or a known `model_type`, the file's own fields; a fact found in neither is left out."""
    try:
        from transformers import AutoConfig

        from fsdpkit.export.model_config import decode_special_floats

        config = AutoConfig.for_model(**decode_special_floats(folder_config))
    except (ImportError, ValueError, KeyError, TypeError):
        config = None
    if config is not None:
        text = config.get_text_config()
        facts: dict[str, Any] = {"tied_embeddings": bool(getattr(config, "tie_word_embeddings", False))}
        vocab = getattr(text, "vocab_size", None)
        return facts | ({"vocab_size": int(vocab)} if isinstance(vocab, int) else {})
    text = folder_config.get("text_config")
    text = text if isinstance(text, dict) else {}
    facts = {}
    vocab = folder_config.get("vocab_size", text.get("vocab_size"))
    if isinstance(vocab, int):
        facts["vocab_size"] = vocab
    if isinstance(folder_config.get("tie_word_embeddings"), bool):
        facts["tied_embeddings"] = folder_config["tie_word_embeddings"]
    return facts


def check_vocab_and_tie(model: nn.Module, folder_config: dict[str, Any], *, grown_vocab_ok: bool = False) -> None:
    """Compare `model` with the config.json of the Hugging Face folder whose weights it is about
    to load.

    Args:
        folder_config: the folder's parsed config.json.
        grown_vocab_ok: the model may have more rows than the folder (model.resize_to_tokenizer
            grew it; the folder's rows fill the first ones).
    Raises:
        ValueError: the vocabulary sizes or the tying differ; the message names both values and
            the setting to change.
    """
    mine, theirs = vocab_and_tie(model), folder_vocab_and_tie(folder_config)
    problems = []
    if "vocab_size" in mine and "vocab_size" in theirs:
        a, b = mine["vocab_size"], theirs["vocab_size"]
        if a < b or (a > b and not grown_vocab_ok):
            problems.append(
                f"the model has vocab_size {a}, the folder's config.json {b}: set model.hf_config.vocab_size={b} "
                f"(model.vocab_size={b} for model.kind=llama), or use the folder's tokenizer"
                + (" and model.resize_to_tokenizer=true to grow it" if a > b else ""))
    if ("tied_embeddings" in mine and "tied_embeddings" in theirs
            and mine["tied_embeddings"] != theirs["tied_embeddings"]):
        a, b = mine["tied_embeddings"], theirs["tied_embeddings"]
        problems.append(
            f"the model's input embedding and lm_head are {tying_words(a)}, the folder's config.json has "
            f"tie_word_embeddings={str(b).lower()}: set model.hf_config.tie_word_embeddings={str(b).lower()} "
            f"(model.tie_word_embeddings for model.kind=llama)")
    if problems:
        raise ValueError("the model does not match the Hugging Face folder it loads: " + "; ".join(problems))


def tying_words(tied: bool) -> str:
    """How messages describe an embedding/head pair."""
    return "tied (one matrix)" if tied else "untied (two matrices)"
