"""fsdpkit.export without a process group: the torch.save locator, the streaming safetensors
writer, key selection, export from hand-built multi-chunk DCP checkpoints (row splits, uneven
and 2-D block layouts, 0-dim, integer tensors), inspect/verify/diff, and load_hf_weights."""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from fsdpkit.checkpoint.errors import (
    CheckpointCorruptError,
    CheckpointMismatchError,
    UnsafeCheckpointError,
)
from fsdpkit.checkpoint.io.torch_save import FileWindow, locate_tensor
from fsdpkit.cli.main import main
from fsdpkit.config import compose_config
from fsdpkit.export.diffing import diff_checkpoints
from fsdpkit.export.exporter import export_checkpoint
from fsdpkit.export.inspection import describe_chunks, inspect_checkpoint
from fsdpkit.export.keys import model_weights
from fsdpkit.export.safetensors_writer import StreamingSafetensorsWriter, plan_shards
from fsdpkit.export.sources import DcpLoadSource, DcpSource, open_checkpoint
from fsdpkit.export.verification import verify_checkpoint
from fsdpkit.hf import build_model, load_hf_weights
from fsdpkit.hf.safetensors_reader import SafetensorsReader, read_header
from fsdpkit.model.names import clean_name
from fsdpkit.tunables import parse_size

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
SRC = Path(__file__).resolve().parents[2] / "src" / "fsdpkit"
G = torch.Generator().manual_seed(0)


def _payload_read(blob: bytes) -> torch.Tensor:
    """What locate_tensor says, turned back into a tensor from the raw bytes."""
    p = locate_tensor(io.BytesIO(blob), source="test")
    data = bytearray(blob[p.data_start : p.data_start + p.storage_bytes])
    storage = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    return storage.view(p.dtype).as_strided(p.shape, p.stride, p.storage_offset)


@pytest.mark.parametrize("tensor", [
    torch.randn(5, 7, generator=G),
    torch.randn(4, 6, generator=G).to(torch.bfloat16),
    torch.arange(10, dtype=torch.int64)[3:8],  # a storage offset
    torch.randn(6, 4, generator=G).t(),  # strided
    torch.tensor(2.5),  # 0-dim
    torch.tensor([True, False, True]),
    torch.randn(3, 2, generator=G).to(torch.float8_e4m3fn),  # pickled through _rebuild_tensor_v3
    torch.empty(0, 3),
])
def test_locate_tensor_finds_exactly_what_torch_load_reads(tensor):
    buf = io.BytesIO()
    torch.save(tensor, buf)
    got = _payload_read(buf.getvalue())
    expected = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    def raw(t: torch.Tensor) -> torch.Tensor:
        return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t

    assert torch.equal(raw(got), raw(expected))


class _Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_crafted_tensor_pickle_is_refused_without_running_it(tmp_path):
    buf = io.BytesIO()
    torch.save(torch.ones(3), buf)
    crafted = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as src, zipfile.ZipFile(crafted, "w") as dst:
        for info in src.infolist():
            data = pickle.dumps(_Payload(tmp_path / "pwned")) if info.filename.endswith("data.pkl") else src.read(info)
            dst.writestr(info, data)
    with pytest.raises(UnsafeCheckpointError, match="posix.system.*refusing to unpickle it"):
        locate_tensor(io.BytesIO(crafted.getvalue()), source="evil")
    assert not (tmp_path / "pwned").exists()
    with pytest.raises(CheckpointCorruptError, match="not a torch.save archive"):
        locate_tensor(io.BytesIO(buf.getvalue()[:-30]), source="cut")


def test_file_window_supports_seeks_from_the_end(tmp_path):
    (tmp_path / "f").write_bytes(b"0123456789")
    with open(tmp_path / "f", "rb") as f:
        w = FileWindow(f, 2, 5)
        assert w.read() == b"23456"
        w.seek(-2, io.SEEK_END)
        assert w.read(10) == b"56"
    fileless = FileWindow(io.BytesIO(b"0123456789"), 2, 5)  # no descriptor (fsspec files): seeks instead
    assert fileless.read() == b"23456"


