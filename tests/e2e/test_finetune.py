"""Fine-tuning through the CLI: `fsdpkit resume-check` with LoRA on a transformers Llama, on data=hf
documents run together (data.packing=concat; at the same world size, bitwise) and on chat SFT packed
with each conversation kept apart (data.packing=true; initialised from a Hugging Face folder; at the
same world size, bitwise, and 2 -> 3 ranks in one check); then the LoRA checkpoint's optimizer
slices and its adapter / merged exports, loaded back with peft."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import EXAMPLE_DATA, fsdpkit  # noqa: E402
from fsdpkit.config import compose_config  # noqa: E402
from fsdpkit.export.keys import model_weights  # noqa: E402
from fsdpkit.export.sources import open_checkpoint  # noqa: E402
from fsdpkit.hf import build_model  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.filterwarnings("ignore::UserWarning")]
STEPS = ["--steps", "5", "--save-at", "3"]
BATCH = ["train.global_batch_size=12", "train.micro_batch_size=2", "data.seq_len=32", "optim.warmup_steps=2"]
LORA = ["experiment=hf_llama", "model.peft.method=lora", "model.peft.r=4", "model.peft.alpha=8",
        "model.peft.target_modules=[q_proj,v_proj,down_proj]"]


@pytest.fixture(scope="module")
def data_args(hf_tokenizer_dir, tmp_path_factory) -> list[str]:
    cache = tmp_path_factory.mktemp("data-cache")  # shared by every run of the module: tokenized once
    return ["data=hf", f"data.tokenizer={hf_tokenizer_dir}", f"data.cache_dir={cache}", *BATCH]


@pytest.fixture(scope="module")
def base_model(tmp_path_factory) -> Path:
    """A random tiny transformers Llama saved as a Hugging Face folder: the "pretrained" model."""
    import transformers

    kwargs = dict(compose_config(["experiment=hf_llama"]).model.hf_config)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.AutoConfig.for_model(kwargs.pop("model_type"), **kwargs))
    out = tmp_path_factory.mktemp("base")
    model.save_pretrained(out)
    return out


def _resume_check(work: Path, nproc_after: int | str, *overrides: str) -> str:
    proc = fsdpkit("resume-check", *STEPS, "--resume-nproc", str(nproc_after), *overrides, "--work-dir", str(work))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert f"resumed on {str(nproc_after).replace(',', ' and on ')} rank(s)" in proc.stdout
    return proc.stdout


def assert_resumed_at_step_3(work: Path, out: str) -> None:
    """Bitwise on 2 ranks, within the fp32 tolerance on 3; each resumed run's own records show the
    resume of step 3 saved on 2 ranks."""
    same, other = out.split("resume-check: resumed on 3 rank(s)")
    assert "PASS: worst relative difference 0.000e+00, tolerance 0e+00" in same
    assert "PASS" in other and "tolerance 1e-06" in other
    for m in (2, 3):
        resumed = [json.loads(line) for line in open(work / f"resumed-{m}" / "metrics.jsonl")]
        assert [(r["step"], r["saved_world_size"]) for r in resumed if r.get("event") == "resume"] == [(3, 2)]


# LoRA adapters on documents run together, resumed on 2 ranks only (bitwise). The elastic 2 -> 3 resume is
# proven once, on packed chat SFT below: what changes with the world size is the same for both data paths
# (the GlobalSampler's split of each global batch, tests/unit/test_data.py, and the loss normaliser
# over the global batch's trained tokens, which chat's masked targets exercise harder); both datasets
# are plain functions of the sample index on every rank. Saves a 3-rank launch (~50 CPU-s measured).
def test_resume_check_on_concatenated_documents(tmp_path, data_args):
    out = _resume_check(tmp_path, 2, *data_args, *LORA, f"data.files=[{EXAMPLE_DATA / 'text.jsonl'}]",
                        "data.packing=concat", "deterministic=true")
    assert "PASS: worst relative difference 0.000e+00, tolerance 0e+00" in out
    resumed = [json.loads(line) for line in open(tmp_path / "resumed" / "metrics.jsonl")]
    assert [(r["step"], r["saved_world_size"]) for r in resumed if r.get("event") == "resume"] == [(3, 2)]


@pytest.fixture(scope="module")
def lora_runs(data_args, base_model, tmp_path_factory) -> tuple[Path, str]:
    """Chat SFT with LoRA from base_model: one resume-check, resumed at 2 (deterministic) and 3 ranks."""
    work = tmp_path_factory.mktemp("lora")
    return work, _resume_check(work, "2,3", *data_args, *LORA, f"model.init_from=hf:{base_model}",
                               f"data.files=[{EXAMPLE_DATA / 'chat.jsonl'}]", "data.messages_field=messages",
                               "data.packing=true", "data.overlong=split", "deterministic=true")


def test_lora_chat_sft_resumes_bitwise_and_elastically(lora_runs):
    assert_resumed_at_step_3(*lora_runs)


def _checkpoint(lora_runs) -> Path:
    return lora_runs[0] / "resumed-3" / "checkpoints" / "step_3"  # saved by 2 ranks


def test_lora_checkpoint_holds_every_ranks_optimizer_slice(lora_runs):
    with open_checkpoint(_checkpoint(lora_runs)) as opened:
        tensors = opened.source.tensors()
        lora_state = [k for k in tensors if k.startswith("optim.state.") and ".lora_" in k and k.endswith("exp_avg")]
        frozen_state = [k for k in tensors if k.startswith("optim.state.") and ".base_layer." in k]
        assert len(lora_state) == 2 * 3 * 2 and not frozen_state  # 2 layers x 3 targets x (A, B); base frozen
        for key in lora_state:
            chunks = opened.source.chunks(key)
            rows = sorted((c.offsets[0], c.offsets[0] + c.sizes[0]) for c in chunks)
            num_rows = tensors[key].shape[0]
            assert len(chunks) == 2
            assert rows[0][0] == 0 and rows[0][1] == rows[1][0] and rows[1][1] == num_rows
            assert float(opened.source.read_rows(key, 0, num_rows).abs().sum()) > 0  # trained state, not zeros


def _trained_model(ckpt: Path) -> torch.nn.Module:
    """The LoRA model exactly as the checkpoint holds it (plain modules, one process)."""
    model = build_model(compose_config(LORA).model)
    with open_checkpoint(ckpt) as opened:
        infos = opened.source.tensors()
        names = model_weights(list(infos), key_paths=opened.source.key_paths)
        state = {n: opened.source.read_rows(k, 0, infos[k].rows).reshape(infos[k].shape) for n, k in names.items()}
    model.load_state_dict(state, strict=True)
    return model.eval()


def test_adapter_export_loads_in_peft_and_merge_equals_the_merged_model(lora_runs, base_model, tmp_path):
    import transformers
    from peft import PeftModel

    ckpt = _checkpoint(lora_runs)
    for flag in ("--adapter", "--merge"):
        proc = fsdpkit("ckpt", "export", str(ckpt), str(tmp_path / flag.strip("-")), flag)
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert {p.name for p in (tmp_path / "adapter").iterdir()} == {"adapter_model.safetensors", "adapter_config.json"}
    adapter_config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == str(base_model)
    x = torch.randint(0, 400, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        trained = _trained_model(ckpt)(x).logits
        peft_model = PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base_model),
                                               tmp_path / "adapter").eval()
        assert torch.equal(peft_model(x).logits, trained)
        assert not torch.equal(transformers.AutoModelForCausalLM.from_pretrained(base_model)(x).logits, trained)
        merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merge").eval()
        reference = peft_model.merge_and_unload().eval()
        assert torch.equal(merged(x).logits, reference(x).logits)
