"""A save's tensor checksums beside a training thread: how fast a loop of small ops runs while
they are computed.

An async save computes its row checksums (`xxh3_64-rows`) on a background thread while training
goes on. That loop makes one Python call per row and holds the GIL meanwhile; each op of the
training thread releases the GIL and must get it back. Measured here: the training thread's op
rate during the hashing window, alone (no background work), beside the plain loop (`share_gil`
off: what fsdpkit did before) and beside the loop that hands the GIL over (what a save does now),
medians of 5 runs, with the hashing's own wall and CPU time.

Usage: python bench/gil.py [--mib 256] [--row-kib 8] [--runs 5]
Writes bench/results/gil.json (markdown included) and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from pathlib import Path

import torch

from fsdpkit.checkpoint.hashing import SHARE_GIL_EVERY_S, hash_part

RESULTS = Path(__file__).parent / "results" / "gil.json"
OP_SIZE = 256  # a 256 x 256 in-place multiply: ~10 us, the size of a small op or a kernel launch
TARGET = 0.25  # the training thread keeps at least this share of its own op rate while a save hashes


def window(background, ops: list[int]) -> tuple[float, float, float]:
    """(training-thread ops/s, wall s, thread CPU s) while `background()` runs on this thread."""
    stop = threading.Event()

    def train() -> None:
        a = torch.randn(OP_SIZE, OP_SIZE)
        while not stop.is_set():
            a.mul_(1.0)
            ops[0] += 1

    thread = threading.Thread(target=train)
    thread.start()
    time.sleep(0.05)  # the loop is running before the window opens
    n0, c0, t0 = ops[0], time.thread_time(), time.perf_counter()
    background()
    wall, cpu, n = time.perf_counter() - t0, time.thread_time() - c0, ops[0] - n0
    stop.set()
    thread.join()
    return n / wall, wall, cpu


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=256, help="state hashed per run (MiB)")
    p.add_argument("--row-kib", type=int, default=8, help="row size (KiB): 8 KiB = a 2048-wide fp32 row")
    p.add_argument("--runs", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(1)
    cols = args.row_kib * 256
    state = torch.randn(args.mib * 2**20 // (cols * 4), cols)
    hash_s = statistics.median(window(lambda: hash_part(state, first_row=0, algorithm="xxh3_64-rows"), [0])[1]
                               for _ in range(3))
    modes = {"no background work (baseline)": lambda: time.sleep(hash_s),
             "row checksums, GIL held (before)": lambda: hash_part(state, first_row=0, algorithm="xxh3_64-rows"),
             "row checksums, GIL handed over (now)":
                 lambda: hash_part(state, first_row=0, algorithm="xxh3_64-rows", share_gil=True)}
    runs: dict[str, list[tuple[float, float, float]]] = {m: [] for m in modes}
    for _ in range(args.runs):  # modes interleaved, so drift on the machine hits all alike
        for mode, fn in modes.items():
            runs[mode].append(window(fn, [0]))
    alone = statistics.median(r[0] for r in runs["no background work (baseline)"])
    rows = []
    for mode, rs in runs.items():
        rate = statistics.median(r[0] for r in rs)
        rows.append({"mode": mode, "ops_per_s": rate, "of_alone": rate / alone,
                     "min": min(r[0] for r in rs), "max": max(r[0] for r in rs),
                     "wall_ms": statistics.median(r[1] for r in rs) * 1e3,
                     "cpu_ms": statistics.median(r[2] for r in rs) * 1e3})
    now = rows[-1]["of_alone"]
    lines = [f"{os.cpu_count()} CPUs, torch {torch.__version__}, 1 intra-op thread; {args.mib} MiB of "
             f"{args.row_kib} KiB rows hashed per run; the training thread runs {OP_SIZE}x{OP_SIZE} in-place "
             f"multiplies; medians of {args.runs} runs, modes interleaved; GIL handed over every "
             f"{SHARE_GIL_EVERY_S * 1e6:.0f} us", "",
             "| background work | training ops/s | min–max (n) | × alone | hashing wall ms | hashing CPU ms |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['ops_per_s']:.0f} | {r['min']:.0f}–{r['max']:.0f} ({args.runs}) | "
                     f"{r['of_alone']:.3f} | {r['wall_ms']:.0f} | {r['cpu_ms']:.0f} |")
    lines += ["", f"target: the training thread keeps >= {TARGET} of its op rate while a save hashes: "
              f"{now:.2f} ({'met' if now >= TARGET else '**NOT met**'}); before: {rows[1]['of_alone']:.3f}"]
    markdown = "\n".join(lines)
    print(markdown)
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"rows": rows, "markdown": markdown}, indent=2) + "\n")


if __name__ == "__main__":
    main()
