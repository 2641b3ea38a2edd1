"""The page-cache reader's A/B: file checksums read through a descriptor renewed every 16 MiB, or one.

Every file checksum fsdpkit verifies (the pass before a load, `fsdpkit ckpt verify`) reads its file
with io/page_cache.SequentialReader, which opens a new descriptor every FSDPKIT_READ_RESTART_BYTES
(16 MiB) so that the kernel's readahead starts afresh (its docstring says why, on a VM that hands
free memory back to its host). Issue 35's rule: a fast path stays only if it beats the plain way
beyond the spread of the same run. Here the plain way is the same reader with
read_restart_bytes=0 (one descriptor from start to end), everything else equal.

Each run: two files of --mib MiB (a 1 GiB state's two ranks' shares by default) evicted from the
page cache (posix_fadvise DONTNEED, after an fsync), --idle seconds of rest (the pages the kernel
freed go back to a ballooning host meanwhile), then `hashing.file_checksum` of both at once on two
threads (as two ranks check their own files). The modes alternate, the first one swapped every run;
medians of --runs, min-max beside.

Usage: python bench/checksum_read.py [--mib 512] [--runs 5] [--idle 3] [--dir D]
Writes bench/results/checksum_read.json (markdown included; results_md.py quotes it).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from export_ceilings import evict
from fsdpkit import tunables
from fsdpkit.checkpoint.hashing import file_checksum
from results_md import publish

HERE = Path(__file__).parent
RESULTS = HERE / "results" / "checksum_read.json"
MODES = {"renewed every 16 MiB (default)": 16 << 20, "one descriptor (plain)": 0}


def make_files(root: Path, *, n: int, mib: int) -> list[Path]:
    block = os.urandom(1 << 20)
    paths = []
    for i in range(n):
        path = root / f"__{i}_0.distcp"
        with open(path, "wb") as f:
            for _ in range(mib):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        paths.append(path)
    return paths


def timed_checksums(paths: list[Path], restart: int) -> tuple[float, list[str]]:
    with tunables.override(read_restart_bytes=restart), ThreadPoolExecutor(len(paths)) as pool:
        t0 = time.perf_counter()
        digests = [d for _, d in pool.map(file_checksum, paths)]
        return time.perf_counter() - t0, digests


def render(data: dict) -> str:
    lines = [f"Two files of {data['mib']} MiB, evicted, {data['idle_s']} s idle, then `hashing.file_checksum` of both "
             f"on two threads; medians of {data['runs']}, modes alternating. Disk: {data['dir_fs']}.", "",
             "| reader | median s | min-max (n) | GB/s | / default |", "|---|---|---|---|---|"]
    base = statistics.median(data["times"][next(iter(MODES))])
    for mode, times in data["times"].items():
        med = statistics.median(times)
        gbs = 2 * data["mib"] * 2**20 / med / 1e9
        lines.append(f"| {mode} | {med:.3f} | {min(times):.3f}-{max(times):.3f} ({len(times)}) | {gbs:.2f} | "
                     f"{med / base:.2f} |")
    fast, plain = (data["times"][m] for m in MODES)
    apart = max(fast) < min(plain)
    lines += ["", "- the default beats one descriptor beyond the spread (its slowest run faster than plain's "
              f"fastest): {'yes' if apart else 'no'}"]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=512)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--idle", type=float, default=3.0, help="seconds of rest after the eviction")
    p.add_argument("--dir", default=None, help="where the files go (default: a temporary directory under bench/)")
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="checksum_read_", dir=args.dir or HERE))
    try:
        paths = make_files(root, n=2, mib=args.mib)
        times: dict[str, list[float]] = {m: [] for m in MODES}
        digests: dict[str, list[str]] = {}
        for run in range(args.runs):
            order = list(MODES) if run % 2 == 0 else list(MODES)[::-1]
            for mode in order:
                for path in paths:
                    evict(path)
                time.sleep(args.idle)
                seconds, got = timed_checksums(paths, MODES[mode])
                if digests.setdefault(mode, got) != got or got != next(iter(digests.values())):
                    raise SystemExit(f"checksum_read: the digests differ between runs or readers: {digests} {got}")
                times[mode].append(seconds)
                print(f"run {run + 1}/{args.runs} {mode}: {seconds:.3f} s", flush=True)
        fs = os.popen(f"df -hT {root} | tail -1").read().split()
        data = {"mib": args.mib, "runs": args.runs, "idle_s": args.idle, "times": times,
                "dir_fs": " ".join(fs[:2]) if fs else "?"}
        data["markdown"] = render(data)
        publish(RESULTS, data)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
