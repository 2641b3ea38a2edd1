"""fsdpkit.checkpoint.safe_io: genuine DCP checkpoints load; crafted ones run nothing.

Every attack test also shows that stock DCP (plain FileSystemReader / DefaultLoadPlanner) *does*
run the same payload, so the test could fail. The payloads only create a marker file in tmp_path.
No process group is needed: DCP saves and loads in one process with no_dist=True.
"""

from __future__ import annotations

import gc
import io
import os
import pickle
import re
import shlex
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from fsdpkit.checkpoint.errors import CheckpointCorruptError, UnsafeCheckpointError
from fsdpkit.checkpoint.safe_io import (
    SafeFileSystemReader,
    SafeLoadPlanner,
    SafeUnpickler,
    read_dcp_metadata,
    unpickle_dcp_metadata,
)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

EXTRA = {
    "step": 7,
    "loss": 1.25,
    "name": "run-a",
    "schedule": [1, 2.5, "cosine"],
    "nested": {"seed": 3, "tags": ["x", "y"]},
    "bf16": torch.linspace(-2, 2, 6, dtype=torch.bfloat16).reshape(2, 3),
    "u8": torch.arange(10, dtype=torch.uint8),
    "f64": torch.randn(3, dtype=torch.float64),
    "i64": torch.tensor([1, -2, 3]),
    "mask": torch.tensor([True, False]),
}


def _model_and_opt(seed: int, lr: float) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A small model and an AdamW that has taken one step, so it has exp_avg/exp_avg_sq/step."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    model(torch.randn(5, 4)).square().sum().backward()
    opt.step()
    return model, opt


def _blank_extra() -> dict[str, Any]:
    """Same structure as EXTRA, different values: what a fresh process would pass to dcp.load."""
    return {
        "step": 0, "loss": 0.0, "name": "", "schedule": [], "nested": {"seed": 0, "tags": []},
        **{k: torch.zeros_like(v) for k, v in EXTRA.items() if isinstance(v, torch.Tensor)},
    }


def _save(path: Path, state_dict: dict[str, Any]) -> Path:
    dcp.save(state_dict, checkpoint_id=path, no_dist=True)
    return path


def _failure(exc: CheckpointException) -> BaseException:
    """The exception DCP wrapped (no_dist: one rank)."""
    (wrapped,) = exc.failures.values()
    return wrapped[0]


class _Payload:
    """Pickles as the call `func(*args)`: what an attacker puts into a checkpoint."""

    def __init__(self, func: Callable[..., Any], *args: Any) -> None:
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


# name -> (global the pickle asks for, factory of a payload that creates `marker`)
PAYLOADS: dict[str, tuple[str, Callable[[Path], _Payload]]] = {
    "os.system": (f"{os.system.__module__}.system",
                  lambda m: _Payload(os.system, f"touch {shlex.quote(str(m))}")),
    "builtins.exec": ("builtins.exec", lambda m: _Payload(exec, f"open({str(m)!r}, 'w').close()")),
    "subprocess.run": ("subprocess.run", lambda m: _Payload(subprocess.run, ["touch", str(m)])),
}


@pytest.fixture(scope="module")
def genuine(tmp_path_factory) -> tuple[Path, dict[str, Any]]:
    """A real DCP checkpoint of model + AdamW state + plain values; returns (dir, what was saved)."""
    model, opt = _model_and_opt(seed=0, lr=1e-3)
    msd, osd = get_state_dict(model, opt)
    saved = {"model": msd, "optim": osd, "extra": EXTRA}
    return _save(tmp_path_factory.mktemp("ckpt") / "step_1", saved), saved


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# --- genuine checkpoints -------------------------------------------------------------------------


