"""Every piece of rank logic goes through here.

The process group is created from the environment torchrun (or `fsdpkit train --nproc`)
sets. Without that environment the process is a world of one: a single-rank gloo group is
still created so that the same FSDP2 code path runs everywhere.
"""

from __future__ import annotations

import ctypes
import datetime
import gc
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from fsdpkit import watchdog

DEFAULT_TIMEOUT_S = 600.0  # dist.timeout_s in the config
PR_SET_PDEATHSIG = 1  # linux/prctl.h
T = TypeVar("T")


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def local_world_size() -> int:
    """The ranks on this host: torchrun's LOCAL_WORLD_SIZE, else every rank of the world (one host).

    Raises:
        ValueError: LOCAL_WORLD_SIZE is set to something other than a positive whole number.
    """
    text = os.environ.get("LOCAL_WORLD_SIZE", "").strip()
    if not text:
        return world_size()
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"LOCAL_WORLD_SIZE={text!r} is not a number of ranks >= 1; torchrun sets it to the ranks on "
                         "each node: unset it, or set it to that number")
    return int(text)


def group_rank(group: dist.ProcessGroup | None = None, *, of: int | None = None) -> int:
    """This rank's rank within `group` (None: the default group), or that of the global rank `of`;
    0 without a process group (a world of one)."""
    if not dist.is_initialized():
        return 0
    if of is None:
        return dist.get_rank(group)
    return of if group is None else dist.get_group_rank(group, of)


def group_size(group: dist.ProcessGroup | None = None) -> int:
    """The ranks in `group` (None: the default group); 1 without a process group."""
    return dist.get_world_size(group) if dist.is_initialized() else 1


def is_main() -> bool:
    return rank() == 0


def pick_backend(requested: str, device_type: str) -> str:
    """`auto` means NCCL on CUDA and gloo on CPU."""
    if requested != "auto":
        return requested
    return "nccl" if device_type == "cuda" else "gloo"


def pick_device(requested: str) -> torch.device:
    """`auto` means this rank's CUDA device when CUDA is available, else the CPU."""
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device=cuda was requested but CUDA is not available; set device=cpu or device=auto")
        torch.cuda.set_device(local_rank())
        return torch.device("cuda", local_rank())
    return torch.device(requested)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def die_with_launcher() -> None:
    """Under torch's elastic launcher, have the kernel SIGKILL this rank when the launcher dies.

    The launcher starts every rank in a new session, so a launcher killed hard (SIGKILL, OOM
    killer) leaves its ranks training on, and writing checkpoints into a directory that a rerun
    then shares with them. Linux only; elsewhere a no-op.
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    launcher = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return  # not fatal: the rank just keeps torch's default behaviour
    if os.getppid() != launcher:  # the launcher died before the request took effect
        os.kill(os.getpid(), signal.SIGKILL)


def attempt_store(timeout: datetime.timedelta) -> dist.Store | None:
    """The store for this restart attempt's process group, when torch's launcher shares its own.

    Under `torchrun --max-restarts` (c10d rendezvous, the default since torch 2.4) every attempt's
    ranks connect to the SAME TCPStore, which the launcher hosts for its whole life, with no key
    prefix ("We create a new TCPStore for every retry" says torch/distributed/rendezvous.py; the
    rendezvous handler in fact caches one server, dynamic_rendezvous.py). The restarted ranks then
    find the previous attempt's keys: gloo read the dead rank's old address ("Connection refused"
    in connectFullMesh) or waited on a stale key (a hang in init). A prefix per attempt gives every
    attempt fresh keys. The restart count agrees across ranks on one node; across nodes a healthy
    node can restart without counting, so multi-node jobs set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    (a fresh store on a fresh port per rendezvous round: USE_AGENT_STORE is then False and this
    returns None). Returns None outside torch's launcher or without a shared store.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    return dist.PrefixStore(f"fsdpkit/attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def init_process_group(*, backend: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Create the default process group from torchrun's environment, or a world of one.

    `timeout_s` bounds the creation and every collective on the default group (dist.timeout_s).
    """
    if dist.is_initialized():
        return
    die_with_launcher()
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    timeout = datetime.timedelta(seconds=timeout_s)
    store = attempt_store(timeout)
    if store is None:
        dist.init_process_group(backend=backend, timeout=timeout)
    else:
        dist.init_process_group(backend=backend, timeout=timeout, store=store, rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]))


def start_watchdog(*, heartbeat_s: float, slow_step_factor: float) -> None:
    """Publish this rank's heartbeat in the process group's store (see fsdpkit.watchdog)."""
    if dist.is_initialized() and dist.get_world_size() > 1 and heartbeat_s > 0:
        # Its own connection: a blocking store wait on the main thread must not hold up a beat. A
        # short timeout: when rank 0 hosts the store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) and is
        # the stopped rank, the report gives up quickly instead of adding dist.timeout_s.
        store = dist.distributed_c10d._get_default_store().clone()
        store.set_timeout(datetime.timedelta(seconds=max(5.0, 5 * heartbeat_s)))
        watchdog.start(store=store, rank=dist.get_rank(), world_size=dist.get_world_size(),
                       interval_s=heartbeat_s, slow_step_factor=slow_step_factor)


def shutdown(*, barrier: bool = True) -> None:
    """Tear the process group down in the order that avoids gloo's abort at exit.

    Callers drop their model/optimizer references first; collecting, then barrier → destroy
    removed the `terminate called without an active exception` abort seen at teardown. After a
    failure pass barrier=False: a peer may be dead or blocked in another collective.
    """
    watchdog.stop()
    gc.collect()
    if dist.is_initialized():
        if barrier:
            dist.barrier()
        dist.destroy_process_group()


def barrier() -> None:
    """Wait for every rank; no-op in a world of one."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def all_reduce_sum(values: Sequence[float | torch.Tensor], *, device: torch.device,
                   fetch: Sequence[torch.Tensor] = ()) -> list[float]:
    """Sum a few scalars over all ranks in one collective (no-op in a world of one) and read them
    back as float64, followed by the `fetch` scalars (read, not summed).

    A value is a Python number or a one-element tensor on `device`; tensors are not read before
    the sum, and everything comes back in one device-to-host copy, so a training step that hands
    its loss and gradient norm here waits for the device once.
    """
    numbers = torch.tensor([float(v) for v in values if not isinstance(v, torch.Tensor)], dtype=torch.float64)
    numbers = numbers.to(device, non_blocking=True)  # no wait for the device's queue
    pieces, n = [], 0
    for v in values:
        if isinstance(v, torch.Tensor):
            pieces.append(v.detach().reshape(1).to(dtype=torch.float64))
        else:
            pieces.append(numbers[n:n + 1])
            n += 1
    t = torch.cat(pieces) if pieces else numbers
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    if fetch:
        t = torch.cat([t, *(f.detach().reshape(1).to(device=t.device, dtype=torch.float64) for f in fetch)])
    return t.tolist()


