"""Output projection and cross-entropy, chunk by chunk: the [tokens, vocab] logits never exist
whole.

`linear_cross_entropy(hidden, weight, bias, targets, ...)` equals

    F.cross_entropy(transform(F.linear(hidden, weight, bias)).float(), targets, reduction="sum",
                    ignore_index=-100)

(the logits in the hidden states' dtype, transformed there, upcast to fp32 for the loss: the order
transformers' models and loss use), computed `chunk` rows at a time, over the rows that are trained
on only (in chat SFT the prompts are a large share of the tokens). Each chunk's gradients with
respect to its hidden rows, the weight and the bias are computed in the forward, while the chunk's
logits exist, and kept (the hidden rows' gradient has the hidden states' size; the weight's is
accumulated in fp32 and has the weight's size), so the backward only scales them by the incoming
gradient: no logits are recomputed. At a 128k vocabulary one token's fp32 logits take 0.5 MB;
the chunk bounds what exists at once to a few chunk-sized buffers, whatever the micro-batch.
The approach is that of Liger Kernel's fused linear cross-entropy, written here in plain PyTorch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fsdpkit.model.head import LogitTransform

IGNORE_INDEX = -100
CHUNK_BYTES = 128 * 2**20
"""Default chunk: as many tokens as keep one chunk's fp32 logits within 128 MiB."""


def chunk_rows(vocab: int, chunk_tokens: int = 0) -> int:
    """Tokens per chunk: `chunk_tokens`, or with 0 the CHUNK_BYTES default for this vocabulary."""
    return chunk_tokens if chunk_tokens > 0 else max(1, CHUNK_BYTES // (4 * vocab))


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, transform: LogitTransform, chunk: int):
        # hidden [N, H], weight [V, H], bias [V] or None, targets [N] (every one trained on: see below)
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grads = need_h or need_w or need_b
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for a in range(0, hidden.shape[0], chunk):
            h, t = hidden[a : a + chunk], targets[a : a + chunk, None]  # [C, H], [C, 1]
            y = transform(F.linear(h, weight, bias)).float()  # [C, V] fp32 (its own buffer unless already fp32)
            factor = transform.grad_factor(y) if grads else 1.0
            logp = torch.log_softmax(y, dim=-1)
            del y
            total -= logp.gather(1, t).sum()
            if not grads:
                continue
            g = logp.exp_()  # the softmax, in place of the log-probabilities
            g.scatter_add_(1, t, torch.full_like(t, -1.0, dtype=g.dtype))  # minus the one-hot target
            if not isinstance(factor, float) or factor != 1.0:
                g.mul_(factor)
            g = g.to(hidden.dtype)  # dL/dlogits, in the logits' dtype as autograd would hold it
            if need_h:
                torch.mm(g, weight, out=grad_h[a : a + chunk])
            if need_w:
                if g.dtype == grad_w.dtype:
                    grad_w.addmm_(g.t(), h)
                else:
                    grad_w.add_(g.t() @ h)
            if need_b:
                grad_b.add_(g.sum(0))
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        ctx.dtypes = (weight.dtype, bias.dtype if bias is not None else None)
        return total

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w, grad_b = ctx.saved_tensors
        w_dtype, b_dtype = ctx.dtypes
        return (None if grad_h is None else grad_h * grad_out.to(grad_h.dtype),
                None if grad_w is None else (grad_w * grad_out).to(w_dtype),
                None if grad_b is None else (grad_b * grad_out).to(b_dtype),
                None, None, None)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         targets: torch.Tensor, *, transform: LogitTransform | None = None,
                         chunk_tokens: int = 0) -> torch.Tensor:
    """Summed cross-entropy (fp32 scalar) of hidden [N, H] projected by weight [V, H] (+ bias [V])
    and `transform`, against targets [N] (-100: not trained on), `chunk_tokens` rows at a time
    (0: the CHUNK_BYTES default). Rows not trained on (prompts, padding) are left out before the
    projection: they add nothing to the loss or the gradients."""
    trained = targets != IGNORE_INDEX
    if not bool(trained.all()):
        keep = trained.nonzero()[:, 0]
        hidden, targets = hidden.index_select(0, keep), targets.index_select(0, keep)
    hidden = hidden.to(weight.dtype)
    return _LinearCrossEntropy.apply(hidden, weight, bias, targets, transform or LogitTransform(),
                                     chunk_rows(weight.shape[0], chunk_tokens))
