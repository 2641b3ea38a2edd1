"""The global sample order, and each rank's share of it.

The order of samples is a function of the seed and the epoch only; a step consumes the next
`global_batch_size` samples of it, whatever the world size. Each rank takes a contiguous share of
the global batch (shares differ by at most one sample) and splits it into as many micro-batches as
every other rank (`rank_micro_batches`). The cursor (epoch, position) counts global samples, so it
survives a change of world size unchanged.
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


def rank_share(global_batch_size: int, *, rank: int, world_size: int) -> tuple[int, int]:
    """(start, length) of `rank`'s contiguous share of a global batch: the first
    global_batch_size % world_size ranks take one sample more than the others.

    Raises:
        ValueError: fewer samples than ranks (a rank would have nothing to train on).
    """
    if global_batch_size < world_size:
        raise ValueError(
            f"a global batch of {global_batch_size} samples over {world_size} ranks leaves a rank without one; set "
            f"train.global_batch_size to at least {world_size}, or run on fewer ranks")
    base, extra = divmod(global_batch_size, world_size)
    return rank * base + min(rank, extra), base + (rank < extra)


def micro_batches_per_step(global_batch_size: int, *, world_size: int, micro_batch_size: int) -> int:
    """Micro-batches every rank runs per optimizer step: the largest share in micro-batches of at
    most `micro_batch_size` samples."""
    largest = -(-global_batch_size // world_size)
    return -(-largest // micro_batch_size)


def rank_micro_batches(global_batch: list[int], *, rank: int, world_size: int,
                       micro_batch_size: int) -> list[list[int]]:
    """This rank's share of the global batch (`rank_share`), split into `micro_batches_per_step`
    micro-batches of at most `micro_batch_size` samples whose sizes differ by at most one (larger
    first). Every rank gets the same number (FSDP's collectives need every rank in every forward
    and backward); a micro-batch is empty only where a share is shorter than that number (5 samples
    over 3 ranks in micro-batches of 1: 1+1, 1+1, 1+empty), and the caller still runs it, adding
    nothing. A function of the batch, the world size and micro_batch_size only.

    Raises:
        ValueError: fewer samples than ranks.
    """
    start, size = rank_share(len(global_batch), rank=rank, world_size=world_size)
    mine = global_batch[start : start + size]
    steps = micro_batches_per_step(len(global_batch), world_size=world_size, micro_batch_size=micro_batch_size)
    base, extra = divmod(size, steps)
    bounds = [i * base + min(i, extra) for i in range(steps + 1)]
    return [mine[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def describe_split(global_batch_size: int, *, world_size: int, micro_batch_size: int) -> str:
    """One line for the start-up log: samples per rank and micro-batches per step, e.g. `global batch:
    16 samples per step over 3 rank(s), 2 micro-batch(es) per rank of at most 4
    (train.micro_batch_size): 6 on rank 0 (3+3), 5 on ranks 1-2 (3+2)`."""
    steps = micro_batches_per_step(global_batch_size, world_size=world_size, micro_batch_size=micro_batch_size)
    groups: dict[int, list[int]] = {}  # share -> its ranks (at most two shares)
    for rank in range(world_size):
        groups.setdefault(rank_share(global_batch_size, rank=rank, world_size=world_size)[1], []).append(rank)

    def ranks(r: list[int]) -> str:
        return "each rank" if len(r) == world_size > 1 else f"rank {r[0]}" if len(r) == 1 else f"ranks {r[0]}-{r[-1]}"

    batch = list(range(global_batch_size))

    def sizes(rank: int) -> str:
        parts = [len(m) for m in rank_micro_batches(batch, rank=rank, world_size=world_size,
                                                    micro_batch_size=micro_batch_size)]
        if steps <= 4:
            return "+".join(map(str, parts))
        return " + ".join(f"{parts.count(n)}x{n}" for n in dict.fromkeys(parts))

    shares = ", ".join(f"{share} on {ranks(r)} ({sizes(r[0])})" for share, r in groups.items())
    empty = "; an empty micro-batch runs with its loss weighted 0" if min(groups) < steps else ""
    return (f"global batch: {global_batch_size} samples per step over {world_size} rank(s), {steps} micro-batch(es) "
            f"per rank of at most {micro_batch_size} (train.micro_batch_size): {shares}{empty}")


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
