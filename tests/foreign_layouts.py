"""Checkpoints in other tools' on-disk layouts, written with plain `dcp.save` (one process) from a
tiny transformers Llama, mirroring what each tool writes (read from their sources, versions noted):

- nested:     {"model": ..., "optim": ...} of a torch.compile'd model (`_orig_mod.` in every name)
- flat:       torchtitan: the model's keys at the top level beside "optimizer", "lr_scheduler",
              "train_state", in <dump>/checkpoint/step-<N>/
- accelerate: Accelerate 1.15 `save_state` with automatic_checkpoint_naming:
              <project>/checkpoints/checkpoint_<i>/pytorch_model_fsdp_0/ ({"model": ...}),
              optimizer_0/ ({"optimizer": ...}), random_states_0.pkl, scheduler.bin
              (accelerate/utils/fsdp_utils.py save_fsdp_model/save_fsdp_optimizer)
- lightning:  Lightning 2.6 ModelParallelStrategy with `self.model = <HF model>`:
              lightning_logs/version_0/checkpoints/epoch=0-step=<N>.ckpt/ holding
              {"state_dict": LightningModule state dict (`model.` prefix), "optimizer_0": ...} and a
              pickled meta.pt (lightning/pytorch/strategies/model_parallel.py save_checkpoint)
"""

from __future__ import annotations

import pickle
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

LAYOUTS = ("nested", "flat", "accelerate", "lightning")


class Tripwire:
    """Unpickling it writes a file: a checkpoint's pickles must never be loaded by the tools."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "unpickled"))


class LitModule(nn.Module):
    """What a LightningModule's state dict looks like: the HF model held as `self.model`."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model


def tiny_llama(*, tied: bool, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                         tie_word_embeddings=tied)
    return LlamaForCausalLM(config)


def trained(model: nn.Module) -> torch.optim.Optimizer:
    """One AdamW step, so that weights move away from init and the optimizer has state."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.arange(16).reshape(2, 8) % 128
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
    return opt


def save_config(model: LlamaForCausalLM, folder: Path) -> Path:
    """The model's Hugging Face folder without weights: config.json + generation_config.json."""
    model.config.save_pretrained(folder)
    GenerationConfig(max_new_tokens=7, do_sample=False).save_pretrained(folder)
    return folder


def write_layout(layout: str, model: LlamaForCausalLM, opt: torch.optim.Optimizer, root: Path, *,
                 tripwire: Path) -> Path:
    """Write `model` in `layout` under `root`; returns the path a user would hand to the tools."""
    if layout == "nested":
        compiled = nn.Module()
        compiled._orig_mod = model  # what torch.compile's OptimizedModule holds; its state_dict keys
        state = {"model": compiled.state_dict(), "optim": get_optimizer_state_dict(model, opt)}
        dcp.save(state, checkpoint_id=root / "ckpt", no_dist=True)
        return root / "ckpt"
    if layout == "flat":
        for step in (1, 3):  # two step directories: the newest is picked
            state = {**get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, opt),
                     "lr_scheduler": {"last_epoch": step}, "train_state": {"step": torch.tensor(step)}}
            dcp.save(state, checkpoint_id=root / "dump" / "checkpoint" / f"step-{step}", no_dist=True)
        return root / "dump" / "checkpoint"
    if layout == "accelerate":
        folder = root / "project" / "checkpoints" / "checkpoint_0"
        dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=folder / "pytorch_model_fsdp_0", no_dist=True)
        dcp.save({"optimizer": get_optimizer_state_dict(model, opt)}, checkpoint_id=folder / "optimizer_0",
                 no_dist=True)
        (folder / "random_states_0.pkl").write_bytes(pickle.dumps(Tripwire(tripwire)))
        (folder / "scheduler.bin").write_bytes(pickle.dumps(Tripwire(tripwire)))
        return folder
    if layout == "lightning":
        lit = LitModule(model)
        ckpts = root / "lightning_logs" / "version_0" / "checkpoints"
        for step in (2, 4):
            path = ckpts / f"epoch=0-step={step}.ckpt"
            dcp.save({"state_dict": get_model_state_dict(lit), "optimizer_0": get_optimizer_state_dict(lit, opt)},
                     checkpoint_id=path, no_dist=True)
            (path / "meta.pt").write_bytes(pickle.dumps(Tripwire(tripwire)))
        return ckpts
    raise ValueError(layout)
