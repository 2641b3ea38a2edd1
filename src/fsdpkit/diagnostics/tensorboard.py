"""Optional TensorBoard logging of the metrics.jsonl records (`logging.tensorboard: true`).

torch.utils.tensorboard needs the `tensorboard` package, which fsdpkit does not depend on: it
is imported when a writer is opened, and a missing package is a clear error naming the fix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fsdpkit import dist

STEP_SCALARS = {
    "loss": "train/loss", "grad_norm": "train/grad_norm", "lr": "train/lr", "tokens_per_s": "train/tokens_per_s",
    "step_time_s": "train/step_time_s", "peak_mem_mib": "train/peak_mem_mib", "tokens_seen": "train/tokens_seen",
    "val_loss": "val/loss",
}
EVENT_SCALARS = {
    "checkpoint": {"stall_s": "checkpoint/stall_s", "background_s": "checkpoint/background_s",
                   "throughput_gbps": "checkpoint/throughput_gbps", "bytes_total": "checkpoint/bytes_total"},
    "resume": {"load_s": "resume/load_s"},
}
MISSING = ("logging.tensorboard=true needs the tensorboard package, which is not installed ({error}); "
           "install it with `pip install tensorboard`, or set logging.tensorboard=false")


class TensorBoardWriter:
    """Writes metrics records as TensorBoard scalars, on rank 0 only (a no-op elsewhere).
    Open one with `TensorBoardWriter.open(log_dir)`; call `write(record)` with every record that
    goes to metrics.jsonl (step records and {"event": ...} records alike), then `close()`."""

    def __init__(self, summary_writer: Any | None):
        self._writer = summary_writer

    @classmethod
    def open(cls, log_dir: str | Path, *, all_ranks: bool = False) -> TensorBoardWriter:
        """A writer into `log_dir` (rank 0, or every rank with all_ranks=True).

        Raises:
            ImportError: tensorboard is not installed; the message says how to fix it.
        """
        if not (all_ranks or dist.is_main()):
            return cls(None)
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ImportError(MISSING.format(error=e)) from None
        return cls(SummaryWriter(log_dir=str(log_dir)))

    def write(self, record: dict[str, Any]) -> None:
        if self._writer is None or "step" not in record:
            return
        step = int(record["step"])
        event = record.get("event")
        names = STEP_SCALARS if event is None else EVENT_SCALARS.get(event, {})
        for key, tag in names.items():
            value = record.get(key)
            if isinstance(value, int | float) and not isinstance(value, bool):
                self._writer.add_scalar(tag, value, step)
        if event is not None:
            detail = ", ".join(f"{k}={record[k]}" for k in ("mode", "reason", "path") if k in record)
            self._writer.add_text(f"events/{event}", f"step {step}: {event} {detail}".strip(), step)

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
