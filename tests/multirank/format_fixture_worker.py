"""Resume the checked-in format-2 checkpoint (a copy of tests/fixtures/ckpt_format2) on 2 gloo ranks.

    format_fixture_worker.py FIXTURE_COPY OUT.json WORK_DIR

Builds the model from the overrides the fixture records (expected.json), resumes from its step_2
as a user would (checkpoint.resume=<path>: file checksums checked before loading, tensor checksums
after), writes the restored model and AdamW state, gathered, to WORK_DIR/loaded_state.safetensors
(rank 0), trains the steps the maker recorded and writes their figures to OUT.json.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as tdist
from safetensors.torch import save_file

from fsdpkit import dist
from fsdpkit.checkpoint.find import find_checkpoint
from fsdpkit.checkpoint.manager import CheckpointGroups
from fsdpkit.config import compose_config
from fsdpkit.train.determinism import enable_determinism
from fsdpkit.train.metrics import read_records
from fsdpkit.train.run import attach_checkpointer, build_trainer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
from make_ckpt_format2 import full_state  # noqa: E402  (the maker's own dump, so both sides gather alike)


def main() -> None:
    fixture, out_path, work = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    expected = json.loads((fixture / "expected.json").read_text())
    enable_determinism()
    dist.init_process_group(backend="gloo")
    run_dir = work / "run"
    saved = fixture / f"step_{expected['saved_step']}"
    cfg = compose_config([*expected["overrides"], f"run_dir={run_dir}", f"checkpoint.resume={saved}"])
    if dist.is_main():
        run_dir.mkdir(parents=True)
    tdist.barrier()
    groups = CheckpointGroups.create(cfg.checkpoint)
    found = find_checkpoint(cfg.checkpoint, group=groups.sync)
    trainer, plan = build_trainer(cfg, device=torch.device("cpu"), run_dir=run_dir, init=found.path is None)
    ckpt = attach_checkpointer(trainer, cfg, plan, groups=groups)
    ckpt.resume(found)
    loaded = full_state(trainer)
    result = {"resumed": {k: getattr(ckpt.resumed, k) for k in ("step", "path", "notes")} if ckpt.resumed else None,
              "start": trainer.state.step}
    if dist.is_main():
        save_file(loaded, str(work / "loaded_state.safetensors"))
    trainer.fit(stop_at=expected["next_steps"][-1]["step"])
    trainer.metrics.close()
    if dist.is_main():
        result["records"] = [r for r in read_records(run_dir) if r["step"] > result["start"]]
        out_path.write_text(json.dumps(result))
    dist.shutdown()
    os._exit(0)


if __name__ == "__main__":
    main()
