"""Item checksums (docs/checkpoint-format.md 4.4) and what a resume that reads each file once
makes of damage, in one process, through the Checkpointer a loop uses.

- The `items` a save records equal an oracle that shares no code with fsdpkit: DCP's own metadata
  reader for where the items lie, Python's zipfile and struct for the storage record, xxhash.
- Damage in each kind of item is refused before anything decodes the damaged item: a non-tensor
  value, an RNG state, a tensor's zip headers (`data.pkl`), in an item read whole and in one read in
  pieces; the decoders are spied on (torch.load and fsdpkit's tensor-record unpickler): none was
  handed the damaged bytes. Damage in a tensor's elements is found after the load by the tensor's
  checksum, and its file named.
- resume=auto over a corrupt newest checkpoint: it is moved aside and the next older loaded over
  everything the corrupt load set (weights, optimizer, schedule, data cursor, counters, RNG); with
  no older one, or a checkpoint named explicitly, the run stops with the error.
- A frozen base in a shared directory: damage there fails every checkpoint that references it.
"""

from __future__ import annotations

import io
import json
import random
import struct
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from fsdpkit.checkpoint import Checkpointer
from fsdpkit.checkpoint.errors import CheckpointCorruptError, CheckpointError
from fsdpkit.checkpoint.io import torch_save

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
SMALL = 64 << 10  # io/items.py SMALL_ITEM_BYTES: the item of the first layer's weight (128 KiB) is above it


class Counter:
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state):
        self.step = int(state["step"])


def _run(root: Path, *, seed: int = 0, frozen: bool = False, **settings) -> tuple[Checkpointer, dict]:
    """A Checkpointer of a small model (the first weight 128 KiB), AdamW, a scheduler, a data cursor
    and counters; the model's and optimizer's values come from `seed`."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 4))
    if frozen:
        model[0].requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    cursor = {"position": -1}
    ckpt = Checkpointer(root, model=model, optimizer=opt, scheduler=sched, state={"data": cursor, "train": Counter()},
                        **settings)
    return ckpt, cursor


def _train(ckpt: Checkpointer, cursor: dict, step: int) -> None:
    model, opt = ckpt.target.model, ckpt.target.optimizer
    model(torch.randn(4, 256)).square().mean().backward()
    opt.step()
    opt.zero_grad()
    ckpt.target.stateful["scheduler"].step()
    cursor["position"] = 32 * step
    ckpt.target.stateful["train"].step = step


def _seed(value: int) -> None:
    for seed in (torch.manual_seed, random.seed, np.random.seed):
        seed(value)


def _everything(ckpt: Checkpointer, cursor: dict) -> dict:
    """All a resume restores, copied: tensors, JSON state and each generator's next draw."""
    target = ckpt.target
    out = {f"model.{k}": v.detach().clone() for k, v in target.model.state_dict().items()}
    for i, state in target.optimizer.state_dict()["state"].items():
        out.update({f"optim.{i}.{k}": torch.as_tensor(v).clone() for k, v in state.items()})
    out["param_groups"] = [{k: v for k, v in g.items() if k != "params"} for g in target.optimizer.param_groups]
    out["scheduler"] = {k: v for k, v in target.stateful["scheduler"].state_dict().items() if k != "lr_lambdas"}
    out["cursor"] = dict(cursor)
    out["train"] = target.stateful["train"].step
    state = (torch.get_rng_state(), random.getstate(), np.random.get_state())
    out["draws"] = (torch.rand(3).tolist(), random.random(), float(np.random.rand()))
    torch.set_rng_state(state[0])
    random.setstate(state[1])
    np.random.set_state(state[2])
    return out


def _same(a: dict, b: dict) -> list[str]:
    differ = [k for k in a.keys() | b.keys() if k not in a or k not in b]
    for k in a.keys() & b.keys():
        x, y = a[k], b[k]
        same = torch.equal(x, y) and x.dtype == y.dtype if isinstance(x, torch.Tensor) else x == y
        if not same:
            differ.append(k)
    return sorted(differ)


