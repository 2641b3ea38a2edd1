"""Load a checkpoint into the live state, verify every byte it uses, and check what was restored.

Which checkpoint to load is resolve.py's question; this module reads it: the fingerprint and the
optimizer checked before anything is touched, DCP's load (resharding as needed; one replica group
reads under HSDP: replicas.py), the file checksums (from the load's own read where re-reading is
cheap, else in a pass of their own: `verify_files`), and the restored tensors' checksums after it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as tdist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from fsdpkit.checkpoint.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
)
from fsdpkit.checkpoint.frozen import file_sets, merge_state, split_state
from fsdpkit.checkpoint.full import read_full
from fsdpkit.checkpoint.hashing import HASH_NAME, LINEAR, file_checksum
from fsdpkit.checkpoint.io import safe_reader
from fsdpkit.checkpoint.io.items import ITEMS
from fsdpkit.checkpoint.manifest import check_files_present, check_fingerprint, read_manifest
from fsdpkit.checkpoint.replicas import find_replication, load_replicated
from fsdpkit.checkpoint.safe_io import METADATA_FILENAME, SafeLoadPlanner
from fsdpkit.checkpoint.save import tensor_table
from fsdpkit.checkpoint.settings import IOSettings
from fsdpkit.checkpoint.state import CheckpointTarget, join_tensors, restore_rng
from fsdpkit.checkpoint.storage import open_storage
from fsdpkit.dist import group_rank, group_size, on_main

log = logging.getLogger("fsdpkit.checkpoint")


def verify_files(ckpt_dir: Path, manifest: dict[str, Any], *, group: tdist.ProcessGroup | None = None,
                 threads: int = 4, only: Callable[[Path, str, dict[str, Any]], bool] | None = None,
                 io: IOSettings | None = None) -> list[str]:
    """Recompute every file checksum (the shared files the checkpoint references too; with `only`,
    the files (directory, name, manifest entry) it accepts), split over ranks (and threads), read
    with `io` (default: the environment's); every rank gets all problems."""
    rank, ws, io = group_rank(group), group_size(group), io or IOSettings.from_environment()
    ckpt_dir = open_storage(ckpt_dir)
    listed = [(directory / name, info) for directory, files in file_sets(ckpt_dir, manifest)
              for name, info in sorted(files.items()) if only is None or only(directory, name, info)]

    def check(item: tuple[Path, dict[str, Any]]) -> str | None:
        path, info = item
        if not path.is_file():
            return f"{path} is missing"
        size, digest = file_checksum(path, io=io)
        if size != info["size"]:
            return f"{path} has {size} bytes, expected {info['size']} (truncated or overwritten)"
        if digest != info[HASH_NAME]:
            return f"{path} fails its checksum ({HASH_NAME} {digest}, expected {info[HASH_NAME]}): the file is corrupt"
        return None

    with ThreadPoolExecutor(max_workers=threads) as pool:
        mine = [p for p in pool.map(check, listed[rank::ws]) if p]
    if not tdist.is_initialized():
        return mine
    everyone: list[list[str]] = [[] for _ in range(ws)]
    tdist.all_gather_object(everyone, mine, group=group)
    return [p for problems in everyone for p in problems]


@dataclass(frozen=True)
class LoadReport:
    """What `load_checkpoint` did."""

    manifest: dict[str, Any]  # the loaded checkpoint's manifest
    notes: list[str]  # tolerated differences (wrap policy, mixed precision, a rank without saved RNG...)
    load_s: float  # reading and restoring
    verify_s: float | None  # post-load verification; None: it did not run (verify_on_load=false)


def load_checkpoint(
    target: CheckpointTarget,
    ckpt_dir: Path,
    *,
    fingerprint: dict[str, Any],
    group: tdist.ProcessGroup | None,
    model_only: bool = False,
    verify: bool = True,
    verify_files: bool = False,
    optimizer_steps: bool = False,
    io: IOSettings | None = None,
) -> LoadReport:
    """Load `ckpt_dir` into `target` (resharding to the current world size as needed), reading with
    `io` (default: the environment's I/O settings).

    Checks the model fingerprint before touching any state. With `verify`, recomputes per-tensor
    checksums of what was restored and compares them with the manifest. With `verify_files` (a
    checkpoint whose file checksums resolution did not check), every byte the load uses is checked
    against the manifest: a sharded checkpoint loaded with `verify` reads each file once, and
    `.metadata` and every item of a file with item checksums are checked from that read before
    anything decodes them (io/checked_read.py), the tensors' elements by `verify` after it; every
    other file (a full checkpoint's, one written without item checksums, or all of them without
    `verify`) is checked whole in a pass of its own, split over ranks, before the load reads any.
    With `optimizer_steps` (the loop's step counts optimizer steps: fsdpkit's trainer), `verify`
    also checks the optimizer's step counts against the checkpoint's step.

    Returns: what was loaded (the manifest), notes about tolerated changes, and timings.
    Raises:
        CheckpointMismatchError: incompatible model, optimizer state saved but no optimizer to take
            it (or the reverse; see check_optimizer), or restored state differs from what was saved.
        CheckpointCorruptError: with `verify_files`, a file is missing, truncated or fails its
            checksum. Found by the pass: nothing was loaded. Found while or after loading: `target`
            holds part of the checkpoint and must not be used as it is (Checkpointer.resume loads
            an older checkpoint over it, or stops the run).
    """
    t0, io, ckpt_dir = time.perf_counter(), io or IOSettings.from_environment(), open_storage(ckpt_dir)
    manifest = read_manifest(ckpt_dir)
    notes = check_fingerprint(manifest["fingerprint"], fingerprint, ckpt_dir=ckpt_dir)
    if not model_only:
        check_optimizer(manifest, target, ckpt_dir=ckpt_dir)
    sharded = manifest.get("state_dict_type", "sharded") != "full"
    one_read = verify_files and verify and sharded
    if one_read:  # before any file is read for loading: every file there, of its size (rank 0 looks)
        on_main(lambda: _check_present(ckpt_dir, manifest), group=group, errors=(CheckpointCorruptError,))
    if verify_files:  # and those the load's own read cannot check, whole
        _check_files(ckpt_dir, manifest, group=group, io=io, only=_read_unchecked if one_read else None)
    rank = group_rank(group)
    tensors: dict[str, Any] = {}
    readers: dict[str, Any] = {}
    if not sharded:
        rng = read_full(target, ckpt_dir, manifest, rank=rank, model_only=model_only)
    else:
        readers = _readers(ckpt_dir, manifest, checked=one_read, io=io)
        rng, tensors = _load_sharded(target, ckpt_dir, manifest, readers, rank=rank, group=group,
                                     model_only=model_only, io=io)
    if rng is None and not model_only:
        notes.append(f"rank {rank} has no saved RNG state (saved on {manifest['world_size']} ranks); "
                     "it keeps its fresh seed")
    if not model_only:
        _restore_stateful(target, manifest, tensors, ckpt_dir=ckpt_dir)
        if rng is not None:
            restore_rng(rng)
    t_load = time.perf_counter()
    verify_s = None
    if verify:
        try:
            verify_restored(target, manifest, group=group, model_only=model_only, ckpt_dir=ckpt_dir, io=io,
                            optimizer_step=manifest["step"] if optimizer_steps else None)
        except CheckpointMismatchError as e:
            if one_read and e.differing:  # the elements were not checked before: are their files intact?
                _check_after_load(ckpt_dir, manifest, readers, keys=e.differing, group=group, cause=e, io=io)
            raise
        verify_s = time.perf_counter() - t_load
    return LoadReport(manifest=manifest, notes=notes, load_s=t_load - t0, verify_s=verify_s)


def _check_present(ckpt_dir: Path, manifest: dict[str, Any]) -> None:
    if problems := check_files_present(ckpt_dir, manifest):
        raise CheckpointCorruptError(f"{ckpt_dir} failed verification before loading (nothing was loaded):\n  "
                                     + "\n  ".join(problems))


def _read_unchecked(directory: Path, name: str, info: dict[str, Any]) -> bool:
    """Whether the load's own read cannot check file `name`: a data file without item checksums
    (`.metadata` always can)."""
    return name != METADATA_FILENAME and ITEMS not in info


def check_optimizer(manifest: dict[str, Any], target: CheckpointTarget, *, ckpt_dir: Path) -> None:
    """Raise CheckpointMismatchError, before anything is loaded, when the checkpoint holds
    optimizer state and `target` has no optimizer, or the reverse: a full resume would drop
    that state, or start an optimizer from nothing, without a word. A manifest without the
    `optimizer` field (not written by a Checkpointer) is not checked."""
    if "optimizer" not in manifest:
        return
    saved, live = manifest["optimizer"], target.optimizer
    if saved is not None and live is None:
        raise CheckpointMismatchError(
            f"checkpoint {ckpt_dir} holds optimizer state ({saved.get('class', 'unknown class')}), and this "
            "Checkpointer has no optimizer; nothing was loaded. Pass the optimizer (Checkpointer(..., "
            "optimizer=opt)) to resume the run, or load the weights alone with resume_mode='model_only' "
            "(checkpoint.resume_mode=model_only): counters, schedule and data then start fresh")
    if saved is None and live is not None:
        raise CheckpointMismatchError(
            f"checkpoint {ckpt_dir} was saved without an optimizer (its manifest records \"optimizer\": null), and "
            f"this Checkpointer has an optimizer ({type(live).__name__}); nothing was loaded. Leave optimizer= out "
            "to resume it as it was saved, or load its weights into a fresh optimizer with "
            "resume_mode='model_only' (checkpoint.resume_mode=model_only): counters, schedule and data then "
            "start fresh too")


def _restore_stateful(target: CheckpointTarget, manifest: dict[str, Any], tensors: dict[str, Any], *,
                      ckpt_dir: Path) -> None:
    missing = sorted(target.stateful.keys() - manifest["trainer"].keys())
    if missing:
        raise CheckpointMismatchError(
            f"checkpoint {ckpt_dir} holds no state for {', '.join(missing)} (it has {sorted(manifest['trainer'])}); "
            "it was saved by a different loop. Resume with checkpoint.resume_mode=model_only, or start fresh")
    for name, obj in target.stateful.items():
        try:
            obj.load_state_dict(join_tensors(manifest["trainer"][name], tensors))
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointMismatchError(
                f"checkpoint {ckpt_dir}: the saved `{name}` state does not fit this run ({type(e).__name__}: {e}); "
                "resume with checkpoint.resume_mode=model_only, or start fresh") from None


def _readers(ckpt_dir: Path, manifest: dict[str, Any], *, checked: bool, io: IOSettings) -> dict[str, Any]:
    """A DCP reader per directory the load reads (the checkpoint's, then each shared one it
    references), by str(directory); `checked`: each checks what it reads against the manifest
    (io/checked_read.py)."""
    covered = manifest["tensors"].keys()
    return {str(directory): safe_reader(directory, files=files if checked else None, covered=covered, io=io)
            for directory, files in file_sets(ckpt_dir, manifest)}


def _load_sharded(target: CheckpointTarget, ckpt_dir: Path, manifest: dict[str, Any], readers: dict[str, Any], *,
                  rank: int, group: tdist.ProcessGroup | None, model_only: bool,
                  io: IOSettings) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """DCP load (resharding as needed) into the live model/optimizer through `readers` (one load
    per directory: the checkpoint's, and each shared one it references); returns this rank's RNG
    state and the Stateful pieces' tensors (by `state.<name>.<path>`).

    Where the live state is replicated (HYBRID_SHARD, NO_SHARD: replicas.find_replication), one
    replica group reads and sends the others what it read (replicas.py): each byte is read once."""
    state = target.tensor_state(rank=rank, model_only=model_only)
    reader = readers[str(ckpt_dir)]

    def read(into: dict[str, Any], *, group: tdist.ProcessGroup | None, no_dist: bool = False) -> None:
        parts = split_state(into, manifest, ckpt_dir)  # frozen tensors shared with other checkpoints (frozen.py)
        try:
            for loading in [reader] + [readers[str(directory)] for directory, _ in parts]:
                _read_metadata(loading, ckpt_dir=ckpt_dir)  # every .metadata first: a bad one fails before any load
            for directory, part in parts:
                _dcp_load(part, readers[str(directory)], group=group, no_dist=no_dist)
            _dcp_load(into, reader, group=group, no_dist=no_dist)
        finally:
            merge_state(into, parts)

    replication = find_replication(state, group=group)
    if replication is not None:
        rng = load_replicated(state, reader, read=read, replication=replication, group=group, ckpt_dir=ckpt_dir, io=io,
                              manifest=manifest)
    else:
        _agree_on_metadata(list(readers.values()), ckpt_dir=ckpt_dir, group=group)
        rng = _load_every_rank(state, reader, read=read, rank=rank, group=group, ckpt_dir=ckpt_dir)
    target.restore_tensors(state)
    tensors = {f"state.{k}": v for k, v in state.get("state", {}).items()}
    return rng, tensors


def _read_metadata(reader: Any, *, ckpt_dir: Path) -> Any:
    """`reader`'s `.metadata` (parsed once per reader, safe_io.SafeMetadataReading): read before
    dcp.load, which would retry a per-rank file and lose a refusal's type. A corrupt one says that
    nothing was loaded."""
    try:
        return reader.read_metadata()
    except CheckpointCorruptError as e:
        raise CheckpointCorruptError(f"{ckpt_dir} failed verification before loading (nothing was loaded):\n  {e}") \
            from e


def _agree_on_metadata(readers: list[Any], *, ckpt_dir: Path, group: tdist.ProcessGroup | None) -> None:
    """Collective: every rank reads every directory's `.metadata` (`_read_metadata`), then all learn
    whether any failed and raise the first failure (its type and message) together. Without it a
    rank that found `.metadata` corrupt would set the checkpoint aside while another still reads it.
    (A replicated load agrees in replicas.py.)"""
    failure: tuple[type, str] | None = None
    try:
        for reader in readers:
            _read_metadata(reader, ckpt_dir=ckpt_dir)
    except CheckpointError as e:
        failure = (type(e), str(e))
    if tdist.is_initialized() and tdist.get_world_size(group) > 1:
        everyone: list[tuple[type, str] | None] = [None] * tdist.get_world_size(group)
        tdist.all_gather_object(everyone, failure, group=group)
        failure = next((f for f in everyone if f is not None), None)
    if failure is not None:
        raise failure[0](failure[1])


def _dcp_load(state: dict[str, Any], reader: Any, *, group: tdist.ProcessGroup | None, no_dist: bool) -> None:
    """dcp.load through `reader` (its `.metadata` read before, `_read_metadata`)."""
    dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(), process_group=group, no_dist=no_dist)


