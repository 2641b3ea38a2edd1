"""The tokenization cache: documents from local files, tokenized once, stored as flat arrays.

Files (jsonl, json, parquet, csv, text) are read through the `datasets` library (its
memory-mapped Arrow cache) and tokenized in parallel with `Dataset.map` (with its progress bar).
The result is written as three numpy arrays under `<cache_dir>/<key>/`:

    ids.npy      uint32 [total tokens]   every document's tokens, one after another
    offsets.npy  int64  [documents + 1]  where each document starts (and the end)
    mask.npy     uint8  [total tokens]   1 where a token is trained on (chat: the assistant's);
                                         absent for plain text, where every token is
    info.json    what was built from what, when, and how long it took

The key is a digest of the files' contents, the tokenizer and the options that change token ids,
so every rank and every later run with the same inputs reuses it. Rank 0 builds; the others wait
at a barrier and then open what it wrote, so nothing is built twice. A build is written under a
temporary name and renamed into place: a reader never sees half a cache.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from fsdpkit import dist
from fsdpkit.log import get_logger

CACHE_FORMAT = 1  # bump when the arrays' meaning changes: old caches then stop matching
INFO_FILE, IDS_FILE, OFFSETS_FILE, MASK_FILE = "info.json", "ids.npy", "offsets.npy", "mask.npy"
DEFAULT_CACHE_DIR = "~/.cache/fsdpkit/data"  # where data.cache_dir='' puts the cache
BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".txt": "text", ".text": "text"}
FORMATS = ("auto", "json", "parquet", "csv", "text")
HASH_CHUNK = 1 << 22

log = get_logger("data")


@dataclass(frozen=True)
class TokenizeSpec:
    """What decides the cached token ids (everything in the key)."""

    files: tuple[str, ...]
    builder: str
    text_field: str
    messages_field: str


@dataclass
class TokenizedCorpus:
    """The cached documents, memory-mapped."""

    ids: np.ndarray  # uint32 [total tokens]
    offsets: np.ndarray  # int64 [documents + 1]
    mask: np.ndarray | None  # uint8 [total tokens], None: every token is trained on
    key: str
    path: Path
    built: bool  # this process built it (False: reused)
    info: dict[str, Any]

    @property
    def num_documents(self) -> int:
        return len(self.offsets) - 1


def resolve_files(patterns: list[str], *, setting: str) -> list[str]:
    """Globs to a sorted list of files.

    Raises:
        FileNotFoundError: a pattern matches nothing, naming it and the setting.
    """
    if not patterns:
        raise ValueError(f"{setting} is empty; give one or more files or globs, e.g. {setting}=[data/*.jsonl]")
    files: list[str] = []
    for pattern in patterns:
        found = sorted(p for p in glob.glob(os.path.expanduser(pattern), recursive=True) if os.path.isfile(p))
        if not found:
            raise FileNotFoundError(f"{setting}: {pattern!r} matches no file")
        files.extend(str(Path(p).resolve()) for p in found)
    return list(dict.fromkeys(files))


def pick_builder(files: list[str], fmt: str) -> str:
    """The `datasets` builder for the files (`data.format`, or from their extension)."""
    if fmt not in FORMATS:
        raise ValueError(f"data.format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if fmt != "auto":
        return fmt
    kinds = {BUILDERS.get(Path(f).suffix.lower()) for f in files}
    if None in kinds or len(kinds) != 1:
        exts = sorted({Path(f).suffix or "(none)" for f in files})
        raise ValueError(f"cannot tell the format of data files with extensions {exts}; use one of "
                         f"{sorted(BUILDERS)} for all of them, or set data.format to json, parquet, csv or text")
    return kinds.pop()


def _file_digest(path: str) -> str:
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while block := f.read(HASH_CHUNK):
            h.update(block)
    return h.hexdigest()


def cache_key(spec: TokenizeSpec, *, tokenizer_fingerprint: str) -> str:
    """Digest of the files' contents (not their names or times), the tokenizer and the options."""
    h = hashlib.sha256()
    h.update(json.dumps({"format": CACHE_FORMAT, "builder": spec.builder, "text_field": spec.text_field,
                         "messages_field": spec.messages_field, "tokenizer": tokenizer_fingerprint}).encode())
    for f in spec.files:
        h.update(_file_digest(f).encode())
    return h.hexdigest()[:32]


def _tokenize_fn(tok: Any, spec: TokenizeSpec):
    """The batched map function: text -> ids + EOS; conversations -> ids and assistant mask."""
    if spec.messages_field:
        from fsdpkit.data.chat import tokenize_conversation

        def chat(batch: dict[str, list]) -> dict[str, list]:
            pairs = [tokenize_conversation(tok, m) for m in batch[spec.messages_field]]
            return {"ids": [p[0].astype(np.uint32) for p in pairs], "mask": [p[1] for p in pairs]}

        return chat

    def text(batch: dict[str, list]) -> dict[str, list]:  # EOS is added when the arrays are written
        return {"ids": tok(batch[spec.text_field], add_special_tokens=False, return_attention_mask=False)["input_ids"]}

    return text


