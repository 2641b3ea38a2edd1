"""A zygote for the suite's Python launches: one process per pytest worker imports torch, DCP,
transformers and fsdpkit once, then forks a child for each launch (a test's rank or CLI command).

Starting a Python process that imports torch and fsdpkit costs about 5 CPU-s on the CI machine
(2 cores), and the suite starts hundreds: that start-up was ~40% of the suite's CPU. A child forked
from the zygote starts in milliseconds with the same modules imported, and otherwise runs as
`python SCRIPT ARGS` or `python -m MODULE ARGS` would: its own session, the environment, working
directory, argv and sys.path given, stdin from /dev/null, stdout/stderr into the files given, the
same exit code (1 and a traceback for an exception, the signal for a kill).

A forked child's own `sys.executable` launches fork too: torch's elastic agent starting the ranks of
`fsdpkit train --nproc` or torchrun, `fsdpkit resume-check` starting its launchers. The agent, its
rendezvous and its signalling are torch's own; only the rank's interpreter start-up is skipped (see
`shim`). Tests about processes themselves (a launcher killed hard, a stopped rank, a node lost:
test_preemption, test_stuck_rank, tests/nodes.py) start their launchers with subprocess, so their
ranks are fresh interpreters, children of the agent, as users run them.

What a fork cannot give is an interpreter started with another environment: a launch whose
environment changes what happens at start-up (PYTHON*, library start-up settings, an armed fault
spec that a sitecustomize reads) gets a fresh interpreter instead (`forkable`). fsdpkit reads its
own FSDPKIT_* settings at run time, not import time (fsdpkit.tunables), so those fork.

The zygote starts no thread (checked after its imports): forking a process with threads could copy
a held lock. It exits when its worker does (its stdin closes).
"""

from __future__ import annotations

import atexit
import io
import json
import os
import selectors
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Linux: fork, and /proc for the thread check. Not where an NVIDIA device is visible: CUDA cannot be
# used in a child forked after the driver was initialised, and the zygote's imports may initialise it
# (a device count); there (tests/cuda on a GPU node) every launch starts a fresh interpreter.
AVAILABLE = sys.platform.startswith("linux") and not (
    os.environ.get("CUDA_VISIBLE_DEVICES") != "" and any(Path("/dev").glob("nvidia[0-9]*")))
# torch._inductor.config: torch.use_deterministic_algorithms imports it (~1 CPU-s), every deterministic run.
# Not datasets: importing it starts a native thread.
PRELOAD = ("torch", "torch.distributed.checkpoint", "torch.distributed.fsdp", "torch.distributed.run",
           "torch._inductor.config", "transformers", "fsdpkit.train.run", "fsdpkit.cli.main", "fsdpkit.cli.ckpt")
# Variables read when an interpreter or a native library starts, not later: a launch that sets them
# differently from the zygote's own environment gets a fresh process.
_AT_START = ("PYTHON", "OMP_", "MKL_", "KMP_", "LD_", "MALLOC", "TORCH", "CUDA", "NCCL", "GLOO", "HF_",
             "TRANSFORMERS", "TOKENIZERS", "FAULTS_SPEC")
# ...except what torch's elastic agent gives each rank, which torch reads when the rank runs.
_AT_RUN = ("TORCHELASTIC_", "TORCH_NCCL_ASYNC_ERROR_HANDLING")


def forkable(env: dict[str, str], base: dict[str, str]) -> bool:
    """Whether a launch with `env` may fork from a zygote started with `base`. The zygote's import of
    torch._inductor.config sets TORCHINDUCTOR_CACHE_DIR to inductor's default where it was unset, as
    the same import does in any process of the tests (the worker's too, after a test imported it):
    that value is the zygote's own."""
    keys = {k for k in env.keys() | base.keys() if k.startswith(_AT_START) and not k.startswith(_AT_RUN)}
    return all(env.get(k) == base.get(k) or (k == _INDUCTOR_CACHE and _inductor_default(env.get(k), base.get(k)))
               for k in keys)


_INDUCTOR_CACHE = "TORCHINDUCTOR_CACHE_DIR"


