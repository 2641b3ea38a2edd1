"""A Hugging Face folder's vocabulary size and tying, from its config.json, against the model's
own (fsdpkit.checkpoint.embeddings): a folder whose weights a model is about to load must agree on both,
or its embedding would be cut or its head silently shared."""

from __future__ import annotations

from typing import Any

from torch import nn

from fsdpkit.checkpoint.embeddings import tying_words, vocab_and_tie
from fsdpkit.hf.config_json import decode_special_floats


def folder_vocab_and_tie(folder_config: dict[str, Any]) -> dict[str, Any]:
    """The same two facts from a Hugging Face folder's parsed config.json, as transformers reads
    it: the vocabulary of its text config (multimodal models keep it in `text_config`), the tying
    of the top-level config (what `tie_weights` reads), with the model type's defaults for what
    the file leaves out (`save_pretrained` writes only non-default fields). Without transformers
    or a known `model_type`, the file's own fields; a fact found in neither is left out."""
    try:
        from transformers import AutoConfig

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
