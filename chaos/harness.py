"""Process plumbing for the chaos suite: launch `fsdpkit train` as a user does, find its ranks,
signal them, wait for steps and saves, and judge a finished run against an uninterrupted one."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from fsdpkit.train.metrics import read_records

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
MAX_STEPS = 24
BASE = ["experiment=demo", "deterministic=true", f"train.max_steps={MAX_STEPS}", "train.eval_every=0",
        "train.progress=false", "checkpoint.every_steps=2", "diagnostics.memory_steps=0"]
# The bounds a stuck or dead rank must be gone within: every wait is at most one of these.
TIMEOUTS = ["dist.timeout_s=10", "checkpoint.timeout_s=10", "checkpoint.exception_timeout_s=5"]
LAUNCHER_GRACE_S = 30  # torch's launcher: SIGTERM, then SIGKILL after its shutdown timeout
EXIT_BOUND_S = 10 + 5 + LAUNCHER_GRACE_S + 30  # + slack: heartbeat report, teardown, a loaded machine


@dataclass
class Outcome:
    """One trial of one case."""

    case: str
    trial: int
    seed: int
    ok: bool
    detail: str = ""
    exercised: bool = True  # False: the fault did not land where the case names it; neither a pass nor a fail
    exit_s: list[float] = field(default_factory=list)  # signal -> every process gone
    kills: int = 0
    kills_in_save: int = 0
    restarts: int = 0


class Job:
    """One `fsdpkit train` launch (launcher + ranks), its output in log files beside the run."""

    def __init__(self, run: Path, *args: str, nproc: int = 2, extra: tuple[str, ...] = (), env: dict | None = None,
                 prefix: list[str] | None = None, tag: str = "job"):
        self.run = run
        run.parent.mkdir(parents=True, exist_ok=True)
        n = len(list(run.parent.glob(f"{run.name}.{tag}*.err")))
        self.err_path = run.parent / f"{run.name}.{tag}{n}.err"
        cmd = [*(prefix or []), sys.executable, "-m", "fsdpkit", "train", "--nproc", str(nproc), *extra, *BASE, *args,
               f"run_dir={run}"]
        self._err = self.err_path.open("w")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self._err, env={**ENV, **(env or {})},
                                     cwd=ROOT, start_new_session=True)
        self.t0 = time.monotonic()

    def processes(self) -> list[psutil.Process]:
        """The launcher and everything under it (the ranks live in sessions of their own)."""
        try:
            me = psutil.Process(self.proc.pid)
            return [me, *me.children(recursive=True)]
        except psutil.Error:
            return []

    def rank(self, r: int) -> psutil.Process | None:
        for p in self.processes()[1:]:
            with contextlib.suppress(psutil.Error):
                if p.environ().get("RANK") == str(r) and "fsdpkit" in " ".join(p.cmdline()):
                    return p
        return None

    def wait_for(self, predicate, *, timeout: float = 300, poll: float = 0.01) -> bool:
        """True once predicate() holds; False if the job ended or the time ran out first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return True
            if self.proc.poll() is not None:
                return predicate()
            time.sleep(poll)
        return False

    def wait_step(self, step: int, **kw) -> bool:
        return self.wait_for(lambda: last_step(self.run) >= step, **kw)

    def kill_all(self) -> None:
        for p in self.processes():
            with contextlib.suppress(psutil.Error):
                p.kill()
        self.finish(timeout=30)

    def gone_after(self, procs: list[psutil.Process], *, t_signal: float, timeout: float) -> float | None:
        """Seconds from t_signal until every process in procs ended (None: one was alive at timeout).
        The launcher is waited for through Popen (psutil would reap it and lose its exit code)."""
        deadline = t_signal + timeout
        try:
            self.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return None
        others = [p for p in procs if p.pid != self.proc.pid]
        _, alive = psutil.wait_procs(others, timeout=max(0.0, deadline - time.monotonic()))
        return None if alive else time.monotonic() - t_signal

    def finish(self, *, timeout: float = 600) -> int:
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in self.processes():
                with contextlib.suppress(psutil.Error):
                    p.kill()
            rc = self.proc.wait()
        self._err.close()
        return rc

    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")


def last_step(run: Path) -> int:
    try:
        steps = [r["step"] for r in read_records(run)]
    except (FileNotFoundError, json.JSONDecodeError, ValueError):
        return 0
    return steps[-1] if steps else 0


def ckpt_root(run: Path) -> Path:
    return run / "checkpoints"


def uncommitted(run: Path, *, since: float = 0.0) -> set[str]:
    """Step directories without a manifest: saves in progress (or abandoned by a kill). With `since`
    (a time.time()), only those written in after it: a kill's debris stays until a later save of
    that step removes it and makes the directory anew."""
    root = ckpt_root(run)
    if not root.is_dir():
        return set()
    found = set()
    for p in root.glob("step_*"):
        with contextlib.suppress(FileNotFoundError):  # a save's clean-up or swap-in may remove it meanwhile
            if p.is_dir() and not (p / "manifest.json").exists() and p.stat().st_mtime >= since:
                found.add(p.name)
    return found


def latest_manifest(run: Path) -> dict | None:
    root = ckpt_root(run)
    try:
        return json.loads((root / (root / "latest").read_text().strip() / "manifest.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None


def resumes(run: Path) -> list[int]:
    try:
        return [e["step"] for e in read_records(run, events=True) if e.get("event") == "resume"]
    except FileNotFoundError:
        return []


def tensor_hashes(manifest: dict) -> dict[str, str]:
    return {k: v["hash"] for k, v in manifest["tensors"].items()}


@dataclass
class Reference:
    """The uninterrupted run every trial must equal."""

    steps: dict[int, tuple[float, float]]
    final_hashes: dict[str, str]

    @classmethod
    def build(cls, run: Path) -> Reference:
        """Run it, unless `run` already holds a finished reference (a --work-dir used again)."""
        manifest = latest_manifest(run)
        if manifest is None or manifest["step"] != MAX_STEPS or not (run / "summary.json").is_file():
            shutil.rmtree(run, ignore_errors=True)
            job = Job(run, tag="ref")
            rc = job.finish()
            if rc != 0:
                raise SystemExit(f"chaos: the uninterrupted reference run failed (exit {rc}); see {job.err_path}")
            manifest = latest_manifest(run)
        return cls(steps=steps_of(run), final_hashes=tensor_hashes(manifest))

    def judge(self, run: Path) -> str:
        """'' when `run` ended bit-identical to the reference (every step's loss and grad norm, the
        final checkpoint's tensor hashes), else what differs."""
        got = steps_of(run)
        if sorted(got) != sorted(self.steps):
            missing = sorted(set(self.steps) - set(got))
            return f"steps missing from metrics: {missing[:5]}{'...' if len(missing) > 5 else ''}"
        bad = [s for s in self.steps if got[s] != self.steps[s]]
        if bad:
            s = bad[0]
            return f"{len(bad)} step(s) differ, first step {s}: loss/grad_norm {got[s]} vs {self.steps[s]}"
        manifest = latest_manifest(run)
        if manifest is None or manifest["step"] != MAX_STEPS:
            return f"latest is not the final step {MAX_STEPS}"
        if tensor_hashes(manifest) != self.final_hashes:
            return "the final checkpoint's tensors differ from the reference's"
        return ""


def steps_of(run: Path) -> dict[int, tuple[float, float]]:
    """(loss, grad_norm) by step; a later record of a step (after a resume) wins."""
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in read_records(run)}


def signal_name(sig: int) -> str:
    return signal.Signals(sig).name