@pytest.fixture
def saved(tmp_path) -> tuple[Path, dict[int, dict]]:
    """step_1, step_2, step_3 of one run, each with other values everywhere; what each holds."""
    root = tmp_path / "run"
    ckpt, cursor = _run(root)
    ckpt.resume()
    states = {}
    for step in (1, 2, 3):
        _train(ckpt, cursor, step)
        _seed(100 + step)
        states[step] = _everything(ckpt, cursor)
        ckpt.save(step)
    ckpt.close()
    return root, states


# -- the definition, against an oracle ------------------------------------------------------------------------
def _oracle(ckpt: Path) -> dict[str, str]:
    """Each data file's `items`, computed from the format document with torch's own DCP metadata
    reader (plain pickle: this checkpoint was just written by the test), zipfile, struct and xxhash."""
    manifest = json.loads((ckpt / "manifest.json").read_text())
    metadata = FileSystemReader(ckpt).read_metadata()
    out = {}
    for name in manifest["files"]:
        if not name.endswith(".distcp"):
            continue
        raw = (ckpt / name).read_bytes()
        digests = []
        for index, info in sorted(metadata.storage_data.items(), key=lambda kv: kv[1].offset):
            if info.relative_path != name:
                continue
            item = raw[info.offset:info.offset + info.length]
            whole = (isinstance(metadata.state_dict_metadata[index.fqn], BytesStorageMetadata)
                     or index.fqn not in manifest["tensors"])
            if whole:
                digests.append(xxhash.xxh3_64_hexdigest(item))
                continue
            archive = zipfile.ZipFile(io.BytesIO(item))
            (record,) = [i for i in archive.infolist() if i.filename.split("/")[-2:-1] == ["data"]]
            name_len, extra_len = struct.unpack("<HH", item[record.header_offset + 26:record.header_offset + 30])
            start = record.header_offset + 30 + name_len + extra_len
            digests.append(xxhash.xxh3_64_hexdigest(item[:start] + item[start + record.file_size:]))
        out[name] = "".join(digests)
    return out


def test_the_items_recorded_are_the_documented_checksums(saved):
    root, _ = saved
    ckpt = root / "step_3"
    files = json.loads((ckpt / "manifest.json").read_text())["files"]
    oracle = _oracle(ckpt)
    assert oracle and {name: files[name]["items"] for name in oracle} == oracle
    assert "items" not in files[".metadata"]
    kinds = _items(ckpt)  # every kind of item is there, and the weight's is read in pieces
    assert {k for k, _, _ in kinds} >= {"bytes", "rng", "tensor"}
    assert any(length > SMALL for k, _, length in kinds if k == "tensor")


def _items(ckpt: Path) -> list[tuple[str, str, int]]:
    """(kind, key, length) of every item, in the order of their offsets."""
    metadata = FileSystemReader(ckpt).read_metadata()
    out = []
    for index, info in sorted(metadata.storage_data.items(), key=lambda kv: kv[1].offset):
        kind = ("bytes" if isinstance(metadata.state_dict_metadata[index.fqn], BytesStorageMetadata)
                else "rng" if index.fqn.startswith("rng.") else "tensor")
        out.append((kind, index.fqn, info.length))
    return out


@pytest.mark.parametrize("restart", [0, 4096, 1000], ids=["one-stream", "4-KiB-pieces", "uneven-pieces"])
def test_a_resume_restores_every_value_bitwise_however_the_elements_are_read(saved, tune, restart):
    """The first weight (128 KiB, read in pieces) through one stream, or a stream opened anew every
    `restart` bytes (FSDPKIT_READ_RESTART_BYTES); the state equals what step 3 held."""
    root, states = saved
    tune(read_restart_bytes=restart)
    ck, cursor = _run(root.parent / f"resumed-{restart}", seed=9, resume=str(root / "step_3"))
    _seed(7)
    assert ck.resume() == 3
    ck.close()
    assert _same(_everything(ck, cursor), states[3]) == []


