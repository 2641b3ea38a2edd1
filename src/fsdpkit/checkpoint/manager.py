"""The Checkpointer: what a training loop calls to resume and to save on its cadence."""

from __future__ import annotations

import datetime
import logging
import os
from pathlib import Path
from typing import Any

import torch.distributed as tdist

from fsdpkit.checkpoint.layout import MANIFEST, step_dir_name
from fsdpkit.checkpoint.manifest import model_fingerprint, optimizer_summary
from fsdpkit.checkpoint.resume import load_checkpoint, resolve_checkpoint
from fsdpkit.checkpoint.save import save_checkpoint
from fsdpkit.checkpoint.state import CheckpointTarget
from fsdpkit.config.schema import CheckpointConfig

log = logging.getLogger("fsdpkit.checkpoint")
# Test hook: comma-separated Stateful names (e.g. "scheduler,data") not restored on resume, to
# prove that `fsdpkit resume-check` catches state that a resume loses.
SKIP_RESTORE_ENV = "FSDPKIT_TEST_SKIP_RESTORE"


def checkpoint_group(timeout_s: float) -> tdist.ProcessGroup | None:
    """A dedicated gloo group with a bounded timeout for every collective around save and load.
    Collective: every rank calls it at the same point."""
    if not tdist.is_initialized():
        return None
    return tdist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))


class Checkpointer:
    """Saves `target` every `cfg.every_steps` steps and at the end; resumes from `cfg.resume`."""

    def __init__(self, cfg: CheckpointConfig, *, target: CheckpointTarget, group: tdist.ProcessGroup | None,
                 sharding: dict[str, Any], run_meta: dict[str, Any], state_dict_type: str = "sharded"):
        self.cfg, self.target, self.group = cfg, target, group
        self.state_dict_type = state_dict_type
        self.root = Path(cfg.dir)
        self.sharding, self.run_meta = sharding, run_meta
        self.last_saved_step: int | None = None

    def fingerprint(self) -> dict[str, Any]:
        return model_fingerprint(self.target.model, sharding=self.sharding)

    def resume_from(self, path: Path) -> dict[str, Any]:
        """Load `path` (already resolved on every rank) and log what happened."""
        model_only = self.cfg.resume_mode == "model_only"
        report = load_checkpoint(self.target, path, fingerprint=self.fingerprint(), group=self.group,
                                 model_only=model_only, verify=self.cfg.verify_on_load,
                                 skip=frozenset(filter(None, os.environ.get(SKIP_RESTORE_ENV, "").split(","))))
        manifest = report["manifest"]
        what = "model weights only (optimizer, schedule, counters and data start fresh)" if model_only else "full state"
        log.info("resumed %s from %s (step %d, saved on %d ranks) in %.2f s; post-load verification %.3f s",
                 what, path, manifest["step"], manifest["world_size"], report["load_s"], report["verify_s"])
        for note in report["notes"]:
            log.info("note: %s", note)
        if not model_only:
            self.last_saved_step = manifest["step"]
        return report

    def save(self, step: int) -> Path:
        path = self.root / step_dir_name(step)
        if (path / MANIFEST).is_file():
            log.info("checkpoint %s is already committed; not saving it again", path)
            return path
        meta = {
            **self.run_meta,
            "fingerprint": self.fingerprint(),
            "optimizer": optimizer_summary(self.target.optimizer, step=step),
        }
        manifest = save_checkpoint(self.target, ckpt_dir=path, step=step, meta=meta, group=self.group,
                                   thread_count=self.cfg.thread_count, state_dict_type=self.state_dict_type)
        self.last_saved_step = step
        if "timings" in manifest:
            t = manifest["timings"]
            log.info("saved %s: %.1f MiB over %d ranks in %.2f s (stage %.2f s, write %.2f s)", path,
                     sum(manifest["bytes_per_rank"]) / 2**20, manifest["world_size"], t["total_s"], t["stage_s"], t["write_s"])
        return path

    def after_step(self, step: int, *, last: bool) -> None:
        due = (self.cfg.every_steps and step % self.cfg.every_steps == 0) or (last and self.cfg.save_at_end)
        if due and self.last_saved_step != step:
            self.save(step)

    @staticmethod
    def resolve(cfg: CheckpointConfig, *, group: tdist.ProcessGroup | None) -> Path | None:
        return resolve_checkpoint(cfg.resume, ckpt_root=Path(cfg.dir), group=group,
                                  verify_checksums=cfg.verify_checksums)
