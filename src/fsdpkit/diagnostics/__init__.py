"""See what FSDP2 actually did and catch the setup mistakes that make training silently wrong.

In your own FSDP2 loop (every rank)::

    from fsdpkit import diagnostics

    fully_shard(...); optimizer = ...            # shard first, then build the optimizer
    diagnostics.check(model, optimizer)          # static checks: raise FSDPContractError with the fix
    with diagnostics.watch_forward(model):       # the first step: hooks ran, dtypes as asked
        loss = model(x).sum(); loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        diagnostics.check_grad_norm(norm, parameters=model.parameters(), max_norm=1.0)
        optimizer.step(); optimizer.zero_grad()

`start_diagnostics` bundles all of it (plus the report and per-phase memory) for a trainer;
`plot_runs` draws metrics.jsonl files; `TensorBoardWriter` mirrors them to TensorBoard.
"""

from fsdpkit.diagnostics.contracts import check, run_static_checks
from fsdpkit.diagnostics.findings import ERROR, WARNING, Finding, FSDPContractError
from fsdpkit.diagnostics.forward import ForwardWatch, watch_forward
from fsdpkit.diagnostics.grad_norm import check_grad_norm, global_grad_norm
from fsdpkit.diagnostics.memory import (
    BACKWARD,
    BATCH_START,
    FORWARD,
    OPTIMIZER_STEP,
    PhaseMemory,
    phase_memory,
)
from fsdpkit.diagnostics.report import (
    DIAGNOSTICS_FILE,
    build_report,
    describe_sharding,
    format_report,
)
from fsdpkit.diagnostics.session import Diagnostics, start_diagnostics
from fsdpkit.diagnostics.tensorboard import TensorBoardWriter


def plot_runs(*args, **kwargs):
    """See fsdpkit.diagnostics.plot.plot_runs (imported on use: matplotlib is optional)."""
    from fsdpkit.diagnostics.plot import plot_runs as _plot_runs

    return _plot_runs(*args, **kwargs)


__all__ = [
    "BACKWARD", "BATCH_START", "DIAGNOSTICS_FILE", "ERROR", "FORWARD", "OPTIMIZER_STEP", "WARNING",
    "Diagnostics", "FSDPContractError", "Finding", "ForwardWatch", "PhaseMemory", "TensorBoardWriter",
    "build_report", "check", "check_grad_norm", "describe_sharding", "format_report", "global_grad_norm",
    "phase_memory", "plot_runs", "run_static_checks", "start_diagnostics", "watch_forward",
]
