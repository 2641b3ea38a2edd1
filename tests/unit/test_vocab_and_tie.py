"""The vocabulary size and embedding tying: read from the model, recorded in the checkpoint
manifest's fingerprint (sealed, shape-checked), compared before a resume loads anything, and
compared with a Hugging Face folder's config.json before its weights load."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from fsdpkit.checkpoint.embeddings import vocab_and_tie
from fsdpkit.checkpoint.errors import CheckpointCorruptError, CheckpointMismatchError
from fsdpkit.checkpoint.layout import MANIFEST
from fsdpkit.checkpoint.manifest import (
    SEAL,
    check_fingerprint,
    manifest_digest,
    model_fingerprint,
    read_manifest,
)
from fsdpkit.checkpoint.resume import load_checkpoint
from fsdpkit.checkpoint.save import save_checkpoint
from fsdpkit.checkpoint.state import CheckpointTarget
from fsdpkit.hf.vocab_and_tie import check_vocab_and_tie
from fsdpkit.model.llama import LlamaArgs, LlamaForCausalLM

transformers = pytest.importorskip("transformers")

SIZES = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)


def llama(*, vocab: int = 64, tied: bool = False, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaArgs(vocab_size=vocab, tie_word_embeddings=tied, **SIZES))


def hf_llama(*, vocab: int = 64, tied: bool = False) -> nn.Module:
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=vocab, tie_word_embeddings=tied, **SIZES))


class Counter:
    def __init__(self, step: int = 0):
        self.step = step

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state):
        self.step = int(state["step"])


def test_read_from_the_model_itself():
    assert vocab_and_tie(llama(vocab=64)) == {"vocab_size": 64, "tied_embeddings": False}
    assert vocab_and_tie(llama(vocab=72, tied=True)) == {"vocab_size": 72, "tied_embeddings": True}
    assert vocab_and_tie(hf_llama(vocab=80)) == {"vocab_size": 80, "tied_embeddings": False}
    assert vocab_and_tie(hf_llama(vocab=80, tied=True)) == {"vocab_size": 80, "tied_embeddings": True}
    grown = hf_llama(vocab=80)
    grown.resize_token_embeddings(96)  # the config follows here, but the rows are what counts
    assert vocab_and_tie(grown) == {"vocab_size": 96, "tied_embeddings": False}
    assert vocab_and_tie(nn.Sequential(nn.Linear(4, 4))) == {}  # a user's own model: unknown


def test_fingerprint_records_them_and_a_tie_change_is_invisible_to_the_tensor_list():
    untied, tied = (model_fingerprint(llama(tied=t), sharding={}) for t in (False, True))
    assert (untied["vocab_size"], untied["tied_embeddings"]) == (64, False)
    assert (tied["vocab_size"], tied["tied_embeddings"]) == (64, True)
    assert untied["tensors"] == tied["tensors"]  # why the manifest needs the flag


def test_check_fingerprint_names_both_values_and_the_setting():
    saved = model_fingerprint(llama(vocab=64), sharding={})
    with pytest.raises(CheckpointMismatchError, match=(
            r"(?s)nothing was loaded.*checkpoint vocab_size 64, model 72: set model\.hf_config\.vocab_size=64 "
            r"\(model\.vocab_size=64 for model\.kind=llama\).*model\.resize_to_tokenizer")) as info:
        check_fingerprint(saved, model_fingerprint(llama(vocab=72), sharding={}), ckpt_dir="ckpt/step_6")
    assert "changed: model.embed_tokens.weight" not in str(info.value)
    with pytest.raises(CheckpointMismatchError, match=(
            r"lm_head are untied \(two matrices\), the model's tied \(one matrix\): "
            r"set model\.hf_config\.tie_word_embeddings=false")):
        check_fingerprint(saved, model_fingerprint(llama(tied=True), sharding={}), ckpt_dir="ckpt/step_6")
    assert check_fingerprint(saved, model_fingerprint(llama(seed=1), sharding={}), ckpt_dir="ckpt/step_6") == []


def test_a_manifest_without_the_fields_is_unknown_not_a_mismatch():
    current = model_fingerprint(llama(tied=True), sharding={})
    older = {"tensors": current["tensors"]}  # written before the fields existed
    assert check_fingerprint(older, current, ckpt_dir="old/step_1") == []
    # and a model fsdpkit cannot read them from is compared by its tensors alone
    assert check_fingerprint(current, {"tensors": current["tensors"]}, ckpt_dir="old/step_1") == []


def _target(model: nn.Module, counter: Counter) -> CheckpointTarget:
    return CheckpointTarget(model=model, optimizer=torch.optim.AdamW(model.parameters()), stateful={"train": counter})


def _save(model: nn.Module, path) -> None:
    target = _target(model, Counter(1))
    meta = {"run_id": "run-a", "fingerprint": model_fingerprint(model, sharding={}), "metrics": {}}
    save_checkpoint(target, ckpt_dir=path, step=1, meta=meta, group=None)


def test_resume_into_a_tied_model_fails_before_loading(tmp_path):
    ckpt = tmp_path / "step_1"
    _save(llama(seed=0), ckpt)
    manifest = read_manifest(ckpt)
    assert (manifest["fingerprint"]["vocab_size"], manifest["fingerprint"]["tied_embeddings"]) == (64, False)
    model = llama(tied=True, seed=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    counter = Counter(0)
    target = _target(model, counter)
    with pytest.raises(CheckpointMismatchError, match=f"checkpoint {ckpt} does not fit this model; nothing was loaded"):
        load_checkpoint(target, ckpt, fingerprint=model_fingerprint(model, sharding={}), group=None)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items()) and counter.step == 0
    untied = llama(seed=1)  # the same settings load
    load_checkpoint(_target(untied, Counter(0)), ckpt, fingerprint=model_fingerprint(untied, sharding={}), group=None)
    assert torch.equal(untied.lm_head.weight, llama(seed=0).lm_head.weight)


def test_the_seal_and_the_shape_check_cover_the_fields(tmp_path):
    ckpt = tmp_path / "step_1"
    _save(llama(), ckpt)
    edited = json.loads((ckpt / MANIFEST).read_text())
    edited["fingerprint"]["tied_embeddings"] = True
    (ckpt / MANIFEST).write_text(json.dumps(edited))
    with pytest.raises(CheckpointCorruptError, match="fails its own checksum"):
        read_manifest(ckpt)
    for field, bad in (("tied_embeddings", "yes"), ("vocab_size", "64"), ("vocab_size", 0)):
        resealed = json.loads((ckpt / MANIFEST).read_text())
        resealed["fingerprint"] = {**resealed["fingerprint"], "tied_embeddings": False, "vocab_size": 64, field: bad}
        resealed[SEAL] = manifest_digest(resealed)
        (ckpt / MANIFEST).write_text(json.dumps(resealed))
        with pytest.raises(CheckpointCorruptError, match=f"malformed: `fingerprint` `{field}` must be"):
            read_manifest(ckpt)


# -- a Hugging Face folder's config.json -------------------------------------------------------------

def folder_config(tmp_path, config) -> dict:
    """config.json as transformers' save_pretrained writes it (defaults left out)."""
    config.save_pretrained(tmp_path)
    return json.loads((tmp_path / "config.json").read_text())


