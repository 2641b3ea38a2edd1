"""Datasets: random access by sample index, each sample `seq_len + 1` token ids (inputs and
next-token targets). Three sources, one interface:

- SyntheticCorpus: built in, deterministic, with learnable structure (no download);
- TokenFile: a flat binary file of uint16/uint32 token ids (what nanoGPT-style pipelines write),
  read through numpy memmap;
- a text file through the byte-level tokenizer (one token per UTF-8 byte, vocabulary 256);
- local jsonl/json/parquet/csv/text files through a Hugging Face tokenizer (hf_dataset.py).

`labeled_batch` gives a `Batch`: inputs, targets with -100 where a target is not trained on,
and, for samples that pack several documents, the positions that keep them apart;
`target_count` gives the number of trained targets of any samples (the loss normaliser).
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple, Protocol

import numpy as np
import torch

from fsdpkit.config.schema import DataConfig

BYTE_VOCAB = 256


class Batch(NamedTuple):
    """One micro-batch as the model and the loss take it."""

    inputs: torch.Tensor
    """[B, L] token ids."""
    targets: torch.Tensor
    """[B, L] next-token targets; -100 where not trained on (padding, prompts, document ends)."""
    positions: torch.Tensor | None = None
    """[B, L] each token's position in its own document, restarting at 0 where a document starts
    (the model attends within a document only); None: one sequence per row, positions 0..L-1."""


class Dataset(Protocol):
    seq_len: int

    def __len__(self) -> int: ...

    def batch(self, indices: list[int]) -> torch.Tensor:
        """Samples `indices` as a LongTensor [len(indices), seq_len + 1]."""
        ...

    def labeled_batch(self, indices: list[int]) -> Batch:
        """Inputs, targets (-100 where not trained on) and positions, each [B, seq_len]."""
        ...

    def target_count(self, indices: list[int]) -> int:
        """Trained targets (not -100) in samples `indices`."""
        ...


def shifted(tokens: torch.Tensor) -> Batch:
    """tokens [B, L + 1] -> inputs [B, L] and next-token targets [B, L], every target trained on."""
    return Batch(tokens[:, :-1], tokens[:, 1:])


class SyntheticCorpus:
    """A Markov chain over the vocabulary: each token has a few likely successors (a table drawn
    from the seed), followed with probability `1 - noise`; otherwise a uniform token. A model can
    learn the table, so the loss falls from ln(vocab) towards the chain's entropy.

    Sample i of a split is drawn from its own generator seeded by (seed, split, i): any sample can
    be produced on any rank in any order. Train and validation use different split streams.
    """

    SUCCESSORS = 4
    NOISE = 0.1

    def __init__(self, *, vocab_size: int, seq_len: int, num_samples: int, seed: int, split: int):
        self.vocab_size, self.seq_len, self.num_samples = vocab_size, seq_len, num_samples
        self.seed, self.split = seed, split
        table_rng = np.random.default_rng([seed, 0xC0FFEE])
        self.table = table_rng.integers(0, vocab_size, size=(vocab_size, self.SUCCESSORS))

    def __len__(self) -> int:
        return self.num_samples

    def _sample(self, i: int) -> np.ndarray:
        n = self.seq_len + 1
        rng = np.random.default_rng([self.seed, self.split, i])
        choice = rng.integers(0, self.SUCCESSORS, size=n)
        noisy = rng.random(n) < self.NOISE
        uniform = rng.integers(0, self.vocab_size, size=n)
        out = np.empty(n, dtype=np.int64)
        out[0] = uniform[0]
        for t in range(1, n):
            out[t] = uniform[t] if noisy[t] else self.table[out[t - 1], choice[t]]
        return out

    def batch(self, indices: list[int]) -> torch.Tensor:
        return torch.from_numpy(np.stack([self._sample(i) for i in indices]))

    def labeled_batch(self, indices: list[int]) -> Batch:
        return shifted(self.batch(indices))

    def target_count(self, indices: list[int]) -> int:
        return len(indices) * self.seq_len


class TokenFile:
    """Fixed-length samples from a memory-mapped token file: sample i covers tokens
    [i * seq_len, i * seq_len + seq_len + 1). Samples [first, first + count) form this split."""

    def __init__(self, tokens: np.ndarray, *, seq_len: int, first: int, count: int, vocab_size: int, path: str):
        self.tokens, self.seq_len, self.first, self.count = tokens, seq_len, first, count
        self.vocab_size, self.path = vocab_size, path

    def __len__(self) -> int:
        return self.count

    def batch(self, indices: list[int]) -> torch.Tensor:
        rows = []
        for i in indices:
            start = (self.first + i) * self.seq_len
            rows.append(np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int64))
        out = torch.from_numpy(np.stack(rows))
        if int(out.max()) >= self.vocab_size:
            raise ValueError(
                f"data file {self.path} holds token id {int(out.max())} but the model's vocabulary has "
                f"{self.vocab_size} entries; set model.vocab_size or check data.token_dtype"
            )
        return out

    def labeled_batch(self, indices: list[int]) -> Batch:
        return shifted(self.batch(indices))

    def target_count(self, indices: list[int]) -> int:
        return len(indices) * self.seq_len


def _open_tokens(cfg: DataConfig) -> np.ndarray:
    path = Path(cfg.path)
    if not path.is_file():
        raise FileNotFoundError(f"data.path={cfg.path!r} is not a file (data.kind={cfg.kind})")
    dtype = np.uint8 if cfg.kind == "text" else np.dtype(cfg.token_dtype)
    if cfg.kind == "tokens" and path.stat().st_size % np.dtype(dtype).itemsize:
        raise ValueError(f"data.path={cfg.path!r} has {path.stat().st_size} bytes, not a whole number of "
                         f"{cfg.token_dtype} tokens; check data.token_dtype")
    return np.memmap(path, dtype=dtype, mode="r")


def build_datasets(cfg: DataConfig, *, vocab_size: int, seed: int) -> tuple[Dataset, Dataset]:
    """(train, validation). The validation split never overlaps the training split."""
    if cfg.kind == "hf":
        from fsdpkit.data.hf_dataset import build_hf_datasets  # needs the optional `hf` extra

        return build_hf_datasets(cfg, vocab_size=vocab_size)
    if cfg.kind == "synthetic":
        n_val = max(1, round(cfg.num_samples * cfg.val_fraction))
        common = dict(vocab_size=vocab_size, seq_len=cfg.seq_len, seed=seed)
        return (SyntheticCorpus(num_samples=cfg.num_samples, split=0, **common),
                SyntheticCorpus(num_samples=n_val, split=1, **common))
    if cfg.kind == "text" and vocab_size < BYTE_VOCAB:
        raise ValueError(f"data.kind=text uses a byte-level vocabulary of {BYTE_VOCAB}; model.vocab_size is "
                         f"{vocab_size}")
    tokens = _open_tokens(cfg)
    total = (len(tokens) - 1) // cfg.seq_len
    n_val = max(1, round(total * cfg.val_fraction))
    n_train = total - n_val - 1  # one sample's gap: the last train target never reaches val tokens
    if n_train < 1:
        raise ValueError(f"data.path={cfg.path!r} holds {len(tokens)} tokens: too few for data.seq_len={cfg.seq_len} "
                         f"with a validation split of {cfg.val_fraction}")
    common = dict(seq_len=cfg.seq_len, vocab_size=vocab_size, path=cfg.path)
    return (TokenFile(tokens, first=0, count=n_train, **common),
            TokenFile(tokens, first=n_train + 1, count=n_val, **common))
