"""A reference Llama decoder (RMSNorm, RoPE, SwiGLU, GQA, optional tied embeddings).

Plain single-device nn.Modules with no distributed code. Parameter names and shapes are
exactly those of Hugging Face `LlamaForCausalLM` (`model.embed_tokens.weight`,
`model.layers.{i}.self_attn.q_proj.weight`, ..., `lm_head.weight`), and the arithmetic follows
it op for op, so a checkpoint exports to transformers unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LlamaArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


class LlamaRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class LlamaRotaryEmbedding(nn.Module):
    """RoPE tables. `inv_freq` is a non-persistent buffer: after materialising the model from
    the meta device it holds garbage until `reset_inv_freq` runs (apply_fsdp calls it)."""

    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.head_dim, self.theta = args.head_dim, args.rope_theta
        self.register_buffer("inv_freq", self._inv_freq(torch.device("cpu")), persistent=False)

    def _inv_freq(self, device: torch.device) -> torch.Tensor:
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float, device=device) / self.head_dim
        return 1.0 / (self.theta**exponents)

    @torch.no_grad()
    def reset_inv_freq(self) -> None:
        self.inv_freq.copy_(self._inv_freq(self.inv_freq.device))

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.float()  # [B, T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [B, T, D]
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, H, T, D]; cos/sin: [B, T, D]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + _rotate_half(x) * sin


class LlamaAttention(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        d, h, kv = args.head_dim, args.num_attention_heads, args.num_key_value_heads
        self.num_heads, self.num_kv_heads, self.head_dim = h, kv, d
        self.q_proj = nn.Linear(args.hidden_size, h * d, bias=False)
        self.k_proj = nn.Linear(args.hidden_size, kv * d, bias=False)
        self.v_proj = nn.Linear(args.hidden_size, kv * d, bias=False)
        self.o_proj = nn.Linear(h * d, args.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)  # [B, H, T, D]
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [B, KV, T, D]
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
        groups = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, H, T, D]
        else:  # causal within each document (document_mask)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class LlamaMLP(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.self_attn = LlamaAttention(args)
        self.mlp = LlamaMLP(args)
        self.input_layernorm = LlamaRMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


def document_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """position_ids [B, T] -> boolean attention mask [B, 1, T, T]: query i attends to key j when
    j <= i and both lie in the same document. A document starts wherever the position does not
    step by one (as transformers' find_packed_sequence_indices reads packed positions)."""
    step = torch.diff(position_ids, dim=-1, prepend=position_ids[:, :1] - 1)
    doc = (step != 1).cumsum(-1)  # [B, T] document index of each token
    t = position_ids.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool, device=position_ids.device).tril()
    return (doc[:, :, None] == doc[:, None, :]).logical_and_(causal)[:, None]


class LlamaModel(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(args) for _ in range(args.num_hidden_layers))
        self.norm = LlamaRMSNorm(args.hidden_size, args.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(args)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [B, T] -> normed hidden states [B, T, hidden]. position_ids [B, T] that restart
        at 0 start a new document there, which attends only to itself (document_mask)."""
        x = self.embed_tokens(input_ids)  # [B, T, hidden]
        mask = None
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand(input_ids.shape[0], -1)
        else:
            mask = document_mask(position_ids)
        cos, sin = self.rotary_emb(x, position_ids)
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    _no_split_modules = ("LlamaDecoderLayer",)  # what policy `auto` wraps, as for transformers models

    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.args = args
        self.model = LlamaModel(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                logits_to_keep: int = 0) -> torch.Tensor:
        """input_ids [B, T] -> logits [B, T, vocab] (of the last `logits_to_keep` positions only, when
        it is not 0, as transformers' argument of that name)."""
        hidden = self.model(input_ids, position_ids)
        return self.lm_head(hidden[:, -logits_to_keep:] if logits_to_keep else hidden)

    def get_input_embeddings(self) -> nn.Embedding:
        """The token embedding, asked for as transformers models are (fsdpkit.checkpoint.embeddings)."""
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Linear:
        """The vocabulary projection, asked for as transformers models are."""
        return self.lm_head

    def reset_nonpersistent_buffers(self) -> None:
        self.model.rotary_emb.reset_inv_freq()
