"""Async save, on_exception and time cadence on 2 gloo ranks. Usage: async_worker.py OUT.json WORK_DIR

- reference: the uninterrupted run, saving synchronously every 3 steps;
- async: the same run driven by hand: save step 3 in the background (its write held at a gate,
  tests/faults, until two more steps were trained while it was in flight), then commit; its
  checkpoint must equal the synchronous one, and resuming from it must reproduce the reference losses;
- async_bg: the same with checkpoint.async_staging=background and the copy itself held at a gate:
  the save returns at once, the next optimizer step waits for the copy (the gate opens HOLD_S
  after that step started waiting), and the checkpoint is again the state at step 3;
- exception: every rank raises in step 5 (injected before its update): on_exception holds step 4,
  and the auto-resume from it reproduces the reference;
- minutes: saves by wall-clock cadence, in the background, with retention: ranks must agree.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import ckpt_worker
import torch
import torch.distributed as tdist
from ckpt_worker import BASE, session

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import faults  # noqa: E402
from fsdpkit import dist  # noqa: E402
from fsdpkit.checkpoint import async_save  # noqa: E402
from fsdpkit.checkpoint.layout import MANIFEST, ON_EXCEPTION  # noqa: E402
from fsdpkit.checkpoint.manager import Checkpointer, CheckpointGroups  # noqa: E402
from fsdpkit.config import compose_config  # noqa: E402
from fsdpkit.train.determinism import enable_determinism  # noqa: E402
from fsdpkit.train.metrics import read_records  # noqa: E402
from fsdpkit.train.run import attach_checkpointer, build_trainer  # noqa: E402

HOLD_S = 1.0  # async_bg: how long the copy stays held after the optimizer step started waiting for it


def manifest(path: Path) -> dict:
    return json.loads((path / MANIFEST).read_text())


def async_by_hand(work: Path, name: str = "async", *, background: bool = False) -> dict:
    """Save step 3 asynchronously, its write (or, with background staging, its copy) held at a gate
    in the background thread, and train two more steps meanwhile."""
    run = work / name
    extra = ["checkpoint.async_staging=background"] if background else []
    cfg = compose_config(BASE + [f"run_dir={run}", "checkpoint.async=true", "checkpoint.resume=none", *extra])
    if dist.is_main():
        run.mkdir(parents=True)
    tdist.barrier()
    trainer, plan = build_trainer(cfg, device=torch.device("cpu"), run_dir=run)
    ckpt = attach_checkpointer(trainer, cfg, plan, groups=ckpt_worker.GROUPS)
    ckpt.resume()
    for _ in range(3):
        trainer.train_step()
    saver = ckpt._async
    waited = threading.Event()  # background: the optimizer step reached the wait for the copy
    with faults.gated(async_save, "stage_hashing" if background else "write_snapshot") as gate:
        ckpt.save(3, reason="test")
        running = saver.in_flight
        stall_at_return = running.stall_s
        held_at_return = gate.reached.wait(60)  # the background thread is at the gate, held
        if background:
            real_wait = saver.wait_staged

            def wait_staged() -> None:  # the optimizer's step pre-hook calls it
                if saver._staging is not None:
                    waited.set()
                real_wait()
            saver.wait_staged = wait_staged

            def open_gate() -> None:  # HOLD_S after the first optimizer step started waiting for the copy
                waited.wait(60)
                time.sleep(HOLD_S)
                gate.release()
            threading.Thread(target=open_gate, daemon=True).start()
        # the parameters and optimizer state move on while step_3 is in flight
        step_s = [trainer.train_step()["step_time_s"] for _ in range(2)]
        in_flight_after_two_steps = not saver.done()
        gate.release()
        ckpt.close()
    trainer.metrics.close()
    return {"in_flight_after_two_steps": in_flight_after_two_steps, "stall_at_return_s": stall_at_return,
            "held_at_return": held_at_return, "held_s": gate.held_s, "step_waited_for_copy": waited.is_set(),
            "stall_s": running.stall_s, "step_s": step_s,
            "events": read_records(run, events=True) if dist.is_main() else []}


def main() -> None:
    out_path, work = Path(sys.argv[1]), Path(sys.argv[2])
    enable_determinism()
    dist.init_process_group(backend="gloo")
    ckpt_worker.GROUPS = CheckpointGroups.create(
        compose_config(BASE + ["checkpoint.async=true", "checkpoint.timeout_s=120"]).checkpoint)
    res: dict = {"reference": session(work / "reference", ["checkpoint.every_steps=3"])}
    res["async"] = async_by_hand(work)
    res["async_bg"] = async_by_hand(work, "async_bg", background=True)
    res["from_async"] = session(work / "from_async", [], resume=str(work / "async" / "checkpoints" / "step_3"))

    marker = work / "faults.jsonl"
    with faults.injected(faults.raise_at(step=5, rank="*"), marker=marker):
        try:
            session(work / "exception", ["checkpoint.every_steps=3"])
            res["exception_raised"] = None
        except RuntimeError as e:
            res["exception_raised"] = str(e)
    tdist.barrier()  # every rank's marker line is written
    res["raise_fired"] = sorted((f["step"], f["rank"]) for f in faults.fired(marker, "raise_at"))
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
        res["manifests"] = {name: {k: manifest(work / name / "checkpoints" / "step_3")[k] for k in ("tensors",
                                                                                                    "trainer",
                                                                                                    "timings")}
                            for name in ("reference", "async", "async_bg")}
        res["minutes_dirs"] = sorted(p.name for p in (work / "minutes" / "checkpoints").iterdir())
        res["minutes_saves"] = [(e["step"], e["reason"]) for e in read_records(work / "minutes", events=True)
                                if e["event"] == "checkpoint"]
        out_path.write_text(json.dumps(res))
    dist.shutdown()
    os._exit(0)


if __name__ == "__main__":
    main()
