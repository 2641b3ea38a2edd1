"""A Checkpointer of a model without an optimizer (an EMA copy, a frozen teacher), end to end in one
process (no process group; a gloo world of one for the full state dict type): save, `fsdpkit ckpt
verify|inspect|export`, a bitwise resume with its RNG and state, and a checkpoint with optimizer
state resumed without an optimizer, or the reverse: refused before anything is loaded, with the way
out (model_only) that then works.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from fsdpkit.checkpoint import Checkpointer
from fsdpkit.checkpoint.errors import CheckpointMismatchError
from fsdpkit.checkpoint.manifest import read_manifest
from fsdpkit.cli.main import main

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _cli(capsys, *args: str) -> tuple[int, str]:
    code = main(["ckpt", *args])
    return code, capsys.readouterr().out


@pytest.fixture
def ema_run(tmp_path) -> tuple[Path, dict[str, torch.Tensor], dict, torch.Tensor]:
    """An EMA model's checkpoints at steps 2 and 4 (no optimizer); returns (root, the EMA weights
    and state at step 4, the RNG state at step 4)."""
    ema, student = _model(0), _model(1)
    counters = {"updates": 0}
    root = tmp_path / "ema"
    with Checkpointer(root, model=ema, state={"ema": counters}, every_steps=2) as ckpt:
        assert ckpt.resume() == 0
        for step in range(1, 5):
            with torch.no_grad():
                for e, s in zip(ema.parameters(), student.parameters(), strict=True):
                    e.mul_(0.9).add_(s + torch.randn_like(s), alpha=0.1)  # the RNG moves between saves
            counters["updates"] += 1
            rng = torch.get_rng_state()
            ckpt.step(step)
    return root, _weights(ema), dict(counters), rng


def test_saved_without_an_optimizer_verifies_inspects_exports_and_resumes_bitwise(ema_run, capsys):
    root, weights, counters, rng = ema_run
    manifest = read_manifest(root / "step_4")
    assert "optimizer" in manifest and manifest["optimizer"] is None  # recorded: there is none
    assert not [k for k in manifest["tensors"] if not k.startswith("model.")]  # no optim.* tensors
    assert manifest["trainer"] == {"ema": {"updates": 4}}

    code, out = _cli(capsys, "verify", str(root / "step_4"))
    assert code == 0 and "OK" in out, out
    code, out = _cli(capsys, "inspect", str(root / "step_4"))
    assert code == 0 and "optimizer   none: saved without an optimizer" in out, out
    code, out = _cli(capsys, "inspect", str(root / "step_4"), "--json")
    report = json.loads(out)
    assert report["saved_without_optimizer"] and report["optimizer_states"] == {}
    assert {"model", "rng"} <= set(report["groups"])  # the RNG is saved as with an optimizer
    code, _ = _cli(capsys, "export", str(root / "step_4"), str(root.parent / "ema.safetensors"), "--format", "single")
    assert code == 0
    exported = load_file(str(root.parent / "ema.safetensors"))
    assert _equal(exported, weights)

    fresh, restored = _model(7), {}
    torch.manual_seed(123)  # the resume must put the saved RNG back
    with Checkpointer(root, model=fresh, state={"ema": restored}) as ckpt:
        assert ckpt.resume() == 4
        assert ckpt.resumed.step == 4 and ckpt.resumed.mode == "full" and ckpt.resumed.saved_world_size == 1
    assert _equal(_weights(fresh), weights) and restored == counters
    assert torch.equal(torch.get_rng_state(), rng)


def _student_checkpoint(root: Path) -> dict[str, torch.Tensor]:
    """Step 1 of a model with AdamW (optimizer state saved); returns its weights."""
    model = _model(2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    with Checkpointer(root, model=model, optimizer=opt) as ckpt:
        ckpt.resume()
        ckpt.save(1)
    return _weights(model)


def test_optimizer_state_without_an_optimizer_is_refused_unless_model_only(tmp_path):
    root = tmp_path / "student"
    weights = _student_checkpoint(root)
    teacher = _model(3)
    before = _weights(teacher)
    ckpt = Checkpointer(root, model=teacher)
    with pytest.raises(CheckpointMismatchError,
                       match=rf"checkpoint {root / 'step_1'} holds optimizer state \(AdamW\), and this Checkpointer "
                             r"has no optimizer; nothing was loaded. Pass the optimizer .* resume_mode='model_only'"):
        ckpt.resume()
    assert _equal(_weights(teacher), before)  # nothing was loaded

    # a frozen teacher from a student's run: its own directory, the weights of a named checkpoint
    with Checkpointer(tmp_path / "teacher", model=teacher, resume=str(root / "step_1"),
                      resume_mode="model_only") as ckpt:
        assert ckpt.resume() == 0 and ckpt.resumed.mode == "model_only"
    assert _equal(_weights(teacher), weights)


def test_no_optimizer_state_with_an_optimizer_is_refused_unless_model_only(ema_run, tmp_path):
    root, weights, _, _ = ema_run
    model = _model(4)
    before = _weights(model)
    opt = torch.optim.AdamW(model.parameters())
    ckpt = Checkpointer(root, model=model, optimizer=opt, state={"ema": {}})
    with pytest.raises(CheckpointMismatchError,
                       match=rf"checkpoint {root / 'step_4'} was saved without an optimizer .* and this Checkpointer "
                             r"has an optimizer \(AdamW\); nothing was loaded. Leave optimizer= out .* "
                             r"resume_mode='model_only'"):
        ckpt.resume()
    assert _equal(_weights(model), before) and opt.state_dict()["state"] == {}

    with Checkpointer(tmp_path / "finetune", model=model, optimizer=opt, resume=str(root / "step_4"),
                      resume_mode="model_only") as ckpt:
        assert ckpt.resume() == 0
    assert _equal(_weights(model), weights)


def test_full_state_dict_type_without_an_optimizer(world_of_one, tmp_path):
    """strategy.state_dict_type=full (rank 0 writes safetensors) for a model without an optimizer."""
    torch.manual_seed(0)
    ema = nn.Linear(8, 8)
    with Checkpointer(tmp_path / "ema", model=ema, state={"ema": {"updates": 3}}, state_dict_type="full") as ckpt:
        ckpt.resume()
        ckpt.save(3)
    manifest = read_manifest(tmp_path / "ema" / "step_3")
    assert manifest["optimizer"] is None and manifest["optimizer_param_groups"] == []
    assert sorted(manifest["files"]) == ["model.safetensors", "rng.safetensors"]
    fresh, counters = nn.Linear(8, 8), {}
    with Checkpointer(tmp_path / "ema", model=fresh, state={"ema": counters}, state_dict_type="full") as ckpt:
        assert ckpt.resume() == 3
    assert _equal(_weights(fresh), _weights(ema)) and counters == {"updates": 3}
