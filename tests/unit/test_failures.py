"""What `fsdpkit train --nproc` says when ranks fail: the first failure first, and ranks the launcher
stopped after an error exit described as such (fake ProcessFailure objects: exitcode, pid, timestamp)."""

from __future__ import annotations

import signal
from types import SimpleNamespace

from fsdpkit.cli.failures import describe_failures, order_failures

OUTSIDE = "(from outside the training code: a kill, the OOM killer or a crash; it left no traceback)"


def _failure(exitcode: int, *, pid: int, timestamp: int) -> SimpleNamespace:
    return SimpleNamespace(exitcode=exitcode, pid=pid, timestamp=timestamp)


def test_error_exit_comes_first_when_the_launcher_s_sigterm_has_the_same_timestamp():
    failures = {0: _failure(-signal.SIGTERM, pid=10, timestamp=100), 1: _failure(1, pid=11, timestamp=100)}
    assert describe_failures(failures, world_size=2) == [
        "rank 1 (pid 11) exited with code 1 (its traceback and error are above)",
        "then rank 0 (pid 10) was killed by SIGTERM (stopped by the launcher after rank 1 failed)",
    ]


def test_ranks_killed_after_an_error_exit_were_stopped_by_the_launcher():
    failures = {0: _failure(-signal.SIGTERM, pid=10, timestamp=101), 1: _failure(1, pid=11, timestamp=100),
                2: _failure(-signal.SIGKILL, pid=12, timestamp=131),
                3: _failure(-signal.SIGSEGV, pid=13, timestamp=101)}
    assert describe_failures(failures, world_size=5) == [
        "rank 1 (pid 11) exited with code 1 (its traceback and error are above)",
        "then rank 0 (pid 10) was killed by SIGTERM (stopped by the launcher after rank 1 failed)",
        f"then rank 3 (pid 13) was killed by SIGSEGV {OUTSIDE}",  # a crash, not the launcher's signal
        "then rank 2 (pid 12) was killed by SIGKILL (stopped by the launcher after rank 1 failed)",
        "the launcher then stopped rank(s) 4 (SIGTERM, SIGKILL after its grace period)",
    ]


def test_a_kill_before_any_error_exit_is_still_the_first_failure():
    failures = {0: _failure(1, pid=10, timestamp=700), 1: _failure(-signal.SIGKILL, pid=11, timestamp=100)}
    assert describe_failures(failures, world_size=2) == [
        f"rank 1 (pid 11) was killed by SIGKILL {OUTSIDE}",
        "then rank 0 (pid 10) exited with code 1 (its traceback and error are above)",
    ]


def test_signals_alone_are_reported_as_from_outside():
    failures = {1: _failure(-signal.SIGKILL, pid=11, timestamp=100),
                0: _failure(-signal.SIGTERM, pid=10, timestamp=100)}
    assert describe_failures(failures, world_size=3) == [
        f"rank 0 (pid 10) was killed by SIGTERM {OUTSIDE}",
        f"then rank 1 (pid 11) was killed by SIGKILL {OUTSIDE}",
        "the launcher then stopped rank(s) 2 (SIGTERM, SIGKILL after its grace period)",
    ]


def test_the_first_failure_the_launcher_checks_for_exit_2_is_the_error_exit():
    failures = {0: _failure(-signal.SIGTERM, pid=10, timestamp=5), 1: _failure(2, pid=11, timestamp=5),
                2: _failure(2, pid=12, timestamp=5)}
    assert [rank for rank, _ in order_failures(failures)] == [1, 2, 0]