def _inductor_default(a: str | None, b: str | None) -> bool:
    """One of the two values is unset and the other is inductor's default cache directory."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return {a, b} == {None, default_cache_dir()}


class Zygote:
    """The test side: `spawn` a launch, `poll` it; `kill` is os.killpg on the pid (its own session)."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = dict(env)
        self._lock = threading.Lock()
        self._proc = subprocess.Popen([sys.executable, __file__, "--serve"],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=self.env,
                                      cwd=ROOT, start_new_session=True)
        ready = self._proc.stdout.readline()
        answer = json.loads(ready or "{}")
        if answer.get("ready") is not True:
            raise RuntimeError(f"the test zygote did not start: {ready!r}")
        self.shim: str = answer["shim"]  # a forked child's sys.executable (see shim below)

    def _ask(self, request: dict) -> dict:
        with self._lock:
            self._proc.stdin.write(json.dumps(request) + "\n")
            self._proc.stdin.flush()
            answer = json.loads(self._proc.stdout.readline())
        if "error" in answer:
            raise RuntimeError(f"test zygote: {answer['error']}")
        return answer

    def spawn(self, argv: list[str], *, env: dict[str, str], cwd: Path | str, stdout: Path | str,
              stderr: Path | str) -> int:
        """Fork a child running `argv` (after the interpreter: SCRIPT ARGS or -m MODULE ARGS); its pid."""
        return self._ask({"op": "spawn", "argv": argv, "env": env, "cwd": str(cwd), "stdout": str(stdout),
                          "stderr": str(stderr)})["pid"]

    def poll(self, pid: int) -> int | None:
        """None while `pid` runs, then its exit code (negative: the signal that killed it), once: the
        zygote reaps it then, and a later poll of that pid is an error."""
        return self._ask({"op": "poll", "pid": pid})["code"]

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.close()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()


_zygote: Zygote | None = None


def get() -> Zygote:
    """This process's zygote, started on first use with the environment of the launches it serves."""
    global _zygote
    if _zygote is None:
        _zygote = Zygote({**os.environ, "OMP_NUM_THREADS": "1"})
        atexit.register(_zygote.close)
    return _zygote


def executable() -> str:
    """A `sys.executable` for a test's in-process code that launches Python itself (the checks of
    fsdpkit.cli.resume_check start `fsdpkit train` launchers): the zygote's shim, so that those
    launches and their ranks fork too, where the zygote is available; the interpreter elsewhere. The
    launch's environment must be forkable (OMP_NUM_THREADS=1, as every launch of the suite), or the
    shim starts a fresh interpreter."""
    return get().shim if AVAILABLE else sys.executable


def process_report() -> str:
    """The processes descended from this worker's zygote (a launch hung: where is each one waiting?):
    pid, parent, state, the kernel function it waits in, its pending, blocked, ignored and caught
    signals (hex masks, bit N-1 for signal N), and command line. A fork's command line is the zygote's."""
    if _zygote is None:
        return ""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    family, lines = [_zygote._proc.pid], []
    for pid in family:  # grows as children are found, breadth first
        family.extend(child for child, parent in parents.items() if parent == pid)
        try:
            with open(f"/proc/{pid}/status") as f:
                fields = dict(line.split(":\t", 1) for line in f.read().splitlines() if ":\t" in line)
            with open(f"/proc/{pid}/wchan") as f:
                wchan = f.read()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        signals = " ".join(f"{name}={fields.get(key, '?')[-8:]}" for key, name in (
            ("SigPnd", "pending"), ("SigBlk", "blocked"), ("SigIgn", "ignored"), ("SigCgt", "caught")))
        lines.append(f"{pid} parent {parents.get(pid)} {fields.get('State', '?')} in {wchan or '-'}; {signals}; "
                     f"{cmdline[:200]}")
    return "\n".join(lines)


# --- the zygote process ---------------------------------------------------------------------------

# A forked child's own launches of `sys.executable` (the ranks that torch's elastic agent starts for
# `fsdpkit train --nproc` or torchrun, the launchers of `fsdpkit resume-check`) fork from the zygote too:
# the child's sys.executable is a shim that asks the zygote for a fork over a unix socket, hands it
# its stdin/stdout/stderr, forwards the signals it gets, and exits as the forked process did. The
# shim dies with its parent (the kernel's parent-death signal) and the zygote then kills the fork, so
# nothing outlives a launcher killed hard. A command the shim does not recognise, or an environment
# that needs a fresh interpreter (`forkable`), is exec'd as the real interpreter instead.
_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
              signal.SIGABRT, signal.SIGALRM)


