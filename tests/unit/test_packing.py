"""Packing whole documents apart and the chunked loss, in one process: the bin packing's guarantees,
the overlong rules, fsdpkit's Llama document mask, the refusal of models that cannot keep documents
apart (by what they are made of, and by running them), and the chunked loss against PyTorch's own
cross-entropy of the full logits, values and gradients."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fsdpkit.data.packing import best_fit_decreasing, pieces  # noqa: E402
from fsdpkit.model.head import LogitTransform, check_against_model, output_head  # noqa: E402
from fsdpkit.model.llama import LlamaArgs, LlamaForCausalLM, document_mask  # noqa: E402
from fsdpkit.train.chunked_loss import chunk_rows, linear_cross_entropy  # noqa: E402

transformers = pytest.importorskip("transformers")


def long_tailed_lengths(n: int, *, seed: int = 0) -> np.ndarray:
    """Token counts shaped like chat corpora: median ~420, mean ~700-900, a long tail."""
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(420), 1.0, size=n).astype(np.int64), 2, 30_000)


def test_best_fit_decreasing_places_every_item_once_within_capacity_and_fills_the_bins():
    sizes = np.minimum(long_tailed_lengths(5000) - 1, 2048)
    offsets, items = best_fit_decreasing(sizes, capacity=2048)
    assert sorted(items.tolist()) == list(range(len(sizes)))
    loads = np.add.reduceat(sizes[items], offsets[:-1])
    assert loads.max() <= 2048 and loads.min() > 0
    assert sizes.sum() / (2048 * (len(offsets) - 1)) > 0.99  # a long-tailed corpus packs almost without padding
    again = best_fit_decreasing(sizes, capacity=2048)
    assert np.array_equal(again[0], offsets) and np.array_equal(again[1], items)  # deterministic
    # a known answer: 6 and 4 share a bin, 5 and 5 another, 3 is alone (capacity 10)
    offsets, items = best_fit_decreasing(np.array([3, 6, 5, 4, 5]), capacity=10)
    assert [sorted(items[a:b].tolist()) for a, b in zip(offsets, offsets[1:], strict=False)] == [[1, 3], [2, 4], [0]]
    with pytest.raises(ValueError, match=r"item sizes must lie in 1\.\.10"):
        best_fit_decreasing(np.array([11]), capacity=10)


def test_overlong_documents_are_truncated_dropped_or_split_into_windows():
    starts, lengths = np.array([0, 10, 12, 40]), np.array([10, 2, 28, 1])  # seq_len 8: windows of 9 tokens
    s, n, cut, dropped = pieces(starts, lengths, seq_len=8, overlong="truncate")
    assert (s.tolist(), n.tolist(), cut, dropped) == ([0, 10, 12], [9, 2, 9], 2, 0)  # the 1-token one: no target
    s, n, cut, dropped = pieces(starts, lengths, seq_len=8, overlong="drop")
    assert (s.tolist(), n.tolist(), cut, dropped) == ([10], [2], 0, 2)
    s, n, cut, dropped = pieces(starts, lengths, seq_len=8, overlong="split")
    # 10 tokens: targets 1..9 as [0, 9) and [8, 10); 28 tokens: [12, 21), [20, 29), [28, 37), [36, 40)
    assert (s.tolist(), n.tolist()) == ([0, 8, 10, 12, 20, 28, 36], [9, 2, 2, 9, 9, 9, 4])
    assert sum(k - 1 for k in n) == (10 - 1) + (2 - 1) + (28 - 1)  # every target once
    with pytest.raises(ValueError, match="data.overlong must be one of truncate, drop, split"):
        pieces(starts, lengths, seq_len=8, overlong="wrap")


def test_llamas_document_mask_is_causal_within_each_document():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0]])
    mask = document_mask(positions)[0, 0].int()
    assert mask.tolist() == [[1, 0, 0, 0, 0, 0],
                             [1, 1, 0, 0, 0, 0],
                             [1, 1, 1, 0, 0, 0],
                             [0, 0, 0, 1, 0, 0],
                             [0, 0, 0, 1, 1, 0],
                             [0, 0, 0, 0, 0, 1]]
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaArgs(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2)).eval()
    a, b = torch.randint(0, 64, (1, 5)), torch.randint(0, 64, (1, 7))
    with torch.no_grad():
        packed = model(torch.cat([a, b], 1), torch.cat([torch.arange(5), torch.arange(7)])[None])
        torch.testing.assert_close(packed[:, 5:], model(b), rtol=1e-5, atol=1e-5)
        assert (model(torch.cat([a, b], 1))[:, 5:] - model(b)).abs().max() > 1e-3  # without positions: one stream


def _meta(model_type: str, **kwargs) -> torch.nn.Module:
    config = transformers.AutoConfig.for_model(model_type, **kwargs)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def test_models_that_carry_state_across_tokens_outside_attention_refuse_packing():
    from fsdpkit.model.isolation import packing_refusal

    small = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2)
    for model_type, layer in [("falcon_h1", "FalconH1Mixer (a convolution over the sequence"),
                              ("qwen3_next", "Qwen3NextGatedDeltaNet"), ("jamba", "JambaMambaMixer"),
                              ("minimax", "MiniMaxLightningAttention")]:
        why = packing_refusal(_meta(model_type))
        assert why is not None and layer in why, (model_type, why)
        assert "data.packing=false" in why and "data.packing=concat" in why
    assert "takes no position_ids" in packing_refusal(_meta("bloom"))
    for model_type in ("llama", "gpt2", "gemma2", "mixtral"):  # GPT-2's Conv1D is a linear layer
        assert packing_refusal(_meta(model_type, **({} if model_type == "gpt2" else small))) is None, model_type


def test_a_model_that_ignores_the_positions_is_caught_by_running_it():
    from fsdpkit.model.isolation import check_isolation

    torch.manual_seed(0)
    opt = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(
        "opt", vocab_size=64, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
        word_embed_proj_dim=32))
    with pytest.raises(ValueError, match=r"OPTForCausalLM does not keep packed documents apart.*data\.packing=false"):
        check_isolation(opt, vocab_size=64, device=torch.device("cpu"))
    assert opt.training  # put back in training mode
    llama = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(
        "llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2))
    check_isolation(llama, vocab_size=64, device=torch.device("cpu"))
    check_isolation(llama.to(torch.bfloat16), vocab_size=64, device=torch.device("cpu"))


@pytest.mark.parametrize("transform", [LogitTransform(), LogitTransform(softcap=3.0),
                                       LogitTransform(scale=0.5, softcap=2.0), LogitTransform(divisor=4.0)])
def test_chunked_loss_equals_the_cross_entropy_of_the_full_logits(transform):
    torch.manual_seed(0)
    n, h, v = 37, 16, 101
    hidden = torch.randn(n, h, dtype=torch.float64, requires_grad=True)
    weight = (torch.randn(v, h, dtype=torch.float64) * 0.5).requires_grad_()
    bias = torch.randn(v, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, v, (n,))
    targets[::5] = -100
    full = F.cross_entropy(transform(F.linear(hidden, weight, bias)), targets, reduction="sum", ignore_index=-100)
    expected = torch.autograd.grad(3 * full, (hidden, weight, bias))
    chunked = linear_cross_entropy(hidden, weight, bias, targets, transform=transform, chunk_tokens=8)
    got = torch.autograd.grad(3 * chunked, (hidden, weight, bias))
    assert float(chunked.detach()) == pytest.approx(float(full), rel=1e-6)  # the loss in fp32, as transformers takes it
    for e, g in zip(expected, got, strict=True):
        torch.testing.assert_close(g.double(), e, rtol=1e-5, atol=1e-6)
    with torch.no_grad():  # evaluation: the same value, no gradient kept
        again = linear_cross_entropy(hidden, weight, bias, targets, transform=transform, chunk_tokens=8)
        assert float(again) == float(chunked.detach())
    assert chunk_rows(131_072) == 256 and chunk_rows(32_000) == 1048 and chunk_rows(512, 7) == 7


def test_the_chunked_loss_takes_the_architectures_logit_transform_and_refuses_one_it_gets_wrong():
    torch.manual_seed(0)
    gemma = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(
        "gemma2", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, final_logit_softcapping=0.5))
    head = output_head(gemma)
    assert head is not None and head.transform == LogitTransform(softcap=0.5)
    x = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        hidden = gemma.get_decoder()(x).last_hidden_state
        check_against_model(head, hidden, gemma(x, logits_to_keep=1).logits)
        wrong = type(head)(name=head.name, trunk=head.trunk, projection=head.projection, transform=LogitTransform())
        with pytest.raises(ValueError, match=r"Gemma2ForCausalLM computes its logits differently .*"
                                             r"train\.chunked_loss=false"):
            check_against_model(wrong, hidden, gemma(x, logits_to_keep=1).logits)


@pytest.mark.parametrize(("model_type", "window", "per_document_calls"), [
    ("llama", None, 2 * 6), ("mistral", 32, 0), ("mistral", 64, 2 * 6), ("gemma3_text", 32, 6), ("qwen3_moe", None, 12),
    ("gpt2", None, 12)])
def test_attention_one_document_at_a_time_equals_transformers_masked_attention(model_type, window, per_document_calls,
                                                                               monkeypatch):
    """The same packed sample through transformers' sdpa with its block-diagonal mask and through
    fsdpkit's per-document sdpa: equal logits and gradients (fp32). A sliding window shorter than a
    document keeps the mask in its layers (mistral at 32, gemma 3's sliding layer); one longer than
    every document does not. Counted: the calls of transformers' sdpa on one document."""
    from transformers.integrations import sdpa_attention

    from fsdpkit.model import logits
    from fsdpkit.model.document_attention import DOCUMENT_SDPA, use_document_attention
    from hf_folders import ARCHITECTURES

    torch.manual_seed(0)
    kwargs = dict(ARCHITECTURES[model_type], attn_implementation="sdpa")
    if window:
        kwargs["sliding_window"] = window
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(model_type, **kwargs))
    lengths = (17, 40, 9, 30)  # the 40-token document is longer than mistral's and gemma 3's window of 32
    x = torch.randint(0, 512, (2, sum(lengths)))
    positions = torch.cat([torch.arange(n) for n in lengths])[None].repeat(2, 1)
    positions[1] = torch.cat([torch.arange(50), torch.arange(sum(lengths) - 50)])  # rows differ

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        model.zero_grad()
        out = logits(model, x, positions=positions)
        out.square().mean().backward()
        return out.detach(), torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    masked, masked_grad = run()
    assert use_document_attention(model) and model.config._attn_implementation == DOCUMENT_SDPA
    calls = []
    sdpa = sdpa_attention.sdpa_attention_forward

    def counted(module, query, *args, **kwargs):
        calls.append(query.shape[2] < x.shape[1])
        return sdpa(module, query, *args, **kwargs)

    monkeypatch.setattr(sdpa_attention, "sdpa_attention_forward", counted)
    per_document, per_document_grad = run()
    # per layer that attends per document: 4 documents in row 0, 2 in row 1
    assert sum(calls) == per_document_calls, calls
    torch.testing.assert_close(per_document, masked, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(per_document_grad, masked_grad, rtol=1e-4, atol=1e-6)
    model.config._attn_implementation = "eager"
    assert not use_document_attention(model)  # only a model that uses sdpa
