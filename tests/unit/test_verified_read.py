"""Loading with `verify_files=True`: file checksums come from the bytes read for loading."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from fsdpkit.checkpoint import resume
from fsdpkit.checkpoint.errors import CheckpointCorruptError
from fsdpkit.checkpoint.resume import load_checkpoint
from fsdpkit.checkpoint.save import save_checkpoint
from fsdpkit.checkpoint.state import CheckpointTarget


class Counter:
    def __init__(self, step: int = 0):
        self.step = step

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state):
        self.step = int(state["step"])


def _target(seed: int) -> CheckpointTarget:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    return CheckpointTarget(model=model, optimizer=opt, stateful={"train": Counter(1)})


def test_files_are_verified_from_the_load_read_and_corruption_is_caught(tmp_path, monkeypatch):
    saved = _target(0)
    ckpt = tmp_path / "step_1"
    save_checkpoint(saved, ckpt_dir=ckpt, step=1, meta={"run_id": "r", "fingerprint": {"tensors": {}}, "metrics": {}},
                    group=None)
    reread: list[str] = []
    full = resume.verify_files

    def spy(path: Path, manifest, **kw):
        reread.extend(manifest["files"])
        return full(path, manifest, **kw)

    monkeypatch.setattr(resume, "verify_files", spy)
    loaded = _target(1)
    load_checkpoint(loaded, ckpt, fingerprint={"tensors": {}}, group=None, verify_files=True)
    for a, b in zip(saved.model.parameters(), loaded.model.parameters(), strict=True):
        assert torch.equal(a, b)
    data = [p.name for p in ckpt.glob("*.distcp")]
    assert data and not set(data) & set(reread), f"data files re-read for verification: {reread}"
    assert reread == [".metadata"]  # read by DCP's metadata path only: hashed apart (small)

    blob = ckpt / data[0]
    raw = bytearray(blob.read_bytes())
    raw[len(raw) // 2] ^= 0x01  # one bit inside tensor data: torch.load still succeeds
    blob.write_bytes(bytes(raw))
    with pytest.raises(CheckpointCorruptError, match=r"fails its checksum .*the file is corrupt"):
        load_checkpoint(_target(2), ckpt, fingerprint={"tensors": {}}, group=None, verify_files=True)
