"""Configuration: layering, Hydra override syntax, validation before anything runs."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from fsdpkit.config import check_world_size, compose_config
from fsdpkit.config.docs import field_docs
from fsdpkit.config.schema import Config

ROOT = Path(__file__).resolve().parents[2]


def test_defaults_compose_and_validate():
    cfg = compose_config()
    assert cfg.strategy.sharding_strategy == "FULL_SHARD"
    assert cfg.policy.auto_wrap_policy == ["auto"]
    assert cfg.run_dir == "runs/default"  # interpolation resolved


def test_experiment_list_composes_in_order():
    cfg = compose_config(["experiment=[demo,bf16,activation_checkpointing]"])
    assert cfg.name == "demo" and cfg.run_dir == "runs/demo"
    assert cfg.policy.mixed_precision == "bf16-mixed"
    assert cfg.policy.activation_checkpointing_policy == ["auto"]
    assert cfg.train.max_steps == 200


def test_experiment_can_switch_model_group():
    cfg = compose_config(["experiment=hf_llama"])
    assert cfg.model.kind == "hf" and cfg.model.hf_config["model_type"] == "llama"


def test_override_of_key_not_in_yaml_needs_no_plus():
    assert compose_config(["train.eval_samples=7"]).train.eval_samples == 7


def test_delete_restores_schema_default():
    cfg = compose_config(["optim.lr=0.5", "~optim.lr"])
    assert cfg.optim.lr == Config().optim.lr


def test_forced_add():
    cfg = compose_config(["++model.hf_config.rope_scaling=null", "++train.max_steps=3"])
    assert "rope_scaling" in cfg.model.hf_config and cfg.train.max_steps == 3


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.max_stepz=3", "unknown config key 'train.max_stepz'"),
        ("++train.bogus=1", "config key 'train.bogus'"),
        ("train.max_steps=abc", "config key 'train.max_steps'"),
        ("strategy.sharding_strategy=FULLSHARD", "expected one of FULL_SHARD"),
        ("policy.mixed_precision=fp8", "policy.mixed_precision"),
        ("data.val_fraction=1.5", "data.val_fraction"),
        ("policy.auto_wrap_policy=[LlamaDecoderLayer]", "not `auto` or a dotted class path"),
        ("experiment=nope", "experiment/nope"),
        ("model.init_from=/some/dir", "model.init_from"),
        ("export.dtype=int8", "config key 'export.dtype'"),
        ("checkpoint.keep_best_mode=lowest", "checkpoint.keep_best_mode"),
        ("checkpoint.preemption_signals=[SIGNOPE]", "unknown signal 'SIGNOPE'"),
        ("checkpoint.async=maybe", "checkpoint.async_save"),
        ("checkpoint.async_staging=lazy", "checkpoint.async_staging"),
        ("checkpoint.async_staging=background", "checkpoint.async_save is off"),
        ("diagnostics.skew_warn_ratio=0.5", "diagnostics.skew_warn_ratio"),
    ],
)
def test_bad_config_names_the_key(override, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        compose_config([override])


@pytest.mark.parametrize(
    ("override", "key", "expected"),
    [
        ("data.files=chat.jsonl", "data.files", ["chat.jsonl"]),
        ("data.val_files=val/*.jsonl", "data.val_files", ["val/*.jsonl"]),
        ("model.peft.target_modules=q_proj", "model.peft.target_modules", ["q_proj"]),
        ("policy.activation_checkpointing_policy=a.B", "policy.activation_checkpointing_policy", ["a.B"]),
        ("checkpoint.preemption_signals=SIGUSR1", "checkpoint.preemption_signals", ["SIGUSR1"]),
        ("data.files=[a.jsonl,b.jsonl]", "data.files", ["a.jsonl", "b.jsonl"]),
    ],
)
def test_one_value_for_a_list_key_becomes_a_one_item_list(override, key, expected):
    cfg = compose_config(["experiment=hf_llama", "model.peft.method=lora", override])
    section, _, name = key.rpartition(".")
    node = cfg
    for part in section.split("."):
        node = getattr(node, part)
    assert getattr(node, name) == expected


def test_one_value_in_an_experiment_file_becomes_a_list_and_interpolations_stay(tmp_path):
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "one_file.yaml").write_text(
        "# @package _global_\ndata:\n  files: chat.jsonl\n  val_files: ${data.files}\n")
    cfg = compose_config(["experiment=one_file"], config_dirs=[str(tmp_path)])
    assert cfg.data.files == ["chat.jsonl"] and cfg.data.val_files == ["chat.jsonl"]


@pytest.mark.parametrize("override", ["optim.betas=0.9", "policy.auto_wrap_policy=5"])
def test_one_value_for_another_list_key_shows_the_list_syntax(override):
    key = override.split("=", 1)[0]
    with pytest.raises(ValueError, match=rf"config key '{key}' takes a list, got .*; write a list: {key}=\[a,b\]"):
        compose_config([override])


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["model.peft.r=16"], "model.peft.r"),
        (["model.peft.alpha=32", "model.peft.dropout=0.1"], "model.peft.alpha, model.peft.dropout"),
        (["model.peft.target_modules=[q_proj,k_proj]"], "model.peft.target_modules"),
    ],
)
def test_lora_settings_without_lora_method_are_refused(overrides, named):
    with pytest.raises(ValueError, match=rf"^{named} set while model.peft.method=none, which trains every "
                                         r"parameter .*add model.peft.method=lora .* or remove them"):
        compose_config(["experiment=hf_llama", *overrides])
    cfg = compose_config(["experiment=hf_llama", "model.peft.method=lora", *overrides])
    assert cfg.model.peft.method == "lora"


def test_a_global_batch_runs_at_any_world_size_it_can_share():
    cfg = compose_config(["train.global_batch_size=16", "train.micro_batch_size=4"])
    for world_size in (1, 2, 3, 5, 7, 8, 16):
        check_world_size(cfg, world_size)
    with pytest.raises(ValueError, match=r"^train.global_batch_size=16 is smaller than the world size \(17 ranks\): "
                                         r"every rank needs .*set train.global_batch_size to at least 17"):
        check_world_size(cfg, 17)


def test_hybrid_shard_group_must_divide_world():
    cfg = compose_config(["strategy.sharding_strategy=HYBRID_SHARD", "strategy.hsdp_shard_size=3",
                          "train.global_batch_size=48"])
    with pytest.raises(ValueError, match="hsdp_shard_size=3 does not divide the world size 4"):
        check_world_size(cfg, 4)


def _schema_classes(cls=Config):
    yield cls
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(default):
            yield from _schema_classes(type(default))


def test_every_field_is_documented():
    for cls in _schema_classes():
        docs = field_docs(cls)
        missing = [f.name for f in dataclasses.fields(cls) if not docs.get(f.name)]
        assert not missing, f"{cls.__name__} fields without a docstring: {missing}"


def test_async_alias_and_cross_checks():
    assert compose_config(["checkpoint.async=true"]).checkpoint.async_save is True
    with pytest.raises(ValueError, match="needs strategy.state_dict_type=sharded"):
        compose_config(["checkpoint.async=true", "strategy.state_dict_type=full"])
    with pytest.raises(ValueError, match="set checkpoint.save_at_end=true"):
        compose_config(["export.on_finish=true", "checkpoint.save_at_end=false"])


@pytest.mark.parametrize("override", ["run_dir=s3://c/run", "run_dir=file:///x"])
def test_urls_are_refused_where_only_local_paths_work(override):
    key = override.split("=", 1)[0]
    with pytest.raises(ValueError, match=rf"{key}='.*' is a \w+:// URL; {key} takes a local or mounted path only"):
        compose_config([override])
    assert compose_config(["export.dir=s3://c/out"]).export.dir == "s3://c/out"  # exported, then uploaded
    with pytest.raises(ValueError, match=r"export.dir='nosuch://c/out': fsspec knows no nosuch:// scheme"):
        compose_config(["export.dir=nosuch://c/out"])


def test_checkpoint_urls_need_a_driver_and_sharded_checkpoints():
    cfg = compose_config(["checkpoint.dir=s3://bucket/run/ckpts", "checkpoint.resume=s3://b/ckpts/step_4",
                          "+checkpoint.storage_options.endpoint_url=http://127.0.0.1:9"])
    assert cfg.checkpoint.dir == "s3://bucket/run/ckpts"
    assert cfg.checkpoint.storage_options == {"endpoint_url": "http://127.0.0.1:9"}
    with pytest.raises(ValueError, match=r"checkpoint.dir='nosuch://b/x': fsspec knows no nosuch:// scheme"):
        compose_config(["checkpoint.dir=nosuch://b/x"])
    with pytest.raises(ValueError, match=r"object storage takes sharded checkpoints only"):
        compose_config(["checkpoint.dir=s3://b/x", "strategy.state_dict_type=full"])
    with pytest.raises(ValueError, match=r"export.on_finish exports from checkpoint.dir, and s3://b/x is a URL"):
        compose_config(["checkpoint.dir=s3://b/x", "export.on_finish=true"])
    assert compose_config(["model.init_from=hf:s3://b/model"]).model.init_from == "hf:s3://b/model"
    with pytest.raises(ValueError, match=r"model.init_from='nosuch://b/m': fsspec knows no nosuch:// scheme"):
        compose_config(["model.init_from=hf:nosuch://b/m"])
    with pytest.raises(ValueError, match=r"checkpoint.storage_options holds credentials \(secret\)"):
        compose_config(["checkpoint.dir=s3://b/x", "+checkpoint.storage_options.secret=abc"])


def test_ckpt_commands_refuse_urls(capsys):
    from fsdpkit.cli.main import main

    assert main(["ckpt", "export", "runs/x/checkpoints", "nosuch://bucket/out"]) == 2
    assert "OUT='nosuch://bucket/out': fsspec knows no nosuch:// scheme" in capsys.readouterr().err
    assert main(["ckpt", "verify", "nosuch://bucket/run/checkpoints/step_4"]) == 2
    assert "fsspec knows no nosuch:// scheme" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "code", "expected"),
    [
        (["config", "show", "--config-dir", "{dir}", "experiment=tiny_batch", "train.max_steps=9"], 0,
         "global_batch_size: 1\n  micro_batch_size: 1"),
        (["train", "experiment=tiny_batch", "--config-dir", "{dir}", "train.max_steps=9", "--nproc", "2"], 2,
         "train.global_batch_size=1 is smaller than the world size (2 ranks)"),
        (["resume-check", "experiment=tiny_batch", "--nproc", "2", "--config-dir", "{dir}", "train.log_every=2"], 2,
         "the first runs on 2 rank(s) (--nproc): train.global_batch_size=1 is smaller than the world size"),
    ],
    ids=["config-show", "train", "resume-check"],
)
def test_config_dir_is_accepted_between_overrides(tmp_path, capsys, argv, code, expected):
    from fsdpkit.cli.main import main

    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "tiny_batch.yaml").write_text(
        "# @package _global_\ntrain:\n  global_batch_size: 1\n  micro_batch_size: 1\n")
    assert main([arg.format(dir=tmp_path) for arg in argv]) == code
    out, err = capsys.readouterr()
    assert expected in (out if code == 0 else err), out + err
    if code == 0:
        assert "max_steps: 9" in out  # the override after --config-dir is applied


def test_unknown_options_after_overrides_are_still_refused(capsys):
    from fsdpkit.cli.main import main

    with pytest.raises(SystemExit):
        main(["config", "show", "--config-dir", "conf", "experiment=demo", "--bogus"])
    assert "unrecognized arguments: experiment=demo --bogus" in capsys.readouterr().err


REMOVED_IO = ("config key 'checkpoint.io' was removed: every load now reads with DCP's own reader, checking "
              "every file's checksums (checkpoint.verify_checksums); ")


@pytest.mark.parametrize("override", ["checkpoint.io=fast", "+checkpoint.io=plain", "++checkpoint.io=fast"])
def test_the_removed_checkpoint_io_setting_is_refused_with_one_sentence_naming_it(override):
    with pytest.raises(ValueError, match="^" + re.escape(REMOVED_IO + "delete checkpoint.io from your command "
                                                                      "line and config files") + "$"):
        compose_config([override])


def test_the_removed_checkpoint_io_setting_in_a_yaml_file_is_refused_by_the_command(tmp_path, capsys):
    from fsdpkit.cli.main import main

    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "old.yaml").write_text("# @package _global_\ncheckpoint:\n  io: fast\n")
    assert main(["config", "show", "--config-dir", str(tmp_path), "experiment=old"]) == 2
    out, err = capsys.readouterr()
    assert REMOVED_IO + "delete checkpoint.io" in err and "checkpoint:" not in out
    assert main(["config", "show", "--config-dir", str(tmp_path)]) == 0  # without the file: composes


def test_the_removed_checkpoint_io_setting_is_refused_by_the_checkpointer(tmp_path):
    from torch import nn

    from fsdpkit.checkpoint import Checkpointer

    with pytest.raises(ValueError, match="^" + re.escape(REMOVED_IO + "leave io= out of Checkpointer(...)") + "$"):
        Checkpointer(tmp_path / "ckpt", model=nn.Linear(2, 2), io="plain")
    assert not (tmp_path / "ckpt").exists()  # refused before anything was made
    with pytest.raises(TypeError, match=r"unknown setting\(s\) \['iox'\]"):  # other unknown names: as before
        Checkpointer(tmp_path / "ckpt", model=nn.Linear(2, 2), iox="plain")
