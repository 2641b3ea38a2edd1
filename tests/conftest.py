"""Shared test helpers: launching real gloo ranks through torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def torchrun(nproc: int, script: Path, *args: str, timeout: float = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `script` on `nproc` local gloo ranks; fail the test with the ranks' output on error."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(script), *args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=ROOT)
    if proc.returncode != 0:
        pytest.fail(f"torchrun {script.name} {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}")
    return proc


def fsdpkit(*args: str, timeout: float = 600, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run the fsdpkit CLI as a user would; returns the completed process (no check)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "fsdpkit", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=cwd or ROOT)


@pytest.fixture(scope="session")
def training_results(tmp_path_factory) -> dict[int, dict]:
    """The scenarios of tests/multirank/train_worker.py at world sizes 1, 2 and 4, run once per session."""
    out = tmp_path_factory.mktemp("training")
    results = {}
    for ws in (1, 2, 4):
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
    """`tune(write_piece_bytes=4, ...)`: fsdpkit.tunables overridden from then until the test ends
    (calls nest; the environment is not touched)."""
    from fsdpkit import tunables

    with ExitStack() as stack:
        yield lambda **values: stack.enter_context(tunables.override(**values))


def opens_o_direct(folder: Path) -> bool:
    """Whether a new file in `folder` opens with O_DIRECT (fsdpkit's probe; the probe file is removed)."""
    from fsdpkit.checkpoint import direct_io

    made, probe = tempfile.mkstemp(prefix=".o_direct_probe_", dir=folder)  # a new file of ours
    os.close(made)
    try:
        fd = direct_io.open_direct(probe, os.O_WRONLY)
        if fd is None:
            return False
        os.close(fd)
        return True
    finally:
        os.unlink(probe)


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
