"""Faults injected from the test side: fsdpkit has no test hooks (no test-only environment variables,
no "if testing" branches); tests hurt it through the seams a user could plug into as well.

    from faults import env, fired, injected, kill_mid_write

    with injected(manifest_enospc(step=3), marker=tmp_path / "faults.jsonl"):   # this process
        ...
    subprocess.run([... "fsdpkit", "train", ...],                               # a launch: every
                   env={**os.environ, **env(raise_at(step=5, rank=1), marker=m)})  # rank inherits it
    assert fired(m, "raise_at") == [...]                                        # it landed, there

The faults (fault_hooks.py has how each one is applied):
- kill_mid_write: a rank SIGKILLs itself after exactly N bytes of its shard file of step S were
  written (pick N inside the tensor bytes: mid_tensor_bytes);
- stall_mid_write: each shard write sleeps after its first bytes (a save held in flight, on disk,
  uncommitted);
- shard_enospc: the disk fills after N bytes of each shard file of step S (ENOSPC from the file's
  raw layer, under Python's buffer: it surfaces in a write, the flush or the close), so fsdpkit's
  own stream, error and clean-up run;
- manifest_enospc: rank 0's commit of step S's manifest fails with ENOSPC in its fsync or its
  rename, so fsdpkit's own clean-up runs;
- skip_restore: a resume leaves named Stateful pieces (or `rng`) unrestored;
- raise_at: training step S raises on a rank (or every rank) before its optimizer update;
- gated (in-process only): the first call of a function (e.g. the async save's write, run by its
  background thread) waits until the test releases it.
Each one records where and when (`time`, the wall clock) it fired in the marker file (`fired`), so a
test proves it landed.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .fault_hooks import SPEC_ENV, Marker, Patches, fired, injected

HERE = Path(__file__).resolve().parent
__all__ = ["SPEC_ENV", "Gate", "Marker", "env", "fired", "gated", "injected", "kill_mid_write", "manifest_enospc",
           "mid_tensor_bytes", "raise_at", "shard_enospc", "skip_restore", "stall_mid_write"]


def kill_mid_write(*, step: int, rank: int, after_bytes: int) -> dict:
    return {"kind": "kill_mid_write", "step": step, "rank": rank, "after_bytes": after_bytes}


def stall_mid_write(*, seconds: float, step: int | None = None) -> dict:
    return {"kind": "stall_mid_write", "seconds": seconds, "step": step}


def shard_enospc(*, step: int, after_bytes: int = 0) -> dict:
    return {"kind": "shard_enospc", "step": step, "after_bytes": after_bytes}


def manifest_enospc(*, step: int, op: str = "fsync") -> dict:
    if op not in ("fsync", "rename"):
        raise ValueError(f"manifest_enospc: op is fsync or rename, not {op!r}")
    return {"kind": "manifest_enospc", "step": step, "op": op}


def skip_restore(*names: str) -> dict:
    return {"kind": "skip_restore", "names": list(names)}


def raise_at(*, step: int, rank: int | str = "*") -> dict:
    return {"kind": "raise_at", "step": step, "rank": rank}


def env(*faults: dict, marker: str | os.PathLike) -> dict[str, str]:
    """What a process needs in its environment (on top of os.environ) to start with `faults`
    armed: this directory first on PYTHONPATH (its sitecustomize.py arms them), the spec."""
    path = [str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {"PYTHONPATH": os.pathsep.join(path), SPEC_ENV: json.dumps({"marker": str(marker), "faults": list(faults)})}


def mid_tensor_bytes(ckpt_dir: str | os.PathLike, rank: int) -> tuple[int, int, int]:
    """(offset of the first tensor item, size, a byte count halfway between them) of `rank`'s
    shard file in the committed checkpoint `ckpt_dir` (a path or a URL). A shard file starts with
    the pickled non-tensor items, then one torch.save archive per tensor: a kill after the middle
    count lands inside tensor bytes, whatever the header sizes."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from fsdpkit.checkpoint.manifest import read_manifest
    from fsdpkit.checkpoint.safe_io import read_dcp_metadata
    from fsdpkit.checkpoint.storage import open_storage

    path = open_storage(ckpt_dir)
    name = f"__{rank}_0.distcp"
    size = read_manifest(path)["files"][name]["size"]
    meta = read_dcp_metadata(path)
    tensors = {fqn for fqn, m in meta.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}
    first = min(info.offset for index, info in meta.storage_data.items()
                if info.relative_path == name and index.fqn in tensors)
    return first, size, first + (size - first) // 2


class Gate:
    """See gated."""

    def __init__(self) -> None:
        self.reached = threading.Event()  # the call arrived and is held
        self.held_s = 0.0  # how long it was held
        self._open = threading.Event()

    def release(self) -> None:
        self._open.set()


@contextmanager
def gated(obj: Any, name: str, *, timeout: float = 300) -> Iterator[Gate]:
    """In this process: the first call of `obj.name` (e.g. a module function that a background
    thread calls) waits until `gate.release()`, or the `with` block ends; `gate.reached` is set
    when it arrives. Later calls pass."""
    gate, patches, real = Gate(), Patches(), getattr(obj, name)

    def held(*args: Any, **kwargs: Any) -> Any:
        if not gate.reached.is_set():
            t0 = time.perf_counter()
            gate.reached.set()
            if not gate._open.wait(timeout):
                raise TimeoutError(f"faults.gated: {name} was held {timeout} s and never released")
            gate.held_s = time.perf_counter() - t0
        return real(*args, **kwargs)

    patches.set(obj, name, held)
    try:
        yield gate
    finally:
        gate.release()
        patches.undo()
