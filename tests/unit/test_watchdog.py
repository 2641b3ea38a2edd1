"""Heartbeats and the stuck-rank report, with two in-process 'ranks' sharing one store."""

from __future__ import annotations

import logging
import time

import torch.distributed as tdist

from fsdpkit import watchdog
from fsdpkit.watchdog import Watchdog

INTERVAL = 0.05


def two_ranks(**kw) -> tuple[Watchdog, Watchdog]:
    store = tdist.HashStore()
    return tuple(Watchdog(store=store, rank=r, world_size=2, interval_s=INTERVAL, **kw).start() for r in (0, 1))


def test_report_names_the_rank_whose_heartbeat_stopped_and_what_each_rank_did():
    r0, r1 = two_ranks()
    try:
        r0.doing("step 7: end-of-step all-reduce")
        r1.doing("step 7: forward/backward")
        r1.doing("background save of step 6: writing and commit", slot=watchdog.BACKGROUND)
        time.sleep(3 * INTERVAL)
        stale, line = r0.report()
        assert stale == [] and line.startswith("every rank answers")
        r1.stop()  # as SIGSTOP would: no more beats
        time.sleep(3 * INTERVAL)
        stale, line = r0.report()
        assert stale == [1]
        assert line.startswith("rank 1 stopped answering (pid ")
        assert "its last heartbeat: step 7: forward/backward for 0 s; background: background save of step 6" in line
        assert "rank 0: step 7: end-of-step all-reduce" in line
    finally:
        r0.stop()
        r1.stop()


def test_slow_step_warns_only_when_a_rank_stopped(monkeypatch, caplog):
    monkeypatch.setattr(watchdog, "MIN_SLOW_S", 0.0)
    r0, r1 = two_ranks(slow_step_factor=3.0)
    try:
        for wd in (r0, r1):
            for _ in range(3):  # recent steps of ~10 ms
                wd.step_started()
                time.sleep(0.01)
                wd.step_finished()
        caplog.set_level(logging.WARNING, logger="fsdpkit.dist")
        r0.step_started()  # a slow step, both ranks alive: nothing to say
        time.sleep(12 * INTERVAL)
        assert not [r for r in caplog.records if "watchdog" in r.getMessage()]
        r0.step_finished()
        r1.stop()
        r0.step_started()  # a slow step with rank 1 stopped: one warning that names it
        time.sleep(14 * INTERVAL)
        warnings = [r.getMessage() for r in caplog.records if "watchdog" in r.getMessage()]
        assert len(warnings) == 1 and "rank 1 stopped answering" in warnings[0], warnings
    finally:
        r0.stop()
        r1.stop()
