"""Known answers for every checksum a checkpoint carries (docs/checkpoint-format.md).

Each literal below was computed once and pasted, so a change to any definition — the tensor
checksums (`xxh3_64-rows`, `linear`), the file checksum (xxh3-64), the manifest seal (SHA-256 of
canonical JSON) — fails here even where writer and verifier change together and still agree with
each other. Each literal is also recomputed by an oracle that shares no code with fsdpkit: the
bytes from `struct` (not from torch's memory), XXH3-64 from tests/xxh3_spec.py (plain Python,
written from xxhash's specification; fsdpkit runs the vendored C library or python-xxhash), the
linear formula in Python integers, the seal from a hand-written canonical JSON text and hashlib.
A test that fails here means the on-disk format changed: bump FORMAT_VERSION and say so in
docs/checkpoint-format.md, never update a literal alone.
"""

from __future__ import annotations

import hashlib
import json
import struct
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fsdpkit.checkpoint import hashing  # noqa: E402
from fsdpkit.checkpoint.hashing import LINEAR, ROWS, file_checksum, hash_part, tensor_hashes  # noqa: E402
from fsdpkit.checkpoint.manifest import SEAL, manifest_digest, read_manifest, write_manifest  # noqa: E402
from xxh3_spec import xxh3_64  # noqa: E402

M64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15

# -- tensors: (values as nested Python lists or a scalar, dtype) ----------------------------------
FP32 = [[0.1, -0.0, 3.5], [1e-30, -7.25, 65504.0], [1.0, 2.0, 3.0], [-1.0, -2.0, -3.0], [3.4e38, -1e-3, float("inf")]]
BF16 = [[1.0, -2.5, 0.15625], [256.0, -0.0, 3.0], [0.5, 1024.0, -96.0], [7.0, 0.75, -1.0]]  # exact in bf16
INT64 = [[1, -2], [3, 1 << 40], [-(1 << 62), 7]]
LONG_ROWS = [[((i * 37) % 101 - 50) / 8 for i in range(r * 300, (r + 1) * 300)] for r in range(3)]  # 1200-byte rows
CASES = {  # name: (values, dtype, shape when empty)
    "fp32": (FP32, torch.float32, None),  # 12-byte rows (xxh3's 9-16 byte class)
    "bf16": (BF16, torch.bfloat16, None),  # 6-byte rows (4-8)
    "int64": (INT64, torch.int64, None),  # 16-byte rows
    "fp32_long_rows": (LONG_ROWS, torch.float32, None),  # rows past one 1024-byte xxh3 block
    "fp32_0dim": (12.0, torch.float32, None),  # an AdamW `step`: the linear formula in both algorithms
    "fp32_1dim": ([1.0, 0.5, -0.25, 2.0], torch.float32, None),  # a norm weight: linear in both
    "empty_rows": ([], torch.float32, (0, 4)),
    "empty_cols": ([], torch.float32, (3, 0)),
}
# The checkpoint's hex checksums (manifest `tensors.<key>.hash`), computed once by fsdpkit 0.1.0
# at commit cf480f7 and checked against the oracle below.
KNOWN = {
    ROWS: {"fp32": "5ce5a881e0122542", "bf16": "4a07ba0792e9c023", "int64": "6e7cb38f68eaac31",
           "fp32_long_rows": "6875acc0b1987c10", "fp32_0dim": "87b1bc205a400000", "fp32_1dim": "467786ca99000000",
           "empty_rows": "0000000000000000", "empty_cols": "0000000000000000"},
    LINEAR: {"fp32": "050c3264dbcc16d0", "bf16": "ab8581c469ea23e0", "int64": "8e3ef10a42502b23",
             "fp32_long_rows": "0bac3f7997fc0000", "fp32_0dim": "87b1bc205a400000", "fp32_1dim": "467786ca99000000",
             "empty_rows": "0000000000000000", "empty_cols": "0000000000000000"},
}
SPLITS = {"fp32": [[2], [1, 4]], "bf16": [[3]], "int64": [[1, 2]], "fp32_long_rows": [[1], [2]]}  # row cuts


def make(name: str) -> torch.Tensor:
    values, dtype, empty = CASES[name]
    return torch.empty(empty, dtype=dtype) if empty is not None else torch.tensor(values, dtype=dtype)


# -- the oracle: bytes from struct, xxh3 from tests/xxh3_spec.py, integers from Python ----------
def element_bytes(value: float | int, dtype: torch.dtype) -> bytes:
    """One element as stored (little-endian), without torch."""
    if dtype == torch.float32:
        return struct.pack("<f", value)
    if dtype == torch.bfloat16:  # the high half of the fp32 pattern (the values are exact in bf16)
        full = struct.pack("<f", value)
        assert full[:2] == b"\0\0", value
        return full[2:]
    if dtype == torch.int64:
        return struct.pack("<q", value)
    raise AssertionError(dtype)


