"""What `fsdpkit train --nproc` says when ranks fail: which rank failed first and how (a signal
leaves no traceback; an exit code follows a traceback above), which ranks failed after it, and which
checkpoint a rerun of the same command will take."""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING, Any

from fsdpkit.checkpoint.resume import committed_candidates
from fsdpkit.checkpoint.storage import open_storage

if TYPE_CHECKING:
    from fsdpkit.config import Config


def how(exitcode: int) -> str:
    """`was killed by SIGKILL` for a negative exit code (the signal's number), else `exited with code N`."""
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"was killed by {name}"
    return f"exited with code {exitcode}"


def describe_failures(failures: dict[int, Any], *, world_size: int) -> list[str]:
    """Lines naming each failed rank, the first failure first. `failures`: torch's ProcessFailure by
    global rank (exitcode, pid, timestamp); ranks not in it were stopped by the launcher."""
    order = sorted(failures.items(), key=lambda item: (item[1].timestamp, item[0]))
    lines = []
    for i, (rank, f) in enumerate(order):
        what = f"rank {rank} (pid {f.pid}) {how(f.exitcode)}"
        if f.exitcode < 0:
            what += " (from outside the training code: a kill, the OOM killer or a crash; it left no traceback)"
        else:
            what += " (its traceback and error are above)"
        lines.append(what if i == 0 else f"then {what}")
    others = sorted(set(range(world_size)) - set(failures))
    if others:
        lines.append(f"the launcher then stopped rank(s) {', '.join(map(str, others))} (SIGTERM, SIGKILL after its grace period)")
    return lines


def rerun_takes(cfg: Config) -> str:
    """Which checkpoint a rerun of the same command resumes from (checked as `resume=auto` does,
    without the checksum pass)."""
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
