"""Peak memory per training phase for the first few steps.

The training step calls `mark(phase)` at each phase boundary. The first phase name ever marked
starts a step and records the memory in use at that moment (e.g. "batch_start": sharded
params, grads and optimizer state); every other mark records the peak since the previous mark
under that name ("forward", "backward", "optimizer_step"), so with gradient accumulation each
phase keeps its largest micro-batch. After `steps` steps every call is a no-op.

Figures: on CUDA, the caching allocator's max_memory_allocated with its peak reset at every
mark; on Linux CPUs, the process's peak RSS (VmHWM, reset through /proc/self/clear_refs);
elsewhere psutil's RSS at the mark. Resetting the peak counters means that during the watched
steps torch.cuda.max_memory_allocated / ru_maxrss only cover the time since the last mark:
whoever logs a lifetime peak should take max(their figure, `observed_peak_mib`).
"""

from __future__ import annotations

import os
import re
from typing import Any, Protocol

import torch

BATCH_START = "batch_start"
FORWARD = "forward"
BACKWARD = "backward"
OPTIMIZER_STEP = "optimizer_step"

_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"


class MemoryProbe(Protocol):
    method: str

    def current_mib(self) -> float: ...
    def peak_mib(self) -> float: ...
    def reset_peak(self) -> None: ...


class CudaProbe:
    method = "cuda max_memory_allocated, peak reset per phase"

    def __init__(self, device: torch.device):
        self.device = device

    def current_mib(self) -> float:
        return torch.cuda.memory_allocated(self.device) / 2**20

    def peak_mib(self) -> float:
        return torch.cuda.max_memory_allocated(self.device) / 2**20

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)


class LinuxRssProbe:
    method = "process peak RSS (Linux VmHWM), reset per phase"

    def _status_kib(self, key: str) -> float:
        with open(_STATUS) as f:
            match = re.search(rf"^{key}:\s+(\d+) kB", f.read(), re.MULTILINE)
        return float(match.group(1)) if match else 0.0

    def current_mib(self) -> float:
        return self._status_kib("VmRSS") / 1024

    def peak_mib(self) -> float:
        return self._status_kib("VmHWM") / 1024

    def reset_peak(self) -> None:
        with open(_CLEAR_REFS, "w") as f:
            f.write("5")  # 5: reset the peak RSS to the current RSS (Linux >= 4.0)


class PsutilRssProbe:
    method = "process RSS at each mark (psutil; this OS has no resettable peak)"

    def __init__(self):
        import psutil

        self._process = psutil.Process()

    def current_mib(self) -> float:
        return self._process.memory_info().rss / 2**20

    def peak_mib(self) -> float:
        return self.current_mib()

    def reset_peak(self) -> None:
        pass


def memory_probe(device: torch.device) -> MemoryProbe:
    """The best per-phase figure available for `device`."""
    if device.type == "cuda":
        return CudaProbe(device)
    if os.path.exists(_CLEAR_REFS) and os.path.exists(_STATUS):
        probe = LinuxRssProbe()
        try:
            probe.reset_peak()
            return probe
        except OSError:  # e.g. a locked-down container
            pass
    return PsutilRssProbe()


class PhaseMemory:
    """Per-phase peak memory of the first `steps` steps; `mark(phase)` at each boundary."""

    def __init__(self, *, steps: int, probe: MemoryProbe):
        self.steps = steps
        self.probe = probe
        self.per_step: list[dict[str, float]] = []
        self.observed_peak_mib = 0.0
        self._start_phase: str | None = None
        self._open = False
        self.done = steps <= 0

    def mark(self, phase: str) -> None:
        """Close the phase that just ended (or start a step, for the first phase name marked)."""
        if self.done:
            return
        if self._start_phase is None:
            self._start_phase = phase
            self.observed_peak_mib = self.probe.peak_mib()  # the peak before we first reset it
        if phase == self._start_phase:
            self.end_step()
            if self.done:
                return
            self.per_step.append({})
            self._open = True
            value = self.probe.current_mib()
        elif self._open:
            value = self.probe.peak_mib()
        else:
            return  # a mark between end_step() and the next step's start
        self.probe.reset_peak()
        row = self.per_step[-1]
        row[phase] = max(row.get(phase, 0.0), value)
        self.observed_peak_mib = max(self.observed_peak_mib, value)

    def end_step(self) -> None:
        """Close the current step (the next start mark does it too)."""
        if self._open:
            self._open = False
            self.done = len(self.per_step) >= self.steps

    @property
    def phases(self) -> list[str]:
        order: list[str] = []
        for row in self.per_step:
            order += [p for p in row if p not in order]
        return order

    def peak_by_phase(self) -> dict[str, float]:
        return {p: max(row.get(p, 0.0) for row in self.per_step) for p in self.phases}

    def summary(self) -> dict[str, Any]:
        """method, steps, per-step figures, the peak of each phase and the largest phase (MiB)."""
        peaks = self.peak_by_phase()
        # The step-start figure is what is resident, not a phase's peak: name a real phase.
        candidates = [p for p in peaks if p != self._start_phase] or list(peaks)
        largest = max(candidates, key=peaks.__getitem__) if candidates else None
        return {
            "method": self.probe.method,
            "steps": len(self.per_step),
            "phases": self.phases,
            "per_step_mib": self.per_step,
            "peak_mib": peaks,
            "largest_phase": largest,
            "largest_mib": peaks.get(largest) if largest else None,
        }


class NullProbe:
    method = "off"

    def current_mib(self) -> float:
        return 0.0

    def peak_mib(self) -> float:
        return 0.0

    def reset_peak(self) -> None:
        pass


def phase_memory(device: torch.device, *, steps: int) -> PhaseMemory:
    """A PhaseMemory for `device` with the best probe available (see the module docstring);
    steps=0 gives one whose marks cost a single attribute check."""
    return PhaseMemory(steps=steps, probe=memory_probe(device) if steps > 0 else NullProbe())
