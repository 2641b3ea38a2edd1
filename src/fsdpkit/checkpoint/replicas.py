"""Replicas read once: under HYBRID_SHARD and NO_SHARD one replica group reads, the others receive.

Under a (replicate, shard) mesh the ranks that share a shard coordinate hold identical local
shards, so a load in which every rank reads its own shards reads the checkpoint once per replica
group. Here the ranks at replicate coordinate 0 (the readers) load through DCP as any load does
(the safe reader and SafeLoadPlanner, on a gloo group of the readers alone), and each reader
broadcasts what it loaded to its replica peers along the mesh's replicate dimension (the mesh's own
group: gloo on CPU, NCCL on GPU). What the readers load, every peer ends up holding bitwise; the
restore (set_state_dict, Stateful pieces, RNG) and the post-load verification then run on every rank
as after any load.

What is read where, and sent:
- DTensors (model and optimizer shards): each reader reads its local shards and sends them to its
  peers, which hold the same shards;
- what every rank holds alike (plain tensors: AdamW's `step`, buffers, the Stateful pieces'
  `state.*` tensors; values: optimizer `param_groups`): read by the first reader alone, which hands
  them to the other readers over the readers' group; then sent on to the peers with the rest (values
  pickled: DCP's, already read with `weights_only=True`);
- each rank's RNG state (`rng.rank<r>.*`, per rank): the reader reads its peers' keys as well as its
  own (each stored once, in its saver's file) and sends them with the rest; every peer keeps its own.
Tensors go whole when large and on the broadcast's device, the rest as the bytes of consecutive
buckets (at most `BUCKET_BYTES` of extra memory).

Failures: the readers agree before DCP's load (a refused `.metadata`: none enters it), and DCP's load
raises on every reader when one of them fails (it gathers its ranks' errors); then every rank of the
load's group agrees on the outcome (one all-reduce) before any broadcast, so a reader that failed
fails every rank with the same error (the first failing reader's), naming the files it was reading
and those of them that fail their size or checksum, and no peer waits on a broadcast that never
comes. A second all-reduce after the broadcasts stops every rank alike should a peer's shards not
match its reader's (an internal error; replicas hold identical shards).

Replication is found from the state's DTensors (their mesh and placements), never from a config
name: one mesh for all of them, one replicated dimension of size > 1 shared by all, covering every
rank (the load's group too). Anything else (a 1-D FULL_SHARD mesh, no DTensors) returns None from
`find_replication` and the load reads as before, every rank its own.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DeviceMesh, DTensor

from fsdpkit.checkpoint.errors import CheckpointCorruptError, CheckpointError, CheckpointMismatchError
from fsdpkit.checkpoint.hashing import HASH_NAME, file_checksum
from fsdpkit.checkpoint.safe_io import SafeLoadPlanner
from fsdpkit.checkpoint.settings import IOSettings
from fsdpkit.checkpoint.staging import tensors as tensors_in
from fsdpkit.dist import group_rank

log = logging.getLogger("fsdpkit.checkpoint")

BUCKET_BYTES = 32 * 2**20
"""Tensors smaller than this, or not on the broadcast's device, travel packed as bytes in buckets of
this size (the extra memory a receive takes); larger ones are broadcast in place."""


@dataclass(frozen=True)
class Replication:
    """Where this rank stands among the replicas (global ranks)."""

    mesh: DeviceMesh
    dim: int  # the replicated mesh dimension
    peers: tuple[int, ...]  # this rank's replica group, along `dim`; peers[0] reads for them all
    readers: tuple[int, ...]  # every rank at coordinate 0 of `dim` (one per shard coordinate)
    group: tdist.ProcessGroup | None = None  # the readers' gloo group (a reader's, when there are several)

    @property
    def reads(self) -> bool:
        return tdist.get_rank() == self.peers[0]


def find_replication(state: dict[str, Any], *, group: tdist.ProcessGroup | None) -> Replication | None:
    """This rank's replica group, from the DTensors of the DCP state `state`; None when nothing is
    replicated (or the layout is one this module does not handle: the load then reads as before)."""
    if not tdist.is_initialized() or tdist.get_world_size(group) == 1:
        return None
    mesh, replicated = None, None
    for value in _flat(state).values():
        if isinstance(value, DTensor):
            dims = {i for i, p in enumerate(value.placements) if p.is_replicate() and value.device_mesh.size(i) > 1}
            if mesh is None:
                mesh, replicated = value.device_mesh, dims
            elif value.device_mesh != mesh:
                return None
            else:
                replicated &= dims
        elif isinstance(value, list | tuple) and next(tensors_in(value), None) is not None:
            return None  # tensors inside a list: leaves this module does not send
    if mesh is None or len(replicated) != 1:
        return None
    if tdist.get_world_size(group) != tdist.get_world_size():
        return None  # the readers' group is made over every rank, all of which must be loading
    if sorted(mesh.mesh.flatten().tolist()) != list(range(tdist.get_world_size())):
        return None
    (dim,) = replicated
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return None
    along = tuple(slice(None) if i == dim else c for i, c in enumerate(coordinate))
    return Replication(mesh=mesh, dim=dim, peers=tuple(mesh.mesh[along].tolist()),
                       readers=tuple(mesh.mesh.select(dim, 0).flatten().tolist()))


def load_replicated(state: dict[str, Any], reader: Any, *, read: Callable[..., None], replication: Replication,
                    group: tdist.ProcessGroup | None, ckpt_dir: Path, manifest: dict[str, Any],
                    io: IOSettings) -> dict[str, torch.Tensor] | None:
    """Collective over `group`: fill `state` (target.tensor_state's dict, this rank's `rng` entry
    included) in place, the readers through `read(state, group=..., no_dist=...)` (DCP's load of
    the checkpoint, through `reader`, and of the shared directories it references), their peers by
    broadcast. Returns this rank's RNG state, or None when the checkpoint holds none for it
    (`state["rng"]` is then removed).

    Raises (on every rank alike): CheckpointCorruptError (a file missing, truncated or garbled),
    UnsafeCheckpointError (a refused `.metadata` or item), CheckpointError for anything else that
    failed a reader's load.
    """
    rank = group_rank(group)
    own_rng = state.get("rng", {}).get(f"rank{rank}")
    if len(replication.readers) > 1:
        replication = dataclasses.replace(replication, group=readers_group(replication.readers))
    failure = _read(state, reader, read=read, replication=replication, group=group, ckpt_dir=ckpt_dir,
                    manifest=manifest, io=io) if replication.reads else None
    _agree(failure, group=group)
    rng, problem = _broadcast(state, replication=replication, rank=rank, own_rng=own_rng)
    _agree(problem, group=group)
    if rng is None:
        state.pop("rng", None)
    else:
        state["rng"] = {f"rank{rank}": rng}
    return rng


# A failure as the ranks agree on it: (error type, message, whether this rank's own load failed
# rather than hearing of another reader's failure from DCP).
Failure = tuple[type[BaseException], str, bool]


# --- the readers ---------------------------------------------------------------------------------------------------

_READER_GROUPS: dict[tuple[int, ...], tuple[Any, tdist.ProcessGroup | None]] = {}


def readers_group(readers: tuple[int, ...]) -> tdist.ProcessGroup | None:
    """Collective over the default group (every rank calls it at the same point): a gloo group of
    `readers` (global ranks; None on the others), made once per process group, then reused. Made
    by every rank, so its name is new (a group made by its members alone is named after its ranks,
    and a second one, or one the run made itself, would take the same name and store keys)."""
    world = tdist.group.WORLD
    made = _READER_GROUPS.get(readers)
    if made is None or made[0] is not world:
        pg = tdist.new_group(list(readers), backend="gloo")
        _READER_GROUPS[readers] = made = (world, pg if tdist.get_rank() in readers else None)
    return made[1]


def _read(state: dict[str, Any], reader: Any, *, read: Callable[..., None], replication: Replication,
          group: tdist.ProcessGroup | None, ckpt_dir: Path, manifest: dict[str, Any], io: IOSettings) -> Failure | None:
    """A reader: DCP load of its shards and of its peers' RNG state; the first reader alone reads the
    leaves that every rank holds alike (plain tensors, optimizer `param_groups`) and hands them to
    the other readers. Returns the failure, if any (every reader then has one, or hears of one)."""
    pg = replication.group
    first = tdist.get_rank() == replication.readers[0]
    failure = None
    try:  # the metadata first, so that a refused one surfaces as UnsafeCheckpointError (DCP keeps its text only)
        reader.read_metadata()
        _select_rng(state, reader, replication=replication, group=group)
    except Exception as e:  # noqa: BLE001 - reported to every rank by _agree
        failure = _describe(e, reader, state=state, ckpt_dir=ckpt_dir, manifest=manifest, own=True, io=io)
    if pg is not None:  # the readers enter dcp.load together, or none does
        flag = torch.tensor([failure is not None], dtype=torch.int64)
        tdist.all_reduce(flag, group=pg)
        if int(flag) and failure is None:
            return None  # another reader failed: its message is the one every rank raises
    if failure is not None:
        return failure
    # The other readers load a copy of the tree without those leaves. A copy: get_state_dict's dicts
    # may be the optimizer's own (optimizer.state[param]), which must keep its `step` whatever happens.
    alike = {} if first or pg is None else {p: v for p, v in _flat(state).items() if _alike(p, v)}
    into = _without(state, alike) if alike else state
    try:
        read(into, group=pg, no_dist=pg is None)
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        own = not isinstance(e, CheckpointException) or (group_rank(pg) if pg else 0) in e.failures
        return _describe(e, reader, state=into, ckpt_dir=ckpt_dir, manifest=manifest, own=own, io=io)
    if pg is not None:
        leaves = {p: v for p, v in _flat(state).items() if _alike(p, v)} if first else alike
        _, problems = _share(state, leaves, src=replication.readers[0], pg=pg, device=torch.device("cpu"))
        if problems:
            return _internal(problems)
    return None


def _alike(path: Path_, value: Any) -> bool:
    """A leaf that every rank holds alike: anything but a DTensor (a shard) or a rank's RNG state."""
    return path[0] != "rng" and not isinstance(value, DTensor)


