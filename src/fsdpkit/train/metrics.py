"""Per-step metrics: metrics.jsonl in the run directory, a live display on rank 0, memory."""

from __future__ import annotations

import json
import logging
import resource
import sys
from pathlib import Path
from typing import Any

import torch

from fsdpkit import dist
from fsdpkit.diagnostics import TensorBoardWriter
from fsdpkit.diagnostics.runlog import METRICS_FILE  # one name for the writer and the readers


def peak_memory_mib(device: torch.device) -> float:
    """CUDA: peak allocated since the last reset. CPU: the process's peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def read_records(run_dir: Path, *, events: bool = False) -> list[dict[str, Any]]:
    """metrics.jsonl in file order: the step records, or (events=True) the event records
    (checkpoint saves, resumes), which carry an "event" key."""
    records = [json.loads(line) for line in (run_dir / METRICS_FILE).read_text().splitlines() if line.strip()]
    return [r for r in records if ("event" in r) == events]


class MetricsLog:
    """Appends one JSON object per step or event to metrics.jsonl (rank 0 only) and logs a summary line."""

    def __init__(self, run_dir: Path, *, logger: logging.Logger, log_every: int,
                 tensorboard: TensorBoardWriter | None = None):
        self.path = run_dir / METRICS_FILE
        self.logger, self.log_every = logger, log_every
        self._file = self.path.open("a", buffering=1) if dist.is_main() else None
        self._tensorboard = tensorboard

    def write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
        if self._tensorboard is not None:
            self._tensorboard.write(record)

    def step(self, record: dict[str, Any], *, quiet: bool = False) -> None:
        self.write(record)
        if not quiet and record["step"] % self.log_every == 0:
            aux = f"  aux_loss {record['aux_loss']:.4f}" if "aux_loss" in record else ""  # MoE router balance
            self.logger.info(
                "step %d  loss %.4f%s  grad_norm %.3f  lr %.2e  %.0f tok/s  %.0f ms",
                record["step"], record["loss"], aux, record["grad_norm"], record["lr"],
                record["tokens_per_s"], record["step_time_s"] * 1000,
            )

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tensorboard is not None:
            self._tensorboard.close()


class Progress:
    """A rich progress bar on rank 0 when stderr is a terminal; otherwise nothing."""

    def __init__(self, *, total: int, start: int, enabled: bool):
        self._bar = None
        if enabled and dist.is_main() and sys.stderr.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress(TextColumn("train"), BarColumn(), MofNCompleteColumn(),
                                     TextColumn("{task.fields[info]}"), TimeRemainingColumn(), transient=True)
            self._task = self._bar.add_task("train", total=total, completed=start, info="")
            self._bar.start()

    @property
    def active(self) -> bool:
        return self._bar is not None

    def update(self, step: int, info: str) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=step, info=info)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
