"""Export and import round trips on real checkpoints: train on 2 gloo ranks, export in one
process, load with transformers, and import into a model sharded over 3 ranks; logits must
match the fsdpkit model loaded from the checkpoint itself (phases of export_worker.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from export_worker import VARIANTS, fixed_batch, overrides  # noqa: E402

from conftest import ROOT, torchrun  # noqa: E402
from fsdpkit.checkpoint.safe_io import SafeFileSystemReader, SafeLoadPlanner  # noqa: E402
from fsdpkit.config import compose_config  # noqa: E402
from fsdpkit.export.exporter import export_checkpoint  # noqa: E402
from fsdpkit.hf import build_model  # noqa: E402
from fsdpkit.model import logits  # noqa: E402

pytestmark = [pytest.mark.dist, pytest.mark.filterwarnings("ignore::UserWarning")]
transformers = pytest.importorskip("transformers")
WORKER = ROOT / "tests" / "multirank" / "export_worker.py"
FP32_ATOL = 1e-5


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """Train every variant on 2 ranks; export each (fp32, bf16, and one in small shards); import
    the exports on 3 ranks."""
    work = tmp_path_factory.mktemp("export")
    torchrun(2, WORKER, "train", str(work))
    jobs = []
    for variant in VARIANTS:
        for tag, dtype in (("fp32", None), ("bf16", "bf16")):
            out = work / "exports" / f"{variant}_{tag}"
            report = export_checkpoint(work / variant / "checkpoints", out, dtype=dtype)
            (out.parent / f"{out.name}.report.json").write_text(json.dumps(report))
            jobs.append({"variant": variant, "tag": f"{variant}_{tag}", "path": str(out)})
    sharded = work / "exports" / "llama_sharded"
    report = export_checkpoint(work / "llama" / "checkpoints", sharded, max_shard_size="300KB")
    (sharded.parent / "llama_sharded.report.json").write_text(json.dumps(report))
    jobs.append({"variant": "llama", "tag": "llama_sharded", "path": str(sharded)})
    (work / "imports.json").write_text(json.dumps(jobs))
    torchrun(3, WORKER, "import", str(work))
    return work


def step_dir(work: Path, variant: str) -> Path:
    root = work / variant / "checkpoints"
    return root / (root / "latest").read_text().strip()


def fsdpkit_model(work: Path, variant: str) -> torch.nn.Module:
    """fsdpkit's own (unsharded) model with the checkpoint's weights, loaded through DCP."""
    model = build_model(compose_config(overrides(variant, work)).model)
    state = {"model": model.state_dict()}
    dcp.load(state, storage_reader=SafeFileSystemReader(step_dir(work, variant)), planner=SafeLoadPlanner(),
             no_dist=True)
    return model.eval()


@torch.no_grad()
def reference_logits(work: Path, variant: str, *, round_to: torch.dtype | None = None) -> torch.Tensor:
    model = fsdpkit_model(work, variant)
    if round_to is not None:
        for p in model.parameters():
            p.copy_(p.to(round_to).float())
    return logits(model, fixed_batch())


def hf_load(path: Path, **kwargs):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(path, output_loading_info=True, **kwargs)
    return model.eval(), info


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_transformers_loads_the_export_exactly(work, variant):
    out = work / "exports" / f"{variant}_fp32"
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    model, info = hf_load(out, dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    with torch.no_grad():
        theirs = model(fixed_batch()).logits
    torch.testing.assert_close(theirs, reference_logits(work, variant), rtol=0, atol=FP32_ATOL)
    tied = variant.endswith("_tied")
    with safe_open(out / "model.safetensors", framework="pt") as f:
        assert ("lm_head.weight" in f.keys()) == (not tied)  # a tied head is written once
    assert (model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()) == tied
    report = json.loads((out.parent / f"{out.name}.report.json").read_text())
    assert report["dropped"] == (["lm_head.weight (tied in the run config: the same tensor as "
                                  "model.embed_tokens.weight, written once, as transformers expects)"]
                                 if tied else [])
    assert report["dtypes"] == {"float32": report["num_tensors"]}
    assert "as stored in the checkpoint" in report["dtype_note"]


@pytest.mark.parametrize("variant", ["llama", "hf_tied"])
def test_bf16_export_matches_within_bf16_rounding(work, variant):
    out = work / "exports" / f"{variant}_bf16"
    report = json.loads((out.parent / f"{out.name}.report.json").read_text())
    assert report["dtypes"] == {"bfloat16": report["num_tensors"]}
    assert report["source_dtypes"] == {"float32": report["num_tensors"]}
    assert "wrote bfloat16, converted from the checkpoint's float32 (the run's master weights" in report["dtype_note"]
    auto, _ = hf_load(out, dtype="auto")
    assert auto.dtype == torch.bfloat16  # config.json names the dtype written
    model, info = hf_load(out, dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    with torch.no_grad():
        theirs = model(fixed_batch()).logits
    # exactly the fp32 model with its weights rounded to bf16 ...
    torch.testing.assert_close(theirs, reference_logits(work, variant, round_to=torch.bfloat16), rtol=0, atol=FP32_ATOL)
    # ... and within bf16 rounding of the fp32 model
    torch.testing.assert_close(theirs, reference_logits(work, variant), rtol=0, atol=2e-2)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_exported_tensors_equal_dcp_to_torch_save_bitwise(work, variant, tmp_path):
    dcp_to_torch_save(step_dir(work, variant), tmp_path / "full.pt")
    reference = torch.load(tmp_path / "full.pt", weights_only=True)["model"]
    exported = load_file(work / "exports" / f"{variant}_fp32" / "model.safetensors")
    expected_keys = set(reference) - ({"lm_head.weight"} if variant.endswith("_tied") else set())
    assert set(exported) == expected_keys
    for key, value in exported.items():
        assert value.dtype == reference[key].dtype and torch.equal(value, reference[key]), key
    bf16 = load_file(work / "exports" / f"{variant}_bf16" / "model.safetensors")
    for key, value in bf16.items():
        assert torch.equal(value, reference[key].to(torch.bfloat16)), key


def test_multi_shard_export_has_a_valid_index_that_transformers_loads(work):
    out = work / "exports" / "llama_sharded"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) >= 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert sorted(set(index["weight_map"].values())) == shards
    sizes, names = 0, set()
    for shard in shards:
        with safe_open(out / shard, framework="pt") as f:
            for key in f.keys():
                t = f.get_tensor(key)
                sizes += t.numel() * t.element_size()
                names.add(key)
                assert index["weight_map"][key] == shard
        assert (out / shard).stat().st_size <= 300_000 + 1024 or len(index["weight_map"]) == 1
    assert names == set(index["weight_map"]) and index["metadata"]["total_size"] == sizes
    model, info = hf_load(out, dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    with torch.no_grad():
        torch.testing.assert_close(model(fixed_batch()).logits, reference_logits(work, "llama"), rtol=0, atol=FP32_ATOL)


@pytest.mark.parametrize("tag", [*(f"{v}_fp32" for v in VARIANTS), "llama_bf16", "llama_sharded"])
def test_import_on_3_ranks_reproduces_the_logits(work, tag):
    variant = tag.rsplit("_", 1)[0]
    imported = torch.load(work / "imported" / f"{tag}.pt", weights_only=True)
    expected = reference_logits(work, variant, round_to=torch.bfloat16 if tag.endswith("bf16") else None)
    torch.testing.assert_close(imported, expected, rtol=0, atol=FP32_ATOL)
    reports = json.loads((work / "imported" / f"{tag}.json").read_text())
    # every tensor loaded (a missing or unexpected one raises), none through a converter
    assert len(reports) == 3 and all(r["loaded"] == reports[0]["loaded"] > 0 and not r["converted"] for r in reports)
    total = json.loads((work / "exports" / f"{tag}.report.json").read_text())["total_size"]
    # every rank read only its own slices: together exactly the file's tensors, each a third or so
    assert sum(r["bytes_read"] for r in reports) == total
    assert max(r["bytes_read"] for r in reports) < 0.4 * total
    if tag.endswith("bf16"):
        assert reports[0]["conversions"] == {"bfloat16->float32": reports[0]["loaded"] - variant.endswith("_tied")}