def _load_every_rank(state: dict[str, Any], reader: Any, *, read: Callable[..., None], rank: int,
                     group: tdist.ProcessGroup | None, ckpt_dir: Path) -> dict[str, Any] | None:
    """Every rank reads its own part of the checkpoint (`read`); this rank's RNG state, if saved.
    A checkpoint error that DCP's load raised on any rank (a corrupt item) is raised on every rank
    as its own type."""
    if "rng" in state:  # a rank the saving run did not have, or a generator it lacked (CUDA saved on a CPU host)
        saved = _read_metadata(reader, ckpt_dir=ckpt_dir).state_dict_metadata
        rng = {k: v for k, v in state["rng"][f"rank{rank}"].items() if f"rng.rank{rank}.{k}" in saved}
        if "torch_cpu" in rng:
            state["rng"][f"rank{rank}"] = rng
        else:
            del state["rng"]
    try:
        read(state, group=group)
    except CheckpointException as e:  # a BaseException: see errors.py
        causes = [cause for cause, _ in e.failures.values() if isinstance(cause, CheckpointError)]
        if not causes:
            raise
        raise type(causes[0])(f"{ckpt_dir} failed verification while loading; the state loaded so far must not be "
                              f"used:\n  {causes[0]}") from e
    return state["rng"][f"rank{rank}"] if "rng" in state else None


