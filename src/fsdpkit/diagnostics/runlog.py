"""Read a run directory's metrics.jsonl into what a plot needs.

Step records have no "event" key; event records do ({"event": "checkpoint", ...},
{"event": "resume", ...}). A resumed run appends to the same file, so steps after the
checkpoint it resumed from appear twice: the later record wins, and the earlier ones are
kept apart as `superseded`. A step number that goes back without a resume event (an older
log) counts as a resume at the step before it. A truncated last line (a killed run) is skipped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"  # what fsdpkit train writes (fsdpkit.train.metrics writes this name)


@dataclass
class RunLog:
    """One run's metrics: `steps` (one per step, later records win, by step), `superseded`
    (step records a resume replaced), `checkpoints` and `resumes` (event records, in order)."""

    path: Path
    label: str
    steps: list[dict[str, Any]] = field(default_factory=list)
    superseded: list[dict[str, Any]] = field(default_factory=list)
    checkpoints: list[dict[str, Any]] = field(default_factory=list)
    resumes: list[dict[str, Any]] = field(default_factory=list)
    skipped_lines: int = 0

    def series(self, key: str, *, superseded: bool = False) -> tuple[list[int], list[float]]:
        """(steps, values) of `key` where present and numeric."""
        rows = self.superseded if superseded else self.steps
        pairs = [(r["step"], r[key]) for r in rows if isinstance(r.get(key),
                                                                 int | float) and not isinstance(r.get(key), bool)]
        return [p[0] for p in pairs], [float(p[1]) for p in pairs]


def metrics_path(run_dir: str | Path) -> Path:
    """RUN_DIR/metrics.jsonl, or RUN_DIR itself when it names a .jsonl file.

    Raises:
        FileNotFoundError: no metrics file there; the message says what a run directory holds.
    """
    run_dir = Path(run_dir)
    path = run_dir if run_dir.suffix == ".jsonl" else run_dir / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: pass a run directory written by `fsdpkit train` "
                                f"(it holds config.yaml and {METRICS_FILE}), e.g. runs/demo/uninterrupted")
    return path


def read_run(run_dir: str | Path, *, label: str | None = None) -> RunLog:
    """Parse RUN_DIR/metrics.jsonl (see the module docstring)."""
    path = metrics_path(run_dir)
    run = RunLog(path=path, label=label or (path.parent.name if path.name == METRICS_FILE else path.stem))
    by_step: dict[int, dict[str, Any]] = {}
    last_step: int | None = None
    resumed_since_last = False
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            run.skipped_lines += 1
            continue
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            run.skipped_lines += 1
            continue
        event = record.get("event")
        if event == "checkpoint":
            run.checkpoints.append(record)
        elif event == "resume":
            run.resumes.append(record)
            resumed_since_last = True
        elif event is None:
            step = record["step"]
            if last_step is not None and step <= last_step and not resumed_since_last:
                run.resumes.append({"event": "resume", "step": step - 1, "implicit": True})
            resumed_since_last = False
            if step in by_step:
                run.superseded.append(by_step[step])
            by_step[step] = record
            last_step = step
    run.steps = [by_step[s] for s in sorted(by_step)]
    run.superseded.sort(key=lambda r: r["step"])
    return run
