"""`model=hf model.path=DIR`: the config as transformers reads it, overrides, bad folders, the
automatic wrap policy, and a random init of a folder's architecture (no process group)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fsdpkit.config import compose_config  # noqa: E402
from fsdpkit.hf.build import build_model  # noqa: E402
from fsdpkit.hf.folder_config import resolve_hf_config  # noqa: E402
from fsdpkit.parallel.init import init_weights  # noqa: E402
from fsdpkit.parallel.policies import matching_modules  # noqa: E402
from hf_folders import make_folder, reference_model  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory) -> Path:
    return make_folder("gemma3_text", tmp_path_factory.mktemp("gemma3"))


def _cfg(folder: Path, *extra: str):
    return compose_config(["model=hf", f"model.path={folder}", *extra]).model


def test_config_is_the_folders_and_overrides_are_applied_and_listed(gemma3):
    config, changed = resolve_hf_config(_cfg(gemma3))
    on_disk = json.loads((gemma3 / "config.json").read_text())
    assert changed == [] and {k: config.to_dict()[k] for k in on_disk} == on_disk and on_disk["dtype"] == "bfloat16"
    config, changed = resolve_hf_config(_cfg(gemma3, "+model.hf_config.rms_norm_eps=1e-3",
                                     "+model.hf_config.sliding_window=16"))
    assert config.rms_norm_eps == 1e-3 and config.sliding_window == 16
    assert changed == ["rms_norm_eps: 1e-06 -> 0.001", "sliding_window: 32 -> 16"]
    with pytest.raises(ValueError, match=r"model.hf_config.rope_thetaa: Gemma3TextConfig has no field 'rope_thetaa'"):
        resolve_hf_config(_cfg(gemma3, "+model.hf_config.rope_thetaa=1"))


def test_a_recorded_config_resolves_to_itself(gemma3):
    cfg = _cfg(gemma3, "+model.hf_config.rms_norm_eps=1e-3")
    full = resolve_hf_config(cfg)[0].to_dict()
    cfg.hf_config = full
    again, changed = resolve_hf_config(cfg)
    assert again.to_dict() == full and changed == ["rms_norm_eps: 1e-06 -> 0.001"]


def test_bad_folders_get_one_clear_paragraph(tmp_path, gemma3):
    with pytest.raises(FileNotFoundError, match="has no config.json; point it at a Hugging Face model folder"):
        resolve_hf_config(_cfg(tmp_path))
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        resolve_hf_config(_cfg(tmp_path / "nope"))
    raw = json.loads((gemma3 / "config.json").read_text())
    quant = tmp_path / "quant"
    quant.mkdir()
    (quant / "config.json").write_text(json.dumps(raw | {"quantization_config": {"quant_method": "fp8"}}))
    with pytest.raises(ValueError, match=r"holds quantized weights .*quant_method='fp8'.*unquantized \(bf16\) release"):
        resolve_hf_config(_cfg(quant))
    vit = tmp_path / "vit"
    vit.mkdir()
    (vit / "config.json").write_text(json.dumps({"model_type": "vit", "architectures": ["ViTModel"]}))
    with pytest.raises(ValueError, match=r"ViTModel \(ViTConfig\) is not a causal language model"):
        resolve_hf_config(_cfg(vit))
    with pytest.raises(ValueError, match="model.path=.* is a Hugging Face folder, but model.kind=llama; select"):
        compose_config([f"model.path={gemma3}"])


def test_a_transformers_older_than_the_tested_one_is_named(gemma3, monkeypatch):
    """transformers 5.16 and older are refused by name, before the folder is read or exported;
    5.17 and later (releases candidates and dev builds included) are taken."""
    import transformers

    from fsdpkit.export.hub_layout import meta_model_from_config

    config, _ = resolve_hf_config(_cfg(gemma3))
    for old in ("5.16.2", "4.57.0"):
        monkeypatch.setattr(transformers, "__version__", old)
        message = rf"this environment has transformers {old}: pip install -U 'transformers>=5.17'"
        with pytest.raises(ImportError, match=message):
            resolve_hf_config(_cfg(gemma3))
        with pytest.raises(ImportError, match=message):
            meta_model_from_config(config)
    for new in ("5.17.0", "5.17.0rc1", "5.30.0.dev0", "6.0.0"):
        monkeypatch.setattr(transformers, "__version__", new)
        assert resolve_hf_config(_cfg(gemma3))[0].model_type == "gemma3_text"


def test_data_tokenizer_defaults_to_the_model_folder(gemma3):
    cfg = compose_config(["model=hf", f"model.path={gemma3}", "data=hf", "data.files=[a.jsonl]"])
    assert cfg.data.tokenizer == str(gemma3)
    with pytest.raises(ValueError, match=r"needs data.tokenizer=.*with model.path it defaults to the model folder"):
        compose_config(["data=hf", "data.files=[a.jsonl]"])


def test_auto_wrap_policy_takes_the_models_own_blocks(gemma3):
    with torch.device("meta"):
        hf = build_model(_cfg(gemma3))
        ours = build_model(compose_config([]).model)
    assert [n for n, _ in matching_modules(hf, ["auto"], setting="s")] == ["model.layers.0", "model.layers.1"]
    assert [type(m).__name__ for _, m in matching_modules(ours, ["auto"], setting="s")] == ["LlamaDecoderLayer"] * 2
    hf._no_split_modules = []
    with pytest.raises(ValueError, match="s=auto: Gemma3ForCausalLM names no block class in _no_split_modules"):
        matching_modules(hf, ["auto"], setting="s")


def test_random_init_of_a_folders_architecture_takes_transformers_constants(gemma3):
    """model.pretrained=false: matrices from the seed, Gemma's zero-centred norms and every buffer as
    transformers' own init gives them (not fsdpkit's ones for norms)."""
    from fsdpkit.parallel.fsdp import materialize

    with torch.device("meta"):
        model = build_model(_cfg(gemma3, "model.pretrained=false"))
    materialize(model, device=torch.device("cpu"), seed=3)
    ref = reference_model(gemma3)
    for name, buf in ref.named_buffers():
        assert torch.equal(dict(model.named_buffers())[name], buf), name
    norms = [p for n, p in model.named_parameters() if "norm" in n]
    assert norms and all(torch.equal(p, torch.zeros_like(p)) for p in norms)  # Gemma: 1 + weight
    q = model.model.layers[0].self_attn.q_proj.weight
    assert 0.015 < float(q.std()) < 0.025 and not torch.isnan(q).any()  # N(0, initializer_range=0.02)


def test_a_one_dimensional_parameter_without_a_rule_is_named():
    class Gate(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.empty(4))

    with pytest.raises(NotImplementedError,
                       match=r"no deterministic init rule for parameter 'gate.scale' \(\[4\]\) of Gate"):
        init_weights(torch.nn.ModuleDict({"gate": Gate()}), seed=0, std=0.02)


def test_loading_a_folder_of_another_vocabulary_or_tying_is_refused_before_loading(gemma3, tmp_path):
    from fsdpkit.hf.vocab_and_tie import check_vocab_and_tie

    with torch.device("meta"):
        model = build_model(_cfg(gemma3))
    raw = json.loads((gemma3 / "config.json").read_text())
    check_vocab_and_tie(model, raw)
    with pytest.raises(ValueError, match="the model has vocab_size 512, the folder's config.json 600"):
        check_vocab_and_tie(model, raw | {"vocab_size": 600})
    with pytest.raises(ValueError, match="tie_word_embeddings=false"):
        check_vocab_and_tie(model, raw | {"tie_word_embeddings": False})


def test_a_config_with_infinite_fields_round_trips(tmp_path):
    """FalconH1's time_step_limit defaults to (0.0, inf); transformers writes inf into config.json as
    {"__float__": "Infinity"} and decodes it when it reads the file: so does every reader here."""
    import transformers

    from fsdpkit.export.hf_config import transformers_config
    from fsdpkit.hf.config_json import read_json_object
    from fsdpkit.hf.vocab_and_tie import folder_vocab_and_tie

    transformers.FalconH1Config(vocab_size=96, tie_word_embeddings=False).save_pretrained(tmp_path)
    on_disk = json.loads((tmp_path / "config.json").read_text())
    assert on_disk["time_step_limit"][1] == {"__float__": "Infinity"}  # the tagged form this test is about
    raw = read_json_object(tmp_path / "config.json", where="test")
    assert raw["time_step_limit"] == [0.0, float("inf")]
    assert folder_vocab_and_tie(on_disk) == {"vocab_size": 96, "tied_embeddings": False}
    config, _ = resolve_hf_config(_cfg(tmp_path))
    assert list(transformers_config({"hf_config": on_disk}).time_step_limit) == [0.0, float("inf")]
    assert list(config.time_step_limit) == [0.0, float("inf")]
