"""Build everything a run needs from the config and run it, on this rank."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from fsdpkit import __version__, dist
from fsdpkit.checkpoint.find import find_checkpoint
from fsdpkit.checkpoint.manager import Checkpointer, CheckpointGroups
from fsdpkit.checkpoint.settings import IOSettings
from fsdpkit.config import Config, check_world_size, to_yaml
from fsdpkit.data import GlobalSampler, build_datasets, describe_split
from fsdpkit.data.tokenizer import tokenizer_size
from fsdpkit.diagnostics import TensorBoardWriter, start_diagnostics
from fsdpkit.export import export_checkpoint
from fsdpkit.hf.config_json import read_json_object
from fsdpkit.hf.folder_config import resolve_hf_config
from fsdpkit.hf.vocab_and_tie import check_vocab_and_tie
from fsdpkit.hf.weights import load_hf_weights
from fsdpkit.log import get_logger, setup_logging
from fsdpkit.model import vocab_size
from fsdpkit.model.document_attention import use_document_attention
from fsdpkit.model.head import output_head
from fsdpkit.model.isolation import check_isolation, packing_refusal
from fsdpkit.model.peft import peft_base_name
from fsdpkit.parallel import ShardingPlan, build_sharded_model
from fsdpkit.train.determinism import enable_determinism, seed_everything
from fsdpkit.train.loop import Trainer
from fsdpkit.train.metrics import METRICS_FILE, MetricsLog
from fsdpkit.train.optim import build_optimizer, build_scheduler
from fsdpkit.train.preflight import check_directories, packs_documents
from fsdpkit.train.state import TrainState

CONFIG_FILE = "config.yaml"
SUMMARY_FILE = "summary.json"

log = get_logger("train")


def precision_note(cfg: Config, plan: ShardingPlan, model: torch.nn.Module) -> str:
    """What governs each dtype, read off the policy FSDP2 applied and the model's own tensors."""
    mp = plan.mp_policy
    masters = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()})
    trained = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters() if p.requires_grad}) or masters

    def name(dtype: torch.dtype | None, fallback: str) -> str:
        return fallback if dtype is None else str(dtype).removeprefix("torch.")

    note = (f"precision: policy.mixed_precision={cfg.policy.mixed_precision!r} (FSDP2 MixedPrecisionPolicy) governs "
            f"params in forward/backward ({name(mp.param_dtype, '/'.join(masters))}), gradient reduction "
            f"({name(mp.reduce_dtype, '/'.join(masters))}) and outputs ({name(mp.output_dtype, 'as computed')}); "
            f"master weights are {'/'.join(masters)} (the sharded parameters) and AdamW state {'/'.join(trained)} "
            "(created like the trained parameters); no autocast is applied")
    stored = (cfg.model.hf_config or {}).get("dtype") or (cfg.model.hf_config or {}).get("torch_dtype")
    if cfg.model.path and stored and stored != "float32":
        note += (f". {cfg.model.path}/config.json's dtype {stored} is how the folder stores its weights; they are "
                 "converted to the master dtype on load (policy.mixed_precision=bf16-mixed computes in bf16)")
    return note


def resolve_model_config(cfg: Config, *, log_overrides: bool = False) -> Any:
    """The transformers config a `model.kind=hf` run trains with (None for model.kind=llama), read
    once per run: the run builds its model from this object. With model.path, model.hf_config
    records the whole of it (the folder's config.json as transformers reads it, with
    model.hf_config's fields over it, each one logged), so that config.yaml, checkpoints and
    exports carry it. Idempotent: a recorded config changes nothing when resolved again."""
    if cfg.model.kind != "hf":
        return None
    config, changed = resolve_hf_config(cfg.model)
    for line in changed if log_overrides else ():
        log.info("model.hf_config overrides %s/config.json: %s", cfg.model.path, line)
    if cfg.model.path:
        cfg.model.hf_config = config.to_dict()
    return config


