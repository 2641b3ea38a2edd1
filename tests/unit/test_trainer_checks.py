"""Trainer.fit in one process (no process group): the router aux loss of MoE models in the step
records, and the warning when nothing trains."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from torch import nn

from fsdpkit.data import GlobalSampler
from fsdpkit.data.datasets import SyntheticCorpus
from fsdpkit.diagnostics.runlog import METRICS_FILE
from fsdpkit.model.llama import LlamaArgs, LlamaForCausalLM
from fsdpkit.train.loop import Trainer
from fsdpkit.train.metrics import MetricsLog
from fsdpkit.train.stalled import FIRST_STEPS, nothing_trains_warning
from fsdpkit.train.state import TrainState

VOCAB, SEQ, SAMPLES, GLOBAL_BATCH, MICRO = 64, 8, 16, 4, 2
WARNING = "nothing is training"


class OneProcess(nn.Module):
    """The Trainer drives an FSDP-sharded model; in one process there is no gradient sync to skip."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner
        if hasattr(inner, "config"):
            self.config = inner.config

    def forward(self, input_ids: torch.Tensor):
        return self.inner(input_ids)

    def set_requires_gradient_sync(self, requires: bool) -> None:
        pass


class AllMasked:
    """SyntheticCorpus with every target masked (-100), as a chat mask that matches nothing would."""

    def __init__(self, data: SyntheticCorpus):
        self.data, self.seq_len = data, data.seq_len

    def __len__(self) -> int:
        return len(self.data)

    def batch(self, indices):
        return self.data.batch(indices)

    def labeled_batch(self, indices):
        got = self.data.labeled_batch(indices)
        return got._replace(targets=torch.full_like(got.targets, -100))

    def target_count(self, indices) -> int:
        return 0


def corpus(split: int) -> SyntheticCorpus:
    return SyntheticCorpus(vocab_size=VOCAB, seq_len=SEQ, num_samples=SAMPLES, seed=0, split=split)


def sampler() -> GlobalSampler:
    return GlobalSampler(num_samples=SAMPLES, global_batch_size=GLOBAL_BATCH, seed=0)


def make_trainer(model: nn.Module, tmp_path, *, max_steps: int, train_data=None, eval_samples: int = 2) -> Trainer:
    model = OneProcess(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    logger = logging.getLogger("fsdpkit.test_trainer_checks")
    return Trainer(
        model=model, optimizer=optimizer, scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0),
        sampler=sampler(), train_data=train_data or corpus(0), val_data=corpus(1), state=TrainState(),
        metrics=MetricsLog(tmp_path, logger=logger, log_every=1), device=torch.device("cpu"), max_steps=max_steps,
        micro_batch_size=MICRO, grad_clip=1.0, eval_every=0, eval_samples=eval_samples, progress=False, logger=logger)


def llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaArgs(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2))


def rec(step: int, loss: float, grad_norm: float) -> dict[str, float]:
    return {"step": step, "loss": loss, "grad_norm": grad_norm}


# -- the warning, from records ---------------------------------------------------------------------------

def test_warns_when_the_gradient_is_zero_and_the_loss_still():
    text = nothing_trains_warning([rec(1, 4.158883, 0.0), rec(2, 4.158883, 0.0), rec(3, 4.158883, 0.0)])
    assert text is not None and text.startswith(f"{WARNING}: steps 1-3 all had grad_norm 0.0 and loss 4.15888 ")
    for cause in ("every parameter frozen", "model.peft.target_modules", "masked to -100", "to_empty()",
                  "learning rate of 0 in warmup does not cause this"):
        assert cause in text
    assert "a loss of exactly 0" not in text
    # after a resume the steps are the run's own
    assert "steps 41-43 " in nothing_trains_warning([rec(41, 0.0, 0.0), rec(42, 0.0, 0.0), rec(43, 0.0, 0.0)])
    assert "a loss of exactly 0" in nothing_trains_warning([rec(1, 0.0, 0.0)] * 3)


