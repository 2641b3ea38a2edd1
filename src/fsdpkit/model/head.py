"""The output head as the chunked loss sees it: the trunk's last hidden states, the output
projection's weight and bias, and the transform the architecture applies to the logits.

A causal LM computes `logits = transform(lm_head(trunk(input_ids)))`. The chunked loss computes
the same thing a few hundred tokens at a time, so it needs the pieces apart:

- the hidden states: the trunk's output (`model.get_decoder()` for transformers models), captured by
  a forward hook during the model's own forward, which keeps FSDP's hooks, activation
  checkpointing and compile as they are. The forward asks the model for the logits of the last
  position only (`logits_to_keep=1`, transformers' own argument);
- the projection: the output embeddings (`lm_head`), a plain `nn.Linear` inside the root FSDP
  unit, whose parameters the root keeps unsharded from its forward to its backward;
- the transform: read from the config (`final_logit_softcapping`, Cohere's `logit_scale`,
  Granite's `logits_scaling`, Falcon-H1's `lm_head_multiplier`).

Every forward proves the pieces right: the model's own logits of the last position must equal
what the pieces give for it (`check_against_model`), so an architecture that does anything else
between its trunk and its logits is refused with a clear error instead of training on another
objective.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule


@dataclass(frozen=True)
class LogitTransform:
    """What an architecture does to `lm_head`'s output, in the order it does it, in the logits'
    own dtype: `logits * scale` (or `/ divisor`), then `cap * tanh(logits / cap)`."""

    scale: float | None = None
    divisor: float | None = None
    softcap: float | None = None

    def __call__(self, z: torch.Tensor) -> torch.Tensor:
        if self.scale is not None:
            z = z * self.scale
        if self.divisor is not None:
            z = z / self.divisor
        if self.softcap is not None:
            z = torch.tanh(z / self.softcap) * self.softcap
        return z

    def grad_factor(self, y: torch.Tensor) -> torch.Tensor | float:
        """d transform(z) / dz, elementwise, from the transformed logits y (fp32)."""
        factor: torch.Tensor | float = 1.0
        if self.softcap is not None:
            factor = 1 - (y / self.softcap) ** 2
        if self.scale is not None:
            factor = factor * self.scale
        if self.divisor is not None:
            factor = factor / self.divisor
        return factor

    @property
    def identity(self) -> bool:
        return self.scale is None and self.divisor is None and self.softcap is None


@dataclass(frozen=True)
class OutputHead:
    name: str
    """The model's class, for messages."""
    trunk: nn.Module
    """The module whose output is the hidden state the projection reads."""
    projection: nn.Linear
    transform: LogitTransform


def _number(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def logit_transform(model: nn.Module) -> LogitTransform:
    """The transform the model's config declares (the identity for fsdpkit's Llama)."""
    config = getattr(model, "config", None)
    if config is None:
        return LogitTransform()
    text = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config
    scale = _number(getattr(model, "logit_scale", None)) or _number(getattr(text, "logit_scale", None))
    multiplier = _number(getattr(text, "lm_head_multiplier", None))
    if scale is not None and multiplier is not None:
        scale *= multiplier
    return LogitTransform(scale=scale if scale is not None else multiplier,
                          divisor=_number(getattr(text, "logits_scaling", None)),
                          softcap=_number(getattr(text, "final_logit_softcapping", None)))


@functools.cache
def _keeps_logits(cls: type) -> bool:
    return "logits_to_keep" in inspect.signature(cls.forward).parameters


def output_head(model: nn.Module) -> OutputHead | None:
    """The pieces of `model`'s head, or None when the chunked loss cannot take it apart (the
    model has no separate trunk, no `logits_to_keep`, or an output projection that is not a plain
    Linear inside the root unit: a LoRA-adapted or separately sharded `lm_head`)."""
    from fsdpkit.model.llama import LlamaForCausalLM

    name = type(model).__name__.removeprefix("FSDP")
    if isinstance(model, LlamaForCausalLM):
        return OutputHead(name=name, trunk=model.model, projection=model.lm_head, transform=LogitTransform())
    get = getattr(model, "get_output_embeddings", None)
    try:  # OPT's forward runs model.decoder, not model.model: transformers' own lookup knows
        trunk = model.get_decoder()
    except (AttributeError, ValueError, NotImplementedError):
        return None
    if get is None or trunk is model or not _keeps_logits(type(model)):
        return None
    projection = get()
    if type(projection) is not nn.Linear or isinstance(projection, FSDPModule):
        return None
    return OutputHead(name=name, trunk=trunk, projection=projection, transform=logit_transform(model))


def check_against_model(head: OutputHead, hidden: torch.Tensor, model_logits: torch.Tensor) -> None:
    """The model's own logits of the last position ([B, 1, V]) must equal transform(lm_head(h))
    of the captured hidden states' last position.

    Raises:
        ValueError: they differ beyond the logits' precision, naming the architecture.
    """
    with torch.no_grad():
        proj = head.projection
        mine = head.transform(nn.functional.linear(hidden[:, -1:].to(proj.weight.dtype), proj.weight, proj.bias))
        theirs = model_logits.to(mine.dtype)
        if mine.shape != theirs.shape:
            diff = float("inf")
        else:
            diff = float((mine.float() - theirs.float()).abs().max())
        tol = 8 * torch.finfo(mine.dtype).eps * max(1.0, float(theirs.float().abs().max()))
    if not diff <= tol:
        raise ValueError(
            f"{head.name} computes its logits differently from what fsdpkit's chunked loss takes them to be (lm_head "
            f"of {type(head.trunk).__name__}'s output, then {head.transform}): the last position's logits differ by "
            f"{diff:.3g} (shape {tuple(theirs.shape)} against {tuple(mine.shape)}). Set train.chunked_loss=false to "
            "train on the model's own full logits")
