"""Diagnostics on 2 real gloo ranks (one torchrun spawn, shared): the report of a correctly
configured run, memory per phase, and each FSDP setup mistake committed on purpose."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import ROOT, torchrun  # noqa: E402

pytestmark = pytest.mark.dist
WORKER = ROOT / "tests" / "multirank" / "diag_worker.py"


@pytest.fixture(scope="module")
def diag(tmp_path_factory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("diag")
    torchrun(2, WORKER, str(out / "result.json"), str(out / "run"), timeout=300)
    return json.loads((out / "result.json").read_text()), out / "run"


def test_report_of_a_correct_two_rank_run(diag):
    res, run_dir = diag
    rep = res["correct"]["report"]
    assert rep["world_size"] == 2 and rep["mesh"] == {"shape": [2], "dim_names": ["shard"],
                                                      "placements": ["Shard(dim=0)"]}
    assert rep["sharding_strategy"] == "FULL_SHARD" and rep["reshard_after_forward"] == {"units": True, "root": False}
    assert rep["num_units"] == 2 and rep["sample_units"] == ["model.layers.0", "model.layers.1"] and rep["root_sharded"]
    assert rep["num_checkpointed"] == 2 and rep["offload"] == ["none"]
    assert rep["mixed_precision"]["param_dtype"] == "bfloat16" and rep["mixed_precision"]["reduce_dtype"] == "float32"
    assert rep["total_param_mib"] == pytest.approx(res["correct"]["full_mib"])
    for mib in rep["local_param_mib_per_rank"]:
        assert mib == pytest.approx(rep["total_param_mib"] / 2, rel=0.01)
    assert rep["local_param_mib_per_rank"] == res["local_mib_by_rank"]  # what each rank computed itself
    assert rep["findings"] == [] and rep["param_skew"] < 1.01
    on_disk = json.loads((run_dir / "diagnostics.json").read_text())
    assert on_disk["num_units"] == 2 and on_disk["memory"]["steps"] == 3
    log = res["correct"]["log"]
    assert "FSDP2 as applied (read from the modules, not the config)" in log
    assert "units: 2 besides the root (model.layers.0, model.layers.1)" in log
    assert "checks: no setup problems found" in log
    assert "peak memory per phase over the first 3 steps" in log


def test_memory_per_phase_is_present_and_plausible(diag):
    res, run_dir = diag
    mem = json.loads((run_dir / "diagnostics.json").read_text())["memory"]
    phases = ["batch_start", "forward", "backward", "optimizer_step"]
    assert mem["phases"] == phases and mem["steps"] == 3 and len(mem["per_step_mib"]) == 3
    assert mem["largest_phase"] in phases[1:] and mem["largest_mib"] == max(mem["peak_mib"].values())
    for row in mem["per_step_mib"]:
        assert all(50 < row[p] < 8192 for p in phases), row  # an RSS of this process, in MiB
        # forward's peak is at least what was resident when the step began (1 MiB slack: RSS pages)
        assert row["forward"] >= row["batch_start"] - 1, row
    assert len(mem["per_rank_mib"]) == 2 and mem["max_over_ranks_mib"]["backward"] >= mem["peak_mib"]["backward"]
    assert res["correct"]["memory_after"]["steps"] == 3  # a no-op after the 3 watched steps


def test_first_step_checks_pass_and_leave_no_trace(diag):
    res, _ = diag
    assert res["correct"]["forward_attr_restored"]
    assert len(res["correct"]["norms"]) == 4
    assert res["mistakes"]["correct_forward"] == {"raised": False, "codes": [], "text": ""}
    assert res["mistakes"]["global_clipping"] == {"raised": False, "codes": [], "text": ""}


@pytest.mark.parametrize(("case", "code", "raised", "text"), [
    ("optimizer_before_sharding", "optimizer-before-sharding", True,
     r"the optimizer holds 8 of 8 tensors that are not parameters of the model .* built before sharding.*"
     r"Create the optimizer after fully_shard"),
    ("direct_root_forward", "forward-bypassed-hooks", True,
     r"the root \(Toy\)\.forward\(\) was called directly, which skips FSDP's pre-forward hook.*"
     r"call the module instead: model\(x\), not model\.forward\(x\)"),
    ("direct_child_forward", "forward-bypassed-hooks", True,
     r"blocks\.0\.forward\(\) was called directly.*model\.blocks\[0\]\(x\), not model\.blocks\[0\]\.forward\(x\)"),
    ("only_root", "only-root-sharded", False,
     r"only the root module is sharded: fully_shard\(model\) made one FSDP unit .*the wrap policy matched nothing"),
    ("root_not_sharded", "params-outside-units", True,
     r"4 parameters are outside every FSDP unit \('embed.weight'.*call fully_shard\(model\) on the root"),
    ("not_sharded", "not-sharded", True, r"Toy is not sharded: no module has fully_shard applied"),
    ("registered_twice", "registered-twice", False,
     r"Block is registered 2 times, as 'blocks.0', 'blocks.2': the same parameters are reachable under 2 parents"),
    ("per_shard_clipping", "per-shard-grad-norm", True,
     r"the gradient norm differs across ranks \(rank 0: .*, rank 1: .*\): it was computed over each rank's local "
     r"shards.*clip_grad_norm_\(model.parameters\(\), max_norm\)"),
    ("mp_not_propagated", "mixed-precision-not-propagated", True,
     r"mixed precision did not reach every FSDP unit: bfloat16 is the root's param_dtype, but 2 of 3 units compute "
     r"with float32 parameters \('blocks.0', 'blocks.1'\).*same mp_policy to every fully_shard call"),
    ("fp32_in_forward", "fp32-in-forward", True,
     r"mixed precision asks for bfloat16 parameters in forward, but 3 FSDP units computed with other dtypes "
     r"\(the root \(Toy\): embed.weight float32; blocks.0: blocks.0.lin.weight float32"),
    ("skew", "param-skew", False, r"ranks hold unequal parameter shards: rank 0 .* \(ratio 1.\d+ > "
                                  r"diagnostics.skew_warn_ratio 1.01\)"),
])
def test_each_mistake_gets_its_message(diag, case, code, raised, text):
    got = diag[0]["mistakes"][case]
    assert got["codes"] == [code] and got["raised"] is raised, got
    assert re.search(text, got["text"], flags=re.S), got["text"]
