"""Exports of runs whose model is a transformers model (`model.kind=hf`), from real fsdpkit
checkpoints written in one process by the Checkpointer API with the run config recorded as the
trainer records it. transformers itself is the reference: `from_pretrained` of the model, the
tokenizer and the generation config, and `save_pretrained` for the files' names and layouts.

- a run from a Hugging Face folder: the export carries that folder's generation_config.json and
  the run's tokenizer (chat template included), and says which files it could not add when the
  folders are gone;
- the hub layout: MoE experts fused in memory are written per expert, GPT-NeoX's lm_head as
  embed_out, exactly as save_pretrained writes them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    GPTNeoXConfig,
    LlamaConfig,
    MixtralConfig,
)

from fsdpkit.checkpoint import Checkpointer
from fsdpkit.cli.main import main
from fsdpkit.export.adapter import export_merged
from fsdpkit.export.exporter import export_checkpoint
from fsdpkit.model.peft import apply_lora

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
SAMPLE = "Hello there! The model exports with its tokenizer, 123 times."
MESSAGES = [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "hi"}]


def save_run(root: Path, model: torch.nn.Module, config: dict) -> Path:
    """An fsdpkit checkpoint of `model` (step 1) recording `config` as the run config; returns its root."""
    with Checkpointer(root, model=model, optimizer=torch.optim.AdamW(model.parameters()), config=config) as ckpt:
        ckpt.resume()
        ckpt.save(1)
    return root


def hf_run_config(model: torch.nn.Module, *, path: str = "", tokenizer: str = "", **model_extra) -> dict:
    """The run config of `fsdpkit train model=hf model.path=...` as its manifest records it."""
    return {"model": {"kind": "hf", "path": path, "hf_config": model.config.to_dict(), **model_extra},
            "data": {"tokenizer": tokenizer}}


def cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["ckpt", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def read_folder(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face folder's safetensors files, by name."""
    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})
    return tensors


def logits(model: torch.nn.Module, vocab: int) -> torch.Tensor:
    ids = torch.arange(24).reshape(2, 12) % vocab
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


# ---- a run from a Hugging Face folder: generation config and tokenizer come along ---------------

@pytest.fixture
def hf_folder(tmp_path, hf_tokenizer_dir) -> tuple[Path, Path]:
    """(a tiny Llama folder with non-default generation settings, a copy of the session tokenizer)."""
    tokenizer = Path(shutil.copytree(hf_tokenizer_dir, tmp_path / "tokenizer"))
    vocab = len(AutoTokenizer.from_pretrained(tokenizer))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64))
    folder = tmp_path / "base"
    model.save_pretrained(folder)
    GenerationConfig(do_sample=True, temperature=0.6, top_p=0.9, eos_token_id=[0, 5], bos_token_id=0,
                     max_new_tokens=33).save_pretrained(folder)
    return folder, tokenizer


def trained(folder: Path) -> torch.nn.Module:
    """The folder's model with changed weights (as training leaves it)."""
    model = AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    return model


