"""Which failures count as a lost peer (the survivors then probe for and name the lost ranks)."""

from __future__ import annotations

import torch.distributed as tdist

from fsdpkit import dist
from fsdpkit.checkpoint.errors import CheckpointSaveError

GLOO_CLOSED = ("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
               "[127.0.0.1]:3292. This is typically caused by a remote worker crashing.")


def test_a_failed_collective_is_a_lost_peer_even_when_wrapped():
    assert dist.lost_a_peer(RuntimeError(GLOO_CLOSED))
    assert dist.lost_a_peer(tdist.DistBackendError("NCCL watchdog"))
    try:  # how a save reports it: CheckpointSaveError raised from the collective's error
        try:
            raise RuntimeError(GLOO_CLOSED)
        except RuntimeError as e:
            raise CheckpointSaveError("saving step_8 failed: a rank died or stalled") from e
    except CheckpointSaveError as wrapped:
        assert dist.lost_a_peer(wrapped)


def test_a_rank_s_own_failure_is_not():
    assert not dist.lost_a_peer(RuntimeError("injected failure at step 5 on rank 1"))
    assert not dist.lost_a_peer(ValueError("bad batch"))
    assert dist.unresponsive_ranks(None, timeout_s=1) == []  # a world of one has no peers
