"""`fsdpkit plot` and the metrics.jsonl reader: resumes, redone steps, truncated lines, and PNGs
of one and two runs (checked by size and pixel dimensions)."""

from __future__ import annotations

import json
import math
import struct
import sys
from pathlib import Path

import pytest

from fsdpkit.cli.main import main
from fsdpkit.diagnostics.plot import DPI, FIGSIZE_IN, plot_runs
from fsdpkit.diagnostics.runlog import METRICS_FILE, read_run

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def step_record(step: int, *, bump: float = 0.0) -> dict:
    return {"step": step, "loss": 6 * math.exp(-step / 10) + 2 + bump, "grad_norm": 1 / (1 + step), "lr": 1e-3,
            "tokens_per_s": 1000.0 + step, "step_time_s": 0.1, "tokens_seen": 64 * step, "peak_mem_mib": 300.0}


def ckpt_event(step: int) -> dict:
    return {"event": "checkpoint", "step": step, "path": f"ckpt/step_{step}", "mode": "sync", "stall_s": 0.25,
            "background_s": 0.0, "bytes_total": 1 << 20, "throughput_gbps": 0.3, "reason": "every_steps"}


def write_run(run_dir: Path, lines: list) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / METRICS_FILE).write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return run_dir


@pytest.fixture
def runs(tmp_path) -> tuple[Path, Path]:
    """An uninterrupted 20-step run, and one killed after step 12 (checkpoint at 10, a torn last
    line), resumed from step 10 into the same metrics.jsonl."""
    full = [step_record(s) for s in range(1, 21)]
    full.insert(10, ckpt_event(10))
    full[5]["val_loss"] = 3.0
    first = [step_record(s, bump=0.5 if s > 10 else 0.0) for s in range(1, 13)]
    first.insert(10, ckpt_event(10))
    resumed = first + ['{"step": 13, "loss": 2.',
                       {"event": "resume", "step": 10, "path": "ckpt/step_10", "load_s": 0.4}]
    resumed += [step_record(s) for s in range(11, 21)]
    return write_run(tmp_path / "uninterrupted", full), write_run(tmp_path / "resumed", resumed)


def png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == PNG_SIGNATURE and head[12:16] == b"IHDR"
    return struct.unpack(">II", head[16:24])


def test_reader_keeps_the_resumed_records_and_sets_the_replaced_ones_apart(runs):
    _, resumed = runs
    run = read_run(resumed)
    assert [r["step"] for r in run.steps] == list(range(1, 21))
    assert [r["step"] for r in run.superseded] == [11, 12]
    assert run.series("loss")[1][10] == pytest.approx(step_record(11)["loss"])  # the resumed record wins
    assert [(r["step"], r["load_s"]) for r in run.resumes] == [(10, 0.4)]
    assert [c["step"] for c in run.checkpoints] == [10] and run.skipped_lines == 1 and run.label == "resumed"


def test_a_step_that_goes_back_without_a_resume_event_counts_as_a_resume(tmp_path):
    run = read_run(write_run(tmp_path / "old", [step_record(s) for s in (1, 2, 3, 2, 3, 4)]))
    assert [r["step"] for r in run.resumes] == [1] and run.resumes[0]["implicit"]
    assert [r["step"] for r in run.steps] == [1, 2, 3, 4] and [r["step"] for r in run.superseded] == [2, 3]


def test_plot_one_and_two_runs(runs, tmp_path):
    width, height = int(FIGSIZE_IN[0] * DPI), int(FIGSIZE_IN[1] * DPI)
    one = plot_runs([runs[0]], out=tmp_path / "one.png")
    assert png_size(tmp_path / "one.png") == (width, height)
    assert (tmp_path / "one.png").stat().st_size > 20_000
    assert one["runs"][0]["steps"] == 20 and one["runs"][0]["checkpoints"] == 1
    two = plot_runs(list(runs), out=tmp_path / "sub" / "two.png", labels=["base", "resume"], title="resume check")
    assert png_size(tmp_path / "sub" / "two.png") == (width, height)
    assert (tmp_path / "sub" / "two.png").stat().st_size > (tmp_path / "one.png").stat().st_size
    assert [r["label"] for r in two["runs"]] == ["base", "resume"]
    assert two["runs"][1]["resumes"] == [10] and two["runs"][1]["replaced_steps"] == 2
    # the redone steps 11-12 of the first attempt differ, but the resumed records win: a seamless resume
    assert two["runs"][1]["loss_vs_first"] == {"steps": 20, "max_abs": 0.0}


def test_plot_errors_say_what_to_do(runs, tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match=r"nowhere/metrics.jsonl does not exist: pass a run directory"):
        plot_runs([tmp_path / "nowhere"], out=tmp_path / "x.png")
    with pytest.raises(ValueError, match="--labels has 1 names for 2 run directories"):
        plot_runs(list(runs), out=tmp_path / "x.png", labels=["a"])
    with pytest.raises(ValueError, match="holds no step records yet"):
        plot_runs([write_run(tmp_path / "empty", [ckpt_event(1)])], out=tmp_path / "x.png")
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # as if matplotlib were not installed
    with pytest.raises(ImportError, match=r"plotting needs matplotlib.*pip install 'fsdpkit\[plot\]'"):
        plot_runs([runs[0]], out=tmp_path / "x.png")


def test_fsdpkit_plot_command(runs, tmp_path, capsys):
    out = tmp_path / "cmp.png"
    assert main(["plot", str(runs[0]), str(runs[1]), "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"wrote {out}" in printed and "resumed: steps 1-20, resumed at 10, 2 steps redone" in printed
    assert "max |loss difference| vs uninterrupted 0 over 20 shared steps" in printed
    assert "1 unreadable lines skipped" in printed and png_size(out)[0] == int(FIGSIZE_IN[0] * DPI)
    assert main(["plot", str(runs[0])]) == 0 and (runs[0] / "metrics.png").is_file()  # default: in the run dir
    assert main(["plot", str(tmp_path / "missing")]) == 2
    assert "fsdpkit plot: error:" in capsys.readouterr().err
