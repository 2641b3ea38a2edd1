"""Checkpoint scenarios on N gloo ranks under torchrun. Usage: ckpt_worker.py PHASE OUT.json WORK_DIR

Phases (run in this order by the tests, sharing WORK_DIR):
  ws2: exact same-world-size resume (fp32 and bf16, two resumes, mid-warmup, with accumulation),
       model-only loading, fingerprint mismatches (shapes, tying, vocabulary); saves the 2-rank checkpoint
       for elastic loads
  ws4: loads the 2-rank checkpoint (2->4); saves a 4-rank checkpoint
  ws2b: loads the 4-rank checkpoint (4->2)
  ws3: loads the 4-rank (4->3) and 2-rank (2->3) checkpoints; a global batch of 14 (uneven shares)
       resumes bit-identically on the same 3 ranks
Across meshes (sharding strategies): HSDP 2x2 saved on 4 ranks resumes under NO_SHARD on 2 (ws2b),
whose own checkpoint resumes under FULL_SHARD on 3 (ws3), as does the HSDP one; FULL_SHARD on 4
resumes under HSDP 2x2 (ws4).
Every elastic load compares the restored full state with what was saved, bit for bit, and the
losses that follow with the uninterrupted run.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as tdist

from fsdpkit import dist
from fsdpkit.checkpoint.errors import CheckpointMismatchError
from fsdpkit.checkpoint.find import find_checkpoint
from fsdpkit.checkpoint.manager import CheckpointGroups
from fsdpkit.config import compose_config
from fsdpkit.train.determinism import enable_determinism
from fsdpkit.train.metrics import read_records
from fsdpkit.train.run import attach_checkpointer, build_trainer

STEPS = 12
BASE = ["deterministic=true", f"train.max_steps={STEPS}", "train.global_batch_size=12", "train.micro_batch_size=1",
        "train.progress=false", "optim.warmup_steps=6", "model.vocab_size=1001", "train.eval_samples=8",
        "checkpoint.save_at_end=false"]
GROUPS: CheckpointGroups | None = None
HSDP_2X2 = ["strategy.sharding_strategy=HYBRID_SHARD", "strategy.hsdp_shard_size=2"]
NO_SHARD = ["strategy.sharding_strategy=NO_SHARD"]
# Every bf16 run (2.5x slower per step on CPU than fp32) takes micro-batches of 3: 2 per step on
# 2 ranks (still accumulating) instead of 6, 1 per step on 4 ranks (the same samples). The fp32 runs
# keep micro-batches of 1, the only size that 12 samples split into on 2, 3 and 4 ranks alike: full4
# is the reference of every fp32 elastic resume.
BF16 = ["experiment=bf16", "train.micro_batch_size=3"]


def session(run_dir: Path, overrides: list[str], *, stop_at: int | None = None, resume: str = "auto",
            dump_loaded_to: Path | None = None, dump_final_to: Path | None = None) -> dict:
    """One 'job': build, resume per checkpoint.resume, train to stop_at; per-step records."""
    cfg = compose_config(BASE + overrides + [f"run_dir={run_dir}", f"checkpoint.resume={resume}"])
    if dist.is_main():
        run_dir.mkdir(parents=True, exist_ok=True)
    tdist.barrier()
    found = find_checkpoint(cfg.checkpoint, group=GROUPS.sync)
    path = found.path
    trainer, plan = build_trainer(cfg, device=torch.device("cpu"), run_dir=run_dir, init=path is None)
    ckpt = attach_checkpointer(trainer, cfg, plan, groups=GROUPS)
    ckpt.resume(found)
    report = ckpt.resumed.record() if ckpt.resumed is not None else None
    if dump_loaded_to is not None:
        dump_full_state(trainer, dump_loaded_to)
    start = trainer.state.step
    trainer.fit(stop_at=stop_at)
    if dump_final_to is not None:
        dump_full_state(trainer, dump_final_to)
    trainer.metrics.close()
    out = {"resumed_from": str(path) if path else None, "start": start, "mesh": list(plan.mesh.shape),
           "resume_event": {k: report.get(k) for k in ("step", "path", "mirror_of")} if report else None,
           "notes": report["notes"] if report else [], "verify_s": report["verify_s"] if report else None}
    if dist.is_main():
        recs = read_records(run_dir)
        out["records"] = [r for r in recs if r["step"] > start]
    return out


def dump_full_state(trainer, path: Path) -> None:
    """Rank 0 writes every model and optimizer tensor, gathered, for bitwise comparisons."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(trainer.model, trainer.optimizer)
    full = {f"model.{k}": v.full_tensor() for k, v in model_sd.items()}
    for fqn, st in optim_sd["state"].items():
        for k, v in st.items():
            full[f"optim.{fqn}.{k}"] = v.full_tensor() if hasattr(v, "full_tensor") else v
    full["train.step"] = torch.tensor(trainer.state.step)
    if dist.is_main():
        torch.save(full, path)


