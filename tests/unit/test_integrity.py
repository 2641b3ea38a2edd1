"""Checkpoint integrity in one process (no process group): the manifest's own checksum and shape,
replacing a committed checkpoint only after its successor committed, a failed manifest write,
corrupt checkpoints moved aside, and one run per checkpoint directory."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from torch.distributed.checkpoint.filesystem import FileSystemReader

from faults import fired, injected, manifest_enospc  # noqa: E402
from fsdpkit.checkpoint import Checkpointer, resume  # noqa: E402
from fsdpkit.checkpoint.errors import CheckpointCorruptError, CheckpointError, CheckpointSaveError
from fsdpkit.checkpoint.layout import INCOMING, LATEST, MANIFEST, ON_EXCEPTION, swap_in
from fsdpkit.checkpoint.manifest import SEAL, manifest_digest, read_manifest
from fsdpkit.checkpoint.ownership import claim
from fsdpkit.checkpoint.resolve import committed_candidates, resolve_checkpoint
from fsdpkit.checkpoint.resume import load_checkpoint
from fsdpkit.checkpoint.retention import RetentionPolicy, apply_retention
from fsdpkit.checkpoint.save import save_checkpoint
from fsdpkit.checkpoint.state import CheckpointTarget
from fsdpkit.checkpoint.storage.local import DirectoryLock
from fsdpkit.cli.main import main


class Counter:
    def __init__(self, step: int = 0):
        self.step = step

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state):
        self.step = int(state["step"])


def _target(seed: int = 0) -> CheckpointTarget:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    return CheckpointTarget(model=model, optimizer=opt, stateful={"train": Counter(1)})


def _save(target, path: Path, step: int, run_id: str = "run-a", **kw) -> dict:
    target.stateful["train"].step = step
    meta = {"run_id": run_id, "fingerprint": {"tensors": {}}, "metrics": {}}
    return save_checkpoint(target, ckpt_dir=path, step=step, meta=meta, group=None, **kw)


@pytest.fixture
def root(tmp_path) -> Path:
    target = _target()
    r = tmp_path / "checkpoints"
    _save(target, r / "step_1", 1)
    _save(target, r / "step_2", 2)
    return r


def _rewrite(path: Path, manifest) -> None:
    (path / MANIFEST).write_text(json.dumps(manifest, indent=1))


# -- the manifest's own checksum and shape --------------------------------------------------------
def test_manifest_is_sealed_and_any_edit_is_refused(root):
    ckpt = root / "step_2"
    manifest = read_manifest(ckpt)
    assert manifest[SEAL] == manifest_digest(manifest) and manifest["run_id"] == "run-a"
    for edit in (lambda m: m.__setitem__("step", 5), lambda m: m["trainer"]["train"].__setitem__("step", 3)):
        edited = json.loads((ckpt / MANIFEST).read_text())
        edit(edited)
        _rewrite(ckpt, edited)
        with pytest.raises(CheckpointCorruptError, match="fails its own checksum"):
            read_manifest(ckpt)
    resealed = dict(manifest, step=5)  # sealed again, but the counters disagree with `step`
    resealed[SEAL] = manifest_digest(resealed)
    _rewrite(ckpt, resealed)
    with pytest.raises(CheckpointCorruptError, match="differs from the trainer counters' step 2"):
        read_manifest(ckpt)


@pytest.mark.parametrize("shape", ["[]", "null", "7", '"x"', "{}", "files-string", "no-files", "no-step",
                                   "no-tensors", "no-trainer", "no-fingerprint", "tensor-hash-int"])
def test_malformed_manifests_are_named_not_tracebacks(root, shape, caplog):
    ckpt = root / "step_2"
    manifest = read_manifest(ckpt)
    if shape.startswith("no-"):
        del manifest[shape[3:]]
    elif shape == "files-string":
        manifest["files"] = "all of them"
    elif shape == "tensor-hash-int":
        next(iter(manifest["tensors"].values()))["hash"] = 7
    if shape[0] in '[n7"{':
        (ckpt / MANIFEST).write_text(shape)
    else:
        manifest[SEAL] = manifest_digest(manifest)  # well sealed, still the wrong shape
        _rewrite(ckpt, manifest)
    with pytest.raises(CheckpointCorruptError, match="cannot be trusted") as err:
        read_manifest(ckpt)
    assert "\n" not in str(err.value)  # one paragraph
    with caplog.at_level(logging.WARNING):  # auto-resume: skipped, moved aside, the older one taken
        assert resolve_checkpoint("auto", ckpt_root=root, group=None, verify_checksums=True) == root / "step_1"
    assert "skipping" in caplog.text and "moved step_2 to step_2.corrupt-" in caplog.text
    assert [p.name.split("-")[0] for p in root.glob("step_2.corrupt-*")] == ["step_2.corrupt"]


def test_explicit_resume_of_a_malformed_manifest_is_one_paragraph(root):
    (root / "step_2" / MANIFEST).write_text('{"format": "fsdpkit-checkpoint", "format_version": 2}')
    with pytest.raises(CheckpointCorruptError, match="fails its own checksum"):
        resolve_checkpoint(str(root / "step_2"), ckpt_root=root, group=None)
    assert (root / "step_2").is_dir()  # a checkpoint named explicitly is never moved


# -- a manifest that claims an older format -----------------------------------------------------
def _checkpointer(root: Path, cursor: dict) -> Checkpointer:
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    return Checkpointer(root, model=model, optimizer=torch.optim.AdamW(model.parameters()), state={"data": cursor})


@pytest.mark.parametrize("seal", ["kept", "removed"])
def test_a_manifest_downgraded_to_format_1_is_corrupt_not_unsealed(tmp_path, seal, capsys, caplog):
    """Issue 35's repro: format_version 2 -> 1 (which had no seal), then the data cursor edited.
    verify names the file and why; auto-resume skips it as it skips any corrupt checkpoint (moved
    aside, never deleted) and loads the older checkpoint's cursor, not the edited one."""
    root = tmp_path / "checkpoints"
    cursor = {"epoch": 0, "position": 32}
    with _checkpointer(root, cursor) as ckpt:
        ckpt.resume()
        ckpt.save(1)
        cursor["position"] = 64
        ckpt.save(2)
    path = root / "step_2" / MANIFEST
    manifest = json.loads(path.read_text())
    manifest["format_version"] = 1
    manifest["trainer"]["data"]["position"] = 9999
    if seal == "removed":
        del manifest[SEAL]
    path.write_text(json.dumps(manifest, indent=1))

    assert main(["ckpt", "verify", str(root / "step_2")]) == 1
    out = capsys.readouterr().out
    edited = ", yet it carries a manifest_sha256: its format_version was edited" if seal == "kept" else ""
    assert (f"BAD: {path} claims format_version 1, which has no seal{edited}; fsdpkit reads only sealed manifests "
            "(formats 2 to 3), so the step, data position and schedule it records cannot be trusted") in out
    assert out.splitlines()[-1] == "FAILED: 1 problem(s) in manifest.json"
    assert "checksums none checked: manifest.json, which holds them, cannot be trusted" in out
    with pytest.raises(CheckpointCorruptError, match="claims format_version 1, which has no seal"):
        resolve_checkpoint(str(root / "step_2"), ckpt_root=root, group=None)  # named explicitly: refused

    resumed: dict = {}
    with caplog.at_level(logging.WARNING), _checkpointer(root, resumed) as ckpt:
        assert ckpt.resume() == 1
    assert resumed == {"epoch": 0, "position": 32}  # step 1's cursor, not 9999
    (aside,) = root.glob("step_2.corrupt-*")
    assert f"moved step_2 to {aside.name}: it failed verification" in caplog.text
    assert json.loads((aside / MANIFEST).read_text()) == manifest  # kept as it was found


