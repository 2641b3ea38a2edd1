"""Sharding plans checked in one process with torch's fake backend: wrap policy, local shard
shapes and the world-size-invariant init at any world size."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from fsdpkit.config import compose_config
from fsdpkit.hf import build_model
from fsdpkit.model import init_std
from fsdpkit.parallel import apply_fsdp, init_weights, materialize
from fsdpkit.parallel.fsdp import build_mesh
from fsdpkit.parallel.policies import matching_modules

OVERRIDES = ["model.vocab_size=1001", "device=cpu"]


@pytest.fixture
def fake_world(request):
    ws, rank = request.param
    dist.init_process_group("fake", rank=rank, world_size=ws, store=FakeStore())
    yield ws, rank
    dist.destroy_process_group()


def check_local_shards(ws: int, rank: int) -> None:
    """Every local shard holds exactly its rows of the single-process init (run in a fresh
    interpreter per (ws, rank): the fake backend leaks device-mesh state across re-inits)."""
    dist.init_process_group("fake", rank=rank, world_size=ws, store=FakeStore())
    cfg = compose_config(OVERRIDES)
    reference = build_model(cfg.model)
    init_weights(reference, seed=cfg.seed, std=init_std(reference))
    with torch.device("meta"):
        model = build_model(cfg.model)
    plan = apply_fsdp(model, cfg, mesh=build_mesh(cfg, torch.device("cpu")))
    materialize(model, device=torch.device("cpu"), seed=cfg.seed)
    assert plan.units == ["model.layers.0", "model.layers.1"] and plan.reshard_after_forward is True
    for name, param in model.named_parameters():
        full = reference.get_parameter(name)
        chunk = -(-full.shape[0] // ws)  # FSDP2 shards dim 0 in torch.chunk sizes
        assert torch.equal(param.to_local(), full[rank * chunk : (rank + 1) * chunk]), name
    assert torch.equal(model.model.rotary_emb.inv_freq, reference.model.rotary_emb.inv_freq)


SHARD_CASES = [(3, 0), (3, 2), (8, 7), (5, 1)]
# One fresh interpreter imports torch and fsdpkit once (~5 CPU-s), then forks a child per case: each
# child starts from a never-initialised process group, as a fresh interpreter would.
_FORK_EACH_CASE = """
import json, os, sys, traceback
sys.path.insert(0, {here!r})
import test_sharding_plan as t
codes = {{}}
for ws, rank in t.SHARD_CASES:
    pid = os.fork()
    if pid == 0:
        try:
            t.check_local_shards(ws, rank)
        except BaseException:
            print(f"--- (ws, rank) = ({{ws}}, {{rank}})", file=sys.stderr)
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
        os._exit(0)
    codes[f"{{ws}},{{rank}}"] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
print(json.dumps(codes))
"""


@pytest.fixture(scope="module")
def local_shard_checks() -> tuple[dict[str, int], str]:
    code = _FORK_EACH_CASE.format(here=str(Path(__file__).parent))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1]), proc.stderr


@pytest.mark.parametrize(("ws", "rank"), SHARD_CASES)
def test_local_shards_hold_their_rows_of_the_reference_init(local_shard_checks, ws, rank):
    codes, stderr = local_shard_checks
    assert codes[f"{ws},{rank}"] == 0, stderr[-3000:]


@pytest.mark.parametrize("fake_world", [(4, 0)], indirect=True)
@pytest.mark.parametrize(
    ("strategy", "mesh", "reshard"),
    [("FULL_SHARD", (4,), True), ("SHARD_GRAD_OP", (4,), False), ("NO_SHARD", (4, 1), False),
     ("HYBRID_SHARD", (2, 2), True)],
)
def test_strategies_map_onto_fsdp2(fake_world, strategy, mesh, reshard):
    cfg = compose_config(OVERRIDES + [f"strategy.sharding_strategy={strategy}", "strategy.hsdp_shard_size=2"])
    with torch.device("meta"):
        model = build_model(cfg.model)
    plan = apply_fsdp(model, cfg, mesh=build_mesh(cfg, torch.device("cpu")))
    assert tuple(plan.mesh.shape) == mesh and plan.reshard_after_forward is reshard


def test_wrap_policy_typo_is_a_clear_error():
    with torch.device("meta"):
        model = build_model(compose_config().model)
    with pytest.raises(ValueError, match="cannot import 'fsdpkit.model.llama.LlamaDecoderLayr'"):
        matching_modules(model, ["fsdpkit.model.llama.LlamaDecoderLayr"], setting="policy.auto_wrap_policy")
    with pytest.raises(ValueError, match=r"matches no module of LlamaForCausalLM; the model's module classes are: "
                                         r".*fsdpkit\.model\.llama\.LlamaDecoderLayer"):
        matching_modules(model, ["torch.nn.TransformerEncoderLayer"], setting="policy.auto_wrap_policy")


@pytest.mark.parametrize("fake_world", [(2, 0)], indirect=True)
def test_compile_backend_is_used_and_an_unknown_one_is_a_clear_error(fake_world, monkeypatch):
    backends = []
    real_compile = torch.compile

    def recording_compile(fn, **kwargs):
        backends.append(kwargs.get("backend"))
        return real_compile(fn, **kwargs)

    monkeypatch.setattr(torch, "compile", recording_compile)
    cfg = compose_config(OVERRIDES + ["train.compile=true", "train.compile_backend=aot_eager"])
    with torch.device("meta"):
        model = build_model(cfg.model)
    plan = apply_fsdp(model, cfg, mesh=build_mesh(cfg, torch.device("cpu")))
    assert len(plan.compiled) == len(model.model.layers) > 0 and backends == ["aot_eager"] * len(plan.compiled)
    cfg = compose_config(OVERRIDES + ["train.compile=true", "train.compile_backend=inductr"])
    with torch.device("meta"):
        model = build_model(cfg.model)
    with pytest.raises(ValueError,
                       match=r"train.compile_backend='inductr' is not a torch.compile backend; use one of .*inductor"):
        apply_fsdp(model, cfg, mesh=build_mesh(cfg, torch.device("cpu")))
