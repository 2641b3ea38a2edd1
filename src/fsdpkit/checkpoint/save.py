"""Sharded save with an atomic commit.

Every rank writes its shards through DCP (file checksums computed while writing); then the file
lists are gathered, rank 0 writes manifest.json (the commit) and moves `latest`, and a final
barrier tells every rank the checkpoint is committed. All collectives run on a dedicated gloo
group created with a bounded timeout, so a dead or stuck rank fails the save on every other rank
instead of hanging it; the previous checkpoint then stays `latest`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import torch
import torch.distributed as tdist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlanner

from fsdpkit.checkpoint import staging
from fsdpkit.checkpoint.catalog import publish_latest
from fsdpkit.checkpoint.errors import CheckpointSaveError
from fsdpkit.checkpoint.frozen import SHARED, SharedDir, frozen_keys, new_dir_name, stale_problem
from fsdpkit.checkpoint.full import write_full
from fsdpkit.checkpoint.hashing import (
    hash_algorithm_for,
    local_contributions,
    reduce_contributions,
    tensor_hashes,
    zip_crc32_off,
)
from fsdpkit.checkpoint.io import hashing_writer, record_items
from fsdpkit.checkpoint.layout import INCOMING, LATEST, MANIFEST, CkptPath, swap_in
from fsdpkit.checkpoint.manifest import (
    FORMAT,
    FORMAT_VERSION,
    FORMAT_VERSION_UNSHARED,
    dtype_name,
    versions,
    write_manifest,
)
from fsdpkit.checkpoint.settings import IOSettings
from fsdpkit.checkpoint.state import CheckpointTarget, flatten
from fsdpkit.checkpoint.storage import open_storage
from fsdpkit.checkpoint.storage.mirror import Mirror
from fsdpkit.dist import group_rank, group_size

log = logging.getLogger("fsdpkit.checkpoint")


class PlanCache:
    """DCP's save-plan caching for the saves of one Checkpointer.

    Planning a save is a gather of every rank's plan at rank 0, a global plan and `.metadata` made
    there, and a scatter back: its cost grows with tensors x ranks. With caching (DCP's
    `DefaultSavePlanner(enable_plan_caching=True)`), a rank whose local plan equals its previous one
    sends an empty plan, rank 0 reuses the global plan and metadata it made before, and each rank
    reuses its final plan; a rank whose plan changed (a tensor's shape or a new key) sends it, and
    rank 0 plans again from the merged plans. The files written are the same either way.

    DCP keeps the caches in class attributes of SavePlanner, under one key per planner class, so
    two Checkpointers in one process would share them; each PlanCache uses a key of its own. After
    a save that failed on some rank, the ranks' caches may disagree (a rank may have cached the
    failed save's plan, another not): `renew` starts every rank afresh under a new key.
    """

    _CACHES = ("_cached_save_plan", "_cached_final_save_plan", "_cached_all_plans", "_cached_global_plan",
               "_cached_metadata")

    def __init__(self) -> None:
        self.key = ""
        self.renew()

    def planner(self) -> DefaultSavePlanner:
        planner = DefaultSavePlanner(enable_plan_caching=True)
        planner._cached_plans_key = self.key  # DCP's own key is the class name, shared by the whole process
        return planner

    def renew(self) -> None:
        self.forget()
        self.key = f"fsdpkit-{uuid.uuid4().hex}"

    def forget(self) -> None:
        for name in self._CACHES:
            getattr(SavePlanner, name, {}).pop(self.key, None)


def checksummed_tensors(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The model, optimizer and Stateful tensors of a DCP state dict, by DCP key (RNG is per rank:
    excluded)."""
    flat = flatten({k: v for k, v in state.items() if k in ("model", "optim", "state")})
    return {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}


def tensor_table(state: dict[str, Any], *, group: tdist.ProcessGroup | None, algorithm: str | None = None,
                 io: IOSettings | None = None) -> tuple[str, dict[str, dict[str, Any]]]:
    """(hash algorithm, {DCP key: shape, dtype, hash}); the algorithm follows where the tensors
    live unless given (verification must use the one the checkpoint was saved with).
    Collective over `group`. `io`: the checksums' tunables (hashing.hash_part)."""
    tensors = checksummed_tensors(state)
    if algorithm is None:  # the same on every rank: all hold their state on the same kind of device
        algorithm = hash_algorithm_for(tensors)
    return algorithm, _table(tensors, tensor_hashes(tensors, group=group, algorithm=algorithm, io=io))


def _table(tensors: dict[str, torch.Tensor], hashes: dict[str, str]) -> dict[str, dict[str, Any]]:
    return {k: {"shape": list(t.shape), "dtype": dtype_name(t.dtype), "hash": hashes[k]} for k, t in tensors.items()}


@dataclass
class Shares:
    """This rank's tensor checksum shares, computed before the write (hashing.local_contributions)."""

    algorithm: str
    local: dict[str, int]
    seconds: float  # wall time of the pass that computed them
    cpu_s: float  # its CPU time (of the thread that ran it)


def _shares(tensors: dict[str, torch.Tensor], *, group: tdist.ProcessGroup | None, algorithm: str, io: IOSettings,
            copy_to: dict[str, torch.Tensor] | None = None) -> Shares:
    t0, c0 = time.perf_counter(), time.thread_time()
    local = local_contributions(tensors, group=group, algorithm=algorithm, copy_to=copy_to, io=io)
    return Shares(algorithm, local, time.perf_counter() - t0, time.thread_time() - c0)


def stage_hashing(live: dict[str, Any], staged: dict[str, Any], *, group: tdist.ProcessGroup | None,
                  io: IOSettings) -> Shares:
    """Copy every tensor of the DCP state dict `live` into its place in `staged` (the same
    structure, e.g. an async save's staging buffer) and return the checksum shares of the copied
    state, computed in the same pass over memory (hashing.hash_part), so that the write after it
    needs no hashing pass of its own (write_snapshot takes them from the Snapshot)."""
    tensors, buffers = checksummed_tensors(live), checksummed_tensors(staged)
    algorithm = hash_algorithm_for(tensors)
    shares = _shares(tensors, group=group, algorithm=algorithm, io=io, copy_to=buffers)
    hashed = {id(t) for t in tensors.values()}
    for src, dst in zip(staging.tensors(live), staging.tensors(staged), strict=True):
        if id(src) not in hashed:  # the rest (e.g. RNG states): copied only
            staging.copy_host(staging.local_part(dst), staging.local_part(src))
    return shares


def _write_and_hash(state: dict[str, Any], write: Callable[[], Any], *, group: tdist.ProcessGroup | None,
                    io: IOSettings,
                    shares: Shares | None = None) -> tuple[Any, str, dict[str, dict[str, Any]], dict[str, float]]:
    """`write()` while a worker thread computes this rank's tensor checksum shares (unless
    `shares` were computed before, by stage_hashing), then sum them over ranks: (write's result,
    algorithm, tensor table, timings).

    Why a thread: hashing is a pass over every byte of the state; run before the write it added
    its full time to every save, while the write mostly waits for the disk (fsync) with the GIL
    released, and xxh3 releases the GIL too. Both only read the tensors. The checksum values are
    those of `tensor_table` (same shares, same sum)."""
    tensors = checksummed_tensors(state)
    algorithm = hash_algorithm_for(tensors)  # the same on every rank: all hold state on the same kind of device
    if shares is not None and (shares.algorithm != algorithm or shares.local.keys() != tensors.keys()):
        raise RuntimeError(f"fsdpkit: checksums staged with {shares.algorithm} for {len(shares.local)} tensors, "
                           f"but the state to write has {len(tensors)} for {algorithm} (a bug: please report it)")
    t0, c0 = time.perf_counter(), time.thread_time()
    if shares is None:
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="fsdpkit-hash") as pool:
            pending = pool.submit(_shares, tensors, group=group, algorithm=algorithm, io=io)
            written = write()
            t_write, c_write = time.perf_counter() - t0, time.thread_time() - c0
            computed = pending.result()
        timings = {"hash_s": computed.seconds, "hash_cpu_s": computed.cpu_s}
    else:
        written = write()
        t_write, c_write = time.perf_counter() - t0, time.thread_time() - c0
        computed = shares
        timings = {"staging_and_hash_s": shares.seconds, "staging_and_hash_cpu_s": shares.cpu_s}
    t_joined = time.perf_counter() - t0
    hashes = reduce_contributions(computed.local, group=group)
    timings.update({"write_s": t_write, "write_cpu_s": c_write, "hash_wait_s": t_joined - t_write,
                    "hash_reduce_s": time.perf_counter() - t0 - t_joined})
    return written, algorithm, _table(tensors, hashes), timings


