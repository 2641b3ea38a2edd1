"""Chat SFT: a conversation rendered with the tokenizer's chat template, and which of its tokens
are the assistant's (the only ones trained on).

Why prefixes and offsets rather than the template's `{% generation %}` markers: most published
templates have no markers. Instead, for every assistant turn k the conversation up to turn k is
rendered with `add_generation_prompt=True` and the conversation through turn k without it; the
characters between the two are the assistant's reply (with whatever the template closes a turn
with, e.g. an end-of-turn token, which the model must learn to emit). The full rendering is
tokenized once with character offsets, and a token is trained on when it starts inside such a span.
"""

from __future__ import annotations

from typing import Any

import numpy as np

ASSISTANT = "assistant"


def _render(tok: Any, messages: list[dict[str, Any]], *, generation_prompt: bool) -> str:
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def assistant_spans(tok: Any, messages: list[dict[str, Any]]) -> tuple[str, list[tuple[int, int]]]:
    """(rendered conversation, character spans [start, end) of the assistant replies).

    Raises:
        ValueError: a message is malformed, or the template renders a prefix of the conversation
            differently from the start of the whole (the spans could not be located).
    """
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"a conversation must be a non-empty list of {{'role': ..., 'content': ...}}, got "
                         f"{messages!r:.200}")
    for m in messages:
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"a chat message needs 'role' and 'content', got {m!r:.200}")
    full = _render(tok, messages, generation_prompt=False)
    spans = []
    for k, m in enumerate(messages):
        if m["role"] != ASSISTANT:
            continue
        before = _render(tok, messages[:k], generation_prompt=True) if k else ""
        through = _render(tok, messages[: k + 1], generation_prompt=False)
        if not full.startswith(through) or not through.startswith(before):
            raise ValueError("the tokenizer's chat template renders the first turns of a conversation differently from "
                             "the start of the whole conversation, so the assistant's tokens cannot be located; use a "
                             "template whose output for a prefix of the messages is a prefix of its output for all of "
                             "them")
        spans.append((len(before), len(through)))
    return full, spans


def tokenize_conversation(tok: Any, messages: list[dict[str, Any]]) -> tuple[np.ndarray, np.ndarray]:
    """(token ids [n] int64, trained-on mask [n] uint8) of one conversation; the mask is 1 on the
    assistant's tokens only."""
    text, spans = assistant_spans(tok, messages)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = np.asarray(enc["input_ids"], dtype=np.int64)
    starts = np.asarray([s for s, _ in enc["offset_mapping"]], dtype=np.int64)
    mask = np.zeros(len(ids), dtype=np.uint8)
    for a, b in spans:
        mask[(starts >= a) & (starts < b)] = 1
    return ids, mask
