"""The Checkpointer: what a training loop calls to resume, to save on its cadence (synchronously
or in the background), to save when preempted, and to save when it fails."""

from __future__ import annotations

import datetime
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist

from fsdpkit.checkpoint.async_save import AsyncSaver, SaveResult
from fsdpkit.checkpoint.errors import CheckpointError, CheckpointSaveError
from fsdpkit.checkpoint.layout import MANIFEST, ON_EXCEPTION, step_dir_name
from fsdpkit.checkpoint.manifest import model_fingerprint, optimizer_summary
from fsdpkit.checkpoint.ownership import DirectoryLock, claim, new_run_id
from fsdpkit.checkpoint.resume import load_checkpoint, resolve_checkpoint
from fsdpkit.checkpoint.retention import RetentionPolicy, apply_retention
from fsdpkit.checkpoint.save import save_checkpoint
from fsdpkit.checkpoint.state import CheckpointTarget
from fsdpkit.config.schema import CheckpointConfig
from fsdpkit.dist import on_main

log = logging.getLogger("fsdpkit.checkpoint")
# Test hook: comma-separated Stateful names (e.g. "scheduler,data") not restored on resume, to
# prove that `fsdpkit resume-check` catches state that a resume loses.
SKIP_RESTORE_ENV = "FSDPKIT_TEST_SKIP_RESTORE"
METRICS_IN_MANIFEST = ("loss", "val_loss", "grad_norm")


def _gloo_group(timeout_s: float) -> tdist.ProcessGroup | None:
    if not tdist.is_initialized():
        return None
    return tdist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))


@dataclass
class CheckpointGroups:
    """Gloo groups, each with its own timeout, so that a dead or stuck rank fails a collective
    instead of hanging it: `sync` (saves and loads on the main thread), `background` (used only by
    the async save thread) and `agreement` (the on_exception vote)."""

    sync: tdist.ProcessGroup | None
    background: tdist.ProcessGroup | None
    agreement: tdist.ProcessGroup | None

    @classmethod
    def create(cls, cfg: CheckpointConfig) -> CheckpointGroups:
        """Collective: every rank calls it at the same point."""
        return cls(sync=_gloo_group(cfg.timeout_s),
                   background=_gloo_group(cfg.timeout_s) if cfg.async_save else None,
                   agreement=_gloo_group(cfg.exception_timeout_s) if cfg.on_exception else None)


