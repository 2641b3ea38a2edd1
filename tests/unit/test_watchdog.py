"""Heartbeats and the stuck-rank report, with two in-process 'ranks' sharing one store.

The report and the slow-step check run on a test clock: `report()`'s wait beats the ranks that are
still alive, so "rank 1 stopped" is decided by the heartbeats alone, never by a thread being
scheduled in time on a loaded machine. One test runs the real thread and waits for its beats."""

from __future__ import annotations

import json
import logging
import time

import torch.distributed as tdist

from fsdpkit import watchdog
from fsdpkit.watchdog import Watchdog


class World:
    """Two ranks' watchdogs on one store and one clock; `sleep` advances the clock and beats every
    rank that has not been stopped, as their threads would."""

    def __init__(self, **kw) -> None:
        self.now, self.alive = 1000.0, {0, 1}
        store = tdist.HashStore()
        self.ranks = [Watchdog(store=store, rank=r, world_size=2, interval_s=1.0, clock=lambda: self.now,
                               sleep=self.sleep, **kw) for r in (0, 1)]
        for wd in self.ranks:
            wd.beat()

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        for r in sorted(self.alive):
            self.ranks[r].beat()

    def stop(self, rank: int) -> None:
        """As SIGSTOP would: no more heartbeats from `rank`."""
        self.alive.discard(rank)


def test_report_names_the_rank_whose_heartbeat_stopped_and_what_each_rank_did():
    world = World()
    r0, r1 = world.ranks
    r0.doing("step 7: end-of-step all-reduce")
    r1.doing("step 7: forward/backward")
    r1.doing("background save of step 6: writing and commit", slot=watchdog.BACKGROUND)
    stale, line = r0.report()
    assert stale == [] and line.startswith("every rank answers")
    world.stop(1)
    world.now += 40
    stale, line = r0.report()
    assert stale == [1]
    assert line.startswith("rank 1 stopped answering (pid ")
    # rank 1's last heartbeat was 3 s after it began the step (the first report's wait)
    assert "its last heartbeat: step 7: forward/backward for 3 s; background: background save of step 6" in line
    assert "rank 0: step 7: end-of-step all-reduce for 46 s" in line


def test_slow_step_warns_only_when_a_rank_stopped(monkeypatch, caplog):
    monkeypatch.setattr(watchdog, "MIN_SLOW_S", 0.0)
    world = World(slow_step_factor=3.0)
    r0 = world.ranks[0]
    for _ in range(3):  # recent steps of 10 ms
        r0.step_started()
        world.now += 0.01
        r0.step_finished()
    caplog.set_level(logging.WARNING, logger="fsdpkit.dist")

    def warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records if "watchdog" in r.getMessage()]

    r0.step_started()
    world.now += 0.02  # twice the median: not slow yet
    r0.tick()
    world.now += 0.1  # 12 times the median, both ranks alive: nothing to say
    r0.tick()
    assert warnings() == []
    r0.step_finished()
    world.stop(1)
    r0.step_started()  # a slow step with rank 1 stopped: one warning that names it
    world.now += 0.1
    r0.tick()
    r0.tick()  # once per step
    assert len(warnings()) == 1 and "rank 1 stopped answering" in warnings()[0], warnings()
    assert "this step has taken 0 s (recent median 0.01 s)" in warnings()[0]


def test_the_thread_publishes_heartbeats_until_stopped():
    store = tdist.HashStore()
    wd = Watchdog(store=store, rank=0, world_size=1, interval_s=0.01).start()
    try:
        deadline = time.monotonic() + 60  # waits for the beats, however loaded the machine

        def seq() -> int:
            return json.loads(store.get(watchdog.KEY.format(rank=0)))["seq"]

        while seq() < 3:
            assert time.monotonic() < deadline, "the heartbeat thread published nothing for 60 s"
            time.sleep(0.01)
    finally:
        wd.stop()
    wd._thread.join(timeout=60)
    assert not wd._thread.is_alive()
    last = seq()
    time.sleep(0.05)
    assert seq() == last
