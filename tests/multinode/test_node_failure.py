"""A node dies: two launchers on loopback train HSDP 2x2; one launcher is SIGKILLed with its ranks,
once in the middle of a step and once in the middle of a save. The other node's ranks must exit
within the configured bound, saying which ranks were lost; `latest` must stay on the last
committed checkpoint; rerunning both launchers must resume exactly."""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import psutil
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from faults import env as faults_env  # noqa: E402
from faults import fired, kill_mid_write, mid_tensor_bytes  # noqa: E402
from fsdpkit.train.metrics import read_records  # noqa: E402
from nodes import Node, kill_tree, run_nodes, start_nodes, wait_all  # noqa: E402

pytestmark = pytest.mark.multinode
STEPS, EVERY = 20, 5
PG_TIMEOUT_S, EXCEPTION_TIMEOUT_S, SAVE_TIMEOUT_S = 30, 10, 30
# A rank learns of a lost peer when its next collective fails: at once when the peer's sockets
# close (a killed process), else after the process-group timeout (PG_TIMEOUT_S; a save's
# collectives: SAVE_TIMEOUT_S). Then the on_exception vote and the probe that names the lost ranks
# take at most EXCEPTION_TIMEOUT_S each, then teardown. Slack for a loaded 2-core machine on top.
BOUND_S = max(PG_TIMEOUT_S, SAVE_TIMEOUT_S) + 2 * EXCEPTION_TIMEOUT_S + 30
ARGS = ["deterministic=true", f"train.max_steps={STEPS}", "train.global_batch_size=16", "train.micro_batch_size=2",
        "train.progress=false", "train.eval_every=0", "model.vocab_size=1001",
        "strategy.sharding_strategy=HYBRID_SHARD", "strategy.hsdp_shard_size=2",
        f"checkpoint.every_steps={EVERY}", f"checkpoint.timeout_s={SAVE_TIMEOUT_S}",
        f"checkpoint.exception_timeout_s={EXCEPTION_TIMEOUT_S}", f"dist.timeout_s={PG_TIMEOUT_S}"]
ENV: dict[str, str] = {}  # added to every launcher's environment


def last_step(run: Path) -> int:
    try:
        records = read_records(run)
    except FileNotFoundError:
        return 0
    return records[-1]["step"] if records else 0