@pytest.mark.parametrize("records", [
    [rec(1, 4.2, 0.5), rec(2, 4.1, 0.4), rec(3, 4.0, 0.4)],  # a normal start
    [rec(1, 4.2, 0.0), rec(2, 4.2, 0.0), rec(3, 4.2, 1e-12)],  # one step with a gradient
    [rec(1, 4.2, 0.0), rec(2, 4.2, 0.0), rec(3, 4.19, 0.0)],  # the loss moved (the data changes it)
    [rec(1, 4.2, 0.5), rec(2, 4.2, 0.5), rec(3, 4.2, 0.5)],  # lr 0 in warmup: a gradient, no update
    [rec(1, float("nan"), float("nan"))] * 3,  # NaN is another problem (diagnostics reports it)
    [],
])
def test_no_warning_when_anything_moves(records):
    assert nothing_trains_warning(records) is None


# -- the Trainer -----------------------------------------------------------------------------------------

def test_trainer_warns_once_when_every_target_is_masked(tmp_path, caplog):
    trainer = make_trainer(llama(), tmp_path, max_steps=FIRST_STEPS + 2, train_data=AllMasked(corpus(0)))
    with caplog.at_level(logging.WARNING, logger="fsdpkit.test_trainer_checks"):
        trainer.fit()
    warnings = [r.getMessage() for r in caplog.records if WARNING in r.getMessage()]
    assert len(warnings) == 1
    assert warnings[0].startswith(f"{WARNING}: steps 1-3 all had grad_norm 0.0 and loss 0 ")


def test_trainer_does_not_warn_on_a_run_that_trains(tmp_path, caplog):
    trainer = make_trainer(llama(), tmp_path, max_steps=FIRST_STEPS + 1)
    with caplog.at_level(logging.INFO, logger="fsdpkit.test_trainer_checks"):
        summary = trainer.fit()
    assert summary["last_loss"] < summary["first_loss"]
    assert not [r for r in caplog.records if WARNING in r.getMessage()]
    assert [r.getMessage() for r in caplog.records if "val_loss" in r.getMessage()][-1].startswith(
        f"step {FIRST_STEPS + 1}  val_loss ")


def test_no_val_loss_without_evaluation_samples(tmp_path, caplog):
    """train.eval_samples=0: no evaluation, so no val_loss anywhere (it printed `val_loss 0.0000`)."""
    trainer = make_trainer(llama(), tmp_path, max_steps=2, eval_samples=0)
    with caplog.at_level(logging.INFO, logger="fsdpkit.test_trainer_checks"):
        summary = trainer.fit()
    assert summary["val_loss"] is None and summary["last_step"] == 2
    assert not [r for r in caplog.records if "val_loss" in r.getMessage()]
    assert "val_loss" not in (tmp_path / METRICS_FILE).read_text()


def test_trainer_records_the_router_aux_loss_beside_the_cross_entropy(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
        router_aux_loss_coef=0.02))
    # transformers' own CE and aux loss of the first step's micro-batches, before the update
    data, indices = corpus(0), sampler().next_global_batch()
    ce, aux = [], []
    with torch.no_grad():
        for mb in (indices[:MICRO], indices[MICRO:]):
            inputs, targets, _ = data.labeled_batch(mb)
            out = model(input_ids=inputs, labels=targets, shift_labels=targets.contiguous())
            ce.append(float(out.loss) - 0.02 * float(out.aux_loss))  # its loss is CE + coef * aux
            aux.append(float(out.aux_loss))
    trainer = make_trainer(model, tmp_path, max_steps=2)
    trainer.fit()
    records = [json.loads(line) for line in (tmp_path / METRICS_FILE).read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2] and all("aux_loss" in r for r in records)
    assert records[0]["aux_loss"] == pytest.approx(sum(aux) / len(aux), rel=1e-6)  # mean over micro-batches
    assert records[0]["loss"] == pytest.approx(sum(ce) / len(ce), rel=1e-6)  # the CE alone (equal token counts)
    assert records[1]["aux_loss"] != records[0]["aux_loss"]


def test_no_aux_loss_metric_without_routers(tmp_path):
    make_trainer(llama(), tmp_path, max_steps=1).fit()
    record = json.loads((tmp_path / METRICS_FILE).read_text())
    assert "aux_loss" not in record and "loss" in record
