"""VerifyingFileSystemReader's partial reads (a load at another world size): the rows a target
needs are read from the file on their own, other slices go to DCP, and a short file is named;
the read buffer is a mapping of its own, and file checksums span several reads. Whole reads:
large tensors go straight into host targets, checked against the zip directory."""

from __future__ import annotations

import dataclasses
import io
import mmap
import os
import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp
import xxhash
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from fsdpkit.checkpoint.errors import CheckpointCorruptError
from fsdpkit.checkpoint.hashing import READ_CHUNK_BYTES, file_checksum
from fsdpkit.checkpoint.io.torch_save import MemoryReader, SplitBlob, locate_tensor, predict_tensor
from fsdpkit.checkpoint.io.verified_read import (
    VerifyingFileSystemReader,
    _Buffer,
    assign_whole_readers,
)
from fsdpkit.checkpoint.safe_io import SafeLoadPlanner


class _Planner:
    """The two calls read_data makes of a LoadPlanner: where an item goes, and that it arrived."""

    def __init__(self, targets: dict[str, torch.Tensor]) -> None:
        self.targets, self.committed = targets, []

    def resolve_tensor(self, req: ReadItem) -> torch.Tensor:
        return self.targets[req.dest_index.fqn]

    def commit_tensor(self, req: ReadItem, tensor: torch.Tensor) -> None:
        self.committed.append(req.dest_index.fqn)


def _item(fqn: str, offsets: tuple[int, ...], lengths: tuple[int, ...]) -> ReadItem:
    index = MetadataIndex(fqn, torch.Size([0] * len(offsets)))
    return ReadItem(type=LoadItemType.TENSOR, dest_index=index, dest_offsets=torch.Size([0] * len(offsets)),
                    storage_index=index, storage_offsets=torch.Size(offsets), lengths=torch.Size(lengths))


@pytest.fixture
def saved(tmp_path):
    gen = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(10, 6, generator=gen), "v": torch.randn(7, generator=gen),
             "s": torch.tensor(3.5), "h": torch.randn(4, 3, generator=gen).to(torch.bfloat16)}
    dcp.save(state, checkpoint_id=tmp_path, no_dist=True)
    return tmp_path, state


def _reader(path, *, hash_files=True):
    sizes = {p.name: p.stat().st_size for p in path.iterdir() if p.is_file()}
    reader = VerifyingFileSystemReader(path, sizes=sizes, hash_files=hash_files)
    metadata = reader.read_metadata()
    reader.set_up_storage_reader(metadata, is_coordinator=True)
    return reader


def test_row_slices_are_read_on_their_own_other_slices_go_to_dcp(saved, monkeypatch):
    path, state = saved
    left_to_dcp: list[str] = []
    real = FileSystemReader.read_data

    def dcp_read(self, plan, planner):
        left_to_dcp.extend(i.dest_index.fqn for i in plan.items)
        return real(self, plan, planner)

    monkeypatch.setattr(FileSystemReader, "read_data", dcp_read)
    targets = {"w": torch.empty(4, 6), "v": torch.empty(2), "s": torch.empty(()),
               "h": torch.empty(4, 3), "cols": torch.empty(10, 2)}  # h: bf16 saved, fp32 target (a cast)
    items = [_item("w", (3, 0), (4, 6)), _item("v", (5,), (2,)), _item("s", (), ()), _item("h", (0, 0), (4, 3))]
    cols = _item("w", (0, 2), (10, 2))  # columns are not whole rows: DCP reads them
    cols = ReadItem(type=cols.type, dest_index=MetadataIndex("cols", torch.Size([0, 0])),
                    dest_offsets=cols.dest_offsets,
                    storage_index=cols.storage_index, storage_offsets=cols.storage_offsets, lengths=cols.lengths)
    planner = _Planner(targets)
    reader = _reader(path)
    reader.read_data(LoadPlan([*items, cols]), planner).wait()
    assert torch.equal(targets["w"], state["w"][3:7])
    assert torch.equal(targets["v"], state["v"][5:7])
    assert torch.equal(targets["s"], state["s"])
    assert torch.equal(targets["h"], state["h"].float())
    assert torch.equal(targets["cols"], state["w"][:, 2:4])
    assert left_to_dcp == ["cols"]
    assert sorted(planner.committed) == ["cols", "h", "s", "v", "w"]
    assert reader.digests == {}  # no file was read whole, so none was hashed here (verify_rest does it)