def rank_map(nodes: list[Node], timeout: float = 300) -> list[dict[int, psutil.Process]]:
    """Each node's ranks, once the rendezvous has placed all of them (c10d decides who is first)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [n.ranks() for n in nodes]
        if sorted(r for f in found for r in f) == [0, 1, 2, 3]:
            return found
        if any(n.proc.poll() is not None for n in nodes):
            break
        time.sleep(0.1)
    raise AssertionError("the two launchers did not start 4 ranks:\n" + "\n".join(n.stderr()[-3000:] for n in nodes))


def latest(run: Path) -> str:
    return (run / "checkpoints" / "latest").read_text().strip()


def resume_steps(run: Path) -> list[int]:
    return [e["step"] for e in read_records(run, events=True) if e["event"] == "resume"]


def survivors_exit(survivor: Node, ranks: dict[int, psutil.Process], since: float) -> tuple[float, int]:
    """(seconds until the surviving node's last rank exited, its launcher's exit code)."""
    gone, alive = psutil.wait_procs(list(ranks.values()), timeout=BOUND_S + 60)
    ranks_done = time.monotonic() - since
    for p in alive:
        p.kill()
    code = wait_all([survivor], timeout=120)[0]
    assert not alive, f"ranks still running {BOUND_S + 60} s after the node died"
    return ranks_done, code


def assert_names_lost_ranks(text: str, lost: list[int]) -> None:
    names = ", ".join(str(r) for r in lost)
    assert re.search(rf"lost rank\(s\) {names}\b", text), (
        f"no message naming the lost ranks {lost} in the surviving node's output:\n{text[-4000:]}")


def test_a_node_dies_mid_step_and_mid_save_and_both_launchers_resume_exactly(tmp_path):
    full, run = tmp_path / "full", tmp_path / "run"
    run_nodes([*ARGS, f"run_dir={full}"], logs=tmp_path / "logs_full", env=ENV)
    figures = {}

    # 1. Mid-step: the node holding rank 0 (and the rendezvous' first launcher, often) dies.
    nodes = start_nodes([*ARGS, f"run_dir={run}"], logs=tmp_path / "logs_step", env=ENV)
    placement = rank_map(nodes)
    victim = 0 if 0 in placement[0] else 1
    while last_step(run) < EVERY + 2:  # past the save at step 5, well before the one at 10
        assert all(n.proc.poll() is None for n in nodes), nodes[0].stderr()[-3000:] + nodes[1].stderr()[-3000:]
        time.sleep(0.02)
    t0 = time.monotonic()
    kill_tree(nodes[victim])
    lost = sorted(placement[victim])
    figures["step"] = survivors_exit(nodes[1 - victim], placement[1 - victim], t0)
    assert figures["step"][0] < BOUND_S and figures["step"][1] != 0
    assert latest(run) == f"step_{EVERY}" and not (run / "checkpoints" / f"step_{2 * EVERY}").exists()
    step_failure = nodes[1 - victim].stderr()

    # 2. Mid-save: both launchers rerun (auto-resume from step 5); rank 3 dies halfway through the
    # tensor bytes of its step-15 shard (sized like its step-5 one), and the rest of its node is
    # killed with it.
    first_tensor, size, after = mid_tensor_bytes(run / "checkpoints" / f"step_{EVERY}", rank=3)
    marker = tmp_path / "faults.jsonl"
    nodes = start_nodes([*ARGS, f"run_dir={run}"], logs=tmp_path / "logs_save",
                        env={**ENV, **faults_env(kill_mid_write(step=3 * EVERY, rank=3, after_bytes=after),
                                                 marker=marker)})
    placement = rank_map(nodes)
    victim = 0 if 3 in placement[0] else 1
    psutil.wait_procs([placement[victim][3]], timeout=600)
    t0 = time.monotonic()
    kill_tree(nodes[victim])
    lost_in_save = sorted(placement[victim])
    figures["save"] = survivors_exit(nodes[1 - victim], placement[1 - victim], t0)
    (kill,) = fired(marker)  # rank 3 died where it should: inside the tensor bytes of its step-15 shard
    assert (kill["step"], kill["rank"], kill["file"]) == (3 * EVERY, 3, "__3_0.distcp"), kill
    assert first_tensor < kill["bytes_written"] == after < size, (kill, first_tensor, size)
    assert resume_steps(run) == [EVERY]
    assert figures["save"][0] < BOUND_S and figures["save"][1] != 0
    partial = run / "checkpoints" / f"step_{3 * EVERY}"
    assert partial.is_dir() and not (partial / "manifest.json").exists()
    assert latest(run) == f"step_{2 * EVERY}"
    save_failure = nodes[1 - victim].stderr()

    # 3. Both launchers rerun: resume from step 10 (skipping the uncommitted step 15), exactly.
    run_nodes([*ARGS, f"run_dir={run}"], logs=tmp_path / "logs_rerun", env=ENV)
    assert resume_steps(run) == [EVERY, 2 * EVERY]
    assert latest(run) == f"step_{STEPS}"
    manifest = json.loads((run / "checkpoints" / f"step_{STEPS}" / "manifest.json").read_text())
    assert manifest["mesh"]["shape"] == [2, 2] and manifest["world_size"] == 4
    want = {r["step"]: (r["loss"], r["grad_norm"]) for r in read_records(full)}
    got = {r["step"]: (r["loss"], r["grad_norm"]) for r in read_records(run)}  # a later record wins
    assert sorted(got) == list(range(1, STEPS + 1)) and got == want  # bit-identical, every step

    print(f"survivors' ranks exited {figures['step'][0]:.1f} s after the node died mid-step, "
          f"{figures['save'][0]:.1f} s mid-save (bound {BOUND_S} s)")
    assert_names_lost_ranks(step_failure, lost)
    assert_names_lost_ranks(save_failure, lost_in_save)
