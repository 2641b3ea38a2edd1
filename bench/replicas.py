"""B11: replicas read once. Resume under HYBRID_SHARD 2x2 on 4 gloo ranks, today's path (every rank
reads its own shards, so each replica group reads the whole checkpoint) against read-once
(checkpoint/replicas.py: replicate coordinate 0 reads, the others receive), side by side in one launch.

The state: fp32 Linear layers + AdamW state totalling about --size-mib, fully_shard per layer on a
(replicate=2, shard=2) mesh, saved once to local disk and once to moto's S3 server (run here, in
this process, behind a WSGI wrapper that counts the bytes of every GET response it sends). Then
--runs loads of each path per storage, in alternating order (today first on even runs), each into
scrambled state (parameters and optimizer state zeroed), the local files' pages evicted first
(posix_fadvise DONTNEED). Per load:
- bytes read, counted from outside fsdpkit: local disk, every rank's /proc/self/io `rchar` delta
  (every read syscall: the checkpoint's files, and anything else the rank reads) and the bytes that
  came through DCP's file system streams (wrapped here); S3, the server's GET bytes. As a multiple
  of the checkpoint's bytes (every file the manifest lists);
- time: the slowest rank's `load_checkpoint` (verify=True: the post-load tensor checksums; without
  the file checksum pass, measured once per storage on its own as `verify_files`, which reads each
  byte once on either path);
- bitwise: every rank's local shards and the optimizer step equal to what was saved.

Usage: python bench/replicas.py [--size-mib 256] [--runs 5] [--json bench/results/replicas.json]
(launches its own 4 ranks through torch.distributed.run; the `worker` argument is theirs)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

MIB = 2**20
RESULTS = Path(__file__).parent / "results" / "replicas.json"
COUNTER = "/__bench/get_bytes"
KINDS = ("distcp", "metadata", "other")


# --- the orchestrator: moto's S3 server with a GET byte counter, the launch, the report ----------------------------

def start_counting_s3() -> tuple[object, dict[str, str]]:
    """moto's S3 app served on loopback behind a wrapper counting GET response bytes by kind."""
    import socket

    from moto.moto_server.threaded_moto_server import MotoRequestHandler
    from moto.server import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import make_server

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # a line per request otherwise
    app, counts, lock = DomainDispatcherApplication(create_backend_app), {}, threading.Lock()

    def counting(environ, start_response):
        if environ["PATH_INFO"] == COUNTER:
            start_response("200 OK", [("Content-Type", "application/json")])
            with lock:
                return [json.dumps(counts).encode()]
        body = app(environ, start_response)
        if environ["REQUEST_METHOD"] != "GET":
            return body
        path = environ["PATH_INFO"]
        kind = "distcp" if path.endswith(".distcp") else "metadata" if path.endswith(".metadata") else "other"
        chunks = list(body)
        with lock:
            counts[kind] = counts.get(kind, 0) + sum(len(c) for c in chunks)
        return chunks

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = make_server("127.0.0.1", port, counting, threaded=True, request_handler=MotoRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "bench",
           "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}
    os.environ.update(env)
    return server, env


def orchestrate(args: argparse.Namespace) -> None:
    import boto3

    server, env = start_counting_s3()
    boto3.client("s3").create_bucket(Bucket="b11")
    with tempfile.TemporaryDirectory(prefix="b11-", dir=args.work) as work:
        out = Path(work) / "out.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", __file__, "worker",
               "--size-mib", str(args.size_mib), "--runs", str(args.runs), "--out", str(out), "--work", work]
        subprocess.run(cmd, check=True, env={**os.environ, **env, "OMP_NUM_THREADS": "1"})
        res = json.loads(out.read_text())
    server.shutdown()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(res, indent=1))
    print(report(res))


