"""Packing whole documents into fixed-length samples, each document kept apart.

A document of n tokens trains n - 1 next-token targets and takes n - 1 input positions (inputs
doc[:-1], targets doc[1:]), so a sample of `seq_len` input positions holds documents whose
lengths minus one add up to at most `seq_len`. The documents of a split are assigned to samples
("bins") by best-fit decreasing: longest first, each into the fullest bin it still fits, else a
new one. The assignment depends on the documents' lengths alone: the same bins at any world size
and on every rank, so the sampler's global order (and an elastic resume) is unchanged.

Inside a sample each document's positions restart at 0; the model isolates documents from those
positions (transformers' packed-sequence masks, flash-attention's varlen kernels, fsdpkit's own
Llama document mask: `fsdpkit.model`). The unused tail is padding: its own positions from 0, no
targets.
"""

from __future__ import annotations

import numpy as np

from fsdpkit.config.schema import OVERLONG


def pieces(starts: np.ndarray, lengths: np.ndarray, *, seq_len: int,
           overlong: str) -> tuple[np.ndarray, np.ndarray, int, int]:
    """Documents (token offsets `starts`, token counts `lengths`) as pieces of at most seq_len + 1
    tokens, following `overlong` for longer ones: `truncate` keeps the first seq_len + 1 tokens,
    `drop` leaves the document out, `split` cuts it into consecutive pieces that overlap by one
    token, so that each of its targets is trained once (a later piece does not see the text
    before it). Documents of fewer than 2 tokens have no target and are left out.

    Returns (piece starts, piece lengths, documents truncated, documents dropped), in document order.
    """
    if overlong not in OVERLONG:
        raise ValueError(f"data.overlong must be one of {', '.join(OVERLONG)}, got {overlong!r}")
    window = seq_len + 1
    too_long = lengths > window
    if overlong == "split":
        # piece k of a document starts k * seq_len tokens in; ceil((n - 1) / seq_len) pieces
        counts = np.where(lengths > 1, -(-(lengths - 1) // seq_len), 0)
        doc = np.repeat(np.arange(len(lengths)), counts)
        k = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        out_starts = starts[doc] + k * seq_len
        out_lengths = np.minimum(lengths[doc] - k * seq_len, window)
        return out_starts.astype(np.int64), out_lengths.astype(np.int64), 0, 0
    keep = (lengths > 1) & ~too_long if overlong == "drop" else lengths > 1
    return (starts[keep].astype(np.int64), np.minimum(lengths[keep], window).astype(np.int64),
            int(too_long.sum()) if overlong == "truncate" else 0, int(too_long.sum()) if overlong == "drop" else 0)


def best_fit_decreasing(sizes: np.ndarray, *, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """Assign items of `sizes` (each 1..capacity) to as few bins of `capacity` as best fit
    decreasing finds: items in decreasing size (ties in index order), each into the open bin with
    the least room that still holds it, else into a new bin. Deterministic.

    Returns (bin_offsets [bins + 1], items [n]): bin b holds items[bin_offsets[b]:bin_offsets[b + 1]],
    in the order they were placed.
    """
    sizes = np.asarray(sizes, dtype=np.int64)
    if len(sizes) and (sizes.min() < 1 or sizes.max() > capacity):
        raise ValueError(f"item sizes must lie in 1..{capacity}, got {sizes.min()}..{sizes.max()}")
    order = np.argsort(-sizes, kind="stable")
    # Open bins grouped by the room they have left; bit r of `rooms` is set while some bin has room r,
    # so the smallest room >= s is the lowest set bit of rooms >> s.
    by_room: list[list[int]] = [[] for _ in range(capacity + 1)]
    rooms = 0
    bin_of = np.empty(len(sizes), dtype=np.int64)
    n_bins = 0
    for item in order.tolist():
        s = int(sizes[item])
        fits = rooms >> s
        if fits:
            room = s + (fits & -fits).bit_length() - 1
            b = by_room[room].pop()
            if not by_room[room]:
                rooms &= ~(1 << room)
        else:
            room, b = capacity, n_bins
            n_bins += 1
        bin_of[item] = b
        left = room - s
        if left:
            if not by_room[left]:
                rooms |= 1 << left
            by_room[left].append(b)
    # items grouped by bin, each bin's items in placement order (a stable sort of the placement sequence)
    placed = order[np.argsort(bin_of[order], kind="stable")]
    offsets = np.zeros(n_bins + 1, dtype=np.int64)
    np.cumsum(np.bincount(bin_of, minlength=n_bins), out=offsets[1:])
    return offsets, placed
