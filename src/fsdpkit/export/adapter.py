"""Export of LoRA runs (`model.peft.method=lora`): the adapter alone, or the merged model.

- `export_adapter`: a PEFT adapter folder, `adapter_model.safetensors` (PEFT's names:
  `base_model.model.<module>.lora_A.weight`) and `adapter_config.json` (written by peft's own
  LoraConfig from the run's settings), that `peft.PeftModel.from_pretrained(base, OUT)` loads.
- `export_merged`: a Hugging Face folder with every adapted weight replaced by
  W + (alpha / r) * B @ A and the model's own names, loadable without peft. One tensor is held
  at a time (plus its A and B), so memory is bounded by the largest weight.

Both read the checkpoint with the streaming readers of fsdpkit.export.sources, check its files
like the plain export, and publish atomically (a temporary folder renamed into place).
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from fsdpkit import __version__
from fsdpkit.checkpoint.storage import fsync_path
from fsdpkit.export.destination import protected_paths
from fsdpkit.export.exporter import (
    _check_destination,
    _check_integrity,
    _out_dtype,
    _publish,
    parse_dtype,
)
from fsdpkit.export.hf_folder import write_folder_files
from fsdpkit.export.keys import model_weights
from fsdpkit.export.naming import drop_tied
from fsdpkit.export.safetensors_writer import StreamingSafetensorsWriter
from fsdpkit.export.sources import OpenedCheckpoint, open_checkpoint
from fsdpkit.hf.safetensors_reader import SINGLE_FILE
from fsdpkit.model.peft import ADAPTER, is_lora_name, lora_config, peft_base_name

ADAPTER_FILE, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"
PEFT_PREFIX = "base_model.model."
_ADAPTER_COMPONENT = re.compile(rf"\.lora_(A|B)\.{ADAPTER}\.")


def _peft_settings(opened: OpenedCheckpoint) -> Any:
    """The run's `model.peft` section as an object with attributes.

    Raises:
        ValueError: the checkpoint was not trained with LoRA (or carries no run config).
    """
    model_cfg = ((opened.manifest or {}).get("config") or {}).get("model") or {}
    peft_cfg = model_cfg.get("peft") or {}
    if peft_cfg.get("method", "none") != "lora":
        raise ValueError(f"{opened.path} was not trained with model.peft.method=lora (or is not an fsdpkit "
                         "checkpoint); --adapter and --merge need LoRA weights: use a plain `fsdpkit ckpt export`")
    return type("PeftSettings", (), dict(peft_cfg))


def is_lora_checkpoint(ckpt: str | os.PathLike) -> bool:
    """Whether `ckpt` is an fsdpkit checkpoint of a model.peft.method=lora run."""
    with open_checkpoint(ckpt) as opened:
        peft_cfg = ((((opened.manifest or {}).get("config") or {}).get("model") or {}).get("peft") or {})
        return peft_cfg.get("method", "none") == "lora"


def _model_names(opened: OpenedCheckpoint) -> dict[str, str]:
    return model_weights(list(opened.source.tensors()), key_paths=opened.source.key_paths, structured=True)


def _read(opened: OpenedCheckpoint, key: str) -> torch.Tensor:
    info = opened.source.tensors()[key]
    return opened.source.read_rows(key, 0, info.rows).reshape(info.shape)


def _write(tmp: Path, file: str, tensors: list[tuple[str, tuple[int, ...], torch.dtype, Any]]) -> None:
    """One safetensors file from (name, shape, dtype, thunk producing the tensor), one tensor in memory at a time."""
    writer = StreamingSafetensorsWriter(tmp / file, [(n, s, d) for n, s, d, _ in tensors],
                                        metadata={"format": "pt", "exported_by": f"fsdpkit {__version__}"})
    try:
        for name, _, dtype, produce in tensors:
            writer.write_tensor(name, [produce().to(dtype)])
    except BaseException:
        writer.abort()
        raise
    writer.close()


def _export(ckpt: str | os.PathLike, out: str | os.PathLike, *, overwrite: bool, verify: bool, fill,
            run_dirs: Sequence[str | os.PathLike] = ()) -> dict[str, Any]:
    out = Path(out)
    t0 = time.perf_counter()
    with open_checkpoint(ckpt) as opened:
        # the same rules as every export: never into the checkpoint, its root or the run
        _check_destination(out, fmt="hf", overwrite=overwrite,
                           protected=protected_paths(opened.path, run_dirs=[Path(d) for d in run_dirs]))
        _check_integrity(opened, verify=verify)
        settings = _peft_settings(opened)
        tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
        tmp.mkdir()
        try:
            report = fill(opened, settings, tmp)
            for file in (p for p in tmp.rglob("*") if p.is_file()):  # peft's and transformers' files too
                fsync_path(file)
            fsync_path(tmp)
            _publish(tmp, out, overwrite=overwrite)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return {"source": str(opened.path), "step": (opened.manifest or {}).get("step"), "out": str(out),
                "seconds": time.perf_counter() - t0, **report}


def export_adapter(ckpt: str | os.PathLike, out: str | os.PathLike, *, dtype: str | None = None,
                   base_model: str = "", overwrite: bool = False, verify: bool = False) -> dict[str, Any]:
    """Write the LoRA adapter of `ckpt` as a PEFT folder at `out`.

    Args:
        dtype: `bf16`, `fp16` or `fp32`; None keeps the stored fp32.
        base_model: recorded as `base_model_name_or_path` (default: the run's model.init_from folder).
    Raises:
        ValueError: not a LoRA checkpoint, bad options, or `out` exists without `overwrite`.
    """
    target = parse_dtype(dtype)

    def fill(opened: OpenedCheckpoint, settings: Any, tmp: Path) -> dict[str, Any]:
        infos = opened.source.tensors()
        names = {n: k for n, k in _model_names(opened).items() if is_lora_name(n)}
        tensors = [(PEFT_PREFIX + _ADAPTER_COMPONENT.sub(r".lora_\1.", n), infos[k].shape,
                    _out_dtype(infos[k].dtype, target),
                    lambda k=k: _read(opened, k)) for n, k in names.items()]
        _write(tmp, ADAPTER_FILE, tensors)
        config = lora_config(settings)
        config.base_model_name_or_path = base_model or _init_from(opened)
        config.task_type = "CAUSAL_LM"
        config.save_pretrained(str(tmp))
        return {"files": [ADAPTER_FILE, ADAPTER_CONFIG], "num_tensors": len(tensors)}

    return _export(ckpt, out, overwrite=overwrite, verify=verify, fill=fill)


def _init_from(opened: OpenedCheckpoint) -> str:
    """The folder the run's base model came from: model.path, else model.init_from's."""
    model_cfg = ((opened.manifest or {}).get("config") or {}).get("model") or {}
    return model_cfg.get("path") or (model_cfg.get("init_from") or "").removeprefix("hf:")


def _transposed_modules(opened: OpenedCheckpoint) -> set[str]:
    """Modules whose weight is stored [in, out] (GPT-2's Conv1D: peft's fan_in_fan_out), found in
    the model transformers builds from the run's config on the meta device; none for other runs."""
    model_cfg = ((opened.manifest or {}).get("config") or {}).get("model") or {}
    if model_cfg.get("kind") != "hf":
        return set()
    import transformers

    from fsdpkit.export.hf_config import transformers_config

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers_config(model_cfg))
    return {name for name, m in model.named_modules() if type(m).__name__ == "Conv1D"}