# -- replacing a committed checkpoint ------------------------------------------------------------
@pytest.fixture
def marker(tmp_path_factory) -> Path:
    """Where the injected faults record that they fired (beside, not inside, the test's directory)."""
    return tmp_path_factory.mktemp("faults") / "fired.jsonl"


def test_a_failed_replacement_keeps_the_committed_checkpoint(tmp_path, marker):
    target = _target()
    path = tmp_path / ON_EXCEPTION
    _save(target, path, 5)
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    with injected(manifest_enospc(step=7, op="rename"), marker=marker), \
            pytest.raises(CheckpointSaveError, match=r"could not write .*manifest.json \(\[Errno 28\] No space left"):
        _save(target, path, 7)
    # the disk filled at the rename of the replacement's manifest, beside the committed checkpoint
    assert [(f["op"], f["path"]) for f in fired(marker)] == [
        ("rename", str(tmp_path / (ON_EXCEPTION + INCOMING) / MANIFEST))]
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before  # untouched, still committed
    assert read_manifest(path)["step"] == 5 and not (tmp_path / (ON_EXCEPTION + INCOMING)).exists()
    _save(target, path, 7)
    assert read_manifest(path)["step"] == 7
    assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST, ON_EXCEPTION]


def test_a_replacement_interrupted_before_the_swap_is_found_and_finished(tmp_path):
    target = _target()
    final = tmp_path / "step_4"
    _save(target, final, 4)
    _save(target, tmp_path / "step_4.incoming", 4)  # committed beside it; the swap never happened
    assert committed_candidates(tmp_path)[0][0] == tmp_path / "step_4.incoming"
    os.rename(final, tmp_path / "step_4.replaced")  # crash between the two renames of swap_in
    assert [p.name for p, _ in committed_candidates(tmp_path)] == ["step_4.incoming"]
    swap_in(tmp_path / "step_4.incoming", final)
    assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST, "step_4"]