def test_genuine_checkpoint_round_trips_through_safe_reader_and_planner(genuine):
    path, saved = genuine
    model, opt = _model_and_opt(seed=1, lr=5.0)  # different weights, state and param_groups
    msd, osd = get_state_dict(model, opt)
    target = {"model": msd, "optim": osd, "extra": _blank_extra()}

    dcp.load(target, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner(), no_dist=True)
    set_state_dict(model, opt, model_state_dict=target["model"], optim_state_dict=target["optim"])

    got_msd, got_osd = get_state_dict(model, opt)
    assert got_msd.keys() == saved["model"].keys()
    for k, v in saved["model"].items():
        assert torch.equal(got_msd[k], v), k
    assert got_osd["param_groups"] == saved["optim"]["param_groups"]  # lr=1e-3, betas, ... as saved
    assert got_osd["param_groups"][0]["lr"] == 1e-3
    for fqn, state in saved["optim"]["state"].items():
        assert state.keys() == got_osd["state"][fqn].keys()
        for k, v in state.items():
            assert torch.equal(got_osd["state"][fqn][k], v), (fqn, k)
    for k, v in EXTRA.items():
        got = target["extra"][k]
        if isinstance(v, torch.Tensor):
            assert got.dtype == v.dtype and torch.equal(got, v), k
        else:
            assert got == v, k


def test_param_groups_and_plain_values_are_stored_as_bytes_items(genuine):
    """The BYTE_IO path (SafeLoadPlanner.load_bytes) is really exercised by the round trip."""
    md = read_dcp_metadata(genuine[0])
    kinds = {k: type(v) for k, v in md.state_dict_metadata.items()}
    assert kinds["optim.param_groups.0.lr"] is BytesStorageMetadata
    assert kinds["optim.param_groups.0.betas"] is BytesStorageMetadata
    assert kinds["extra.schedule"] is BytesStorageMetadata
    assert kinds["extra.bf16"] is TensorStorageMetadata
    assert md.state_dict_metadata["extra.bf16"].properties.dtype == torch.bfloat16
    assert md.state_dict_metadata["extra.u8"].properties.dtype == torch.uint8
    assert md.state_dict_metadata["extra.bf16"].size == torch.Size([2, 3])


def test_read_dcp_metadata_equals_what_plain_pickle_reads(genuine):
    path = genuine[0]
    with open(path / ".metadata", "rb") as f:
        expected = pickle.load(f)  # genuine file from this test: safe to read the unsafe way
    assert read_dcp_metadata(path) == expected
    assert read_dcp_metadata(path / ".metadata") == expected


def test_safe_reader_keeps_the_base_readers_bookkeeping(genuine):
    reader = SafeFileSystemReader(genuine[0])
    md = reader.read_metadata()
    assert isinstance(md, Metadata)
    assert md.storage_meta is not None and md.storage_meta.load_id == reader.load_id
    stock = FileSystemReader(genuine[0]).read_metadata()  # genuine file: safe to read this way
    stock.storage_meta.load_id = reader.load_id  # each reader stamps its own load id
    assert md == stock


def test_all_dtypes_layouts_and_memory_formats_resolve():
    for name in ("float32", "bfloat16", "uint8", "float8_e4m3fn", "complex64", "bool",
                 "strided", "sparse_coo", "contiguous_format", "channels_last"):
        data = f"ctorch\n{name}\n.".encode()
        assert SafeUnpickler(io.BytesIO(data), source="x").load() is getattr(torch, name)


# --- crafted .metadata ---------------------------------------------------------------------------


def _craft_metadata(genuine_dir: Path, dst: Path, payload: _Payload) -> Path:
    """Copy a genuine checkpoint and hide `payload` in one field of its Metadata."""
    path = _copy(genuine_dir, dst)
    md = read_dcp_metadata(path)
    md.version = payload
    (path / ".metadata").write_bytes(pickle.dumps(md))
    return path


