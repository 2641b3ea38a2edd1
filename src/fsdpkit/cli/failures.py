"""What `fsdpkit train --nproc` says when ranks fail: which rank failed first and how (a signal
leaves no traceback; an exit code follows a traceback above), which ranks failed after it, and which
checkpoint a rerun of the same command will take."""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING, Any

from fsdpkit.checkpoint.resolve import committed_candidates
from fsdpkit.checkpoint.storage import open_storage

if TYPE_CHECKING:
    from fsdpkit.config import Config

LAUNCHER_SIGNALS = (signal.SIGTERM, signal.SIGKILL)  # how torch's launcher stops the other ranks


def how(exitcode: int) -> str:
    """`was killed by SIGKILL` for a negative exit code (the signal's number), else `exited with code N`."""
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"was killed by {name}"
    return f"exited with code {exitcode}"


def order_failures(failures: dict[int, Any]) -> list[tuple[int, Any]]:
    """(rank, failure) pairs, the first failure first: by timestamp, then a rank that exited with an
    error code before ranks killed by a signal, then by rank. torch's timestamps are whole seconds,
    and the SIGTERM the launcher sends the other ranks after an error exit lands in the same one."""
    return sorted(failures.items(), key=lambda item: (item[1].timestamp, item[1].exitcode < 0, item[0]))


def describe_failures(failures: dict[int, Any], *, world_size: int) -> list[str]:
    """Lines naming each failed rank, the first failure first. `failures`: torch's ProcessFailure by
    global rank (exitcode, pid, timestamp); ranks not in it were stopped by the launcher. A rank
    killed by SIGTERM or SIGKILL after another rank exited with an error code was stopped by the
    launcher, which reacts to that exit."""
    lines = []
    failed = None  # the first rank that exited with an error code
    for i, (rank, f) in enumerate(order_failures(failures)):
        what = f"rank {rank} (pid {f.pid}) {how(f.exitcode)}"
        if f.exitcode >= 0:
            what += " (its traceback and error are above)"
            failed = rank if failed is None and f.exitcode > 0 else failed
        elif failed is not None and -f.exitcode in LAUNCHER_SIGNALS:
            what += f" (stopped by the launcher after rank {failed} failed)"
        else:
            what += " (from outside the training code: a kill, the OOM killer or a crash; it left no traceback)"
        lines.append(what if i == 0 else f"then {what}")
    others = sorted(set(range(world_size)) - set(failures))
    if others:
        lines.append(f"the launcher then stopped rank(s) {', '.join(map(str, others))} (SIGTERM, SIGKILL after its "
                     "grace period)")
    return lines


def rerun_takes(cfg: Config) -> str:
    """Which checkpoint a rerun of the same command resumes from (checked as `resume=auto` resolves
    it, without reading its files: a corrupt one is found by the rerun's load)."""
    resume = cfg.checkpoint.resume
    if resume == "none":
        return "a rerun starts from scratch (checkpoint.resume=none)"
    if resume != "auto":
        return f"a rerun resumes from {resume} (checkpoint.resume)"
    candidates = committed_candidates(open_storage(cfg.checkpoint.dir, cfg.checkpoint.storage_options))
    if not candidates:
        return f"a rerun starts from scratch: no committed checkpoint under {cfg.checkpoint.dir}"
    path, step = candidates[0]
    return f"a rerun resumes from {path} (step {step}) if its checksums verify; run the same command"
