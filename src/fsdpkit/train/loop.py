"""The training loop: one optimizer step over the global batch, evaluation, and `fit`."""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from fsdpkit import dist, watchdog
from fsdpkit.checkpoint.manager import Checkpointer
from fsdpkit.data import GlobalSampler, eval_micro_batches, rank_micro_batches
from fsdpkit.data.datasets import Dataset
from fsdpkit.diagnostics import (
    BACKWARD,
    BATCH_START,
    FORWARD,
    OPTIMIZER_STEP,
    Diagnostics,
    FSDPContractError,
)
from fsdpkit.train.loss import micro_batch_terms
from fsdpkit.train.metrics import MetricsLog, Progress, peak_memory_mib
from fsdpkit.train.optim import clip_grad_norm
from fsdpkit.train.stalled import FIRST_STEPS, nothing_trains_warning
from fsdpkit.train.state import TrainState


@dataclass
class Trainer:
    """Wires the pieces; `fit` runs the loop. Built by fsdpkit.train.run.build_trainer."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    sampler: GlobalSampler
    train_data: Dataset
    val_data: Dataset
    state: TrainState
    metrics: MetricsLog
    device: torch.device
    max_steps: int
    micro_batch_size: int
    grad_clip: float
    eval_every: int
    eval_samples: int
    progress: bool
    logger: logging.Logger
    diagnostics: Diagnostics = field(default_factory=Diagnostics.disabled)
    checkpointer: Checkpointer | None = None
    loss_chunk_tokens: int | None = 0
    """Tokens per chunk of the chunked loss (0: its default); None: the loss of the full logits."""
    stopped_by: str | None = None
    """Why fit stopped before max_steps or stop_at: a preemption signal's name."""

    def __post_init__(self) -> None:
        self._agreed: list[float] = []  # this step's summed boundary flags (see _local_flags)
        self._cursor_before: dict[str, Any] | None = None  # data cursor at the start of a step in progress
        self._updating = False  # inside the optimizer update: the state is no step boundary

    def stateful(self) -> dict[str, Any]:
        """The small Stateful pieces that must survive a restart, by name (model, optimizer and
        RNG are saved as tensors beside them)."""
        return {"train": self.state, "data": self.sampler, "scheduler": self.scheduler}

    def train_step(self) -> dict[str, float]:
        """One optimizer step over the next global batch; returns this step's metrics."""
        t0 = time.perf_counter()
        step = self.state.step + 1
        watchdog.doing(f"step {step}: forward/backward")
        mem = self.diagnostics.memory  # per-phase peaks of the first steps; no-ops afterwards
        mem.mark(BATCH_START)
        rank, ws = dist.rank(), dist.world_size()
        self._cursor_before = self.sampler.state_dict()
        global_batch = self.sampler.next_global_batch()
        micro = rank_micro_batches(global_batch, rank=rank, world_size=ws, micro_batch_size=self.micro_batch_size)
        # Trained targets in the whole global batch (every rank computes it from the data alone), so
        # the loss means the same at any world size and micro-batch split.
        global_tokens = max(1, self.train_data.target_count(global_batch))  # 1: a batch with nothing to train
        lr = self.scheduler.get_last_lr()[0]
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        aux_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        has_aux, aux_count = False, 0
        for i, indices in enumerate(micro):
            # Only the last micro-batch reduce-scatters; earlier ones accumulate locally. Every rank
            # has the same number of micro-batches, so every rank syncs on the same one.
            self.model.set_requires_gradient_sync(i == len(micro) - 1)
            # An empty micro-batch (a share shorter than the micro-batch count) still runs forward and
            # backward, since FSDP's collectives need every rank: on the global batch's first sample
            # (trained by another rank this step, so no input the model cannot take), its objective
            # multiplied by exactly 0: its gradients are zeros and it adds nothing.
            weight = 1.0 if indices else 0.0
            terms = micro_batch_terms(self.model, self.train_data, indices or global_batch[:1], device=self.device,
                                      chunk_tokens=self.loss_chunk_tokens)
            mem.mark(FORWARD)
            # MoE models add their router load-balancing term here (fsdpkit.train.loss explains the weighting)
            (terms.objective_sum() * weight / global_tokens).backward()
            mem.mark(BACKWARD)
            has_aux = has_aux or terms.aux is not None  # the same on every rank: it sizes the all-reduce
            if indices:
                loss_sum += terms.ce_sum.detach()
                if terms.aux is not None:
                    aux_sum += terms.aux.detach()
                    aux_count += 1
        watchdog.doing(f"step {step}: grad clipping and optimizer update")
        grad_norm = clip_grad_norm(self.model.parameters(), self.grad_clip)  # skips params without grads
        self.diagnostics.check_grad_norm(grad_norm, parameters=self.model.parameters(), max_norm=self.grad_clip)
        self._updating = True
        self.optimizer.step()
        mem.mark(OPTIMIZER_STEP)
        self.scheduler.step()
        self.state.step += 1
        self.state.tokens_seen += global_tokens
        self._updating, self._cursor_before = False, None  # a step boundary again
        self.optimizer.zero_grad(set_to_none=True)
        # One all-reduce per step carries the loss and the flags every rank must agree on
        # (preemption, checkpoint cadence by time, a failed background save: Checkpointer.local_flags).
        watchdog.doing(f"step {step}: end-of-step all-reduce")
        # The aux pair rides along only for models with an aux term; its count is of non-empty micro-batches.
        # The gradient norm is already global: read back with the sums (one device sync per step), not summed.
        aux = [aux_sum, aux_count] if has_aux else []
        total, *reduced, grad_norm = dist.all_reduce_sum([loss_sum, *aux, *self._local_flags()], device=self.device,
                                                         fetch=[grad_norm])
        aux_total, aux_count = reduced[:len(aux)] if aux else (None, None)
        self._agreed = reduced[len(aux):]
        dt = time.perf_counter() - t0
        return {
            "step": self.state.step,
            "loss": total / global_tokens,  # the cross-entropy alone, also for MoE models
            # the router load-balancing loss, unweighted, averaged over micro-batches and ranks
            **({"aux_loss": aux_total / aux_count} if aux else {}),
            "grad_norm": grad_norm,
            "lr": lr,
            "tokens_per_s": global_tokens / dt,
            "step_time_s": dt,
            "tokens_seen": self.state.tokens_seen,
            # the phase marks reset the peak counters: their own peaks count too
            "peak_mem_mib": max(peak_memory_mib(self.device), mem.observed_peak_mib),
        }

    def _local_flags(self) -> list[float]:
        return self.checkpointer.local_flags() if self.checkpointer is not None else []

    def boundary_step(self) -> int | None:
        """After a failure: the step whose state the live objects hold, or None when the failure hit
        the optimizer update (model and optimizer half-updated). A step that failed before its
        update gives its batch back to the data cursor."""
        if self._updating:
            return None
        if self._cursor_before is not None:
            self.sampler.load_state_dict(self._cursor_before)
            self._cursor_before = None
        return self.state.step

    @torch.no_grad()
    def evaluate(self) -> float:
        """Token-weighted loss over the first `eval_samples` held-out samples, the same samples at
        any world size. Every rank runs the same number of forwards (FSDP needs all ranks)."""
        watchdog.doing(f"step {self.state.step}: evaluating")
        n = min(self.eval_samples, len(self.val_data))
        chunks = eval_micro_batches(n, rank=dist.rank(), world_size=dist.world_size(),
                                    micro_batch_size=self.micro_batch_size)
        loss_sum, tokens = 0.0, 0
        for indices in chunks:
            loss = micro_batch_terms(self.model, self.val_data, indices or [0], device=self.device,
                                     chunk_tokens=self.loss_chunk_tokens).ce_sum
            if indices:  # an empty slot only keeps this rank in step with the others
                loss_sum += float(loss)
                tokens += self.val_data.target_count(indices)
        # The root keeps its params unsharded after a forward with no backward: reshard so the
        # next step all-gathers the freshly updated shards.
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
        total, count = dist.all_reduce_sum([loss_sum, tokens], device=self.device)
        return total / max(count, 1)

    def fit(self, *, stop_at: int | None = None) -> dict[str, Any]:
        """Train until max_steps (or until step `stop_at`, as an interruption would), evaluating
        every eval_every steps and at the end, saving on the checkpointer's cadence."""
        start, wall0 = self.state.step, time.perf_counter()
        end = self.max_steps if stop_at is None else min(stop_at, self.max_steps)
        progress = Progress(total=self.max_steps, start=start, enabled=self.progress)
        records: list[dict[str, float]] = []
        val_loss = None
        try:
            while self.state.step < end:
                watchdog.step_started()
                record = self.train_step()
                self.diagnostics.after_step(last=self.state.step >= end)
                last = self.state.step == self.max_steps  # not at stop_at: an interruption is not the end
                if self.eval_samples and (last or (self.eval_every and self.state.step % self.eval_every == 0)):
                    val_loss = record["val_loss"] = self.evaluate()
                    self.logger.info("step %d  val_loss %.4f", self.state.step, val_loss)
                self.metrics.step(record, quiet=progress.active)
                if self.checkpointer is not None:
                    watchdog.doing(f"step {self.state.step}: checkpoint cadence (a save if one is due)")
                preempted = self.checkpointer is not None and self.checkpointer.step(
                    self.state.step, metrics=record, last=last, agreed=self._agreed)
                watchdog.step_finished()
                progress.update(self.state.step, f"loss {record['loss']:.4f}")
                records.append(record)
                if len(records) == FIRST_STEPS and dist.is_main() and (why := nothing_trains_warning(records)):
                    self.logger.warning("%s", why)
                if preempted:
                    got = self.checkpointer.preemption.received
                    self.stopped_by = got.name if got is not None else "a preemption signal on another rank"
                    self.logger.warning("stopped at step %d after %s; the checkpoint is committed", self.state.step,
                                        self.stopped_by)
                    break
            if self.checkpointer is not None:
                watchdog.doing("finishing: waiting for the background save")
                self.checkpointer.close()  # waits for the last save
        except Exception as e:
            # One line that names the rank that stopped answering (if one did) and what every
            # rank was doing; before on_exception, whose own wait may end the job first.
            watchdog.doing(f"failed at step {self.state.step}: {type(e).__name__}")
            watchdog.log_stuck_ranks(e)
            # A set-up mistake found by the diagnostics is no state worth saving.
            if self.checkpointer is not None and not isinstance(e, FSDPContractError):
                self.checkpointer.on_exception(e, boundary_step=self.boundary_step())
            if self.checkpointer is not None:
                self.checkpointer.close(wait=False)  # the run is over: release the directory and signals
            raise
        finally:
            progress.close()
            self.diagnostics.close()
        summary = summarize(records, val_loss=val_loss, wall_s=time.perf_counter() - wall0)
        if self.stopped_by:
            summary["stopped_by"] = self.stopped_by
        return summary


def summarize(records: list[dict[str, float]], *, val_loss: float | None, wall_s: float) -> dict[str, Any]:
    if not records:
        return {"steps": 0, "wall_s": wall_s}
    steady = [r["tokens_per_s"] for r in records[1:]] or [records[0]["tokens_per_s"]]
    return {
        "steps": len(records),
        "first_step": records[0]["step"],
        "last_step": records[-1]["step"],
        "first_loss": records[0]["loss"],
        "last_loss": records[-1]["loss"],
        "val_loss": val_loss,
        "median_tokens_per_s": statistics.median(steady),
        "peak_mem_mib": max(r["peak_mem_mib"] for r in records),
        "wall_s": wall_s,
    }


