"""The async save's staging buffer: allocation by shape, and the (parallel) host copy into it."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from fsdpkit.checkpoint import staging


def _state() -> dict:
    gen = torch.Generator().manual_seed(0)
    big = torch.randn(3 * staging.COPY_PIECE_BYTES // 4 + 123, generator=gen)  # several pieces, a ragged end
    return {"model": {"big": big, "small": torch.arange(7), "bf16": torch.randn(64, 33, generator=gen).bfloat16()},
            "optim": [torch.randn(40, 30, generator=gen).t(), {"step": torch.tensor(5.0), "lr": 0.1}]}


@pytest.mark.parametrize("threads", [1, 3])
def test_copy_into_a_reused_buffer_is_exact(threads):
    """Every tensor lands whole in its own place, split over threads or not, contiguous or not;
    non-tensors are copied; a changed shape changes the signature (the buffer is rebuilt)."""
    state = _state()
    buffer = staging.allocate(state, pin=False)
    assert staging.signature(buffer) == staging.signature(state)
    with ThreadPoolExecutor(threads) as pool:
        staged = staging.copy_into(state, buffer, copy_tensors=False)
        staging.copy_tensors(state, buffer, pool=pool if threads > 1 else None)
    for src, dst in zip(staging.tensors(state), staging.tensors(staged), strict=True):
        assert dst.data_ptr() != src.data_ptr() and torch.equal(src, dst)
    assert staged["optim"][1]["lr"] == 0.1
    state["model"]["big"].add_(1.0)  # the buffer is a copy, not a view of the live state
    assert not torch.equal(state["model"]["big"], staged["model"]["big"])
    state["model"]["small"] = torch.arange(8)
    assert staging.signature(state) != staging.signature(buffer)


def test_copy_threads_setting(monkeypatch):
    monkeypatch.setenv(staging.STAGING_THREADS_ENV, "3")
    assert staging.copy_threads() == 3
    monkeypatch.setenv(staging.STAGING_THREADS_ENV, "two")
    with pytest.raises(ValueError, match="FSDPKIT_STAGING_THREADS='two' is not a whole number"):
        staging.copy_threads()
    monkeypatch.delenv(staging.STAGING_THREADS_ENV)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1000")  # more ranks on this host than cores: one thread each
    assert staging.copy_threads() == 1
