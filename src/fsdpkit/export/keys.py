"""Which tensors of a checkpoint are the model's weights, and under which names.

DCP flattens a nested state dict into dotted keys and records each key's nested path in its
metadata (`planner_data`): fsdpkit, Accelerate and Lightning Fabric save `{"model": ..., "optim"...}`
(path `('model', 'lm_head.weight')`), Lightning's Trainer `{"state_dict": ..., "optimizer_0": ...}`,
torchtitan saves the model's keys at the top level (path `('lm_head.weight',)`). The path tells the two apart
even when a model FQN itself starts with `model.`, which a prefix test could not. Names are then cleaned of
wrapper components.
"""

from __future__ import annotations

import re
from typing import Any

from fsdpkit.model.names import clean_name

# Top-level state-dict entries that are never model weights.
NON_MODEL_NAMESPACES = frozenset({
    "optim", "optimizer", "optimizers", "optimizer_states", "rng", "lr_scheduler", "lr_schedulers", "scheduler",
    "dataloader", "train_state", "trainer", "loops", "callbacks",
})
# Top-level entries holding the model, in order of preference: fsdpkit, Accelerate, Fabric;
# Lightning's Trainer (ModelParallelStrategy/FSDPStrategy sharded checkpoints).
MODEL_NAMESPACES = ("model", "state_dict")
_NUMBERED_OPTIMIZER = re.compile(r"optim(izer)?_\d+")  # Lightning's Trainer: optimizer_0, ...


def is_non_model_namespace(top: str) -> bool:
    """Whether a top-level state-dict entry holds something other than model weights."""
    return top in NON_MODEL_NAMESPACES or bool(_NUMBERED_OPTIMIZER.fullmatch(top))


def split_namespace(key: str, key_paths: dict[str, tuple[Any, ...]] | None) -> tuple[str, str]:
    """(top-level entry, the name below it) of a DCP key; ('', key) for a top-level tensor."""
    if key_paths and key in key_paths:
        path = key_paths[key]
        if len(path) == 1:
            return "", str(path[0])
        return str(path[0]), ".".join(str(p) for p in path[1:])
    top, _, rest = key.partition(".")
    return (top, rest) if rest else ("", key)


def model_weights(keys: list[str], *, key_paths: dict[str, tuple[Any, ...]] | None, namespace: str | None = None,
                  structured: bool = True, strip_prefixes: tuple[str, ...] = (),
                  add_prefix: str = "") -> dict[str, str]:
    """Output name -> source key for every model weight, in source order.

    Args:
        keys: the source's tensor keys.
        key_paths: DCP's nested path per key, if known.
        namespace: the top-level state-dict entry holding the model (`model` for fsdpkit);
            `""` for a flat layout (every tensor outside NON_MODEL_NAMESPACES); None: decide
            from the paths (the first of MODEL_NAMESPACES present, else flat).
        structured: False for sources without namespaces (safetensors): every key is a weight.
    Raises:
        ValueError: nothing selected, an undecidable layout, or two keys cleaning to one name.
    """
    if not structured:
        selected = {k: k for k in keys}
    else:
        split = {k: split_namespace(k, key_paths) for k in keys}
        tops = sorted({top for top, _ in split.values()})
        if namespace is None:
            if present := [n for n in MODEL_NAMESPACES if n in tops]:
                namespace = present[0]
            elif not [t for t in tops if t and not is_non_model_namespace(t)]:
                namespace = ""
            else:
                raise ValueError(
                    f"cannot tell which tensors are the model's: the checkpoint's top-level entries are {tops}; "
                    "pass --namespace NAME (the entry holding the model) or --namespace '' (model keys at the top "
                    "level)"
                )
        if namespace:
            selected = {k: rest for k, (top, rest) in split.items() if top == namespace}
        else:
            selected = {k: (f"{top}.{rest}" if top else rest) for k, (top, rest) in split.items()
                        if not is_non_model_namespace(top)}
        if not selected:
            raise ValueError(f"no tensors under the namespace {namespace!r}; the checkpoint's top-level entries are "
                             f"{tops} (pass one of them with --namespace)")
    out: dict[str, str] = {}
    for key, name in selected.items():
        clean = clean_name(name, strip_prefixes=strip_prefixes, add_prefix=add_prefix)
        if clean in out:
            raise ValueError(f"{out[clean]!r} and {key!r} both become {clean!r} after removing prefixes; "
                             "adjust --strip-prefix/--add-prefix")
        out[clean] = key
    return out