def report(res: dict) -> str:
    size = res["checkpoint_bytes"]
    lines = [f"checkpoint: {size / MIB:.1f} MiB ({res['data_bytes'] / MIB:.1f} MiB in .distcp files), "
             f"HSDP mesh {res['mesh']}, {res['runs']} loads per path and storage",
             "| storage | path | bytes read / checkpoint (median) | per rank (MiB, median) | resume s median "
             "(min-max) | bitwise |", "|---|---|---|---|---|---|"]
    for storage in ("local", "s3"):
        for mode in ("today", "once"):
            runs = res["loads"][storage][mode]
            if storage == "local":
                ratio = statistics.median(sum(r["rchar"]) / size for r in runs)
                stream = statistics.median(sum(r["stream"]) / size for r in runs)
                read = f"{ratio:.3f}x (rchar); {stream:.3f}x (DCP streams)"
                per_rank = [statistics.median(r["rchar"][k] for r in runs) / MIB for k in range(4)]
            else:
                get = {k: statistics.median(r["get_bytes"].get(k, 0) for r in runs) / MIB for k in KINDS}
                total = statistics.median(sum(r["get_bytes"].values()) / size for r in runs)
                read = f"{total:.3f}x (GET bytes: " + ", ".join(f"{k} {v:.1f} MiB" for k, v in get.items()) + ")"
                per_rank = [statistics.median(r["stream"][k] for r in runs) / MIB for k in range(4)]
            times = [max(r["seconds"]) for r in runs]
            lines.append(f"| {storage} | {mode} | {read} | {' / '.join(f'{b:.1f}' for b in per_rank)} | "
                         f"{statistics.median(times):.3f} ({min(times):.3f}-{max(times):.3f}) | "
                         f"{all(all(r['bitwise']) for r in runs)} |")
    for storage, v in res["verify_files"].items():
        lines.append(f"checksum pass (verify_files) on {storage}: {v['bytes'] / size:.3f}x in {v['seconds']:.3f} s")
    return "\n".join(lines)


# --- the ranks -----------------------------------------------------------------------------------------------------

STREAM = [0]  # bytes this rank read through DCP's file system streams (local or fsspec)


def count_streams() -> None:
    """Wrap the streams DCP's readers open (local and fsspec file systems) to count what they return."""
    from torch.distributed.checkpoint import _fsspec_filesystem, filesystem

    class Counted:
        def __init__(self, stream):
            self._s = stream

        def read(self, *a):
            data = self._s.read(*a)
            STREAM[0] += len(data)
            return data

        def readinto(self, b):
            n = self._s.readinto(b) or 0
            STREAM[0] += n
            return n

        def __getattr__(self, name):
            return getattr(self._s, name)

    for cls in (filesystem.FileSystem, _fsspec_filesystem.FileSystem):
        original = cls.create_stream

        def create_stream(self, path, mode, _original=original):
            cm = _original(self, path, mode)

            class Wrapped:
                def __enter__(self_):
                    s = cm.__enter__()
                    return Counted(s) if "r" in mode else s

                def __exit__(self_, *exc):
                    return cm.__exit__(*exc)

            return Wrapped()

        cls.create_stream = create_stream


def rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def get_bytes() -> dict[str, int]:
    """The server's GET response bytes so far, by kind (.distcp, .metadata, other)."""
    with urllib.request.urlopen(os.environ["AWS_ENDPOINT_URL"] + COUNTER) as r:
        return json.loads(r.read())


def delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items()}


def build(size_mib: int):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from fsdpkit.checkpoint.state import CheckpointTarget

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    width = 1024
    layers = max(1, round(size_mib * MIB / (3 * 4 * width * width)))  # params + exp_avg + exp_avg_sq, fp32
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    opt.zero_grad()
    return CheckpointTarget(model=model, optimizer=opt, stateful={}), mesh


def local_state(target) -> list:
    from torch.distributed.tensor import DTensor

    from fsdpkit.checkpoint.state import flatten

    flat = flatten(target.tensor_state(rank=0, model_only=False))
    return [(v.to_local() if isinstance(v, DTensor) else v).clone() for k, v in sorted(flat.items())
            if hasattr(v, "dtype") and not k.startswith("rng.")]