# -- damage, refused before anything decodes it ---------------------------------------------------------------
def _item(ckpt: Path, key: str) -> tuple[Path, int, int]:
    metadata = FileSystemReader(ckpt).read_metadata()
    (info,) = [i for idx, i in metadata.storage_data.items() if idx.fqn == key]
    return ckpt / info.relative_path, info.offset, info.length


def _flip(path: Path, at: int) -> bytes:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x04
    path.write_bytes(bytes(data))
    return bytes(data)


def _spy_decoders(monkeypatch) -> list[bytes]:
    """Every blob handed to torch.load (DCP's values and RNG states, tensors read whole) and every
    data.pkl handed to fsdpkit's tensor-record unpickler."""
    seen: list[bytes] = []
    load, record = torch.load, torch_save._read_record
    monkeypatch.setattr(torch, "load", lambda f, *a, **k: seen.append(f.getvalue() if isinstance(f, io.BytesIO)
                                                                         else b"?") or load(f, *a, **k))
    monkeypatch.setattr(torch_save, "_read_record", lambda source, pickled: seen.append(pickled) or record(source,
                                                                                                         pickled))
    return seen


def _first(ckpt: Path, kind: str, *, large: bool | None = None) -> str:
    return next(key for k, key, length in _items(ckpt) if k == kind and (large is None or (length > SMALL) == large))


def _record(item: bytes, suffix: str) -> tuple[int, int]:
    """[start, end) of the zip record of `item` whose name ends with `suffix` (zipfile and struct)."""
    (record,) = [i for i in zipfile.ZipFile(io.BytesIO(item)).infolist() if i.filename.endswith(suffix)]
    name_len, extra_len = struct.unpack("<HH", item[record.header_offset + 26:record.header_offset + 30])
    start = record.header_offset + 30 + name_len + extra_len
    return start, start + record.file_size