def flat(values) -> list:
    return [v for row in values for v in flat(row)] if isinstance(values, list) else [values]


def oracle_rows(name: str) -> str:
    """`xxh3_64-rows`: sum over rows r of XXH3-64(row r's bytes, seed=r), mod 2**64; tensors of
    fewer than 2 dims use the linear formula."""
    values, dtype, empty = CASES[name]
    if not isinstance(values, list) or not values or not isinstance(values[0], list):
        return oracle_linear(name)
    total = sum(xxh3_64(b"".join(element_bytes(v, dtype) for v in row), seed=r) for r, row in enumerate(values))
    return f"{total & M64:016x}"


def oracle_linear(name: str) -> str:
    """`linear`: sum over elements i (row-major) of bits_i * (2i + 1) * 0x9E3779B97F4A7C15, mod
    2**64, bits_i being the element's bit pattern read as a signed integer of its width."""
    values, dtype, _ = CASES[name]
    total = 0
    for i, v in enumerate(flat(values)):
        raw = element_bytes(v, dtype)
        bits = int.from_bytes(raw, "little", signed=True)
        total += bits * (2 * i + 1) * GOLDEN
    return f"{total & M64:016x}"


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_literals_are_what_the_independent_oracle_computes(name):
    assert oracle_rows(name) == KNOWN[ROWS][name]
    assert oracle_linear(name) == KNOWN[LINEAR][name]


# -- fsdpkit's implementations against the literals -----------------------------------------------
def native_available() -> bool:
    return hashing._native_rows_sum is not None


@pytest.fixture(params=["native", "python"])
def row_hash(request, tune) -> str:
    """Both implementations of `xxh3_64-rows`: the C extension and the python-xxhash loop."""
    if request.param == "native" and not native_available():
        pytest.skip("fsdpkit.checkpoint._rowhash is not built here (tests/unit/test_hashing.py says why)")
    tune(python_row_hash=request.param == "python")
    return request.param


@pytest.mark.parametrize("algorithm", [ROWS, LINEAR])
def test_tensor_checksums_match_the_known_answers(row_hash, algorithm):
    got = tensor_hashes({name: make(name) for name in CASES}, group=None, algorithm=algorithm)
    assert got == KNOWN[algorithm]


@pytest.mark.parametrize("native", [True, False])
def test_the_row_hash_gives_the_known_answers_with_native_on_and_off(native):
    if native and not native_available():
        pytest.skip("fsdpkit.checkpoint._rowhash is not built here")
    for name in ("fp32", "bf16", "int64", "fp32_long_rows"):
        total = hashing._rows_hash(make(name), 0, native=native)
        assert f"{total & M64:016x}" == KNOWN[ROWS][name], name


@pytest.mark.parametrize("algorithm", [ROWS, LINEAR])
def test_a_staging_copy_that_hashes_gives_the_known_answers(row_hash, algorithm):
    """hash_part(copy_to=) (an async save's staging pass; native: one pass that copies and hashes)."""
    for name in CASES:
        t = make(name)
        out = torch.empty_like(t)
        got = hash_part(t, first_row=0, algorithm=algorithm, copy_to=out)
        assert f"{got & M64:016x}" == KNOWN[algorithm][name], name
        assert torch.equal(out, t), name


@pytest.mark.parametrize("algorithm", [ROWS, LINEAR])
def test_row_ranges_sum_to_the_whole_tensors_known_answer(row_hash, algorithm):
    """What each rank contributes for its rows (FSDP2 shards dim 0), summed mod 2**64 as the
    all-reduce sums it, gives the whole tensor's literal, however the rows are cut."""
    for name, cuts_list in SPLITS.items():
        t = make(name)
        for cuts in cuts_list:
            bounds = [0, *cuts, t.shape[0]]
            total = sum(hash_part(t[a:b], first_row=a, algorithm=algorithm) for a, b in zip(bounds, bounds[1:],
                                                                                            strict=False))
            assert f"{total & M64:016x}" == KNOWN[algorithm][name], (name, cuts)


# -- files ----------------------------------------------------------------------------------------
LONG_FILE = bytes((i * 7) % 251 for i in range(5000))  # 5000 bytes: several xxh3 blocks
KNOWN_FILES = {  # name: (bytes, size, xxh3-64 hex digest as the manifest's `files.<name>.xxh3_64`)
    "empty": (b"", 0, "2d06800538d394c2"),
    "short": (b"fsdpkit checkpoint\n", 19, "25df14546dc68c8b"),
    "long": (LONG_FILE, 5000, "ce29a19460ee1bfc"),
}