def _without(tree: dict[Any, Any], leaves: dict[Path_, Any], path: Path_ = ()) -> dict[Any, Any]:
    """A copy of the nested dicts of `tree` without the leaves at `leaves`' paths (the other
    leaves are the same objects: a load into the copy is a load into `tree`'s tensors)."""
    return {k: _without(v, leaves, (*path, k)) if isinstance(v, dict) else v for k, v in tree.items()
            if (*path, k) not in leaves}


def _select_rng(state: dict[str, Any], reader: Any, *, replication: Replication,
                group: tdist.ProcessGroup | None) -> None:
    """`state["rng"]`: this reader's and each peer's generators that the checkpoint holds (a rank the
    saving run did not have, or without `torch_cpu`, keeps its fresh seed), in buffers shaped as
    this rank's own."""
    if "rng" not in state:
        return
    saved = reader.read_metadata().state_dict_metadata
    me = group_rank(group)
    own = state["rng"][f"rank{me}"]
    rng = {}
    for peer in (group_rank(group, of=p) for p in replication.peers):
        keys = [k for k in own if f"rng.rank{peer}.{k}" in saved]
        if "torch_cpu" in keys:
            rng[f"rank{peer}"] = {k: own[k] if peer == me else own[k].clone() for k in keys}
    if rng:
        state["rng"] = rng
    else:
        del state["rng"]


