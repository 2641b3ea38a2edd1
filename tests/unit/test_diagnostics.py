"""Diagnostics without a real process group: memory per phase, the gradient-norm and optimizer
checks in a world of one, findings and their texts, the TensorBoard writer, the settings read
back from FSDP2 at world size 4 on the fake backend, and the package's import direction."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from torch import nn

from fsdpkit import diagnostics
from fsdpkit.diagnostics import findings as codes
from fsdpkit.diagnostics.contracts import check_optimizer, check_shared, run_static_checks
from fsdpkit.diagnostics.findings import ERROR, WARNING, Finding, FSDPContractError, report_findings
from fsdpkit.diagnostics.fsdp_state import human_bytes, python_path
from fsdpkit.diagnostics.grad_norm import grad_norm_findings
from fsdpkit.diagnostics.memory import PhaseMemory, PsutilRssProbe, memory_probe, phase_memory
from fsdpkit.diagnostics.report import infer_strategy
from fsdpkit.diagnostics.tensorboard import TensorBoardWriter

SRC = Path(__file__).resolve().parents[2] / "src" / "fsdpkit"


class FakeProbe:
    """Memory figures scripted per call: current_mib/peak_mib return the next values."""

    method = "fake"

    def __init__(self, values: list[float]):
        self.values = list(values)
        self.resets = 0

    def current_mib(self) -> float:
        return self.values.pop(0)

    def peak_mib(self) -> float:
        return self.values.pop(0)

    def reset_peak(self) -> None:
        self.resets += 1


def test_phase_memory_keeps_each_phase_peak_and_stops_after_n_steps():
    # first mark reads the pre-existing peak (50), then: step 1 start 10, two micro-batches of
    # forward/backward (30, 60, 40, 70), optimizer 35; step 2 start 12, forward 31, backward 65, optimizer 36
    probe = FakeProbe([50, 10, 30, 60, 40, 70, 35, 12, 31, 65, 36])
    mem = PhaseMemory(steps=2, probe=probe)
    for micro in (2, 1):
        mem.mark("batch_start")
        for _ in range(micro):
            mem.mark("forward")
            mem.mark("backward")
        mem.mark("optimizer_step")
        mem.end_step()
    assert mem.done and probe.values == []
    mem.mark("batch_start")  # a no-op now: no probe call (the list is empty), no reset
    mem.mark("forward")
    assert probe.resets == 11 - 1
    s = mem.summary()
    assert s["per_step_mib"] == [{"batch_start": 10, "forward": 40, "backward": 70, "optimizer_step": 35},
                                 {"batch_start": 12, "forward": 31, "backward": 65, "optimizer_step": 36}]
    assert s["peak_mib"] == {"batch_start": 12, "forward": 40, "backward": 70, "optimizer_step": 36}
    assert (s["largest_phase"], s["largest_mib"], s["steps"]) == ("backward", 70, 2)
    assert mem.observed_peak_mib == 70


def test_phase_memory_next_start_closes_a_step_and_zero_steps_is_off():
    mem = PhaseMemory(steps=1, probe=FakeProbe([0, 5, 9]))
    mem.mark("start")
    mem.mark("fwd")
    mem.mark("start")  # closes step 1 without end_step(): done, nothing more recorded
    assert mem.done and mem.summary()["per_step_mib"] == [{"start": 5, "fwd": 9}]
    off = phase_memory(torch.device("cpu"), steps=0)
    off.mark("start")
    assert off.done and off.summary()["steps"] == 0 and off.probe.method == "off"


def test_cpu_probe_reports_plausible_rss():
    probe = memory_probe(torch.device("cpu"))
    before = probe.current_mib()
    probe.reset_peak()
    blob = torch.ones(64 * 2**20 // 4)  # 64 MiB touched
    peak = probe.peak_mib()
    del blob
    assert 10 < before < 64 * 1024
    if "VmHWM" in probe.method:  # Linux: a resettable peak that saw the 64 MiB
        assert peak >= before + 48


def test_psutil_fallback_probe():
    probe = PsutilRssProbe()
    probe.reset_peak()
    assert 10 < probe.current_mib() < 64 * 1024 and probe.peak_mib() > 10


def test_grad_norm_check_in_a_world_of_one():
    p = nn.Parameter(torch.zeros(4))
    p.grad = torch.tensor([3.0, 4.0, 0.0, 0.0])  # norm 5
    assert grad_norm_findings(5.0, parameters=[p], max_norm=0.0) == []
    assert grad_norm_findings(torch.tensor(5.0), parameters=[p], max_norm=float("inf")) == []
    (exceeds,) = grad_norm_findings(5.0, parameters=[p], max_norm=1.0)  # "clipped" but still 5
    assert exceeds.code == codes.PER_SHARD_GRAD_NORM
    assert "after clipping to max_norm=1 the global gradient norm is 5" in exceeds.message
    (wrong,) = grad_norm_findings(4.0, parameters=[p], max_norm=0.0)
    assert wrong.code == codes.GRAD_NORM_MISMATCH and "reported gradient norm 4 is not the global norm" in wrong.message
    torch.nn.utils.clip_grad_norm_([p], 1.0)
    assert grad_norm_findings(5.0, parameters=[p], max_norm=1.0) == []
    p.grad = None
    assert grad_norm_findings(5.0, parameters=[p], max_norm=1.0) == []  # nothing to check after zero_grad


def test_unsharded_model_and_stale_optimizer_are_errors_with_the_fix():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    stale = torch.optim.SGD(nn.Linear(4, 4).parameters(), lr=0.1)
    found = run_static_checks(model, stale)
    assert [f.code for f in found] == [codes.NOT_SHARDED, codes.OPTIMIZER_BEFORE_SHARDING]
    with pytest.raises(FSDPContractError, match=r"Sequential is not sharded: no module has fully_shard applied.*"
                                                r"fully_shard\(block\)"):
        diagnostics.check(model)
    (f,) = check_optimizer(model, stale)
    assert "Create the optimizer after fully_shard" in f.message and "2 of 2 tensors" in f.message
    partial = torch.optim.SGD(model[0].parameters(), lr=0.1)
    (f,) = check_optimizer(model, partial)
    assert f.level == WARNING and f.code == codes.PARAMS_NOT_IN_OPTIMIZER and "'1.weight'" in f.message
    assert check_optimizer(model, torch.optim.SGD(model.parameters(), lr=0.1)) == []


def test_a_module_registered_twice_is_reported_once_with_both_names():
    block = nn.Sequential(nn.Linear(4, 4))
    model = nn.ModuleDict({"a": block, "b": nn.ModuleDict({"alias": block})})
    (f,) = check_shared(model)
    assert f.code == codes.REGISTERED_TWICE and "Sequential is registered 2 times, as 'a', 'b.alias'" in f.message
    tied = nn.ModuleDict({"emb": nn.Embedding(8, 4), "head": nn.Linear(4, 8, bias=False)})
    tied["head"].weight = tied["emb"].weight  # tied weights in one unit are fine
    assert check_shared(tied) == []


def test_report_findings_logs_warnings_and_raises_errors(caplog):
    warn = Finding(WARNING, "w", "a warning")
    err = Finding(ERROR, "e", "an error; do this instead")
    logger = logging.getLogger("fsdpkit")
    propagate, logger.propagate = logger.propagate, True  # setup_logging may have turned it off
    with caplog.at_level(logging.WARNING, logger="fsdpkit"):
        try:
            assert report_findings([warn]) == [warn]
            with pytest.raises(FSDPContractError, match=r"FSDP setup check failed:\n  \[e\] an error; do this instead"):
                report_findings([warn, err])
            assert report_findings([err], strict=False) == [err]
        finally:
            logger.propagate = propagate
    assert [r.getMessage() for r in caplog.records] == ["[w] a warning", "[w] a warning",
                                                        "[e] an error; do this instead"]
    assert isinstance(FSDPContractError([err]), ValueError)  # the CLI prints it as a user error


def test_disabled_diagnostics_are_no_ops():
    diag = diagnostics.start_diagnostics(nn.Linear(2, 2), None, device=torch.device("cpu"), enabled=False)
    diag.memory.mark("batch_start")
    diag.check_grad_norm(1.0, parameters=[], max_norm=1.0)
    diag.after_step(last=True)
    assert diag.report is None and diag.memory.done


@pytest.mark.parametrize(("shape", "placements", "reshard", "name"), [
    ((4,), ("Shard(dim=0)",), {True}, "FULL_SHARD"),
    ((4,), ("Shard(dim=0)",), {False}, "SHARD_GRAD_OP"),
    ((4,), ("Shard(dim=0)",), {2}, "FULL_SHARD, resharded to 2 ranks after forward"),
    ((2, 2), ("Replicate()", "Shard(dim=0)"), {True}, "HYBRID_SHARD"),
    ((4, 1), ("Replicate()", "Shard(dim=0)"), {False}, "NO_SHARD"),
])
def test_strategy_names(shape, placements, reshard, name):
    assert infer_strategy(shape, placements, reshard) == name


def test_names_and_sizes_read_like_code():
    assert python_path("model.layers.3.mlp") == "model.model.layers[3].mlp"
    assert python_path("") == "model"
    assert [human_bytes(b) for b in (12, 3 * 2**10, 5.5 * 2**20, 2**31)] == ["12 B", "3.00 KiB", "5.50 MiB", "2.00 GiB"]


def test_tensorboard_missing_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as if absent
    with pytest.raises(ImportError, match=r"logging.tensorboard=true needs the tensorboard package.*pip install "
                                          r"tensorboard"):
        TensorBoardWriter.open("tb")


def test_tensorboard_writer_maps_step_and_event_records(monkeypatch, tmp_path):
    calls = []

    class FakeSummaryWriter:
        def __init__(self, log_dir):
            calls.append(("open", log_dir))

        def add_scalar(self, tag, value, step):
            calls.append((tag, value, step))

        def add_text(self, tag, text, step):
            calls.append((tag, text, step))

        def flush(self):
            pass

        def close(self):
            calls.append(("close",))

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=FakeSummaryWriter))
    writer = TensorBoardWriter.open(tmp_path)
    writer.write({"step": 3, "loss": 2.5, "grad_norm": 0.7, "lr": 1e-3, "tokens_per_s": 9e3, "val_loss": 2.6})
    writer.write({"event": "checkpoint", "step": 3, "path": "p", "mode": "async", "stall_s": 0.2,
                  "reason": "every_steps"})
    writer.write({"event": "resume", "step": 3, "path": "p", "load_s": 0.4})
    writer.close()
    writer.close()
    assert calls[0] == ("open", str(tmp_path)) and calls[-1] == ("close",)
    assert ("train/loss", 2.5, 3) in calls and ("val/loss", 2.6, 3) in calls and ("train/lr", 1e-3, 3) in calls
    assert ("checkpoint/stall_s", 0.2, 3) in calls and ("resume/load_s", 0.4, 3) in calls
    assert ("events/checkpoint", "step 3: checkpoint mode=async, reason=every_steps, path=p", 3) in calls


def describe_strategies_at_world_size_4() -> None:
    """Print, as JSON, what diagnostics reads back from FSDP2 for each strategy (fake backend,
    world size 4, meta-device model: no memory and no real collectives)."""
    import torch.distributed as tdist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from fsdpkit.config import compose_config
    from fsdpkit.hf import build_model
    from fsdpkit.parallel import apply_fsdp
    from fsdpkit.parallel.fsdp import build_mesh

    tdist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
    out = {}
    for name, overrides in {
        "FULL_SHARD": [], "SHARD_GRAD_OP": ["strategy.sharding_strategy=SHARD_GRAD_OP"],
        "HYBRID_SHARD": ["strategy.sharding_strategy=HYBRID_SHARD", "strategy.hsdp_shard_size=2"],
        "NO_SHARD": ["strategy.sharding_strategy=NO_SHARD"],
        "offload_ac_bf16": ["strategy.cpu_offload=true", "experiment=[bf16,activation_checkpointing]"],
    }.items():
        cfg = compose_config(["device=cpu", "model.num_hidden_layers=3", *overrides])
        with torch.device("meta"):
            model = build_model(cfg.model)
        apply_fsdp(model, cfg, mesh=build_mesh(cfg, torch.device("cpu")))
        out[name] = diagnostics.describe_sharding(model)
        out[name]["findings"] = [f.code for f in run_static_checks(model)]
    print(json.dumps(out, default=str))
    tdist.destroy_process_group()


def test_settings_are_read_back_from_the_live_modules():
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
            "import test_diagnostics as t; t.describe_strategies_at_world_size_4()")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, mesh, units, root in (("FULL_SHARD", [4], True, False), ("SHARD_GRAD_OP", [4], False, False),
                                    ("HYBRID_SHARD", [2, 2], True, False), ("NO_SHARD", [4, 1], False, False)):
        r = got[name]
        assert r["sharding_strategy"] == name and r["mesh"]["shape"] == mesh, name
        assert r["reshard_after_forward"] == {"units": units, "root": root}, name
        assert r["num_units"] == 3 and r["sample_units"] == ["model.layers.0", "model.layers.1", "model.layers.2"]
        assert r["offload"] == ["none"]
        assert r["mixed_precision"]["param_dtype"] == "unset"
        assert r["num_checkpointed"] == 0
        assert r["findings"] == [], (name, r["findings"])
        shard_ranks = mesh[-1]
        assert r["local_param_mib"] == pytest.approx(r["total_param_mib"] / shard_ranks, rel=0.02), name
    r = got["offload_ac_bf16"]
    assert r["offload"] == ["cpu"] and r["num_checkpointed"] == 3
    assert r["mixed_precision"] == {"param_dtype": "bfloat16", "reduce_dtype": "float32", "output_dtype": "float32",
                                    "cast_forward_inputs": True}
    assert {u["param_dtype"] for u in r["units"]} == {"bfloat16"} and r["findings"] == []
