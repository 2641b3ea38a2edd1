"""Who is doing what, on every rank: heartbeats in the launcher's store, and the one report line
that names the rank that stopped answering when a collective times out.

Each rank runs a daemon thread that publishes, every `interval_s`, a sequence number and what the
rank is doing ("step 14: forward/backward", "background save of step 10: writing", ...) under
`fsdpkit/heartbeat/<rank>` in the store the process group was created with. The store lives in the
launcher (torch's elastic agent), so a stopped or dead rank cannot block it. A rank whose sequence
number does not move between two reads of the store has stopped answering: that comparison needs
no clocks shared between hosts.

The thread also watches its own rank's step: when one step has lasted `slow_step_factor` times the
median of the recent ones (and at least MIN_SLOW_S), it reads the heartbeats and warns, naming the
rank that stopped, only if one did: a slow step on live ranks is not reported. The job still ends
through the collectives' own timeouts (dist.timeout_s, checkpoint.timeout_s): the watchdog reports,
it never kills.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch.distributed as tdist

log = logging.getLogger("fsdpkit.dist")
KEY = "fsdpkit/heartbeat/{rank}"
MIN_SLOW_S = 30.0  # a step shorter than this is never reported as stuck
RECENT_STEPS = 20
MAIN, BACKGROUND = "main", "background"


class Watchdog:
    """Heartbeats of one rank; `report()` describes every rank. Thread-safe.

    `clock` (seconds, monotonic) times steps and what each slot is doing; `sleep` is the wait of
    `report()` between its two reads. Both are time's own unless a test drives them."""

    def __init__(self, *, store: tdist.Store, rank: int, world_size: int, interval_s: float = 1.0,
                 slow_step_factor: float = 10.0, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep):
        self.store, self.rank, self.world_size = store, rank, world_size
        self.interval_s, self.slow_step_factor = interval_s, slow_step_factor
        self._clock, self._sleep = clock, sleep
        self._phases: dict[str, tuple[str, float]] = {MAIN: ("starting", clock())}
        self._step_started: float | None = None
        self._step_times: deque[float] = deque(maxlen=RECENT_STEPS)
        self._warned_step = False
        self._seq = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fsdpkit-heartbeat", daemon=True)

    # -- what this rank is doing ---------------------------------------------------------------
    def doing(self, what: str | None, *, slot: str = MAIN) -> None:
        """Record what this rank's `slot` (main thread, background save) is doing now (None: idle)."""
        with self._lock:
            if what is None:
                self._phases.pop(slot, None)
            elif self._phases.get(slot, ("",))[0] != what:
                self._phases[slot] = (what, self._clock())

    def step_started(self) -> None:
        with self._lock:
            self._step_started, self._warned_step = self._clock(), False

    def step_finished(self) -> None:
        with self._lock:
            if self._step_started is not None:
                self._step_times.append(self._clock() - self._step_started)
            self._step_started = None

    # -- the thread ----------------------------------------------------------------------------
    def start(self) -> Watchdog:
        self.beat()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.tick()
            except Exception as e:  # noqa: BLE001 - the store went away (launcher ended): stop quietly
                log.debug("heartbeat stopped: %s", e)
                return

    def tick(self) -> None:
        """One round of the thread: publish a heartbeat, then warn if this rank's step is stuck."""
        self.beat()
        if self._step_is_slow():
            self._warn_slow_step()

    def beat(self) -> None:
        """Publish this rank's heartbeat: the next sequence number and what each slot is doing."""
        with self._lock:
            self._seq += 1
            now = self._clock()
            record = {"seq": self._seq, "pid": os.getpid(), "host": socket.gethostname(),
                      "doing": {slot: [what, now - since] for slot, (what, since) in self._phases.items()}}
        self.store.set(KEY.format(rank=self.rank), json.dumps(record))

    def _step_is_slow(self) -> bool:
        with self._lock:
            if (not self.slow_step_factor or self._step_started is None or self._warned_step
                    or len(self._step_times) < 3):
                return False
            elapsed = self._clock() - self._step_started
            return elapsed >= max(MIN_SLOW_S, self.slow_step_factor * statistics.median(self._step_times))

    def _warn_slow_step(self) -> None:
        with self._lock:
            self._warned_step = True
            now = self._clock()
            elapsed = now - (self._step_started or now)
            median = statistics.median(self._step_times)
        stale, line = self.report()
        if stale:  # a slow step with every rank alive is just slow: say nothing
            log.warning("watchdog: this step has taken %.0f s (recent median %.2f s): %s", elapsed, median, line)

    # -- every rank ------------------------------------------------------------------------------
    def read(self) -> dict[int, dict[str, Any]]:
        """The latest heartbeat of every rank that published one."""
        out = {}
        for r in range(self.world_size):
            key = KEY.format(rank=r)
            if self.store.check([key]):
                out[r] = json.loads(self.store.get(key))
        return out

    def report(self, *, wait_s: float | None = None) -> tuple[list[int], str]:
        """(ranks that stopped answering, one line describing every rank). Reads the heartbeats,
        waits three heartbeat intervals, reads again: a rank whose sequence did not move is stale
        (this rank never is: the caller may be its own heartbeat thread)."""
        first = self.read()
        self._sleep(3 * self.interval_s if wait_s is None else wait_s)
        self.beat()
        second = self.read()
        stale = [r for r in range(self.world_size)
                 if r != self.rank and (r not in second or second[r]["seq"] == first.get(r, {}).get("seq"))]
        return stale, describe(second, stale=stale, world_size=self.world_size)