def _describe(error: BaseException, reader: Any, *, state: dict[str, Any], ckpt_dir: Path, manifest: dict[str, Any],
              own: bool, io: IOSettings) -> Failure:
    """A reader's failed load as every rank will raise it, naming the files it was reading."""
    causes = [e for e, _ in error.failures.values()] if isinstance(error, CheckpointException) else [error]
    ours = [type(c) for c in causes if isinstance(c, CheckpointError)]
    kind = ours[0] if ours else CheckpointCorruptError
    reasons = "; ".join(dict.fromkeys(f"{type(c).__name__}: {c}" for c in causes))
    where = ""
    if own:
        files = _files_read(reader, state)
        damaged = _check(files, ckpt_dir=ckpt_dir, manifest=manifest, io=io)
        where = (f" Damaged: {'; '.join(damaged)}." if damaged
                 else f" It was reading {', '.join(str(ckpt_dir / f) for f in files)}." if files else "")
    message = (f"{ckpt_dir} could not be loaded: rank {tdist.get_rank()}, which reads for its replicas, failed "
               f"({reasons}).{where} The load stopped on every rank, before the restore; check the checkpoint with "
               f"`fsdpkit ckpt verify {ckpt_dir}`, or resume from an earlier one")
    return kind, message, own


def _files_read(reader: Any, state: dict[str, Any]) -> list[str]:
    """The data files this rank's part of the load reads (none if planning never got that far)."""
    try:
        planner = SafeLoadPlanner()
        planner.set_up_planner(state, reader.read_metadata(), False)
        items = planner.create_local_plan().items
        return sorted({reader.storage_data[item.storage_index].relative_path for item in items})
    except Exception:  # noqa: BLE001 - naming files is a courtesy: the error itself is reported anyway
        return []


