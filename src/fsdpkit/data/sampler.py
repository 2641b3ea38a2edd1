"""The global sample order, and each rank's slice of it.

The order of samples is a function of the seed and the epoch only; a step consumes the next
`global_batch_size` samples of it, whatever the world size. Each rank takes a contiguous slice of
the global batch and splits it into micro-batches. The cursor (epoch, position) counts global
samples, so it survives a change of world size unchanged.
"""

from __future__ import annotations

from typing import Any

import torch


class GlobalSampler:
    """Deterministic, resumable, world-size-invariant batch order (a `Stateful`)."""

    def __init__(self, *, num_samples: int, global_batch_size: int, seed: int, shuffle: bool = True,
                 fingerprint: str = ""):
        if global_batch_size > num_samples:
            raise ValueError(
                f"train.global_batch_size={global_batch_size} exceeds the {num_samples} training samples of one epoch"
            )
        self.num_samples, self.global_batch_size = num_samples, global_batch_size
        self.seed, self.shuffle = seed, shuffle
        self.fingerprint = fingerprint  # what the samples are (tokenized data); "" for built-in data
        self.epoch, self.position, self.samples_seen = 0, 0, 0
        self._order_epoch, self._order = -1, torch.empty(0, dtype=torch.long)

    def _epoch_order(self) -> torch.Tensor:
        if self._order_epoch != self.epoch:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
                self._order = torch.randperm(self.num_samples, generator=g)
            else:
                self._order = torch.arange(self.num_samples)
            self._order_epoch = self.epoch
        return self._order

    def next_global_batch(self) -> list[int]:
        """The next `global_batch_size` sample indices; a partial batch at an epoch's end is dropped."""
        if self.position + self.global_batch_size > self.num_samples:
            self.epoch, self.position = self.epoch + 1, 0
        batch = self._epoch_order()[self.position : self.position + self.global_batch_size].tolist()
        self.position += self.global_batch_size
        self.samples_seen += self.global_batch_size
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "samples_seen": self.samples_seen,
            "num_samples": self.num_samples,
            "seed": self.seed,
            "shuffle": self.shuffle,
            **({"fingerprint": self.fingerprint} if self.fingerprint else {}),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("num_samples", "seed", "shuffle"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"data cursor was saved with {key}={state[key]!r} but this run has {getattr(self, key)!r}; "
                    "the sample order would differ. Restore the data settings or start fresh (resume=none)"
                )
        if state.get("fingerprint", "") != self.fingerprint:
            raise ValueError(
                f"data cursor was saved for data {state.get('fingerprint') or '(built-in)'} but this run reads "
                f"{self.fingerprint or '(built-in)'} (different files, tokenizer, seq_len, packing or split); the "
                "sample order would differ. Restore the data settings or start fresh (checkpoint.resume=none). A "
                "run saved before data.packing=true kept documents apart (it ran them together) resumes with "
                "data.packing=concat"
            )
        self.epoch, self.position, self.samples_seen = state["epoch"], state["position"], state["samples_seen"]


def rank_micro_batches(global_batch: list[int], *, rank: int, world_size: int,
                       micro_batch_size: int) -> list[list[int]]:
    """This rank's contiguous slice of the global batch, split into micro-batches.

    Raises:
        ValueError: the batch does not split evenly (samples would be silently dropped).
    """
    per_rank = len(global_batch) // world_size
    if per_rank * world_size != len(global_batch) or per_rank % micro_batch_size:
        raise ValueError(
            f"a global batch of {len(global_batch)} does not split into {world_size} ranks x micro-batches of "
            f"{micro_batch_size}; change train.global_batch_size or train.micro_batch_size"
        )
    mine = global_batch[rank * per_rank : (rank + 1) * per_rank]
    return [mine[i : i + micro_batch_size] for i in range(0, per_rank, micro_batch_size)]


def eval_micro_batches(num_samples: int, *, rank: int, world_size: int, micro_batch_size: int) -> list[list[int]]:
    """Validation samples 0..num_samples-1 split over ranks. Every rank gets the same number of
    micro-batches (FSDP needs every rank in every forward); ranks short of samples get empty
    lists, which the caller runs as fully masked batches."""
    per_pass = world_size * micro_batch_size
    passes = -(-num_samples // per_pass)
    out = []
    for p in range(passes):
        start = p * per_pass + rank * micro_batch_size
        out.append(list(range(start, min(start + micro_batch_size, num_samples))))
    return out