class _Server:
    def __init__(self, base: dict[str, str]) -> None:
        self.base = base  # the environment before the imports (torch._inductor.config sets a variable)
        self.pending = b""
        self.dir = tempfile.mkdtemp(prefix="zygote-")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.listener.bind(os.path.join(self.dir, "socket"))
        self.listener.listen(128)
        self.shim = os.path.join(self.dir, "python")
        with open(self.shim, "w") as f:
            f.write(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} -SEs {shlex.quote(__file__)} --exec "
                    f"{shlex.quote(self.listener.getsockname())} \"$@\"\n")
        os.chmod(self.shim, 0o755)
        self.sel = selectors.DefaultSelector()
        self.sel.register(0, selectors.EVENT_READ, self._from_worker)
        self.sel.register(self.listener, selectors.EVENT_READ, self._accept)
        self.shims: dict[int, tuple[socket.socket, int]] = {}  # pid -> (connection, pidfd)
        self.running = True

    def loop(self) -> None:
        try:
            while self.running:
                for key, _ in self.sel.select():
                    key.data(key)
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)

    def close_in_child(self) -> None:
        """A fork keeps none of the zygote's descriptors (a kept socket would hide a shim's exit)."""
        for conn, pidfd in self.shims.values():
            conn.close()
            os.close(pidfd)
        self.sel.close()
        self.listener.close()

    def _from_worker(self, _key) -> None:
        data = os.read(0, 1 << 16)
        if not data:  # the worker exited
            self.running = False
            return
        self.pending += data
        while b"\n" in self.pending:
            line, self.pending = self.pending.split(b"\n", 1)
            try:
                _reply(self._answer(json.loads(line)))
            except Exception as e:  # noqa: BLE001 - the test side raises it
                _reply({"error": f"{type(e).__name__}: {e}"})

    def _answer(self, request: dict) -> dict:
        if request["op"] == "spawn":
            return {"pid": self._fork(request, stdio=None)}
        # Reaped when first seen finished, and forgotten: the worker keeps the code (conftest._Process),
        # and a remembered pid would answer for a later launch that the kernel gave the same pid (pid_max
        # is 32768 here, and a suite starts more processes than that).
        done, status = os.waitpid(request["pid"], os.WNOHANG)
        return {"code": os.waitstatus_to_exitcode(status) if done else None}

    def _accept(self, _key) -> None:
        conn, _ = self.listener.accept()
        conn.settimeout(10)
        fds: list[int] = []
        try:
            message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
            request = json.loads(message)
            if len(fds) != 3 or not forkable(request["env"], self.base):
                conn.send(json.dumps({"fresh": True}).encode())
                conn.close()
                return
            pid = self._fork(request, stdio=fds, conn=conn)
        except Exception:  # noqa: BLE001 - the shim then runs a fresh interpreter
            conn.close()
            return
        finally:
            for fd in fds:
                os.close(fd)
        pidfd = os.pidfd_open(pid)
        self.shims[pid] = (conn, pidfd)
        self.sel.register(pidfd, selectors.EVENT_READ, lambda _key: self._exited(pid))
        self.sel.register(conn, selectors.EVENT_READ, lambda _key: self._shim_gone(pid))
        try:
            conn.send(json.dumps({"pid": pid}).encode())
        except OSError:
            self._shim_gone(pid)

    def _shim_gone(self, pid: int) -> None:
        conn = self.shims[pid][0]
        try:
            if conn.recv(1 << 16):
                return  # the shim sends nothing after its request; ignore it
        except OSError:
            pass
        self.sel.unregister(conn)
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def _exited(self, pid: int) -> None:
        conn, pidfd = self.shims.pop(pid)
        self.sel.unregister(pidfd)
        os.close(pidfd)
        _, status = os.waitpid(pid, 0)
        try:
            conn.send(json.dumps({"code": os.waitstatus_to_exitcode(status)}).encode())
        except OSError:
            pass  # the shim is gone
        if conn in self.sel.get_map():
            self.sel.unregister(conn)
        conn.close()

    def _fork(self, request: dict, stdio: list[int] | None, conn: socket.socket | None = None) -> int:
        pid = os.fork()
        if pid:
            return pid
        code = 1
        try:
            self.close_in_child()
            if conn is not None:
                conn.close()
            sys.executable = self.shim
            code = _child(request, stdio)
        finally:
            os._exit(code)


def serve() -> None:
    import importlib

    base = dict(os.environ)
    for name in PRELOAD:
        importlib.import_module(name)
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1 or threading.active_count() != 1:
        raise SystemExit(f"test zygote: {threads} threads after importing {PRELOAD}; forking would be unsafe")
    server = _Server(base)
    _reply({"ready": True, "shim": server.shim})
    server.loop()


