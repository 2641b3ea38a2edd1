"""`data.kind=hf`: documents or conversations from local files, tokenized with a Hugging Face
tokenizer (through the shared cache of token_cache.py), as fixed-length training samples.
`data.packing` decides how documents become samples:

- `true` (isolated packing, packing.py): whole documents bin-packed into samples of seq_len input
  positions, each document's positions restarting at 0 so that the model keeps it apart from the
  others in its sample; the tail is padding. A document longer than the window follows
  `data.overlong`: `truncate`, `drop` or `split` (into consecutive windows).
- `false`: one document per sample, padded, with the same `overlong` rule.
- `concat`: the split's documents one after another (each ends with EOS for text; a chat template
  closes its own turns), cut into seq_len + 1 windows as for a token file. Nothing is padded, and
  attention runs across document boundaries: for pretraining on a stream of text.

Targets are -100 wherever the target token is not trained on (padding, and for chat SFT every
token that is not the assistant's), so the summed cross-entropy covers trained tokens only.
`target_count` gives the number of trained tokens of any set of samples without a forward, so
every rank knows the global batch's count (the loss normaliser) without a collective.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch

from fsdpkit.config.schema import PACKING, DataConfig
from fsdpkit.data.datasets import Batch
from fsdpkit.data.packing import best_fit_decreasing, pieces
from fsdpkit.data.token_cache import (
    TokenizedCorpus,
    TokenizeSpec,
    pick_builder,
    resolve_files,
    tokenized_corpus,
)
from fsdpkit.data.tokenizer import check_vocab, load_tokenizer, tokenizer_fingerprint
from fsdpkit.log import get_logger

IGNORE_INDEX = -100

log = get_logger("data")


def packing_mode(value: object) -> str:
    """`data.packing` as one of PACKING (YAML and the command line give true/false as booleans).

    Raises:
        ValueError: any other value.
    """
    mode = str(value).lower()
    if mode not in PACKING:
        raise ValueError(f"data.packing must be true (whole documents packed, each kept apart), false (one document "
                         f"per sample, padded) or concat (documents run together across samples, for pretraining), "
                         f"got {value!r}")
    return mode


@dataclass
class SplitReport:
    """What became of a split's documents (logged, and asserted by tests)."""

    documents: int
    samples: int
    truncated: int
    dropped: int
    trained_tokens: int
    untrained: int = 0
    """Documents with no trained target (a chat with no assistant turn), left out."""
    split: int = 0
    """Documents longer than the window cut into several pieces (data.overlong=split)."""
    padding: float = 0.0
    """Share of the samples' input positions that are padding."""


