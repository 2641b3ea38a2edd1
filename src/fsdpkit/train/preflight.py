"""Checks made before a run builds anything: the directories it will write must be usable, and a
model that cannot keep packed documents apart is not given packed samples.

A run that fails them stops before the first step with one message naming the setting, instead
of a traceback from deep inside the first save (or an hour later, at the first checkpoint).
"""

from __future__ import annotations

import os
import tempfile
import uuid
from pathlib import Path

from fsdpkit.checkpoint.storage import RemotePath, open_storage
from fsdpkit.config import Config
from fsdpkit.export.destination import check_no_overlap, check_replaceable, protected_paths


def _writable_dir(path: Path, *, setting: str) -> None:
    """Create `path` if needed and prove a file can be written, fsynced and removed in it."""
    if path.exists() and not path.is_dir():
        raise ValueError(f"{setting}={path} is an existing file, not a directory; choose another {setting} "
                         "(fsdpkit never replaces a file it did not write)")
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".fsdpkit-write-test-", dir=path)
        try:
            os.write(fd, b"ok")
            os.fsync(fd)
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as e:
        where = f" ({e.filename})" if e.filename and str(e.filename) != str(path) else ""
        raise ValueError(f"{setting}={path} cannot be written: {e.strerror or e}{where}. Point {setting} at a "
                         "writable directory (a read-only mount, a missing permission or a file in the path "
                         "stops every save)") from None


def _writable_prefix(root: RemotePath, *, setting: str) -> None:
    """Prove an object can be written and deleted under `root` (credentials, endpoint, bucket)."""
    probe = root / f".fsdpkit-write-test-{uuid.uuid4().hex}"
    try:
        probe.write_bytes(b"ok")
        probe.unlink()
    except Exception as e:  # noqa: BLE001 - any client error (no credentials, no bucket, no endpoint) says the same
        raise ValueError(f"{setting}={root} cannot be written: {type(e).__name__}: {e}. Check the bucket name, the "
                         "credentials (AWS_* environment, profile) and the endpoint (AWS_ENDPOINT_URL or "
                         "checkpoint.storage_options.endpoint_url)") from None


def check_directories(cfg: Config) -> None:
    """Raise ValueError when run_dir or checkpoint.dir cannot be created and written, or when
    export.on_finish would be refused at the end (export.dir overlaps the checkpoints, or holds
    something that is not an earlier export)."""
    _writable_dir(Path(cfg.run_dir), setting="run_dir")
    ckpt_root = open_storage(cfg.checkpoint.dir, cfg.checkpoint.storage_options)
    if isinstance(ckpt_root, RemotePath):
        _writable_prefix(ckpt_root, setting="checkpoint.dir")
    else:
        _writable_dir(ckpt_root, setting="checkpoint.dir")
    # export.on_finish uploads with checkpoint.storage_options (run.export_final): probe with them too
    out = open_storage(cfg.export.dir, cfg.checkpoint.storage_options) if cfg.export.on_finish else None
    if isinstance(out, RemotePath):
        from fsdpkit.export.remote_destination import check_destination

        _writable_prefix(out, setting="export.dir")
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
