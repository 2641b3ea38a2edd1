"""The Checkpointer: fsdpkit's checkpoints for any FSDP2 training loop (fsdpkit's own trainer uses
exactly this class).

    ckpt = Checkpointer(dir, model=model, optimizer=opt, scheduler=sched, state={"data": loader_state},
                        every_steps=500, async_save=True, keep_last=3)
    start = ckpt.resume()                     # the newest intact committed checkpoint's step, or 0
    for step in range(start + 1, max_steps + 1):
        ...                                   # forward, backward, optimizer.step(), scheduler.step()
        if ckpt.step(step, metrics={"loss": loss}, last=step == max_steps):
            break                             # a preemption signal: the state is saved; exit (75)
    ckpt.close()                              # waits for the last save

The constructor and resume/step/save/close/on_exception are collective: every rank calls them, at
the same point (each method's docstring says). Its settings are a `CheckpointConfig` (settings.py:
the trainer's `checkpoint.*` group, see `fsdpkit config docs`), given whole (`settings=`) or as
keyword arguments, and an `IOSettings` (`io_settings=`; default: the FSDPKIT_* environment).

Everything a Checkpointer uses belongs to it: its settings (`cfg`, `io`), its storage options (they
travel with `root`, see storage/__init__.py), its local mirror (`mirror`, see storage/mirror.py),
its process groups and its retention, which it applies after each commit (retention.py). Two
Checkpointers in one process (a model and its EMA, a teacher and a student) share nothing; a
preemption signal, which reaches the process, is passed to both (preemption.py).
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as tdist
from torch import nn

from fsdpkit.checkpoint.async_save import AsyncSaver, SaveResult
from fsdpkit.checkpoint.catalog import step_dir_name
from fsdpkit.checkpoint.errors import CheckpointCorruptError, CheckpointError, CheckpointSaveError
from fsdpkit.checkpoint.find import Found, find_checkpoint
from fsdpkit.checkpoint.frozen import adoptable, sweep
from fsdpkit.checkpoint.layout import MANIFEST, ON_EXCEPTION, CkptPath
from fsdpkit.checkpoint.manifest import model_fingerprint, optimizer_summary, read_manifest
from fsdpkit.checkpoint.ownership import claim, new_run_id
from fsdpkit.checkpoint.preemption import EXIT_PREEMPTED, PreemptionHandler
from fsdpkit.checkpoint.resolve import resolve_checkpoint, set_aside
from fsdpkit.checkpoint.resume import LoadReport, load_checkpoint
from fsdpkit.checkpoint.retention import RetentionPolicy, apply_retention
from fsdpkit.checkpoint.save import FrozenShare, PlanCache, save_checkpoint
from fsdpkit.checkpoint.settings import CheckpointConfig, IOSettings, refuse_removed, validate_checkpoint
from fsdpkit.checkpoint.state import CheckpointTarget, as_stateful, capture_rng, restore_rng
from fsdpkit.checkpoint.storage import Lock, open_storage
from fsdpkit.checkpoint.storage.mirror import Mirror
from fsdpkit.dist import group_rank, on_main

log = logging.getLogger("fsdpkit.checkpoint")
METRICS_IN_MANIFEST = ("loss", "val_loss", "grad_norm")
_LAST_STEP = object()  # on_exception's default boundary: the last step passed to step()
__all__ = ["EXIT_PREEMPTED", "CheckpointGroups", "Checkpointer", "Resumed"]


def _gloo_group(timeout_s: float) -> tdist.ProcessGroup | None:
    if not tdist.is_initialized():
        return None
    return tdist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))


@dataclass
class CheckpointGroups:
    """Gloo groups, each with its own timeout, so that a dead or stuck rank fails a collective
    instead of hanging it: `sync` (saves, loads and the per-step agreement on the main thread),
    `background` (used only by the async save thread) and `agreement` (the on_exception vote)."""

    sync: tdist.ProcessGroup | None
    background: tdist.ProcessGroup | None
    agreement: tdist.ProcessGroup | None

    @classmethod
    def create(cls, cfg: CheckpointConfig) -> CheckpointGroups:
        """Collective: every rank calls it at the same point."""
        return cls(sync=_gloo_group(cfg.timeout_s),
                   background=_gloo_group(cfg.timeout_s) if cfg.async_save else None,
                   agreement=_gloo_group(cfg.exception_timeout_s) if cfg.on_exception else None)


@dataclass(frozen=True)
class Resumed:
    """What `Checkpointer.resume()` loaded (`ckpt.resumed`; None after a fresh start). `record()` is
    the `{"event": "resume", ...}` record handed to `on_event` (a line of fsdpkit's metrics.jsonl)."""

    step: int  # the step the checkpoint holds
    path: str  # the checkpoint read (checkpoint.local_dir's copy when `mirror_of` is set)
    load_s: float  # reading and restoring
    verify_s: float | None  # post-load verification; None: it did not run (verify_on_load=false)
    saved_world_size: int  # the world size the checkpoint was saved at
    mode: str  # resume_mode: "full", or "model_only" (weights only; resume() returned 0)
    notes: list[str] = field(default_factory=list)  # tolerated differences (see load checks)
    mirror_of: str | None = None  # the remote checkpoint whose local copy `path` is

    def record(self) -> dict[str, Any]:
        """The resume event as a JSON-able dict; `mirror_of` only when the local copy was read."""
        out = {"event": "resume", **asdict(self)}
        if self.mirror_of is None:
            del out["mirror_of"]
        return out


class Checkpointer:
    """Sharded, checksummed, atomically committed checkpoints of `model`, `optimizer`, `scheduler`
    and any `state` (dicts or Stateful objects, the same on every rank: a data loader's position,
    an EMA, counters), with async save, retention, preemption and on-exception saves.

    Collective: every rank constructs it, at the same point (unless `groups` are given, it
    creates gloo process groups, which every rank of the default group must join).

    Args:
        dir: the checkpoints root (step_<N>/ directories, `latest`): a local path or an fsspec URL.
        model: the FSDP2-sharded model (plain modules work too).
        optimizer: saved and restored with the model. None for a model without an optimizer of its
            own (an EMA copy, a frozen teacher): its checkpoints hold the model, the RNG and
            `state`, and their manifest records `"optimizer": null`. Resuming a checkpoint with
            optimizer state without an optimizer, or one without optimizer state with an optimizer,
            is refused (CheckpointMismatchError) unless resume_mode="model_only". With
            async_staging="background" and no optimizer, the copy blocks as with "blocking" (the
            background copy is guarded by the optimizer's step hook).
        scheduler: saved and restored with the model (optional).
        state: name -> dict or Stateful; JSON in the manifest, tensors in the DCP files.
        config: a JSON-able dict recorded in every manifest (e.g. your run's settings).
        sharding: how the model was sharded, recorded in the fingerprint (notes on change).
        mesh: the device mesh's description, recorded in the manifest.
        on_event: called with every `{"event": "checkpoint" | "resume", ...}` record.
        groups: gloo groups to use (default: created here, collectively).
        state_dict_type: `sharded` (DCP, every rank writes its shards) or `full` (rank 0 writes safetensors).
        settings: the settings (a `CheckpointConfig`; its `dir` is replaced by `dir`). Default: the
            defaults, with the keyword `**overrides`.
        io_settings: the I/O tunables (default: `IOSettings.from_environment()`, the FSDPKIT_* variables).
        optimizer_steps: every step passed to `step()` and `save()` is the number of optimizer
            updates made so far (true of fsdpkit's trainer): a load with verify_on_load then also
            checks the optimizer's step counts against the checkpoint's step.
        **overrides: `CheckpointConfig` fields by name, over `settings` (every_steps, every_minutes,
            save_at_end, resume, resume_mode, existing, async_save, async_staging, keep_last,
            keep_every, keep_best, keep_best_metric, keep_best_mode, verify_checksums, verify_on_load,
            timeout_s, exception_timeout_s, thread_count, share_frozen, on_exception, preemption_signals,
            storage_options, local_dir). They are this instance's alone: `storage_options` open its
            `dir` (and a `resume` URL), `local_dir` is its own mirror.
    Raises:
        ValueError: a setting is out of range (the message names it).
        TypeError: an override that is no setting.
    """

    def __init__(self, dir: str | os.PathLike, *, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 scheduler: Any = None, state: dict[str, Any] | None = None, config: dict[str, Any] | None = None,
                 sharding: dict[str, Any] | None = None, mesh: dict[str, Any] | None = None,
                 on_event: Callable[[dict[str, Any]], None] | None = None, groups: CheckpointGroups | None = None,
                 state_dict_type: str = "sharded", settings: CheckpointConfig | None = None,
                 io_settings: IOSettings | None = None, optimizer_steps: bool = False, **overrides: Any):
        self.cfg = _settings(dir, settings, overrides, state_dict_type=state_dict_type)
        self.io = io_settings or IOSettings.from_environment()
        self.root = open_storage(self.cfg.dir, self.cfg.storage_options)  # a RemotePath keeps the options
        self.mirror = Mirror.open(self.cfg.local_dir, root=self.root)  # None without checkpoint.local_dir
        self.target = CheckpointTarget(model=model, optimizer=optimizer, stateful=_stateful(scheduler, state))
        self.optimizer_steps = optimizer_steps
        self.groups = groups if groups is not None else CheckpointGroups.create(self.cfg)
        several_ranks = tdist.is_initialized() and tdist.get_world_size() > 1
        if self.cfg.async_save and self.groups.background is None and several_ranks:
            # the save thread would run its collectives on the default group, interleaved with
            # training's own: a hang, not an error
            raise ValueError("checkpoint.async_save needs CheckpointGroups with a background group, and the groups "
                             "given have none (they were created with async_save off): create them with "
                             "CheckpointGroups.create(cfg) from the same settings, or leave groups= out")
        self.group = self.groups.sync
        self.state_dict_type = state_dict_type
        self.sharding = sharding or {}
        self.run_meta = {**({"mesh": mesh} if mesh else {}), **({"config": config} if config else {})}
        self.on_event = on_event or (lambda record: None)
        c = self.cfg
        self.retention = RetentionPolicy(keep_last=c.keep_last, keep_every=c.keep_every, keep_best=c.keep_best,
                                         metric=c.keep_best_metric, mode=c.keep_best_mode)
        self.preemption = PreemptionHandler(c.preemption_signals)
        self.run_id: str | None = None  # set by resume(): this run's, or the resumed run's
        self.resumed: Resumed | None = None  # what resume() loaded, if it loaded a checkpoint
        self.last_saved_step: int | None = None
        self.lock: Lock | None = None
        self._last_step: int | None = None
        self._last_save_t = time.monotonic()
        self._fingerprint: dict[str, Any] | None = None
        self._mirror_of: tuple[CkptPath, CkptPath] | None = None  # (local copy, remote checkpoint) resumed from
        # DCP plans a save afresh only when the state's structure changed since the last (save.PlanCache)
        self._plans = PlanCache()
        # frozen weights written once (frozen.py); a mirror copies checkpoint directories alone
        shares = c.share_frozen and self.mirror is None and state_dict_type == "sharded"
        self._frozen = FrozenShare(self.root, io=self.io) if shares else None
        self._async = (AsyncSaver(group=self.groups.background, thread_count=c.thread_count, io=self.io,
                                  mirror=self.mirror, background_staging=c.async_staging == "background",
                                  plans=self._plans, frozen=self._frozen)
                       if c.async_save else None)

    @classmethod
    def from_config(cls, cfg: CheckpointConfig, **kwargs: Any) -> Checkpointer:
        """A Checkpointer with the settings `cfg` (fsdpkit's trainer: its `checkpoint.*` config), in
        `cfg.dir`. Collective, as the constructor."""
        return cls(cfg.dir, settings=cfg, **kwargs)

    def __enter__(self) -> Checkpointer:
        """Not collective: returns the Checkpointer."""
        return self

    def __exit__(self, kind, error, tb) -> None:
        """Collective, as `close()`: on an exception, `on_exception(error)` then `close(wait=False)`
        (among the ranks that can still take part); otherwise `close()`."""
        if isinstance(error, Exception):
            self.on_exception(error)
            self.close(wait=False)
        else:
            self.close()

    # -- resume -----------------------------------------------------------------------------
    def resume(self, found: Found | None = None) -> int:
        """Collective (every rank calls it), before the first step: find the checkpoint to resume
        from (per `resume`), claim the directory for this run (see ownership.py), load everything,
        verify it, and install the preemption handlers. What was loaded is then `self.resumed`
        (a `Resumed`; None after a fresh start).

        Args:
            found: what `find_checkpoint` found already (fsdpkit's trainer), else found here.
        Returns:
            The step to continue after (0: a fresh start; also 0 after a model_only load).
        Raises:
            CheckpointError: the directory belongs to another run, a named checkpoint is missing or
                corrupt, or the checkpoint does not fit the model or the optimizer (a
                CheckpointMismatchError; the message says what to do).
        """
        found = found or find_checkpoint(self.cfg, group=self.group, io_settings=self.io)
        self.lock = found.lock
        self._mirror_of = (found.path, found.mirror_of) if found.mirror_of is not None else None
        try:
            path = found.path
            manifest = read_manifest(path) if path is not None else None
            full = manifest is not None and self.cfg.resume_mode == "full"
            moved = self._claim(resumed=manifest if full else None, start=self._how_started(manifest))
            if path is not None:
                if str(path) in moved:  # archived out of this run's way (an explicit resume of it)
                    path = open_storage(moved[str(path)], self.cfg.storage_options)
                self._load_verified(path, while_loading=found.verify_while_loading)
        except BaseException:
            self.close(wait=False)
            raise
        self.preemption.install()
        if self.resumed is None or self.cfg.resume_mode == "model_only":
            return 0
        return self.resumed.step

    def _claim(self, *, resumed: dict[str, Any] | None, start: str) -> dict[str, str]:
        run_id = (resumed or {}).get("run_id") or new_run_id()

        def claim_directory() -> tuple[str, dict[str, str]]:
            lines, moved = claim(self.root, run_id=run_id, resumed=resumed, existing=self.cfg.existing, start=start)
            for line in lines:
                log.warning("%s", line)
            return run_id, moved

        self.run_id, moved = on_main(claim_directory, group=self.group, errors=(CheckpointError, OSError))
        log.info("run id %s; checkpoints in %s", self.run_id, self.root)
        return moved

    def _how_started(self, manifest: dict[str, Any] | None) -> str:
        if manifest is None:
            return ("a new run: resume=none" if self.cfg.resume == "none"
                    else f"a new run: resume={self.cfg.resume} found nothing to resume")
        if self.cfg.resume_mode == "model_only":
            return f"a new run: it loaded weights only from step {manifest['step']} (resume_mode=model_only)"
        return f"resumed from step {manifest['step']}"

    def fingerprint(self) -> dict[str, Any]:
        """Not collective: the model's fingerprint recorded in every manifest (tensor names,
        shapes and dtypes; vocabulary and tying; `sharding`), computed once."""
        if self._fingerprint is None:  # the model's structure never changes during a run
            self._fingerprint = model_fingerprint(self.target.model, sharding=self.sharding)
        return self._fingerprint

    def _load_verified(self, path: CkptPath, *, while_loading: bool) -> LoadReport:
        """Load `path`, its file checksums checked by the load itself if `while_loading` (each file
        read once where it can: resume.load_checkpoint). If that finds an auto-resumed checkpoint
        corrupt, the state holds part of it: set it aside and load the newest older checkpoint
        over all of it, as long as one is found corrupt in turn; the RNG state goes back to what it
        was first (a rank the older checkpoint has none for keeps its fresh seed, not the corrupt one's)."""
        fresh_rng = capture_rng() if while_loading and self.cfg.resume == "auto" else None
        tried: list[str] = []
        while True:
            try:
                return self._load(path, verify_files=while_loading)
            except CheckpointCorruptError as e:
                if fresh_rng is None:
                    raise
                why = str(e)
            if str(path.parent) == str(self.root):  # not checkpoint.local_dir's copy: the remote one may be intact
                tried.append(path.name)
            on_main(lambda path=path, why=why: set_aside(path, why), group=self.group,
                    errors=(CheckpointError, OSError))
            restore_rng(fresh_rng)
            older = resolve_checkpoint("auto", ckpt_root=self.root, group=self.group, verify_checksums=False,
                                       skip=tried, io=self.io)
            if older is None:
                raise CheckpointCorruptError(
                    f"{why}\n{', '.join(tried)} {'was' if len(tried) == 1 else 'were'} moved aside and no older "
                    "checkpoint passes verification; the state holds part of a corrupt checkpoint, and this run was "
                    "set up to resume (a loop may have skipped its model's initialization), so it stops here: run "
                    "again to start fresh")
            log.warning("loading the older checkpoint %s instead of %s", older.name, path.name)
            path = older

    def _load(self, path: CkptPath, *, verify_files: bool = False) -> LoadReport:
        model_only = self.cfg.resume_mode == "model_only"
        report = load_checkpoint(self.target, path, fingerprint=self.fingerprint(), group=self.group,
                                 model_only=model_only, verify=self.cfg.verify_on_load, verify_files=verify_files,
                                 optimizer_steps=self.optimizer_steps, io=self.io)
        manifest = report.manifest
        what = "model weights only (optimizer, schedule, counters and data start fresh)" if model_only else "full state"
        checked = ("restored state not verified (checkpoint.verify_on_load=false)" if report.verify_s is None
                   else f"post-load verification {report.verify_s:.3f} s")
        log.info("resumed %s from %s (step %d, saved on %d ranks) in %.2f s; %s",
                 what, path, manifest["step"], manifest["world_size"], report.load_s, checked)
        for note in report.notes:
            log.info("note: %s", note)
        if not model_only:
            self.last_saved_step = self._last_step = manifest["step"]
            if self._frozen is not None:  # keep referencing the frozen tensors the load just verified
                self._frozen.current = adoptable(path, manifest, self.root)
        from_mirror = self._mirror_of is not None and self._mirror_of[0] == path  # read from checkpoint.local_dir
        self.resumed = Resumed(step=manifest["step"], path=str(path), load_s=report.load_s, verify_s=report.verify_s,
                               saved_world_size=manifest["world_size"], mode=self.cfg.resume_mode, notes=report.notes,
                               mirror_of=str(self._mirror_of[1]) if from_mirror else None)
        self.on_event(self.resumed.record())
        return report

    # -- every step ---------------------------------------------------------------------------
    def local_flags(self) -> list[float]:
        """Not collective: this rank's view of what should happen at this step boundary — a
        preemption signal, the time cadence, a failed background save — to be summed over all
        ranks so that every rank acts at the same step. `step()` sums them itself; a loop that
        already all-reduces something every step can carry them and pass the sums as
        `step(..., agreed=)`."""
        preempted = self.preemption.received is not None
        time_due = self.cfg.every_minutes > 0 and time.monotonic() - self._last_save_t >= self.cfg.every_minutes * 60
        failed = self._async is not None and self._async.failed()
        return [float(preempted), float(time_due), float(failed)]

    def step(self, step: int, *, metrics: dict[str, Any] | None = None, last: bool = False,
             agreed: Sequence[float] | None = None) -> bool:
        """Collective (every rank calls it, at every step), after the optimizer update of `step`:
        save if the cadence (every_steps, every_minutes, save_at_end with `last`) or a preemption
        signal says so. Without `agreed` it all-reduces the ranks' `local_flags()` itself.

        Returns: True when a preemption signal reached any rank: the state at `step` is committed
        and the loop should stop (exit with EXIT_PREEMPTED, 75, to be restarted).
        Raises:
            CheckpointSaveError: a save failed on some rank (every rank raises it at this step).
        """
        if self.run_id is None:
            raise CheckpointError("Checkpointer.resume() must be called (on every rank) before the first step")
        self._last_step = step
        preempted, time_due, failed = agreed if agreed is not None else self._sum(self.local_flags())
        if failed:
            self._raise_background_failure()
        if self._async is not None and (done := self._async.collect_if_ok()) is not None:
            self._report(done)
        reason = ("preempted" if preempted else "end" if last and self.cfg.save_at_end
                  else "every_steps" if self.cfg.every_steps and step % self.cfg.every_steps == 0
                  else "every_minutes" if time_due else None)
        if reason is not None and self.last_saved_step != step:
            self.save(step, reason=reason, metrics=metrics, wait=bool(preempted))
        return bool(preempted)

    def _sum(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        if tdist.is_initialized() and tdist.get_world_size(self.group) > 1:
            tdist.all_reduce(t, group=self.group)
        return t.tolist()

    # -- saving -----------------------------------------------------------------------------
    def save(self, step: int, *, reason: str = "manual", metrics: dict[str, Any] | None = None,
             wait: bool = False) -> CkptPath:
        """Collective (every rank calls it, with the same `step`): save `step` now (in the
        background when async_save is on, unless `wait`). A committed checkpoint of the same step
        is replaced once the new one is committed. Each save is reported to `on_event` as a
        `{"event": "checkpoint", ...}` record once it is committed.

        Returns:
            The checkpoint's directory (committed on return unless the save runs in the background).
        Raises:
            CheckpointSaveError: this save (or the background one before it) failed on some rank.
        """
        if self.run_id is None:
            raise CheckpointError("Checkpointer.resume() must be called (on every rank) before the first save")
        path = self.root / step_dir_name(step)
        if (path / MANIFEST).is_file():
            log.warning("checkpoint %s is committed already; it is replaced once step %d is saved again", path, step)
        t0 = time.perf_counter()
        meta = self._meta(step, metrics) | {"reason": reason}
        self._last_save_t = time.monotonic()
        if self._async is not None:
            previous, running = self._async.save(self.target, ckpt_dir=path, step=step, meta=meta,
                                                 then=lambda: self._after_commit(path))
            running.reason, running.stall_s = reason, time.perf_counter() - t0  # the loop's whole wait
            if previous is not None:
                self._report(previous)
            if wait:
                self._report(self._async.wait())
        else:
            manifest = save_checkpoint(self.target, ckpt_dir=path, step=step, meta=meta, group=self.group,
                                       thread_count=self.cfg.thread_count, state_dict_type=self.state_dict_type,
                                       io=self.io, mirror=self.mirror, plans=self._plans, frozen=self._frozen)
            self._after_commit(path)
            stall = time.perf_counter() - t0
            self._report(SaveResult(step=step, path=path, mode="sync", reason=reason, stall_s=stall, manifest=manifest))
        self.last_saved_step = step
        return path

    def wait_staged(self) -> None:
        """Not collective: with `async_staging="background"`, block until the save in flight has
        copied the state. `optimizer.step()` does this itself; call it before changing the model's
        or the optimizer's state in place any other way while a save may be in flight. A no-op
        otherwise."""
        if self._async is not None:
            self._async.wait_staged()

    def close(self, *, wait: bool = True) -> None:
        """Collective with `wait` (every rank calls it: the save in flight commits with a barrier):
        wait for that save (its errors are raised here), then release the directory and the signal
        handlers. Not collective with `wait=False`, for after a failure: a peer may be gone, so
        nothing is waited for. Idempotent."""
        try:
            if self._async is not None and wait:
                done = self._async.wait()
                if done is not None:
                    self._report(done)
        finally:
            if self._async is not None and wait:
                self._async.close()
            if self._async is None or wait:  # no save in flight uses it any more
                self._plans.forget()
            self.preemption.uninstall()
            if self.lock is not None:
                self.lock.release()
                self.lock = None

    def on_exception(self, error: BaseException, *, boundary_step: Any = _LAST_STEP) -> None:
        """Collective among the ranks that can still take part (every live rank calls it; a rank
        that does not within exception_timeout_s means no save): save to on_exception/ if every
        rank is at the same consistent step boundary; otherwise say why not. Never raises: the
        caller re-raises `error` afterwards.

        Args:
            boundary_step: the step whose state the live objects hold, or None when the failure hit
                the optimizer update (the state is then half-updated and is not saved). Default:
                the last step passed to `step()` — right when the failure happened outside
                `optimizer.step()`.
        """
        if not self.cfg.on_exception or self.run_id is None:  # None: failed before the directory was claimed
            return
        if boundary_step is _LAST_STEP:
            if self._last_step is None:
                log.error("not saving on_exception: no step completed before %s", type(error).__name__)
                return
            boundary_step = self._last_step
        rank = group_rank()
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
                            thread_count=self.cfg.thread_count, state_dict_type=self.state_dict_type,
                            io=self.io, mirror=self.mirror)
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

    def _after_commit(self, committed: CkptPath) -> None:
        """Policy after a commit, on the save's own thread, every rank calling it (rank 0 acts):
        retention (retention.py), then the shared frozen tensors no checkpoint references, then the
        local mirror (storage/mirror.py). Nothing here fails the save that committed."""
        if group_rank(self.group) != 0:
            return
        try:
            apply_retention(self.root, self.retention, run_id=self.run_id, just_committed=committed)
            if self._frozen is not None and self.retention.active and self.run_id is not None:
                current = self._frozen.current
                sweep(self.root, run_id=self.run_id, in_use=current.dir if current is not None else None)
        except Exception as e:  # noqa: BLE001 - a failed deletion must not fail the save that just committed
            log.warning("retention: could not delete an old checkpoint: %s", e)
        if self.mirror is None:
            return
        try:
            self.mirror.publish(committed)
        except Exception as e:  # noqa: BLE001 - the remote copy is committed: the mirror is only a cache
            log.warning("checkpoint.local_dir: could not update the local copy of %s (a restart reads the "
                        "bucket): %s", committed, e)

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


def _settings(dir: str | os.PathLike, settings: CheckpointConfig | None, overrides: dict[str, Any], *,
              state_dict_type: str) -> CheckpointConfig:
    """`settings` (default: the defaults) with `dir` and the keyword `overrides`, validated."""
    known = {f.name for f in dataclasses.fields(CheckpointConfig)} - {"dir"}
    for name in overrides.keys() - known:
        refuse_removed(f"checkpoint.{name}", fix=f"leave {name}= out of Checkpointer(...)")
    if unknown := sorted(overrides.keys() - known):
        raise TypeError(f"Checkpointer got unknown setting(s) {unknown}; known: {sorted(known)}")
    if "preemption_signals" in overrides:
        overrides["preemption_signals"] = list(overrides["preemption_signals"])
    cfg = dataclasses.replace(settings or CheckpointConfig(), dir=str(dir), **overrides)
    validate_checkpoint(cfg, state_dict_type=state_dict_type)
    return cfg


def _stateful(scheduler: Any, state: dict[str, Any] | None) -> dict[str, Any]:
    """The Stateful pieces a checkpoint holds besides model and optimizer: the scheduler and `state`."""
    stateful = {"scheduler": as_stateful(scheduler, name="scheduler")} if scheduler is not None else {}
    for name, obj in (state or {}).items():
        if name in stateful:
            raise ValueError(f"checkpoint state {name!r} is taken by the scheduler; choose another name")
        stateful[name] = as_stateful(obj, name=name)
    return stateful


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