@pytest.mark.parametrize("op", ["fsync", "rename"])
def test_a_failed_manifest_write_leaves_no_debris_and_latest_unmoved(root, marker, op):
    with injected(manifest_enospc(step=3, op=op), marker=marker), \
            pytest.raises(CheckpointSaveError, match=r"could not write .*step_3/manifest.json \(\[Errno 28\] No space"):
        _save(_target(), root / "step_3", 3)
    tmp = root / "step_3" / f".{MANIFEST}.tmp"  # the fsync fails on the temporary file, the rename onto the manifest
    failed_path = str(tmp if op == "fsync" else root / "step_3" / MANIFEST)
    assert [(f["op"], f["path"]) for f in fired(marker)] == [(op, failed_path)]
    assert not (root / "step_3").exists() and (root / LATEST).read_text().strip() == "step_2"
    assert not list(root.glob("step_*/.*.tmp"))


# -- one run per directory --------------------------------------------------------------------
def test_a_new_run_refuses_or_archives_another_runs_checkpoints(root):
    with pytest.raises(CheckpointError, match=r"holds committed checkpoints of another run: step_1 \(step 1, "
                                              r"run run-a\).*checkpoint.existing=archive"):
        claim(root, run_id="run-b", resumed=None, existing="error", start="a new run: checkpoint.resume=none")
    assert (root / "step_2" / MANIFEST).is_file()
    lines, moved = claim(root, run_id="run-b", resumed=None, existing="archive", start="a new run")
    (archive,) = (root / "archive").iterdir()
    assert moved == {str(root / n): str(archive / n) for n in ("step_1", "step_2")}
    assert sorted(p.name for p in archive.iterdir()) == [LATEST, "step_1", "step_2"]
    assert "moved step_1, step_2 (of another run" in lines[0]
    assert not (root / LATEST).exists() and committed_candidates(root) == []


def test_resuming_an_older_step_moves_the_newer_history_aside(root):
    lines, _ = claim(root, run_id="run-a", resumed=read_manifest(root / "step_1"), existing="error", start="resumed")
    assert "moved step_2 (newer than step 1" in lines[0]
    assert [p.name for p, _ in committed_candidates(root)] == ["step_1"]
    assert (root / LATEST).read_text().strip() == "step_1"  # `latest` never names a moved checkpoint


def test_retention_touches_this_run_only_and_never_what_latest_names(root, tmp_path):
    target = _target()
    _save(target, root / "step_3", 3, run_id="run-b")
    (root / LATEST).write_text("step_1\n")  # as if step_3's `latest` update had failed
    deleted = apply_retention(root, RetentionPolicy(keep_last=1), run_id="run-a", just_committed=root / "step_2")
    assert deleted == []  # step_1 is what latest names, step_2 was just committed, step_3 is run-b's
    (root / LATEST).write_text("step_2\n")
    assert apply_retention(root, RetentionPolicy(keep_last=1), run_id="run-a") == [root / "step_1"]
    assert (root / "step_3" / MANIFEST).is_file()


def test_a_second_process_cannot_lock_a_directory_in_use(tmp_path):
    first = DirectoryLock(tmp_path).acquire()
    try:
        with pytest.raises(CheckpointError, match=rf"is in use by another run \(\{{\"pid\": {os.getpid()}"):
            DirectoryLock(tmp_path).acquire(wait_s=0.3)
    finally:
        first.release()
    DirectoryLock(tmp_path).acquire(wait_s=0).release()


def test_copy_is_independent(root, tmp_path):
    """The fixture's two checkpoints resolve as usual (a guard for the tests above)."""
    shutil.copytree(root, tmp_path / "copy")
    assert resolve_checkpoint("auto", ckpt_root=tmp_path / "copy", group=None) == tmp_path / "copy" / "step_2"


