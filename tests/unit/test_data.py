"""Datasets and the world-size-invariant sampler."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fsdpkit.config import compose_config
from fsdpkit.data import GlobalSampler, build_datasets, describe_split, eval_micro_batches, rank_micro_batches


def test_global_order_is_identical_for_any_world_size():
    for ws, mb in [(1, 8), (2, 4), (4, 1), (8, 1), (3, 4), (3, 1), (5, 2), (7, 3)]:
        s = GlobalSampler(num_samples=100, global_batch_size=8, seed=3)
        seen = []
        for _ in range(30):  # crosses epoch boundaries (12 full batches per epoch)
            batch = s.next_global_batch()
            parts = [rank_micro_batches(batch, rank=r, world_size=ws, micro_batch_size=mb) for r in range(ws)]
            seen.append([i for rank_part in parts for micro in rank_part for i in micro])
        if ws == 1:
            expected = seen
        assert seen == expected


@pytest.mark.parametrize("global_batch_size", [1, 2, 3, 4, 5, 7, 12, 16, 17, 31, 64])
def test_every_rank_takes_its_share_in_the_same_number_of_micro_batches(global_batch_size):
    """The split at any world size, against its definition: contiguous shares in rank order that
    differ by at most one sample; on every rank ceil(ceil(G / W) / micro) micro-batches of at most
    `micro` samples, whose sizes differ by at most one (empty ones only where a share is shorter)."""
    batch = [100 + 3 * i for i in range(global_batch_size)]  # sample ids unlike positions
    for ws in range(1, global_batch_size + 1):
        for mb in (1, 2, 3, 4, 8):
            parts = [rank_micro_batches(batch, rank=r, world_size=ws, micro_batch_size=mb) for r in range(ws)]
            shares = [[i for micro in part for i in micro] for part in parts]
            where = f"G={global_batch_size} W={ws} micro={mb}: {parts}"
            assert [i for share in shares for i in share] == batch, where
            assert max(map(len, shares)) - min(map(len, shares)) <= 1, where
            assert sorted((len(s) for s in shares), reverse=True) == [len(s) for s in shares], where
            steps = math.ceil(math.ceil(global_batch_size / ws) / mb)
            assert {len(part) for part in parts} == {steps}, where
            for part in parts:
                sizes = [len(micro) for micro in part]
                assert max(sizes) <= mb and max(sizes) - min(sizes) <= 1, where
                assert min(sizes) > 0 or sum(sizes) < steps, where  # empty only when the share is short


def test_the_start_up_log_states_the_split():
    assert describe_split(16, world_size=3, micro_batch_size=4) == (
        "global batch: 16 samples per step over 3 rank(s), 2 micro-batch(es) per rank of at most 4 "
        "(train.micro_batch_size): 6 on rank 0 (3+3), 5 on ranks 1-2 (3+2)")
    assert describe_split(5, world_size=3, micro_batch_size=1).endswith(
        "2 on ranks 0-1 (1+1), 1 on rank 2 (1+0); an empty micro-batch runs with its loss weighted 0")
    assert describe_split(64, world_size=2, micro_batch_size=4).endswith("32 on each rank (8x4)")


def test_a_global_batch_smaller_than_the_world_is_refused():
    with pytest.raises(ValueError, match=r"global batch of 2 samples over 3 ranks.*train.global_batch_size"):
        rank_micro_batches([5, 6], rank=0, world_size=3, micro_batch_size=1)


def test_epoch_drops_partial_batch_and_reshuffles():
    s = GlobalSampler(num_samples=10, global_batch_size=4, seed=0)
    e0 = s.next_global_batch() + s.next_global_batch()
    e1 = s.next_global_batch()
    assert s.epoch == 1 and len(set(e0)) == 8 and s.samples_seen == 12
    assert e1 != e0[:4]


def test_cursor_resumes_the_same_sequence():
    a = GlobalSampler(num_samples=50, global_batch_size=6, seed=9)
    for _ in range(11):
        a.next_global_batch()
    b = GlobalSampler(num_samples=50, global_batch_size=6, seed=9)
    b.load_state_dict(a.state_dict())
    assert [a.next_global_batch() for _ in range(10)] == [b.next_global_batch() for _ in range(10)]


def test_cursor_refuses_other_data():
    a = GlobalSampler(num_samples=50, global_batch_size=6, seed=9)
    b = GlobalSampler(num_samples=60, global_batch_size=6, seed=9)
    with pytest.raises(ValueError, match="num_samples=50 but this run has 60"):
        b.load_state_dict(a.state_dict())


def test_eval_batches_cover_each_sample_once_with_equal_counts():
    for ws in (1, 2, 3, 4):
        parts = [eval_micro_batches(21, rank=r, world_size=ws, micro_batch_size=2) for r in range(ws)]
        assert len({len(p) for p in parts}) == 1
        assert sorted(i for p in parts for m in p for i in m) == list(range(21))


def test_synthetic_corpus_is_deterministic_and_learnable():
    cfg = compose_config().data
    train, val = build_datasets(cfg, vocab_size=512, seed=1)
    again, _ = build_datasets(cfg, vocab_size=512, seed=1)
    assert (train.batch([5, 7]) == again.batch([5, 7])).all()
    assert not (train.batch([0]) == val.batch([0])).all()
    x = train.batch(list(range(64))).numpy()
    # most transitions follow the table: the successor is one of the token's few likely successors
    hits = np.mean([x[i, t + 1] in train.table[x[i, t]] for i in range(64) for t in range(64)])
    assert hits > 0.85


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_token_file_splits_never_overlap(tmp_path, dtype):
    tokens = np.arange(10_000, dtype=dtype) % 1000
    path = tmp_path / "train.bin"
    tokens.tofile(path)
    cfg = compose_config(["data.kind=tokens", f"data.path={path}", f"data.token_dtype={dtype}",
                          "data.seq_len=16", "data.val_fraction=0.1"]).data
    train, val = build_datasets(cfg, vocab_size=1000, seed=0)
    last_train = train.batch([len(train) - 1])[0]
    first_val = val.batch([0])[0]
    assert (train.batch([0])[0].numpy() == tokens[:17]).all()
    # positions (token value = position % 1000 here) of the two splits do not meet
    assert int(last_train[-1]) < int(first_val[0]) or int(first_val[0]) < 100
    assert len(train) + len(val) + 1 == (len(tokens) - 1) // 16


def test_token_file_rejects_ids_beyond_vocab(tmp_path):
    path = tmp_path / "t.bin"
    (np.arange(5000, dtype=np.uint16)).tofile(path)
    cfg = compose_config(["data.kind=tokens", f"data.path={path}", "data.seq_len=16"]).data
    train, _ = build_datasets(cfg, vocab_size=512, seed=0)
    with pytest.raises(ValueError, match="token id .* vocabulary has 512"):
        train.batch([len(train) - 1])


def test_text_file_is_byte_tokenized(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("héllo world " * 200)
    cfg = compose_config(["data.kind=text", f"data.path={path}", "data.seq_len=8"]).data
    train, _ = build_datasets(cfg, vocab_size=512, seed=0)
    assert bytes(train.batch([0])[0].tolist()) == "héllo world "[:9].encode()[:9]
    with pytest.raises(ValueError, match="byte-level vocabulary of 256"):
        build_datasets(cfg, vocab_size=100, seed=0)


def test_missing_data_file_is_a_clear_error(tmp_path):
    cfg = compose_config(["data.kind=tokens", f"data.path={tmp_path / 'nope.bin'}"]).data
    with pytest.raises(FileNotFoundError, match="data.path=.*nope.bin"):
        build_datasets(cfg, vocab_size=512, seed=0)