@pytest.mark.parametrize("attack", sorted(PAYLOADS))
def test_crafted_metadata_is_refused_and_nothing_runs(genuine, tmp_path, attack):
    refused_global, make = PAYLOADS[attack]
    marker = tmp_path / "pwned"
    path = _craft_metadata(genuine[0], tmp_path / "ckpt", make(marker))

    with pytest.raises(UnsafeCheckpointError) as exc:
        read_dcp_metadata(path)
    assert f"`{refused_global}`" in str(exc.value) and str(path / ".metadata") in str(exc.value)
    assert "nothing was executed" in str(exc.value)
    with pytest.raises(UnsafeCheckpointError, match=refused_global.replace(".", r"\.")):
        SafeFileSystemReader(path).read_metadata()
    assert not marker.exists()

    # Through dcp.load: DCP swallows read_metadata()'s error and retries `__0.metadata`, so the
    # outer error is DCP's, but our refusal text is in it and still nothing ran.
    target = {"model": get_state_dict(*_model_and_opt(seed=1, lr=5.0))[0]}
    with pytest.raises(CheckpointException) as exc:
        dcp.load(target, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner(), no_dist=True)
    assert refused_global in str(exc.value)
    assert not marker.exists()

    # The test can fail: stock DCP runs the payload while reading the same file.
    FileSystemReader(path).read_metadata()
    assert marker.exists()


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("posix", "system"),
        ("torch", "load"),  # on the torch module, but not a dtype/layout/memory_format
        ("torch", "os"),
        ("torch.serialization", "load"),
        ("torch.distributed.checkpoint.metadata", "os.system"),  # dotted name through an allowed module
        ("torch.distributed.checkpoint.metadata", "torch"),
        ("torch.distributed.checkpoint.filesystem", "pickle"),
        ("pathlib", "Path.write_text"),
        ("copyreg", "_reconstructor"),
    ],
)
def test_globals_outside_the_allow_list_are_refused(module, name):
    data = f"c{module}\n{name}\n.".encode()
    with pytest.raises(UnsafeCheckpointError, match=f"`{module}.{name}`"):
        SafeUnpickler(io.BytesIO(data), source="/x/.metadata").load()


def test_overwriting_an_allowed_class_is_refused_and_undone():
    """pickle's BUILD applied to a class object would set class attributes process-wide."""
    # GLOBAL Metadata; (None, {"version": "pwned", "evil": 1}); BUILD; STOP
    data = (b"ctorch.distributed.checkpoint.metadata\nMetadata\n"
            b"N(Vversion\nVpwned\nVevil\nI1\nd\x86b.")
    assert Metadata.version is None
    with pytest.raises(UnsafeCheckpointError, match="Metadata"):
        SafeUnpickler(io.BytesIO(data), source="/x/.metadata").load()
    assert Metadata.version is None
    assert not hasattr(Metadata, "evil")


def test_layout_lookup_accepts_only_layout_names():
    """torch.layout pickles as a call to torch.serialization._get_layout(name); only names pass."""
    ok = b"ctorch.serialization\n_get_layout\n(Vtorch.strided\ntR."
    assert SafeUnpickler(io.BytesIO(ok), source="x").load() is torch.strided
    for arg in (b"Vtorch.float32", b"Vos.system", b"I1"):
        bad = b"ctorch.serialization\n_get_layout\n(" + arg + b"\ntR."
        with pytest.raises(pickle.UnpicklingError):
            SafeUnpickler(io.BytesIO(bad), source="x").load()
        with pytest.raises(CheckpointCorruptError):
            unpickle_dcp_metadata(io.BytesIO(bad), source="x")


# --- crafted bytes items -------------------------------------------------------------------------


@pytest.mark.parametrize("attack", sorted(PAYLOADS))
def test_crafted_bytes_item_is_refused_by_safe_load_planner(tmp_path, attack):
    """An optimizer checkpoint whose param_groups `lr` bytes carry a payload."""
    refused_global, make = PAYLOADS[attack]
    marker = tmp_path / "pwned"
    model, opt = _model_and_opt(seed=0, lr=1e-3)
    msd, osd = get_state_dict(model, opt)
    osd["param_groups"][0]["lr"] = make(marker)  # pickling does not run it
    path = _save(tmp_path / "ckpt", {"model": msd, "optim": osd})

    def fresh() -> dict[str, Any]:
        msd2, osd2 = get_state_dict(*_model_and_opt(seed=1, lr=5.0))
        return {"model": msd2, "optim": osd2}

    target = fresh()
    with pytest.raises(CheckpointException) as exc:
        dcp.load(target, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner(), no_dist=True)
    err = _failure(exc.value)
    assert isinstance(err, UnsafeCheckpointError)
    assert "`optim.param_groups.0.lr`" in str(err) and "nothing was executed" in str(err)
    # torch names it as pickled at protocol 2 (`exec`, `posix.system`, `commands.run`)
    assert re.search(rf"GLOBAL \S*{refused_global.rsplit('.', 1)[1]}\b", str(err))
    assert target["optim"]["param_groups"][0]["lr"] == 5.0
    assert not marker.exists()

    # The test can fail: stock DCP's planner (torch.load(weights_only=False)) runs the payload.
    dcp.load(fresh(), storage_reader=FileSystemReader(path), planner=DefaultLoadPlanner(), no_dist=True)
    assert marker.exists()


