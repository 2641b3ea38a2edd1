"""B9: what the coordinating rank costs a save and a resume, from 2 real ranks to 4,096 simulated.

The state has a 70B Llama's tensor count (723 parameters, AdamW's exp_avg, exp_avg_sq and step for
each, param-group entries, each rank's RNG: ~2,900 DCP items), every tensor tiny (~13 MB in all):
the coordinator's cost grows with tensors x ranks, not with bytes (coordinator_state.py).

Real ranks (2, 4, 8, 16 gloo processes on this host; coordinator_worker.py): fsdpkit's save
(save_checkpoint) and resume (resolve_checkpoint + load_checkpoint with a pass that checks every
file's checksum first, as a Checkpointer does) beside plain dcp.save / dcp.load of the same state
dict. Rank 0 measures wall and CPU time outside the storage writer's write_data, the reader's
read_data and that checksum pass (the rest is planning, gathers, metadata, manifest, commit), the
pickled bytes of the
object collectives, `.metadata` and `manifest.json` sizes and its peak RSS; the first save apart,
then medians of the repeats.

Simulated ranks (256, 1,024, 4,096; coordinator_sim.py): rank 0's own coordinator code run on the
inputs that many ranks would send it, in one process under torch's fake process group. How this
maps to a cluster and what it leaves out: rank 0's work is real (DCP's global planning and
metadata, fsdpkit's commit, manifest and resolution); the gathers are rank 0 unpickling N
payloads. Left out: the network latency and bandwidth of the gathers (bytes are reported),
storage latency, the other ranks' planning (parallel on a cluster), stragglers.

Usage: python bench/coordinator.py [--quick] [--ranks 2,4,8,16] [--sim 256,1024,4096] [--repeats 5] [--sim-repeats N]
Writes bench/results/coordinator.json (markdown included; results_md.py quotes it as B9).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from coordinator_report import render

HERE = Path(__file__).parent
RESULTS = HERE / "results" / "coordinator.json"
STATE = ("70B-Llama-shaped, every dimension / 256: 723 parameters + AdamW exp_avg, exp_avg_sq, step "
         "(2,892 tensors) + param groups + per-rank RNG, ~13 MB; FSDP2 fully_shard per layer")


def _env() -> dict[str, str]:
    src = str(HERE.parent / "src")
    return dict(os.environ, PYTHONPATH=os.pathsep.join([src, str(HERE), os.environ.get("PYTHONPATH", "")]))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def real_ranks(world: int, *, repeats: int, timeout_s: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix=f"b9_real{world}_") as tmp:
        out, port = Path(tmp) / "rank0.json", _port()
        procs = [subprocess.Popen([sys.executable, str(HERE / "coordinator_worker.py"), "--rank", str(r),
                                   "--world", str(world), "--port", str(port), "--dir", str(Path(tmp) / "ckpt"),
                                   "--repeats", str(repeats), "--out", str(out)], env=_env())
                 for r in range(world)]
        deadline = time.monotonic() + timeout_s
        try:
            codes = [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        if any(codes) or not out.is_file():
            raise RuntimeError(f"{world} real ranks failed (exit codes {codes})")
        return json.loads(out.read_text())


def simulated(world: int, *, repeats: int, timeout_s: float) -> dict[str, Any]:
    tmp = tempfile.mkdtemp(prefix=f"b9_sim{world}_")
    try:
        out = Path(tmp) / "sim.json"
        subprocess.run([sys.executable, str(HERE / "coordinator_sim.py"), "--world", str(world), "--repeats",
                        str(repeats), "--dir", str(Path(tmp) / "ckpt"), "--out", str(out)], env=_env(), check=True,
                       timeout=timeout_s)
        return json.loads(out.read_text())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smoke test: 2 real ranks, 16 simulated, 2 repeats")
    p.add_argument("--ranks", default="2,4,8,16")
    p.add_argument("--sim", default="256,1024,4096")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--timeout", type=float, default=3600, help="seconds per launch")
    p.add_argument("--sim-repeats", type=int, help="saves and resumes per method in a simulation (default: "
                   "repeats // 2 + 1, at least 2; 1 runs DCP once and fsdpkit's first and one cached save)")
    p.add_argument("--note", default="2-core VM shared with other jobs, every process at nice 19: absolute "
                                     "times are inflated and noisy; compare fsdpkit with DCP within a row")
    args = p.parse_args()
    if args.quick:
        args.ranks, args.sim, args.repeats = "2", "16", 2
    data: dict[str, Any] = {"state": STATE, "machine_note": args.note, "repeats": args.repeats, "real": [],
                            "sim": [], "failures": []}
    for world in map(int, filter(None, args.ranks.split(","))):
        t0 = time.monotonic()
        try:
            data["real"].append(real_ranks(world, repeats=args.repeats, timeout_s=args.timeout))
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            data["failures"].append(f"{world} real ranks: {e}")
        print(f"B9: {world} real ranks in {time.monotonic() - t0:.0f} s", flush=True)
    for world in map(int, filter(None, args.sim.split(","))):
        t0 = time.monotonic()
        try:
            data["sim"].append(simulated(world, repeats=args.sim_repeats or max(2, args.repeats // 2 + 1),
                                         timeout_s=args.timeout))
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
            data["failures"].append(f"{world} simulated ranks: {e}")
        print(f"B9: {world} simulated ranks in {time.monotonic() - t0:.0f} s", flush=True)
    data["markdown"], data["targets"] = render(data)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(data, indent=1))
    print(data["markdown"])


if __name__ == "__main__":
    main()
