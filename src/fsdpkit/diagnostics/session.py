"""What a training loop wires in: the report and static checks at the start, the forward and
gradient-norm checks of the first step, per-phase memory of the first steps, and
diagnostics.json kept up to date in the run directory (rank 0)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from fsdpkit import dist
from fsdpkit.diagnostics.contracts import run_static_checks
from fsdpkit.diagnostics.findings import ERROR, Finding, log, report_findings
from fsdpkit.diagnostics.forward import ForwardWatch, watch_forward
from fsdpkit.diagnostics.gather import all_gather_floats
from fsdpkit.diagnostics.grad_norm import grad_norm_findings
from fsdpkit.diagnostics.memory import NullProbe, PhaseMemory, phase_memory
from fsdpkit.diagnostics.report import (
    DIAGNOSTICS_FILE,
    build_report,
    format_memory,
    format_report,
    write_json,
)


class Diagnostics:
    """Built by `start_diagnostics`. The loop calls `memory.mark(phase)` at phase boundaries,
    `check_grad_norm` after clipping and `after_step` after every step; all are no-ops once
    their work is done (the first step, or the first `memory_steps` steps)."""

    def __init__(self, *, memory: PhaseMemory, watch: ForwardWatch | None, report: dict[str, Any] | None,
                 path: Path | None, strict: bool):
        self.memory = memory
        self.report = report
        self.path = path
        self.strict = strict
        self._watch = watch
        self._grad_norm_checked = report is None
        self._memory_reported = report is None

    @classmethod
    def disabled(cls) -> Diagnostics:
        """One whose every call is a no-op (diagnostics.enabled=false, or a default)."""
        return cls(memory=PhaseMemory(steps=0, probe=NullProbe()), watch=None, report=None, path=None, strict=False)

    def check_grad_norm(self, norm: float | torch.Tensor, *, parameters, max_norm: float) -> None:
        """First call only: the norm is global and clipping was global (two small collectives;
        every rank). Call right after clipping, before zero_grad.

        Raises:
            FSDPContractError: strict and the norm or clipping was per shard.
        """
        if self._grad_norm_checked:
            return
        self._grad_norm_checked = True
        self._record(grad_norm_findings(norm, parameters=parameters, max_norm=max_norm))

    def after_step(self, *, last: bool = False) -> None:
        """After each optimizer step (every rank): the first one evaluates the forward-time
        checks; once the memory steps are done (or at `last`, the run's final step) the
        per-phase peaks are gathered (one collective), logged and written.

        Raises:
            FSDPContractError: strict and a forward-time check failed.
        """
        if self._watch is not None:
            watch, self._watch = self._watch, None
            watch.remove()
            self._record(watch.findings())
        self.memory.end_step()
        if not self._memory_reported and (self.memory.done or last) and self.memory.per_step:
            self._memory_reported = True
            self._report_memory()

    def close(self) -> None:
        """Remove the forward guards if the first step never finished (e.g. it raised)."""
        if self._watch is not None:
            self._watch.remove()
            self._watch = None

    def _record(self, findings: list[Finding]) -> None:
        if findings and self.report is not None:
            self.report["findings"] += [f.as_dict() for f in findings]
            self._write()
        report_findings(findings, strict=self.strict)

    def _report_memory(self) -> None:
        summary = self.memory.summary()
        phases = summary["phases"]
        rows = all_gather_floats([summary["peak_mib"][p] for p in phases])
        summary["per_rank_mib"] = [dict(zip(phases, row, strict=True)) for row in rows]
        summary["max_over_ranks_mib"] = {p: max(row[i] for row in rows) for i, p in enumerate(phases)}
        if self.report is not None:
            self.report["memory"] = summary
            self._write()
        if dist.is_main():
            log.info(format_memory(summary))

    def _write(self) -> None:
        if self.path is not None and dist.is_main():
            write_json(self.path, self.report)


def start_diagnostics(model: nn.Module, optimizer: torch.optim.Optimizer | None, *, device: torch.device,
                      run_dir: Path | None = None, enabled: bool = True, memory_steps: int = 3,
                      skew_warn_ratio: float = 1.25, strict: bool = True, param_dtype: torch.dtype | None = None,
                      state_dict_type: str | None = None) -> Diagnostics:
    """Report what FSDP2 applied and run the static checks (rank 0 logs; `run_dir` gets
    diagnostics.json), then arm the first step's checks and the per-phase memory. Call on
    every rank after sharding and building the optimizer, before the first step (one
    all-gather). With enabled=False nothing is checked and every later call is a no-op.

    Args:
        model: the root module after fully_shard.
        optimizer: the optimizer over the sharded parameters (None: skip that check).
        device: the compute device (chooses the memory probe).
        run_dir: where diagnostics.json goes (rank 0); None: nowhere.
        enabled: diagnostics.enabled.
        memory_steps: steps whose per-phase peak memory is recorded (0: none).
        skew_warn_ratio: warn when max/min local parameter MiB across ranks exceeds this.
        strict: contract errors raise FSDPContractError (True) or are only logged.
        param_dtype: the parameter dtype mixed precision asked for (None: the root's policy).
        state_dict_type: how checkpoints store state, for the report.

    Raises:
        FSDPContractError: strict and a static check failed.
    """
    if not enabled:
        return Diagnostics.disabled()
    report, findings = build_report(model, state_dict_type=state_dict_type, skew_warn_ratio=skew_warn_ratio)
    findings += run_static_checks(model, optimizer, param_dtype=param_dtype)
    report["findings"] = [f.as_dict() for f in findings]
    path = Path(run_dir) / DIAGNOSTICS_FILE if run_dir is not None else None
    if dist.is_main():
        errors = sum(f.level == ERROR for f in findings)
        verdict = (f"{errors} errors, {len(findings) - errors} warnings (below)" if findings
                   else "no setup problems found")
        log.info("%s\n  checks: %s%s", format_report(report), verdict, f"; written to {path}" if path else "")
        if path is not None:
            write_json(path, report)
    report_findings(findings, strict=strict)
    return Diagnostics(memory=phase_memory(device, steps=memory_steps),
                       watch=watch_forward(model, param_dtype=param_dtype),
                       report=report, path=path, strict=strict)