class Checkpointer:
    """Saves `target` on the configured cadence and at the end; resumes from `cfg.resume`.

    `lock` is rank 0's hold on the directory (`lock_directory`), released by `close()`/`finish()`."""

    def __init__(self, cfg: CheckpointConfig, *, target: CheckpointTarget, groups: CheckpointGroups,
                 sharding: dict[str, Any], run_meta: dict[str, Any], state_dict_type: str = "sharded",
                 on_event: Callable[[dict[str, Any]], None] | None = None, lock: DirectoryLock | None = None):
        self.cfg, self.target, self.groups = cfg, target, groups
        self.group = groups.sync
        self.state_dict_type = state_dict_type
        self.root = Path(cfg.dir)
        self.sharding, self.run_meta = sharding, run_meta
        self.on_event = on_event or (lambda record: None)
        self.retention = RetentionPolicy(keep_last=cfg.keep_last, keep_every=cfg.keep_every, keep_best=cfg.keep_best,
                                         metric=cfg.keep_best_metric, mode=cfg.keep_best_mode)
        self.last_saved_step: int | None = None
        self.run_id: str | None = None  # set by open(): this run's, or the resumed run's
        self.lock = lock
        self._last_save_t = time.monotonic()
        self._fingerprint: dict[str, Any] | None = None
        self._async = AsyncSaver(group=groups.background, thread_count=cfg.thread_count) if cfg.async_save else None

    # -- the directory --------------------------------------------------------------------------
    def open(self, *, resumed: dict[str, Any] | None, start: str) -> dict[str, str]:
        """Collective, before the first step and before loading: claim the directory for this run
        (see ownership.py). Every rank raises the same CheckpointError if rank 0 cannot.

        Args:
            resumed: the manifest of a full resume (this run continues that run), else None.
            start: how the run started, for messages.
        Returns: where checkpoints that were moved out of the way went ({old path: new path}).
        """
        run_id = (resumed or {}).get("run_id") or new_run_id()

        def claim_directory() -> tuple[str, dict[str, str]]:
            lines, moved = claim(self.root, run_id=run_id, resumed=resumed, existing=self.cfg.existing, start=start)
            for line in lines:
                log.warning("%s", line)
            return run_id, moved

        try:
            self.run_id, moved = on_main(claim_directory, group=self.group, errors=(CheckpointError, OSError))
        except BaseException:
            self.close()
            raise
        log.info("run id %s; checkpoints in %s", self.run_id, self.root)
        return moved

    def close(self) -> None:
        """Release the directory (the lock); idempotent."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    # -- resume -----------------------------------------------------------------------------
    def fingerprint(self) -> dict[str, Any]:
        if self._fingerprint is None:  # the model's structure never changes during a run
            self._fingerprint = model_fingerprint(self.target.model, sharding=self.sharding)
        return self._fingerprint

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
        self.on_event({"event": "resume", "step": manifest["step"], "path": str(path), "load_s": report["load_s"],
                       "saved_world_size": manifest["world_size"], "mode": self.cfg.resume_mode})
        return report

    @staticmethod
    def resolve(cfg: CheckpointConfig, *, group: tdist.ProcessGroup | None) -> Path | None:
        return resolve_checkpoint(cfg.resume, ckpt_root=Path(cfg.dir), group=group,
                                  verify_checksums=cfg.verify_checksums)

    # -- saving -----------------------------------------------------------------------------
    def local_flags(self) -> list[float]:
        """This rank's view of what should happen at this step boundary, to be summed over all
        ranks in the step's one all-reduce, so that every rank acts at the same step."""
        time_due = self.cfg.every_minutes > 0 and time.monotonic() - self._last_save_t >= self.cfg.every_minutes * 60
        failed = self._async is not None and self._async.failed()
        return [float(time_due), float(failed)]

    def after_step(self, step: int, *, last: bool, metrics: dict[str, Any], agreed: list[float],
                   preempted: bool = False) -> None:
        """Called by every rank at every step boundary with the summed `local_flags()`."""
        time_due, failed = agreed
        if failed:
            self._raise_background_failure()
        if self._async is not None and (done := self._async.collect_if_ok()) is not None:
            self._report(done)
        reason = ("preempted" if preempted else "end" if last and self.cfg.save_at_end
                  else "every_steps" if self.cfg.every_steps and step % self.cfg.every_steps == 0
                  else "every_minutes" if time_due else None)
        if reason is None or self.last_saved_step == step:
            return
        self.save(step, reason=reason, metrics=metrics, wait=preempted)

    def save(self, step: int, *, reason: str = "manual", metrics: dict[str, Any] | None = None,
             wait: bool = False) -> Path:
        """Save `step`: in the background when async_save is on (unless `wait`), else now. A
        committed checkpoint of the same step is replaced once the new one is committed."""
        if self.run_id is None:
            raise CheckpointError("Checkpointer.open() must be called before the first save")
        path = self.root / step_dir_name(step)
        if (path / MANIFEST).is_file():
            log.warning("checkpoint %s is committed already; it is replaced once step %d is saved again", path, step)
        t0 = time.perf_counter()
        meta = self._meta(step, metrics) | {"reason": reason}
        self._last_save_t = time.monotonic()
        if self._async is not None:
            previous, running = self._async.save(self.target, ckpt_dir=path, step=step, meta=meta,
                                                 on_commit=self._retain)
            running.reason, running.stall_s = reason, time.perf_counter() - t0  # the loop's whole wait
            if previous is not None:
                self._report(previous)
            if wait:
                self._report(self._async.wait())
        else:
            manifest = save_checkpoint(self.target, ckpt_dir=path, step=step, meta=meta, group=self.group,
                                       thread_count=self.cfg.thread_count, state_dict_type=self.state_dict_type,
                                       on_commit=self._retain)
            stall = time.perf_counter() - t0
            self._report(SaveResult(step=step, path=path, mode="sync", reason=reason, stall_s=stall, manifest=manifest))
        self.last_saved_step = step
        return path

    def finish(self) -> None:
        """Wait for the save in flight (the run's end): its errors are raised here."""
        try:
            if self._async is not None:
                try:
                    done = self._async.wait()
                finally:
                    self._async.close()
                if done is not None:
                    self._report(done)
        finally:
            self.close()

    def on_exception(self, error: BaseException, *, boundary_step: int | None) -> None:
        """Save to on_exception/ if every rank is at the same consistent step boundary and can take
        part; otherwise say why not. Never raises: the caller re-raises `error` afterwards."""
        if not self.cfg.on_exception or self.run_id is None:  # None: failed before the directory was claimed
            return
        rank = tdist.get_rank() if tdist.is_initialized() else 0
        log.error("rank %d: training failed with %s: %s; checking whether every rank can save on_exception",
                  rank, type(error).__name__, error)
        try:
            step = _agree_on_step(boundary_step, group=self.groups.agreement)
        except Exception as e:  # noqa: BLE001 - a timeout or a lost peer: no save, and say so
            log.error("not saving on_exception: not every rank took part within checkpoint.exception_timeout_s=%s s "
                      "(%s); the original error follows", self.cfg.exception_timeout_s, str(e).splitlines()[0])
            return
        if step is None:
            log.error("not saving on_exception: the ranks are not all at the same step boundary (one failed in the "
                      "middle of an optimizer update, or they disagree on the step); the original error follows")
            return
        try:
            if self._async is not None:
                self._async.wait()  # at most one save in flight; its own failure is logged below
        except Exception as e:  # noqa: BLE001
            log.error("the background save in flight failed too: %s", e)
        try:
            path = self.root / ON_EXCEPTION
            meta = self._meta(step, None) | {"reason": "exception", "exception": f"{type(error).__name__}: {error}"}
            save_checkpoint(self.target, ckpt_dir=path, step=step, meta=meta, group=self.group,
                            thread_count=self.cfg.thread_count, state_dict_type=self.state_dict_type)
            log.error("saved the state at step %d to %s; the original error follows", step, path)
        except Exception as e:  # noqa: BLE001
            log.error("saving on_exception failed (%s); the original error follows", e)

    # -- internals ----------------------------------------------------------------------------
    def _meta(self, step: int, metrics: dict[str, Any] | None) -> dict[str, Any]:
        return {
            **self.run_meta,
            "run_id": self.run_id,
            "fingerprint": self.fingerprint(),
            "optimizer": optimizer_summary(self.target.optimizer, step=step),
            "metrics": {k: metrics[k] for k in METRICS_IN_MANIFEST if metrics and k in metrics},
        }

    def _retain(self, committed: Path) -> None:
        """Rank 0, right after a commit (on the save's own thread)."""
        try:
            apply_retention(self.root, self.retention, run_id=self.run_id, just_committed=committed)
        except Exception as e:  # noqa: BLE001 - a failed deletion must not fail the save that just committed
            log.warning("retention: could not delete an old checkpoint: %s", e)

    def _raise_background_failure(self) -> None:
        assert self._async is not None
        step = self._async.in_flight.step if self._async.in_flight else None
        try:
            self._async.wait()
        except Exception as e:  # noqa: BLE001
            raise CheckpointSaveError(f"the background save of step {step} failed: {e}; the previous checkpoint "
                                      "stays latest. Fix the cause (disk space, permissions, a lost rank) and "
                                      "resume") from e
        raise CheckpointSaveError(f"the background save of step {step} failed on another rank; the previous "
                                  "checkpoint stays latest")

    def _report(self, result: SaveResult) -> None:
        per_rank = result.bytes_per_rank
        total = sum(per_rank)
        busy = result.stall_s + result.background_s
        record = {
            "event": "checkpoint", "step": result.step, "path": str(result.path), "mode": result.mode,
            "reason": result.reason, "stall_s": result.stall_s, "wait_s": result.wait_s,
            "background_s": result.background_s, "bytes_total": total, "bytes_per_rank": per_rank,
            "throughput_gbps": total / busy / 1e9 if busy else None,
        }
        if per_rank:  # rank 0 has the manifest's figures
            log.info("checkpoint %s (%s, %s): %.1f MiB per rank, stall %.3f s, background %.2f s, %.2f GB/s",
                     result.path.name, result.mode, result.reason, max(per_rank) / 2**20, result.stall_s,
                     result.background_s, record["throughput_gbps"] or 0.0)
        self.on_event(record)


def lock_directory(cfg: CheckpointConfig, *, group: tdist.ProcessGroup | None) -> DirectoryLock | None:
    """Collective: rank 0 creates and locks `cfg.dir` for this run's life (returned to rank 0,
    None elsewhere). Every rank raises the same CheckpointError if it is in use or not writable."""
    held: list[DirectoryLock] = []

    def acquire() -> None:
        root = Path(cfg.dir)
        root.mkdir(parents=True, exist_ok=True)
        held.append(DirectoryLock(root).acquire())

    on_main(acquire, group=group, errors=(CheckpointError, OSError))
    return held[0] if held else None


def _agree_on_step(step: int | None, *, group: tdist.ProcessGroup | None) -> int | None:
    """The common step if every rank reports the same consistent boundary, else None. Raises
    when a rank does not take part within the group's timeout."""
    if not tdist.is_initialized() or tdist.get_world_size(group) == 1:
        return step
    ok = step is not None
    vec = torch.tensor([int(ok), step if ok else 0, -(step if ok else 0)], dtype=torch.int64)
    tdist.all_reduce(vec, op=tdist.ReduceOp.MIN, group=group)
    all_ok, low, high = int(vec[0]), int(vec[1]), -int(vec[2])
    return low if all_ok and low == high else None