def test_folder_config_matches(tmp_path):
    saved = folder_config(tmp_path / "a", transformers.LlamaConfig(vocab_size=64, **SIZES))
    check_vocab_and_tie(hf_llama(vocab=64), saved)
    check_vocab_and_tie(llama(vocab=64), saved)
    tied = folder_config(tmp_path / "b", transformers.LlamaConfig(vocab_size=64, tie_word_embeddings=True, **SIZES))
    check_vocab_and_tie(hf_llama(vocab=64, tied=True), tied)


def test_folder_config_vocabulary_and_tie_differences(tmp_path):
    saved = folder_config(tmp_path / "a", transformers.LlamaConfig(vocab_size=64, **SIZES))
    with pytest.raises(ValueError, match=r"the model has vocab_size 72, the folder's config\.json 64: "
                                         r"set model\.hf_config\.vocab_size=64"):
        check_vocab_and_tie(hf_llama(vocab=72), saved)
    with pytest.raises(ValueError, match=r"vocab_size 56, the folder's config\.json 64"):
        check_vocab_and_tie(hf_llama(vocab=56), saved, grown_vocab_ok=True)  # only growing is allowed
    check_vocab_and_tie(hf_llama(vocab=72), saved, grown_vocab_ok=True)  # model.resize_to_tokenizer grew it
    with pytest.raises(ValueError, match=r"lm_head are tied \(one matrix\), the folder's config\.json has "
                                         r"tie_word_embeddings=false: set model\.hf_config\.tie_word_embeddings=false"):
        check_vocab_and_tie(hf_llama(vocab=64, tied=True), saved)


def test_folder_config_defaults_and_text_config(tmp_path):
    # a config.json without tie_word_embeddings: the model type's default (Gemma 3 ties, Llama does not)
    gemma = folder_config(tmp_path / "g", transformers.Gemma3TextConfig(vocab_size=64, **SIZES, head_dim=8))
    del gemma["tie_word_embeddings"]
    with pytest.raises(ValueError, match="tie_word_embeddings=true"):
        check_vocab_and_tie(hf_llama(vocab=64), gemma)
    # a multimodal config keeps the vocabulary in text_config; the model type may be unknown here
    nested = {"model_type": "not-a-model-type", "text_config": {"vocab_size": 64}, "tie_word_embeddings": False}
    check_vocab_and_tie(hf_llama(vocab=64, tied=True), gemma)
    plain = folder_config(tmp_path / "l", transformers.LlamaConfig(vocab_size=64, **SIZES))
    del plain["tie_word_embeddings"]
    with pytest.raises(ValueError, match="tie_word_embeddings=false"):
        check_vocab_and_tie(hf_llama(vocab=64, tied=True), plain)
    check_vocab_and_tie(hf_llama(vocab=64), nested)
    with pytest.raises(ValueError, match=r"vocab_size 72, the folder's config\.json 64"):
        check_vocab_and_tie(hf_llama(vocab=72), nested)
    mm_config = transformers.Gemma3Config(text_config={"vocab_size": 64, **SIZES, "head_dim": 8})
    mm = folder_config(tmp_path / "m", mm_config)
    with pytest.raises(ValueError, match=r"vocab_size 72, the folder's config\.json 64"):
        check_vocab_and_tie(hf_llama(vocab=72, tied=True), mm)
