"""One live run per checkpoints prefix on object storage, where there is no flock.

The rule: rank 0 of a run holds `<root>/.lock`, a small JSON object {owner, host, pid, heartbeat}
that a daemon thread rewrites every `heartbeat_s` seconds (IOSettings.object_lock_heartbeat_s). A run
that finds another owner's lock refuses the prefix, unless that lock is stale: its heartbeat is
older than `stale_s` (IOSettings.object_lock_stale_s), or it was written on this host by a process
that is gone (a killed run restarted on the same node). The lock
is deleted on release.

What it does not give: object stores have no compare-and-swap that fsspec exposes everywhere, so
two runs starting within the same moment could both write the lock; each reads it back after
writing and the one that finds the other's owner refuses (last writer wins, read-after-write is
consistent on S3). A run paused longer than the stale age (a stopped VM) loses its claim.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import TYPE_CHECKING

import psutil

from fsdpkit.checkpoint.errors import CheckpointError
from fsdpkit.tunables import DEFAULTS

if TYPE_CHECKING:
    from fsdpkit.checkpoint.storage.remote import RemotePath

log = logging.getLogger("fsdpkit.checkpoint")
LOCK = ".lock"


class ObjectLock:
    """The lock object `<root>/.lock`, held for a run's life by its rank 0 (storage.protocol.Lock,
    as local.DirectoryLock)."""

    def __init__(self, root: RemotePath, *, heartbeat_s: float = DEFAULTS.object_lock_heartbeat_s,
                 stale_s: float = DEFAULTS.object_lock_stale_s):
        self.root, self.path = root, root / LOCK
        self.heartbeat_s, self.stale_s = heartbeat_s, stale_s
        self.owner = uuid.uuid4().hex
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _record(self) -> dict[str, object]:
        return {"owner": self.owner, "host": socket.gethostname(), "pid": os.getpid(), "heartbeat": time.time()}

    def _holder(self) -> dict[str, object] | None:
        try:
            holder = json.loads(self.path.read_bytes())
        except FileNotFoundError:
            return None
        except (ValueError, UnicodeDecodeError):
            return None  # garbage: nobody can be holding it
        return holder if isinstance(holder, dict) else None

    def _live(self, holder: dict[str, object]) -> bool:
        if holder.get("owner") == self.owner:
            return False
        beat = holder.get("heartbeat")
        if not isinstance(beat, int | float) or time.time() - beat > self.stale_s:
            return False
        pid = holder.get("pid")
        if holder.get("host") == socket.gethostname() and isinstance(pid, int):
            return psutil.pid_exists(pid) and pid != os.getpid()
        return True

    def acquire(self, *, wait_s: float | None = None) -> ObjectLock:
        """Raises CheckpointError when another live run holds the prefix after `wait_s` (default 15 s)."""
        deadline = time.monotonic() + (15.0 if wait_s is None else wait_s)
        while (holder := self._holder()) is not None and self._live(holder):
            if time.monotonic() >= deadline:
                raise CheckpointError(
                    f"checkpoint.dir={self.root} is in use by another run (lock {self.path}: host "
                    f"{holder.get('host')}, pid {holder.get('pid')}, heartbeat "
                    f"{time.time() - float(holder['heartbeat']):.0f} s ago): two runs must never write into one "
                    "checkpoint prefix. Wait for it to end, stop it, or set checkpoint.dir to another prefix (a lock "
                    f"silent for {self.stale_s:.0f} s is taken over)")
            time.sleep(0.5)
        self.path.write_text(json.dumps(self._record()))
        if (holder := self._holder()) is not None and holder.get("owner") != self.owner:
            raise CheckpointError(f"checkpoint.dir={self.root}: another run took the lock {self.path} at the same "
                                  "moment; two runs must never write into one checkpoint prefix")
        self._thread = threading.Thread(target=self._beat, name="fsdpkit-object-lock", daemon=True)
        self._thread.start()
        return self

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                self.path.write_text(json.dumps(self._record()))
            except Exception as e:  # noqa: BLE001 - a failed heartbeat is retried; saves report real trouble
                log.warning("could not refresh the lock %s: %s", self.path, e)

    def release(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        try:
            holder = self._holder()
            if holder is not None and holder.get("owner") == self.owner:
                self.path.unlink(missing_ok=True)
        except Exception as e:  # noqa: BLE001 - a lock left behind goes stale by itself
            log.warning("could not remove the lock %s: %s", self.path, e)
