"""A single-process, non-sharded reference training loop: plain nn.Module, plain
`clip_grad_norm_`, the loss written here with torch alone (not fsdpkit's), the same data, init and
hyper-parameters. What FSDP runs are compared to."""

from __future__ import annotations

import torch

from fsdpkit.config import Config
from fsdpkit.data import GlobalSampler, build_datasets
from fsdpkit.hf import build_model
from fsdpkit.model import init_std
from fsdpkit.parallel import init_weights
from fsdpkit.train.optim import build_optimizer, build_scheduler


def token_loss_sum(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy of batch [B, L+1]: the logits of batch[:, :-1] against batch[:, 1:]."""
    out = model(batch[:, :-1])
    logits = out if isinstance(out, torch.Tensor) else out.logits  # [B, L, V]
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1),
                                             reduction="sum")


def reference_run(cfg: Config) -> dict[str, list[float] | float]:
    model = build_model(cfg.model)
    init_weights(model, seed=cfg.seed, std=init_std(model))
    opt = build_optimizer(model, cfg.optim, device=torch.device("cpu"))
    sched = build_scheduler(opt, cfg.optim, max_steps=cfg.train.max_steps)
    train, val = build_datasets(cfg.data, vocab_size=cfg.model.vocab_size, seed=cfg.seed)
    sampler = GlobalSampler(num_samples=len(train), global_batch_size=cfg.train.global_batch_size, seed=cfg.seed)
    losses, norms = [], []
    for _ in range(cfg.train.max_steps):
        batch = sampler.next_global_batch()
        tokens = len(batch) * cfg.data.seq_len
        total = 0.0
        for i in range(0, len(batch), cfg.train.micro_batch_size):
            loss = token_loss_sum(model, train.batch(batch[i : i + cfg.train.micro_batch_size]))
            (loss / tokens).backward()
            total += float(loss)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)))
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total / tokens)
    with torch.no_grad():
        n = min(cfg.train.eval_samples, len(val))
        val_loss = float(token_loss_sum(model, val.batch(list(range(n))))) / (n * cfg.data.seq_len)
    return {"loss": losses, "grad_norm": norms, "val_loss": val_loss}