def losses(result: dict) -> list[float]:
    return [r["loss"] for r in result.get("records", [])]


def phase_ws2(work: Path) -> dict:
    res = {}
    # the uninterrupted bf16 run also saves at step 6: the source of the bf16 elastic resume (2->4)
    for name, extra, full_extra in (("fp32", [], []), ("bf16", BF16, ["checkpoint.every_steps=6"])):
        res[f"{name}_full"] = session(work / f"{name}_full", extra + full_extra)
        run = work / f"{name}_resumed"
        first = session(run, extra + ["checkpoint.every_steps=3"], stop_at=3)  # killed mid-warmup
        second = session(run, extra + ["checkpoint.every_steps=7"], stop_at=8)  # 2nd resume, same epoch
        third = session(run, extra + ["checkpoint.every_steps=7"])
        res[f"{name}_parts"] = [first, second, third]
    # elastic sources: the uninterrupted fp32 run saves at step 6 (and dumps its state there)
    src = work / "src2"
    (work / "dumps").mkdir(exist_ok=True)
    res["src2"] = session(src, ["checkpoint.every_steps=6"], stop_at=6, dump_final_to=work / "dumps" / "saved_ws2.pt")
    run = work / "full_type_resumed"
    full_type = ["strategy.state_dict_type=full"]
    res["full_type_parts"] = [session(run, full_type + ["checkpoint.every_steps=6"], stop_at=6),
                              session(run, full_type + ["checkpoint.every_steps=6"])]
    res["full_type_files"] = sorted(p.name for p in (run / "checkpoints" / "step_6").iterdir())
    # aot_eager: the same compiled-module wrapping as inductor without minutes of cold kernel builds
    # (test_training compiles with inductor)
    compiled = ["experiment=activation_checkpointing", "train.compile=true", "train.compile_backend=aot_eager"]
    res["ac_compile"] = session(work / "ac_compile", compiled, stop_at=8, resume=str(src / "checkpoints" / "step_6"))
    res["model_only"] = session(work / "model_only", ["checkpoint.resume_mode=model_only"], stop_at=2,
                                resume=str(src / "checkpoints" / "step_6"))
    # a tie change keeps every tensor name and shape: only the manifest's tied_embeddings tells
    for key, override in (("mismatch_error", "model.hidden_size=64"),
                          ("tie_mismatch_error", "model.tie_word_embeddings=true"),
                          ("vocab_mismatch_error", "model.vocab_size=1000")):
        try:
            session(work / key, [override], stop_at=1, resume=str(src / "checkpoints" / "step_6"))
            res[key] = None
        except CheckpointMismatchError as e:
            res[key] = str(e)
    return res


