"""`fsdpkit ckpt export|inspect|verify` on checkpoints in other tools' layouts (tests/foreign_layouts.py:
nested {"model","optim"}, flat torchtitan-like, Accelerate's save_state folder, Lightning's
`model.`-prefixed `state_dict` namespace with meta.pt): with --config, transformers loads the export
with no missing or unexpected keys and the same logits, with no other flag. The CLI's main() runs
in-process (same parser, same exit codes)."""

from __future__ import annotations

import shutil
import sys
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from foreign_layouts import LAYOUTS, save_config, tiny_llama, trained, write_layout  # noqa: E402
from fsdpkit.cli.main import main  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.filterwarnings("ignore::UserWarning")]
TIED = {"nested": False, "flat": True, "accelerate": True, "lightning": False}
# The line each layout's export must print about what it found and did.
NOTES = {
    "nested": "removed wrapper components from the names: _orig_mod. (21 names)",
    "flat": "holds 2 checkpoints (step-1, step-3): using the newest by the number in its name, step-3",
    "accelerate": "an Accelerate save_state folder: using pytorch_model_fsdp_0/ (model); optimizer_0/ holds the "
                  "optimizer",
    "lightning": "stripped the prefix 'model.' from all 21 names, to match the names of LlamaForCausalLM",
}


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict[str, tuple]:
    """layout -> (model, path to hand to the tools, HF config folder, tripwire marker)."""
    out = {}
    for layout in LAYOUTS:
        root = tmp_path_factory.mktemp(layout)
        model = tiny_llama(tied=TIED[layout], seed=len(layout))
        opt = trained(model)
        path = write_layout(layout, model, opt, root, tripwire=root / "unpickled")
        out[layout] = (model.eval(), path, save_config(model, root / "hf"), root / "unpickled")
    return out


def cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["ckpt", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("layout", LAYOUTS)
def test_export_with_config_loads_in_transformers_exactly(written, layout, tmp_path, capsys):
    model, path, hf, tripwire = written[layout]
    code, out, err = cli(capsys, "export", str(path), str(tmp_path / "out"), "--config", str(hf))
    assert code == 0, err
    assert NOTES[layout] in out
    assert "config.json and generation_config.json written from" in out
    assert ("dropped: lm_head.weight (tied in" in out) == TIED[layout]
    loaded, info = AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert (info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"]) == (set(), set(), set())
    assert loaded.generation_config.max_new_tokens == 7  # generation_config.json came along
    ids = torch.arange(20).reshape(2, 10) % 128
    with torch.no_grad():
        assert torch.equal(loaded.eval()(input_ids=ids).logits, model(input_ids=ids).logits)
    if TIED[layout]:
        with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
            assert "lm_head.weight" not in f.keys()
    assert not tripwire.exists()  # meta.pt, random_states_0.pkl, scheduler.bin: never unpickled

    # Without --config: the same weights, and the report says exactly what to do for config.json.
    code, out, _ = cli(capsys, "export", str(path), str(tmp_path / "bare"))
    assert code == 0 and not (tmp_path / "bare" / "config.json").exists()
    assert "pass --config with the model's config.json or its Hugging Face folder" in out
    assert f"model.config.save_pretrained('{tmp_path / 'bare'}')" in out
    if TIED[layout]:
        assert "dropped: lm_head.weight (equal tensors" in out


def test_names_that_do_not_fit_the_config_are_refused_with_a_list(written, tmp_path, capsys):
    _, path, hf, _ = written["lightning"]
    code, _, err = cli(capsys, "export", str(path), str(tmp_path / "kept"), "--config", str(hf), "--strip-prefix", "")
    assert code == 2 and "does not hold the weights of LlamaForCausalLM" in err and "unexpected (21)" in err
    assert "missing (21)" in err and "--strip-prefix" in err and not (tmp_path / "kept").exists()
    code, out, _ = cli(capsys, "export", str(path), str(tmp_path / "raw"), "--strip-prefix", "")
    assert code == 0 and "stripped" not in out
    with safe_open(str(tmp_path / "raw" / "model.safetensors"), "pt") as f:
        assert "model.model.embed_tokens.weight" in f.keys()
    other = tiny_llama(tied=False)
    other.config.hidden_size, other.config.head_dim = 48, 12
    save_config(other, tmp_path / "other")
    code, _, err = cli(capsys, "export", str(path), str(tmp_path / "x"), "--config", str(tmp_path / "other"))
    assert code == 2 and "other shape" in err and "model.embed_tokens.weight [128, 32]" in err


def test_optimizer_state_is_never_written_as_model_weights(written, tmp_path, capsys):
    _, path, _, _ = written["accelerate"]
    code, _, err = cli(capsys, "export", str(path), str(tmp_path / "o"), "--namespace", "optimizer")
    assert code == 2 and "transformers would load as the model's weights" in err and "--format single" in err
    code, _, err = cli(capsys, "export", str(path), str(tmp_path / "model.safetensors"), "--namespace", "optimizer",
                       "--format", "single")
    assert code == 2 and "would pass for model weights" in err
    code, out, _ = cli(capsys, "export", str(path), str(tmp_path / "optimizer.safetensors"), "--namespace", "optimizer",
                       "--format", "single")
    assert code == 0 and "using optimizer_0/ (optimizer)" in out and "stripped" not in out
    with safe_open(str(tmp_path / "optimizer.safetensors"), "pt") as f:
        assert "state.model.embed_tokens.weight.exp_avg" in f.keys()


def test_dcp_reader_warnings_only_with_verbose(written, tmp_path, capsys):
    _, path, _, _ = written["nested"]
    for verbose in (False, True):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            code, _, _ = cli(capsys, "export", str(path), str(tmp_path / f"out{verbose}"), "--reader", "dcp",
                             *(["--verbose"] if verbose else []))
        assert code == 0
        assert bool([w for w in seen if "torch" in w.filename]) == verbose, [str(w.message) for w in seen]


def test_inspect_and_verify_say_what_they_picked(written, tmp_path, capsys):
    path = Path(shutil.copytree(written["accelerate"][1], tmp_path / "checkpoint_0"))
    code, out, _ = cli(capsys, "inspect", str(path))
    assert code == 0 and out.startswith("an Accelerate save_state folder: using pytorch_model_fsdp_0/")
    code, out, _ = cli(capsys, "verify", str(path))
    assert code == 0 and "pytorch_model_fsdp_0 and " in out and "optimizer_0 (dcp)" in out
    assert "STRUCTURE OK, VALUES NOT CHECKED" in out and "intact" not in out  # Accelerate records no checksums
    (path / "optimizer_0" / "__0_0.distcp").write_bytes(b"")
    code, out, _ = cli(capsys, "verify", str(path))
    assert code == 1 and "optimizer_0/__0_0.distcp" in out
    lightning = Path(shutil.copytree(written["lightning"][1], tmp_path / "checkpoints"))
    code, out, _ = cli(capsys, "inspect", str(lightning))
    assert code == 0 and "using the newest by the number in its name, epoch=0-step=4.ckpt" in out
    (lightning / "last.ckpt").mkdir()
    (lightning / "last.ckpt" / ".metadata").write_bytes((lightning / "epoch=0-step=4.ckpt" / ".metadata").read_bytes())
    code, _, err = cli(capsys, "inspect", str(lightning))
    assert code == 2
    assert "their names do not say which is newest: epoch=0-step=2.ckpt, epoch=0-step=4.ckpt, last.ckpt" in err
