"""make chaos's verdicts (chaos/run.py): a trial whose fault did not land where its case names it is
"not exercised", never a pass, and a case with no exercised trial fails the run; where a disk-full
case's fault landed is read from the error the product's own code path reports, and whether a
mid-save signal landed in a save from the stall record tests/faults writes inside a real save."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "chaos"), str(ROOT / "tests"), str(ROOT / "tests" / "fuzz")]

import cases  # noqa: E402  (chaos/cases.py)
import run  # noqa: E402  (chaos/run.py)
from harness import Outcome  # noqa: E402

from faults import fired, injected, manifest_enospc, shard_enospc, stall_mid_write  # noqa: E402
from fsdpkit.checkpoint.errors import CheckpointSaveError  # noqa: E402
from fsdpkit.checkpoint.save import save_checkpoint  # noqa: E402
from fsdpkit.checkpoint.state import CheckpointTarget  # noqa: E402


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


# -- where a disk-full case's fault landed: read from the error the product itself reports ---------
def _target(width: int) -> CheckpointTarget:
    torch.manual_seed(0)
    model = nn.Linear(width, width)
    return CheckpointTarget(model=model, optimizer=torch.optim.AdamW(model.parameters()), stateful={})


@pytest.mark.parametrize(("width", "fault", "where", "file"), [
    (4, shard_enospc(step=3), "shard", "__0_0.distcp"),  # every write fits Python's buffer: ENOSPC at the close
    (256, shard_enospc(step=3), "shard", "__0_0.distcp"),  # a 256 KiB tensor: ENOSPC in a write
    (4, manifest_enospc(step=3), "manifest", "manifest.json"),  # the shards fit, the commit does not
])
def test_where_the_disk_filled_is_what_the_products_own_error_names(tmp_path, width, fault, where, file):
    """make chaos's disk-full cases judge where their disk filled from the job's error alone
    (cases.where_the_disk_filled): here the product's own save path meets a full disk, and its
    error must name the file it could not write in a form that function reads."""
    marker = tmp_path / "fired.jsonl"
    step_dir = tmp_path / "ckpt" / "step_3"
    meta = {"run_id": "run-a", "fingerprint": {"tensors": {}}, "metrics": {}}
    with injected(fault, marker=marker), pytest.raises(CheckpointSaveError) as failed:
        save_checkpoint(_target(width), ckpt_dir=step_dir, step=3, meta=meta, group=None)
    assert [f["fault"] for f in fired(marker)] == [fault["kind"]]  # the disk filled once, there
    error = f"fsdpkit train: error: {failed.value}\n"  # as the CLI prints it
    assert cases.where_the_disk_filled(error) == (where, str(step_dir / file)), error


def test_a_full_disk_reported_without_its_file_names_nowhere():
    assert cases.where_the_disk_filled("OSError: [Errno 28] No space left on device\n") is None
    assert cases.where_the_disk_filled("OSError: [Errno 22] Invalid argument\n"
                                       "fsdpkit: while writing checkpoint file /x/step_2/__0_0.distcp\n") is None


def test_a_signal_lands_in_a_save_only_while_the_victims_stall_holds_it(tmp_path):
    """The mid-save cases' proof (cases.held_in_save) reads the stall's own record, as tests/faults
    writes it from inside a real save: the signal must fall wholly within that rank's stall."""
    marker = tmp_path / "fired.jsonl"
    meta = {"run_id": "run-a", "fingerprint": {"tensors": {}}, "metrics": {}}
    with injected(stall_mid_write(seconds=0.3), marker=marker):
        save_checkpoint(_target(4), ckpt_dir=tmp_path / "step_3", step=3, meta=meta, group=None)
    (stall,) = fired(marker)
    t = stall["time"]
    assert cases.held_in_save(marker, 0, sent=(t + 0.1, t + 0.2))
    assert not cases.held_in_save(marker, 0, sent=(t + 0.1, t + 0.4))  # the stall ended before the signal went
    assert not cases.held_in_save(marker, 0, sent=(t - 0.1, t + 0.1))  # sent before the stall began
    assert not cases.held_in_save(marker, 1, sent=(t + 0.1, t + 0.2))  # rank 1 was never held
