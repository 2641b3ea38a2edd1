"""Save-plan caching gives the bytes an uncached save gives, for two Checkpointers in one process,
and is used: after a first save, DCP's local plans go out empty until the state's structure changes
(tests/multirank/plan_cache_worker.py has the scenario)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import torchrun

pytestmark = pytest.mark.dist
WORKER = Path(__file__).with_name("plan_cache_worker.py")


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> list[list[dict]]:
    out = tmp_path_factory.mktemp("plan_cache")
    torchrun(2, WORKER, str(out / "res.json"), str(out / "work"))
    return json.loads((out / "res.json").read_text())


def test_cached_saves_write_what_uncached_saves_write(reports):
    for rank, report in enumerate(reports):
        assert len(report) == 8
        for save in report:
            assert save["cached"] == save["reference"], (rank, save["name"], save["step"])
            assert len(save["cached"]) == 2  # one data file of this rank's and the metadata


def test_a_save_is_planned_afresh_only_when_the_state_changed(reports):
    for report in reports:
        planned = {(s["name"], s["step"]): s["planned"] for s in report}
        # step 3 changed the net's `state` tensor: its plan went out again; the EMA's did not
        assert planned == {("net", 1): [True], ("net", 2): [False], ("net", 3): [True], ("net", 4): [False],
                           ("ema", 1): [True], ("ema", 2): [False], ("ema", 3): [False], ("ema", 4): [False]}
        keys = {s["name"]: {t["key"] for t in report if t["name"] == s["name"]} for s in report}
        assert len(keys["net"]) == len(keys["ema"]) == 1 and keys["net"] != keys["ema"]  # a cache each
