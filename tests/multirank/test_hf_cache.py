"""The tokenization cache on 2 gloo ranks: rank 0 builds it once, rank 1 waits and reads the same
samples, and a second run reuses it without tokenizing again."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import EXAMPLE_DATA, ROOT, torchrun  # noqa: E402

pytestmark = pytest.mark.dist
WORKER = ROOT / "tests" / "multirank" / "hf_cache_worker.py"


def test_built_once_by_rank_0_and_reused_by_the_next_run(tmp_path, hf_tokenizer_dir):
    cache = tmp_path / "cache"
    runs = []
    for i in range(2):
        out = tmp_path / f"run{i}.json"
        torchrun(2, WORKER, str(out), str(hf_tokenizer_dir), str(EXAMPLE_DATA / "chat.jsonl"), str(cache))
        runs.append(json.loads(out.read_text()))
    first, second = runs
    assert [r["built"] for r in first] == [True, False]  # rank 0 tokenized, rank 1 waited
    assert [r["built"] for r in second] == [False, False]  # nobody tokenized again
    assert len({r["key"] for r in first + second}) == 1
    assert len({r["built_at"] for r in first + second}) == 1  # the same build, read four times
    assert len({r["samples"] for r in first + second}) == 1
    entries = [p.name for p in cache.iterdir() if p.name != "hf-datasets"]
    assert entries == [first[0]["key"]]  # one cache entry, no leftover temporary directory
