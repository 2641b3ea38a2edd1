"""Checks made before a run builds anything: the directories it will write must be usable, and a
model that cannot keep packed documents apart is not given packed samples.

A run that fails them stops before the first step with one message naming the setting, instead
of a traceback from deep inside the first save (or an hour later, at the first checkpoint).
"""

from __future__ import annotations

from pathlib import Path

from fsdpkit.checkpoint.storage import is_url, open_storage
from fsdpkit.config import Config
from fsdpkit.export.destination import check_no_overlap, check_replaceable, protected_paths


def check_directories(cfg: Config) -> None:
    """Raise ValueError when run_dir or checkpoint.dir cannot be created and written, or when
    export.on_finish would be refused at the end (export.dir overlaps the checkpoints, or holds
    something that is not an earlier export)."""
    open_storage(cfg.run_dir).check_writable(setting="run_dir")
    open_storage(cfg.checkpoint.dir, cfg.checkpoint.storage_options).check_writable(setting="checkpoint.dir")
    if cfg.export.on_finish and is_url(cfg.export.dir):
        from fsdpkit.export.remote_destination import check_destination

        # export.on_finish uploads with checkpoint.storage_options (run.export_final): probe with them too
        out = open_storage(cfg.export.dir, cfg.checkpoint.storage_options)
        out.check_writable(setting="export.dir")
        try:
            check_destination(out, fmt=cfg.export.format, overwrite=True, source=cfg.checkpoint.dir)
        except ValueError as e:
            raise ValueError(f"export.dir={out} (export.on_finish): {e}") from None
    elif cfg.export.on_finish:
        out = Path(cfg.export.dir)
        try:
            check_no_overlap(out, protected_paths(Path(cfg.checkpoint.dir) / "step_0", run_dirs=[Path(cfg.run_dir)]))
            check_replaceable(out, overwrite=True)
        except ValueError as e:
            raise ValueError(f"export.dir={out} (export.on_finish): {e}") from None


def packs_documents(cfg: Config) -> bool:
    """Whether the run's samples pack several documents, each to be kept apart (data.packing=true)."""
    return cfg.data.kind == "hf" and str(cfg.data.packing).lower() == "true"


def check_packing(cfg: Config) -> None:
    """Refuse data.packing=true for a model with layers that carry state across tokens outside
    attention (fsdpkit.model.isolation), reading the model built on the meta device (nothing is
    allocated). A no-op unless the run packs documents.

    Raises:
        ValueError: naming the model, the layers and the alternatives.
    """
    if not packs_documents(cfg):
        return
    import torch

    from fsdpkit.hf.build import build_model
    from fsdpkit.model.isolation import packing_refusal

    with torch.device("meta"):
        model = build_model(cfg.model)
    if why := packing_refusal(model):
        raise ValueError(why)
