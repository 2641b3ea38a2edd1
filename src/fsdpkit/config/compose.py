"""Compose a run's configuration: YAML layers from `conf/`, Hydra overrides on top, then
validation against the typed schema, all before any process group exists.

Layers, later wins: schema defaults (a Hydra node, so every key can be overridden) →
conf/config.yaml → its groups (strategy, model, data) →
experiment files (`experiment=[a,b]`, applied in order) → command-line overrides. Hydra's
override grammar applies: `key=value`, `+key=value` (add), `++key=value` (add or override),
`~key` (delete: the schema default applies again).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from collections.abc import Iterator, Sequence
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from fsdpkit.checkpoint.settings import (
    REMOVED_KEYS,
    check_one_of,
    check_positive,
    refuse_removed,
    validate_checkpoint,
)
from fsdpkit.checkpoint.storage.urls import check_url, is_url, refuse_url
from fsdpkit.config.schema import (
    MIXED_PRECISION_PRESETS,
    OVERLONG,
    PACKING,
    SHARDING_STRATEGIES,
    STATE_DICT_TYPES,
    Config,
    PeftConfig,
)

CONF_DIR = Path(__file__).parent / "conf"
PRIMARY = "config"
SCHEMA_NODE = "fsdpkit_schema"  # conf/config.yaml's first default: every key exists, typed
ASYNC_ALIAS = "async"
# List keys that users often give one value (`data.files=chat.jsonl`): a lone string becomes a
# one-item list. A lone value for any other list key is refused with the list syntax.
ONE_VALUE_LISTS = frozenset({"data.files", "data.val_files", "model.peft.target_modules", "policy.auto_wrap_policy",
                             "policy.activation_checkpointing_policy", "checkpoint.preemption_signals"})


def _register_schema() -> None:
    # A plain (untyped) dict of the defaults: Hydra can then delete keys (`~key`), which it
    # refuses on typed nodes; types are enforced right after composing, by to_typed().
    defaults = OmegaConf.to_container(OmegaConf.structured(Config), resolve=False)
    defaults["checkpoint"][ASYNC_ALIAS] = None  # `checkpoint.async`: see to_typed
    ConfigStore.instance().store(name=SCHEMA_NODE, node=defaults)


def compose_config(overrides: Sequence[str] = (), *, config_dirs: Sequence[str] = ()) -> Config:
    """Compose, validate and return the typed config.

    Args:
        overrides: Hydra override strings, e.g. ``["experiment=[bf16,ac]", "train.max_steps=5"]``.
        config_dirs: extra directories searched for config groups (users' own experiment files).

    Raises:
        ValueError: an unknown key, a wrong type or an invalid value, naming the key.
    """
    return to_typed(compose_raw(overrides, config_dirs=config_dirs))


def compose_raw(overrides: Sequence[str] = (), *, config_dirs: Sequence[str] = ()) -> DictConfig:
    """The composed YAML layers before schema validation."""
    hydra_overrides = list(overrides)
    if config_dirs:
        paths = ",".join(f"file://{Path(d).resolve()}" for d in config_dirs)
        hydra_overrides.append(f"hydra.searchpath=[{paths}]")
    _register_schema()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            return compose(config_name=PRIMARY, overrides=hydra_overrides)
    except (HydraException, OmegaConfBaseException) as e:
        unknown = re.match(r"Could not override '([^']+)'", str(e))
        if unknown:
            refuse_removed(unknown.group(1))
            raise ValueError(f"unknown config key '{unknown.group(1)}'; see `fsdpkit config docs` for every "
                             "key") from None
        raise ValueError(f"invalid configuration override: {e}") from None


def to_typed(raw: DictConfig) -> Config:
    """Merge composed values onto the schema; reject unknown keys and wrong types."""
    schema = OmegaConf.structured(Config)
    checkpoint = raw.get("checkpoint")
    if checkpoint is not None and ASYNC_ALIAS in checkpoint:
        # `async` is a Python keyword, so the field is async_save; the issue-tracker spelling
        # `checkpoint.async` is accepted for it.
        with open_dict(checkpoint):
            alias = checkpoint.pop(ASYNC_ALIAS)
            if alias is not None:
                checkpoint.async_save = alias
    for key in REMOVED_KEYS:  # set by a YAML file, or added with +key=value
        if OmegaConf.select(raw, key, default=_ABSENT) is not _ABSENT:
            refuse_removed(key)
    _lists_from_single_values(raw, schema)
    try:
        merged = OmegaConf.merge(schema, raw)
        OmegaConf.resolve(merged)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        msg = getattr(e, "msg", None) or str(e)
        raise ValueError(
            f"config key '{key}': {msg.splitlines()[0]}; see `fsdpkit config docs` for every key and its type"
        ) from None
    cfg: Config = OmegaConf.to_object(merged)
    validate(cfg)
    return cfg


def _list_keys(defaults: dict, prefix: str = "") -> Iterator[str]:
    """Dotted keys of the list-typed fields in a container of the schema's defaults."""
    for name, value in defaults.items():
        if isinstance(value, list):
            yield f"{prefix}{name}"
        elif isinstance(value, dict):
            yield from _list_keys(value, f"{prefix}{name}.")


def _lists_from_single_values(raw: DictConfig, schema: DictConfig) -> None:
    """Wrap a lone string given for a ONE_VALUE_LISTS key into a one-item list, in place; refuse a
    lone value for any other list key with a ValueError that shows how to write a list."""
    values = OmegaConf.to_container(raw, resolve=False)  # interpolations stay as written
    for key in _list_keys(OmegaConf.to_container(schema, resolve=False)):
        value = values
        for part in key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        # None is left to the merge (it says the key is not optional); `${...}` may resolve to a list
        if value is None or isinstance(value, list) or (isinstance(value, str) and value.startswith("${")):
            continue
        if key in ONE_VALUE_LISTS and isinstance(value, str):
            OmegaConf.update(raw, key, [value], merge=False)
        else:
            raise ValueError(f"config key '{key}' takes a list, got {value!r}; write a list: {key}=[a,b]")


_ABSENT = object()


def _refuse_unused_peft(peft: PeftConfig) -> None:
    """ValueError when LoRA settings differ from their defaults while model.peft.method=none: the
    run would be a full fine-tune that ignores them."""
    if peft.method != "none":
        return
    defaults = PeftConfig()
    changed = [f"model.peft.{f.name}" for f in dataclasses.fields(PeftConfig)
               if f.name != "method" and getattr(peft, f.name) != getattr(defaults, f.name)]
    if changed:
        raise ValueError(f"{', '.join(changed)} set while model.peft.method=none, which trains every parameter "
                         "and ignores them; add model.peft.method=lora for LoRA, or remove them for a full fine-tune")


def validate(cfg: Config) -> None:
    """Value checks the type system cannot express. World-size-dependent checks (a sample for every
    rank, HSDP groups) run in `check_world_size` as soon as the world size is known."""
    s, p, m, d, o, t = cfg.strategy, cfg.policy, cfg.model, cfg.data, cfg.optim, cfg.train
    check_one_of("strategy.sharding_strategy", s.sharding_strategy, SHARDING_STRATEGIES)
    check_one_of("strategy.state_dict_type", s.state_dict_type, STATE_DICT_TYPES)
    check_positive("strategy.hsdp_shard_size", s.hsdp_shard_size, allow_zero=True)
    if isinstance(p.mixed_precision, str):
        check_one_of("policy.mixed_precision", p.mixed_precision, MIXED_PRECISION_PRESETS)
    elif not (isinstance(p.mixed_precision, dict) and "_target_" in p.mixed_precision):
        raise ValueError(
            "config key 'policy.mixed_precision' must be a preset name "
            f"({', '.join(MIXED_PRECISION_PRESETS)}) or a mapping with a `_target_` factory"
        )
    for key in ("auto_wrap_policy", "activation_checkpointing_policy"):
        for path in getattr(p, key):
            if path != "auto" and "." not in path:
                raise ValueError(f"config key 'policy.{key}' entry {path!r} is not `auto` or a dotted class path "
                                 "(module.Class)")
    check_one_of("model.kind", m.kind, ("llama", "hf"))
    if m.kind == "llama":
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "num_key_value_heads"):
            check_positive(f"model.{key}", getattr(m, key))
        if m.hidden_size % m.num_attention_heads:
            raise ValueError("config key 'model.hidden_size' must be divisible by model.num_attention_heads")
        if m.num_attention_heads % m.num_key_value_heads:
            raise ValueError("config key 'model.num_attention_heads' must be divisible by model.num_key_value_heads")
    elif not m.path and "model_type" not in m.hf_config:
        raise ValueError("model.kind=hf needs model.path=<Hugging Face model folder> (or, to build a model from a "
                         "config alone, model.hf_config with a `model_type`, e.g. llama)")
    if m.path:
        if m.kind != "hf":
            raise ValueError(f"model.path={m.path} is a Hugging Face folder, but model.kind={m.kind}; select the "
                             "folder's model with model=hf model.path=DIR")
        if m.init_from:
            raise ValueError(f"model.init_from={m.init_from} and model.path={m.path} both name weights to start from; "
                             "model.path loads its own (model.pretrained=false for a random init): drop "
                             "model.init_from")
    check_one_of("model.attn_implementation", m.attn_implementation or "eager",
            ("eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3", "paged_attention"))
    check_one_of("model.peft.method", m.peft.method, ("none", "lora"))
    _refuse_unused_peft(m.peft)
    if m.peft.method != "none":
        if m.kind != "hf":
            raise ValueError("model.peft.method=lora needs a transformers model (model.kind=hf, e.g. "
                             "model=hf_llama_tiny)")
        check_positive("model.peft.r", m.peft.r)
        if not m.peft.target_modules:
            raise ValueError("config key 'model.peft.target_modules' is empty; name the layers, e.g. [q_proj,v_proj]")
    check_one_of("data.kind", d.kind, ("synthetic", "tokens", "text", "hf"))
    if d.kind == "hf":
        if not d.files:
            raise ValueError("data.kind=hf needs data.files=[path or glob, ...] (jsonl, json, parquet, csv or txt)")
        if not d.tokenizer and m.path:
            d.tokenizer = m.path  # the model folder's own tokenizer
        if not d.tokenizer:
            raise ValueError("data.kind=hf needs data.tokenizer=<folder of a Hugging Face tokenizer> (with model.path "
                             "it defaults to the model folder)")
        check_one_of("data.format", d.format, ("auto", "json", "parquet", "csv", "text"))
        d.packing = str(d.packing).lower()  # YAML and the command line give true/false as booleans
        check_one_of("data.packing", d.packing, PACKING)
        check_one_of("data.overlong", d.overlong, OVERLONG)
        check_positive("data.num_proc", d.num_proc)
    check_one_of("data.token_dtype", d.token_dtype, ("uint16", "uint32"))
    if d.kind in ("tokens", "text") and not d.path:
        raise ValueError(f"config key 'data.path' must name a file when data.kind={d.kind}")
    check_positive("data.seq_len", d.seq_len)
    check_positive("data.num_samples", d.num_samples)
    if not 0 < d.val_fraction < 1:
        raise ValueError(f"config key 'data.val_fraction' is {d.val_fraction}; it must lie strictly between 0 and 1")
    check_one_of("optim.schedule", o.schedule, ("cosine", "constant"))
    check_one_of("optim.impl", o.impl, ("auto", "fused", "foreach", "for_loop"))
    if len(o.betas) != 2:
        raise ValueError(f"config key 'optim.betas' needs two values, got {o.betas}")
    check_positive("optim.lr", o.lr)
    check_positive("optim.warmup_steps", o.warmup_steps, allow_zero=True)
    for key in ("max_steps", "global_batch_size", "micro_batch_size", "log_every"):
        check_positive(f"train.{key}", getattr(t, key))
    check_positive("train.eval_every", t.eval_every, allow_zero=True)
    check_positive("train.stop_at", t.stop_at, allow_zero=True)
    check_positive("train.eval_samples", t.eval_samples, allow_zero=True)
    check_positive("train.loss_chunk_tokens", t.loss_chunk_tokens, allow_zero=True)
    check_positive("train.grad_clip", t.grad_clip, allow_zero=True)
    check_positive("dist.timeout_s", cfg.dist.timeout_s)
    check_positive("dist.heartbeat_s", cfg.dist.heartbeat_s, allow_zero=True)
    check_positive("dist.slow_step_factor", cfg.dist.slow_step_factor, allow_zero=True)
    validate_checkpoint(cfg.checkpoint, state_dict_type=s.state_dict_type)
    check_positive("diagnostics.memory_steps", cfg.diagnostics.memory_steps, allow_zero=True)
    if cfg.diagnostics.skew_warn_ratio < 1:
        raise ValueError(f"config key 'diagnostics.skew_warn_ratio' is {cfg.diagnostics.skew_warn_ratio}; it must be "
                         ">= 1")
    if cfg.logging.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ValueError("config key 'logging.tensorboard' is true but tensorboard is not installed: "
                         "`pip install tensorboard`, or set logging.tensorboard=false")
    refuse_url(cfg.run_dir, setting="run_dir")
    check_url(cfg.export.dir, setting="export.dir")  # a URL: exported locally, then uploaded
    local_dirs = {"run_dir": (cfg.run_dir,
                              True)} | ({} if is_url(cfg.export.dir) else {"export.dir": (cfg.export.dir, False)})
    _refuse_overlap("checkpoint.local_dir", cfg.checkpoint.local_dir, local_dirs)
    check_url(m.init_from.removeprefix("hf:"), setting="model.init_from")  # a folder, or a URL read by ranged GETs
    if cfg.export.on_finish and is_url(cfg.checkpoint.dir):
        raise ValueError(f"export.on_finish exports from checkpoint.dir, and {cfg.checkpoint.dir} is a URL, which the "
                         "end-of-run export does not read yet; set export.on_finish=false and run "
                         "`fsdpkit ckpt export` on a local copy")
    if m.init_from and not (m.init_from.startswith("hf:") and len(m.init_from) > 3):
        raise ValueError(f"config key 'model.init_from' is {m.init_from!r}; use hf:<directory of safetensors> or ''")
    check_one_of("export.dtype", cfg.export.dtype, ("bf16", "fp16", "fp32"))
    check_one_of("export.format", cfg.export.format, ("hf", "single"))
    if cfg.export.on_finish and not cfg.checkpoint.save_at_end:
        raise ValueError("export.on_finish exports the final checkpoint: set checkpoint.save_at_end=true "
                         "(or export later with `fsdpkit ckpt export`)")
    check_one_of("device", cfg.device, ("auto", "cpu", "cuda"))
    check_one_of("backend", cfg.backend, ("auto", "gloo", "nccl"))