def test_safe_load_planner_without_flattening(tmp_path):
    """The planner's other branch (flatten_state_dict=False) loads plain values and refuses payloads.

    flatten_sharded_tensors=False too: with it on, DefaultLoadPlanner itself writes non-flattened
    bytes items into a copy of the state dict and they never reach the caller (torch 2.13).
    """
    marker = tmp_path / "pwned"
    path = _save(tmp_path / "ok", {"w": torch.ones(3), "cfg": [1, "a", 2.5]})
    target = {"w": torch.zeros(3), "cfg": None}
    planner = SafeLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    dcp.load(target, storage_reader=SafeFileSystemReader(path), planner=planner, no_dist=True)
    assert target["cfg"] == [1, "a", 2.5] and torch.equal(target["w"], torch.ones(3))

    bad = _save(tmp_path / "bad", {"w": torch.ones(3), "cfg": PAYLOADS["os.system"][1](marker)})
    with pytest.raises(CheckpointException) as exc:
        dcp.load({"w": torch.zeros(3), "cfg": None}, storage_reader=SafeFileSystemReader(bad),
                 planner=SafeLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False),
                 no_dist=True)
    assert isinstance(_failure(exc.value), UnsafeCheckpointError)
    assert "`cfg`" in str(_failure(exc.value))
    assert not marker.exists()


# --- damaged or missing .metadata ----------------------------------------------------------------


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda b: b[: len(b) // 2], id="truncated"),
        pytest.param(lambda b: b[:-1], id="last-byte-missing"),
        pytest.param(lambda b: b"", id="empty"),
        pytest.param(lambda b: bytes(range(256)) * 4, id="garbage"),
        pytest.param(lambda b: pickle.dumps({"not": "metadata"}), id="not-metadata"),
    ],
)
def test_damaged_metadata_is_corrupt(genuine, tmp_path, damage):
    path = _copy(genuine[0], tmp_path / "ckpt")
    meta = path / ".metadata"
    meta.write_bytes(damage(meta.read_bytes()))
    with pytest.raises(CheckpointCorruptError, match=str(meta).replace(".", r"\.")):
        read_dcp_metadata(path)
    with pytest.raises(CheckpointCorruptError):
        SafeFileSystemReader(path).read_metadata()


def test_missing_metadata_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / ".metadata").replace(".", r"\.")):
        read_dcp_metadata(tmp_path)


def _many_chunks_metadata(chunks: int) -> bytes:
    sizes = torch.Size([1, 4])
    meta = TensorStorageMetadata(
        TensorProperties(dtype=torch.float32),
        torch.Size([chunks, 4]),
        [ChunkStorageMetadata(offsets=torch.Size([r, 0]), sizes=sizes) for r in range(chunks)],
    )
    return pickle.dumps(Metadata(state_dict_metadata={"w": meta}))


def test_metadata_unpickle_pauses_the_collector_and_restores_it():
    """No collection runs inside the unpickle (the plain unpickler, the control, triggers several with
    the same thresholds); the collector is left as found: on, off, and on after a refused file."""
    data = _many_chunks_metadata(20_000)
    started: list[int] = []

    def count(phase: str, info: dict) -> None:
        if phase == "start":
            started.append(info["generation"])

    thresholds = gc.get_threshold()
    gc.set_threshold(100, 10, 10)
    gc.callbacks.append(count)
    try:
        SafeUnpickler(io.BytesIO(data), source="control").load()
        control = len(started)
        stream = io.BytesIO(data)
        started.clear()
        loaded = unpickle_dcp_metadata(stream, source="paused")
        paused = len(started)
    finally:
        gc.callbacks.remove(count)
        gc.set_threshold(*thresholds)
    # At most one: the allocations before the pause begins (its own context manager) may trigger one.
    assert control > 10 and paused <= 1, (control, paused)
    assert len(loaded.state_dict_metadata["w"].chunks) == 20_000
    assert gc.isenabled()

    gc.disable()
    try:
        unpickle_dcp_metadata(io.BytesIO(data), source="off")
        assert not gc.isenabled()
    finally:
        gc.enable()
    crafted = b"cposix\nsystem\n(S'true'\ntR."
    with pytest.raises(UnsafeCheckpointError):
        unpickle_dcp_metadata(io.BytesIO(crafted), source="crafted")
    assert gc.isenabled()
