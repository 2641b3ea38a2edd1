"""The test zygote (tests/zygote.py) against the reference it stands in for: a fresh interpreter
running the same command. Every launch of the suite that can fork does, so a difference here would
change what the other tests see."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import zygote  # noqa: E402
from conftest import ROOT, _start, run_python  # noqa: E402

pytestmark = pytest.mark.skipif(not zygote.AVAILABLE, reason="the test zygote forks and reads /proc: Linux only")

SCRIPT = textwrap.dedent("""
    import os, sys
    print("argv", sys.argv[1:], "path0", sys.path[0], "cwd", os.getcwd(), "var", os.environ.get("ZYGOTE_PROBE"))
    print("to stderr", file=sys.stderr)
    if sys.argv[1] == "raise":
        def inner():
            raise ValueError("from the script")
        inner()
    raise SystemExit(int(sys.argv[1]) if sys.argv[1].isdigit() else sys.argv[1])
""")


def _fresh(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, cwd=cwd, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "ZYGOTE_PROBE": "seen"})


def test_a_forked_launch_is_what_a_fresh_interpreter_gives(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    env = {"ZYGOTE_PROBE": "seen"}
    assert zygote.forkable({**os.environ, "OMP_NUM_THREADS": "1", **env}, zygote.get().env)
    for arg in ("0", "3", "raise", "a message"):
        forked = run_python(str(script), arg, env=env, cwd=tmp_path, timeout=120)
        fresh = _fresh(str(script), arg, cwd=tmp_path)
        assert (forked.returncode, forked.stdout, forked.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr), arg
        assert ("ValueError: from the script" in forked.stderr) == (arg == "raise"), forked.stderr
    module = run_python("-m", "fsdpkit", "ckpt", "--help", cwd=tmp_path)
    reference = _fresh("-m", "fsdpkit", "ckpt", "--help", cwd=tmp_path)
    assert (module.returncode, module.stdout) == (reference.returncode, reference.stdout) and module.returncode == 0


def test_a_killed_launch_reports_the_signal_and_leads_its_own_session(tmp_path):
    script = tmp_path / "sleeper.py"
    script.write_text("import os, time\nprint(os.getsid(0) == os.getpid(), flush=True)\ntime.sleep(600)\n")
    log = tmp_path / "log"
    proc = _start([sys.executable, str(script)], env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=ROOT, stdout=log,
                  stderr=log)
    assert proc._popen is None  # forked, not a fresh interpreter
    while "True" not in log.read_text():
        assert proc.poll() is None, log.read_text()
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL


@pytest.mark.parametrize("variable", ["FAULTS_SPEC", "PYTHONPATH", "OMP_NUM_THREADS", "TORCH_LOGS"])
def test_an_environment_read_at_start_up_gets_a_fresh_interpreter(variable):
    base = zygote.get().env
    assert zygote.forkable({**base, "RANK": "3", "FSDPKIT_DIRECT_READ_BYTES": "0", "AWS_ENDPOINT_URL": "x"}, base)
    assert not zygote.forkable({**base, variable: "changed"}, base)