def describe(beats: dict[int, dict[str, Any]], *, stale: list[int], world_size: int) -> str:
    """One line: the stale ranks first (what they were doing when they stopped), then the others."""
    def doing(beat: dict[str, Any]) -> str:
        parts = [f"{what} for {age:.0f} s" if slot == MAIN else f"{slot}: {what} for {age:.0f} s"
                 for slot, (what, age) in beat["doing"].items()]
        return "; ".join(parts) or "idle"

    parts = []
    for r in stale:
        if r in beats:
            b = beats[r]
            parts.append(f"rank {r} stopped answering (pid {b['pid']} on {b['host']}; its last heartbeat: {doing(b)})")
        else:
            parts.append(f"rank {r} never sent a heartbeat")
    if not stale:
        parts.append("every rank answers")
    parts += [f"rank {r}: {doing(beats[r])}" for r in range(world_size) if r not in stale and r in beats]
    return "; ".join(parts)


_current: Watchdog | None = None


def start(*, store: tdist.Store, rank: int, world_size: int, interval_s: float,
          slow_step_factor: float) -> Watchdog | None:
    """Start this rank's heartbeat (a no-op with interval_s=0 or a world of one)."""
    global _current
    if interval_s <= 0 or world_size == 1:
        return None
    _current = Watchdog(store=store, rank=rank, world_size=world_size, interval_s=interval_s,
                        slow_step_factor=slow_step_factor).start()
    return _current


def stop() -> None:
    global _current
    if _current is not None:
        _current.stop()
    _current = None


def current() -> Watchdog | None:
    return _current


def doing(what: str | None, *, slot: str = MAIN) -> None:
    """Record what this rank is doing (no-op without a running watchdog)."""
    if _current is not None:
        _current.doing(what, slot=slot)


def step_started() -> None:
    """The loop began a step (the watchdog times steps to notice a stuck one)."""
    if _current is not None:
        _current.step_started()


def step_finished() -> None:
    if _current is not None:
        _current.step_finished()


def log_stuck_ranks(error: BaseException) -> list[int]:
    """After a failed collective: log one line naming the rank(s) that stopped answering and what
    every rank was doing. Logged by the lowest live rank only. Returns the stale ranks."""
    if _current is None:
        return []
    try:
        stale, line = _current.report()
    except Exception as e:  # noqa: BLE001 - the store is gone too: nothing to report
        log.debug("no heartbeat report: %s", e)
        return []
    live = [r for r in range(_current.world_size) if r not in stale]
    if stale and live and live[0] == _current.rank:
        log.error("training stopped (%s): %s", type(error).__name__, line)
    elif not stale and _current.rank == 0:
        log.info("after %s: %s", type(error).__name__, line)
    return stale
