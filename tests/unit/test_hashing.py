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


def test_file_stream_hashes_what_reached_the_file_small_large_and_short_writes():
    """Writes under and over the overlap threshold (the latter hashed on another thread while
    written), and a short write, give xxh3-64 of exactly the bytes the file holds."""
    import io

    import xxhash

    from fsdpkit.checkpoint.hashing import _HashingStream

    class Short(io.BytesIO):  # accepts only part of one large write, as a non-blocking stream may
        def write(self, b):
            return super().write(bytes(b)[: len(b) - 7] if len(b) > 3 << 20 else b)

    big = torch.randint(0, 255, (5 << 20,), dtype=torch.uint8).numpy()
    for raw in (io.BytesIO(), Short()):
        got = {}
        stream = _HashingStream(raw, lambda size, digest, got=got: got.update(size=size, digest=digest))
        for chunk in (b"header", big[: 2 << 20], b"x" * 100, big):
            stream.write(chunk)
        stream.close()
        data = raw.getvalue()
        assert got == {"size": len(data), "digest": xxhash.xxh3_64(data).hexdigest()}
        assert len(data) == 6 + (2 << 20) + 100 + (5 << 20) - (7 if isinstance(raw, Short) else 0)
