"""One run from a Hugging Face folder reads the folder's config once and initialises the model's
buffers once, however it starts: from the folder's weights, from a random init of its architecture,
with LoRA adapters over the folder's weights, or resuming from its own checkpoint. Counted through
the run itself (fsdpkit.train.run.train, what each rank of `fsdpkit train` runs) in a world of one."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fsdpkit.config import compose_config  # noqa: E402
from hf_folders import make_folder  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
RUN = ["model=hf", "train.global_batch_size=2", "train.micro_batch_size=1", "data.seq_len=16", "data.num_samples=8",
       "train.eval_every=0", "train.progress=false", "checkpoint.every_steps=1", "diagnostics.memory_steps=0"]
STARTS = {
    "from the folder's weights": [],
    "from a random init": ["model.pretrained=false"],
    "LoRA over the folder's weights": ["model.peft.method=lora", "model.peft.r=4",
                                       "model.peft.target_modules=[q_proj]"],
}


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory) -> Path:
    return make_folder("gemma3_text", tmp_path_factory.mktemp("gemma3"))


@pytest.fixture
def counted(monkeypatch) -> dict[str, list]:
    """Every read of a config folder by transformers, and every buffer initialisation of a
    transformers model (fsdpkit.hf.buffers, which init_buffers goes through), as they happen."""
    import transformers

    from fsdpkit.hf import buffers

    calls: dict[str, list] = {"config reads": [], "buffer inits": []}
    read, init = transformers.AutoConfig.from_pretrained, buffers.init_transformers_buffers

    def counted_read(*args, **kwargs):
        calls["config reads"].append(args[0])
        return read(*args, **kwargs)

    def counted_init(model, **kwargs):
        calls["buffer inits"].append(kwargs)
        return init(model, **kwargs)

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", counted_read)
    monkeypatch.setattr(buffers, "init_transformers_buffers", counted_init)
    return calls


@pytest.mark.parametrize("start", STARTS)
def test_a_run_reads_the_config_once_and_initialises_the_buffers_once(gemma3, tmp_path, world_of_one, counted,
                                                                      start):
    from fsdpkit.train.run import train

    args = [*RUN, f"model.path={gemma3}", f"run_dir={tmp_path / 'run'}", *STARTS[start]]
    summary = train(compose_config([*args, "train.max_steps=1"]), device=_cpu())
    assert summary["last_step"] == 1
    assert counted["config reads"] == [str(gemma3)]
    # loaded from the folder: once, after the weights, keeping the persistent buffers the file holds
    loaded = start != "from a random init"
    assert counted["buffer inits"] == [{"also_params": frozenset(), "keep_persistent": True} if loaded else
                                       {"also_params": counted["buffer inits"][0]["also_params"],
                                        "keep_persistent": False}]
    assert loaded or counted["buffer inits"][0]["also_params"]  # Gemma's norms are left to its own init

    for calls in counted.values():
        calls.clear()
    summary = train(compose_config([*args, "train.max_steps=2"]), device=_cpu())  # resumes from step 1
    assert summary["last_step"] == 2
    assert counted["config reads"] == [str(gemma3)]
    assert counted["buffer inits"] == [{"also_params": frozenset(), "keep_persistent": False}]  # then the checkpoint


def _cpu():
    import torch

    return torch.device("cpu")
