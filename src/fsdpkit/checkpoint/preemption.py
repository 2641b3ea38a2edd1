"""Preemption: SLURM and Kubernetes send SIGTERM (SLURM's `--signal` often SIGUSR1) some time
before killing a job. The first signal asks the loop to save at the next step boundary (agreed
by every rank, see Checkpointer.step) and exit with EXIT_PREEMPTED; a second one ends the
process at once (the default action is restored, so it works even while the main thread is
blocked in a collective). An unfinished save then never becomes `latest`: nothing is lost but
the steps since the previous checkpoint.
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType

EXIT_PREEMPTED = 75  # EX_TEMPFAIL (sysexits.h): "try again later" — resume with the same command

log = logging.getLogger("fsdpkit.checkpoint")


class PreemptionHandler:
    """Installs the handlers (main thread only) and restores the previous ones."""

    def __init__(self, signals: list[str]):
        self.signals = [signal.Signals[name if name.startswith("SIG") else f"SIG{name}"] for name in signals]
        self.received: signal.Signals | None = None
        self._previous: dict[signal.Signals, object] = {}

    def install(self) -> PreemptionHandler:
        if self._previous:
            return self
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        elif self.signals:
            log.warning("not on the main thread: preemption signals are not handled")
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = signal.Signals(signum)
        for sig in self._previous:  # a second signal: the default action, at once
            signal.signal(sig, signal.SIG_DFL)
        log.warning("received %s: saving a checkpoint at the end of this step, then exiting with %d "
                    "(send it again to exit at once)", self.received.name, EXIT_PREEMPTED)