def export_merged(ckpt: str | os.PathLike, out: str | os.PathLike, *, dtype: str | None = None,
                  overwrite: bool = False, verify: bool = False, write_config: bool = True,
                  run_dirs: Sequence[str | os.PathLike] = ()) -> dict[str, Any]:
    """Write the model of a LoRA checkpoint with its adapters merged in, as a Hugging Face folder
    (model.safetensors, config.json, generation_config.json and the run's tokenizer, as the plain
    export writes them: fsdpkit.export.hf_folder) under the base model's own names.

    Raises:
        ValueError: not a LoRA checkpoint, bad options, or `out` exists without `overwrite`.
    """
    target = parse_dtype(dtype)

    def fill(opened: OpenedCheckpoint, settings: Any, tmp: Path) -> dict[str, Any]:
        infos = opened.source.tensors()
        names = _model_names(opened)
        scale = float(settings.alpha) / int(settings.r)
        base = {peft_base_name(n): k for n, k in names.items() if not is_lora_name(n)}
        dropped = drop_tied(base, opened, None)
        adapters = {n.split(".lora_", 1)[0]: None for n in names if is_lora_name(n)}
        transposed = _transposed_modules(opened) if adapters else set()

        def merged(name: str, key: str) -> torch.Tensor:
            w = _read(opened, key)
            module = name.removesuffix(".weight")
            if module not in adapters:
                return w
            a = _read(opened, names[f"{module}.lora_A.{ADAPTER}.weight"]).float()  # [r, in]
            b = _read(opened, names[f"{module}.lora_B.{ADAPTER}.weight"]).float()  # [out, r]
            delta = b @ a  # [out, in]
            return w.float() + scale * (delta.T if module in transposed else delta)

        out_dtypes = {n: _out_dtype(infos[k].dtype, target) for n, k in base.items()}
        tensors = [(n, infos[k].shape, out_dtypes[n], lambda n=n, k=k: merged(n, k)) for n, k in base.items()]
        _write(tmp, SINGLE_FILE, tensors)
        found = write_folder_files(tmp, opened, target=target, out_dtypes=out_dtypes, expected_model=None, out=out,
                                   write_config=write_config)
        return {"files": sorted(p.name for p in tmp.iterdir()), "num_tensors": len(tensors), "merged": len(adapters),
                "scale": scale, "dropped": dropped, "config": found.config if write_config else "",
                "added": found.added, "not_added": found.not_added}

    return _export(ckpt, out, overwrite=overwrite, verify=verify, fill=fill, run_dirs=run_dirs)