def _check_files(ckpt_dir: Path, manifest: dict[str, Any], *, group: tdist.ProcessGroup | None, io: IOSettings,
                 only: Callable[[Path, str, dict[str, Any]], bool] | None = None) -> None:
    """Collective: raise CheckpointCorruptError naming every file of `manifest` (that `only`
    accepts) that is missing, has another size or fails its checksum (`verify_files`)."""
    if only is not None and not any(only(directory, name, info) for directory, files in file_sets(ckpt_dir, manifest)
                                    for name, info in files.items()):
        return  # nothing to check (every rank sees the same manifest)
    problems = verify_files(ckpt_dir, manifest, group=group, only=only, io=io)
    if problems:
        raise CheckpointCorruptError(f"{ckpt_dir} failed verification before loading (nothing was loaded):\n  "
                                     + "\n  ".join(problems))


def _check_after_load(ckpt_dir: Path, manifest: dict[str, Any], readers: dict[str, Any], *, keys: list[str],
                      group: tdist.ProcessGroup | None, cause: CheckpointMismatchError, io: IOSettings) -> None:
    """Collective, after a one-read load restored `keys` with other checksums than the manifest's:
    check the files their elements were read from, whole. Raise CheckpointCorruptError naming
    those that fail (the bytes were corrupt); return if they pass (the restore changed the values:
    the caller raises `cause`)."""
    holders = {(directory, info.relative_path) for directory, reader in readers.items()
               for index, info in reader.read_metadata().storage_data.items() if index.fqn in keys}
    problems = verify_files(ckpt_dir, manifest, group=group, io=io,
                            only=lambda directory, name, _: (str(directory), name) in holders)
    if problems:
        raise CheckpointCorruptError(
            f"{ckpt_dir} failed verification after loading: {len(keys)} tensor(s) differ from their checksums "
            f"({', '.join(keys[:5])}{', ...' if len(keys) > 5 else ''}), and the files they were read from fail "
            "theirs; the state loaded must not be used:\n  " + "\n  ".join(problems)) from cause


