"""The seeded corruption fuzz (tests/fuzz/corruption.py), fast subset: 64 mutations over every
file kind of a 2-rank checkpoint. Zero silent wrong loads, zero tracebacks; every damage that
changes meaning is named by verify (the damaged file blamed and named) and skipped (moved aside,
with a warning naming the file) or refused by auto-resume. A load counts as right only when every
restored item equals, by torch.equal, an independent copy of the undamaged checkpoint read by
torch's own DCP reader: never by fsdpkit's checksums, which guard the load under test.
`make chaos` runs a larger count."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import ROOT, fsdpkit, run_python  # noqa: E402

pytestmark = pytest.mark.e2e
OVERRIDES = ["experiment=demo", "train.max_steps=8", "checkpoint.every_steps=4", "train.eval_every=0"]
COUNT = int(os.environ.get("FUZZ_COUNT", "64"))  # more cases: FUZZ_COUNT=1000 pytest ...


def test_corruption_fuzz(tmp_path):
    run = tmp_path / "run"
    proc = fsdpkit("train", "--nproc", "2", *OVERRIDES, f"run_dir={run}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "report.json"
    fuzz = run_python(str(ROOT / "tests" / "fuzz" / "corruption.py"), "--run", str(run), "--count", str(COUNT),
                      "--seed", "20261122", "--out", str(out), *OVERRIDES, timeout=900)
    print(fuzz.stdout)
    assert out.is_file(), fuzz.stderr[-4000:]
    report = json.loads(out.read_text())
    assert len(report["records"]) == COUNT >= 60
    assert {r["kind"] for r in report["records"]} >= {"manifest valid-JSON edit", "shard bit flip", "junk latest"}
    assert report["failures"] == [], fuzz.stdout[-4000:]
    skipped = [r for r in report["records"] if r["resume"] == "skipped to older"]
    assert skipped and all(r["moved_aside"] for r in skipped if r["kind"] != "manifest deleted")
    assert all(r["damaged"] for r in report["records"])  # each mutation says which file it damaged
    assert fuzz.returncode == 0
