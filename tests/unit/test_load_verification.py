"""Post-load verification (`checkpoint.verify_on_load`) can fail, and says whether it ran; a
difference that the files do not explain (they pass their checksums) is a mismatch, not a corrupt
checkpoint: auto-resume stops rather than setting it aside.

In one process (no process group), through the Checkpointer a loop uses. The restored state is
made to differ from what was saved after every file checksum passed, from the test side, through
the seams a user holds: the Checkpointer's target (one model weight changed between the load and
the check), or a Stateful passed as `state=` whose load_state_dict keeps a rounded copy.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from torch import nn

from fsdpkit.checkpoint import Checkpointer
from fsdpkit.checkpoint.errors import CheckpointMismatchError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
RAN = "post-load verification"
OFF = "restored state not verified (checkpoint.verify_on_load=false)"


class Ema:
    """An EMA of the weights; with `lossy`, load_state_dict keeps a bf16-rounded copy (a user's bug)."""

    def __init__(self, shadow: torch.Tensor, *, lossy: bool = False):
        self.shadow, self.lossy = shadow, lossy

    def state_dict(self):
        return {"shadow": self.shadow}

    def load_state_dict(self, state):
        self.shadow = state["shadow"].to(torch.bfloat16).float() if self.lossy else state["shadow"].clone()


def _checkpointer(root: Path, *, lossy: bool = False, **settings) -> Checkpointer:
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    ema = Ema(torch.randn(8, 8), lossy=lossy)
    return Checkpointer(root, model=model, optimizer=opt, state={"ema": ema}, **settings)


def _change_one_weight_after_restoring(ckpt: Checkpointer) -> None:
    restore = ckpt.target.restore_tensors

    def restore_then_change(state):
        restore(state)
        with torch.no_grad():
            ckpt.target.model.weight[3, 5] += 1.0

    ckpt.target.restore_tensors = restore_then_change


@pytest.fixture
def root(tmp_path) -> Path:
    ckpt = _checkpointer(tmp_path / "checkpoints")
    ckpt.resume()
    ckpt.save(1)
    ckpt.close()
    return tmp_path / "checkpoints"


@pytest.mark.parametrize("changed", ["model.weight", "state.ema.shadow"])
def test_a_restored_tensor_that_differs_fails_the_load_only_when_verification_is_on(root, changed, caplog):
    caplog.set_level(logging.INFO, logger="fsdpkit")
    intact = _checkpointer(root)
    assert intact.resume() == 1  # the control: nothing changed, verification ran and passed
    intact.close()
    assert isinstance(intact.resumed.verify_s, float) and RAN in caplog.text and OFF not in caplog.text

    for verify_on_load in (True, False):
        caplog.clear()
        ckpt = _checkpointer(root, lossy=changed == "state.ema.shadow", verify_on_load=verify_on_load)
        if changed == "model.weight":
            _change_one_weight_after_restoring(ckpt)
        if verify_on_load:
            with pytest.raises(CheckpointMismatchError,
                               match=rf"restored state differs from checkpoint {root / 'step_1'} "
                                                              rf"\(1 problem\(s\)\):\n  {changed}: hash saved "
                                                              rf"[0-9a-f]{{16}}, "
                                                              r"restored [0-9a-f]{16}$"):
                ckpt.resume()
            assert ckpt.resumed is None and RAN not in caplog.text
            # the files hold what was saved (a resume that read each file once checked them when the values
            # differed): the checkpoint is not corrupt, and stays where it is
            assert [p.name for p in root.iterdir() if p.is_dir()] == ["step_1"]
        else:
            assert ckpt.resume() == 1  # the same difference goes through unseen: nothing looked
            ckpt.close()
            assert ckpt.resumed.verify_s is None
            assert OFF in caplog.text and RAN not in caplog.text
