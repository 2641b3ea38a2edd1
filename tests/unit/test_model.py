"""The reference Llama: Hugging Face names, shapes and arithmetic; module layering."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from fsdpkit.config import compose_config
from fsdpkit.hf import build_model

SRC = Path(__file__).resolve().parents[2] / "src" / "fsdpkit"


@pytest.mark.parametrize("tied", [False, True])
def test_reference_llama_equals_transformers(tied):
    transformers = pytest.importorskip("transformers")
    m = compose_config([f"model.tie_word_embeddings={str(tied).lower()}"]).model
    ours = build_model(m)
    theirs = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
        num_hidden_layers=m.num_hidden_layers, num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_key_value_heads, rms_norm_eps=m.rms_norm_eps, tie_word_embeddings=tied))
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in theirs.state_dict().items()}
    theirs.load_state_dict(ours.state_dict())
    x = torch.randint(0, m.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(ours(x), theirs(x).logits, rtol=0, atol=1e-6)
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == tied


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [
        ("model", ("fsdpkit.parallel", "fsdpkit.train", "fsdpkit.checkpoint", "fsdpkit.cli", "fsdpkit.data")),
        ("data", ("fsdpkit.parallel", "fsdpkit.train", "fsdpkit.checkpoint", "fsdpkit.cli", "fsdpkit.model")),
        ("parallel", ("fsdpkit.train", "fsdpkit.checkpoint", "fsdpkit.cli")),
        ("config", ("fsdpkit.model", "fsdpkit.parallel", "fsdpkit.train", "fsdpkit.cli", "fsdpkit.data")),
        ("train", ("fsdpkit.cli",)),
        ("checkpoint", ("fsdpkit.train", "fsdpkit.cli", "fsdpkit.diagnostics")),
        ("diagnostics", ("fsdpkit.train", "fsdpkit.cli", "fsdpkit.checkpoint", "fsdpkit.export", "fsdpkit.parallel",
                         "fsdpkit.data")),
        ("export", ("fsdpkit.train", "fsdpkit.cli", "fsdpkit.diagnostics", "fsdpkit.parallel")),
    ],
)
def test_imports_point_one_way(package, forbidden):
    for path in (SRC / package).rglob("*.py"):
        bad = [m for m in _imports(path) if m.startswith(forbidden)]
        assert not bad, f"{path.relative_to(SRC)} imports {bad}"


def test_plot_command_imports_matplotlib_and_torch_lazily():
    assert not [m for m in _imports(SRC / "cli" / "plot.py") if m.startswith(("matplotlib", "torch"))]


def test_activation_checkpointing_is_exact_and_survives_a_deep_copy():
    """A checkpointed layer computes what it computed before (forward and gradients, bit for bit),
    and a deep copy of the model (an EMA, a teacher) recomputes its own layers, not the original's."""
    import copy

    from fsdpkit.parallel.fsdp import checkpoint_activations

    torch.manual_seed(0)
    cfg = compose_config(["model.vocab_size=64", "model.hidden_size=32", "model.intermediate_size=64"])
    model = build_model(cfg.model)
    x = torch.randint(0, 64, (2, 8))

    def run(m):
        m.zero_grad()
        out = m(x)
        out.square().mean().backward()
        return out.detach(), [p.grad.clone() for p in m.parameters()]

    before, grads = run(model)
    for layer in model.model.layers:
        checkpoint_activations(layer)
    after, grads_after = run(model)
    assert torch.equal(before, after) and all(map(torch.equal, grads, grads_after))

    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in model.model.layers.parameters():
            p.zero_()  # the original changes; the copy must not follow it
    assert torch.equal(twin(x), after)