@pytest.mark.parametrize("where", ["data.tokenizer", "model.path"])
def test_export_of_a_run_from_a_folder_loads_model_tokenizer_and_generation_config(hf_folder, tmp_path, capsys, where):
    folder, tokenizer = hf_folder
    if where == "model.path":  # data.tokenizer left empty: the folder is the tokenizer's place
        for file in tokenizer.iterdir():
            shutil.copy(file, folder / file.name)
    model = trained(folder)
    ckpt = save_run(tmp_path / "ckpt", model,
                    hf_run_config(model, path=str(folder),
                                  tokenizer=str(tokenizer) if where == "data.tokenizer" else ""))
    out = tmp_path / "out"
    code, stdout, err = cli(capsys, "export", str(ckpt), str(out))
    assert code == 0, err
    assert sorted(p.name for p in out.iterdir()) == ["chat_template.jinja", "config.json", "generation_config.json",
                                                     "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert f"added: generation_config.json copied from the run's model folder {folder} (model.path)" in stdout
    source = tokenizer if where == "data.tokenizer" else folder
    assert f"added: tokenizer with its chat template from {source} ({where})" in stdout and "NOT ADDED" not in stdout

    loaded, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert (info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"]) == (set(), set(), set())
    assert torch.equal(logits(loaded, model.config.vocab_size), logits(model, model.config.vocab_size))
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    trained_config = {k: v for k, v in AutoConfig.from_pretrained(folder).to_dict().items() if k != "_name_or_path"}
    assert {k: v for k, v in loaded.config.to_dict().items() if k != "_name_or_path"} == trained_config

    want, got = AutoTokenizer.from_pretrained(tokenizer), AutoTokenizer.from_pretrained(out)
    assert got(SAMPLE)["input_ids"] == want(SAMPLE)["input_ids"] and got.eos_token == want.eos_token
    assert got.chat_template == want.chat_template and got.chat_template
    assert got.apply_chat_template(MESSAGES, tokenize=False) == want.apply_chat_template(MESSAGES, tokenize=False)

    generation = GenerationConfig.from_pretrained(out)
    assert generation == GenerationConfig.from_pretrained(folder)
    assert (generation.temperature, generation.top_p, generation.eos_token_id) == (0.6, 0.9, [0, 5])
    assert loaded.generation_config.max_new_tokens == 33

    # an earlier export with tokenizer files is one --overwrite may replace
    code, _, err = cli(capsys, "export", str(ckpt), str(out), "--overwrite", "--dtype", "bf16")
    assert code == 0, err
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    (out / "notes.txt").write_text("mine")
    code, _, err = cli(capsys, "export", str(ckpt), str(out), "--overwrite")
    assert code == 2 and "it holds notes.txt, which an export does not write" in err


def test_a_folder_that_is_gone_does_not_stop_the_export_and_the_output_says_what_is_missing(hf_folder, tmp_path,
                                                                                            capsys):
    folder, tokenizer = hf_folder
    model = trained(folder)
    ckpt = save_run(tmp_path / "ckpt", model, hf_run_config(model, path=str(folder), tokenizer=str(tokenizer)))
    shutil.rmtree(folder)
    shutil.rmtree(tokenizer)
    out = tmp_path / "out"
    code, stdout, err = cli(capsys, "export", str(ckpt), str(out))
    assert code == 0, err
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    assert (f"NOT ADDED: tokenizer files (tokenizer.json, tokenizer_config.json, chat template): the run's tokenizer "
            f"folder {tokenizer} (data.tokenizer) no longer exists; add them with python -c \"from transformers import "
            f"AutoTokenizer; AutoTokenizer.from_pretrained('TOKENIZER_FOLDER').save_pretrained('{out}')\"") in stdout
    assert (f"NOT ADDED: generation_config.json: the run's model folder {folder} (model.path) no longer "
            "exists" in stdout
            and f"cp ORIGINAL_FOLDER/generation_config.json {out}/" in stdout)
    loaded, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and torch.equal(logits(loaded, 64), logits(model, 64))

    report = export_checkpoint(ckpt, tmp_path / "again")  # the same through the API, for export.on_finish
    assert [line.split(":")[0] for line in report["not_added"]] == ["generation_config.json",
                                                                    "tokenizer files (tokenizer.json, "
                                                                    "tokenizer_config.json, chat template)"]


def test_merged_lora_export_gets_the_tokenizer_and_generation_config_too(hf_folder, tmp_path):
    folder, tokenizer = hf_folder
    base = trained(folder)
    settings = {"method": "lora", "r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}
    model = apply_lora(base, type("Peft", (), settings))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.05)  # B starts at zero: give the merge something to add
    ckpt = save_run(tmp_path / "ckpt", model, hf_run_config(base, path=str(folder), tokenizer=str(tokenizer),
                                                            peft=settings))
    report = export_merged(ckpt, tmp_path / "merged")
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
            "generation_config.json"} <= set(report["files"])
    assert report["merged"] == 4 and not report["not_added"]
    loaded, info = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    vocab = base.config.vocab_size
    torch.testing.assert_close(logits(loaded, vocab), logits(model, vocab), rtol=1e-5, atol=1e-5)
    assert GenerationConfig.from_pretrained(tmp_path / "merged") == GenerationConfig.from_pretrained(folder)
    assert (AutoTokenizer.from_pretrained(tmp_path / "merged")(SAMPLE)["input_ids"]
            == AutoTokenizer.from_pretrained(tokenizer)(SAMPLE)["input_ids"])


# ---- the hub layout: what save_pretrained writes ----------------------------------------------------

TINY = {
    # experts fused in memory (gate_up_proj, down_proj: 3-D), one tensor per expert in the files
    "mixtral": (MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                              num_experts_per_tok=2), "model.layers.0.mlp.experts.gate_up_proj",
                "model.layers.0.block_sparse_moe.experts.3.w3.weight"),
    # renamed only: lm_head in memory, embed_out in the files
    "gpt_neox": (GPTNeoXConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                               num_attention_heads=4, max_position_embeddings=64), "lm_head.weight",
                               "embed_out.weight"),
}


