"""Shared test helpers: launching real gloo ranks (directly, or through torchrun), the CLI, shared fixtures."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

import zygote

ROOT = Path(__file__).resolve().parents[1]

# A background job of a non-interactive shell (`make test &` in a script) starts with SIGINT and SIGQUIT
# ignored, and an ignored signal stays ignored through fork and exec: every launch of the suite would
# then ignore the SIGINT a test sends it and run on (test_zygote's "wait" case hung 120 s in each such
# run, forked or fresh). Launches start as they would from a terminal: both signals at their defaults.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
if signal.getsignal(signal.SIGQUIT) == signal.SIG_IGN:
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)


def pytest_addoption(parser) -> None:
    parser.addoption("--no-zygote", action="store_true",
                     help="start every launch (test ranks, CLI commands, their launchers) as a fresh interpreter, "
                          "as users run them, instead of forking it from the per-worker zygote (tests/zygote.py): "
                          "slower, and the plain way to debug a hang. `make test PYTEST_ARGS=--no-zygote`")


def pytest_configure(config) -> None:
    if config.getoption("--no-zygote"):
        zygote.AVAILABLE = False  # every launch then starts fresh; test_zygote.py skips itself


def pytest_collection_modifyitems(config, items) -> None:
    """The files that launch ranks or the CLI (marked dist or e2e: most of the suite's time, a few tests
    each) run first, the rest after, each group in collection order. `make test` runs with xdist's
    --dist loadfile --no-loadscope-reorder: each worker then takes long files first and ends on short
    unit tests, where xdist's own order (most tests first) leaves one worker finishing a long file
    alone (gw0 946 s against gw1 858 s of tests in one run; in this order the next quiet run had
    798 s against 791 s)."""
    launches = {item.path for item in items if item.get_closest_marker("dist") or item.get_closest_marker("e2e")}
    items.sort(key=lambda item: item.path not in launches)  # stable: the order within each group is kept


def torchrun(nproc: int, script: Path, *args: str, timeout: float = 600, env: dict | None = None,
             elastic: bool = False) -> subprocess.CompletedProcess:
    """Run `script` on `nproc` local gloo ranks; fail the test with every rank's output on error.

    Test workers need no elastic agent: by default the ranks are started directly (`_launch_ranks`),
    which saves torch.distributed.run's own process, ~3 CPU-s and ~3 s per call. `elastic=True` goes
    through torch.distributed.run, for scripts that users launch with torchrun themselves.
    """
    if not elastic:
        return _launch_ranks(nproc, [sys.executable, str(script), *args], env={**os.environ, "OMP_NUM_THREADS": "1",
                                                                              **(env or {})}, timeout=timeout)
    proc = run_python("-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(script), *args,
                      env=env, timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(f"torchrun {script.name} {' '.join(args)} failed ({proc.returncode}):\n"
                    f"{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}")
    return proc


def _launch_ranks(nproc: int, cmd: list[str], *, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """Start `cmd` once per rank with the variables torchrun gives a single-node worker (no
    TORCHELASTIC_*: fsdpkit then uses the plain env:// rendezvous), wait for all; when one fails, or at
    `timeout`, kill every rank (and its children: each rank leads its own session) and fail the test
    with each rank's exit code or signal and output. Returns all ranks' output, rank by rank.
    Each rank is forked from the test zygote where its environment allows (tests/zygote.py)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ranks: list[_Process] = []
    with tempfile.TemporaryDirectory(prefix="ranks-") as logs:
        try:
            for rank in range(nproc):
                # a file, not a pipe: a chatty rank never blocks on a full pipe
                log = Path(logs) / f"rank{rank}.log"
                rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
                            "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                            "MASTER_PORT": str(port), "PYTHONUNBUFFERED": "1"}
                ranks.append(_start(cmd, env=rank_env, cwd=ROOT, stdout=log, stderr=log))
            deadline = time.monotonic() + timeout
            while (codes := [p.poll() for p in ranks]).count(0) < nproc:
                if any(c not in (None, 0) for c in codes) or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
        finally:
            codes = [p.poll() for p in ranks]
            for p in ranks:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        outputs = [(Path(logs) / f"rank{r}.log").read_text(errors="replace") for r in range(nproc)]
    if codes.count(0) == nproc:
        return subprocess.CompletedProcess(cmd, 0, stdout="".join(outputs), stderr="")
    why = "another rank failed" if any(c not in (None, 0) for c in codes) else f"timeout after {timeout:g} s"
    status = {None: f"killed by the launcher ({why})", 0: "exit code 0"}

    def describe(c: int | None) -> str:
        return status.get(c) or (f"killed by {signal.Signals(-c).name}" if c < 0 else f"exit code {c}")

    report = "\n".join(f"--- rank {r}: {describe(c)}\n{out[-6000:]}"
                        for r, (c, out) in enumerate(zip(codes, outputs, strict=True)))
    pytest.fail(f"{' '.join(cmd[1:])} on {nproc} ranks failed:\n{report}")


class _Process:
    """A launch forked from the test zygote, or a fresh interpreter: poll, wait, pid (its session)."""

    def __init__(self, pid: int, popen: subprocess.Popen | None = None) -> None:
        self.pid, self._popen, self.returncode = pid, popen, None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._popen.poll() if self._popen else zygote.get().poll(self.pid)
        return self.returncode

    def wait(self) -> int:
        while self.poll() is None:
            time.sleep(0.02)
        return self.returncode


def _start(cmd: list[str], *, env: dict, cwd: Path, stdout: Path, stderr: Path) -> _Process:
    """`cmd` ([sys.executable, SCRIPT or -m MODULE, ARGS...]) in its own session, output appended to
    the files; forked from the zygote unless its environment needs a fresh interpreter."""
    stdout.touch()  # before the launch, so its output files exist even if it is killed at once
    stderr.touch()
    if cmd[0] == sys.executable and zygote.AVAILABLE and zygote.forkable(env, (forker := zygote.get()).env):
        return _Process(forker.spawn(cmd[1:], env=env, cwd=cwd, stdout=stdout, stderr=stderr))
    with open(stdout, "ab") as out, open(stderr, "ab") as err:
        popen = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env, cwd=cwd,
                                 start_new_session=True)
    return _Process(popen.pid, popen)


