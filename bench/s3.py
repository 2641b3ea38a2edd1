"""Checkpoints on object storage against a loopback S3 server (moto's standalone server, in its own
process so that it does not share this process's interpreter lock), side by side in one run:

1. upload: fsdpkit `save_checkpoint` to s3:// (time until committed: shards streamed and hashed,
   manifest and `latest` PUT) versus a plain s3fs `put` of the same bytes (the files that save
   wrote, from local disk), and the save through DCP's own S3 stream (what fsdpkit's overlapped
   multipart stream replaces), in rounds rotating which goes first. Ratio = fsdpkit throughput /
   s3fs throughput (target >= 0.8).
2. async stall: `AsyncSaver.save` with an s3:// target versus a local target: the time until the
   call returns (the loop's stall; the upload runs in the background), 2 x --runs saves each,
   alternating which target goes first. Ratio S3 / local (target <= 1.2).
3. export: `fsdpkit ckpt export` of that checkpoint from s3:// and from a local copy, each in a
   subprocess (peak RSS = the child's ru_maxrss). Target: peak RSS <= 0.1 x model + 512 MiB.

One process, no process group (world of one); state = fp32 Linear layers + AdamW state totalling
about --size-mib. Medians of --runs runs. A loopback server in Python is slow: the absolute
figures say little about a real store, the ratios compare like with like on the same server.

Usage: python bench/s3.py [--size-mib 256] [--runs 5] [--json bench/results/s3.json] [--upload-only]
(--upload-only: measure 1. alone and print it, e.g. for an A/B of upload settings such as
FSDPKIT_REMOTE_PART_BYTES / FSDPKIT_REMOTE_PARTS_IN_FLIGHT)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "s3.json"
MIB = 2**20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server() -> tuple[subprocess.Popen, dict[str, str]]:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "bench",
           "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}
    os.environ.update(env)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return proc, env
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"moto's S3 server did not start on port {port} (pip install 'moto[server]')")


def build_target(size_mib: int):
    import torch

    from fsdpkit.checkpoint.state import CheckpointTarget

    width = 1024
    layers = max(1, round(size_mib * MIB / (3 * 4 * width * width)))  # params + exp_avg + exp_avg_sq, fp32
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    return CheckpointTarget(model=model, optimizer=opt, stateful={}), 3 * 4 * width * width * layers


def meta_for(target) -> dict:
    from fsdpkit.checkpoint.manifest import model_fingerprint

    return {"run_id": "bench", "fingerprint": model_fingerprint(target.model, sharding={}), "optimizer": {},
            "metrics": {}}


def bench_upload(target, fs, bucket: str, work: Path, runs: int) -> dict:
    """A warm-up save whose files, fetched to local disk, are what the plain put uploads; then
    `runs` rounds of a save, a save through DCP's own S3 stream (s3fs's `S3File`, parts uploaded
    one after another: what fsdpkit's overlapped stream replaces) and a put, each round starting
    with the next one of the three (the server's state after the others' requests is no bias)."""
    from fsdpkit.checkpoint.save import save_checkpoint
    from fsdpkit.checkpoint.storage import open_storage, safe_fsspec

    root, meta = open_storage(f"s3://{bucket}/upload"), meta_for(target)
    manifest = save_checkpoint(target, ckpt_dir=root / "step_0", step=0, meta=meta, group=None)
    local = work / "plain"
    fs.get(f"{bucket}/upload/step_0", str(local), recursive=True)
    times: dict[str, list[float]] = {"fsdpkit": [], "dcp_s3file": [], "s3fs_put": []}
    kinds, overlapped = list(times), safe_fsspec.is_s3
    for i in range(1, runs + 1):
        for kind in kinds[i % 3:] + kinds[:i % 3]:
            t0 = time.perf_counter()
            if kind == "s3fs_put":
                for name in manifest["files"]:
                    fs.put_file(str(local / name), f"{bucket}/plain/step_{i}/{name}")
                times[kind].append(time.perf_counter() - t0)
                fs.rm(f"{bucket}/plain/step_{i}", recursive=True)
                continue
            safe_fsspec.is_s3 = overlapped if kind == "fsdpkit" else (lambda _fs: False)
            try:
                save_checkpoint(target, ckpt_dir=root / f"{kind}_{i}", step=i, meta=meta, group=None)
            finally:
                safe_fsspec.is_s3 = overlapped
            times[kind].append(time.perf_counter() - t0)
            fs.rm(f"{bucket}/upload/{kind}_{i}", recursive=True)  # the server keeps objects in memory
    fs.rm(f"{bucket}/upload", recursive=True)
    save_checkpoint(target, ckpt_dir=root / "step_1", step=1, meta=meta, group=None)  # what the export bench reads
    nbytes = sum(info["size"] for info in manifest["files"].values())
    med = {kind: statistics.median(v) for kind, v in times.items()}
    return {"bytes": nbytes, **{f"{kind}_runs_s": v for kind, v in times.items()},
            **{f"{kind}_s": m for kind, m in med.items()},
            **{f"{kind}_mbps": nbytes / m / 1e6 for kind, m in med.items()},
            "ratio": med["s3fs_put"] / med["fsdpkit"], "dcp_s3file_ratio": med["s3fs_put"] / med["dcp_s3file"]}


def bench_async_stall(target, bucket: str, work: Path, runs: int) -> dict:
    from fsdpkit.checkpoint.async_save import AsyncSaver
    from fsdpkit.checkpoint.storage import open_storage

    meta = meta_for(target)
    roots = {"local": open_storage(work / "async_local"), "s3": open_storage(f"s3://{bucket}/async")}
    savers = {kind: AsyncSaver(group=None) for kind in roots}
    stalls: dict[str, list[float]] = {"s3": [], "local": []}
    for i in range(2 * runs + 1):  # alternating, each first in turn; the first saves allocate the buffers
        for kind in (("s3", "local") if i % 2 else ("local", "s3")):
            t0 = time.perf_counter()
            savers[kind].save(target, ckpt_dir=roots[kind] / f"step_{i}", step=i, meta=meta)
            stall = time.perf_counter() - t0
            savers[kind].wait()
            if i:
                stalls[kind].append(stall)
    for saver in savers.values():
        saver.close()
    s3, local = statistics.median(stalls["s3"]), statistics.median(stalls["local"])
    return {"s3_stall_s": s3, "local_stall_s": local, "ratio": s3 / local}


def _export_rss(source: str, out: Path) -> tuple[float, float]:
    """(seconds, peak RSS MiB) of `fsdpkit ckpt export source out` in a fresh child."""
    code = ("import resource, subprocess, sys, time; t = time.perf_counter(); "
            "rc = subprocess.call([sys.executable, '-m', 'fsdpkit', 'ckpt', 'export', sys.argv[1], sys.argv[2], "
            "'--format', 'single'], stdout=subprocess.DEVNULL); "
            "print(rc, time.perf_counter() - t, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    rc, seconds, kib = subprocess.check_output([sys.executable, "-c", code, source, str(out)], text=True).split()
    if rc != "0":
        raise SystemExit(f"fsdpkit ckpt export {source} failed ({rc})")
    return float(seconds), int(kib) / 1024


def bench_export(fs, bucket: str, work: Path, runs: int, model_bytes: int) -> dict:
    source = f"s3://{bucket}/upload"
    fs.get(f"{bucket}/upload", str(work / "local_ckpts"), recursive=True)
    res: dict[str, list[tuple[float, float]]] = {"s3": [], "local": []}
    for i in range(runs):
        for kind, src in (("s3", source), ("local", str(work / "local_ckpts"))):
            res[kind].append(_export_rss(src, work / f"export_{kind}_{i}"))
    bound = 0.1 * model_bytes / MIB + 512
    return {kind: {"seconds": statistics.median(s for s, _ in v), "peak_rss_mib": max(r for _, r in v)}
            for kind, v in res.items()} | {"bound_mib": bound, "model_mib": model_bytes / MIB}


def markdown(report: dict) -> str:
    """The report as RESULTS.md quotes it: each figure beside its reference and target, met or not."""
    upload, stall, export = report["upload"], report["async_stall"], report["export"]

    def met(ok: bool) -> str:
        return "met" if ok else "**NOT met**"

    return "\n".join([
        f"state {report['size_mib']:.0f} MiB (fp32 Linear layers + AdamW state), one process, moto's S3 server on "
        f"loopback in its own process; medians of {report['runs']} runs",
        "",
        "| measure | fsdpkit / S3 | reference (same run) | ratio | target | met |",
        "|---|---|---|---|---|---|",
        f"| upload MB/s (save until committed vs s3fs put of the same files) | {upload['fsdpkit_mbps']:.1f} | "
        f"s3fs put {upload['s3fs_put_mbps']:.1f} | {upload['ratio']:.2f} | >= 0.8 | {met(upload['ratio'] >= 0.8)} |",
        f"| upload MB/s through DCP's own S3 stream (s3fs S3File, no overlap: before fsdpkit's stream) | "
        f"{upload['dcp_s3file_mbps']:.1f} | s3fs put {upload['s3fs_put_mbps']:.1f} | {upload['dcp_s3file_ratio']:.2f} "
        "| | |",
        f"| async stall s (S3 target vs local target) | {stall['s3_stall_s']:.3f} | local {stall['local_stall_s']:.3f} "
        f"| {stall['ratio']:.2f} | <= 1.2 | {met(stall['ratio'] <= 1.2)} |",
        f"| export peak RSS MiB (from S3 vs from a local copy) | {export['s3']['peak_rss_mib']:.0f} | "
        f"local {export['local']['peak_rss_mib']:.0f} | bound {export['bound_mib']:.0f} | <= 0.1 x model + 512 MiB | "
        f"{met(export['s3']['peak_rss_mib'] <= export['bound_mib'])} |",
        f"| export s | {export['s3']['seconds']:.2f} | local {export['local']['seconds']:.2f} | | | |",
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=256, help="model + optimizer state, fp32 (default 256)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--json", default=str(RESULTS))
    parser.add_argument("--upload-only", action="store_true",
                        help="measure the upload only (no async stall, no export); prints its JSON")
    args = parser.parse_args()
    server, _ = start_server()
    try:
        import boto3
        import s3fs

        bucket = "fsdpkit-bench"
        boto3.client("s3").create_bucket(Bucket=bucket)
        fs = s3fs.S3FileSystem(use_listings_cache=False)
        target, state_bytes = build_target(args.size_mib)
        model_bytes = state_bytes // 3
        with tempfile.TemporaryDirectory(dir=Path(__file__).parent) as tmp:
            work = Path(tmp)
            upload = bench_upload(target, fs, bucket, work, args.runs)
            if args.upload_only:
                print(json.dumps(upload, indent=1))
                return
            stall = bench_async_stall(target, bucket, work, args.runs)
            export = bench_export(fs, bucket, work, args.runs, model_bytes)
    finally:
        server.kill()
    report = {"size_mib": state_bytes / MIB, "runs": args.runs, "upload": upload, "async_stall": stall,
              "export": export, "self_peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    report["markdown"] = markdown(report)
    print(report["markdown"])
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    print(f"results: {args.json}")


if __name__ == "__main__":
    main()