def on_main(fn: Callable[[], T], *, group: dist.ProcessGroup | None = None,
            errors: tuple[type[BaseException], ...] = (OSError, ValueError)) -> T:
    """Run `fn` on rank 0 only; every rank returns its result, or raises rank 0's error (same type
    and message) if it raised one of `errors`. Collective over `group`.

    For checks that one rank makes for all (the run directory, the checkpoint directory): every
    rank stops at the same point with the same message; only rank 0 prints it (the others' copy
    carries `echoed = True`, which `fsdpkit`'s main reads).
    """
    outcome: tuple[bool, Any] = (True, None)
    if rank() == 0:
        try:
            outcome = (True, fn())
        except errors as e:
            outcome = (False, (type(e), str(e)))
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        box = [outcome]
        dist.broadcast_object_list(box, src=0, group=group)
        outcome = box[0]
    ok, value = outcome
    if ok:
        return value
    kind, message = value
    error = kind(message) if issubclass(kind, Exception) else RuntimeError(message)
    error.echoed = rank() != 0  # the same error rank 0 reports: other ranks stay quiet about it
    raise error


def new_peer_group(*, timeout_s: float) -> dist.ProcessGroup | None:
    """A gloo group kept for `unresponsive_ranks` alone, so that it is idle (and intact) when a
    training or checkpoint collective fails. Collective: every rank creates it at the same point."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))


def lost_a_peer(error: BaseException | None) -> bool:
    """Whether `error`, or an error that caused it, is a failed collective (a peer that died or
    stalled) rather than a failure of this rank's own."""
    while error is not None:
        if isinstance(error, dist.DistError) or "gloo/transport" in str(error) or "Timed out waiting" in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


def unresponsive_ranks(group: dist.ProcessGroup | None, *, timeout_s: float) -> list[int]:
    """After a failed collective: the ranks that do not exchange a token with this rank within
    `timeout_s` (their process or node died, or they are stuck elsewhere). Point-to-point with every
    peer, so it needs no coordinating rank: a lost rank 0 is found like any other. Every surviving
    rank calls it; a peer that did not is reported too."""
    if group is None:
        return []
    me = dist.get_rank()
    token = torch.tensor([me], dtype=torch.int64)
    lost: set[int] = set()
    pending = []
    for peer in (r for r in range(dist.get_world_size()) if r != me):
        try:
            pending.append((peer, dist.isend(token, peer, group=group),
                            dist.irecv(torch.empty(1, dtype=torch.int64), peer, group=group)))
        except RuntimeError:  # the connection to that peer is already known to be broken
            lost.add(peer)
    deadline = time.monotonic() + timeout_s
    for peer, *works in pending:
        for work in works:
            try:
                work.wait(datetime.timedelta(seconds=max(0.01, deadline - time.monotonic())))
            except RuntimeError:
                lost.add(peer)
                break
    return sorted(lost)
