"""The hub's names and layouts for an export: what `save_pretrained` of the same model writes.

transformers 5 holds some weights in memory in another layout than its files: MoE experts fused
into 3-D tensors (`mlp.experts.gate_up_proj`) where Mixtral's and Qwen3-MoE's files hold one
tensor per expert; legacy names (GPT-NeoX's `embed_out` for `lm_head`). A checkpoint holds what
`model.state_dict()` holds, the in-memory side. `save_pretrained` undoes transformers' load-time
conversions with `core_model_loading.revert_weight_conversion`; this module plans the same undoing
tensor by tensor, so that the export can still stream:

- tensors that are only renamed keep their data as stored: they stream a block of rows at a
  time under the new name;
- tensors that a reverse converter transforms (split fused experts, concatenate, transpose) are
  grouped as transformers groups them; each group is read whole and converted by transformers'
  own `revert_weight_conversion`, one group at a time (memory: one group's inputs and outputs).

The plan is made on meta tensors (no data) and checked against transformers' answer for the whole
state dict, so the export writes exactly the names and shapes save_pretrained would.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from fsdpkit.export.sources import TensorInfo

_SHOWN = 3  # examples of renamed / converted names in the report line


@dataclass
class ConvertedGroup:
    """In-memory tensors that one reverse converter turns into the file's tensors."""

    inputs: list[str]  # in-memory names (the export's names before the hub layout)
    outputs: dict[str, TensorInfo]  # file name -> shape and dtype (as converted from the stored dtype)


@dataclass
class HubLayout:
    """How the in-memory names become the file's names (identity when `model` is None)."""

    renamed: dict[str, str] = field(default_factory=dict)  # file name -> in-memory name (data unchanged)
    groups: list[ConvertedGroup] = field(default_factory=list)
    model: Any = None  # the meta model whose conversions these are (None: names kept)
    note: str = ""

    def convert(self, group: ConvertedGroup, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The file's tensors of `group` from its in-memory tensors (read whole), by transformers."""
        from transformers.core_model_loading import revert_weight_conversion

        out = revert_weight_conversion(self.model, dict(tensors))
        assert set(out) == set(group.outputs), (sorted(out), sorted(group.outputs))
        return {name: t.contiguous() for name, t in out.items()}


def meta_model_from_config(config: Any) -> Any:
    """The causal LM transformers builds from `config` (a PretrainedConfig), on the meta device."""
    from fsdpkit.hf.library import require_transformers

    transformers = require_transformers()
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def plan_hub_layout(model: Any, tensors: Mapping[str, TensorInfo]) -> HubLayout:
    """Plan the file names of `tensors` (in-memory name -> shape and dtype) for `model`.

    Args:
        model: a transformers model (on the meta device is enough), or None to keep the names.
    Raises:
        ValueError: transformers' reverse conversion cannot be planned on meta tensors, or the
            plan differs from transformers' answer for the whole state dict (the message says
            how to export the in-memory names instead).
    """
    if model is None:
        return HubLayout(renamed={name: name for name in tensors})
    from transformers.core_model_loading import PrefixChange, WeightConverter, WeightRenaming, revert_weight_conversion

    conversions = getattr(model, "_weight_conversions", None)
    if conversions is None:  # as revert_weight_conversion does for a model not built by from_pretrained
        from transformers.conversion_mapping import get_model_conversion_mapping

        conversions = [c for c in get_model_conversion_mapping(model, add_legacy=False)
                       if not isinstance(c, PrefixChange)]
    reverse = [c.reverse_transform() for c in conversions[::-1]]
    renamings = [r for r in reverse if isinstance(r, WeightRenaming)]
    converters = [r for r in reverse if isinstance(r, WeightConverter)]

    def meta(names: list[str]) -> dict[str, torch.Tensor]:
        return {n: torch.empty(tensors[n].shape, dtype=tensors[n].dtype, device="meta") for n in names}

    layout = HubLayout(model=model)
    by_target: dict[str, list[str]] = {}
    for name in tensors:
        target, pattern = _first_match(name, converters)
        if pattern is None:
            for renaming in renamings:
                target, _ = renaming.rename_source_key(target)
            layout.renamed[target] = name
        else:
            by_target.setdefault(target, []).append(name)
    for inputs in by_target.values():
        out = _revert_on_meta(revert_weight_conversion, model, meta(inputs))
        layout.groups.append(ConvertedGroup(inputs, {n: TensorInfo(tuple(t.shape), t.dtype) for n, t in out.items()}))
    _check_against_transformers(layout, _revert_on_meta(revert_weight_conversion, model, meta(list(tensors))), tensors)
    layout.note = _describe(layout, type(model).__name__)
    return layout


def _first_match(name: str, converters: list[Any]) -> tuple[str, str | None]:
    """(the name the first converter matching `name` gives it, that converter's pattern), or
    (name, None): what saving does before the renamings. Written on the transforms' own
    `rename_source_key`, which every transformers 5 has (module-level helpers come and go)."""
    for converter in converters:
        target, pattern = converter.rename_source_key(name)
        if pattern is not None:
            return target, pattern
    return name, None


def _revert_on_meta(revert: Callable[..., dict[str, torch.Tensor]], model: Any,
                    state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    try:
        return revert(model, state)
    except Exception as e:  # noqa: BLE001 - any failure of a converter on meta tensors
        raise ValueError(f"transformers cannot plan the hub layout of {type(model).__name__} without reading the data "
                         f"({type(e).__name__}: {e}); pass --no-hub-layout (hub_layout=False) to export the names and "
                         "layouts the checkpoint holds, those of model.state_dict()") from None


def _check_against_transformers(layout: HubLayout, whole: dict[str, torch.Tensor],
                                tensors: Mapping[str, TensorInfo]) -> None:
    planned = {n: tensors[m].shape for n, m in layout.renamed.items()}
    for group in layout.groups:
        planned.update({n: info.shape for n, info in group.outputs.items()})
    expected = {n: tuple(t.shape) for n, t in whole.items()}
    if planned != expected:
        differ = sorted(set(planned) ^ set(expected)) or sorted(n for n in planned if planned[n] != expected[n])
        raise ValueError(f"the hub layout planned tensor by tensor differs from transformers' for the whole model "
                         f"({', '.join(differ[:8])}); pass --no-hub-layout (hub_layout=False) to export the names and "
                         "layouts the checkpoint holds, those of model.state_dict()")


def _describe(layout: HubLayout, model_class: str) -> str:
    renamed = [(m, n) for n, m in layout.renamed.items() if n != m]
    if not renamed and not layout.groups:
        return ""
    parts = []
    if renamed:
        examples = ", ".join(f"{m} -> {n}" for m, n in renamed[:_SHOWN])
        parts.append(f"renamed {len(renamed)} tensors (e.g. " + examples + ")")
    if layout.groups:
        inputs = sum(len(g.inputs) for g in layout.groups)
        outputs = sum(len(g.outputs) for g in layout.groups)
        first = layout.groups[0]
        parts.append(f"converted {inputs} tensors into {outputs} (e.g. {first.inputs[0]} -> "
                     f"{', '.join(list(first.outputs)[:2])}, ...)")
    return (f"wrote the hub's layout of {model_class}, as save_pretrained does: " + "; ".join(parts)
            + "; --no-hub-layout keeps the checkpoint's names")