def _spy_load(monkeypatch) -> list[str]:
    """In order: `verify <files>` for each checksum pass (the files it checks), `.metadata` for each
    parse of it, `checked` for each read by the checking reader, `data` for each read as DCP reads."""
    from fsdpkit.checkpoint import safe_io
    from fsdpkit.checkpoint.io.checked_read import CheckedFileSystemReader

    events: list[str] = []
    unpickle = safe_io.unpickle_dcp_metadata
    full = resume.verify_files

    def verify(path, manifest, **kw):
        only = kw.get("only") or (lambda *_: True)
        names = [n for directory, files in resume.file_sets(path, manifest) for n, i in files.items()
                 if only(directory, n, i)]
        events.append("verify " + " ".join(sorted(names)))
        return full(path, manifest, **kw)

    monkeypatch.setattr(resume, "verify_files", verify)
    monkeypatch.setattr(safe_io, "unpickle_dcp_metadata",
                        lambda *a, **kw: events.append(".metadata") or unpickle(*a, **kw))
    for reader, event in ((FileSystemReader, "data"), (CheckedFileSystemReader, "checked")):
        monkeypatch.setattr(reader, "read_data", lambda *a, real=reader.read_data, event=event, **kw:
                            events.append(event) or real(*a, **kw))
    return events


@pytest.fixture
def step_1(tmp_path) -> tuple[CheckpointTarget, Path]:
    saved = _target(0)
    _save(saved, tmp_path / "step_1", 1)
    return saved, tmp_path / "step_1"


def _same_weights(a: CheckpointTarget, b: CheckpointTarget) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.model.parameters(), b.model.parameters(), strict=True))


def _without_items(ckpt: Path) -> None:
    """The manifest as fsdpkit wrote it before item checksums (resealed)."""
    manifest = read_manifest(ckpt)
    for info in manifest["files"].values():
        info.pop("items", None)
    manifest[SEAL] = manifest_digest(manifest)
    _rewrite(ckpt, manifest)


def test_a_load_with_tensor_checks_reads_each_file_once_and_checks_metadata_from_that_read(step_1, monkeypatch):
    saved, ckpt = step_1
    events = _spy_load(monkeypatch)
    loaded = _target(1)
    load_checkpoint(loaded, ckpt, fingerprint={"tensors": {}}, group=None, verify_files=True)
    assert _same_weights(saved, loaded)
    assert events == [".metadata", "checked"]  # no pass; one parse; one read of the data
    assert all("items" in info for name, info in read_manifest(ckpt)["files"].items() if name.endswith(".distcp"))


def test_without_tensor_checks_or_item_checksums_a_pass_checks_the_files_before_the_load_reads_any(step_1,
                                                                                                   monkeypatch):
    """verify_on_load=false: every file in the pass, first. A checkpoint written before item checksums:
    its data files in the pass, first, `.metadata` still from the load's read."""
    saved, ckpt = step_1
    events = _spy_load(monkeypatch)
    files = sorted(read_manifest(ckpt)["files"])
    assert ".metadata" in files and any(f.endswith(".distcp") for f in files)
    loaded = _target(1)
    load_checkpoint(loaded, ckpt, fingerprint={"tensors": {}}, group=None, verify=False, verify_files=True)
    assert _same_weights(saved, loaded)
    assert events == ["verify " + " ".join(files), ".metadata", "data"]
    events.clear()
    _without_items(ckpt)
    loaded = _target(1)
    load_checkpoint(loaded, ckpt, fingerprint={"tensors": {}}, group=None, verify_files=True)
    assert _same_weights(saved, loaded)
    assert events == ["verify " + " ".join(f for f in files if f.endswith(".distcp")), ".metadata", "checked", "data"]
    events.clear()
    load_checkpoint(_target(1), ckpt, fingerprint={"tensors": {}}, group=None, verify_files=False)
    assert events and not [e for e in events if e.startswith("verify")]  # resolution checked them (the caller says)


def _flip_middle(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x01  # one bit flipped: the checksum catches it (whether or not torch.load fails)
    path.write_bytes(bytes(raw))


def _truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 8)


BEFORE = r"^{ckpt} failed verification before loading \(nothing was loaded\):\n  "


