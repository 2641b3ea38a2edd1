"""Runs as pictures: loss, gradient norm, learning rate and tokens/s against step, several runs
overlaid, with checkpoint saves (and their stalls) and resumes marked.

matplotlib is an optional dependency (the `plot` extra): it is imported when a plot is drawn,
through the Agg canvas directly (no pyplot, so no GUI backend and no global state).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fsdpkit.diagnostics.runlog import RunLog, read_run

PANELS = (("loss", "loss"), ("grad_norm", "gradient norm"), ("lr", "learning rate"), ("tokens_per_s", "tokens / s"))
FIGSIZE_IN = (12.0, 8.0)
DPI = 100
MAX_STALL_LABELS = 12
MISSING = ("plotting needs matplotlib, which is not installed ({error}); "
           "install it with `pip install 'fsdpkit[plot]'`")


def _matplotlib():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D
    except ImportError as e:
        raise ImportError(MISSING.format(error=e)) from None
    return Figure, FigureCanvasAgg, Line2D


def plot_runs(run_dirs: list[str | Path], *, out: str | Path, labels: list[str] | None = None,
              title: str | None = None) -> dict[str, Any]:
    """Draw the runs' metrics into a PNG at `out` (parent directories are created).

    Args:
        run_dirs: run directories (each with metrics.jsonl), drawn in this order.
        out: the PNG to write.
        labels: legend names, one per run (default: each directory's name).
        title: the figure title (default: the labels).

    Returns:
        What was drawn: out, and per run its label, steps, resumes, checkpoints and skipped lines.

    Raises:
        FileNotFoundError: a run directory has no metrics.jsonl.
        ValueError: labels do not match the runs, or a run has no step records.
        ImportError: matplotlib is missing; the message names the extra to install.
    """
    if labels is not None and len(labels) != len(run_dirs):
        raise ValueError(f"--labels has {len(labels)} names for {len(run_dirs)} run directories; give one per run")
    runs = [read_run(d, label=labels[i] if labels else None) for i, d in enumerate(run_dirs)]
    for run in runs:
        if not run.steps:
            raise ValueError(f"{run.path} holds no step records yet; plot a run that has trained at least one step")
    Figure, FigureCanvasAgg, Line2D = _matplotlib()
    fig = Figure(figsize=FIGSIZE_IN, dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 2, sharex=True).flatten()
    colors = [f"C{i % 10}" for i in range(len(runs))]
    for i, (run, color) in enumerate(zip(runs, colors, strict=True)):
        _draw_run(axes, run, color=color, index=i)
    for ax, (_, name) in zip(axes, PANELS, strict=True):
        ax.set_ylabel(name)
        ax.grid(True, alpha=0.3)
    for ax in axes[2:]:
        ax.set_xlabel("step")
    handles = [Line2D([], [], color=c, lw=2, ls=_style(i)[0],
                      label=r.label) for i, (r, c) in enumerate(zip(runs, colors, strict=True))]
    if any(r.superseded for r in runs):
        handles.append(Line2D([], [], color="0.4", lw=1, ls=":", alpha=0.6,
                              label="steps redone after a resume (replaced)"))
    if any(r.resumes for r in runs):
        handles.append(Line2D([], [], color="0.4", lw=1, ls="-.", label="resume"))
    if any(r.checkpoints for r in runs):
        handles.append(Line2D([], [], color="0.4", lw=0, marker="v", label="checkpoint save (stall s)"))
    fig.legend(handles=handles, fontsize="small", loc="outside lower center", ncols=min(len(handles), 6))
    diffs = [loss_difference(runs[0], r) for r in runs[1:]]
    notes = [f"{r.label} vs {runs[0].label}: max |Δ loss| {d['max_abs']:.3g} over {d['steps']} shared steps"
             for r, d in zip(runs[1:], diffs, strict=True) if d["steps"]]
    fig.suptitle((title or "fsdpkit: " + " vs ".join(r.label for r in runs)) + "".join("\n" + n for n in notes))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    described = [_describe(r) for r in runs]
    for d, diff in zip(described[1:], diffs, strict=True):
        d["loss_vs_first"] = diff
    return {"out": str(out), "runs": described}


def loss_difference(base: RunLog, other: RunLog) -> dict[str, Any]:
    """Steps both runs logged, and the largest absolute loss difference over them (the number
    that says whether a resumed run continued exactly)."""
    mine = dict(zip(*base.series("loss"), strict=True))
    pairs = [(mine[s], v) for s, v in zip(*other.series("loss"), strict=True) if s in mine]
    return {"steps": len(pairs), "max_abs": max((abs(a - b) for a, b in pairs), default=0.0)}


def _style(index: int) -> tuple[str, float]:
    # Later runs dashed and thinner, so an exact overlay (a seamless resume) shows both lines.
    return ("-" if index == 0 else (0, (4, 2 + index)), max(0.9, 2.2 - 0.6 * index))


def _draw_run(axes, run: RunLog, *, color: str, index: int) -> None:
    from matplotlib.transforms import blended_transform_factory

    ls, lw = _style(index)
    for ax, (key, _) in zip(axes, PANELS, strict=True):
        xs, ys = run.series(key)
        if xs:
            ax.plot(xs, ys, color=color, ls=ls, lw=lw, zorder=2 + index)
        old_x, old_y = run.series(key, superseded=True)
        if old_x:
            ax.plot(old_x, old_y, color=color, ls=":", lw=1, alpha=0.6, zorder=1)
        for resume in run.resumes:
            ax.axvline(resume["step"], color=color, ls="-.", lw=1, alpha=0.8)
        marks = blended_transform_factory(ax.transData, ax.transAxes)
        for ckpt in run.checkpoints:
            ax.plot([ckpt["step"]], [0.97 - 0.04 * index], marker="v", color=color, ms=5, transform=marks,
                    clip_on=False)
    val_x, val_y = run.series("val_loss")
    if val_x:
        axes[0].plot(val_x, val_y, color=color, marker="o", ls="none", ms=5, mfc="white", zorder=5)
    for resume in run.resumes:
        load = resume.get("load_s")
        text = f"{run.label}: resumed at {resume['step']}" + (f" (load {load:.2f} s)" if isinstance(load, int | float)
                                                              else "")
        axes[0].annotate(text, xy=(resume["step"], 0.02 + 0.06 * index), xycoords=("data", "axes fraction"),
                         rotation=90, fontsize="x-small", color=color, ha="right", va="bottom")
    stalls = [c for c in run.checkpoints if isinstance(c.get("stall_s"), int | float)]
    if len(stalls) <= MAX_STALL_LABELS:
        tok = axes[3]
        for ckpt in stalls:
            tok.annotate(f"{ckpt['stall_s']:.2f}s", xy=(ckpt["step"], 0.97 - 0.04 * index), xytext=(5, 0),
                         xycoords=("data", "axes fraction"), textcoords="offset points", fontsize="x-small",
                         color=color, ha="left", va="center")


def _describe(run: RunLog) -> dict[str, Any]:
    return {
        "label": run.label, "path": str(run.path), "steps": len(run.steps),
        "first_step": run.steps[0]["step"], "last_step": run.steps[-1]["step"],
        "resumes": [r["step"] for r in run.resumes], "replaced_steps": len(run.superseded),
        "checkpoints": len(run.checkpoints), "skipped_lines": run.skipped_lines,
    }
