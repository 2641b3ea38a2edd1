"""Checkpoint promises on real gloo ranks: exact and elastic resume, model-only loading, the
fingerprint check, and post-load verification (phases of ckpt_worker.py, run once per session)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import ROOT, torchrun  # noqa: E402

pytestmark = pytest.mark.dist
WORKER = ROOT / "tests" / "multirank" / "ckpt_worker.py"
FP32_RTOL, BF16_RTOL = 1e-6, 5e-4


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt")
    work = out / "work"
    results: dict = {}
    for phase, nproc in (("ws2", 2), ("ws4", 4), ("ws2b", 2), ("ws3", 3)):
        torchrun(nproc, WORKER, phase, str(out / f"{phase}.json"), str(work))
        results.update(json.loads((out / f"{phase}.json").read_text()))
    return results, work


def by_step(result: dict, key: str = "loss") -> dict[int, float]:
    return {r["step"]: r[key] for r in result["records"]}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_same_world_size_resume_is_bit_identical(ckpt, precision):
    res, _ = ckpt
    parts = res[f"{precision}_parts"]
    # killed after step 3 (mid-warmup: warmup is 6 steps), resumed, killed after 8, resumed again
    assert [p["start"] for p in parts] == [0, 3, 7]
    assert parts[1]["resumed_from"].endswith("step_3") and parts[2]["resumed_from"].endswith("step_7")
    for key in ("loss", "grad_norm"):
        resumed = {s: v for p in parts for s, v in by_step(p, key).items()}
        assert resumed == by_step(res[f"{precision}_full"], key)  # exact float equality, every step


def test_uneven_global_batch_resumes_bit_identically_at_the_same_world_size(ckpt):
    res, _ = ckpt
    parts = res["uneven_parts"]
    assert [p["start"] for p in parts] == [0, 3] and parts[1]["resumed_from"].endswith("step_3")
    for key in ("loss", "grad_norm"):
        resumed = {s: v for p in parts for s, v in by_step(p, key).items()}
        assert resumed == by_step(res["uneven_full"], key)  # exact float equality, every step
        assert sorted(resumed) == list(range(1, 7))


@pytest.mark.parametrize(("tag", "source"), [("2to4", 2), ("4to3", 4), ("2to3", 2), ("4to2", 4)])
def test_elastic_resume_restores_state_bitwise_and_continues(ckpt, tag, source):
    res, work = ckpt
    saved = torch.load(work / "dumps" / f"saved_ws{source}.pt")
    loaded = torch.load(work / "dumps" / f"loaded_{tag}.pt")
    assert saved.keys() == loaded.keys()
    assert saved["model.model.embed_tokens.weight"].shape[0] == 1001  # not divisible by 2, 3 or 4
    for key in saved:  # model params and AdamW exp_avg, exp_avg_sq, step
        assert torch.equal(saved[key], loaded[key]), key
    reference = by_step(res["full4"])
    resumed = by_step(res[tag])
    assert sorted(resumed) == list(range(7, 13))  # the same global sample sequence continues
    assert max(abs(v - reference[s]) / reference[s] for s, v in resumed.items()) < FP32_RTOL


@pytest.mark.parametrize(
    ("tag", "saved", "mesh", "first"),
    [("fs4_to_hsdp", "saved_ws4", [2, 2], 7),  # FULL_SHARD on 4 -> HSDP 2x2
     ("hsdp_to_fs3", "saved_ws4_hsdp", [3], 7),  # HSDP 2x2 -> FULL_SHARD on 3
     ("hsdp_to_noshard2", "saved_ws4_hsdp", [2, 1], 7),  # HSDP 2x2 -> NO_SHARD on 2 (which saves at step 9)
     ("noshard2_to_fs3", "saved_hsdp_to_noshard2", [3], 10)],  # ... and on to FULL_SHARD on 3
)
def test_resume_across_meshes_restores_state_bitwise_and_continues(ckpt, tag, saved, mesh, first):
    res, work = ckpt
    run = res[tag]
    assert run["mesh"] == mesh and run["start"] == first - 1
    saved_state = torch.load(work / "dumps" / f"{saved}.pt")
    loaded = torch.load(work / "dumps" / f"loaded_{tag}.pt")
    assert saved_state.keys() == loaded.keys() and any(k.endswith(".exp_avg_sq") for k in loaded)
    for key in saved_state:  # gathered model params and AdamW exp_avg, exp_avg_sq, step
        assert torch.equal(saved_state[key], loaded[key]), key
    reference, resumed = by_step(res["full4"]), by_step(run)
    assert sorted(resumed) == list(range(first, 10 if tag == "hsdp_to_noshard2" else 13))
    assert max(abs(v - reference[s]) / reference[s] for s, v in resumed.items()) < FP32_RTOL


def test_cross_mesh_sources_were_saved_under_their_meshes(ckpt):
    res, work = ckpt
    for ckpt_dir, mesh, world_size in (("src4_hsdp/checkpoints/step_6", [2, 2], 4),
                                       ("elastic_hsdp_to_noshard2/checkpoints/step_9", [2, 1], 2)):
        manifest = json.loads((work / ckpt_dir / "manifest.json").read_text())
        assert manifest["mesh"] == {"shape": mesh, "dim_names": ["replicate", "shard"]}
        assert manifest["world_size"] == world_size
    reference, hsdp = by_step(res["full4"]), by_step(res["src4_hsdp"])
    assert sorted(hsdp) == list(range(1, 7))
    assert max(abs(v - reference[s]) / reference[s] for s, v in hsdp.items()) < FP32_RTOL


def test_elastic_resume_bf16_within_tolerance(ckpt):
    res, _ = ckpt
    reference, resumed = by_step(res["bf16_full"]), by_step(res["2to4_bf16"])
    assert sorted(resumed) == list(range(7, 13))
    assert max(abs(v - reference[s]) / reference[s] for s, v in resumed.items()) < BF16_RTOL


def test_post_load_verification_ran_and_is_cheap(ckpt):
    res, _ = ckpt
    for tag in ("2to4", "4to3", "4to2"):
        assert res[tag]["verify_s"] is not None and res[tag]["verify_s"] < 1.0


def test_model_only_starts_optimizer_and_counters_at_zero(ckpt):
    res, _ = ckpt
    run = res["model_only"]
    assert run["resumed_from"].endswith("src2/checkpoints/step_6") and run["start"] == 0
    assert [r["step"] for r in run["records"]] == [1, 2]
    # the weights came from step 6: the first loss is far below a fresh model's ln(1001) ~ 6.9
    assert run["records"][0]["loss"] < by_step(res["fp32_full"])[1] - 0.2
    assert run["records"][0]["lr"] == by_step(res["fp32_full"], "lr")[1]  # the schedule restarted at step 0


def test_fingerprint_mismatch_fails_before_touching_state(ckpt):
    res, _ = ckpt
    err = res["mismatch_error"]
    assert err is not None and "does not fit this model" in err and "nothing was loaded" in err
    assert "changed: model.embed_tokens.weight: checkpoint [1001, 128] float32, model [1001, 64] float32" in err


def test_tie_and_vocabulary_changes_fail_before_touching_state(ckpt):
    res, _ = ckpt
    err = res["tie_mismatch_error"]
    assert err is not None and "nothing was loaded" in err
    assert ("the checkpoint's input embedding and lm_head are untied (two matrices), the model's tied (one matrix): "
            "set model.hf_config.tie_word_embeddings=false "
            "(model.tie_word_embeddings=false for model.kind=llama)") in err
    err = res["vocab_mismatch_error"]
    assert err is not None and "checkpoint vocab_size 1001, model 1000: set model.hf_config.vocab_size=1001" in err
    assert "changed: model.embed_tokens.weight" not in err  # the one setting, not a list of shapes


def test_full_state_dict_type_resumes_bitwise_and_elastically(ckpt):
    res, _ = ckpt
    assert res["full_type_files"] == ["manifest.json", "model.safetensors", "optimizer.safetensors", "rng.safetensors"]
    first, second = res["full_type_parts"]
    assert second["resumed_from"].endswith("full_type_resumed/checkpoints/step_6") and second["start"] == 6
    resumed = {**by_step(first), **by_step(second)}
    assert resumed == by_step(res["fp32_full"])  # bit-identical at the same world size
    reference, elastic = by_step(res["full4"]), by_step(res["2to4_full_type"])
    assert sorted(elastic) == list(range(7, 13))
    assert max(abs(v - reference[s]) / reference[s] for s, v in elastic.items()) < FP32_RTOL


def test_changed_activation_checkpointing_and_compile_load_with_notes(ckpt):
    res, _ = ckpt
    run = res["ac_compile"]
    assert run["start"] == 6
    notes = "\n".join(run["notes"])
    assert "activation_checkpointing changed: checkpoint [], now ['fsdpkit.model.llama.LlamaDecoderLayer']" in notes
    assert "compiled changed: checkpoint False, now True" in notes
    reference = by_step(res["fp32_full"])
    assert max(abs(v - reference[s]) / reference[s] for s, v in by_step(run).items()) < FP32_RTOL
