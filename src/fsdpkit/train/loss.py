"""The training objective of one micro-batch: summed token cross-entropy, plus a router
load-balancing term for mixture-of-experts models that ask for one.

Normalisation. The trainer divides every micro-batch's summed loss by the number of trained
targets in the whole global batch (`Trainer.train_step`), so the objective is the same at any
world size and micro-batch split. transformers' MoE causal LMs (Mixtral, Qwen2-MoE, Qwen3-MoE,
OLMoE, ...) with `config.output_router_logits` return `aux_loss` (the Switch Transformer
load-balancing loss of that forward) and train on `mean CE + router_aux_loss_coef * aux_loss`.
Here the aux term enters the summed loss weighted by the micro-batch's trained targets:

    objective_sum = ce_sum + router_aux_loss_coef * aux_loss * tokens

so with one micro-batch on one rank, objective_sum / tokens is exactly transformers' `loss`; with
several, the aux term is the token-weighted mean of the micro-batches' aux losses (a micro-batch
with no trained target adds none). The reported `loss` metric stays the cross-entropy alone
(comparable with runs and models without experts); `aux_loss` is reported beside it.

The cross-entropy is computed chunk by chunk from the trunk's hidden states (train/chunked_loss.py,
model/head.py), so the [tokens, vocab] fp32 logits never exist whole; `train.chunked_loss=false`
computes it from the model's full logits instead. Packed samples carry positions that keep their
documents apart (fsdpkit.model.forward).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fsdpkit.data.datasets import Batch, Dataset
from fsdpkit.model import forward as model_forward
from fsdpkit.model.head import check_against_model, output_head
from fsdpkit.train.chunked_loss import linear_cross_entropy

IGNORE_INDEX = -100


@dataclass(frozen=True)
class LossTerms:
    """The pieces of one micro-batch's objective (see the module docstring)."""

    ce_sum: torch.Tensor
    """[] summed cross-entropy over the trained targets (float32)."""
    tokens: torch.Tensor
    """[] trained targets (not -100) in the micro-batch (a tensor: no device sync)."""
    aux: torch.Tensor | None = None
    """[] the router load-balancing loss as transformers returns it (not yet multiplied by the
    coefficient); None for models without one, or with `output_router_logits` off."""
    aux_coef: float = 0.0
    """`router_aux_loss_coef` of the model's config (0 without an aux term)."""

    def objective_sum(self) -> torch.Tensor:
        """What the trainer backpropagates before dividing by the global batch's trained targets:
        ce_sum + aux_coef * aux * tokens."""
        if self.aux is None:
            return self.ce_sum
        return self.ce_sum + self.aux_coef * self.aux.to(self.ce_sum.device, self.ce_sum.dtype) * self.tokens


def router_aux_loss_coef(model: nn.Module) -> float | None:
    """The load-balancing coefficient of a transformers MoE model whose config enables
    `output_router_logits`; None when it does not (or the model has no such setting).

    Multimodal MoE models keep both settings in their text config, which is read when the
    top-level config has none.

    Raises:
        ValueError: `output_router_logits` is on but the config has no `router_aux_loss_coef`.
    """
    config = getattr(model, "config", None)
    if config is None:
        return None
    candidates = [config]
    if callable(getattr(config, "get_text_config", None)):
        candidates.append(config.get_text_config())
    owner = next((c for c in candidates if hasattr(c, "output_router_logits")), None)
    if owner is None or not owner.output_router_logits:
        return None
    coef = getattr(owner, "router_aux_loss_coef", None)
    if coef is None:
        raise ValueError(
            f"{type(model).__name__}'s config enables output_router_logits but has no router_aux_loss_coef, so the "
            "router load-balancing loss cannot be weighted; set model.hf_config.router_aux_loss_coef (transformers' "
            "MoE models default to 0.001-0.02) or model.hf_config.output_router_logits=false")
    return float(coef)


def _ce_terms(model: nn.Module, batch: Batch, *, chunk_tokens: int | None):
    """(summed cross-entropy, the model's output) of one forward. With `chunk_tokens` (not None)
    and a head the chunked loss can take apart, the logits are never built whole
    (fsdpkit.train.chunked_loss); otherwise from the model's full logits, upcast to fp32."""
    head = output_head(model) if chunk_tokens is not None else None
    if head is None:
        out = model_forward(model, batch.inputs, positions=batch.positions)
        logits = out if isinstance(out, torch.Tensor) else out.logits  # [B, L, V]
        ce_sum = F.cross_entropy(logits.float().flatten(0, 1), batch.targets.flatten(), reduction="sum",
                                 ignore_index=IGNORE_INDEX)
        return ce_sum, out
    captured: list = []
    hook = head.trunk.register_forward_hook(lambda module, args, output: captured.append(output))
    try:
        out = model_forward(model, batch.inputs, positions=batch.positions, logits_to_keep=1)
    finally:
        hook.remove()
    if not captured:
        raise ValueError(f"{head.name}'s forward does not run {type(head.trunk).__name__}, where fsdpkit's chunked "
                         "loss reads the hidden states; set train.chunked_loss=false to train on the model's full "
                         "logits")
    hidden = captured[-1] if isinstance(captured[-1], torch.Tensor) else captured[-1][0]  # [B, L, H] or [1, B*L, H]
    check_against_model(head, hidden, out if isinstance(out, torch.Tensor) else out.logits)
    proj = head.projection
    ce_sum = linear_cross_entropy(hidden.flatten(0, 1), proj.weight, proj.bias, batch.targets.flatten(),
                                  transform=head.transform, chunk_tokens=chunk_tokens)
    return ce_sum, out


def masked_loss_terms(model: nn.Module, batch: Batch, *, chunk_tokens: int | None = 0) -> LossTerms:
    """One forward of a micro-batch (inputs, targets with -100 where not trained on, positions
    that keep packed documents apart).

    chunk_tokens: tokens per chunk of the chunked loss (0: its default); None: the model's full
    logits.

    The aux term (if the config enables it) covers every input position, as transformers
    computes it when called without an attention mask.

    Raises:
        ValueError: the config enables output_router_logits but the forward returned no aux_loss,
            or the model computes its logits otherwise than the chunked loss takes them to be.
    """
    coef = router_aux_loss_coef(model)
    ce_sum, out = _ce_terms(model, batch, chunk_tokens=chunk_tokens)
    tokens = (batch.targets != IGNORE_INDEX).sum()
    if coef is None:
        return LossTerms(ce_sum=ce_sum, tokens=tokens)
    aux = None if isinstance(out, torch.Tensor) else getattr(out, "aux_loss", None)
    if aux is None:
        raise ValueError(
            f"{type(model).__name__}'s config enables output_router_logits, but its forward returned no aux_loss to "
            "train the router with; set model.hf_config.output_router_logits=false to train on the cross-entropy "
            "alone")
    return LossTerms(ce_sum=ce_sum, tokens=tokens, aux=torch.as_tensor(aux, dtype=torch.float32, device=ce_sum.device),
                     aux_coef=coef)


def micro_batch_terms(model: nn.Module, data: Dataset, indices: list[int], *, device: torch.device,
                      chunk_tokens: int | None = 0) -> LossTerms:
    """The loss pieces of samples `indices` (see masked_loss_terms)."""
    batch = Batch(*(None if t is None else t.to(device) for t in data.labeled_batch(indices)))
    return masked_loss_terms(model, batch, chunk_tokens=chunk_tokens)