def build_trainer(cfg: Config, *, device: torch.device, run_dir: Path, init: bool = True,
                  hf_config: Any = None) -> tuple[Trainer, ShardingPlan]:
    """Model (sharded), optimizer (after sharding), schedule, data and metrics for this rank.

    Args:
        hf_config: what `resolve_model_config(cfg)` returned (train() resolves it first); resolved
            here when not given.
    """
    check_world_size(cfg, dist.world_size(), local_world_size=dist.local_world_size())
    if hf_config is None:
        hf_config = resolve_model_config(cfg)
    init_from = (cfg.model.path if cfg.model.pretrained else "") or cfg.model.init_from.removeprefix("hf:")
    init_from = init_from if init else ""
    lora = cfg.model.peft.method == "lora"
    grown = resize_vocab_to_tokenizer(cfg, hf_config)
    # LoRA adapters and grown vocabulary rows are not in the base model's folder: they get their
    # own init, the rest is loaded (and the buffers with it: once, after the weights).
    model, plan = build_sharded_model(cfg, device, init=init and (lora or grown or not init_from),
                                      buffers=not init_from, hf_config=hf_config)
    if packs_documents(cfg) and (why := packing_refusal(model)):  # also under a plain torchrun launch
        raise ValueError(why)
    # sdpa by transformers' choice (not the user's), not compiled: attend one packed document at a time
    if packs_documents(cfg) and not cfg.model.attn_implementation and not cfg.train.compile and \
            use_document_attention(model):
        log.info("packed samples: attention runs one document at a time (sdpa, causal within each document: the "
                 "sum of n^2/2 over the documents instead of a masked seq_len^2); model.attn_implementation=sdpa "
                 "keeps transformers' block-diagonal mask")
    if init_from:
        config_json = Path(init_from).expanduser() / "config.json"
        if config_json.is_file():  # a local folder: its vocabulary and tying must be the model's
            check_vocab_and_tie(model, read_json_object(config_json, where=f"model.init_from={init_from}"),
                                grown_vocab_ok=grown)
        loaded = load_hf_weights(model, init_from, rename=peft_base_name if lora else None, grow_rows=grown,
                                 storage_options=cfg.checkpoint.storage_options)
        log.info("initialised %d tensors from %s in %.2f s (rank 0 read %.1f MiB: its own slices)",
                 loaded["loaded"], init_from, loaded["seconds"], loaded["bytes_read"] / 2**20)
    log.info(precision_note(cfg, plan, model))
    if cfg.train.chunked_loss and output_head(model) is None:
        log.warning("train.chunked_loss=true, but %s's output projection cannot be taken apart from its forward (no "
                    "separate trunk or logits_to_keep, or an lm_head that is adapted or sharded on its own): the loss "
                    "is computed from the full [tokens, vocab] logits", type(model).__name__.removeprefix("FSDP"))
    optimizer = build_optimizer(model, cfg.optim, device=device)
    d = cfg.diagnostics
    diagnostics = start_diagnostics(model, optimizer, device=device, run_dir=run_dir, enabled=d.enabled,
                                    memory_steps=d.memory_steps, skew_warn_ratio=d.skew_warn_ratio, strict=d.strict,
                                    param_dtype=plan.mp_policy.param_dtype,
                                    state_dict_type=cfg.strategy.state_dict_type)
    tensorboard = TensorBoardWriter.open(cfg.logging.tensorboard_dir) if cfg.logging.tensorboard else None
    train_data, val_data = build_datasets(cfg.data, vocab_size=vocab_size(model), seed=cfg.seed)
    sampler = GlobalSampler(num_samples=len(train_data), global_batch_size=cfg.train.global_batch_size,
                            seed=cfg.seed, shuffle=cfg.data.shuffle, fingerprint=getattr(train_data, "fingerprint", ""))
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
        loss_chunk_tokens=t.loss_chunk_tokens if t.chunked_loss else None,
        progress=t.progress,
        logger=log,
        diagnostics=diagnostics,
    )
    return trainer, plan


def resize_vocab_to_tokenizer(cfg: Config, hf_config: Any = None) -> bool:
    """model.resize_to_tokenizer: grow the model's vocabulary to data.tokenizer's size (in the config,
    and in `hf_config`, the run's transformers config, before the model is built from them);
    returns whether the vocabulary is larger than configured."""
    if not (cfg.model.resize_to_tokenizer and cfg.data.kind == "hf" and cfg.data.tokenizer):
        return False
    size = tokenizer_size(cfg.data.tokenizer)
    if cfg.model.kind == "hf" and hf_config is None:
        hf_config = resolve_model_config(cfg)
    if size > (cfg.model.vocab_size if hf_config is None else hf_config.vocab_size):
        cfg.model.vocab_size = size
        if hf_config is not None:
            hf_config.vocab_size = size
            cfg.model.hf_config["vocab_size"] = size
        log.info("model vocabulary grown to %d rows for data.tokenizer (model.resize_to_tokenizer)", size)
    return cfg.model.vocab_size == size