def _gather(obj: Any, group: tdist.ProcessGroup | None) -> list[Any]:
    if not tdist.is_initialized():
        return [obj]
    out = [None] * tdist.get_world_size(group)
    tdist.all_gather_object(out, obj, group=group)
    return out


@dataclass
class Snapshot:
    """Everything one checkpoint holds, captured at a step boundary: the DCP state dict (live
    tensors for a synchronous save, a staged host copy for an async one) and the manifest's
    JSON parts, copied so that training can run on while the snapshot is written."""

    step: int
    state: dict[str, Any]
    trainer: dict[str, Any]
    meta: dict[str, Any]
    shares: Shares | None = None  # tensor checksum shares computed while staging (stage_hashing)
    shared: SharedDir | None = None  # the frozen tensors, taken out of `state`: written there (FrozenShare)
    frozen_s: float = 0.0  # FrozenShare.take's time: the frozen tensors' checksums (and their write, if any)


class FrozenShare:
    """The frozen tensors of one Checkpointer's saves (frozen.py): the shared directory its
    checkpoints reference, written by the first save and again only when a frozen tensor changed."""

    def __init__(self, root: CkptPath, *, io: IOSettings | None = None) -> None:
        self.root, self.io = open_storage(root), io or IOSettings.from_environment()
        self.current: SharedDir | None = None

    def take(self, snapshot: Snapshot, target: CheckpointTarget, *, run_id: str, group: tdist.ProcessGroup | None,
             thread_count: int = 1, algorithm: str | None = None) -> None:
        """Collective: take the frozen tensors out of `snapshot.state` and make `snapshot.shared`
        the directory that holds them, writing it when none holds exactly these values (their
        checksums, computed now, decide). `algorithm`: the tensor hash the rest of the save will
        use (one per manifest); default: the one the rest of `snapshot.state` calls for (an async
        save, which hashes its host copy, passes `xxh3_64-rows`)."""
        keys = [k.removeprefix("model.") for k in frozen_keys(target)]
        model = snapshot.state.get("model", {})
        if not keys or any(k not in model for k in keys):
            return
        t0 = time.perf_counter()
        frozen = {"model": {k: model.pop(k) for k in keys}}
        try:
            if algorithm is None:
                algorithm = hash_algorithm_for(checksummed_tensors(snapshot.state))
            algorithm, table = tensor_table(frozen, group=group, algorithm=algorithm, io=self.io)
            current = self.current
            if current is not None and current.algorithm == algorithm and current.tensors == table:
                problem = _agree(stale_problem(current, self.root) if group_rank(group) == 0 else None, group)
                if problem is None:
                    snapshot.shared, snapshot.frozen_s = current, time.perf_counter() - t0
                    return
                log.warning("checkpoint: the shared frozen tensors in %s cannot be referenced any more (%s); writing "
                            "them again", self.root / current.dir, problem)
            elif current is not None:
                changed = sorted(k for k in table if current.tensors.get(k) != table[k])
                log.warning("checkpoint: %d frozen tensor(s) changed since %s was written (%s%s); writing them again",
                            len(changed), self.root / current.dir, ", ".join(changed[:5]),
                            ", ..." if len(changed) > 5 else "")
            self.current = snapshot.shared = self._write(frozen, table, algorithm, run_id=run_id, step=snapshot.step,
                                                         group=group, thread_count=thread_count)
            snapshot.frozen_s = time.perf_counter() - t0
        except BaseException:
            model.update(frozen["model"])  # the snapshot stays whole for the caller
            raise

    def _write(self, frozen: dict[str, Any], table: dict[str, Any], algorithm: str, *, run_id: str, step: int,
               group: tdist.ProcessGroup | None, thread_count: int) -> SharedDir:
        name = _agree(new_dir_name(run_id=run_id, step=step) if group_rank(group) == 0 else None, group)
        into = self.root / name
        try:
            try:
                writer, fs = hashing_writer(into, thread_count=thread_count, io=self.io)
                with zip_crc32_off():
                    metadata = dcp.save(frozen, storage_writer=writer, process_group=group)
                record_items(into, fs.files, metadata, covered=frozenset(table))
                files = {n: i for rank_files in _gather(fs.files, group) for n, i in rank_files.items()}
            except BaseException:
                if group_rank(group) == 0:  # a fresh name that nothing references: give the space back
                    with contextlib.suppress(OSError):
                        into.remove_tree()
                raise
        except (CheckpointException, RuntimeError, OSError) as e:
            raise save_error(e, doing=f"writing the frozen tensors to {into}") from e
        log.info("checkpoint: wrote %d frozen tensor(s) to %s; later checkpoints reference them while they are "
                 "unchanged", len(table), into)
        return SharedDir(name, files, table, algorithm)


