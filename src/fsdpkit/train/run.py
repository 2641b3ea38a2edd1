"""Build everything a run needs from the config and run it, on this rank."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from fsdpkit import __version__, dist
from fsdpkit.checkpoint.manager import Checkpointer, CheckpointGroups
from fsdpkit.checkpoint.state import CheckpointTarget
from fsdpkit.config import Config, check_world_size, to_yaml
from fsdpkit.data import GlobalSampler, build_datasets
from fsdpkit.diagnostics import TensorBoardWriter, start_diagnostics
from fsdpkit.export import export_checkpoint, load_hf_weights
from fsdpkit.log import get_logger, setup_logging
from fsdpkit.model import vocab_size
from fsdpkit.parallel import ShardingPlan, build_sharded_model
from fsdpkit.train.determinism import enable_determinism, seed_everything
from fsdpkit.train.loop import Trainer
from fsdpkit.train.metrics import METRICS_FILE, MetricsLog
from fsdpkit.train.optim import build_optimizer, build_scheduler
from fsdpkit.train.preemption import PreemptionHandler
from fsdpkit.train.state import TrainState

CONFIG_FILE = "config.yaml"
SUMMARY_FILE = "summary.json"

log = get_logger("train")


def precision_note(cfg: Config, plan: ShardingPlan) -> str:
    mp = plan.mp_policy

    def name(dtype: torch.dtype | None) -> str:
        return "param dtype (fp32)" if dtype is None else str(dtype).removeprefix("torch.")

    return (
        f"precision: policy.mixed_precision={cfg.policy.mixed_precision!r} (FSDP2 MixedPrecisionPolicy) governs "
        f"params in forward/backward ({name(mp.param_dtype)}), gradient reduction ({name(mp.reduce_dtype)}) and "
        f"outputs ({name(mp.output_dtype)}); master weights and optimizer state stay fp32; no autocast is applied"
    )


def build_trainer(cfg: Config, *, device: torch.device, run_dir: Path, init: bool = True) -> tuple[Trainer, ShardingPlan]:
    """Model (sharded), optimizer (after sharding), schedule, data and metrics for this rank."""
    check_world_size(cfg, dist.world_size(), local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or None)
    init_from = cfg.model.init_from.removeprefix("hf:") if init else ""
    model, plan = build_sharded_model(cfg, device, init=init and not init_from)
    if init_from:
        loaded = load_hf_weights(model, init_from)
        log.info("initialised %d tensors from %s in %.2f s (rank 0 read %.1f MiB: its own slices)",
                 loaded["loaded"], init_from, loaded["seconds"], loaded["bytes_read"] / 2**20)
    log.info(precision_note(cfg, plan))
    optimizer = build_optimizer(model, cfg.optim, device=device)
    d = cfg.diagnostics
    diagnostics = start_diagnostics(model, optimizer, device=device, run_dir=run_dir, enabled=d.enabled,
                                    memory_steps=d.memory_steps, skew_warn_ratio=d.skew_warn_ratio, strict=d.strict,
                                    param_dtype=plan.mp_policy.param_dtype, state_dict_type=cfg.strategy.state_dict_type)
    tensorboard = TensorBoardWriter.open(cfg.logging.tensorboard_dir) if cfg.logging.tensorboard else None
    train_data, val_data = build_datasets(cfg.data, vocab_size=vocab_size(model), seed=cfg.seed)
    sampler = GlobalSampler(num_samples=len(train_data), global_batch_size=cfg.train.global_batch_size,
                            seed=cfg.seed, shuffle=cfg.data.shuffle)
    t = cfg.train
    trainer = Trainer(
        model=model,
        optimizer=optimizer,
        scheduler=build_scheduler(optimizer, cfg.optim, max_steps=t.max_steps),
        sampler=sampler,
        train_data=train_data,
        val_data=val_data,
        state=TrainState(),
        metrics=MetricsLog(run_dir, logger=log, log_every=t.log_every, tensorboard=tensorboard),
        device=device,
        max_steps=t.max_steps,
        micro_batch_size=t.micro_batch_size,
        grad_clip=t.grad_clip,
        eval_every=t.eval_every,
        eval_samples=t.eval_samples,
        progress=t.progress,
        logger=log,
        diagnostics=diagnostics,
    )
    return trainer, plan


def attach_checkpointer(trainer: Trainer, cfg: Config, plan: ShardingPlan, *, groups: CheckpointGroups) -> Checkpointer:
    """Give the trainer a Checkpointer over its model, optimizer and Stateful pieces."""
    target = CheckpointTarget(model=trainer.model, optimizer=trainer.optimizer, stateful=trainer.stateful())
    sharding = {
        "wrap_policy": list(cfg.policy.auto_wrap_policy),
        "activation_checkpointing": list(cfg.policy.activation_checkpointing_policy),
        "mixed_precision": cfg.policy.mixed_precision,
        "reshard_after_forward": plan.reshard_after_forward,
        "compiled": bool(plan.compiled),
    }
    run_meta = {
        "mesh": {"shape": list(plan.mesh.shape), "dim_names": list(plan.mesh.mesh_dim_names or ())},
        "config": OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True),
    }
    trainer.checkpointer = Checkpointer(cfg.checkpoint, target=target, groups=groups, sharding=sharding,
                                        run_meta=run_meta, state_dict_type=cfg.strategy.state_dict_type,
                                        on_event=trainer.metrics.write)
    return trainer.checkpointer


def run(cfg: Config) -> dict[str, Any]:
    """Train on this rank (one of torchrun's, or a world of one). Returns the summary."""
    device = dist.pick_device(cfg.device)
    if cfg.deterministic:
        enable_determinism()
    dist.init_process_group(backend=dist.pick_backend(cfg.backend, device.type), timeout_s=cfg.dist.timeout_s)
    setup_logging(cfg.log_level)
    dist.start_watchdog(heartbeat_s=cfg.dist.heartbeat_s, slow_step_factor=cfg.dist.slow_step_factor)
    trainer, failed = None, True
    try:
        seed_everything(cfg.seed, rank=dist.rank())
        run_dir = Path(cfg.run_dir)
        if dist.is_main():
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / CONFIG_FILE).write_text(to_yaml(cfg))
            log.info("resolved config (also in %s):\n%s", run_dir / CONFIG_FILE, to_yaml(cfg))
        dist.barrier()  # everyone waits until the run directory exists
        log.info("fsdpkit %s, torch %s, world size %d, device %s", __version__, torch.__version__, dist.world_size(), device)
        groups = CheckpointGroups.create(cfg.checkpoint)
        resume_path = Checkpointer.resolve(cfg.checkpoint, group=groups.sync)
        trainer, plan = build_trainer(cfg, device=device, run_dir=run_dir, init=resume_path is None)
        checkpointer = attach_checkpointer(trainer, cfg, plan, groups=groups)
        if resume_path is not None:
            checkpointer.resume_from(resume_path)
        with PreemptionHandler(cfg.checkpoint.preemption_signals) as trainer.preemption:
            summary = trainer.fit(stop_at=cfg.train.stop_at or None)
        trainer.metrics.close()
        trainer = None  # drop model and optimizer before teardown (see dist.shutdown)
        if dist.is_main():
            (run_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
            log.info("done: %s", json.dumps(summary))
            log.info("run directory: %s (metrics: %s)", run_dir.resolve(), (run_dir / METRICS_FILE).resolve())
        failed = False
    finally:
        trainer = None
        main = dist.is_main()
        # After a failure another rank may be dead or stuck in a collective: no barrier then.
        dist.shutdown(barrier=not failed)
    finished = summary.get("last_step") == cfg.train.max_steps and not summary.get("stopped_by")
    if cfg.export.on_finish and finished and main:
        export_final(cfg)  # after the teardown: no rank waits on it
    return summary


def export_final(cfg: Config) -> dict[str, Any]:
    """Export the final checkpoint's weights as configured under `export` (one process)."""
    e = cfg.export
    report = export_checkpoint(Path(cfg.checkpoint.dir), Path(e.dir), dtype=e.dtype, fmt=e.format,
                               max_shard_size=e.max_shard_size, overwrite=True)
    log.info("exported the final weights to %s (%s)", e.dir, report.get("dtype_note") or e.dtype)
    return report
