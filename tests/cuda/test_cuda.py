"""The paths only a GPU node takes: NCCL, bf16 on CUDA, the pinned staging buffer of an async save,
CUDA's RNG across a resume, CPU offload with pinned memory, torch.compile with Triton kernels,
checkpoints moved between CPU and GPU hosts, and the library examples on CUDA.

One GPU is enough (every run here is one rank: NCCL, like CUDA, cannot share a device between
ranks). Without CUDA every test is skipped, with the reason in pytest's summary (`-ra`); CI has no
GPU, so these run where one is lent: `pytest tests/cuda -ra` (or `make test-cuda`).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import ROOT, fsdpkit, torchrun  # noqa: E402
from faults import env as faults_env  # noqa: E402
from faults import fired, skip_restore  # noqa: E402
from fsdpkit.checkpoint.io import safe_reader  # noqa: E402
from fsdpkit.cli.main import main  # noqa: E402
from fsdpkit.cli.resume_check import resume_check  # noqa: E402
from fsdpkit.train.metrics import read_records  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
CUDA = ["device=cuda", "backend=nccl"]
SMALL = ["train.global_batch_size=8", "train.micro_batch_size=4", "train.eval_every=0"]
LORA = ["experiment=hf_llama", "model.peft.method=lora", "model.peft.r=4", "model.peft.alpha=8",
        "model.peft.target_modules=[q_proj,v_proj,down_proj]"]


def resume_events(run: Path) -> list[tuple[int, int]]:
    return [(e["step"], e["saved_world_size"]) for e in read_records(run, events=True) if e["event"] == "resume"]


def saved_keys(ckpt: Path) -> set[str]:
    return set(safe_reader(ckpt).read_metadata().state_dict_metadata)


def test_bf16_async_save_on_nccl_resumes_bitwise_and_exports_bf16(tmp_path):
    """bf16-mixed on one GPU under NCCL, saving asynchronously through the pinned staging buffer:
    the resumed run repeats every loss and grad norm bit for bit; the checkpoint holds CUDA's RNG;
    the bf16 export is the fp32 export rounded, under the model's own names."""
    proc = fsdpkit("resume-check", "--nproc", "1", "--steps", "8", "--save-at", "4", "experiment=demo", *CUDA, *SMALL,
                   "policy.mixed_precision=bf16-mixed", "checkpoint.async_save=true", "--work-dir", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "PASS: worst relative difference 0.000e+00, tolerance 0e+00" in proc.stdout
    assert resume_events(tmp_path / "resumed") == [(4, 1)]
    steps = read_records(tmp_path / "uninterrupted")
    assert [r["step"] for r in steps] == list(range(1, 9))
    assert all(math.isfinite(r["loss"]) and r["peak_mem_mib"] > 0 for r in steps)
    run = tmp_path / "resumed"  # saved step 4 and stopped; then resumed from it
    saves = [(e["step"], e["mode"]) for e in read_records(run, events=True) if e["event"] == "checkpoint"]
    assert saves == [(4, "async")], saves
    ckpt = run / "checkpoints" / "step_4"
    assert {"rng.rank0.torch_cuda", "rng.rank0.torch_cpu"} <= saved_keys(ckpt)

    for dtype in ("bf16", "fp32"):
        assert main(["ckpt", "export", str(ckpt), str(tmp_path / dtype), "--dtype", dtype]) == 0
    low, high = (load_file(tmp_path / d / "model.safetensors") for d in ("bf16", "fp32"))
    assert low.keys() == high.keys() and not any(k.startswith(("_orig_mod", "module.", "_fsdp")) for k in low)
    assert "model.embed_tokens.weight" in low
    for name, t in low.items():
        assert t.dtype == torch.bfloat16 and high[name].dtype == torch.float32, name
        assert torch.equal(t, high[name].to(torch.bfloat16)), name


def test_async_staging_buffer_is_pinned_reused_and_exact():
    """The async save's stall is a device-to-host copy into pinned memory, allocated once."""
    from fsdpkit.checkpoint.async_save import AsyncSaver

    state = {"w": torch.randn(1000, 33, device="cuda"), "b": torch.randn(7, device="cuda", dtype=torch.bfloat16),
             "nested": [torch.arange(5, device="cuda")], "step": 3}
    saver = AsyncSaver(group=None)
    try:
        staged = saver._stage(state)
        assert all(t.device.type == "cpu" and t.is_pinned() for t in (staged["w"], staged["b"], staged["nested"][0]))
        assert staged["step"] == 3 and torch.equal(staged["nested"][0], state["nested"][0].cpu())
        state["w"].add_(1.0)
        again = saver._stage(state)
        assert again["w"].data_ptr() == staged["w"].data_ptr()  # the same buffer, refilled
        assert torch.equal(again["w"], state["w"].cpu()) and torch.equal(again["b"], state["b"].cpu())
    finally:
        saver.close()


def test_lora_dropout_on_cuda_continues_the_saved_rng_stream(tmp_path, monkeypatch):
    """LoRA dropout draws from CUDA's generator: the resume is bitwise only if that generator's
    state was saved and restored. Left unrestored (injected: tests/faults), the same check fails."""
    args = [*LORA, "model.peft.dropout=0.2", *CUDA, *SMALL, "deterministic=true", "data.seq_len=32"]
    assert resume_check(overrides=args, nproc=1, resume_nproc=1, steps=6, save_at=3, work_dir=tmp_path / "kept") == 0
    assert resume_events(tmp_path / "kept" / "resumed") == [(3, 1)]

    marker = tmp_path / "faults.jsonl"

    def drop_rng(run: Path) -> None:  # the resumed run is an `fsdpkit train` launch: it inherits os.environ
        for key, value in faults_env(skip_restore("rng"), marker=marker).items():
            monkeypatch.setenv(key, value)

    code = resume_check(overrides=args, nproc=1, resume_nproc=1, steps=6, save_at=3, work_dir=tmp_path / "dropped",
                        before_resume=drop_rng)
    assert [(f["name"], f["rank"]) for f in fired(marker)] == [("rng", 0)]  # the RNG restore was skipped, once
    assert code == 1
    assert resume_events(tmp_path / "dropped" / "resumed") == [(3, 1)]  # it resumed: only the RNG differs


def cpu_host(*args: str) -> subprocess.CompletedProcess:
    """The CLI as on a host without CUDA (CUDA_VISIBLE_DEVICES empty)."""
    return subprocess.run([sys.executable, "-m", "fsdpkit", *args], capture_output=True, text=True, timeout=600,
                          cwd=ROOT, env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"})


def test_checkpoints_move_between_cpu_and_gpu_hosts(tmp_path):
    """Saved on a CPU host (no CUDA RNG in it), resumed on the GPU (a warning says CUDA's stream
    starts from this run's seed), saved there, and resumed on the CPU again."""
    base = ["experiment=demo", *SMALL, "checkpoint.every_steps=2", "checkpoint.keep_last=0"]
    cpu = cpu_host("train", *base, "train.max_steps=2", f"run_dir={tmp_path / 'cpu'}")
    assert cpu.returncode == 0, cpu.stderr[-3000:]
    assert "rng.rank0.torch_cuda" not in saved_keys(tmp_path / "cpu" / "checkpoints" / "step_2")

    gpu = fsdpkit("train", *base, *CUDA, "train.max_steps=4", f"run_dir={tmp_path / 'gpu'}",
                  f"checkpoint.resume={tmp_path / 'cpu' / 'checkpoints' / 'step_2'}")
    assert gpu.returncode == 0, gpu.stderr[-3000:]
    assert resume_events(tmp_path / "gpu") == [(2, 1)]
    assert "holds no CUDA RNG state" in gpu.stderr
    assert "rng.rank0.torch_cuda" in saved_keys(tmp_path / "gpu" / "checkpoints" / "step_4")

    back = cpu_host("train", *base, "train.max_steps=6", f"run_dir={tmp_path / 'back'}",
                   f"checkpoint.resume={tmp_path / 'gpu' / 'checkpoints' / 'step_4'}")
    assert back.returncode == 0, back.stderr[-3000:]
    assert resume_events(tmp_path / "back") == [(4, 1)]


def test_cpu_offload_and_compile_train_like_the_plain_run(tmp_path):
    """CPU offload (pinned host memory, the optimizer step on the CPU) and torch.compile (inductor:
    Triton kernels) give the plain CUDA run's losses within float tolerance."""
    base = ["experiment=demo", *CUDA, *SMALL, "train.max_steps=3", "checkpoint.every_steps=0"]
    losses = {}
    for name, extra in {"plain": [], "offload": ["strategy.cpu_offload=true"],
                        "compile": ["train.compile=true"]}.items():
        proc = fsdpkit("train", *base, *extra, f"run_dir={tmp_path / name}")
        assert proc.returncode == 0, f"{name}: {proc.stderr[-3000:]}"
        losses[name] = [r["loss"] for r in read_records(tmp_path / name)]
    assert len(losses["plain"]) == 3 and all(map(math.isfinite, losses["plain"]))
    for name in ("offload", "compile"):
        torch.testing.assert_close(losses[name], losses["plain"], rtol=1e-4, atol=1e-4, msg=name)


def _example(script: str, out: Path, *args: str) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
           str(ROOT / "examples" / script), "--out", str(out), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, f"{script}: {proc.stderr[-4000:]}"
    return json.loads(out.read_text())


@pytest.mark.parametrize("script", ["own_loop.py", "accelerate_fsdp2.py", "lightning_fsdp2.py"])
def test_examples_resume_on_cuda(script, tmp_path):
    """Each library example on one GPU: 4 steps saving every 2, then a run resumed from step 2
    whose steps 3 and 4 repeat the first run's losses."""
    pytest.importorskip({"accelerate_fsdp2.py": "accelerate", "lightning_fsdp2.py": "lightning"}.get(script, "torch"))
    common = ["--steps", "4", "--save-every", "2"]
    first = _example(script, tmp_path / "a.json", "--ckpt-dir", str(tmp_path / "a"), *common)
    if script == "own_loop.py":  # no --resume flag: stop a run after step 2, then run it again (auto-resume)
        _example(script, tmp_path / "stopped.json", "--ckpt-dir", str(tmp_path / "b"), "--stop-at", "2", *common)
        second = _example(script, tmp_path / "b.json", "--ckpt-dir", str(tmp_path / "b"), "--async-save", *common)
        assert second["resumed"]["step"] == 2
    else:
        second = _example(script, tmp_path / "b.json", "--ckpt-dir", str(tmp_path / "b"),
                          "--resume", str(tmp_path / "a" / "step_2"), *common)
        resumed = second.get("resumed_step", (second.get("resumed") or {}).get("step"))
        assert resumed == 2, second
    assert sorted(map(int, second["losses"])) == [3, 4]
    for step, loss in second["losses"].items():
        assert abs(loss - first["losses"][step]) <= 1e-5 * abs(loss), (script, step, loss, first["losses"][step])


HF_LORA = ["qwen2", "mixtral", "gpt2", "gemma3_text"]  # tied embeddings, MoE, Conv1D, Gemma's scaled embedding


def _hf_matrix_problems(arch: str, results: dict, runs: Path, folder: Path, tmp: Path) -> list[str]:
    """What differs from transformers for one architecture trained on the GPU (empty: nothing)."""
    import transformers

    from fsdpkit.export import export_checkpoint
    from fsdpkit.export.adapter import export_adapter
    from hf_folders import reference_model

    problems = []
    first, reference = results["loss"][0], results["reference_loss"]
    if not abs(first - reference) <= 1e-5 * abs(reference):
        problems.append(f"step-1 loss {first!r} vs transformers' {reference!r}")
    if not (results["loss"][0] != results["loss"][2] and results["grad_norm"][0] > 0):
        problems.append(f"did not train: losses {results['loss']}, grad norms {results['grad_norm']}")
    if [e["step"] for e in results["resume_events"]] != [2] or \
            results["resumed"] != [[3, results["loss"][2], results["grad_norm"][2]]]:
        problems.append(f"resume not bitwise: {results['resumed']} vs step 3 {results['loss'][2]}")
    if results["param_dtypes"] != ["torch.float32"] or results["mine_attn"] != results["attn"]:
        problems.append(f"params {results['param_dtypes']}, attention {results['mine_attn']} vs {results['attn']}")
    if arch.endswith("+lora"):
        from peft import PeftModel

        export_adapter(runs / arch / "full" / "checkpoints", tmp / "adapter")
        model = PeftModel.from_pretrained(reference_model(folder), tmp / "adapter").eval().cuda()
    else:
        wrong = sorted(n for n, same in results["buffers"].items() if not same) + results["buffers_extra"]
        if wrong:
            problems.append(f"buffers unlike from_pretrained's: {wrong}")
        export_checkpoint(runs / arch / "full" / "checkpoints", tmp / "export", dtype="fp32")
        model, info = transformers.AutoModelForCausalLM.from_pretrained(tmp / "export", output_loading_info=True)
        if any(info.values()):
            problems.append(f"export loads with {info}")
        model = model.eval().cuda()
    batch = torch.load(runs / arch / "batch.pt")
    with torch.no_grad():
        logits = model(batch[:, :-1].cuda()).logits.cpu()
    trained = torch.load(runs / arch / "trained_logits.pt")
    if not torch.allclose(logits, trained, rtol=1e-5, atol=1e-5):
        problems.append(f"exported logits differ by up to {(logits - trained).abs().max().item():.3e}")
    return problems


def test_every_hf_architecture_trains_resumes_and_exports_on_cuda(tmp_path, hf_tokenizer_dir):
    """tests/multirank/test_hf_matrix.py's matrix on one GPU under NCCL: each tiny `save_pretrained`
    folder trained from `model=hf model.path=DIR` gives transformers' own step-1 loss on the same
    GPU, resumes bit for bit, keeps every buffer transformers builds (computed on the GPU by the
    model's init hooks, compared with from_pretrained's), and exports (or, LoRA, gives an adapter)
    that transformers loads with the trained logits. One launch; every architecture's problems are
    reported together."""
    from hf_folders import ARCHITECTURES, make_folder

    archs = list(ARCHITECTURES)
    folders = {a: make_folder(a, tmp_path / "folders" / a, tokenizer_dir=hf_tokenizer_dir) for a in archs}
    specs = [f"{a}={folders[a]}" for a in archs] + [f"{a}+lora={folders[a]}" for a in HF_LORA]
    runs = tmp_path / "runs"
    torchrun(1, ROOT / "tests" / "multirank" / "hf_matrix_worker.py", "--device", "cuda", str(tmp_path / "out.json"),
             str(runs), *specs, timeout=900)
    results = json.loads((tmp_path / "out.json").read_text())
    problems = {}
    for spec in specs:
        arch = spec.split("=", 1)[0]
        found = _hf_matrix_problems(arch, results[arch], runs, folders[arch.removesuffix("+lora")], tmp_path / arch)
        if found:
            problems[arch] = found
    assert problems == {}, json.dumps(problems, indent=1)


@pytest.mark.parametrize("async_save", [False, True])
def test_frozen_weights_on_cuda_are_written_once_and_resume_bitwise(tmp_path, async_save):
    """On CUDA the sync save checksums on the device (`linear`), an async one its host copy (rows):
    the frozen tensors' checksums must follow the same algorithm as the rest of the save."""
    sys.path.insert(0, str(ROOT / "tests" / "multirank"))
    from frozen_worker import LoraNet

    from fsdpkit.checkpoint.manager import Checkpointer

    def build(seed: int):
        torch.manual_seed(seed)
        model = LoraNet().cuda()
        model.base.requires_grad_(False)
        return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)

    model, opt = build(0)
    ck = Checkpointer(tmp_path / "ckpt", model=model, optimizer=opt, async_save=async_save)
    ck.resume()
    for step in (1, 2, 3):
        model(torch.randn(4, 16, device="cuda")).square().mean().backward()
        opt.step()
        opt.zero_grad()
        ck.save(step)
    ck.close()
    manifests = [json.loads((tmp_path / "ckpt" / f"step_{s}" / "manifest.json").read_text()) for s in (1, 2, 3)]
    assert len({m["shared"][0]["dir"] for m in manifests}) == 1
    assert {m["tensor_hash"] for m in manifests} == {"xxh3_64-rows" if async_save else "linear"}
    fresh, fresh_opt = build(1)
    again = Checkpointer(tmp_path / "ckpt", model=fresh, optimizer=fresh_opt)
    assert again.resume() == 3
    again.close()
    for key, value in model.state_dict().items():
        assert torch.equal(value, fresh.state_dict()[key]), key
