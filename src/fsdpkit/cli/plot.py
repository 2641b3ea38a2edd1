"""`fsdpkit plot RUN_DIR [RUN_DIR ...] -o loss.png`: runs as pictures."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DESCRIPTION = """\
Draw loss (and val_loss), gradient norm, learning rate and tokens/s against step from each run
directory's metrics.jsonl, overlaying the runs. Checkpoint saves are marked (with their stall in
seconds), resumes are drawn as vertical lines, and steps that a resumed run redid are shown
dotted (the resumed run's records win). Needs matplotlib: pip install 'fsdpkit[plot]'.

examples:
  fsdpkit plot runs/demo/uninterrupted runs/demo/resumed -o resume.png
  fsdpkit plot runs/a runs/b --labels fp32,bf16 --title "precision"
"""


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("plot", help="draw loss, grad norm, LR and tokens/s of one or more runs into a PNG",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (or metrics.jsonl files)")
    p.add_argument("-o", "--out", default=None, help="the PNG to write (default: metrics.png in the first RUN_DIR)")
    p.add_argument("--labels", default=None, help="comma-separated legend names, one per RUN_DIR")
    p.add_argument("--title", default=None, help="figure title")
    return p


def run(args: argparse.Namespace) -> int:
    from fsdpkit.diagnostics.plot import plot_runs

    first = Path(args.run_dirs[0])
    out = Path(args.out) if args.out else (first.parent if first.suffix == ".jsonl" else first) / "metrics.png"
    labels = [s.strip() for s in args.labels.split(",")] if args.labels else None
    try:
        drawn = plot_runs(args.run_dirs, out=out, labels=labels, title=args.title)
    except ImportError as e:
        print(f"fsdpkit plot: error: {e}", file=sys.stderr)
        return 2
    for r in drawn["runs"]:
        notes = [f"resumed at {', '.join(map(str, r['resumes']))}" if r["resumes"] else "",
                 f"{r['replaced_steps']} steps redone" if r["replaced_steps"] else "",
                 f"{r['checkpoints']} checkpoints" if r["checkpoints"] else "",
                 f"{r['skipped_lines']} unreadable lines skipped" if r["skipped_lines"] else ""]
        diff = r.get("loss_vs_first")
        if diff and diff["steps"]:
            notes.append(f"max |loss difference| vs {drawn['runs'][0]['label']} {diff['max_abs']:.3g} "
                         f"over {diff['steps']} shared steps")
        print(f"  {r['label']}: steps {r['first_step']}-{r['last_step']}" + "".join(f", {n}" for n in notes if n))
    print(f"wrote {drawn['out']}")
    return 0
