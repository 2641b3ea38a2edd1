"""Replicas read once (issue 36 item 4): under HYBRID_SHARD 2x2 on 4 gloo ranks and NO_SHARD on 2, one
replica group reads the checkpoint and the others receive it. Two launches of replicas_worker.py; the
bytes each rank read are counted by the worker around DCP's file system (nothing in fsdpkit counts)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import ROOT, torchrun  # noqa: E402

pytestmark = pytest.mark.dist
WORKER = ROOT / "tests" / "multirank" / "replicas_worker.py"


@pytest.fixture(scope="module")
def runs(tmp_path_factory, s3):
    out = tmp_path_factory.mktemp("replicas")
    work = out / "work"
    work.mkdir()
    res = {}
    bucket = s3.new_bucket()
    for phase, nproc in (("hsdp", 4), ("noshard", 2)):
        torchrun(nproc, WORKER, phase, str(out / f"{phase}.json"), str(work), bucket, timeout=400, env=s3.env)
        res[phase] = json.loads((out / f"{phase}.json").read_text())
    return res


def data_bytes(reads: dict) -> int:
    return sum(n for name, n in reads.items() if name.endswith(".distcp"))


@pytest.mark.parametrize(("phase", "readers", "receivers"), [("hsdp", [0, 1], [2, 3]), ("noshard", [0], [1])])
def test_each_byte_is_read_once_and_the_state_is_restored_bitwise(runs, phase, readers, receivers):
    res = runs[phase]
    data = {name: size for name, size in res["sizes"].items() if name.endswith(".distcp")}
    for mode in ("today", "once"):
        assert res[mode]["errors"] == [None] * len(res[mode]["errors"]), mode
        assert res[mode]["differ"] == [[]] * len(res[mode]["differ"]), mode  # model, AdamW, buffers, Stateful, RNG
        assert res[mode]["count"] == [3] * len(res[mode]["count"]), mode
    once = res["once"]["reads"]
    for r in receivers:  # not a byte of the checkpoint, .metadata included
        assert once[r] == {}, (r, once[r])
    assert all(data_bytes(once[r]) > 0 for r in readers)
    # every stored item read by one rank, once; together they are every byte of every data file
    items = [tuple(item) for per_rank in res["once"]["items"] for item in per_rank]
    assert len(items) == len(set(items))
    assert {name: sum(n for f, _, n in items if f == name) for name in data} == data
    # today's path, in the same launch and counted alike: every replica group read it all (the items
    # every rank holds alike, every rank), but for each rank's own RNG state, read once either way
    replicas, rng = len(res["peers"][0]), {tuple(item) for item in res["rng_items"]}
    items_today = [tuple(item) for per_rank in res["today"]["items"] for item in per_rank]
    assert set(items_today) == set(items) and rng < set(items)
    assert all(items_today.count(item) == 1 if item in rng else items_today.count(item) >= replicas
               for item in set(items_today))
    # the bytes that came through the file system (torch.load reads an item's zip records with some
    # overlap: more than the items' own bytes on so small a state)
    today = sum(data_bytes(reads) for reads in res["today"]["reads"])
    assert sum(data_bytes(reads) for reads in once) < 0.6 * today


@pytest.mark.parametrize("phase", ["hsdp", "noshard"])
def test_a_replica_holds_exactly_what_its_reader_loaded(runs, phase):
    res = runs[phase]
    assert len(res["replica_differs"]) == sum(len(group) for group in res["peers"])
    assert all(differ == [] for differ in res["replica_differs"].values()), res["replica_differs"]


@pytest.mark.parametrize("damage", ["truncated", "removed"])
def test_a_failure_on_the_reading_replica_fails_every_rank_with_one_error(runs, damage):
    damaged = runs["hsdp"]["damaged"]
    victim, run = damaged["victim"], damaged[damage]
    errors = run["errors"]
    assert all(e is not None for e in errors), errors
    assert len(set(errors)) == 1, errors  # one error, the same on every rank
    assert errors[0].startswith("CheckpointCorruptError: ") and victim in errors[0], errors[0]
    assert "reads for its replicas" in errors[0] and "The load stopped on every rank" in errors[0]
    if damage == "truncated":
        assert f"{victim} has " in errors[0] and "(truncated or overwritten)" in errors[0]
    else:
        assert f"{victim} is missing" in errors[0]
    assert max(run["seconds"]) < 60  # nobody waited for a broadcast that never came


@pytest.mark.parametrize(("phase", "tag"), [("hsdp", "fs4_to_hsdp"), ("noshard", "hsdp_to_noshard")])
def test_elastic_resumes_into_and_out_of_replicas(runs, phase, tag):
    run = runs[phase][tag]
    assert run["errors"] == [None] * len(run["errors"])
    assert run["differ"] == [[]] * len(run["differ"])
    assert run["count"] == [3] * len(run["count"])
    assert all(reads == {} for reads in run["reads"][len(run["reads"]) // 2:])  # replicate coordinate 1


def test_flipped_bytes_on_the_reading_replica_fail_every_rank_alike(runs):
    run = runs["hsdp"]["damaged"]["flipped"]
    errors = run["errors"]
    assert all(e is not None for e in errors) and len(set(errors)) == 1, errors
    # a tensor's values: no reader sees it; the post-load checksums, which every rank computes over
    # what it holds, received or read, find it and name the key (the file checksum pass, off in these
    # loads, would have named the file before any load)
    assert errors[0].startswith("CheckpointMismatchError: restored state differs from checkpoint"), errors[0]
    assert "hash saved" in errors[0]
    assert max(run["seconds"]) < 60


def test_a_refused_metadata_fails_every_rank_before_anything_is_read(runs):
    run = runs["hsdp"]["damaged"]["refused"]
    errors = run["errors"]
    assert len(set(errors)) == 1 and errors[0] is not None, errors
    assert errors[0].startswith("UnsafeCheckpointError: ")
    assert "step_2/.metadata` asks to load `posix.system`" in errors[0]
    assert all(reads == {} for reads in run["reads"][2:])  # the replicas read nothing, .metadata included
    assert all(not any(name.endswith(".distcp") for name in reads) for reads in run["reads"])


def test_frozen_tensors_in_a_shared_directory_are_read_once_too(runs):
    run = runs["hsdp"]["frozen"]
    assert run["shared"] and run["errors"] == [None] * 4
    assert run["differ"] == [[]] * 4
    assert run["reads"][2] == {} and run["reads"][3] == {}
    items = [tuple(item) for per_rank in run["items"] for item in per_rank]
    assert len(items) == len(set(items))
    data = {name: size for name, size in run["sizes"].items() if name.endswith(".distcp")}
    assert any(name.startswith(run["shared"][0] + "/") for name in data)
    assert {name: sum(n for f, _, n in items if f == name) for name in data} == data


def test_on_object_storage_only_the_readers_fetch_and_each_byte_once(runs):
    run = runs["hsdp"]["s3"]
    assert run["errors"] == [None] * 4 and run["differ"] == [[]] * 4
    assert run["fetched"][2] == 0 and run["fetched"][3] == 0  # the replicas fetched nothing
    assert sum(run["fetched"]) == run["data_bytes"]  # the items' bytes, each once (the manifest read apart)