def test_file_windows_on_one_file_read_from_threads(tmp_path):
    """Positional reads: windows sharing one open file do not move each other's position."""
    data = os.urandom(1 << 20)
    (tmp_path / "f").write_bytes(data)
    with open(tmp_path / "f", "rb") as f, ThreadPoolExecutor(max_workers=4) as pool:
        def read(i: int) -> bytes:
            w, got = FileWindow(f, i * 4096, 4096), b""
            while chunk := w.read(100):  # many small reads, interleaved across the threads
                got += chunk
            return got
        assert list(pool.map(read, range(256))) == [data[i * 4096 : (i + 1) * 4096] for i in range(256)]


def test_streaming_writer_output_reads_back_with_safe_open(tmp_path):
    tensors = {"a": torch.randn(33, 5, generator=G), "b": torch.arange(7, dtype=torch.int32), "c": torch.tensor(1.5),
               "d": torch.randn(4, 4, generator=G).to(torch.bfloat16), "e": torch.zeros(0, 2)}
    path = tmp_path / "out.safetensors"
    writer = StreamingSafetensorsWriter(path, [(k, tuple(v.shape), v.dtype) for k, v in tensors.items()],
                                        metadata={"format": "pt"})
    for k, v in tensors.items():
        writer.write_tensor(k, (v[i : i + 4] for i in range(0, max(len(v), 1), 4)) if v.dim() else [v])
    writer.close()
    with safe_open(path, framework="pt") as f:
        assert f.metadata() == {"format": "pt"} and set(f.keys()) == set(tensors)
        for k, v in tensors.items():
            assert torch.equal(f.get_tensor(k), v), k
    assert path.stat().st_size == writer.file_bytes and (writer.file_bytes - writer.data_bytes) % 8 == 0
    save_file(tensors, tmp_path / "lib.safetensors")  # our header reader accepts the library's files too
    assert set(read_header(tmp_path / "lib.safetensors").tensors) == set(tensors)
    writer = StreamingSafetensorsWriter(tmp_path / "x.safetensors", [("a", (2,), torch.float32)])
    with pytest.raises(AssertionError, match="wrote 4 bytes, the header promised 8"):
        writer.write_tensor("a", [torch.ones(1)])
    writer.abort()


def test_sizes_and_shard_plans():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30 and parse_size("300KB") == 300_000
    assert parse_size(1024) == 1024
    with pytest.raises(ValueError, match="write e.g. 5GB"):
        parse_size("5 gigs")
    assert plan_shards([("a", 4), ("b", 4), ("c", 10), ("d", 1)], max_shard_size=8) == [["a", "b"], ["c"], ["d"]]


def test_names_are_cleaned_of_wrappers_and_the_model_namespace_is_chosen_by_path():
    assert clean_name("model.layers.0._checkpoint_wrapped_module.mlp._orig_mod.w") == "model.layers.0.mlp.w"
    assert clean_name("module.module.lm_head.weight") == "lm_head.weight"
    assert clean_name("_fsdp_wrapped_module.x", strip_prefixes=("x",), add_prefix="net.") == "net."
    keys = ["model.model.embed_tokens.weight", "model.lm_head.weight", "optim.state.x.exp_avg"]
    paths = {"model.model.embed_tokens.weight": ("model", "model.embed_tokens.weight"),
             "model.lm_head.weight": ("model", "lm_head.weight"),
             "optim.state.x.exp_avg": ("optim", "state", "x", "exp_avg")}
    assert model_weights(keys, key_paths=paths) == {"model.embed_tokens.weight": "model.model.embed_tokens.weight",
                                                    "lm_head.weight": "model.lm_head.weight"}
    # torchtitan-style: model keys at the top level (even one starting with `model.`)
    flat = {"model.norm.weight": ("model.norm.weight",), "lm_head.weight": ("lm_head.weight",),
            "optimizer.state.0": ("optimizer", "state", "0")}
    assert model_weights(list(flat), key_paths=flat) == {"model.norm.weight": "model.norm.weight",
                                                         "lm_head.weight": "lm_head.weight"}
    with pytest.raises(ValueError, match="cannot tell which tensors are the model's.*--namespace"):
        model_weights(["a.w", "b.w"], key_paths={"a.w": ("a", "w"), "b.w": ("b", "w")})
    assert model_weights(["a.w", "b.w"], key_paths={"a.w": ("a", "w"), "b.w": ("b", "w")},
                         namespace="b") == {"w": "b.w"}
    with pytest.raises(ValueError, match="both become 'w'"):
        model_weights(["module.w", "w"], key_paths=None, structured=False)