def _check(files: list[str], *, ckpt_dir: Path, manifest: dict[str, Any], io: IOSettings) -> list[str]:
    """The problems of `files` against the manifest's sizes and checksums."""
    problems = []
    for name in files:
        info, path = manifest.get("files", {}).get(name), ckpt_dir / name
        if info is None:
            continue
        try:
            size, digest = file_checksum(path, io=io)
        except FileNotFoundError:
            problems.append(f"{path} is missing")
            continue
        except OSError as e:
            problems.append(f"{path} cannot be read ({e})")
            continue
        if size != info["size"]:
            problems.append(f"{path} has {size} bytes, expected {info['size']} (truncated or overwritten)")
        elif digest != info[HASH_NAME]:
            problems.append(f"{path} fails its checksum ({HASH_NAME} {digest}, expected {info[HASH_NAME]})")
    return problems


def _agree(failure: Failure | None, *, group: tdist.ProcessGroup | None) -> None:
    """Collective over `group`: if any rank failed, raise on every rank the error of the first
    rank whose own load failed (else the first that heard of a failure). One all-reduce when none did."""
    ws, me = tdist.get_world_size(group), group_rank(group)
    score = 2 * ws if failure is None else me if failure[2] else ws + me
    first = torch.tensor([score], dtype=torch.int64)
    tdist.all_reduce(first, op=tdist.ReduceOp.MIN, group=group)
    if int(first) == 2 * ws:
        return
    box = [failure]
    tdist.broadcast_object_list(box, group_src=int(first) % ws, group=group)
    kind, message, _ = box[0]
    error = kind(message) if issubclass(kind, Exception) else CheckpointError(message)
    error.echoed = int(first) % ws != me  # the failing rank reports it; the others raise it quietly
    raise error


# --- the broadcast -------------------------------------------------------------------------------------------------

Path_ = tuple[Any, ...]  # a leaf's keys from the root of the state dict


def _flat(tree: dict[Any, Any], path: Path_ = ()) -> dict[Path_, Any]:
    """Leaves of nested dicts by key path (lists and tuples are leaves, as DCP keeps optimizer
    `param_groups`)."""
    out: dict[Path_, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flat(v, (*path, k)))
        else:
            out[(*path, k)] = v
    return out


def _set(tree: dict[Any, Any], path: Path_, value: Any) -> None:
    for k in path[:-1]:
        tree = tree[k]
    tree[path[-1]] = value


def _local(value: Any) -> Any:
    return value.to_local() if isinstance(value, DTensor) else value


def _share(state: dict[str, Any], leaves: dict[Path_, Any], *, src: int, pg: tdist.ProcessGroup,
           device: torch.device) -> tuple[dict[Path_, torch.Tensor], list[str]]:
    """Collective over `pg`: `src`'s `leaves` (key path -> tensor or value) to the other ranks.
    A receiver's `leaves` are its own leaves at those paths: each tensor is received into its own
    (a DTensor: into its local tensor) and put in `state` at its path if it is a plain tensor; each
    value is set in `state`. Returns (the tensors received, by path; what did not fit)."""
    box: list[Any] = [None]
    if tdist.get_rank() == src:
        tensors = {p: _local(v) for p, v in leaves.items() if isinstance(v, torch.Tensor)}
        objects = {p: v for p, v in leaves.items() if not isinstance(v, torch.Tensor)}
        box = [(objects, [(p, tuple(t.shape), t.dtype) for p, t in sorted(tensors.items(), key=_order)])]
    tdist.broadcast_object_list(box, src=src, group=pg, device=device)
    objects, layout = box[0]
    if tdist.get_rank() == src:
        _send([tensors[p] for p, _, _ in layout], src=src, pg=pg, device=device)
        return tensors, []
    problems, received = [], {}
    for path, shape, dtype in layout:
        own = leaves.get(path)
        t = _local(own) if isinstance(own, torch.Tensor) else None
        if t is not None and (tuple(t.shape) != shape or t.dtype != dtype):
            problems.append(f"{_name(path)}: sent as {list(shape)} {dtype}, this rank's is {list(t.shape)} {t.dtype}")
            t = None
        elif t is None and path[0] != "rng":  # another rank's RNG state is not this rank's to hold
            problems.append(f"{_name(path)}: sent, and this rank holds no such tensor")
        received[path] = t if t is not None else torch.empty(shape, dtype=dtype, device=device)
    _send(list(received.values()), src=src, pg=pg, device=device)
    for path, t in received.items():
        if path in leaves and path[0] != "rng" and not isinstance(leaves[path], DTensor):
            _set(state, path, t)  # (the same tensor, received in place, unless it did not fit)
    for path, value in objects.items():
        _set(state, path, value)
    problems += [f"{_name(p)}: not sent" for p, v in leaves.items()
                 if isinstance(v, torch.Tensor) and p not in received and p[0] != "rng"]
    return received, problems