def capture(target: CheckpointTarget, *, step: int, meta: dict[str, Any], rank: int) -> Snapshot:
    """The live state of `target` (no tensor copies; see AsyncSaver for a staged one)."""
    trainer = json.loads(json.dumps(target.json_state()))  # a deep copy, JSON-safe by construction
    return Snapshot(step=step, state=target.tensor_state(rank=rank), trainer=trainer, meta=meta)


def save_checkpoint(
    target: CheckpointTarget,
    *,
    ckpt_dir: CkptPath,
    step: int,
    meta: dict[str, Any],
    group: tdist.ProcessGroup | None,
    thread_count: int = 1,
    state_dict_type: str = "sharded",
    io: IOSettings | None = None,
    mirror: Mirror | None = None,
    plans: PlanCache | None = None,
    frozen: FrozenShare | None = None,
) -> dict[str, Any]:
    """Save and commit `target` to `ckpt_dir` on every rank; returns the manifest (rank 0) or
    {"step", "bytes_per_rank"} (other ranks).

    A committed checkpoint already at `ckpt_dir` is replaced only once its successor is committed:
    the new one is written to `<ckpt_dir>.incoming` and swapped in after its commit.

    Args:
        meta: manifest fields known to the caller (run id, config, fingerprint, optimizer summary, mesh).
        io: the I/O tunables (default: the environment's).
        mirror: the local copy (checkpoint.local_dir) a remote sharded save's files are teed into.
        plans: the save-plan cache of the caller's saves (a sharded save; None: DCP plans afresh).
        frozen: the caller's shared frozen tensors (a sharded save; None: every tensor is written).
    Raises:
        CheckpointSaveError: on every rank, if any rank failed or timed out; nothing was committed.
    """
    rank, io = group_rank(group), io or IOSettings.from_environment()
    snapshot = capture(target, step=step, meta=meta, rank=rank)
    if state_dict_type != "full":
        if frozen is not None:
            frozen.take(snapshot, target, run_id=meta["run_id"], group=group, thread_count=thread_count)
        return write_snapshot(snapshot, ckpt_dir=ckpt_dir, group=group, thread_count=thread_count, io=io,
                              mirror=mirror, plans=plans)

    if "state" in snapshot.state:
        raise CheckpointSaveError("strategy.state_dict_type=full cannot hold tensors in the checkpoint `state` "
                                  f"({', '.join(sorted(snapshot.state['state'])[:5])}); use the sharded type")

    def write(into: CkptPath) -> tuple[list[dict[str, Any]], dict[str, Any]]:  # rank 0 gathers and writes safetensors
        written = write_full(target, into, rank=rank, group=group, io=io)
        return [written.get("files", {})], {"optimizer_param_groups": written.get("optimizer_param_groups")}

    return _commit(snapshot, ckpt_dir=ckpt_dir, group=group, kind="full", write=write, io=io)


