"""Tensor checksums: the same however the rows are split, different when anything moves."""

from __future__ import annotations

import pytest
import torch

from fsdpkit.checkpoint.hashing import LINEAR, ROWS, hash_part


def split_sum(t: torch.Tensor, cuts: list[int], algorithm: str) -> int:
    bounds = [0, *cuts, t.shape[0]]
    total = sum(hash_part(t[a:b], first_row=a, algorithm=algorithm) for a, b in zip(bounds, bounds[1:], strict=False))
    return (total + (1 << 63)) % (1 << 64) - (1 << 63)  # int64 wrap-around, as the all-reduce does


@pytest.mark.parametrize("algorithm", [ROWS, LINEAR])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_split_invariant_and_sensitive(algorithm, dtype):
    t = (torch.randn(37, 5, generator=torch.Generator().manual_seed(0)) * 100).to(dtype)
    whole = hash_part(t, first_row=0, algorithm=algorithm)
    assert split_sum(t, [10], algorithm) == whole == split_sum(t, [1, 13, 36], algorithm)
    swapped = t.clone()
    swapped[[3, 4]] = t[[4, 3]]
    changed = t.clone()
    changed.view(-1).view(torch.uint8)[37] ^= 1  # one bit of one element, whatever the dtype
    assert hash_part(swapped, first_row=0, algorithm=algorithm) != whole
    assert hash_part(changed, first_row=0, algorithm=algorithm) != whole
    # the same rows at another global position (a mismapped shard) hash differently
    assert hash_part(t[1:], first_row=0, algorithm=algorithm) != hash_part(t[1:], first_row=1, algorithm=algorithm)


def test_unknown_algorithm_is_an_error():
    with pytest.raises(ValueError, match="unknown tensor hash algorithm"):
        hash_part(torch.zeros(2, 2), first_row=0, algorithm="md5")
