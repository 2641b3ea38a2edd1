"""B9's simulation (bench/coordinator_plans.py) cannot drift from DCP: at 8 simulated ranks, the
plans it builds for every rank equal those DCP makes from FSDP2's real shards (each rank built in
turn under torch's fake process group), and so do the global plan and metadata DCP derives."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch.distributed as tdist
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

WORLD, LAYERS = 8, 2


def _fake_group(rank: int, world: int) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    tdist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)


def _real_plans() -> tuple[list, list]:
    """(every rank's local SavePlan, every rank's state dict) from FSDP2 under the fake group."""
    from coordinator_state import build
    from fsdpkit.checkpoint.state import CheckpointTarget

    plans, states = [], []
    for rank in range(WORLD):
        _fake_group(rank, WORLD)
        try:
            model, opt = build(layers=LAYERS)
            state = CheckpointTarget(model, opt).tensor_state(rank=rank)
            planner = DefaultSavePlanner()
            planner.set_up_planner(state, is_coordinator=rank == 0)
            plans.append(planner.create_local_plan())
            states.append(state)
        finally:
            tdist.destroy_process_group()
    return plans, states


@pytest.fixture(scope="module")
def real():
    return _real_plans()


def test_synthetic_plans_equal_dcp_plans_of_real_shards(real):
    from coordinator_plans import (
        load_plan_for_rank,
        rank0_state,
        remember_sizes,
        save_plan_for_rank,
    )

    plans, states = real
    _fake_group(0, WORLD)
    try:
        state0 = rank0_state(world=WORLD, layers=LAYERS)
        planner = DefaultSavePlanner()
        planner.set_up_planner(state0, is_coordinator=True)
        plan0 = planner.create_local_plan()
    finally:
        tdist.destroy_process_group()
    assert len(plan0.items) == len(plans[0].items) > 9 * LAYERS * 3
    synthetic = [save_plan_for_rank(plan0, rank=r, world=WORLD) for r in range(WORLD)]
    for r in range(WORLD):
        assert [repr(i) for i in synthetic[r].items] == [repr(i) for i in plans[r].items], f"rank {r}"
        assert synthetic[r].planner_data == plans[r].planner_data, f"rank {r}"
    real_global, real_md = DefaultSavePlanner().create_global_plan(plans)
    syn_global, syn_md = DefaultSavePlanner().create_global_plan(synthetic)
    assert [len(p.items) for p in syn_global] == [len(p.items) for p in real_global]
    assert syn_md.state_dict_metadata.keys() == real_md.state_dict_metadata.keys()
    assert repr(syn_md.state_dict_metadata) == repr(real_md.state_dict_metadata)

    # the load side: rank r's plan against the same metadata, from real shards and synthetic
    remember_sizes(real_md)
    load0 = None
    for r in (0, 3, WORLD - 1):
        _fake_group(r, WORLD)
        try:
            from coordinator_state import build
            from fsdpkit.checkpoint.state import CheckpointTarget

            model, opt = build(layers=LAYERS)
            lp = DefaultLoadPlanner()
            lp.set_up_planner(CheckpointTarget(model, opt).tensor_state(rank=r), real_md, r == 0)
            real_load = lp.create_local_plan()
        finally:
            tdist.destroy_process_group()
        load0 = load0 or real_load
        syn = load_plan_for_rank(load0, rank=r, world=WORLD)
        assert sorted(map(repr, syn.items)) == sorted(map(repr, real_load.items)), f"rank {r}"
