"""make chaos's verdicts (chaos/run.py): a trial whose fault did not land where its case names it is
"not exercised", never a pass, and a case with no exercised trial fails the run."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "chaos"), str(ROOT / "tests")]

import run  # noqa: E402  (chaos/run.py)
from harness import Outcome  # noqa: E402


def outcome(case: str, *, ok: bool = True, exercised: bool = True, detail: str = "") -> Outcome:
    return Outcome(case=f"{case}: what", trial=0, seed=7, ok=ok, exercised=exercised, detail=detail)


def test_a_trial_whose_fault_did_not_land_is_counted_apart_and_never_as_a_pass():
    results = [outcome("kill"), outcome("kill", exercised=False, detail="arrived after the commit"),
               outcome("disk", exercised=False, detail="filled in the shard"), outcome("fuzz", ok=False, detail="boom")]
    text = run.table(results, seed=7, wall_s=60)
    assert "| kill | 2 | 1 | 1 | 0 |" in text
    assert "| disk | 1 | 0 | 1 | 0 |" in text
    assert "| fuzz | 1 | 0 | 0 | 1 |" in text
    assert "4 trials, 1 passed, 2 not exercised" in text
    assert "- not exercised: kill: what #0: arrived after the commit" in text
    assert run.never_exercised(results) == ["disk"]  # kill had one landed trial; fuzz failed (a verdict)
