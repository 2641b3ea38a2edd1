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


def test_copy_threads_setting(monkeypatch, tune):
    tune(staging_threads=3)
    assert staging.copy_threads() == 3
    tune(staging_threads=None)  # unset: from the cores and the ranks on this host
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1000")  # more ranks on this host than cores: one thread each
    assert staging.copy_threads() == 1


class _Wrapped(torch.Tensor):
    """A tensor subclass (as NF4 or float8 wrappers are): its bytes are not simply its values."""


def test_host_copies_stream_where_they_can(monkeypatch):
    """Large contiguous host tensors go through the C streaming copy (exact for every dtype, a
    destination off 16-byte alignment and a ragged end, a source that requires grad); the rest
    (small, strided, lazily conjugated, a tensor subclass) through copy_, as does everything without
    the extension."""
    if staging._stream_copy is None:
        pytest.skip("fsdpkit's C extension was not built here")
    calls = []
    native = staging._stream_copy
    monkeypatch.setattr(staging, "_stream_copy", lambda out, src: (calls.append(len(src)), native(out, src)))
    gen = torch.Generator().manual_seed(1)
    n = staging.STREAM_MIN_BYTES // 4 + 13  # whole 64-byte blocks and a ragged tail
    param = torch.nn.Parameter(torch.randn(n, generator=gen))
    state = {"param": param, "bf16": torch.randn(3, n, generator=gen).bfloat16(),
             "small": torch.randn(5, generator=gen), "strided": torch.randn(300, 70, generator=gen).t(),
             "conj": torch.randn(n, dtype=torch.complex64, generator=gen).conj(),
             "subclass": torch.randn(n, generator=gen).as_subclass(_Wrapped)}
    buffer = staging.allocate(state, pin=False)
    staged = staging.copy_into(state, buffer)  # the one-thread path of a blocking stage
    for k in state:
        assert torch.equal(staged[k], state[k]), k
    assert sorted(calls) == sorted([param.nbytes, state["bf16"].nbytes])
    raw = torch.empty(n * 4 + 3, dtype=torch.uint8)[3:]  # a destination 3 bytes off alignment
    calls.clear()
    staging.copy_host(raw, param.detach().view(torch.uint8))
    assert calls == [n * 4] and torch.equal(raw, param.detach().view(torch.uint8))
    monkeypatch.setattr(staging, "_stream_copy", None)
    again = staging.copy_into(state, staging.allocate(state, pin=False))
    assert all(torch.equal(again[k], state[k]) for k in state)
