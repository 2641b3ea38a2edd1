"""Async save, on_exception and time cadence on 2 gloo ranks. Usage: async_worker.py OUT.json WORK_DIR

- reference: the uninterrupted run, saving synchronously every 3 steps;
- async: the same run driven by hand: save step 3 in the background (its write held back by a test
  hook), train two more steps while it is in flight, then commit; its checkpoint must equal the
  synchronous one, and resuming from it must reproduce the reference losses;
- async_bg: the same with checkpoint.async_staging=background and the copy itself held back: the
  save returns at once, the next optimizer step waits for the copy, and the checkpoint is again
  the state at step 3;
- exception: every rank raises in step 5 (before its update): on_exception holds step 4, and the
  auto-resume from it reproduces the reference;
- minutes: saves by wall-clock cadence, in the background, with retention: ranks must agree.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import ckpt_worker
import torch
import torch.distributed as tdist
from ckpt_worker import BASE, session

from fsdpkit import dist
from fsdpkit.checkpoint.async_save import SLOW_STAGING_ENV, SLOW_WRITE_ENV
from fsdpkit.checkpoint.layout import MANIFEST, ON_EXCEPTION
from fsdpkit.checkpoint.manager import Checkpointer, CheckpointGroups
from fsdpkit.config import compose_config
from fsdpkit.train.determinism import enable_determinism
from fsdpkit.train.loop import RAISE_AT_ENV
from fsdpkit.train.metrics import read_records
from fsdpkit.train.run import attach_checkpointer, build_trainer


def manifest(path: Path) -> dict:
    return json.loads((path / MANIFEST).read_text())


def async_by_hand(work: Path, name: str = "async", *, hold: str = SLOW_WRITE_ENV, extra: tuple[str, ...] = ()) -> dict:
    run = work / name
    cfg = compose_config(BASE + [f"run_dir={run}", "checkpoint.async=true", "checkpoint.resume=none", *extra])
    if dist.is_main():
        run.mkdir(parents=True)
    tdist.barrier()
    trainer, plan = build_trainer(cfg, device=torch.device("cpu"), run_dir=run)
    ckpt = attach_checkpointer(trainer, cfg, plan, groups=ckpt_worker.GROUPS)
    ckpt.resume()
    for _ in range(3):
        trainer.train_step()
    os.environ[hold] = "1.5"
    ckpt.save(3, reason="test")
    running = ckpt._async.in_flight
    stall_at_return = running.stall_s
    # the parameters and optimizer state move on while step_3 is written
    step_s = [trainer.train_step()["step_time_s"] for _ in range(2)]
    in_flight_after_two_steps = not ckpt._async.done()
    del os.environ[hold]
    ckpt.close()
    trainer.metrics.close()
    return {"in_flight_after_two_steps": in_flight_after_two_steps, "stall_at_return_s": stall_at_return,
            "stall_s": running.stall_s, "step_s": step_s, "events": read_records(run, events=True) if dist.is_main() else []}


def main() -> None:
    out_path, work = Path(sys.argv[1]), Path(sys.argv[2])
    enable_determinism()
    dist.init_process_group(backend="gloo")
    ckpt_worker.GROUPS = CheckpointGroups.create(
        compose_config(BASE + ["checkpoint.async=true", "checkpoint.timeout_s=120"]).checkpoint)
    res: dict = {"reference": session(work / "reference", ["checkpoint.every_steps=3"])}
    res["async"] = async_by_hand(work)
    res["async_bg"] = async_by_hand(work, "async_bg", hold=SLOW_STAGING_ENV, extra=("checkpoint.async_staging=background",))
    res["from_async"] = session(work / "from_async", [], resume=str(work / "async" / "checkpoints" / "step_3"))

    os.environ[RAISE_AT_ENV] = "5:*"
    try:
        session(work / "exception", ["checkpoint.every_steps=3"])
        res["exception_raised"] = None
    except RuntimeError as e:
        res["exception_raised"] = str(e)
    del os.environ[RAISE_AT_ENV]
    res["after_exception"] = session(work / "exception", ["checkpoint.every_steps=3"])

    no_background = CheckpointGroups(sync=ckpt_worker.GROUPS.sync, background=None, agreement=None)
    try:
        Checkpointer(work / "no_background", model=torch.nn.Linear(2, 2), async_save=True, groups=no_background)
        res["no_background_error"] = None
    except ValueError as e:
        res["no_background_error"] = str(e)
    res["minutes"] = session(work / "minutes", ["checkpoint.async=true", "checkpoint.every_minutes=0.002",
                                                "checkpoint.keep_last=2"])
    if dist.is_main():
        ck = work / "exception" / "checkpoints"
        res["on_exception_manifest"] = {k: manifest(ck / ON_EXCEPTION)[k] for k in ("step", "reason", "exception")}
        res["manifests"] = {name: {k: manifest(work / name / "checkpoints" / "step_3")[k] for k in ("tensors", "trainer", "timings")}
                            for name in ("reference", "async", "async_bg")}
        res["minutes_dirs"] = sorted(p.name for p in (work / "minutes" / "checkpoints").iterdir())
        res["minutes_saves"] = [(e["step"], e["reason"]) for e in read_records(work / "minutes", events=True)
                                if e["event"] == "checkpoint"]
        out_path.write_text(json.dumps(res))
    dist.shutdown()
    os._exit(0)


if __name__ == "__main__":
    main()
