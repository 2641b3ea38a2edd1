"""Hugging Face tokenizers from a local folder (`data.tokenizer=<dir>`), and the vocabulary check.

A folder is read with `local_files_only=True`: nothing is downloaded. A name that is not a folder
is passed to transformers as a hub id (that needs network, and is the user's explicit choice).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def load_tokenizer(spec: str) -> Any:
    """The `transformers` tokenizer saved in folder `spec` (or hub id `spec`).

    Raises:
        ImportError: transformers is not installed.
        FileNotFoundError: `spec` looks like a path but does not exist.
        ValueError: the tokenizer is not a fast tokenizer (offsets are needed for chat masks) or
            has no EOS token (packing separates documents with it).
    """
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ImportError("data.tokenizer needs transformers: pip install 'fsdpkit[hf]' (with -c "
                          "constraints.txt)") from None
    path = Path(spec).expanduser()
    local = path.is_dir()
    if not local and (spec.startswith((".", "/", "~")) or path.suffix):
        raise FileNotFoundError(f"data.tokenizer={spec!r} is not a directory; save one with "
                                "tokenizer.save_pretrained(DIR) and pass data.tokenizer=DIR")
    tok = AutoTokenizer.from_pretrained(str(path) if local else spec, local_files_only=local)
    if not tok.is_fast:
        raise ValueError(f"data.tokenizer={spec!r} is a slow (Python) tokenizer; fsdpkit needs a fast one "
                         "(tokenizer.json), e.g. save it again with transformers' PreTrainedTokenizerFast")
    if tok.eos_token_id is None:
        raise ValueError(f"data.tokenizer={spec!r} has no eos_token; set one (tokenizer.eos_token = ...) and save it "
                         "again")
    return tok


def tokenizer_size(spec: str) -> int:
    """Token ids the tokenizer in `spec` can produce (its `len`, added tokens included)."""
    return len(load_tokenizer(spec))


def tokenizer_fingerprint(tok: Any) -> str:
    """A digest of everything that decides token ids: the vocabulary, merges, normaliser,
    special tokens and chat template (the serialised fast tokenizer plus the template)."""
    h = hashlib.sha256()
    h.update(tok.backend_tokenizer.to_str().encode())
    h.update(repr(sorted((k, str(v)) for k, v in tok.special_tokens_map.items())).encode())
    h.update(str(getattr(tok, "chat_template", None) or "").encode())
    return h.hexdigest()


def check_vocab(tok: Any, *, model_vocab: int, spec: str) -> None:
    """The model must have an embedding row for every id the tokenizer can produce.

    Raises:
        ValueError: naming both sizes and the settings that fix it.
    """
    need = len(tok)
    if need > model_vocab:
        raise ValueError(
            f"data.tokenizer={spec!r} has {need} tokens but the model's vocabulary has {model_vocab} rows; "
            f"set model.vocab_size (and model.hf_config.vocab_size for model.kind=hf) to at least {need}, "
            "or set model.resize_to_tokenizer=true to grow the embedding and lm_head"
        )


# A minimal chat template whose rendering of the first turns is a prefix of the whole (what
# fsdpkit.data.chat needs to find the assistant's tokens).
SIMPLE_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SIMPLE_SPECIAL_TOKENS = ("<|endoftext|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")


def train_bpe_tokenizer(texts: Iterable[str], *, vocab_size: int, out_dir: str | Path,
                        chat_template: str = SIMPLE_CHAT_TEMPLATE) -> Any:
    """Train a byte-level BPE tokenizer on `texts` with the `tokenizers` library (seconds, no
    download) and save it as a transformers fast tokenizer in `out_dir`, with EOS, padding and a
    chat template. Returns the tokenizer; `len()` of it is at most `vocab_size`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SIMPLE_SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(texts, trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>", pad_token="<|pad|>",
                                  additional_special_tokens=list(SIMPLE_SPECIAL_TOKENS[2:]))
    tok.chat_template = chat_template
    tok.save_pretrained(str(out_dir))
    return tok
