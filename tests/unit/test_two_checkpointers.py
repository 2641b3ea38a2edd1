"""Two Checkpointers in one process (a student and its EMA), in a gloo world of one: each keeps its
own directory, storage options, local mirror and cadence, saves and resumes bitwise on its own, and
a preemption signal reaches both. Also: every public method says whether it is collective.

The "bucket" is fsspec's in-memory filesystem under a test scheme whose instances carry the
storage option `tag` and log every object they open, so the test sees which Checkpointer's
options reached each read and write (a user's fsspec driver plugs into the same seam).
"""

from __future__ import annotations

import inspect
import os
import signal
import uuid
from pathlib import Path

import fsspec
import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem
from torch import nn

from fsdpkit.checkpoint import Checkpointer, Resumed
from fsdpkit.checkpoint.layout import MANIFEST
from fsdpkit.checkpoint.manifest import read_manifest
from fsdpkit.checkpoint.storage import open_storage

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
SCHEME = "taggedmem"


class TaggedMemory(MemoryFileSystem):
    """The in-memory store, under SCHEME; `tag` is a storage option, logged with every opened object."""

    protocol = SCHEME
    opened: list[tuple[str | None, str]] = []  # (the opening instance's tag, the object's key)

    def __init__(self, *args, tag: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.tag = tag

    @classmethod
    def _strip_protocol(cls, path):
        return super()._strip_protocol(str(path).removeprefix(f"{SCHEME}://"))

    def _open(self, path, mode="rb", **kwargs):
        TaggedMemory.opened.append((self.tag, self._strip_protocol(path)))
        return super()._open(path, mode, **kwargs)

    def cat_file(self, path, start=None, end=None, **kwargs):
        TaggedMemory.opened.append((self.tag, self._strip_protocol(path)))
        return super().cat_file(path, start=start, end=end, **kwargs)


@pytest.fixture
def buckets():
    fsspec.register_implementation(SCHEME, TaggedMemory, clobber=True)
    TaggedMemory.opened.clear()
    names = {who: f"{who}-{uuid.uuid4().hex[:8]}" for who in ("student", "ema")}
    yield names
    for key in [k for k in TaggedMemory.store if k.startswith(tuple(f"/{n}/" for n in names.values()))]:
        del TaggedMemory.store[key]  # the store is shared with memory://


def _pair(tmp_path: Path, buckets: dict[str, str], *, seed: int, first: str, **common):
    """A student (AdamW, a data cursor, saved every 2 steps, keep_last 2, with a local mirror) and its
    EMA (no optimizer, an update counter, every 3 steps, async), each in its own bucket with its own
    `tag`; built in the order `first` says, so that either could inherit the other's settings."""
    torch.manual_seed(seed)
    student, ema = nn.Linear(8, 8), nn.Linear(8, 8)
    opt = torch.optim.AdamW(student.parameters(), lr=1e-2)
    data, counters, events = {"position": 0}, {"updates": 0}, {"student": [], "ema": []}
    build = {
        "student": lambda: Checkpointer(
            f"{SCHEME}://{buckets['student']}/ckpt", model=student, optimizer=opt, state={"data": data},
            storage_options={"tag": "student"}, local_dir=str(tmp_path / "student-mirror"), every_steps=2,
            keep_last=2, on_event=events["student"].append, **common),
        "ema": lambda: Checkpointer(
            f"{SCHEME}://{buckets['ema']}/ckpt", model=ema, state={"ema": counters}, storage_options={"tag": "ema"},
            every_steps=3, async_save=True, async_staging="background", on_event=events["ema"].append, **common),
    }
    made = {who: build[who]() for who in (first, "ema" if first == "student" else "student")}
    return made["student"], made["ema"], (student, ema, opt, data, counters, events)


def _train(student, ema, opt, data, counters, *, steps, s_ckpt, e_ckpt) -> None:
    for step in steps:
        loss = student(torch.randn(4, 8)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        data["position"] += 4
        with torch.no_grad():
            for e, s in zip(ema.parameters(), student.parameters(), strict=True):
                e.mul_(0.9).add_(s, alpha=0.1)
        counters["updates"] += 1
        s_ckpt.step(step, metrics={"loss": float(loss)})
        e_ckpt.step(step)


def _state(model: nn.Module, opt: torch.optim.Optimizer | None = None) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for pid, st in (opt.state_dict()["state"] if opt is not None else {}).items():
        out.update({f"optim.{pid}.{k}": v.clone() for k, v in st.items()})
    return out


def _bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _steps_in(bucket: str, *, tag: str) -> list[str]:
    """The committed checkpoints in `bucket` (read with its owner's `tag`, as the log expects)."""
    root = open_storage(f"{SCHEME}://{bucket}/ckpt", {"tag": tag})
    return sorted(p.name for p in root.iterdir() if (p / MANIFEST).is_file())


def test_two_checkpointers_keep_their_own_storage_mirror_and_cadence(world_of_one, buckets, tmp_path):
    original = signal.getsignal(signal.SIGUSR1)
    s_ckpt, e_ckpt, (student, ema, opt, data, counters, events) = _pair(tmp_path, buckets, seed=0, first="student",
                                                                       preemption_signals=["SIGUSR1"])
    assert s_ckpt.resume() == 0 and e_ckpt.resume() == 0
    _train(student, ema, opt, data, counters, steps=range(1, 7), s_ckpt=s_ckpt, e_ckpt=e_ckpt)
    s_ckpt.close()
    e_ckpt.close()
    saved = {"student": _state(student, opt), "ema": _state(ema)}

    # cadences and retention apart: the student every 2 steps keeping 2, the EMA every 3 keeping all
    assert _steps_in(buckets["student"], tag="student") == ["step_4", "step_6"]
    assert _steps_in(buckets["ema"], tag="ema") == ["step_3", "step_6"]
    assert read_manifest(open_storage(f"{SCHEME}://{buckets['ema']}/ckpt/step_6", {"tag": "ema"}))["optimizer"] is None
    assert [r["step"] for r in events["student"]] == [2, 4, 6] and [r["step"] for r in events["ema"]] == [3, 6]
    # the mirror is the student's alone, and holds its retained checkpoints
    mirror = tmp_path / "student-mirror"
    assert sorted(p.name for p in mirror.iterdir() if (p / MANIFEST).is_file()) == ["step_4", "step_6"]
    assert (mirror / ".mirror_of").read_text().strip() == f"{SCHEME}://{buckets['student']}/ckpt"
    # every object of each bucket was read and written with that Checkpointer's storage options
    for who, bucket in buckets.items():
        tags = {tag for tag, key in TaggedMemory.opened if key.startswith(f"/{bucket}/")}
        assert tags == {who}, (who, tags)
    TaggedMemory.opened.clear()

    # resumed in the other order, each from its own newest checkpoint, bitwise
    s2, e2, (student2, ema2, opt2, data2, counters2, events2) = _pair(tmp_path, buckets, seed=1, first="ema",
                                                                     preemption_signals=["SIGUSR1"])
    assert e2.resume() == 6 and s2.resume() == 6
    assert isinstance(s2.resumed, Resumed) and s2.resumed.mirror_of == f"{SCHEME}://{buckets['student']}/ckpt/step_6"
    assert s2.resumed.path == str(mirror / "step_6")  # read from the student's local copy
    assert e2.resumed.mirror_of is None and e2.resumed.path == f"{SCHEME}://{buckets['ema']}/ckpt/step_6"
    assert events2["student"] == [s2.resumed.record()]  # on_event gets the JSON record, as before
    assert list(events2["ema"][0]) == ["event", "step", "path", "load_s", "verify_s", "saved_world_size", "mode",
                                       "notes"]
    assert _bitwise(_state(student2, opt2), saved["student"]) and _bitwise(_state(ema2), saved["ema"])
    assert data2 == {"position": 24} and counters2 == {"updates": 6}
    for who, bucket in buckets.items():
        assert {tag for tag, key in TaggedMemory.opened if key.startswith(f"/{bucket}/")} == {who}

    # a preemption signal reaches the process: both Checkpointers hear it, save and stop
    os.kill(os.getpid(), signal.SIGUSR1)
    assert s2.step(7) and e2.step(7)
    s2.close()  # in construction order, not the reverse: the process's handler comes back all the same
    e2.close()
    assert "step_7" in _steps_in(buckets["student"], tag="student") and "step_7" in _steps_in(buckets["ema"], tag="ema")
    assert signal.getsignal(signal.SIGUSR1) == original


def test_every_public_method_says_whether_it_is_collective():
    methods = {"__init__": Checkpointer.__doc__} | {
        name: fn.__doc__ for name, fn in inspect.getmembers(Checkpointer, inspect.isfunction)
        if not name.startswith("_") or name in ("__enter__", "__exit__")}
    methods["from_config"] = Checkpointer.from_config.__doc__
    unsaid = sorted(name for name, doc in methods.items() if "collective" not in (doc or "").lower())
    assert not unsaid, f"Checkpointer methods whose docstring does not say whether they are collective: {unsaid}"


def test_a_hugging_face_folder_in_a_bucket_is_read_with_the_options_given(buckets, tmp_path):
    """load_hf_weights opens a URL with the storage options it is given (the trainer passes
    checkpoint.storage_options for model.init_from=hf:URL), nothing process-wide."""
    from safetensors.torch import save_file

    from fsdpkit.config import compose_config
    from fsdpkit.hf import build_model, load_hf_weights

    tiny = compose_config(["model.hidden_size=16", "model.intermediate_size=24", "model.vocab_size=32"]).model
    torch.manual_seed(0)
    src, dst = build_model(tiny), build_model(tiny)
    save_file({k: v.contiguous() for k, v in src.state_dict().items()}, tmp_path / "model.safetensors")
    url = f"{SCHEME}://{buckets['student']}/hf"
    remote = open_storage(url, {"tag": "init"})
    remote.mkdir(parents=True, exist_ok=True)
    (remote / "model.safetensors").write_bytes((tmp_path / "model.safetensors").read_bytes())
    TaggedMemory.opened.clear()
    load_hf_weights(dst, url, storage_options={"tag": "init"})
    assert all(torch.equal(a, b) for a, b in zip(src.state_dict().values(), dst.state_dict().values(), strict=True))
    reads = [tag for tag, key in TaggedMemory.opened if key.endswith("model.safetensors")]
    assert reads and set(reads) == {"init"}, TaggedMemory.opened