def _load_rows(spec: TokenizeSpec, *, hf_cache: Path) -> Any:
    try:
        import datasets
    except ImportError:
        raise ImportError("data.kind=hf needs the `datasets` library: pip install 'fsdpkit[hf]' (with -c "
                          "constraints.txt)") from None
    ds = datasets.load_dataset(spec.builder, data_files=list(spec.files), split="train", cache_dir=str(hf_cache))
    field = spec.messages_field or spec.text_field
    if field not in ds.column_names:
        which = "data.messages_field" if spec.messages_field else "data.text_field"
        raise ValueError(f"{which}={field!r} is not a column of {spec.files[0]} (and the other data files); "
                         f"the columns are {ds.column_names}")
    return ds


def _write_column(column: Any, path: Path, dtype: type, *, append: int | None = None) -> np.ndarray:
    """A list<int> Arrow column, flattened chunk by chunk into a .npy file, with `append` (EOS)
    after every row if given; returns the rows' lengths as written."""
    import pyarrow.compute as pc

    extra = 0 if append is None else 1
    lengths = np.concatenate([pc.list_value_length(c).to_numpy(zero_copy_only=False) for c in column.chunks]
                             or [np.zeros(0, dtype=np.int64)]).astype(np.int64) + extra
    out = np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=(int(lengths.sum()),))
    at = 0
    for chunk in column.chunks:
        values = chunk.flatten().to_numpy(zero_copy_only=False)
        if append is not None:  # row r's tokens move r places right; each row's last slot gets `append`
            rows = pc.list_value_length(chunk).to_numpy(zero_copy_only=False).astype(np.int64)
            ends = np.cumsum(rows + 1)
            block = np.empty(int(ends[-1]) if len(ends) else 0, dtype=dtype)
            block[np.arange(len(values)) + np.repeat(np.arange(len(rows)), rows)] = values
            block[ends - 1] = append
            values = block
        out[at : at + len(values)] = values
        at += len(values)
    out.flush()
    del out
    return lengths


def _build(spec: TokenizeSpec, tok: Any, *, final: Path, num_proc: int) -> None:
    t0 = time.perf_counter()
    rows = _load_rows(spec, hf_cache=final.parent / "hf-datasets")
    mapped = rows.map(_tokenize_fn(tok, spec), batched=True, batch_size=1000,
                      num_proc=num_proc if num_proc > 1 else None,
                      remove_columns=rows.column_names, desc="fsdpkit: tokenizing", keep_in_memory=True)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        lengths = _write_column(mapped.data.column("ids"), tmp / IDS_FILE, np.uint32,
                                append=None if spec.messages_field else tok.eos_token_id)
        if spec.messages_field:
            _write_column(mapped.data.column("mask"), tmp / MASK_FILE, np.uint8)
        np.save(tmp / OFFSETS_FILE, np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
        info = {"format": CACHE_FORMAT, "files": list(spec.files), "builder": spec.builder,
                "text_field": spec.text_field, "messages_field": spec.messages_field,
                "tokenizer": getattr(tok, "name_or_path", ""), "documents": int(len(lengths)),
                "tokens": int(lengths.sum()), "built_at": time.time(), "build_s": time.perf_counter() - t0,
                "pid": os.getpid()}
        (tmp / INFO_FILE).write_text(json.dumps(info, indent=1) + "\n")
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("tokenized %d documents (%d tokens) from %d file(s) in %.1f s into %s", info["documents"], info["tokens"],
             len(spec.files), info["build_s"], final)


def _open(path: Path, *, key: str, built: bool) -> TokenizedCorpus:
    mask = path / MASK_FILE
    return TokenizedCorpus(ids=np.load(path / IDS_FILE, mmap_mode="r"), offsets=np.load(path / OFFSETS_FILE),
                           mask=np.load(mask, mmap_mode="r") if mask.exists() else None, key=key, path=path,
                           built=built, info=json.loads((path / INFO_FILE).read_text()))


def tokenized_corpus(spec: TokenizeSpec, tok: Any, *, tokenizer_fingerprint: str, cache_dir: str,
                     num_proc: int) -> TokenizedCorpus:
    """The cached tokenization of `spec`, built by rank 0 if absent; call it on every rank.

    Raises:
        FileNotFoundError: rank 0 built the cache but this rank cannot see it (cache_dir is not
            on a filesystem every rank shares).
    """
    key = cache_key(spec, tokenizer_fingerprint=tokenizer_fingerprint)
    path = Path(cache_dir or DEFAULT_CACHE_DIR).expanduser() / key
    built = False
    if dist.is_main() and not (path / INFO_FILE).exists():
        _build(spec, tok, final=path, num_proc=num_proc)
        built = True
    dist.barrier()  # the others wait for rank 0's build
    if not (path / INFO_FILE).exists():
        raise FileNotFoundError(f"rank {dist.rank()} cannot see the tokenization cache {path} that rank 0 built; "
                                "set data.cache_dir to a directory every rank shares")
    if not built:
        log.info("reusing the tokenization cache %s", path)
    return _open(path, key=key, built=built)