def _broadcast(state: dict[str, Any], *, replication: Replication, rank: int,
               own_rng: dict[str, torch.Tensor] | None) -> tuple[dict[str, torch.Tensor] | None, Failure | None]:
    """The reader's loaded state to its peers along the replicate dimension: (this rank's RNG
    state or None, a failure or None)."""
    pg, src = replication.mesh.get_group(replication.dim), replication.peers[0]
    leaves = _flat(state)
    if not replication.reads:
        leaves = {p: v for p, v in leaves.items() if p[0] != "rng"}
        leaves.update({("rng", f"rank{rank}", k): t for k, t in (own_rng or {}).items()})
    received, problems = _share(state, leaves, src=src, pg=pg, device=_device(replication.mesh))
    prefix = ("rng", f"rank{rank}")
    rng = {p[2]: t for p, t in received.items() if p[:2] == prefix}
    return (rng if "torch_cpu" in rng else None), (_internal(problems) if problems else None)


def _internal(problems: list[str]) -> Failure:
    return (CheckpointMismatchError, f"rank {tdist.get_rank()} cannot take its replica's state (an internal error: "
            "replicas hold identical shards and alike values): " + "; ".join(problems[:10]), True)


def _name(path: Path_) -> str:
    return ".".join(map(str, path))


def _order(item: tuple[Path_, Any]) -> tuple[str, ...]:
    return tuple(map(str, item[0]))


def _device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def _send(tensors: list[torch.Tensor], *, src: int, pg: tdist.ProcessGroup, device: torch.device) -> None:
    """Broadcast `tensors` from `src` over `pg`: each one of BUCKET_BYTES or more that is on
    `device` and contiguous in place, the rest as the bytes of buckets of BUCKET_BYTES."""
    sending = tdist.get_rank() == src
    packed: list[tuple[torch.Tensor, torch.Tensor]] = []  # (tensor, a contiguous tensor with its values)
    for t in tensors:
        if t.device == device and t.is_contiguous() and t.numel() * t.element_size() >= BUCKET_BYTES:
            tdist.broadcast(t, src=src, group=pg)
        elif t.numel():
            packed.append((t, t if t.is_contiguous() else t.contiguous()))
    pieces: list[tuple[torch.Tensor, int, int]] = []  # (a tensor's bytes, start, end) in the bucket
    filled = 0
    for _, c in packed:
        raw = c.reshape(-1).view(torch.uint8)
        start = 0
        while start < raw.numel():
            n = min(raw.numel() - start, BUCKET_BYTES - filled)
            pieces.append((raw, start, start + n))
            filled, start = filled + n, start + n
            if filled == BUCKET_BYTES:
                _bucket(pieces, filled, src=src, pg=pg, device=device, sending=sending)
                pieces, filled = [], 0
    if pieces:
        _bucket(pieces, filled, src=src, pg=pg, device=device, sending=sending)
    if not sending:
        for t, c in packed:
            if c is not t:
                t.copy_(c)


def _bucket(pieces: list[tuple[torch.Tensor, int, int]], size: int, *, src: int, pg: tdist.ProcessGroup,
            device: torch.device, sending: bool) -> None:
    buffer = torch.empty(size, dtype=torch.uint8, device=device)
    views, offset = [], 0
    for raw, start, end in pieces:
        views.append((raw[start:end], buffer[offset:offset + end - start]))
        offset += end - start
    if sending:
        for piece, slot in views:
            slot.copy_(piece)
    tdist.broadcast(buffer, src=src, group=pg)
    if not sending:
        for piece, slot in views:
            piece.copy_(slot)