def _reply(answer: dict) -> None:
    sys.stdout.write(json.dumps(answer) + "\n")
    sys.stdout.flush()


def _child(request: dict, stdio: list[int] | None) -> int:
    os.setsid()
    if stdio is None:
        stdio = [os.open(os.devnull, os.O_RDONLY), os.open(request["stdout"], os.O_WRONLY | os.O_APPEND),
                 os.open(request["stderr"], os.O_WRONLY | os.O_APPEND)]
    for fd, opened in enumerate(stdio):
        os.dup2(opened, fd)
    for opened in set(stdio) - {0, 1, 2}:
        os.close(opened)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED") or request.get("unbuffered"))
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=False, write_through=unbuffered)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), errors="backslashreplace", line_buffering=True,
                                  write_through=unbuffered)
    import runpy

    argv = request["argv"]
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path[0] = os.getcwd()
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        _print_uncaught()
        _finish()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)  # as the interpreter does: the status says SIGINT
        code = 130
    except BaseException:  # noqa: BLE001 - as an uncaught exception ends `python SCRIPT`
        _print_uncaught()
        code = 1
    _finish()
    return code


def _print_uncaught() -> None:
    """sys.excepthook with the traceback from the script's first frame (not the zygote's or runpy's)."""
    kind, value, tb = sys.exc_info()
    while tb is not None and tb.tb_frame.f_code.co_filename in (__file__, "<frozen runpy>"):
        tb = tb.tb_next
    sys.excepthook(kind, value.with_traceback(tb), tb)


def _finish() -> None:
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed stream at exit, as the interpreter ignores it
                pass


# --- the shim: a forked child's sys.executable ----------------------------------------------------

def shim(socket_path: str, args: list[str]) -> None:
    """Run `python ARGS` as a fork of the zygote at `socket_path`, or exec the real interpreter."""
    argv, unbuffered = list(args), False
    while argv[:1] == ["-u"]:
        argv, unbuffered = argv[1:], True
    # A fork gets stdin, stdout and stderr only: a launch handed other descriptors (torch inductor's
    # compile workers get pipes) runs a fresh interpreter.
    if not argv or not (argv[0] == "-m" and len(argv) > 1 or not argv[0].startswith("-")) or _inherited():
        os.execv(sys.executable, [sys.executable, *args])
    import ctypes

    libc = ctypes.CDLL(None)
    parent = os.getppid()
    libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG: die with the parent (the zygote kills the fork)
    if os.getppid() != parent:
        os._exit(1)
    # Signals are forwarded from now on; those that come before the fork exists wait for it.
    pid, early = 0, []

    def forward(signum: int, _frame) -> None:
        if not pid:
            early.append(signum)
            return
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for signum in _FORWARDED:
        signal.signal(signum, forward)
    answer: dict = {}
    try:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        conn.connect(socket_path)
        request = {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(), "unbuffered": unbuffered}
        socket.send_fds(conn, [json.dumps(request).encode()], [0, 1, 2])
        answer = json.loads(conn.recv(1 << 16) or b"{}")
    except OSError:  # no zygote (it exited): a fresh interpreter
        answer = {}
    if "pid" not in answer:
        libc.prctl(1, 0, 0, 0, 0)
        for signum in _FORWARDED:
            signal.signal(signum, signal.SIG_DFL)
        for signum in early:  # as a fresh interpreter starting would have taken it
            os.kill(os.getpid(), signum)
        os.execv(sys.executable, [sys.executable, *args])
    pid = answer["pid"]
    for signum in early:
        forward(signum, None)
    message = conn.recv(1 << 16)
    code = json.loads(message)["code"] if message else 1  # no message: the zygote exited
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        code = 128 - code
    os._exit(code)


def _inherited() -> list[int]:
    """Open descriptors besides 0, 1 and 2 (the listing's own is closed by the time it is checked)."""
    found = []
    for fd in map(int, os.listdir("/proc/self/fd")):
        try:
            if fd > 2 and os.fstat(fd):
                found.append(fd)
        except OSError:
            pass
    return found


if __name__ == "__main__" and sys.argv[1:] == ["--serve"]:
    serve()
elif __name__ == "__main__" and sys.argv[1:2] == ["--exec"]:
    shim(sys.argv[2], sys.argv[3:])