def attach_checkpointer(trainer: Trainer, cfg: Config, plan: ShardingPlan, *, groups: CheckpointGroups | None = None,
                        io_settings: IOSettings | None = None) -> Checkpointer:
    """Give the trainer a Checkpointer (the public API) over its model, optimizer, scheduler and
    Stateful pieces, with the I/O settings `io_settings` (default: the environment's, as
    find_checkpoint's); `resume()` is the caller's next call."""
    sharding = {
        "wrap_policy": plan.unit_classes,  # what the policy (`auto` included) resolved to
        "activation_checkpointing": plan.checkpointed_classes,
        "mixed_precision": cfg.policy.mixed_precision,
        "reshard_after_forward": plan.reshard_after_forward,
        "compiled": bool(plan.compiled),
    }
    state = trainer.stateful()  # the trainer's list of what must survive a restart
    trainer.checkpointer = Checkpointer.from_config(
        cfg.checkpoint, model=trainer.model, optimizer=trainer.optimizer, scheduler=state.pop("scheduler"),
        state=state, sharding=sharding,
        mesh={"shape": list(plan.mesh.shape), "dim_names": list(plan.mesh.mesh_dim_names or ())},
        config=OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True),
        state_dict_type=cfg.strategy.state_dict_type, on_event=trainer.metrics.write, groups=groups,
        io_settings=io_settings, optimizer_steps=True)  # its step counts optimizer updates: a load checks them
    return trainer.checkpointer


def run(cfg: Config) -> dict[str, Any]:
    """Train on this rank (one of torchrun's, or a world of one). Returns the summary."""
    device = dist.pick_device(cfg.device)
    if cfg.deterministic:
        enable_determinism()
    dist.init_process_group(backend=dist.pick_backend(cfg.backend, device.type), timeout_s=cfg.dist.timeout_s)
    setup_logging(cfg.log_level)
    dist.start_watchdog(heartbeat_s=cfg.dist.heartbeat_s, slow_step_factor=cfg.dist.slow_step_factor)
    failed = True
    peers = dist.new_peer_group(timeout_s=cfg.checkpoint.exception_timeout_s)
    try:
        summary = train(cfg, device=device)
        failed = False
    except Exception as e:
        if dist.lost_a_peer(e):
            report_lost_peers(peers, timeout_s=cfg.checkpoint.exception_timeout_s)
        raise
    finally:
        main = dist.is_main()
        # After a failure another rank may be dead or stuck in a collective: no barrier then.
        dist.shutdown(barrier=not failed)
    finished = summary.get("last_step") == cfg.train.max_steps and not summary.get("stopped_by")
    if cfg.export.on_finish and finished and main:
        export_final(cfg)  # after the teardown: no rank waits on it
    return summary