@pytest.mark.parametrize("hash_files", [False, True])
def test_a_file_whose_every_item_is_touched_but_only_in_part(saved, monkeypatch, hash_files):
    """At another world size a rank may need some rows of every item of a file, less than half
    of it: without hashing it reads just those rows (not the whole file); with hashing the plan
    (as DCP makes it, through the coordinator) has it read the file whole, once, and hash it."""
    path, state = saved
    whole: list[str] = []
    real = VerifyingFileSystemReader._load_whole
    monkeypatch.setattr(VerifyingFileSystemReader, "_load_whole",
                        lambda self, name, *a: (whole.append(name), real(self, name, *a))[1])
    targets = {"w": torch.empty(2, 6), "v": torch.empty(2), "s": torch.empty(()),
               "h": torch.empty(1, 3, dtype=torch.bfloat16)}
    items = [_item("w", (3, 0), (2, 6)), _item("v", (0,), (2,)), _item("s", (), ()), _item("h", (1, 0), (1, 3))]
    reader = _reader(path, hash_files=hash_files)
    size = reader.sizes[reader.storage_data[MetadataIndex("w", torch.Size([0, 0]))].relative_path]
    assert 2 * sum(reader._needed_bytes(item) for item in items) < size  # the case: less than half of the file
    planner = _Planner(targets)
    plan = reader.prepare_global_plan([reader.prepare_local_plan(LoadPlan(items))])[0]
    assert plan.storage_data["wait"] is False  # one rank: nobody to wait for
    reader.read_data(plan, planner).wait()
    assert torch.equal(targets["w"], state["w"][3:5]) and torch.equal(targets["v"], state["v"][:2])
    assert torch.equal(targets["s"], state["s"]) and torch.equal(targets["h"], state["h"][1:2])
    assert sorted(planner.committed) == ["h", "s", "v", "w"]
    name = reader.storage_data[MetadataIndex("w", torch.Size([0, 0]))].relative_path
    assert whole == ([name] if hash_files else [])
    assert sorted(reader.digests) == ([name] if hash_files else [])


def test_ranks_of_a_host_that_need_parts_of_a_file_share_it_one_reads_it_whole(tmp_path, monkeypatch):
    """As 3 ranks loading a 2-rank checkpoint on one host: each needs a third of every item of both
    files; per file one rank reads it whole (the others' rows then come from the page cache after
    the barrier the plan asks for) and the rest read just their rows."""
    calls: list[tuple[int, str, str]] = []
    real_whole, real_rows = VerifyingFileSystemReader._load_whole, VerifyingFileSystemReader._read_rows
    monkeypatch.setattr(VerifyingFileSystemReader, "_load_whole",
                        lambda self, name, *a: (calls.append((self.rank_for_test, "whole", name)),
                                                real_whole(self, name, *a))[1])
    monkeypatch.setattr(VerifyingFileSystemReader, "_read_rows", lambda self, in_part, planner: (
        calls.extend((self.rank_for_test, "rows", n) for n in in_part), real_rows(self, in_part, planner))[1])
    gen = torch.Generator().manual_seed(2)
    state = {f"t{i}": torch.randn(60, 16, generator=gen) for i in range(6)}
    dcp.save(state, storage_writer=FileSystemWriter(tmp_path, thread_count=2), no_dist=True)
    files = sorted(p.name for p in tmp_path.glob("*.distcp"))
    assert len(files) == 2
    readers, planners, local = [], [], []
    for rank, (a, b) in enumerate([(0, 20), (20, 40), (40, 60)]):
        reader = _reader(tmp_path, hash_files=False)
        reader.rank_for_test = rank
        targets = {k: torch.empty(b - a, 16) for k in state}
        items = [_item(k, (a, 0), (b - a, 16)) for k in state]
        readers.append(reader)
        planners.append(_Planner(targets))
        local.append(reader.prepare_local_plan(LoadPlan(items)))
    assert all(p.storage_data["partial"].keys() == set(files) for p in local)
    plans = readers[0].prepare_global_plan(local)  # rank 0 is the coordinator
    assert [p.storage_data["read_whole"] for p in plans] == [[files[0]], [files[1]], []]
    assert all(p.storage_data["wait"] is True for p in plans)
    for reader, plan, planner in zip(readers, plans, planners, strict=True):
        reader.read_data(plan, planner).wait()
    for rank, (a, b) in enumerate([(0, 20), (20, 40), (40, 60)]):
        for key, value in state.items():
            assert torch.equal(planners[rank].targets[key], value[a:b]), (rank, key)
    assert sorted(calls) == [(0, "rows", files[1]), (0, "whole", files[0]), (1, "rows", files[0]),
                             (1, "whole", files[1]), (2, "rows", files[0]), (2, "rows", files[1])]