def scramble(target) -> None:
    import torch

    with torch.no_grad():
        for p in target.model.parameters():
            p.zero_()
        for st in target.optimizer.state.values():
            for v in st.values():
                v.zero_()


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as tdist

    from checkpoint_measure import drop_page_cache
    from fsdpkit import dist
    from fsdpkit.checkpoint import resume
    from fsdpkit.checkpoint.manifest import model_fingerprint
    from fsdpkit.checkpoint.save import save_checkpoint
    from fsdpkit.checkpoint.storage import open_storage

    dist.init_process_group(backend="gloo")
    rank = tdist.get_rank()
    target, mesh = build(args.size_mib)
    count_streams()
    meta = {"run_id": "b11", "fingerprint": model_fingerprint(target.model, sharding={}), "metrics": {}}
    where = {"local": Path(args.work) / "local" / "step_1", "s3": open_storage("s3://b11/ckpt") / "step_1"}
    manifests = {s: save_checkpoint(target, ckpt_dir=path, step=1, meta=meta, group=None) for s, path in where.items()}
    saved = local_state(target)
    box = [manifests if rank == 0 else None]
    tdist.broadcast_object_list(box, src=0)
    manifests = box[0]
    finder = resume.find_replication
    loads: dict = {s: {"today": [], "once": []} for s in where}
    verify: dict = {}
    for storage, path in where.items():
        for i in range(args.runs):
            for mode in ("today", "once") if i % 2 == 0 else ("once", "today"):
                scramble(target)
                resume.find_replication = (lambda state, group: None) if mode == "today" else finder
                if rank == 0 and storage == "local":
                    drop_page_cache(path)
                tdist.barrier()
                g0 = get_bytes() if rank == 0 else {}
                STREAM[0], r0, t0 = 0, rchar(), time.perf_counter()
                resume.load_checkpoint(target, path, fingerprint=meta["fingerprint"], group=None, verify=True)
                seconds, rc, stream = time.perf_counter() - t0, rchar() - r0, STREAM[0]
                tdist.barrier()
                g1 = get_bytes() if rank == 0 else {}
                bitwise = all(torch.equal(a, b) for a, b in zip(saved, local_state(target), strict=True))
                row = [None] * 4
                tdist.all_gather_object(row, (seconds, rc, stream, bitwise))
                loads[storage][mode].append({"seconds": [r[0] for r in row], "rchar": [r[1] for r in row],
                                             "stream": [r[2] for r in row], "bitwise": [r[3] for r in row],
                                             "get_bytes": delta(g0, g1)})
        resume.find_replication = finder
        if rank == 0 and storage == "local":
            drop_page_cache(path)
        tdist.barrier()
        g0, r0, t0 = get_bytes() if rank == 0 else {}, rchar(), time.perf_counter()
        resume.verify_files(path, manifests[storage], group=None)
        seconds, rc = time.perf_counter() - t0, rchar() - r0
        tdist.barrier()
        g1 = get_bytes() if rank == 0 else {}
        row = [None] * 4
        tdist.all_gather_object(row, (seconds, rc))
        verify[storage] = {"seconds": max(r[0] for r in row),
                           "bytes": sum(r[1] for r in row) if storage == "local" else sum(delta(g0, g1).values())}
    if rank == 0:
        files = manifests["local"]["files"]
        Path(args.out).write_text(json.dumps({
            "checkpoint_bytes": sum(f["size"] for f in files.values()),
            "data_bytes": sum(f["size"] for n, f in files.items() if n.endswith(".distcp")),
            "mesh": list(mesh.mesh.shape), "runs": args.runs, "loads": loads, "verify_files": verify}))
    del target
    dist.shutdown()
    os._exit(0)



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("role", nargs="?", default="bench", choices=["bench", "worker"])
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--json", type=Path, default=RESULTS)
    parser.add_argument("--out", default=None)
    parser.add_argument("--work", default=None)
    args = parser.parse_args()
    worker(args) if args.role == "worker" else orchestrate(args)


if __name__ == "__main__":
    main()