@pytest.fixture(scope="module", params=sorted(TINY))
def hub_case(request, tmp_path_factory):
    """(model, checkpoint root, save_pretrained folder, in-memory-only name, file-only name)."""
    config, memory_name, file_name = TINY[request.param]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    root = tmp_path_factory.mktemp(request.param)
    assert memory_name in model.state_dict()
    ckpt = save_run(root / "ckpt", model, hf_run_config(model))
    model.save_pretrained(root / "reference")
    return model, ckpt, root / "reference", memory_name, file_name


def assert_same_files(out: Path, reference: Path) -> None:
    got, want = read_folder(out), read_folder(reference)
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


@pytest.mark.parametrize("shards", [False, True])
def test_export_writes_exactly_what_save_pretrained_writes(hub_case, tmp_path, shards):
    model, ckpt, reference, memory_name, file_name = hub_case
    out = tmp_path / "out"
    # shards: a 20 KB limit splits the files (and a group's outputs across them); 256-byte blocks stream rows
    report = export_checkpoint(ckpt, out, **({"max_shard_size": 20_000, "block_bytes": 256} if shards else {}))
    assert_same_files(out, reference)
    assert (len(report["files"]) > 1) == shards
    layout_note = f"wrote the hub's layout of {type(model).__name__}, as save_pretrained does"
    assert any(layout_note in n for n in report["notes"])
    with safe_open(str(next(out.glob("*.safetensors"))), "pt") as f:
        assert f.metadata()["exported_by"].startswith("fsdpkit ")
    loaded, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert (info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"]) == (set(), set(), set())
    assert torch.equal(logits(loaded, 64), logits(model, 64))
    files = read_folder(out)
    assert file_name in files and memory_name not in files


def test_no_hub_layout_keeps_the_checkpoint_names_and_config_gives_the_layout_to_foreign_checkpoints(hub_case, tmp_path,
                                                                                                      capsys):
    model, ckpt, reference, memory_name, file_name = hub_case
    code, _, err = cli(capsys, "export", str(ckpt), str(tmp_path / "memory"), "--no-hub-layout")
    assert code == 0, err
    files = read_folder(tmp_path / "memory")
    assert sorted(files) == sorted(model.state_dict()) and memory_name in files and file_name not in files
    # a plain DCP checkpoint of the in-memory state dict (another tool's), described by --config
    dcp.save({"model": model.state_dict()}, checkpoint_id=tmp_path / "foreign", no_dist=True)
    code, stdout, err = cli(capsys, "export", str(tmp_path / "foreign"), str(tmp_path / "out"), "--config",
                            str(reference))
    assert code == 0, err
    assert_same_files(tmp_path / "out", reference)
    assert "wrote the hub's layout of" in stdout