def check_world_size(cfg: Config, world_size: int, *, local_world_size: int | None = None) -> None:
    """World-size-dependent checks, run before launching ranks and again in each rank. A global
    batch runs at any world size that leaves every rank a sample (fsdpkit.data.sampler shares it
    out); an HSDP shard group must divide the world.

    Raises:
        ValueError: naming the setting to change.
    """
    if cfg.train.global_batch_size < world_size:
        raise ValueError(
            f"train.global_batch_size={cfg.train.global_batch_size} is smaller than the world size ({world_size} "
            f"ranks): every rank needs at least one sample of each global batch; set train.global_batch_size to at "
            f"least {world_size}, or run on fewer ranks")
    if cfg.strategy.sharding_strategy == "HYBRID_SHARD":
        shard = cfg.strategy.hsdp_shard_size or (local_world_size or world_size)
        if world_size % shard:
            raise ValueError(
                f"strategy.hsdp_shard_size={shard} does not divide the world size {world_size}; "
                "set strategy.hsdp_shard_size to the ranks per node"
            )


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def _refuse_overlap(setting: str, value: str, others: dict[str, tuple[str, bool]]) -> None:
    """ValueError when the local directory `value` is, contains or (unless the other's flag allows
    it) lies inside one of `others` ({setting: (directory, may hold value)}): each directory keeps
    what it holds apart, so that pruning the mirror or replacing an export never reaches the other."""
    if not value:
        return
    mine = Path(value).resolve()
    for name, (other, may_hold) in others.items():
        theirs = Path(other).resolve()
        if mine == theirs or mine in theirs.parents or (theirs in mine.parents and not may_hold):
            raise ValueError(f"{setting}={value} overlaps {name}={other}; give it a directory of its own "
                             "(e.g. /local/nvme/<run>/checkpoints)")