def write_snapshot(snapshot: Snapshot, *, ckpt_dir: CkptPath, group: tdist.ProcessGroup | None, thread_count: int = 1,
                   io: IOSettings | None = None, mirror: Mirror | None = None,
                   plans: PlanCache | None = None) -> dict[str, Any]:
    """Write a captured snapshot as a sharded checkpoint and commit it (collective over `group`).
    Safe to run on a background thread when `group` is used by nothing else meanwhile. A remote
    checkpoint's files are also written to `mirror`, if given (storage/mirror.py). The files go through
    io.hashing_writer, and each data file gets its item checksums (io.record_items; local only);
    with `plans`, DCP reuses the previous save's plan where nothing changed. `io`: the I/O tunables
    (default: the environment's)."""
    io = io or IOSettings.from_environment()

    # every rank writes its shards through DCP
    def write(into: CkptPath) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        writer, fs = hashing_writer(into, thread_count=thread_count, io=io, mirror=mirror)
        try:
            with zip_crc32_off():
                metadata = dcp.save(snapshot.state, storage_writer=writer, process_group=group,
                                    planner=plans.planner() if plans is not None else None)
        except BaseException:
            if plans is not None:  # every rank's save raises: every rank starts its cache afresh
                plans.renew()
            raise
        record_items(into, fs.files, metadata, covered=frozenset(checksummed_tensors(snapshot.state)))
        return _gather(fs.files, group), {}

    return _commit(snapshot, ckpt_dir=ckpt_dir, group=group, kind="sharded", write=write, io=io)