class LaunchTimedOut(subprocess.TimeoutExpired):
    """A launch of run_python that ran past its timeout: its message shows what it printed and, for a
    forked launch, the zygote's processes as they were at the timeout, before the kill."""

    def __init__(self, cmd, timeout, *, output: str, stderr: str, processes: str) -> None:
        super().__init__(cmd, timeout, output=output, stderr=stderr)
        self.processes = processes

    def __str__(self) -> str:
        text = (f"{super().__str__()}\n--- stdout (end) ---\n{self.output[-3000:]}\n"
                f"--- stderr (end) ---\n{self.stderr[-3000:]}")
        return text + (f"\n--- the zygote's processes ---\n{self.processes}" if self.processes else "")


def run_python(*argv: str, env: dict | None = None, timeout: float = 600,
               cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`python ARGV` (SCRIPT ARGS or -m MODULE ARGS) with OMP_NUM_THREADS=1 and `env` on top of this
    process's environment, as subprocess.run(..., capture_output=True, text=True) would run it: forked
    from the test zygote where the environment allows (tests/zygote.py), in its own session. Returns
    the completed process (no check); at `timeout` the session is killed (a launcher and its ranks)
    and subprocess.TimeoutExpired raised with the output so far."""
    cmd = [sys.executable, *argv]
    with tempfile.TemporaryDirectory(prefix="run-") as logs:
        out, err = Path(logs) / "stdout", Path(logs) / "stderr"
        proc = _start(cmd, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, cwd=cwd or ROOT, stdout=out,
                      stderr=err)
        deadline = time.monotonic() + timeout
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        if proc.returncode is None:
            processes = zygote.process_report() if proc._popen is None else ""
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise LaunchTimedOut(cmd, timeout, output=out.read_text(errors="replace"),
                                 stderr=err.read_text(errors="replace"), processes=processes)
        return subprocess.CompletedProcess(cmd, proc.returncode, out.read_text(errors="replace"),
                                           err.read_text(errors="replace"))


def fsdpkit(*args: str, timeout: float = 600, cwd: Path | None = None,
            env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the fsdpkit CLI as a user would (`python -m fsdpkit ARGS`, see run_python); no check."""
    return run_python("-m", "fsdpkit", *args, timeout=timeout, cwd=cwd, env=env)


@pytest.fixture(scope="session")
def training_results(tmp_path_factory) -> dict[int, dict]:
    """The scenarios of tests/multirank/train_worker.py at world sizes 1, 2, 3 (the uneven global
    batches only) and 4, run once per session."""
    out = tmp_path_factory.mktemp("training")
    results = {}
    for ws in (1, 2, 3, 4):
        path = out / f"ws{ws}.json"
        torchrun(ws, ROOT / "tests" / "multirank" / "train_worker.py", str(path), str(out / f"runs{ws}"))
        results[ws] = json.loads(path.read_text())
    return results


EXAMPLE_DATA = ROOT / "examples" / "finetune" / "data"


@pytest.fixture(scope="session")
def hf_tokenizer_dir(tmp_path_factory) -> Path:
    """A byte-level BPE tokenizer (with a chat template) trained on the example's data, saved as a
    transformers folder: what a user passes as data.tokenizer (no download)."""
    from fsdpkit.data.tokenizer import train_bpe_tokenizer

    texts = [json.loads(line)["text"] for line in open(EXAMPLE_DATA / "text.jsonl")]
    texts += [m["content"] for line in open(EXAMPLE_DATA / "chat.jsonl") for m in json.loads(line)["messages"]]
    out = tmp_path_factory.mktemp("tokenizer")
    train_bpe_tokenizer(texts, vocab_size=512, out_dir=out)
    return out


@pytest.fixture(scope="session")
def s3():
    """moto's S3 server on loopback for the session (tests/s3_server.py)."""
    from s3_server import s3_server

    with s3_server() as server:
        yield server


@pytest.fixture
def tune() -> Iterator[Callable[..., object]]:
    """`tune(read_restart_bytes=4096, ...)`: fsdpkit.tunables overridden from then until the test ends
    (calls nest; the environment is not touched)."""
    from fsdpkit import tunables

    with ExitStack() as stack:
        yield lambda **values: stack.enter_context(tunables.override(**values))


@pytest.fixture
def world_of_one(monkeypatch):
    """A gloo process group of one rank in this process (fsdpkit.dist.init_process_group), torn down
    afterwards: the collectives run for real, in seconds."""
    import socket

    import torch.distributed as tdist

    from fsdpkit import dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(key, value)  # init_process_group reads them (and sets them when absent)
    dist.init_process_group(backend="gloo")
    yield
    tdist.destroy_process_group()
