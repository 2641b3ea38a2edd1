"""Attention one document at a time, for packed samples of transformers models that use sdpa.

transformers keeps packed documents apart with a block-diagonal causal mask. `scaled_dot_product_attention`
with an explicit mask computes every query-key block of the sample, masked or not: a sample of L
positions costs L^2, twice the L^2 / 2 of plain causal attention, whatever its documents. Run one
document at a time with `is_causal=True`, a sample costs the sum of n_i^2 / 2 over its documents:
what flash-attention's varlen kernels do on GPUs, here through transformers' own sdpa function
(`sdpa_attention_forward`: its grouped-query handling, scaling and dropout), so nothing about the
attention itself is written again.

`use_document_attention(model)` registers this function with transformers' AttentionInterface
under DOCUMENT_SDPA and makes it the model's attention. It reads the documents from the
`position_ids` that transformers passes every attention call (positions restart at 0 where a
document starts), and hands the call to sdpa unchanged whenever per-document causal attention
would not be the same computation: no positions, a sliding window shorter than a document, a
position bias, a non-causal module, or a query that is not the key's length.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

DOCUMENT_SDPA = "fsdpkit_document_sdpa"

# (the position_ids tensor, its version, its segments): every layer of a forward gets the same tensor
_last: tuple[weakref.ref, int, list[list[tuple[int, int]]]] | None = None


def _segments(position_ids: torch.Tensor) -> list[list[tuple[int, int]]]:
    """[(start, end), ...] of each row's documents (a document starts where the position does not
    step by one), computed once per forward: every layer gets the same position_ids tensor."""
    global _last
    if _last is not None and _last[0]() is position_ids and _last[1] == position_ids._version:
        return _last[2]
    new = torch.diff(position_ids, dim=-1, prepend=position_ids[:, :1]) != 1
    new[:, 0] = True
    starts = new.nonzero().tolist()  # [[row, start], ...] in row order: one device sync
    length = position_ids.shape[-1]
    rows: list[list[int]] = [[] for _ in range(position_ids.shape[0])]
    for row, start in starts:
        rows[row].append(start)
    segments = [list(zip(r, r[1:] + [length], strict=True)) for r in rows]
    _last = (weakref.ref(position_ids), position_ids._version, segments)
    return segments


def document_sdpa_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, **kwargs):
    """transformers' attention-function interface: query [B, H, T, D], key and value [B, KV, T, D]
    -> ([B, T, H, D], None)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    position_ids = kwargs.get("position_ids")
    b, _, t, _ = query.shape
    plain = (position_ids is None or position_ids.ndim != 2 or tuple(position_ids.shape) != (b, t)
             or key.shape[2] != t or kwargs.get("position_bias") is not None
             or kwargs.get("is_causal", getattr(module, "is_causal", True)) is False)
    segments = None if plain else _segments(position_ids)
    if segments is not None:
        window = kwargs.get("sliding_window") or getattr(module, "sliding_window", None)
        longest = max(e - a for row in segments for a, e in row)
        if all(len(row) == 1 for row in segments) or (window and longest > window):
            segments = None  # one document per row: plain causal sdpa is the same and one call
    if segments is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    rest = {k: v for k, v in kwargs.items() if k not in ("position_ids", "sliding_window", "is_causal")}
    rows = []
    for i, row in enumerate(segments):
        parts = [sdpa_attention_forward(module, query[i : i + 1, :, a:e], key[i : i + 1, :, a:e],
                                        value[i : i + 1, :, a:e], None, is_causal=True, **rest)[0]
                 for a, e in row]
        rows.append(torch.cat(parts, dim=1))  # [1, T, H, D]
    return torch.cat(rows, dim=0), None


def use_document_attention(model: nn.Module) -> bool:
    """Make `model` (a transformers model whose attention is sdpa) attend one document at a time;
    returns whether it did. The masks transformers builds for sdpa are still built (the calls that
    go to sdpa unchanged use them)."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(DOCUMENT_SDPA, document_sdpa_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(DOCUMENT_SDPA, sdpa_mask)
    config._attn_implementation = DOCUMENT_SDPA
    return True