@pytest.mark.parametrize(("needs", "hash_files", "whole", "wait"), [
    # 2 -> 3 ranks on one host: the ranks needing two thirds read the files whole, the middle one waits
    ([{"host": "a", "partial": {"f0": 60}}, {"host": "a", "partial": {"f0": 30, "f1": 30}},
      {"host": "a", "partial": {"f1": 60}}], False, [{"f0"}, set(), {"f1"}], True),
    # ... on three hosts: no page cache shared; a rank needing at least half a file reads it whole,
    # the middle one its parts (or, hashing, each file whole)
    ([{"host": "a", "partial": {"f0": 60}}, {"host": "b", "partial": {"f0": 30, "f1": 30}},
      {"host": "c", "partial": {"f1": 60}}], False, [{"f0"}, set(), {"f1"}], False),
    # 2 -> 1: the second file also holds the other rank's RNG state; read whole all the same
    ([{"host": "a", "partial": {"f1": 89}}], False, [{"f1"}], False),
    ([{"host": "a", "partial": {"f0": 60}}, {"host": "b", "partial": {"f0": 30, "f1": 30}},
      {"host": "c", "partial": {"f1": 60}}], True, [{"f0"}, {"f0", "f1"}, {"f1"}], False),
    # 2 -> 4 on one host: equal needs, the lower rank reads; the next file goes to a rank with less to read
    ([{"host": "a", "partial": {"f0": 45}}, {"host": "a", "partial": {"f0": 45}},
      {"host": "a", "partial": {"f1": 45}}, {"host": "a", "partial": {"f1": 45}}], False,
     [{"f0"}, set(), {"f1"}, set()], True),
    ([{"host": "a", "partial": {"f0": 45, "f1": 45}}, {"host": "a", "partial": {"f0": 45, "f1": 45}}], False,
     [{"f0"}, {"f1"}], True),
    # together less than half of the file: each reads its parts; a plan without needs counts for nothing
    ([{"host": "a", "partial": {"f0": 20}}, {"host": "a", "partial": {"f0": 20}}, None], False,
     [set(), set(), set()], False),
])
def test_whole_readers_are_assigned_per_host(needs, hash_files, whole, wait):
    assert assign_whole_readers(needs, {"f0": 90, "f1": 90}, hash_files=hash_files) == (whole, wait)