def _incoming(final: CkptPath) -> CkptPath:
    """Where a save that replaces the committed `final` is written and committed first."""
    return final.with_name(final.name + INCOMING)


def _prepare(final: CkptPath) -> CkptPath:
    """Rank 0, before a save: the directory to write into (`final`, or beside it when `final` is
    committed), cleared of debris from an earlier attempt that never committed."""
    final.parent.mkdir(parents=True, exist_ok=True)
    incoming = _incoming(final)
    if (incoming / MANIFEST).is_file():
        swap_in(incoming, final)  # an earlier replacement committed but was not swapped in: finish it
    for stale in (incoming, final):
        if stale.exists() and not (stale / MANIFEST).is_file():
            stale.remove_tree()  # an uncommitted attempt of this run (the directory is ours: see ownership)
    return incoming if (final / MANIFEST).is_file() else final


def _agree(status: Any, group: tdist.ProcessGroup | None) -> Any:
    """Rank 0's `status` on every rank (the group's bounded timeout applies)."""
    if not tdist.is_initialized():
        return status
    box = [status]
    tdist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def save_error(e: BaseException, *, doing: str, unfinished: str = "") -> CheckpointSaveError:
    """The CheckpointSaveError every rank raises when `doing` (e.g. "saving <dir>") failed with `e`:
    DCP's CheckpointException (a BaseException: wrapped so that callers' `except Exception` sees it),
    a RuntimeError (a collective timed out or lost a peer: `unfinished` says what is left), or an
    OSError (the disk: full, or not writable)."""
    if isinstance(e, CheckpointException):
        return CheckpointSaveError(f"{doing} failed on at least one rank; the previous checkpoint stays latest: {e}")
    if isinstance(e, RuntimeError):
        return CheckpointSaveError(f"{doing} failed: a rank died or stalled ({str(e).splitlines()[0]}); the previous "
                                   f"checkpoint stays latest{unfinished}")
    return CheckpointSaveError(f"{doing} failed ({e}); nothing was committed and the previous checkpoint stays "
                               "latest. Free space or fix permissions, then resume")


