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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fsdpkit.data.datasets import Dataset
from fsdpkit.model import forward as model_forward

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


def masked_loss_terms(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> LossTerms:
    """One forward of inputs [B, L] scored against targets [B, L] (-100: not trained on).

    The aux term (if the config enables it) covers every input position, as transformers
    computes it when called without an attention mask.

    Raises:
        ValueError: the config enables output_router_logits but the forward returned no aux_loss.
    """
    coef = router_aux_loss_coef(model)
    # Not fsdpkit.model.logits: that keeps only the logits, and the aux loss is in the same output.
    out = model_forward(model, inputs)
    logits = out if isinstance(out, torch.Tensor) else out.logits  # [B, L, V]
    ce_sum = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum",
                             ignore_index=IGNORE_INDEX)
    tokens = (targets != IGNORE_INDEX).sum()
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


def masked_loss_sum(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy of inputs [B, L] against targets [B, L]; targets of -100 are skipped.
    The cross-entropy alone: no router aux term (see masked_loss_terms)."""
    return masked_loss_terms(model, inputs, targets).ce_sum


def token_loss_sum(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy of batch [B, L+1] (inputs batch[:, :-1], targets batch[:, 1:])."""
    return masked_loss_sum(model, batch[:, :-1], batch[:, 1:])


def micro_batch_terms(model: nn.Module, data: Dataset, indices: list[int], *, device: torch.device) -> LossTerms:
    """The loss pieces of samples `indices` (see masked_loss_terms)."""
    inputs, targets = data.labeled_batch(indices)
    return masked_loss_terms(model, inputs.to(device), targets.to(device))


def micro_batch_loss(model: nn.Module, data: Dataset, indices: list[int], *, device: torch.device) -> torch.Tensor:
    """Summed cross-entropy of samples `indices` over their trained targets."""
    return micro_batch_terms(model, data, indices, device=device).ce_sum