def elastic_load(work: Path, source: str, tag: str, overrides: tuple[str, ...] | list[str] = (), *, step: int = 6,
                 stop_at: int | None = None) -> dict:
    """Resume run `source`'s step `step` in a fresh run (dumping what was loaded) and train on; with
    stop_at, save there too (dumping what was saved), as the source of a later hop."""
    run = work / f"elastic_{tag}"
    if dist.is_main() and run.exists():
        shutil.rmtree(run)
    tdist.barrier()
    save = [f"checkpoint.every_steps={stop_at}"] if stop_at else []
    return session(run, [*overrides, *save], resume=str(work / source / "checkpoints" / f"step_{step}"),
                   dump_loaded_to=work / "dumps" / f"loaded_{tag}.pt", stop_at=stop_at,
                   dump_final_to=work / "dumps" / f"saved_{tag}.pt" if stop_at else None)


# 14 samples over 3 ranks: shares of 5, 5 and 4 samples, each in 2 micro-batches (3+2, 3+2, 2+2)
UNEVEN = ["train.global_batch_size=14", "train.micro_batch_size=3", "train.max_steps=6"]


def uneven_resume(work: Path) -> dict:
    """A global batch that does not divide the world: the run killed after step 3 resumes on the
    same 3 ranks bit-identically."""
    res = {"uneven_full": session(work / "uneven_full", UNEVEN)}
    run = work / "uneven_resumed"
    res["uneven_parts"] = [session(run, [*UNEVEN, "checkpoint.every_steps=3"], stop_at=3),
                           session(run, [*UNEVEN, "checkpoint.every_steps=3"])]
    return res


def phase_meshes(phase: str, work: Path) -> dict:
    """The checkpoints that change sharding strategy (and world size) on resume."""
    if phase == "ws4":
        return {"src4_hsdp": session(work / "src4_hsdp", [*HSDP_2X2, "checkpoint.every_steps=6"], stop_at=6,
                                     dump_final_to=work / "dumps" / "saved_ws4_hsdp.pt"),
                "fs4_to_hsdp": elastic_load(work, "src4", "fs4_to_hsdp", HSDP_2X2)}
    if phase == "ws2b":
        return {"hsdp_to_noshard2": elastic_load(work, "src4_hsdp", "hsdp_to_noshard2", NO_SHARD, stop_at=9)}
    if phase == "ws3":
        return {"hsdp_to_fs3": elastic_load(work, "src4_hsdp", "hsdp_to_fs3"),
                "noshard2_to_fs3": elastic_load(work, "elastic_hsdp_to_noshard2", "noshard2_to_fs3", step=9)}
    return {}


def main() -> None:
    global GROUPS
    phase, out_path, work = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    enable_determinism()
    dist.init_process_group(backend="gloo")
    GROUPS = CheckpointGroups.create(compose_config(BASE + ["checkpoint.timeout_s=120"]).checkpoint)
    if phase == "ws2":
        res = phase_ws2(work)
    elif phase == "ws4":
        res = {"full4": session(work / "full4", []), "2to4": elastic_load(work, "src2", "2to4")}
        res["2to4_full_type"] = session(work / "elastic_2to4_full_type", ["strategy.state_dict_type=full"],
                                        resume=str(work / "full_type_resumed" / "checkpoints" / "step_6"))
        res["2to4_bf16"] = session(work / "elastic_2to4_bf16", BF16,
                                   resume=str(work / "bf16_full" / "checkpoints" / "step_6"))
        res["src4"] = session(work / "src4", ["checkpoint.every_steps=6"], stop_at=6,
                              dump_final_to=work / "dumps" / "saved_ws4.pt")
    elif phase == "ws3":
        res = uneven_resume(work)
        res |= {"4to3": elastic_load(work, "src4", "4to3"), "2to3": elastic_load(work, "src2", "2to3")}
    elif phase == "ws2b":
        res = {"4to2": elastic_load(work, "src4", "4to2")}
    else:
        raise SystemExit(f"unknown phase {phase}")
    res |= phase_meshes(phase, work)
    if dist.is_main():
        out_path.write_text(json.dumps(res))
    dist.shutdown()
    os._exit(0)


if __name__ == "__main__":
    main()