def verify_restored(target: CheckpointTarget, manifest: dict[str, Any], *, group: tdist.ProcessGroup | None,
                    model_only: bool, ckpt_dir: Path, optimizer_step: int | None = None,
                    io: IOSettings | None = None) -> None:
    """Compare the live, restored state with the manifest: keys, shapes, dtypes and checksums (computed
    with `io`), and with `optimizer_step` the optimizer's step counts. Any difference is an error
    naming the key and both values."""
    rank = group_rank(group)
    # checkpoints written before the algorithm was recorded used `linear`
    _, live = tensor_table(target.tensor_state(rank=rank, model_only=model_only), group=group,
                           algorithm=manifest.get("tensor_hash", LINEAR), io=io)
    saved = {k: v for k, v in manifest["tensors"].items() if not model_only or k.startswith("model.")}
    problems = [f"{k}: in the checkpoint, not restored" for k in sorted(saved.keys() - live.keys())]
    problems += [f"{k}: restored, but not in the checkpoint" for k in sorted(live.keys() - saved.keys())]
    differing = []  # keys of the right shape and dtype whose values differ
    for k in sorted(saved.keys() & live.keys()):
        for field in ("shape", "dtype", "hash"):
            if saved[k][field] != live[k][field]:
                problems.append(f"{k}: {field} saved {saved[k][field]}, restored {live[k][field]}")
                if field == "hash":
                    differing.append(k)
    if not model_only and optimizer_step is not None and target.optimizer is not None:
        opt_steps = {int(s["step"]) for s in target.optimizer.state.values() if "step" in s}
        if opt_steps and opt_steps != {optimizer_step}:
            problems.append(f"optimizer step counts {sorted(opt_steps)} differ from the trainer step {optimizer_step}")
    if problems:
        raise CheckpointMismatchError(
            f"restored state differs from checkpoint {ckpt_dir} ({len(problems)} problem(s)):\n  "
            + "\n  ".join(problems[:40]), differing=differing)