@pytest.mark.parametrize("what", ["bytes", "rng", "tensor-headers-small", "tensor-headers-large"])
def test_a_damaged_item_is_refused_before_anything_decodes_it(saved, monkeypatch, what):
    """A bit flipped in the middle of a value's or an RNG state's item, or of a tensor's data.pkl."""
    root, _ = saved
    ckpt = root / "step_3"
    kind = what.split("-")[0]
    key = _first(ckpt, kind, large=None if kind != "tensor" else what.endswith("large"))
    path, offset, length = _item(ckpt, key)
    with open(path, "rb") as f:
        f.seek(offset)
        start, end = _record(f.read(length), "/data.pkl") if kind == "tensor" else (0, length)
    damaged = _flip(path, offset + (start + end) // 2)[offset + start:offset + end]
    seen = _spy_decoders(monkeypatch)
    ck, _ = _run(root.parent / "resumed", seed=9, resume=str(ckpt))
    with pytest.raises(CheckpointCorruptError, match=rf"^{ckpt} failed verification while loading; the state loaded "
                                                     rf"so far must not be used:\n  {path} fails its checksum at item "
                                                     rf"{key} \(bytes {offset}-{offset + length}: xxh3_64 "
                                                     r"[0-9a-f]{16}, expected [0-9a-f]{16}\): the file is corrupt; "
                                                     "nothing was decoded from it$"):
        ck.resume()
    assert ck.resumed is None
    assert seen or kind != "tensor"  # the spies see what is decoded (values and RNG lie before the tensors)
    assert not [blob for blob in seen if damaged in blob], "the damaged bytes were decoded"


@pytest.mark.parametrize("large", [False, True], ids=["read-whole", "read-in-pieces"])
def test_a_damaged_tensor_element_is_found_after_the_load_and_its_file_named(saved, large):
    root, _ = saved
    ckpt = root / "step_3"
    key = _first(ckpt, "tensor", large=large)
    path, offset, length = _item(ckpt, key)
    with open(path, "rb") as f:
        f.seek(offset)
        blob = f.read(length)
    start, end = torch_save.storage_span(io.BytesIO(blob), source=key)
    _flip(path, offset + (start + end) // 2)
    ck, _ = _run(root.parent / "resumed", seed=9, resume=str(ckpt))
    with pytest.raises(CheckpointCorruptError, match=rf"^{ckpt} failed verification after loading: 1 tensor\(s\) "
                                                     rf"differ from their checksums \({key}\), and the files they were "
                                                     rf"read from fail theirs; the state loaded must not be used:\n  "
                                                     rf"{path} fails its checksum \(xxh3_64 [0-9a-f]{{16}}, expected "
                                                     r"[0-9a-f]{16}\): the file is corrupt$"):
        ck.resume()
    assert ck.resumed is None


# -- what resume=auto loads instead ---------------------------------------------------------------------------
def test_auto_resume_loads_the_older_checkpoint_over_everything_the_corrupt_ones_set(saved, caplog):
    """step_3: an element flipped (found after step_3 was loaded and restored: weights, optimizer,
    schedule, cursor, counters, RNG); step_2: a value's bytes (found while loading). step_1 is
    loaded over all of it; nothing of the corrupt loads survives."""
    root, states = saved
    key = _first(root / "step_3", "tensor", large=True)
    path, offset, length = _item(root / "step_3", key)
    _flip(path, offset + length // 2)
    path, offset, length = _item(root / "step_2", _first(root / "step_2", "bytes"))
    _flip(path, offset + length // 2)
    ck, cursor = _run(root, seed=9)
    _seed(7)
    assert ck.resume() == 1
    ck.close()
    assert _same(_everything(ck, cursor), states[1]) == []
    assert sorted(p.name.split(".")[0] for p in root.iterdir() if ".corrupt-" in p.name) == ["step_2", "step_3"]
    assert "loading the older checkpoint step_2 instead of step_3" in caplog.text
    assert "loading the older checkpoint step_1 instead of step_2" in caplog.text


def test_with_no_older_checkpoint_or_one_named_the_run_stops(saved):
    root, _ = saved
    for step in (1, 2, 3):
        path, offset, length = _item(root / f"step_{step}", "model.0.weight")
        _flip(path, offset + length // 2)
    ck, _ = _run(root.parent / "named", seed=9, resume=str(root / "step_3"))
    with pytest.raises(CheckpointCorruptError, match=r"failed verification after loading"):
        ck.resume()  # named: stops, nothing moved
    assert (root / "step_3" / "manifest.json").is_file()
    ck, _ = _run(root, seed=9)
    with pytest.raises(CheckpointCorruptError, match=r"step_3, step_2, step_1 were moved aside and no older checkpoint "
                                                     r"passes verification; the state holds part of a corrupt "
                                                     r"checkpoint, .* so it stops here"):
        ck.resume()
    assert ck.resumed is None and not list(root.glob("step_?"))


def test_a_damaged_frozen_base_fails_every_checkpoint_that_references_it(tmp_path):
    root = tmp_path / "run"
    ck, cursor = _run(root, frozen=True)
    ck.resume()
    for step in (1, 2):
        _train(ck, cursor, step)
        ck.save(step)
    ck.close()
    manifest = json.loads((root / "step_2" / "manifest.json").read_text())
    (ref,) = manifest["shared"]
    shared = root / ref["dir"]
    assert "items" in ref["files"]["__0_0.distcp"]  # the base's files carry item checksums too
    path, offset, length = _item(shared, "model.0.weight")
    _flip(path, offset + length // 2)  # an element of the frozen weight
    named, _ = _run(tmp_path / "named", frozen=True, seed=9, resume=str(root / "step_2"))
    with pytest.raises(CheckpointCorruptError, match=rf"model.0.weight\), and the files .*\n  {path} fails its "
                                                     "checksum"):
        named.resume()
    ck, _ = _run(root, frozen=True, seed=9)
    with pytest.raises(CheckpointError, match=r"step_2, step_1 were moved aside"):
        ck.resume()
    assert sorted(p.name.split(".")[0] for p in root.iterdir() if ".corrupt-" in p.name) == ["step_1", "step_2"]
    assert shared.is_dir()  # referenced by the manifests moved aside: kept