def test_several_whole_files_stream_side_by_side_and_are_hashed(tmp_path, monkeypatch):
    threads: list[str] = []
    real = VerifyingFileSystemReader._load_whole

    def load_whole(self, *args):
        threads.append(threading.current_thread().name)
        return real(self, *args)

    monkeypatch.setattr(VerifyingFileSystemReader, "_load_whole", load_whole)
    gen = torch.Generator().manual_seed(1)
    state = {f"t{i}": torch.randn(64, 32, generator=gen) for i in range(8)}
    state["meta"] = {"lr": 0.5, "betas": [0.9, 0.95]}  # byte items go through the planner too
    dcp.save(state, storage_writer=FileSystemWriter(tmp_path, thread_count=2), no_dist=True)
    files = sorted(p.name for p in tmp_path.glob("*.distcp"))
    assert len(files) == 2  # the case: one rank reading two whole files
    reader = _reader(tmp_path)
    loaded = {k: torch.zeros_like(v) for k, v in state.items() if k != "meta"}
    loaded["meta"] = {"lr": 0.0, "betas": [0.0, 0.0]}
    dcp.load(loaded, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
    for key, value in state.items():
        assert (torch.equal(loaded[key], value) if key != "meta" else loaded[key] == value), key
    assert sorted(reader.digests) == files
    assert len(threads) == 2 and all(t.startswith("fsdpkit-load-file") for t in threads)
    for name in files:
        data = (tmp_path / name).read_bytes()
        assert reader.digests[name] == (len(data), xxhash.xxh3_64(data).hexdigest())


def test_a_truncated_file_is_named(saved):
    path, _ = saved
    reader = _reader(path)
    info = reader.storage_data[MetadataIndex("w", torch.Size([0, 0]))]
    data_file = path / info.relative_path
    with open(data_file, "r+b") as f:  # cut inside w's rows, after its header
        f.truncate(info.offset + info.length - 8)
    with pytest.raises(CheckpointCorruptError, match="truncated") as caught:
        reader.read_data(LoadPlan([_item("w", (8, 0), (2, 6))]), _Planner({"w": torch.empty(2, 6)})).wait()
    assert str(data_file) in str(caught.value)
    assert os.path.getsize(data_file) == info.offset + info.length - 8


def test_read_buffer_is_a_mapping_of_its_own_reused_and_grown():
    """The buffer bypasses malloc (whose raised mmap threshold slowed the reads after a
    dcp.load), is reused for every item that fits and grows for one that does not."""
    buffer = _Buffer()
    first = buffer.view(3 << 20)
    assert isinstance(first.obj, mmap.mmap) and len(first) == 3 << 20
    backing = first.obj
    again = buffer.view(1 << 20)
    assert again.obj is backing and len(again) == 1 << 20
    larger = buffer.view(5 << 20)  # does not fit: a new, larger mapping; the old views stay valid
    assert larger.obj is not backing and isinstance(larger.obj, mmap.mmap) and len(larger) == 5 << 20
    first[:4] = b"abcd"
    assert bytes(again[:4]) == b"abcd"


def test_file_checksum_over_several_read_chunks(tmp_path):
    data = os.urandom(READ_CHUNK_BYTES * 2 + 12345)
    path = tmp_path / "blob"
    path.write_bytes(data)
    assert file_checksum(path) == (len(data), xxhash.xxh3_64_hexdigest(data))
    (tmp_path / "empty").write_bytes(b"")
    assert file_checksum(tmp_path / "empty") == (0, xxhash.xxh3_64_hexdigest(b""))


@pytest.fixture
def large(tmp_path):
    """Tensors above FSDPKIT_DIRECT_READ_BYTES (read straight into their targets) beside small ones."""
    gen = torch.Generator().manual_seed(2)
    state = {"big": torch.randn(512, 1024, generator=gen),
             "half": torch.randn(1024, 600, generator=gen).to(torch.bfloat16),
             "small": torch.randn(8, 8, generator=gen), "s": torch.tensor(1.5)}
    dcp.save(state, checkpoint_id=tmp_path, no_dist=True)
    return tmp_path, state


def _load_all(path, state, monkeypatch, targets=None):
    """Load every item of `state` whole through the reader; (targets, keys copied from the buffer)."""
    copied: list[str] = []
    real = VerifyingFileSystemReader._consume
    monkeypatch.setattr(VerifyingFileSystemReader, "_consume",
                        lambda self, req, *a: (copied.append(req.dest_index.fqn), real(self, req, *a))[1])
    targets = targets or {k: torch.empty_like(v) for k, v in state.items()}
    items = [_item(k, (0,) * v.dim(), tuple(v.shape)) for k, v in state.items()]
    reader = _reader(path)
    reader.read_data(LoadPlan(items), _Planner(targets)).wait()
    return reader, targets, copied


def test_large_tensors_are_read_straight_into_their_targets_and_hashed(large, monkeypatch):
    path, state = large
    reader, targets, copied = _load_all(path, state, monkeypatch)
    for key, value in state.items():
        assert torch.equal(targets[key], value), key
    assert sorted(copied) == ["s", "small"]  # the large ones never went through the read buffer
    (name,) = [p.name for p in path.glob("*.distcp")]
    data = (path / name).read_bytes()
    assert reader.digests == {name: (len(data), xxhash.xxh3_64(data).hexdigest())}


def test_the_rows_a_rank_holds_are_read_straight_into_its_targets(large, monkeypatch):
    """At another world size a rank that reads a file whole takes its rows of each tensor
    straight from the file; other slices (columns) go through the buffer."""
    path, state = large
    copied: list[str] = []
    real = VerifyingFileSystemReader._consume
    monkeypatch.setattr(VerifyingFileSystemReader, "_consume",
                        lambda self, req, *a: (copied.append(req.dest_index.fqn), real(self, req, *a))[1])
    targets = {"big": torch.empty(200, 1024), "half": torch.empty(1024, 100, dtype=torch.bfloat16)}
    items = [_item("big", (100, 0), (200, 1024)), _item("half", (0, 500), (1024, 100))]
    reader = _reader(path)
    plan = reader.prepare_global_plan([reader.prepare_local_plan(LoadPlan(items))])[0]
    assert plan.storage_data["read_whole"]  # the file is read whole (its checksum comes from that read)
    reader.read_data(plan, _Planner(targets)).wait()
    assert torch.equal(targets["big"], state["big"][100:300])
    assert torch.equal(targets["half"], state["half"][:, 500:600])
    assert copied == ["half"]
    (name,) = [p.name for p in path.glob("*.distcp")]
    data = (path / name).read_bytes()
    assert reader.digests == {name: (len(data), xxhash.xxh3_64(data).hexdigest())}


def test_a_target_of_another_dtype_is_copied_from_the_buffer(large, monkeypatch):
    path, state = large
    targets = {k: torch.empty(v.shape, dtype=torch.float32) for k, v in state.items()}
    _, targets, copied = _load_all(path, state, monkeypatch, targets)
    assert torch.equal(targets["half"], state["half"].float()) and torch.equal(targets["big"], state["big"])
    assert sorted(copied) == ["half", "s", "small"]


def test_a_wrong_prediction_is_caught_by_the_zip_directory_and_read_again(large, monkeypatch):
    """predict_tensor reads local headers only; were it wrong (here: made to point 64 bytes too
    far), the directory at the item's end disagrees and the item is read again and copied."""
    import fsdpkit.checkpoint.io.verified_read as vr

    real = vr.predict_tensor
    monkeypatch.setattr(vr, "predict_tensor",
                        lambda head, **kw: dataclasses.replace(p, data_start=p.data_start + 64)
                        if (p := real(head, **kw)) else p)
    path, state = large
    reader, targets, copied = _load_all(path, state, monkeypatch)
    for key, value in state.items():
        assert torch.equal(targets[key], value), key
    assert sorted(copied) == ["big", "half", "s", "small"]
    (name,) = [p.name for p in path.glob("*.distcp")]
    data = (path / name).read_bytes()
    assert reader.digests[name] == (len(data), xxhash.xxh3_64(data).hexdigest())  # hashed once, in order


def test_a_file_cut_inside_a_large_tensor_is_named(large, monkeypatch):
    path, state = large
    reader = _reader(path)
    info = reader.storage_data[MetadataIndex("big", torch.Size([0, 0]))]
    data_file = path / info.relative_path
    with open(data_file, "r+b") as f:
        f.truncate(info.offset + info.length // 2)
    with pytest.raises(CheckpointCorruptError, match="truncated") as caught:
        _load_all(path, state, monkeypatch)
    assert str(data_file) in str(caught.value)


@pytest.mark.parametrize("tensor", [torch.randn(300, 7), torch.randn(10, 20).to(torch.bfloat16), torch.tensor(3.5),
                                    torch.arange(12).reshape(3, 4)[1:], torch.randn(4, 6).t()])
def test_predict_tensor_from_the_head_matches_the_zip_directory(tensor):
    buf = io.BytesIO()
    torch.save(tensor, buf)
    blob = memoryview(buf.getvalue())
    found = locate_tensor(MemoryReader(blob), source="t")
    assert predict_tensor(blob[:4096], source="t") == found
    assert predict_tensor(blob[:100], source="t") is None  # data.pkl cut off: no prediction
    assert predict_tensor(memoryview(b"garbage" * 100), source="t") is None
    end = found.data_start + found.storage_bytes
    assert locate_tensor(SplitBlob(blob[: found.data_start], blob[end:], len(blob)), source="t") == found
    with pytest.raises(SplitBlob.MissingBytes):
        SplitBlob(blob[:10], blob[end:], len(blob)).read(20)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="no /proc here: one descriptor reads it all")
def test_whole_files_are_read_through_a_descriptor_renewed_every_restart_bytes(large, monkeypatch, tune):
    """The load's whole-file reads, into targets and into the buffer alike, go through
    page_cache.SequentialReader (a new descriptor every FSDPKIT_READ_RESTART_BYTES: see page_cache)."""

    tune(read_restart_bytes=1 << 20)
    path, state = large
    opened: list[str] = []
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda p, *a, **kw: (opened.append(str(p)), real_open(p, *a, **kw))[1])
    reader, targets, copied = _load_all(path, state, monkeypatch)
    assert torch.equal(targets["big"], state["big"]) and sorted(copied) == ["s", "small"]
    (name,) = [p.name for p in path.glob("*.distcp")]
    size = (path / name).stat().st_size
    assert len([p for p in opened if p.startswith("/proc/self/fd/")]) == size // (1 << 20)
