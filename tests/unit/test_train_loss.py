"""The training objective of MoE models: fsdpkit's loss pieces, combined as Trainer.train_step
combines them, against transformers' own `loss` and `aux_loss` of the same model."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fsdpkit.data.datasets import Batch
from fsdpkit.model.llama import LlamaArgs, LlamaForCausalLM
from fsdpkit.train.loss import IGNORE_INDEX, masked_loss_terms, router_aux_loss_coef

transformers = pytest.importorskip("transformers")

COEF = 0.02
VOCAB = 64


def tiny_mixtral(*, output_router_logits: bool, coef: float = COEF) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        output_router_logits=output_router_logits, router_aux_loss_coef=coef)
    return transformers.MixtralForCausalLM(config).eval()


def as_targets(labels: torch.Tensor) -> torch.Tensor:
    """transformers' labels [B, T] (shifted inside its loss) -> fsdpkit's targets [B, T] for inputs [B, T]."""
    return torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE_INDEX)], dim=1)


def batch(seed: int, rows: int = 2, length: int = 9) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, length), generator=torch.Generator().manual_seed(seed))


def test_one_micro_batch_equals_transformers_loss_with_the_aux_term():
    model = tiny_mixtral(output_router_logits=True)
    x = batch(1)
    labels = x.clone()
    labels[0, 3:6] = IGNORE_INDEX  # masked targets count in neither the CE nor the token weight
    with torch.no_grad():
        ref = model(input_ids=x, labels=labels)
        terms = masked_loss_terms(model, Batch(x, as_targets(labels)))
    assert int(terms.tokens) == 2 * 8 - 3
    assert float(terms.aux) == pytest.approx(float(ref.aux_loss), rel=1e-6)
    assert terms.aux_coef == COEF
    # one micro-batch on one rank: the trainer divides by the batch's trained targets
    assert float(terms.objective_sum() / terms.tokens) == pytest.approx(float(ref.loss), rel=1e-6)
    # the aux term is big enough here that leaving it out would fail the comparison above
    assert abs(float(terms.ce_sum / terms.tokens) - float(ref.loss)) > 1e-3
    # and `loss` the trainer reports stays the cross-entropy: transformers' loss minus its aux term
    assert float(terms.ce_sum / terms.tokens) == pytest.approx(float(ref.loss) - COEF * float(ref.aux_loss), rel=1e-6)


def test_gradients_equal_transformers_loss_gradients():
    model = tiny_mixtral(output_router_logits=True)
    x = batch(2)
    model(input_ids=x, labels=x).loss.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    terms = masked_loss_terms(model, Batch(x, as_targets(x)))
    (terms.objective_sum() / terms.tokens).backward()
    router = "model.layers.0.mlp.gate.weight"
    assert router in ref and ref[router].abs().max() > 0
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[name], rtol=1e-5, atol=1e-7, msg=name)


def test_micro_batches_add_the_aux_term_weighted_by_their_trained_targets():
    model = tiny_mixtral(output_router_logits=True)
    xs = [batch(3), batch(4, rows=1)]
    labels = [x.clone() for x in xs]
    labels[1][0, :5] = IGNORE_INDEX
    with torch.no_grad():
        # transformers' pieces of each micro-batch: its mean CE (aux off for this call) and its aux_loss
        ce = [float(model(input_ids=x, labels=y, output_router_logits=False).loss) for x, y in zip(xs, labels,
                                                                                                   strict=True)]
        aux = [float(model(input_ids=x).aux_loss) for x in xs]
        terms = [masked_loss_terms(model, Batch(x, as_targets(y))) for x, y in zip(xs, labels, strict=True)]
    n = [16, 4]  # trained targets: 2 rows x 8, and 1 row x 8 with labels 1-4 masked (label 0 is no target)
    assert [int(t.tokens) for t in terms] == n
    expected = sum((c + COEF * a) * k for c, a, k in zip(ce, aux, n, strict=True)) / sum(n)
    global_tokens = sum(n)  # as Trainer.train_step: each micro-batch's sum over the global count
    got = sum(float(t.objective_sum()) for t in terms) / global_tokens
    assert got == pytest.approx(expected, rel=1e-6)


def test_no_aux_term_when_output_router_logits_is_off():
    model = tiny_mixtral(output_router_logits=False)
    x = batch(5)
    assert router_aux_loss_coef(model) is None
    with torch.no_grad():
        ref = model(input_ids=x, labels=x)
        terms = masked_loss_terms(model, Batch(x, as_targets(x)))
    assert ref.aux_loss is None and terms.aux is None
    assert terms.objective_sum() is terms.ce_sum
    assert float(terms.ce_sum / terms.tokens) == pytest.approx(float(ref.loss), rel=1e-6)


def test_models_without_routers_have_no_aux_term():
    llama = LlamaForCausalLM(LlamaArgs(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=4, num_key_value_heads=2))
    hf_llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2))
    assert router_aux_loss_coef(llama) is None and router_aux_loss_coef(hf_llama) is None
    x = batch(6)
    with torch.no_grad():
        ref = float(hf_llama(input_ids=x, labels=x).loss)
        # the summed CE of 16 trained targets, chunked and from the full logits
        for chunk in (0, 3, None):
            terms = masked_loss_terms(hf_llama, Batch(x, as_targets(x)), chunk_tokens=chunk)
            assert float(terms.ce_sum) / 16 == pytest.approx(ref, rel=1e-6) and terms.aux is None


class ConfiguredLinear(torch.nn.Module):
    """A model whose config asks for a router aux loss that its forward (logits only) never returns."""

    def __init__(self, **config):
        super().__init__()
        self.config = SimpleNamespace(**config)
        self.head = torch.nn.Embedding(VOCAB, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(input_ids)


def test_aux_loss_coefficient_from_the_config_and_its_errors():
    assert router_aux_loss_coef(tiny_mixtral(output_router_logits=True, coef=0.5)) == 0.5
    with pytest.raises(ValueError, match=r"no router_aux_loss_coef.*model\.hf_config\.router_aux_loss_coef"):
        router_aux_loss_coef(ConfiguredLinear(output_router_logits=True))
    assert router_aux_loss_coef(ConfiguredLinear(output_router_logits=False)) is None
    x = batch(7)
    with pytest.raises(ValueError, match=r"returned no aux_loss.*model\.hf_config\.output_router_logits=false"):
        masked_loss_terms(ConfiguredLinear(output_router_logits=True, router_aux_loss_coef=0.1),
                          Batch(x, as_targets(x)))


def test_the_training_forward_builds_no_kv_cache(monkeypatch):
    """transformers configs default to use_cache=True, which builds a KV cache in every forward, training
    included (under activation checkpointing + torch.compile the recompute then failed checkpoint's metadata
    check). fsdpkit's forward turns it off; the logits stay transformers' own."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(config).train()
    assert model.config.use_cache
    built = []
    init = transformers.DynamicCache.__init__

    def counted(self, *args, **kwargs):
        built.append(1)
        init(self, *args, **kwargs)

    monkeypatch.setattr(transformers.DynamicCache, "__init__", counted)
    x = batch(3)
    reference = model(x).logits
    assert len(built) == 1  # the probe sees transformers' own cache
    from fsdpkit.model import forward, logits

    assert forward(model, x).past_key_values is None
    terms = masked_loss_terms(model, Batch(x[:, :-1], x[:, 1:]))
    assert torch.equal(logits(model, x), reference) and len(built) == 1
    assert float(terms.ce_sum.detach()) > 0
