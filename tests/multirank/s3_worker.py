"""Checkpoint scenarios against an S3 server (tests/s3_server.py) on N gloo ranks under torchrun.
Usage: s3_worker.py PHASE OUT.json WORK_DIR BUCKET   (AWS_ENDPOINT_URL etc. in the environment)

Phases, run in this order by test_s3.py (run directories are local, checkpoints go to the bucket):
  ws2:   an uninterrupted reference run (local checkpoints); the same run saved to s3:// and resumed
         twice (sync saves, retention keep_last=1), and once with async saves; the 2-rank source
         run (s3://BUCKET/src, stopped and dumped at step 4); checkpoint.local_dir: async saves with a
         local copy, restarted three times (the copy read; a copy whose manifest changed skipped; a
         copy with a corrupt shard moved aside and the bucket read)
  kill:  resumes s3://BUCKET/src from step 4 and saves step 8 with rank 1 SIGKILLed mid-upload
         (by the fault tests/faults injects, armed by the test's environment): this launch fails
  ws3:   model.init_from=hf: the source's step 4 exported as a Hugging Face folder, from local disk and
         from s3://BUCKET/hf (3 ranks, dumped before any step); auto-resume of s3://BUCKET/src on 3
         ranks (must pick step 4); the 2->3 elastic load of s3://BUCKET/src/checkpoints/step_4 into a
         new run that saves on 3 ranks to s3://BUCKET/elastic
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import ckpt_worker
from ckpt_worker import BASE, losses

from fsdpkit import dist
from fsdpkit.checkpoint.manager import CheckpointGroups
from fsdpkit.config import compose_config
from fsdpkit.train.determinism import enable_determinism

STEPS = 8  # fewer than ckpt_worker's 12: enough for two resumes
SRC: list[str] = []  # the 2-rank source run's checkpoint settings (set in main)


def session(run_dir: Path, overrides: list[str], **kwargs) -> dict:
    return ckpt_worker.session(run_dir, [f"train.max_steps={STEPS}", *overrides], **kwargs)


def phase_ws2(work: Path, s3: str) -> dict:
    res = {"full": session(work / "full", ["checkpoint.save_at_end=false"])}
    sync = [f"checkpoint.dir={s3}/sync/checkpoints", "checkpoint.keep_last=1"]
    res["sync"] = [session(work / "sync", [*sync, "checkpoint.every_steps=3"], stop_at=3),
                   session(work / "sync", [*sync, "checkpoint.every_steps=3"], stop_at=6),
                   session(work / "sync", [*sync, "checkpoint.save_at_end=true"])]
    run_async = [f"checkpoint.dir={s3}/async/checkpoints", "checkpoint.keep_last=1", "checkpoint.async_save=true"]
    res["async"] = [session(work / "async", [*run_async, "checkpoint.every_steps=3"], stop_at=6),
                    session(work / "async", [*run_async, "checkpoint.save_at_end=true"])]
    res["src"] = session(work / "src", SRC, stop_at=4, dump_final_to=work / "saved_src.pt")
    res["mirror"] = phase_mirror(work, s3)
    return res


def phase_mirror(work: Path, s3: str) -> list[dict]:
    """checkpoint.local_dir: async saves to the bucket with a local copy (keep_last=1 on both);
    the first restart reads the copy, the second finds the copy's manifest changed and reads the bucket."""
    settings = [f"checkpoint.dir={s3}/mirror/checkpoints", f"checkpoint.local_dir={work / 'mirror'}",
                "checkpoint.keep_last=1", "checkpoint.async_save=true"]
    parts = [session(work / "mirror_run", [*settings, "checkpoint.every_steps=3"], stop_at=3)]
    parts[0]["mirror_after"] = listing(work / "mirror")
    parts.append(session(work / "mirror_run", [*settings, "checkpoint.every_steps=3"], stop_at=6))
    parts[1]["mirror_after"] = listing(work / "mirror")
    if dist.is_main():  # the same JSON with one more space: no longer byte for byte the remote manifest
        manifest = work / "mirror" / "step_6" / "manifest.json"
        manifest.write_text(manifest.read_text() + " ")
    dist.barrier()
    parts.append(session(work / "mirror_run", [*settings, "checkpoint.save_at_end=true"]))
    parts[2]["mirror_after"] = listing(work / "mirror")
    if dist.is_main():  # one byte of a shard changed, same size: only the checksums can tell
        shard = sorted((work / "mirror" / "step_8").glob("*.distcp"))[0]
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    dist.barrier()
    parts.append(session(work / "mirror_run", settings))  # at max_steps already: the resume only
    parts[3]["mirror_after"] = listing(work / "mirror")
    return parts


def listing(local: Path) -> dict[str, list[str]]:
    return {d.name: sorted(f.name for f in d.iterdir()) for d in sorted(local.iterdir()) if d.is_dir()}


def main() -> None:
    phase, out_path, work, bucket = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]
    s3 = f"s3://{bucket}"
    enable_determinism()
    dist.init_process_group(backend="gloo")
    # async_save=true: a background group too (the async runs' saves must not share the training group)
    ckpt_worker.GROUPS = CheckpointGroups.create(
        compose_config(BASE + ["checkpoint.timeout_s=60", "checkpoint.async_save=true"]).checkpoint)
    # preemption_signals=[]: the launcher's SIGTERM to rank 0 after rank 1 died ends it at once
    SRC[:] = [f"checkpoint.dir={s3}/src/checkpoints", "checkpoint.every_steps=4", "checkpoint.preemption_signals=[]"]
    if phase == "ws2":
        res = phase_ws2(work, s3)
    elif phase == "kill":
        res = {"kill": session(work / "kill", SRC)}  # resumes step 4; rank 1 dies during step 8's upload
    elif phase == "ws3":
        for tag, folder in (("local", work / "hf"), ("s3", f"{s3}/hf")):  # init_from, before any step
            session(work / f"init_{tag}", [f"model.init_from=hf:{folder}", "checkpoint.save_at_end=false"], stop_at=1,
                    resume="none", dump_loaded_to=work / f"init_{tag}.pt")
        res = {"after_kill": session(work / "kill", SRC, stop_at=5),
               "elastic": session(work / "elastic", [f"checkpoint.dir={s3}/elastic/checkpoints",
                                                     "checkpoint.save_at_end=true"],
                                  resume=f"{s3}/src/checkpoints/step_4", dump_loaded_to=work / "loaded_elastic.pt")}
    else:
        raise SystemExit(f"unknown phase {phase}")
    for r in res.values():
        for part in r if isinstance(r, list) else [r]:
            part["losses"] = losses(part)
    if dist.is_main():
        out_path.write_text(json.dumps(res))
    dist.shutdown()
    os._exit(0)


if __name__ == "__main__":
    main()
