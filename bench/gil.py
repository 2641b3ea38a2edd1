"""A save's checksums beside a training thread: how much training time they take through the GIL.

An async save computes its tensor checksums (`xxh3_64-rows`) on a background thread while training
goes on. Computed as a Python loop of one python-xxhash call per row (the fallback where fsdpkit's
C extension was not built), the loop holds the GIL between calls, and a training thread whose every
op releases the GIL then waits up to the switch interval (5 ms) to get it back: it barely runs while
the checksums are computed, even with a core of its own. fsdpkit's C extension (`_rowhash`) hashes
a whole tensor in one call that releases the GIL. Measured: the training thread's rate of small
ops during the hashing window and the training time it lost ((1 - rate / rate alone) x window),
alone, beside the row checksums from the C extension (as a save computes them), beside the Python
loop, and beside an xxh3 stream over the same bytes (how the file checksums are taken), medians of
5 runs, modes interleaved, with the hashing's wall and CPU time. (Handing the GIL over every
50-200 us from the Python loop was tried: the training thread then lost more time in all.)

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
import xxhash

from fsdpkit.checkpoint.hashing import READ_CHUNK_BYTES, _rows_hash, native_row_hash

RESULTS = Path(__file__).parent / "results" / "gil.json"
OP_SIZE = 256  # a 256 x 256 in-place multiply: ~10 us, the size of a small op or a kernel launch
TARGET = 1.1  # training time lost to the row checksums <= this x their own CPU time (no waste beyond the work)


def window(background) -> tuple[float, float, float]:
    """(training-thread ops/s, wall s, thread CPU s) while `background()` runs on this thread."""
    stop, ops = threading.Event(), [0]

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
    if not native_row_hash():
        raise SystemExit("fsdpkit's C row hash is not built (or FSDPKIT_PYTHON_ROW_HASH=1): reinstall "
                         "fsdpkit where a C compiler is found to measure it")
    hash_s = statistics.median(window(lambda: _rows_hash(state, 0, native=True))[1] for _ in range(3))
    raw = memoryview(state.reshape(-1).view(torch.uint8).numpy())

    def stream() -> None:
        h = xxhash.xxh3_64()
        for i in range(0, len(raw), READ_CHUNK_BYTES):
            h.update(raw[i : i + READ_CHUNK_BYTES])

    modes = {"no background work (baseline)": lambda: time.sleep(hash_s),
             "row checksums, C extension (as a save computes them)": lambda: _rows_hash(state, 0, native=True),
             "row checksums, Python loop (the fallback without a C "
             "compiler)": lambda: _rows_hash(state, 0, native=False),
             "xxh3 stream over the same bytes (file checksums; releases the GIL)": stream}
    runs: dict[str, list[tuple[float, float, float]]] = {m: [] for m in modes}
    for _ in range(args.runs):  # modes interleaved, so drift on the machine hits all alike
        for mode, fn in modes.items():
            runs[mode].append(window(fn))
    alone = statistics.median(r[0] for r in runs["no background work (baseline)"])
    rows = []
    for mode, rs in runs.items():
        rate = statistics.median(r[0] for r in rs)
        lost = statistics.median((1 - r[0] / alone) * r[1] for r in rs) * 1e3
        rows.append({"mode": mode, "ops_per_s": rate, "of_alone": rate / alone,
                     "min": min(r[0] for r in rs), "max": max(r[0] for r in rs), "lost_ms": lost,
                     "wall_ms": statistics.median(r[1] for r in rs) * 1e3,
                     "cpu_ms": statistics.median(r[2] for r in rs) * 1e3})
    rows_hash, python_loop, streamed = rows[1], rows[2], rows[3]
    lines = [f"{os.cpu_count()} CPUs, torch {torch.__version__}, 1 intra-op thread; {args.mib} MiB of "
             f"{args.row_kib} KiB rows hashed per run on a second thread; the training thread runs "
             f"{OP_SIZE}x{OP_SIZE} in-place multiplies; medians of {args.runs} runs, modes interleaved", "",
             "| background work | training ops/s | min–max (n) | × alone | training time lost ms | "
             "hashing wall ms | hashing CPU ms |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['ops_per_s']:.0f} | {r['min']:.0f}–{r['max']:.0f} ({args.runs}) | "
                     f"{r['of_alone']:.3f} | {r['lost_ms']:.0f} | {r['wall_ms']:.0f} | {r['cpu_ms']:.0f} |")
    ratio = rows_hash["lost_ms"] / rows_hash["cpu_ms"]
    gib = args.mib / 1024
    lines += ["", f"the row checksums cost the training thread {rows_hash['lost_ms'] / gib:.0f} ms per GiB hashed "
              f"(the Python loop: {python_loop['lost_ms'] / gib:.0f} ms; an xxh3 stream over the same bytes: "
              f"{streamed['lost_ms'] / gib:.0f} ms); target: training time lost <= {TARGET} x the checksums' own "
              f"CPU time: {ratio:.2f} ({'met' if ratio <= TARGET else '**NOT met**'})"]
    markdown = "\n".join(lines)
    print(markdown)
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"rows": rows, "markdown": markdown}, indent=2) + "\n")


if __name__ == "__main__":
    main()