def train(cfg: Config, *, device: torch.device) -> dict[str, Any]:
    """One run on this rank, in the process group that exists: build, resume or initialise, fit.
    Returns the summary (rank 0 also writes it to the run directory)."""
    trainer, found = None, None
    try:
        seed_everything(cfg.seed, rank=dist.rank())
        # before config.yaml is written: it records the config trained with
        hf_config = resolve_model_config(cfg, log_overrides=True)
        resize_vocab_to_tokenizer(cfg, hf_config)  # likewise the grown size
        run_dir = Path(cfg.run_dir)
        dist.on_main(lambda: check_directories(cfg))  # every rank stops here, with rank 0's message
        if dist.is_main():
            (run_dir / CONFIG_FILE).write_text(to_yaml(cfg))
            log.info("resolved config (also in %s):\n%s", run_dir / CONFIG_FILE, to_yaml(cfg))
        log.info("fsdpkit %s, torch %s, world size %d, device %s", __version__, torch.__version__, dist.world_size(),
                 device)
        log.info("%s", describe_split(cfg.train.global_batch_size, world_size=dist.world_size(),
                                      micro_batch_size=cfg.train.micro_batch_size))
        groups, io = CheckpointGroups.create(cfg.checkpoint), IOSettings.from_environment()
        found = find_checkpoint(cfg.checkpoint, group=groups.sync, io_settings=io)  # before the model: skip init
        trainer, plan = build_trainer(cfg, device=device, run_dir=run_dir, init=found.path is None,
                                      hf_config=hf_config)
        attach_checkpointer(trainer, cfg, plan, groups=groups, io_settings=io).resume(found)
        if packs_documents(cfg):  # on the weights it trains from: the model itself keeps documents apart
            check_isolation(trainer.model, vocab_size=vocab_size(trainer.model), device=device, seed=cfg.seed)
        summary = trainer.fit(stop_at=cfg.train.stop_at or None)
        trainer.metrics.close()
        if dist.is_main():
            (run_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
            log.info("done: %s", json.dumps(summary))
            log.info("run directory: %s (metrics: %s)", run_dir.resolve(), (run_dir / METRICS_FILE).resolve())
        return summary
    finally:
        if trainer is not None and trainer.checkpointer is not None:
            trainer.checkpointer.close(wait=False)  # the lock and signal handlers (a no-op after fit)
        elif found is not None and found.lock is not None:
            found.lock.release()  # the kernel would at exit; a caller that runs again in-process needs it now
        trainer = None  # drop model and optimizer before teardown (see dist.shutdown)


def report_lost_peers(group: Any, *, timeout_s: float) -> None:
    """After a collective failed: name the ranks that no longer answer, so that the survivors' logs
    say which node to look at (torch's launcher only lists its own, surviving, ranks as failed)."""
    lost = dist.unresponsive_ranks(group, timeout_s=timeout_s)
    if lost:
        log.error("lost rank(s) %s: no answer within checkpoint.exception_timeout_s=%s s after a collective failed "
                  "(their process or node died, or they are stuck); rank %d stops too. Check the node(s) and logs of "
                  "rank(s) %s, then rerun the same command on every node to resume from the last committed checkpoint",
                  ", ".join(map(str, lost)), timeout_s, dist.rank(), ", ".join(map(str, lost)))


def _export_to(cfg: Config, export: Callable[[str | Path], dict[str, Any]]) -> dict[str, Any]:
    """`export(export.dir)`; a URL export.dir is exported locally first, then uploaded (export/remote_destination.py)
    with checkpoint.storage_options (as preflight checked it)."""
    from fsdpkit.export.remote_destination import export_to

    return export_to(cfg.export.dir, export, fmt="hf" if cfg.model.peft.method == "lora" else cfg.export.format,
                     overwrite=True, source=cfg.checkpoint.dir, storage_options=cfg.checkpoint.storage_options)


def export_final(cfg: Config) -> dict[str, Any]:
    """Export the final checkpoint's weights as configured under `export` (one process). It
    replaces only an earlier export there and never overlaps the checkpoints or the run directory."""
    e = cfg.export
    if cfg.model.peft.method == "lora":  # a model anyone can load: the adapters merged in
        from fsdpkit.export.adapter import export_merged

        report = _export_to(cfg, lambda out: export_merged(Path(cfg.checkpoint.dir), Path(out), dtype=e.dtype,
                                                           overwrite=True, run_dirs=[cfg.run_dir]))
        log.info("exported the final weights, LoRA merged, to %s", e.dir)
        _log_folder_files(report)
        return report
    report = _export_to(cfg, lambda out: export_checkpoint(Path(cfg.checkpoint.dir), Path(out), dtype=e.dtype,
                                                           fmt=e.format,
                                                           max_shard_size=e.max_shard_size, overwrite=True,
                                                           run_dirs=[cfg.run_dir]))
    log.info("exported the final weights to %s (%s)", e.dir, report.get("dtype_note") or e.dtype)
    _log_folder_files(report)
    return report


def _log_folder_files(report: dict[str, Any]) -> None:
    """The export's files beside the weights; those it could not add as warnings (with how to add them)."""
    for line in report.get("added", []):
        log.info("export: added %s", line)
    for line in report.get("not_added", []):
        log.warning("export: NOT ADDED: %s", line)
