"""Can the model keep packed documents apart?

Packing (`data.packing=true`) isolates documents through attention: positions restart at 0 per
document and the model's attention masks (or varlen kernels) follow them. Layers that carry state
from one token to the next outside attention do not see those boundaries: state-space (Mamba)
mixers, short convolutions, linear and lightning attention, recurrent blocks. A packed document
would read the ones before it through them, so packing is refused for such models, before any
rank starts (`packing_refusal`). Nothing is listed per architecture: the model is read for what
such layers are made of (a convolution over the sequence), what they are called, and what the
config says its layers are (`layer_types`, `layers_block_type`, `block_types`). A model that
ignores the positions some other way (one that builds its masks without them, as OPT does) is
caught at start-up by `check_isolation`, which runs the model itself on two documents.
"""

from __future__ import annotations

import inspect
import re

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

# Class names of token mixers that carry state outside attention (GPT-2's `Conv1D` is a linear layer: a
# convolution over the sequence is found as an nn.Conv1d instead), and the layer kinds configs name them by.
_STATEFUL = re.compile(r"mamba|ssm|linear.?att|lightning|delta.?net|rwkv|recurren|retention|hyena|short.?conv|"
                       r"[msx]lstm", re.IGNORECASE)
_STATEFUL_KIND = re.compile(rf"{_STATEFUL.pattern}|conv|hybrid|linear", re.IGNORECASE)
_LAYER_KIND_KEYS = ("layer_types", "layers_block_type", "block_types")


def _config_kinds(model: nn.Module) -> list[str]:
    config = getattr(model, "config", None)
    if config is None:
        return []
    text = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config
    kinds: list[str] = []
    for key in _LAYER_KIND_KEYS:
        value = getattr(text, key, None)
        if isinstance(value, list | tuple):
            kinds += [f"{key}={kind}" for kind in dict.fromkeys(map(str, value)) if _STATEFUL_KIND.search(kind)]
    return kinds


def stateful_token_mixers(model: nn.Module) -> list[str]:
    """What in `model` carries state across tokens outside attention (empty: nothing does), e.g.
    ['FalconH1Mixer (a convolution over the sequence: model.layers.0.mamba.conv1d)']."""
    found: dict[str, str] = {}
    modules = dict(model.named_modules())
    whole = {id(model), id(getattr(model, "base_model", model))}  # their names carry the architecture's (Mamba...)
    for name, module in modules.items():
        cls = type(module).__name__.removeprefix("FSDP")
        if isinstance(module, nn.Conv1d):
            owner = type(modules.get(name.rpartition(".")[0], model)).__name__.removeprefix("FSDP")
            found.setdefault(owner, f"{owner} (a convolution over the sequence: {name})")
        elif _STATEFUL.search(cls) and id(module) not in whole:
            found.setdefault(cls, cls)
    return list(found.values()) + _config_kinds(model)


def packing_refusal(model: nn.Module) -> str | None:
    """Why `model` cannot keep packed documents apart, or None when it can."""
    name = type(model).__name__.removeprefix("FSDP")
    alternative = ("use data.packing=false (one document per sample, padded) or data.packing=concat (documents run "
                   "together on purpose, as in pretraining)")
    params = inspect.signature(type(model).forward).parameters
    if "position_ids" not in params:
        return (f"data.packing=true keeps packed documents apart through position_ids that restart at 0 per document, "
                f"and {name}'s forward takes no position_ids; {alternative}")
    mixers = stateful_token_mixers(model)
    if mixers:
        return (f"data.packing=true keeps packed documents apart through attention masks, but {name} has layers that "
                f"carry state from token to token outside attention ({'; '.join(mixers)}), so a packed document would "
                f"read the documents before it; {alternative}")
    return None


# A leak is a change of a document's logits, when another document is packed before it, of more than
# this share of the change when the same document simply follows the other without isolation (computing
# in fp32; in bf16 or fp16 the share is 0.1: the two forwards' roundings differ by ~1e-2 of the logits).
LEAK_RATIO = 1e-3
LEAK_RATIO_LOW_PRECISION = 0.1


@torch.no_grad()
def check_isolation(model: nn.Module, *, vocab_size: int, device: torch.device, seed: int = 0) -> None:
    """Prove on `model` itself that a packed document sees nothing of the one before it: document
    b's logits packed after document a (positions restarting at 0) against b alone. Every rank
    runs the same forwards (FSDP needs them all); the model is in eval mode meanwhile.

    Raises:
        ValueError: the model lets packed documents see each other, naming it and the alternative.
    """
    from fsdpkit.model import logits

    g = torch.Generator().manual_seed(seed)
    a = torch.randint(0, vocab_size, (1, 11), generator=g)
    b = torch.randint(0, vocab_size, (1, 13), generator=g)
    both = torch.cat([a, b], dim=1).to(device)
    positions = torch.cat([torch.arange(11), torch.arange(13)])[None].to(device)
    was_training = model.training
    model.eval()
    try:
        packed = logits(model, both, positions=positions)[0, 11:].float()
        alone = logits(model, b.to(device))[0].float()
        run_on = logits(model, both)[0, 11:].float()  # what a leak would look like
    finally:
        model.train(was_training)
        for module in model.modules():  # the root keeps its parameters gathered after a forward alone
            if isinstance(module, FSDPModule):
                module.reshard()
    leak, context = float((packed - alone).abs().max()), float((run_on - alone).abs().max())
    ratio = LEAK_RATIO if _compute_dtype(model).itemsize >= 4 else LEAK_RATIO_LOW_PRECISION
    if not leak <= ratio * context:
        name = type(model).__name__.removeprefix("FSDP")
        raise ValueError(
            f"data.packing=true: {name} does not keep packed documents apart: a document's logits change by {leak:.3g} "
            f"when another document is packed before it (positions restarting at 0), against {context:.3g} when it "
            "simply follows it; its attention does not follow the positions (or some layer carries state across "
            "tokens). Use data.packing=false (one document per sample, padded) or data.packing=concat (documents run "
            "together on purpose, as in pretraining)")


def _compute_dtype(model: nn.Module) -> torch.dtype:
    """The dtype the forward computes in: FSDP's param_dtype, else the parameters' own."""
    for module in model.modules():
        policy = getattr(getattr(module, "_get_fsdp_state", lambda: None)(), "_mp_policy", None)
        if policy is not None and policy.param_dtype is not None:
            return policy.param_dtype
    return next(model.parameters()).dtype
