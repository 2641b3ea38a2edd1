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
    """One Checkpointer's view of the preemption signals: `received` is set when one arrives.

    Signal handlers belong to the process, not to a Checkpointer: two Checkpointers in one process
    (a model and its EMA) each installing their own would leave only the last one told. So one
    dispatcher per signal is installed while any handler wants it, and tells every handler that
    asked for that signal; the handler found before the first install is put back when the last
    one leaves, in whatever order they uninstall (main thread only).
    """

    def __init__(self, signals: list[str]):
        self.signals = [signal.Signals[name if name.startswith("SIG") else f"SIG{name}"] for name in signals]
        self.received: signal.Signals | None = None
        self._installed = False

    def install(self) -> PreemptionHandler:
        if self._installed:
            return self
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                if not _listeners.get(sig):
                    _before[sig] = signal.signal(sig, _dispatch)
                _listeners.setdefault(sig, []).append(self)
            self._installed = True
        elif self.signals:
            log.warning("not on the main thread: preemption signals are not handled")
        return self

    def uninstall(self) -> None:
        if not self._installed:
            return
        for sig in self.signals:
            listeners = _listeners.get(sig, [])
            if self in listeners:
                listeners.remove(self)
            if not listeners:
                _listeners.pop(sig, None)
                if sig in _before:
                    signal.signal(sig, _before.pop(sig))
        self._installed = False


_listeners: dict[signal.Signals, list[PreemptionHandler]] = {}  # per signal, the handlers installed for it
_before: dict[signal.Signals, object] = {}  # per signal, the handler the first install replaced


def _dispatch(signum: int, frame: FrameType | None) -> None:
    received = signal.Signals(signum)
    for handler in _listeners.get(received, []):
        handler.received = received
    for sig in list(_listeners):  # a second signal: the default action, at once
        signal.signal(sig, signal.SIG_DFL)
    log.warning("received %s: saving a checkpoint at the end of this step, then exiting with %d "
                "(send it again to exit at once)", received.name, EXIT_PREEMPTED)
