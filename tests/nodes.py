"""Simulated nodes on one host: several torchrun launchers joined through one c10d rendezvous on
loopback, exactly as the README's multi-node section shows (one launcher per "node")."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher_cmd(*, nnodes: int, nproc_per_node: int, port: int, run_id: str, args: list[str]) -> list[str]:
    """One node's launcher: `torchrun` (as `python -m torch.distributed.run`) running `fsdpkit train`."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes),
            "--nproc-per-node", str(nproc_per_node), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id, "-m", "fsdpkit", "train", *args]


@dataclass
class Node:
    """A launcher process; its output goes to files (a pipe left unread could block it)."""

    proc: subprocess.Popen
    out: Path
    err: Path

    def stderr(self) -> str:
        return self.err.read_text(errors="replace")

    def ranks(self) -> dict[int, psutil.Process]:
        """This launcher's rank processes by global rank (known once the rendezvous is done)."""
        found = {}
        for child in psutil.Process(self.proc.pid).children(recursive=True):
            try:
                if "RANK" in (env := child.environ()) and "fsdpkit" in " ".join(child.cmdline()):
                    found[int(env["RANK"])] = child
            except psutil.Error:
                continue
        return found


def start_nodes(args: list[str], *, logs: Path, nnodes: int = 2, nproc_per_node: int = 2,
                env: dict | None = None, envs: list[dict] | None = None) -> list[Node]:
    """Start `nnodes` launchers of `nproc_per_node` ranks each; `envs[i]` adds to node i's env."""
    port, run_id = free_port(), f"fsdpkit-test-{os.getpid()}-{time.monotonic_ns()}"
    logs.mkdir(parents=True, exist_ok=True)
    nodes = []
    for i in range(nnodes):
        out, err = logs / f"node{i}.out", logs / f"node{i}.err"
        cmd = launcher_cmd(nnodes=nnodes, nproc_per_node=nproc_per_node, port=port, run_id=run_id, args=args)
        proc = subprocess.Popen(cmd, stdout=out.open("w"), stderr=err.open("w"), cwd=ROOT,
                                env={**ENV, **(env or {}), **((envs or [{}] * nnodes)[i])})
        nodes.append(Node(proc, out, err))
    return nodes


def wait_all(nodes: list[Node], *, timeout: float = 600) -> list[int]:
    """Exit codes of every launcher (kills them all if the timeout passes)."""
    deadline = time.monotonic() + timeout
    try:
        return [n.proc.wait(timeout=max(1.0, deadline - time.monotonic())) for n in nodes]
    except subprocess.TimeoutExpired:
        for n in nodes:
            kill_tree(n)
        raise


def run_nodes(args: list[str], *, logs: Path, timeout: float = 600, **kwargs) -> list[Node]:
    """Start the launchers, wait for them, and fail with their output unless all exited 0."""
    nodes = start_nodes(args, logs=logs, **kwargs)
    codes = wait_all(nodes, timeout=timeout)
    if any(codes):
        tails = "\n".join(f"--- node {i} (exit "
                          f"{c}):\n{n.stderr()[-4000:]}" for i, (n, c) in enumerate(zip(nodes, codes, strict=True)))
        raise AssertionError(f"a launcher failed: {codes}\n{tails}")
    return nodes


def kill_tree(node: Node) -> list[int]:
    """SIGKILL a launcher and every process under it, as a node losing power would; returns the
    global ranks that ran there."""
    ranks = node.ranks()
    try:
        procs = [psutil.Process(node.proc.pid), *psutil.Process(node.proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        procs = list(ranks.values())
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    node.proc.wait()
    psutil.wait_procs(procs, timeout=10)
    return sorted(ranks)