@pytest.mark.parametrize("name", sorted(KNOWN_FILES))
def test_file_checksums_match_the_known_answers(name, tmp_path, monkeypatch):
    data, size, digest = KNOWN_FILES[name]
    assert f"{xxh3_64(data):016x}" == digest  # the oracle: XXH3-64, seed 0, of every byte of the file
    path = tmp_path / name
    path.write_bytes(data)
    assert file_checksum(path) == (size, digest)
    monkeypatch.setattr(hashing, "READ_CHUNK_BYTES", 1000)  # read in several pieces: the same digest
    assert file_checksum(path) == (size, digest)


# -- the manifest seal ----------------------------------------------------------------------------
SEALED_MANIFEST = {
    "format": "fsdpkit-checkpoint", "format_version": 2, "step": 7, "world_size": 2, "state_dict_type": "sharded",
    "run_id": "run-0001", "reason": "café ✓", "tensor_hash": "xxh3_64-rows",
    "metrics": {"loss": 2.5, "lr": 1e-05, "tokens": 4096},
    "fingerprint": {"tensors": {"w": {"shape": [4, 3], "dtype": "float32"}}, "vocab_size": 4, "tied_embeddings": False},
    "trainer": {"train": {"step": 7, "samples": 56}, "data": {"epoch": 0, "position": None}},
    "tensors": {"model.w": {"shape": [4, 3], "dtype": "float32", "hash": "0123456789abcdef"}},
    "files": {"__0_0.distcp": {"size": 1234, "xxh3_64": "fedcba9876543210"},
              ".metadata": {"size": 99, "xxh3_64": "00000000000000ff"}},
}
# Its canonical form, written out by hand: keys sorted at every level, no whitespace, non-ASCII
# as \\u escapes, floats as Python's repr, true/false/null.
CANONICAL = (
    '{"files":{".metadata":{"size":99,"xxh3_64":"00000000000000ff"},"__0_0.distcp":{"size":1234,'
    '"xxh3_64":"fedcba9876543210"}},"fingerprint":{"tensors":{"w":{"dtype":"float32","shape":[4,3]}},'
    '"tied_embeddings":false,"vocab_size":4},"format":"fsdpkit-checkpoint","format_version":2,'
    '"metrics":{"loss":2.5,"lr":1e-05,"tokens":4096},"reason":"caf\\u00e9 \\u2713","run_id":"run-0001",'
    '"state_dict_type":"sharded","step":7,"tensor_hash":"xxh3_64-rows","tensors":{"model.w":{"dtype":'
    '"float32","hash":"0123456789abcdef","shape":[4,3]}},"trainer":{"data":{"epoch":0,"position":null},'
    '"train":{"samples":56,"step":7}},"world_size":2}'
)
KNOWN_SEAL = "ffc5c17e5e8d74ab74d1ca5788e81a81b30a498ed6757b427c5f8aa290b09f91"


def test_the_seal_literal_is_sha256_of_the_hand_written_canonical_json():
    assert hashlib.sha256(CANONICAL.encode("ascii")).hexdigest() == KNOWN_SEAL
    assert json.loads(CANONICAL) == SEALED_MANIFEST  # the text is this manifest


def test_the_manifest_seal_matches_the_known_answer():
    assert SEAL == "manifest_sha256"
    assert manifest_digest(SEALED_MANIFEST) == KNOWN_SEAL
    assert manifest_digest({**SEALED_MANIFEST, SEAL: "anything"}) == KNOWN_SEAL  # the seal is not sealed
    reordered = dict(reversed(list(SEALED_MANIFEST.items())))
    assert manifest_digest(reordered) == KNOWN_SEAL  # key order in memory or on disk does not matter


def test_a_committed_manifest_carries_the_known_seal(tmp_path):
    write_manifest(tmp_path, SEALED_MANIFEST)
    on_disk = json.loads((tmp_path / "manifest.json").read_text(encoding="utf-8"))
    assert on_disk[SEAL] == KNOWN_SEAL
    assert {k: v for k, v in on_disk.items() if k != SEAL} == SEALED_MANIFEST
    assert read_manifest(tmp_path)[SEAL] == KNOWN_SEAL  # and fsdpkit accepts it


def test_the_format_description_lists_these_known_answers():
    """docs/checkpoint-format.md's test vectors are the literals above (the text cannot drift)."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "checkpoint-format.md").read_text(encoding="utf-8")
    assert "# fsdpkit checkpoint format, version 3" in doc
    for name in ("fp32", "bf16", "int64", "fp32_0dim", "fp32_1dim"):
        for algorithm in (ROWS, LINEAR):
            assert KNOWN[algorithm][name] in doc, (name, algorithm)
    for name in ("empty", "short"):
        assert KNOWN_FILES[name][2] in doc, name
    assert KNOWN_SEAL in doc
