"""`data.kind=hf`: documents or conversations from local files, tokenized with a Hugging Face
tokenizer (through the shared cache of token_cache.py), as fixed-length training samples.

- packing=true: the split's documents one after another (each ends with EOS for text; a chat
  template closes its own turns); sample i covers tokens [i*L, i*L + L + 1) of that stream, as
  for a token file. Nothing is truncated or dropped; attention runs across document boundaries.
- packing=false: one document per sample, cut at L + 1 tokens (`overlong=truncate`) or left out
  (`overlong=drop`), then padded; padded targets are -100.

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

from fsdpkit.config.schema import DataConfig
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
OVERLONG = ("truncate", "drop")

log = get_logger("data")


@dataclass
class SplitReport:
    """What became of a split's documents (logged, and asserted by tests)."""

    documents: int
    samples: int
    truncated: int
    dropped: int
    trained_tokens: int


class PackedDocuments:
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

    def labeled_batch(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = self.batch(indices)  # [B, L + 1]
        targets = tokens[:, 1:].clone()
        if self.mask is not None:
            keep = torch.from_numpy(np.stack([np.asarray(self.mask[self._window(i)][1:], dtype=bool) for i in indices]))
            targets[~keep] = IGNORE_INDEX
        return tokens[:, :-1], targets

    def target_count(self, indices: list[int]) -> int:
        if self._trained is None:
            return len(indices) * self.seq_len
        return int(self._trained[indices].sum())


class PaddedDocuments:
    """One document per sample, truncated or dropped beyond L + 1 tokens, padded to L + 1."""

    def __init__(self, corpus: TokenizedCorpus, *, first_doc: int, last_doc: int, seq_len: int, pad_id: int,
                 overlong: str, fingerprint: str):
        if overlong not in OVERLONG:
            raise ValueError(f"data.overlong must be `truncate` or `drop`, got {overlong!r}")
        self.corpus, self.fingerprint = corpus, fingerprint
        self.ids, self.mask, self.seq_len, self.pad_id = corpus.ids, corpus.mask, seq_len, pad_id
        starts = corpus.offsets[first_doc:last_doc]
        lengths = corpus.offsets[first_doc + 1 : last_doc + 1] - starts
        too_long = lengths > seq_len + 1
        keep = ~too_long if overlong == "drop" else lengths > 1  # a 1-token document has no target
        self.starts, self.lengths = starts[keep], np.minimum(lengths[keep], seq_len + 1)
        if self.mask is None:
            self._trained = self.lengths - 1
        else:
            csum = np.concatenate([[0], np.cumsum(self.mask, dtype=np.int64)])
            self._trained = csum[self.starts + self.lengths] - csum[self.starts + 1]
        self.report = SplitReport(documents=last_doc - first_doc, samples=len(self.starts),
                                  truncated=int(too_long.sum()) if overlong == "truncate" else 0,
                                  dropped=int(too_long.sum()) if overlong == "drop" else 0,
                                  trained_tokens=int(self._trained.sum()))

    def __len__(self) -> int:
        return len(self.starts)

    def _rows(self, indices: list[int]) -> tuple[np.ndarray, np.ndarray]:
        n = self.seq_len + 1
        tokens = np.full((len(indices), n), self.pad_id, dtype=np.int64)
        trained = np.zeros((len(indices), n), dtype=bool)
        for row, i in enumerate(indices):
            a, k = int(self.starts[i]), int(self.lengths[i])
            tokens[row, :k] = self.ids[a : a + k]
            trained[row, :k] = True if self.mask is None else np.asarray(self.mask[a : a + k], dtype=bool)
        return tokens, trained

    def batch(self, indices: list[int]) -> torch.Tensor:
        """Token ids [B, L + 1] (padding included)."""
        return torch.from_numpy(self._rows(indices)[0])

    def labeled_batch(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, trained = self._rows(indices)
        targets = np.where(trained[:, 1:], tokens[:, 1:], IGNORE_INDEX)
        return torch.from_numpy(tokens[:, :-1]), torch.from_numpy(targets)

    def target_count(self, indices: list[int]) -> int:
        return int(self._trained[indices].sum())


def _split(corpus: TokenizedCorpus, cfg: DataConfig, *, pad_id: int, first_doc: int, last_doc: int, fingerprint: str):
    common = dict(first_doc=first_doc, last_doc=last_doc, seq_len=cfg.seq_len, fingerprint=fingerprint)
    if cfg.packing:
        return PackedDocuments(corpus, **common)
    return PaddedDocuments(corpus, pad_id=pad_id, overlong=cfg.overlong, **common)


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
    identity = f"{corpus.key}:{list(cfg.val_files) or cfg.val_fraction}:{cfg.packing}:{cfg.overlong}:{cfg.seq_len}"
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
                             f"({r.documents} documents, {r.dropped} dropped as too long); add data, lower "
                             "data.seq_len or change data.val_fraction / data.overlong")
        overlong = ("packed: documents run across windows, none cut" if cfg.packing else
                    f"longer than {cfg.seq_len + 1} tokens: {r.truncated} truncated, {r.dropped} dropped")
        log.info("data %s: %d documents -> %d samples, %d trained tokens; %s", name, r.documents, r.samples,
                 r.trained_tokens, overlong)
    return train, val