class ConcatenatedDocuments:
    """Documents [first_doc, last_doc) of a corpus as one token stream cut into L + 1 windows."""

    def __init__(self, corpus: TokenizedCorpus, *, first_doc: int, last_doc: int, seq_len: int, fingerprint: str):
        self.corpus, self.fingerprint = corpus, fingerprint
        self.ids, self.mask, self.seq_len = corpus.ids, corpus.mask, seq_len
        self.start, end = int(corpus.offsets[first_doc]), int(corpus.offsets[last_doc])
        self.count = max(0, (end - self.start - 1) // seq_len)
        self._trained = None
        if self.mask is not None:  # trained targets per sample, from a running count of the mask
            csum = np.concatenate([[0], np.cumsum(self.mask[self.start : end], dtype=np.int64)])
            starts = np.arange(self.count, dtype=np.int64) * seq_len
            self._trained = csum[starts + seq_len + 1] - csum[starts + 1]
        self.report = SplitReport(documents=last_doc - first_doc, samples=self.count, truncated=0, dropped=0,
                                  trained_tokens=(int(self._trained.sum()) if self._trained is not None
                                                  else self.count * seq_len))

    def __len__(self) -> int:
        return self.count

    def _window(self, i: int) -> slice:
        a = self.start + i * self.seq_len
        return slice(a, a + self.seq_len + 1)

    def batch(self, indices: list[int]) -> torch.Tensor:
        """Token ids [B, L + 1]."""
        return torch.from_numpy(np.stack([np.asarray(self.ids[self._window(i)], dtype=np.int64) for i in indices]))

    def labeled_batch(self, indices: list[int]) -> Batch:
        tokens = self.batch(indices)  # [B, L + 1]
        targets = tokens[:, 1:].clone()
        if self.mask is not None:
            keep = torch.from_numpy(np.stack([np.asarray(self.mask[self._window(i)][1:], dtype=bool) for i in indices]))
            targets[~keep] = IGNORE_INDEX
        return Batch(tokens[:, :-1], targets)

    def target_count(self, indices: list[int]) -> int:
        if self._trained is None:
            return len(indices) * self.seq_len
        return int(self._trained[indices].sum())


class DocumentSamples:
    """Whole documents (pieces of at most L + 1 tokens) grouped into samples of L input positions:
    several per sample when packed (isolated), one per sample when padded.

    Sample b holds pieces items[bin_offsets[b]:bin_offsets[b + 1]]; piece p is tokens
    [starts[p], starts[p] + lengths[p]) of the corpus and fills lengths[p] - 1 input positions, its
    positions restarting at 0. The rest of the sample is padding (its own positions from 0, no
    targets).
    """

    def __init__(self, corpus: TokenizedCorpus, *, first_doc: int, last_doc: int, seq_len: int, pad_id: int,
                 overlong: str, packed: bool, fingerprint: str):
        self.corpus, self.fingerprint = corpus, fingerprint
        self.ids, self.mask, self.seq_len, self.pad_id = corpus.ids, corpus.mask, seq_len, pad_id
        doc_starts = corpus.offsets[first_doc:last_doc]
        doc_lengths = corpus.offsets[first_doc + 1 : last_doc + 1] - doc_starts
        starts, lengths, truncated, dropped = pieces(doc_starts, doc_lengths, seq_len=seq_len, overlong=overlong)
        if self.mask is None:
            trained = lengths - 1
        else:  # trained targets of a piece: its mask after the first token
            csum = np.concatenate([[0], np.cumsum(self.mask, dtype=np.int64)])
            trained = csum[starts + lengths] - csum[starts + 1]
        # A conversation with no assistant turn has nothing to train: packing leaves it out; one document per
        # sample keeps it (the samples of runs saved before packing kept documents apart), as a fully masked sample.
        untrained = trained == 0
        if packed:
            starts, lengths, trained = starts[~untrained], lengths[~untrained], trained[~untrained]
        self.starts, self.lengths = starts, lengths
        if packed:
            self.bin_offsets, self.items = best_fit_decreasing(self.lengths - 1, capacity=seq_len)
        else:
            self.bin_offsets, self.items = np.arange(len(self.starts) + 1), np.arange(len(self.starts))
        samples = len(self.bin_offsets) - 1
        self._trained = (np.add.reduceat(trained[self.items], self.bin_offsets[:-1]) if samples
                         else np.zeros(0, dtype=np.int64))
        filled = int((self.lengths - 1).sum())
        self.report = SplitReport(documents=last_doc - first_doc, samples=samples, truncated=truncated,
                                  dropped=dropped, trained_tokens=int(trained.sum()), untrained=int(untrained.sum()),
                                  split=int((doc_lengths > seq_len + 1).sum()) if overlong == "split" else 0,
                                  padding=1 - filled / (samples * seq_len) if samples else 0.0)

    def __len__(self) -> int:
        return len(self.bin_offsets) - 1

    def labeled_batch(self, indices: list[int]) -> Batch:
        """Inputs, targets and positions [B, L]; positions are None when every sample holds one
        document (its positions are then 0..L-1, as the model assumes without them)."""
        n = self.seq_len
        inputs = np.full((len(indices), n), self.pad_id, dtype=np.int64)
        targets = np.full((len(indices), n), IGNORE_INDEX, dtype=np.int64)
        positions = np.zeros((len(indices), n), dtype=np.int64)
        several = False
        for row, b in enumerate(indices):
            at = 0
            members = self.items[self.bin_offsets[b] : self.bin_offsets[b + 1]].tolist()
            several |= len(members) > 1
            for p in members:
                a, k = int(self.starts[p]), int(self.lengths[p])
                tokens = np.asarray(self.ids[a : a + k], dtype=np.int64)
                inputs[row, at : at + k - 1] = tokens[:-1]
                targets[row, at : at + k - 1] = (tokens[1:] if self.mask is None else
                                                 np.where(self.mask[a + 1 : a + k], tokens[1:], IGNORE_INDEX))
                positions[row, at : at + k - 1] = np.arange(k - 1)
                at += k - 1
            positions[row, at:] = np.arange(n - at)  # the padding: a block of its own
        return Batch(torch.from_numpy(inputs), torch.from_numpy(targets),
                     torch.from_numpy(positions) if several else None)

    def batch(self, indices: list[int]) -> torch.Tensor:
        """Token ids [B, L + 1] of samples that hold one document each (padding included).

        Raises:
            ValueError: a sample holds several documents (their boundaries need the positions).
        """
        tokens = np.full((len(indices), self.seq_len + 1), self.pad_id, dtype=np.int64)
        for row, b in enumerate(indices):
            first, stop = int(self.bin_offsets[b]), int(self.bin_offsets[b + 1])
            if stop - first > 1:
                raise ValueError(f"sample {b} holds {stop - first} documents; read packed samples with labeled_batch, "
                                 "whose positions keep them apart")
            p = int(self.items[first])
            a, k = int(self.starts[p]), int(self.lengths[p])
            tokens[row, :k] = self.ids[a : a + k]
        return torch.from_numpy(tokens)

    def target_count(self, indices: list[int]) -> int:
        return int(self._trained[indices].sum())


# What the data cursor's fingerprint records for each mode: `concat` and `false` keep the names that
# runs saved before isolated packing recorded for them (true and false), so those runs resume.
_IDENTITY = {"concat": "True", "false": "False", "true": "isolated"}


def _split(corpus: TokenizedCorpus, cfg: DataConfig, *, pad_id: int, first_doc: int, last_doc: int, fingerprint: str):
    common = dict(first_doc=first_doc, last_doc=last_doc, seq_len=cfg.seq_len, fingerprint=fingerprint)
    mode = packing_mode(cfg.packing)
    if mode == "concat":
        return ConcatenatedDocuments(corpus, **common)
    return DocumentSamples(corpus, pad_id=pad_id, overlong=cfg.overlong, packed=mode == "true", **common)


def _corpus(cfg: DataConfig, tok, *, patterns: list[str], setting: str, fingerprint: str) -> TokenizedCorpus:
    files = resolve_files(patterns, setting=setting)
    spec = TokenizeSpec(files=tuple(files), builder=pick_builder(files, cfg.format), text_field=cfg.text_field,
                        messages_field=cfg.messages_field)
    return tokenized_corpus(spec, tok, tokenizer_fingerprint=fingerprint, cache_dir=cfg.cache_dir,
                            num_proc=cfg.num_proc)


def build_hf_datasets(cfg: DataConfig, *, vocab_size: int):
    """(train, validation) for data.kind=hf. Validation is `data.val_files`, or else the last
    `val_fraction` of the documents (at least one), never overlapping training.

    Raises:
        ValueError: bad settings, a tokenizer larger than the model's vocabulary, or too little data.
    """
    if not cfg.tokenizer:
        raise ValueError("data.kind=hf needs data.tokenizer=<folder with a Hugging Face tokenizer>")
    tok = load_tokenizer(cfg.tokenizer)
    check_vocab(tok, model_vocab=vocab_size, spec=cfg.tokenizer)
    fingerprint = tokenizer_fingerprint(tok)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    corpus = _corpus(cfg, tok, patterns=list(cfg.files), setting="data.files", fingerprint=fingerprint)
    n = corpus.num_documents
    # Identifies the sample order's universe: the data cursor refuses to resume on other data.
    mode = packing_mode(cfg.packing)
    identity = f"{corpus.key}:{list(cfg.val_files) or cfg.val_fraction}:{_IDENTITY[mode]}:{cfg.overlong}:{cfg.seq_len}"
    common = dict(pad_id=pad_id, fingerprint=hashlib.sha256(identity.encode()).hexdigest()[:16])
    if cfg.val_files:
        val_corpus = _corpus(cfg, tok, patterns=list(cfg.val_files), setting="data.val_files", fingerprint=fingerprint)
        train = _split(corpus, cfg, first_doc=0, last_doc=n, **common)
        val = _split(val_corpus, cfg, first_doc=0, last_doc=val_corpus.num_documents, **common)
    else:
        n_val = max(1, round(n * cfg.val_fraction))
        train = _split(corpus, cfg, first_doc=0, last_doc=n - n_val, **common)
        val = _split(corpus, cfg, first_doc=n - n_val, last_doc=n, **common)
    for name, part in (("train", train), ("validation", val)):
        r = part.report
        if r.samples < 1:
            raise ValueError(f"the {name} split has no sample of data.seq_len={cfg.seq_len} + 1 tokens "
                             f"({r.documents} documents, {r.dropped} dropped as too long, {r.untrained} with no "
                             "trained token); add data, lower data.seq_len or change data.val_fraction / "
                             "data.overlong")
        log.info("data %s: %d documents -> %d samples, %d trained tokens; %s", name, r.documents, r.samples,
                 r.trained_tokens, _describe(r, mode=mode, seq_len=cfg.seq_len, overlong=cfg.overlong))
    return train, val


def _describe(r: SplitReport, *, mode: str, seq_len: int, overlong: str) -> str:
    """The start-up line's account of how documents became samples."""
    if mode == "concat":
        return ("data.packing=concat: documents run one after another across samples, and each attends to the "
                "documents before it in its sample (for pretraining; data.packing=true keeps them apart)")
    how = ("packed whole, each document attending only to itself" if mode == "true" else "one document per sample")
    longer = {"truncate": f"{r.truncated} truncated", "drop": f"{r.dropped} dropped",
              "split": f"{r.split} split into windows"}[overlong]
    untrained = ""
    if r.untrained:
        untrained = f", {r.untrained} with no trained token" + (" left out" if mode == "true" else "")
    return (f"{how}; {100 * r.padding:.1f}% of the input positions are padding; longer than {seq_len + 1} tokens: "
            f"{longer}{untrained}")
