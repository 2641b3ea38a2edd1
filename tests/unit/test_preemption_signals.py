"""Preemption signals reach the process, not one Checkpointer: every handler installed for a signal
hears it, and the handler found before the first install comes back when the last one leaves, in
whatever order they uninstall (two Checkpointers in one process: a model and its EMA)."""

from __future__ import annotations

import os
import signal

from fsdpkit.checkpoint.preemption import PreemptionHandler


def test_every_installed_handler_hears_the_signal_and_the_original_comes_back():
    original = signal.getsignal(signal.SIGUSR1)
    first, second = PreemptionHandler(["SIGUSR1"]).install(), PreemptionHandler(["USR1", "SIGUSR2"]).install()
    os.kill(os.getpid(), signal.SIGUSR1)
    assert first.received == second.received == signal.SIGUSR1
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL  # a second signal ends the process at once
    first.uninstall()  # in the order they were installed, not the reverse
    second.uninstall()
    assert signal.getsignal(signal.SIGUSR1) == original

    alone = PreemptionHandler(["SIGUSR1"]).install()
    quiet = PreemptionHandler(["SIGUSR2"]).install()
    os.kill(os.getpid(), signal.SIGUSR1)
    assert alone.received == signal.SIGUSR1 and quiet.received is None  # only those that asked for it
    quiet.uninstall()
    alone.uninstall()
    assert signal.getsignal(signal.SIGUSR1) == original and signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL

    def mine(signum, frame):  # the process's own handler, set after every handler left
        pass

    previous = signal.signal(signal.SIGUSR2, mine)
    try:
        lone = PreemptionHandler(["SIGUSR1"]).install()
        os.kill(os.getpid(), signal.SIGUSR1)
        lone.uninstall()
        assert signal.getsignal(signal.SIGUSR2) is mine  # untouched: no handler of ours wanted it any more
    finally:
        signal.signal(signal.SIGUSR2, previous)
