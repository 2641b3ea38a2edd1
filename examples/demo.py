"""What `make demo` runs: train the reference Llama on 2 CPU ranks with FSDP2, the way a user
would (`fsdpkit train --nproc 2 experiment=demo`), then show where everything went."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

RUN_DIR = Path("runs/demo")


def main() -> int:
    cmd = [sys.executable, "-m", "fsdpkit", "train", "--nproc", "2", "experiment=demo", f"run_dir={RUN_DIR}"]
    print("$", " ".join(["fsdpkit", *cmd[3:]]), flush=True)
    if (RUN_DIR / "metrics.jsonl").exists():
        (RUN_DIR / "metrics.jsonl").unlink()  # a fresh curve on every demo
    t0 = time.perf_counter()
    code = subprocess.call(cmd)
    wall = time.perf_counter() - t0
    if code != 0:
        print(f"demo: training failed with exit code {code}", file=sys.stderr)
        return code
    records = [json.loads(line) for line in (RUN_DIR / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records]
    print(f"\ndemo: {len(records)} steps on 2 ranks in {wall:.1f} s (wall, including launch)")
    print(f"demo: loss {losses[0]:.3f} -> {losses[-1]:.3f}; val_loss {records[-1].get('val_loss', float('nan')):.3f}")
    every = max(1, len(losses) // 10)
    print("demo: loss curve  " + "  ".join(f"{r['step']}:{r['loss']:.2f}" for r in records[::every]))
    print(f"demo: run directory {RUN_DIR.resolve()}  (config.yaml, metrics.jsonl, summary.json)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