@pytest.mark.parametrize(("damage", "victim", "pass_first", "one_read"), [
    (_flip_middle, "data", r"{path} fails its checksum \(xxh3_64 [0-9a-f]{{16}}, expected [0-9a-f]{{16}}\): the file "
                           r"is corrupt$",
     r"^{ckpt} failed verification (while|after) loading[^\n]*\n  {path} fails its checksum [^\n]*the file is "
     r"corrupt"),
    (_flip_middle, ".metadata", r"{path} fails its checksum .*: the file is corrupt$",
     BEFORE + r"{path} fails its checksum \(xxh3_64 [0-9a-f]{{16}}, expected [0-9a-f]{{16}}\): the file is corrupt; "
              r"nothing was unpickled from it$"),
    (_truncate, "data", r"{path} has {size} bytes, expected {expected} \(truncated or overwritten\)$",
     BEFORE + r"{name} has {size} bytes, the manifest says {expected} \(truncated or overwritten\)$"),
    (Path.unlink, "data", r"{path} is missing$", BEFORE + r"{name} is missing$"),
], ids=["flipped", "metadata-flipped", "truncated", "missing"])
@pytest.mark.parametrize("tensor_checks", [False, True], ids=["pass-first", "one-read"])
def test_a_damaged_file_is_named(step_1, monkeypatch, damage, victim, pass_first, one_read, tensor_checks):
    """A corrupt, truncated or missing file fails the load with CheckpointCorruptError naming the
    file. In a pass first (no tensor checks after the load): before anything is read or loaded. In
    the one read: `.metadata` before it is unpickled, and a missing or truncated file before anything
    is read (the target is left as it was); a flipped data byte as the item or the tensor it lies in
    is checked (the state then holds part of the checkpoint: the caller must not use it)."""
    _, ckpt = step_1
    files = read_manifest(ckpt)["files"]
    name = ".metadata" if victim == ".metadata" else sorted(f for f in files if f.endswith(".distcp"))[0]
    path = ckpt / name
    damage(path)
    events = _spy_load(monkeypatch)
    target = _target(1)
    before = _target(1)
    message = (one_read if tensor_checks else BEFORE + pass_first).format(
        ckpt=re.escape(str(ckpt)), path=re.escape(str(path)), name=re.escape(name), size=files[name]["size"] - 8,
        expected=files[name]["size"])
    with pytest.raises(CheckpointCorruptError, match=message):
        load_checkpoint(target, ckpt, fingerprint={"tensors": {}}, group=None, verify=tensor_checks, verify_files=True)
    if not tensor_checks:
        assert events == ["verify " + " ".join(sorted(files))]  # no .metadata parsed, no data read
    elif victim == ".metadata" or damage is not _flip_middle:
        assert events == []  # nothing parsed, nothing read
    if tensor_checks and victim == "data" and damage is _flip_middle:
        assert events[:2] == [".metadata", "checked"]  # found by the load's own read
    else:
        assert _same_weights(target, before)


def test_checkpoints_skip_torch_saves_crc32_and_load_with_and_without_file_checks(tmp_path):
    """fsdpkit writes DCP's per-tensor zips without torch.save's CRC32 (its xxh3 covers the
    bytes); torch.load, DCP and both fsdpkit load paths read them, and the setting is restored."""
    import io
    import zipfile

    from fsdpkit.checkpoint.safe_io import read_dcp_metadata

    assert torch.serialization.get_crc32_options()
    saved = _target(0)
    ckpt = tmp_path / "step_1"
    _save(saved, ckpt, 1)
    assert torch.serialization.get_crc32_options(), "the process-wide CRC32 setting was not restored"
    meta = read_dcp_metadata(ckpt)
    index, info = next((i, s) for i, s in meta.storage_data.items() if i.fqn == "model.0.weight")
    with open(ckpt / info.relative_path, "rb") as f:
        f.seek(info.offset)
        blob = f.read(info.length)
    with zipfile.ZipFile(io.BytesIO(blob)) as z:
        crcs = {i.filename.rsplit("/", 1)[-1]: i.CRC for i in z.infolist()}
    assert crcs["0"] == 0 and crcs["data.pkl"] == 0, crcs  # written with CRC32 off
    assert torch.equal(torch.load(io.BytesIO(blob), weights_only=True), saved.model[0].weight.detach())
    for verify_files in (False, True):
        loaded = _target(1)
        load_checkpoint(loaded, ckpt, fingerprint={"tensors": {}}, group=None, verify_files=verify_files)
        for a, b in zip(saved.model.parameters(), loaded.model.parameters(), strict=True):
            assert torch.equal(a, b)
        assert torch.equal(saved.optimizer.state_dict()["state"][0]["exp_avg"],
                           loaded.optimizer.state_dict()["state"][0]["exp_avg"])