# ---- hand-built DCP checkpoints: every chunk layout DCP can describe ----------------------------

TENSORS = {
    # uneven rows
    "embed": (torch.randn(10, 6, generator=G), [((0, 0), (4, 6), 0), ((4, 0), (4, 6), 1), ((8, 0), (2, 6), 1)]),
    "mlp.w": (torch.randn(6, 8, generator=G),
              [((0, 0), (3, 4), 0), ((0, 4), (3, 4), 1), ((3, 0), (3, 4), 0), ((3, 4), (3, 4), 1)]),
    "norm": (torch.randn(5, generator=G), [((0,), (3,), 0), ((3,), (2,), 1), ((5,), (0,), 1)]),  # with an empty chunk
    "half": (torch.randn(4, 3, generator=G).to(torch.bfloat16), [((0, 0), (4, 3), 1)]),
    "count": (torch.tensor(7, dtype=torch.int64), [((), (), 0)]),
}


def write_dcp(root: Path, tensors=TENSORS, *, namespace: str = "model", drop_chunk: str | None = None) -> Path:
    """A DCP checkpoint written by hand (two rank files), with planner data like DCP's own."""
    root.mkdir(parents=True, exist_ok=True)
    files = [bytearray(), bytearray()]
    md, storage, planner = {}, {}, {}
    for name, (full, chunks) in tensors.items():
        key = f"{namespace}.{name}"
        metas = []
        for offsets, sizes, rank in chunks:
            piece = full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))].clone()
            buf = io.BytesIO()
            torch.save(piece, buf)
            metas.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))
            if name == drop_chunk and offsets == chunks[-1][0]:
                continue
            storage[MetadataIndex(key, torch.Size(offsets))] = _StorageInfo(f"__{rank}_0.distcp", len(files[rank]),
                                                                            len(buf.getvalue()))
            files[rank] += buf.getvalue()
        md[key] = TensorStorageMetadata(TensorProperties(dtype=full.dtype), full.shape, metas)
        planner[key] = (namespace, name)
    blob = io.BytesIO()
    torch.save(0.25, blob)
    md["optim.param_groups.0.lr"] = BytesStorageMetadata()
    storage[MetadataIndex("optim.param_groups.0.lr")] = _StorageInfo("__0_0.distcp", len(files[0]),
                                                                     len(blob.getvalue()))
    files[0] += blob.getvalue()
    planner["optim.param_groups.0.lr"] = ("optim", "param_groups", 0, "lr")
    for rank, data in enumerate(files):
        (root / f"__{rank}_0.distcp").write_bytes(bytes(data))
    (root / ".metadata").write_bytes(pickle.dumps(Metadata(state_dict_metadata=md, planner_data=planner,
                                                           storage_data=storage)))
    return root


@pytest.fixture
def ckpt(tmp_path) -> Path:
    return write_dcp(tmp_path / "ckpt")


def test_hand_built_checkpoint_is_valid_dcp_and_both_readers_agree(ckpt, tmp_path):
    dcp_to_torch_save(ckpt, tmp_path / "full.pt")  # DCP itself reads it: the fixture is a genuine checkpoint
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    for reader in (DcpSource(ckpt), DcpLoadSource(ckpt)):
        for name, (expected, _) in TENSORS.items():
            info = reader.tensors()[f"model.{name}"]
            assert torch.equal(full["model"][name], expected)
            rows = [reader.read_rows(f"model.{name}", a, min(a + 3, info.rows)) for a in range(0, info.rows, 3)]
            got = torch.cat(rows) if expected.dim() else rows[0]
            assert got.dtype == expected.dtype and torch.equal(got, expected), (type(reader).__name__, name)
        reader.close()


