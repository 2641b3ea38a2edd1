"""Every buffer's value after `to_empty()`, as the model's own construction gives it.

After `to_empty()` every buffer holds garbage: RoPE tables, embedding scales, per-layer-type RoPE
tables, Mamba vectors, persistent or not. fsdpkit's Llama recomputes its one table. A transformers
model runs its own `_init_weights` hooks (the mechanism `from_pretrained` uses after it builds on
the meta device), with every parameter marked as initialised, so that only buffers, and the
parameters left to the model on purpose, are touched. Nothing is listed per architecture.

A run initialises the buffers once: when the model is materialised (fsdpkit.parallel.materialize),
or, when it starts from a Hugging Face folder, after the folder's weights are loaded
(fsdpkit.hf.weights.load_hf_weights), keeping the persistent ones the file held.
"""

from __future__ import annotations

import torch
from torch import nn

from fsdpkit.hf.library import transformers_class
from fsdpkit.model.llama import LlamaForCausalLM


@torch.no_grad()
def init_buffers(model: nn.Module, *, also_params: frozenset[int] = frozenset(),
                 keep_persistent: bool = False) -> None:
    """Give every buffer the value the model's construction gives it, and the parameters whose id
    is in `also_params` (transformers models only) what the model's own init gives them; no other
    parameter is touched.

    Args:
        also_params: ids of parameters fsdpkit's init left to the model (fsdpkit.parallel.init:
            norm weights, biases and other 1-D parameters of a transformers model).
        keep_persistent: the persistent buffers were just loaded (they are in the state dict, so
            in the weights file): they keep the loaded values, as from_pretrained keeps them.
    Raises:
        NotImplementedError: the model's own init sets no value for a parameter in `also_params`.
    """
    if isinstance(model, LlamaForCausalLM):
        model.reset_nonpersistent_buffers()  # its only buffers: the RoPE table
    else:
        init_transformers_buffers(model, also_params=also_params, keep_persistent=keep_persistent)


@torch.no_grad()
def init_transformers_buffers(model: nn.Module, *, also_params: frozenset[int] = frozenset(),
                              keep_persistent: bool = False) -> None:
    """init_buffers of a transformers model: its own `_init_weights` hooks (MiniMax's decay tables
    are persistent, and its hooks would recompute them in full precision: keep_persistent restores
    them, whichever way a hook writes).

    transformers' init functions skip tensors flagged `_is_hf_initialized`: every other parameter
    is flagged, and the modules' own flags (set when the model was built) are cleared so that the
    hooks run again.
    """
    kept = {}
    if keep_persistent:  # restored after the hooks, whichever way a hook writes (not all use init.*)
        kept = {id(b): (b, b.detach().clone()) for m in model.modules() for n, b in m.named_buffers(recurse=False)
                if n not in m._non_persistent_buffers_set}
    for module in model.modules():
        if "_is_hf_initialized" in module.__dict__:
            del module._is_hf_initialized
    left = {name: p for name, p in model.named_parameters() if id(p) in also_params}
    for p in model.parameters():
        p._is_hf_initialized = id(p) not in also_params
    for p in left.values():  # what no hook sets stays NaN, and is caught below
        _local(p).fill_(float("nan"))
    with transformers_class(model):
        model.initialize_weights()
    for buffer, value in kept.values():
        buffer.copy_(value)
    for p in model.parameters():
        p._is_hf_initialized = True
    unset = [f"{name} of {type(model.get_submodule(name.rpartition('.')[0])).__name__}"
             for name, p in left.items() if _local(p).isnan().any()]
    if unset:
        raise NotImplementedError(
            f"{type(model).__name__}'s own _init_weights sets no value for {', '.join(unset)}, and fsdpkit has no rule "
            "for a 1-D parameter that is neither a bias nor a norm weight. Start from trained weights (model.path with "
            "model.pretrained=true, or model.init_from=hf:DIR)")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t.data
