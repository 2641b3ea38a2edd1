"""A zygote for the suite's Python launches: one process per pytest worker imports torch, DCP,
transformers and fsdpkit once, then forks a child for each launch (a test's rank or CLI command).

Starting a Python process that imports torch and fsdpkit costs about 5 CPU-s on the CI machine
(2 cores), and the suite starts hundreds: that start-up was ~40% of the suite's CPU. A child forked
from the zygote starts in milliseconds with the same modules imported, and otherwise runs as
`python SCRIPT ARGS` or `python -m MODULE ARGS` would: its own session, the environment, working
directory, argv and sys.path given, stdin from /dev/null, stdout/stderr into the files given, the
same exit code (1 and a traceback for an exception, the signal for a kill).

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
import signal
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
AVAILABLE = sys.platform.startswith("linux")  # fork, and /proc for the thread check; elsewhere launches start fresh
# torch._inductor.config: torch.use_deterministic_algorithms imports it (~1 CPU-s), every deterministic run.
# Not datasets: importing it starts a native thread.
PRELOAD = ("torch", "torch.distributed.checkpoint", "torch.distributed.fsdp", "torch.distributed.run",
           "torch._inductor.config", "transformers", "fsdpkit.train.run", "fsdpkit.cli.main", "fsdpkit.cli.ckpt")
# Variables read when an interpreter or a native library starts, not later: a launch that sets them
# differently from the zygote's own environment gets a fresh process.
_AT_START = ("PYTHON", "OMP_", "MKL_", "KMP_", "LD_", "MALLOC", "TORCH", "CUDA", "NCCL", "GLOO", "HF_",
             "TRANSFORMERS", "TOKENIZERS", "FAULTS_SPEC")


def forkable(env: dict[str, str], base: dict[str, str]) -> bool:
    """Whether a launch with `env` may fork from a zygote started with `base`."""
    keys = {k for k in env.keys() | base.keys() if k.startswith(_AT_START)}
    return all(env.get(k) == base.get(k) for k in keys)


class Zygote:
    """The test side: `spawn` a launch, `poll` it; `kill` is os.killpg on the pid (its own session)."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = dict(env)
        self._lock = threading.Lock()
        self._proc = subprocess.Popen([sys.executable, __file__, "--serve"],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=self.env,
                                      cwd=ROOT, start_new_session=True)
        ready = self._proc.stdout.readline()
        if json.loads(ready or "{}").get("ready") is not True:
            raise RuntimeError(f"the test zygote did not start: {ready!r}")

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
        """None while `pid` runs, then its exit code (negative: the signal that killed it)."""
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


# --- the zygote process ---------------------------------------------------------------------------

def serve() -> None:
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1 or threading.active_count() != 1:
        raise SystemExit(f"test zygote: {threads} threads after importing {PRELOAD}; forking would be unsafe")
    finished: dict[int, int] = {}
    _reply({"ready": True})
    for line in sys.stdin:
        request = json.loads(line)
        try:
            if request["op"] == "spawn":
                _reply({"pid": _fork(request)})
            else:
                pid = request["pid"]
                if pid not in finished:
                    done, status = os.waitpid(pid, os.WNOHANG)
                    if done:
                        finished[pid] = os.waitstatus_to_exitcode(status)
                _reply({"code": finished.get(pid)})
        except Exception as e:  # noqa: BLE001 - the test side raises it
            _reply({"error": f"{type(e).__name__}: {e}"})


def _reply(answer: dict) -> None:
    sys.stdout.write(json.dumps(answer) + "\n")
    sys.stdout.flush()


def _fork(request: dict) -> int:
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        code = _child(request)
    finally:
        os._exit(code)


def _child(request: dict) -> int:
    os.setsid()
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY | os.O_APPEND),
                            (2, request["stderr"], os.O_WRONLY | os.O_APPEND)):
        opened = os.open(path, flags)
        os.dup2(opened, fd)
        os.close(opened)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
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


if __name__ == "__main__" and sys.argv[1:] == ["--serve"]:
    serve()
