"""Your own Hugging Face model, for every architecture in the matrix: tiny random folders written by
transformers' `save_pretrained` (bf16, tokenizer, generation config), trained on 2 gloo ranks from
`model=hf model.path=DIR` with nothing else about the model written down. Each one is compared with
transformers itself: step 1's loss with the loss transformers computes on the same batch, every
buffer with a model built by `from_pretrained`, the export with what `from_pretrained` loads. One
torchrun launch trains them all (tests/multirank/hf_matrix_worker.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import ROOT, torchrun  # noqa: E402
from hf_folders import ARCHITECTURES, make_folder  # noqa: E402

pytestmark = [pytest.mark.dist, pytest.mark.filterwarnings("ignore::UserWarning")]
ARCHS = list(ARCHITECTURES)
LORA = ["qwen2", "mixtral", "gpt2", "gemma3_text"]  # tied embeddings, MoE, Conv1D, Gemma's scaled embedding
LOSS_RTOL = 1e-5


@pytest.fixture(scope="module")
def folders(tmp_path_factory, hf_tokenizer_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf-folders")
    return {arch: make_folder(arch, root / arch, tokenizer_dir=hf_tokenizer_dir) for arch in ARCHS}


@pytest.fixture(scope="module")
def matrix(folders, tmp_path_factory) -> tuple[dict, Path]:
    work = tmp_path_factory.mktemp("hf-matrix")
    specs = [f"{a}={folders[a]}" for a in ARCHS] + [f"{a}+lora={folders[a]}" for a in LORA]
    torchrun(2, ROOT / "tests" / "multirank" / "hf_matrix_worker.py", str(work / "out.json"), str(work / "runs"),
             *specs, timeout=900)
    return json.loads((work / "out.json").read_text()), work / "runs"


@pytest.mark.parametrize("arch", ARCHS + [f"{a}+lora" for a in LORA])
def test_first_loss_is_transformers_own_and_resume_is_bitwise(matrix, arch):
    results = matrix[0][arch]
    first, reference = results["loss"][0], results["reference_loss"]
    assert abs(first - reference) / reference <= LOSS_RTOL, (first, reference)
    assert results["loss"][0] != results["loss"][2] and results["grad_norm"][0] > 0  # it trains
    assert [e["step"] for e in results["resume_events"]] == [2]  # the resumed run did resume, from step 2
    assert results["resumed"] == [[3, results["loss"][2], results["grad_norm"][2]]]  # bit for bit
    assert results["param_dtypes"] == ["torch.float32"]  # the folder is bf16: masters stay fp32
    assert results["mine_attn"] == results["attn"]  # transformers' own choice (Gemma 2: eager)


STATEFUL = {"falcon_h1": "FalconH1Mixer", "minimax": "MiniMaxLightningAttention"}  # Mamba; lightning attention


@pytest.mark.parametrize("arch", ARCHS)
def test_a_packed_sample_scores_each_document_as_transformers_does_alone(matrix, arch):
    """Three documents packed into one sample (positions restarting at 0), through fsdpkit's sharded
    forward: every token's loss equals transformers' forward of its document alone (1e-5, fp32), and
    the chunked loss sums them. Run together without positions (concat), the same tokens differ.
    Models whose layers carry state across tokens outside attention refuse packing, naming the layer."""
    results = matrix[0][arch]["packing"]
    if arch in STATEFUL:
        assert STATEFUL[arch] in results["refused"] and "data.packing=false" in results["refused"]
        return
    assert "refused" not in results, results
    packed, alone, concat = (torch.tensor(results[k]) for k in ("packed", "alone", "concat"))
    assert len(packed) == len(alone) == 21
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)
    if matrix[0][arch]["attn"] == "sdpa":  # and one document at a time, as packed runs attend with sdpa
        torch.testing.assert_close(torch.tensor(results["per_document"]), alone, rtol=1e-5, atol=1e-5)
    else:
        assert "per_document" not in results
    assert results["chunked_sum"] == pytest.approx(float(alone.sum()), rel=1e-5)
    first_doc = 5  # the first document has nothing before it; the others do, in one stream
    assert (concat[first_doc:] - alone[first_doc:]).abs().max() > 1e-3


@pytest.mark.parametrize("arch", ARCHS)
def test_every_buffer_equals_from_pretrained(matrix, arch):
    results = matrix[0][arch]
    assert results["buffers_extra"] == []
    assert all(results["buffers"].values()), {k: v for k, v in results["buffers"].items() if not v}


@pytest.mark.parametrize("arch", ARCHS)
def test_plain_export_loads_in_transformers_with_the_trained_logits(matrix, arch, tmp_path):
    import transformers

    from fsdpkit.export import export_checkpoint

    runs = matrix[1]
    export_checkpoint(runs / arch / "full" / "checkpoints", tmp_path / "out", dtype="fp32")
    model, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not any(info.values()), info
    batch = torch.load(runs / arch / "batch.pt")
    with torch.no_grad():
        logits = model.eval()(batch[:, :-1]).logits
    trained = torch.load(runs / arch / "trained_logits.pt")
    torch.testing.assert_close(logits, trained, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", LORA)
def test_lora_adapter_loads_in_peft_with_the_trained_logits(matrix, folders, arch, tmp_path):
    from peft import PeftModel

    from fsdpkit.export.adapter import export_adapter
    from hf_folders import reference_model

    runs = matrix[1] / f"{arch}+lora"
    export_adapter(runs / "full" / "checkpoints", tmp_path / "adapter")
    model = PeftModel.from_pretrained(reference_model(folders[arch]), tmp_path / "adapter").eval()
    batch = torch.load(runs / "batch.pt")
    with torch.no_grad():
        logits = model(batch[:, :-1]).logits
        base = reference_model(folders[arch])(batch[:, :-1]).logits
    trained = torch.load(runs / "trained_logits.pt")
    torch.testing.assert_close(logits, trained, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(base, trained, rtol=1e-5, atol=1e-5)  # the adapter changed the model


@pytest.mark.parametrize("arch", ["gpt2"])
def test_merged_lora_export_of_conv1d_equals_peft_merge(matrix, folders, arch, tmp_path):
    """GPT-2 keeps Conv1D weights [in, out]: the merged update is (B A) transposed, as peft merges it."""
    import transformers
    from peft import PeftModel

    from fsdpkit.export.adapter import export_adapter, export_merged
    from hf_folders import reference_model

    runs = matrix[1] / f"{arch}+lora"
    export_adapter(runs / "full" / "checkpoints", tmp_path / "adapter")
    export_merged(runs / "full" / "checkpoints", tmp_path / "merged", dtype="fp32")
    peft_merged = PeftModel.from_pretrained(reference_model(folders[arch]), tmp_path / "adapter").merge_and_unload()
    ours = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    for name, tensor in peft_merged.state_dict().items():
        torch.testing.assert_close(ours.state_dict()[name], tensor, rtol=1e-6, atol=1e-6, msg=name)
