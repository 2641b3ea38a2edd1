"""Tiny random Hugging Face model folders, written the way the hub's are: transformers' own
`save_pretrained` with bf16 weights (`config.json` says `"dtype": "bfloat16"`), a fast tokenizer
with a chat template, and a `generation_config.json` of non-default values.

Nothing here goes through fsdpkit: the folders are the independent input of the model tests.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

VOCAB = 512  # the example tokenizer's size (tests/conftest.py hf_tokenizer_dir)
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, bos_token_id=0, eos_token_id=0, pad_token_id=1)
_IDS = dict(bos_token_id=0, eos_token_id=0, pad_token_id=1)  # the tokenizer's <|endoftext|> and <|pad|>

# model_type -> config kwargs. Every entry is a different code path in transformers (norms, RoPE
# variants, attention, MoE, Conv1D, tied embeddings, legacy names on disk).
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "llama": dict(_COMMON, rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False),
    "qwen2": dict(_COMMON, tie_word_embeddings=True),
    "qwen3": dict(_COMMON, head_dim=16, tie_word_embeddings=False),
    "mistral": dict(_COMMON, sliding_window=32, tie_word_embeddings=False),
    "gemma2": dict(_COMMON, head_dim=16, query_pre_attn_scalar=16, sliding_window=32,
                   final_logit_softcapping=30.0, attn_logit_softcapping=50.0),
    "gemma3_text": dict(_COMMON, head_dim=16, query_pre_attn_scalar=16, sliding_window=32, sliding_window_pattern=2,
                        layer_types=["sliding_attention", "full_attention"]),
    "phi3": dict(_COMMON, tie_word_embeddings=False),
    # GPT-2's dropout is off here: the loss of a training-mode forward with dropout is random.
    "gpt2": dict(_IDS, vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256, resid_pdrop=0.0,
                 embd_pdrop=0.0, attn_pdrop=0.0),
    "mixtral": dict(_COMMON, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False),
    "qwen3_moe": dict(_COMMON, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                      decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False),
    # Mamba-2 + attention hybrid: FalconH1Model's own init hook sets every layer's mup_vector buffer,
    # and config.json holds an infinite time_step_limit (written by transformers as a tagged object)
    "falcon_h1": dict(_COMMON, head_dim=16, mamba_d_ssm=64, mamba_n_heads=8, mamba_d_head=8, mamba_d_state=16,
                      mamba_chunk_size=32, tie_word_embeddings=False),
    # lightning (linear) attention in layer 1: its decay tables are persistent buffers, in the file
    "minimax": dict(_COMMON, head_dim=16, num_local_experts=4, num_experts_per_tok=2, block_size=16,
                    layer_types=["full_attention", "linear_attention"], tie_word_embeddings=False),
    "gpt_neox": dict(_IDS, vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                     num_attention_heads=4, max_position_embeddings=256, tie_word_embeddings=False),
}
GENERATION = {"temperature": 0.6, "top_p": 0.9, "do_sample": True, "max_new_tokens": 17}


def make_folder(model_type: str, out: Path, *, tokenizer_dir: Path | None = None, seed: int = 0) -> Path:
    """Write a random `model_type` model of ARCHITECTURES' size to `out` as a hub folder (bf16)."""
    import transformers

    config = transformers.AutoConfig.for_model(model_type, **ARCHITECTURES[model_type])
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _perturb_constant_params(model, seed=seed)
    model.to(torch.bfloat16).save_pretrained(out)
    gen = json.loads((out / "generation_config.json").read_text()) if (out / "generation_config.json").exists() else {}
    (out / "generation_config.json").write_text(json.dumps({**gen, **GENERATION}, indent=2))
    if tokenizer_dir is not None:
        transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True).save_pretrained(out)
    return out


@torch.no_grad()
def _perturb_constant_params(model: torch.nn.Module, *, seed: int) -> None:
    """Norm weights and biases start constant (ones, zeros): give them random values, so that a
    loader that leaves one at its init value, or swaps two, is caught."""
    g = torch.Generator().manual_seed(seed + 1)
    for _, p in model.named_parameters():
        if p.ndim == 1:
            p.add_(torch.randn(p.shape, generator=g) * 0.1)


def reference_model(folder: Path, **kwargs: Any) -> torch.nn.Module:
    """transformers' own model of `folder` in fp32 (the reference every fsdpkit result is compared with)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, **kwargs)
    return model.eval() if isinstance(model, torch.nn.Module) else (model[0].eval(), *model[1:])