def _commit(snapshot: Snapshot, *, ckpt_dir: CkptPath, group: tdist.ProcessGroup | None, kind: str,
            write: Callable[[CkptPath], tuple[list[dict[str, Any]], dict[str, Any]]],
            io: IOSettings) -> dict[str, Any]:
    """Checksum the tensors, `write(dir)` the files ((files by rank, extra manifest fields)), then
    commit on rank 0 and tell every rank the outcome: all ranks succeed or all raise."""
    ckpt_dir = open_storage(ckpt_dir)
    rank = group_rank(group)
    step = snapshot.step
    t0 = time.perf_counter()
    try:
        prepared: tuple[str, bool] | str = ""
        if rank == 0:
            try:
                prepared = ("ok", _prepare(ckpt_dir) != ckpt_dir)
            except OSError as e:
                prepared = f"could not prepare {ckpt_dir}: {e}"
        prepared = _agree(prepared, group)
        if isinstance(prepared, str):
            raise CheckpointSaveError(f"saving {ckpt_dir} failed on rank 0 ({prepared}); the previous checkpoint "
                                      "stays latest")
        # derived from ckpt_dir, not reopened from a string: a RemotePath keeps its filesystem and
        # with it the storage options of the Checkpointer that saves
        into = _incoming(ckpt_dir) if prepared[1] else ckpt_dir
        t_prepared = time.perf_counter()
        (files_by_rank, extra), algorithm, tensors, timings = _write_and_hash(snapshot.state, lambda: write(into),
                                                                              group=group, io=io,
                                                                              shares=snapshot.shares)
        shared = snapshot.shared
        if shared is not None:
            if shared.algorithm != algorithm:
                raise RuntimeError(f"fsdpkit: the frozen tensors were hashed with {shared.algorithm}, the rest with "
                                   f"{algorithm} (a bug: please report it)")
            tensors = {**tensors, **shared.tensors}
            extra = {**extra, SHARED: [shared.reference()]}
            timings["frozen_s"] = snapshot.frozen_s  # checked (and written, the first time) before the rest
        timings["prepare_s"] = t_prepared - t0  # rank 0 readies the directory; every rank learns the outcome
        bytes_per_rank = [sum(i["size"] for n, i in f.items() if n != ".metadata") for f in files_by_rank]
        manifest, failure = None, None
        if rank == 0:
            files = {name: info for rank_files in files_by_rank for name, info in rank_files.items()}
            manifest = {
                "format": FORMAT,
                "format_version": FORMAT_VERSION if shared is not None else FORMAT_VERSION_UNSHARED,
                "step": step,
                "committed_at": datetime.now(UTC).isoformat(),
                "world_size": group_size(group),
                "state_dict_type": kind,
                "versions": versions(),
                **snapshot.meta,
                "trainer": snapshot.trainer,
                "tensor_hash": algorithm,
                "tensors": tensors,
                "files": dict(sorted(files.items())),
                "bytes_per_rank": bytes_per_rank,
                "timings": timings,
                **extra,
            }
            manifest["timings"]["total_s"] = time.perf_counter() - t0
            failure = _publish(manifest, into=into, final=ckpt_dir)
        failure = _agree(failure, group)
        if failure is not None:
            raise CheckpointSaveError(failure)
        return manifest if manifest is not None else {"step": step, "bytes_per_rank": bytes_per_rank}
    except (CheckpointException, RuntimeError) as e:  # an OSError here is rank 0's own, raised as it is
        raise save_error(e, doing=f"saving {ckpt_dir}", unfinished=f" and {ckpt_dir.name} has no {MANIFEST}") from e


def _publish(manifest: dict[str, Any], *, into: CkptPath, final: CkptPath) -> str | None:
    """Rank 0: write the manifest (the commit), swap a replacement in, move `latest`. Returns None,
    or why the checkpoint was not committed."""
    try:
        write_manifest(into, manifest)
    except OSError as e:
        into.remove_tree()  # this save's own uncommitted files: give the space back
        return (f"saving {final} failed: rank 0 could not write {into / MANIFEST} ({e}); nothing was committed and "
                "the previous checkpoint stays latest. Free space or fix permissions, then resume")
    try:
        if into != final:
            swap_in(into, final)
        publish_latest(final)
    except OSError as e:  # committed (the manifest exists) but not in place: resolution still finds it
        log.warning("checkpoint %s is committed, but moving it into place or updating %s failed: %s",
                    into, final.parent / LATEST, e)
    return None