def test_dcp_reader_reads_metadata_once_and_only_the_requested_chunks(ckpt, monkeypatch):
    import fsdpkit.checkpoint.safe_io as safe_io
    import fsdpkit.export.sources as sources

    unpickled, planned = [], []
    real_unpickle, real_read_data = safe_io.unpickle_dcp_metadata, sources._CachedMetadataReader.read_data
    monkeypatch.setattr(safe_io, "unpickle_dcp_metadata", lambda *a, **k: unpickled.append(1) or real_unpickle(*a, **k))

    def read_data(self, plan, planner):
        planned.append(sorted({item.storage_index.fqn for item in plan.items}))
        return real_read_data(self, plan, planner)

    monkeypatch.setattr(sources._CachedMetadataReader, "read_data", read_data)
    reader = DcpLoadSource(ckpt)
    for key in ("model.embed", "model.mlp.w", "model.norm"):
        reader.read_rows(key, 0, 1)
    assert len(unpickled) == 1 and planned == [["model.embed"], ["model.mlp.w"], ["model.norm"]]


def test_export_streams_every_layout_into_shards_and_converts_dtypes(ckpt, tmp_path):
    out = tmp_path / "out"
    report = export_checkpoint(ckpt, out, max_shard_size=200, block_bytes=16, dtype="fp16")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(TENSORS) and report["index"] == "model.safetensors.index.json"
    assert len(report["files"]) == len(set(index["weight_map"].values())) >= 2
    assert not (out / "config.json").exists()
    assert "carries no model config" in report["config"] and "--config" in report["config"]
    got = {}
    for file in report["files"]:
        with safe_open(out / file, framework="pt") as f:
            got.update({k: f.get_tensor(k) for k in f.keys()})
    for name, (expected, _) in TENSORS.items():
        want = expected.to(torch.float16) if expected.is_floating_point() else expected
        assert got[name].dtype == want.dtype and torch.equal(got[name], want), name
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in got.values())
    assert report["dtypes"] == {"float16": 4,
                                "int64": 1} and "integer tensors are kept as stored" in report["dtype_note"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary left behind


def test_export_single_file_and_overwrite_rules(ckpt, tmp_path):
    out = tmp_path / "w.safetensors"
    export_checkpoint(ckpt, out, fmt="single", reader="dcp")
    with safe_open(out, framework="pt") as f:
        assert torch.equal(f.get_tensor("embed"), TENSORS["embed"][0])
    with pytest.raises(ValueError, match="already exists; pass --overwrite"):
        export_checkpoint(ckpt, out, fmt="single")
    export_checkpoint(ckpt, out, fmt="single", dtype="bf16", overwrite=True)
    with safe_open(out, framework="pt") as f:
        assert f.get_tensor("embed").dtype == torch.bfloat16
    with pytest.raises(ValueError, match="--format single writes one file"):
        export_checkpoint(ckpt, tmp_path, fmt="single")
    with pytest.raises(ValueError, match="--dtype must be one of"):
        export_checkpoint(ckpt, tmp_path / "x", dtype="int8")


def test_a_failed_export_leaves_nothing_behind(ckpt, tmp_path):
    os.truncate(ckpt / "__1_0.distcp", 100)
    with pytest.raises(CheckpointCorruptError, match="__1_0.distcp"):
        export_checkpoint(ckpt, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp-*"))


def test_prefix_options_and_plain_dcp_with_lightning_meta_pt(tmp_path):
    state = {"model": {"_orig_mod.net.module.w": torch.ones(2, 2), "_orig_mod.net.b": torch.zeros(2)},
             "optimizer": {"state": {"0": {"exp_avg": torch.ones(2)}}}}
    dcp.save(state, checkpoint_id=tmp_path / "lightning", no_dist=True)
    (tmp_path / "lightning" / "meta.pt").write_bytes(pickle.dumps(_Payload(tmp_path / "pwned")))  # never loaded
    report = export_checkpoint(tmp_path / "lightning", tmp_path / "out", strip_prefixes=["net."],
                               add_prefix="backbone.")
    with safe_open(tmp_path / "out" / "model.safetensors", framework="pt") as f:
        assert sorted(f.keys()) == ["backbone.b", "backbone.module.w"]
    assert report["source_kind"] == "dcp" and not (tmp_path / "pwned").exists()


def test_a_hugging_face_folder_re_exports_into_shards(ckpt, tmp_path):
    export_checkpoint(ckpt, tmp_path / "one")
    report = export_checkpoint(tmp_path / "one", tmp_path / "two", max_shard_size=150, dtype="bf16", block_bytes=8)
    assert report["source_kind"] == "safetensors" and len(report["files"]) >= 2
    diff = diff_checkpoints(tmp_path / "one", tmp_path / "two")
    assert len(diff["dtype_changed"]) == 3 and not diff["only_in_a"] and not diff["only_in_b"]
    assert all(s["rel"] < 4e-3 for s in diff["tensors"].values())


def test_uncommitted_fsdpkit_directory_is_refused(ckpt):
    (ckpt.parent / "latest").write_text("step_1\n")
    os.rename(ckpt, ckpt.parent / "step_3")
    with pytest.raises(Exception, match="never committed"):
        open_checkpoint(ckpt.parent / "step_3")


def test_inspect_describes_layouts_and_refuses_crafted_metadata(ckpt, tmp_path):
    report = inspect_checkpoint(ckpt)
    by_key = {t["key"]: t for t in report["tensors"]}
    assert by_key["model.embed"]["sharding"] == "dim 0: 4+4+2 rows"
    assert by_key["model.mlp.w"]["sharding"].startswith("4 blocks")
    assert by_key["model.count"]["sharding"] == "whole"
    assert report["non_tensor_items"][0]["key"] == "optim.param_groups.0.lr"
    assert set(report["bytes_per_rank"]) == {"rank 0", "rank 1"} and report["checksums"]["recorded"] is False
    assert describe_chunks((8, 2), [((0, 0), (4, 2)), ((4, 0), (4, 2))]) == "dim 0: 2 x 4 rows"
    (ckpt / ".metadata").write_bytes(pickle.dumps(_Payload(tmp_path / "pwned")))
    with pytest.raises(UnsafeCheckpointError, match="refusing to unpickle"):
        inspect_checkpoint(ckpt)
    assert not (tmp_path / "pwned").exists()
    result = verify_checkpoint(ckpt)
    assert not result["ok"] and result["bad_files"] == [".metadata"] and not (tmp_path / "pwned").exists()


def test_verify_plain_dcp_checks_structure(tmp_path):
    assert verify_checkpoint(write_dcp(tmp_path / "good"))["ok"]
    bad = write_dcp(tmp_path / "bad")
    os.truncate(bad / "__1_0.distcp", (bad / "__1_0.distcp").stat().st_size - 10)
    result = verify_checkpoint(bad)
    assert result["bad_files"] == ["__1_0.distcp"] and "is truncated" in result["problems"][0]
    (bad / "__0_0.distcp").unlink()
    assert "__0_0.distcp is missing" in "\n".join(verify_checkpoint(bad)["problems"])
    gap = write_dcp(tmp_path / "gap", drop_chunk="embed")
    problems = "\n".join(verify_checkpoint(gap)["problems"])
    assert "model.embed at [8, 0] is listed but no file holds it" in problems


def test_verify_of_plain_dcp_says_its_values_were_not_checked(tmp_path, capsys):
    """A plain DCP checkpoint records no checksums: a flipped bit inside a tensor passes every
    structural check, and DCP itself then loads a different value. verify's verdict says what it
    checked (structure) and what it could not (values), never that the checkpoint is intact."""
    good, flipped = write_dcp(tmp_path / "good"), write_dcp(tmp_path / "flipped")
    shard = flipped / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    stored = TENSORS["embed"][0][:4].numpy().tobytes()  # rank 0's chunk of model.embed, as torch.save stores it
    data[data.index(stored) + len(stored) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    dcp_to_torch_save(good, tmp_path / "good.pt")
    dcp_to_torch_save(flipped, tmp_path / "flipped.pt")
    loaded = [torch.load(tmp_path / f"{name}.pt", weights_only=True)["model"]["embed"] for name in ("good", "flipped")]
    assert not torch.equal(*loaded)

    assert main(["ckpt", "verify", str(flipped)]) == 0  # nothing it could check is wrong
    out = capsys.readouterr().out
    assert "checksums none recorded (plain DCP checkpoint): structure checked only" in out
    assert out.splitlines()[-1] == ("STRUCTURE OK, VALUES NOT CHECKED: every file and chunk is present and "
                                    "well-formed, but the checkpoint records no checksums, so tensor values could not "
                                    "be checked (a flipped bit in one would pass)")
    assert "intact" not in out and verify_checkpoint(flipped)["values_checked"] is False


def test_diff_reports_keys_shapes_dtypes_and_values(tmp_path):
    a = write_dcp(tmp_path / "a")
    changed = dict(TENSORS)
    changed["embed"] = (TENSORS["embed"][0] + 0.5, TENSORS["embed"][1])
    changed["norm"] = (torch.randn(4, generator=G), [((0,), (4,), 0)])
    changed["half"] = (TENSORS["half"][0].float(), TENSORS["half"][1])
    del changed["count"]
    changed["extra"] = (torch.ones(2), [((0,), (2,), 0)])
    b = write_dcp(tmp_path / "b", changed)
    report = diff_checkpoints(a, b)
    assert report["only_in_a"] == ["count"] and report["only_in_b"] == ["extra"] and not report["identical"]
    assert report["shape_changed"] == [{"name": "norm", "a": [5], "b": [4]}]
    assert report["dtype_changed"] == [{"name": "half", "a": "bfloat16", "b": "float32"}]
    assert report["tensors"]["embed"]["max_abs"] == pytest.approx(0.5) and not report["tensors"]["embed"]["equal"]
    assert report["tensors"]["half"]["equal"] and report["tensors"]["mlp.w"] == {"max_abs": 0.0, "rel": 0.0,
                                                                                 "equal": True}
    assert diff_checkpoints(a, a, all_tensors=True)["identical"]


# ---- import ---------------------------------------------------------------------------------------

def _tiny(tied: bool) -> torch.nn.Module:
    return build_model(compose_config(["model.hidden_size=32", "model.intermediate_size=48", "model.vocab_size=40",
                                       f"model.tie_word_embeddings={str(tied).lower()}"]).model)


def test_load_hf_weights_fills_a_plain_model_and_converts_dtypes(tmp_path):
    src = _tiny(tied=True)
    # tied: written once
    state = {k: v.to(torch.bfloat16) for k, v in src.state_dict().items() if k != "lm_head.weight"}
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    dst = _tiny(tied=True)
    report = load_hf_weights(dst, tmp_path)
    assert report["conversions"] == {"bfloat16->float32": len(state)} and report["loaded"] == len(state) + 1
    for k, v in dst.state_dict().items():
        assert torch.equal(v, src.state_dict()[k].to(torch.bfloat16).float()), k
    assert dst.lm_head.weight is dst.model.embed_tokens.weight


def test_load_hf_weights_names_every_missing_unexpected_and_reshaped_key(tmp_path):
    src = _tiny(tied=False).state_dict()
    state = {k: v for k, v in src.items() if k != "model.norm.weight"}
    state["model.extra.weight"] = torch.ones(3)
    state["model.layers.0.mlp.up_proj.weight"] = torch.ones(5, 5)
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    dst = _tiny(tied=False)
    before = {k: v.clone() for k, v in dst.state_dict().items()}
    with pytest.raises(CheckpointMismatchError) as err:
        load_hf_weights(dst, tmp_path)
    text = str(err.value)
    assert "nothing was loaded" in text and "missing from tmp" not in text
    assert "shape differs: model.layers.0.mlp.up_proj.weight: file [5, 5] (model.safetensors), model [48, 32]" in text
    assert "missing from " in text and "model.norm.weight [32]" in text
    assert "not in the model: model.extra.weight [3]" in text
    assert all(torch.equal(before[k], v) for k, v in dst.state_dict().items())  # untouched
    state["model.layers.0.mlp.up_proj.weight"] = src["model.layers.0.mlp.up_proj.weight"]
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointMismatchError, match="2 problem"):  # never a tensor left random
        load_hf_weights(dst, tmp_path)


def test_the_safetensors_reader_reads_exactly_what_safe_open_reads_without_mapping_the_file(tmp_path):
    """The one reader of import and export against the safetensors library's own: every piece and
    row range equal, bit for bit, into the caller's buffer too; while it reads, the file is not
    mapped into the process (its pages would count in the RSS)."""
    g = torch.Generator().manual_seed(0)
    tensors = {"w": torch.randn(7, 5, generator=g).to(torch.bfloat16), "b": torch.randn(9, generator=g),
               "steps": torch.tensor(3, dtype=torch.int64), "e": torch.randn(0, 4, generator=g),
               "cube": torch.randn(4, 3, 2, generator=g).half(), "mask": torch.tensor([True, False, True])}
    path = tmp_path / "model.safetensors"
    save_file(tensors, path)
    pieces = {"w": [(slice(2, 5), slice(0, 5)), (slice(0, 7), slice(1, 4)), (slice(6, 7), slice(0, 5))],
              "b": [(slice(0, 9),), (slice(4, 9),)], "cube": [(slice(1, 3), slice(0, 3), slice(1, 2))],
              "e": [(slice(0, 0), slice(0, 4))]}
    with SafetensorsReader([path]) as reader:
        got = [(name, None, reader.read(name)) for name in tensors]
        got += [(name, piece, reader.read(name, piece)) for name, ps in pieces.items() for piece in ps]
        out = torch.full((3, 5), -1.0, dtype=torch.bfloat16)
        assert reader.read_rows("w", 2, 5, out=out) is out  # straight into the caller's buffer
        got.append(("w", (slice(2, 5),), out))
        strided = torch.zeros(5, 3, dtype=torch.bfloat16).t()  # not contiguous: read, then copied in
        assert reader.read_rows("w", 4, 7, out=strided) is strided
        got.append(("w", (slice(4, 7),), strided))
        assert reader.read_rows("steps", 0, 1).shape == ()  # a 0-dim tensor is one row, and stays 0-dim
        maps = Path("/proc/self/maps")
        assert not maps.exists() or str(path) not in maps.read_text()
        assert reader.tensors()["cube"] == (torch.float16, [4, 3, 2]) and reader.file_of("cube") == path
    with safe_open(str(path), framework="pt") as ref:
        for name, piece, value in got:
            want = ref.get_tensor(name) if piece is None else ref.get_slice(name)[piece]
            assert value.dtype == want.dtype == tensors[name].dtype and torch.equal(value, want), (name, piece)
    assert reader._ranges == {}  # closed by the context manager
    data = path.read_bytes()
    path.write_bytes(data[:-8])  # one tensor's last bytes gone
    with pytest.raises(CheckpointCorruptError, match="truncated or padded"):
        SafetensorsReader([path])


def test_a_tensor_in_two_files_is_refused_by_import_and_export_alike_naming_both(tmp_path):
    """One rule for a duplicated name, wherever a folder is read: which copy a reader took would
    depend on the order it read the files (the loader used to keep the last, the export refused)."""
    folder = tmp_path / "hf"
    folder.mkdir()
    save_file({"model.norm.weight": torch.ones(4), "lm_head.weight": torch.zeros(2, 4)}, folder / "a.safetensors")
    save_file({"model.norm.weight": torch.zeros(4)}, folder / "b.safetensors")
    both = (f"model.norm.weight is in both {folder / 'a.safetensors'} and {folder / 'b.safetensors'}; a model "
            "folder holds each tensor once")
    with pytest.raises(CheckpointCorruptError, match=re.escape(both)):
        load_hf_weights(torch.nn.Module(), folder)
    with pytest.raises(CheckpointCorruptError, match=re.escape(both)):
        open_checkpoint(folder)
    with pytest.raises(CheckpointCorruptError, match=re.escape(both)):
        export_checkpoint(folder, tmp_path / "out")
