"""The staging buffer of an async save: host tensors shaped like the state dict, and the copies into it.

The buffer mirrors the state dict: DTensors keep their spec (mesh, placements, global shape)
around a host local tensor, as DCP's own staging does. torch's helpers for this
(_create_cpu_state_dict, _check_state_dict_similarity) copy every tensor while allocating or
comparing, which doubled the stall; these allocate empty buffers and compare shapes only.

A blocking host-to-host copy (the training loop waits for it) runs on several threads over
disjoint pieces of the state: one thread copies at well under the machine's memory bandwidth
(bench/checkpoint.py measures one and two copies at once). The threads are the cores this
process may use, divided among the ranks on this host (fsdpkit.dist.local_world_size), at
most MAX_COPY_THREADS; IOSettings.staging_threads (FSDPKIT_STAGING_THREADS) overrides that.

Where the C extension is built, host copies use non-temporal stores (`_rowhash.stream_copy`):
the buffer's lines are neither read into the cache before being overwritten nor kept there
afterwards, so the copy moves two bytes of memory traffic per byte instead of three and leaves the
cache to the training that resumes after it (1 GiB over 2 ranks on the 2-core bench VM: a 67 ms
stall instead of 87 ms with `copy_`).
"""

from __future__ import annotations

import copy
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from fsdpkit.checkpoint.settings import IOSettings
from fsdpkit.dist import local_world_size

MAX_COPY_THREADS = 4
COPY_PIECE_BYTES = 16 << 20  # the unit a parallel copy hands to a thread
STREAM_MIN_BYTES = 1 << 16  # below this, copy_ (a small tensor fits in the cache; the call costs more)

try:
    from fsdpkit.checkpoint._rowhash import stream_copy as _stream_copy
except ImportError:  # built without a C compiler, or a build older than stream_copy
    _stream_copy = None
HAS_STREAM_COPY = _stream_copy is not None


def local_part(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def tensors(state: Any):
    """Every tensor in `state` (nested dicts, lists, tuples), in a fixed order."""
    if isinstance(state, dict):
        for v in state.values():
            yield from tensors(v)
    elif isinstance(state, list | tuple):
        for v in state:
            yield from tensors(v)
    elif isinstance(state, torch.Tensor):
        yield state


def signature(state: Any) -> Any:
    """Keys, tensor kinds, shapes and dtypes: a buffer is reused only for the same signature."""
    if isinstance(state, dict):
        return tuple((k, signature(v)) for k, v in state.items())
    if isinstance(state, list | tuple):
        return tuple(signature(v) for v in state)
    if isinstance(state, torch.Tensor):
        local = local_part(state)
        return (type(state).__name__, tuple(state.shape), tuple(local.shape), local.dtype)
    return None


def allocate(state: Any, *, pin: bool) -> Any:
    """An empty host buffer shaped like `state` (pinned with `pin`)."""
    if isinstance(state, dict):
        return {k: allocate(v, pin=pin) for k, v in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(allocate(v, pin=pin) for v in state)
    if isinstance(state, torch.Tensor):
        local = local_part(state)
        buf = torch.empty(local.shape, dtype=local.dtype, device="cpu", pin_memory=pin)
        return DTensor(buf, state._spec, requires_grad=False) if isinstance(state, DTensor) else buf
    return None  # not a tensor: taken from the live state at every save


def copy_into(state: Any, buffer: Any, *, non_blocking: bool = False, copy_tensors: bool = True) -> Any:
    """The state with its tensors replaced by `buffer`'s (copied into it unless not `copy_tensors`);
    other values deep-copied (they are small)."""
    if isinstance(state, dict):
        return {k: copy_into(v, buffer[k], non_blocking=non_blocking, copy_tensors=copy_tensors)
                for k, v in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(copy_into(v, b, non_blocking=non_blocking, copy_tensors=copy_tensors)
                           for v, b in zip(state, buffer, strict=True))
    if isinstance(state, torch.Tensor):
        if copy_tensors:
            copy_host(local_part(buffer), local_part(state), non_blocking=non_blocking)
        return buffer
    return copy.deepcopy(state)


def _plain_host(t: torch.Tensor) -> bool:
    """A plain tensor (not a subclass, e.g. an NF4 or float8 wrapper) of dense, contiguous host
    memory whose bytes are its values (not quantized, no lazy conjugate or negation)."""
    return (type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type == "cpu" and t.layout == torch.strided
            and not t.is_quantized and t.is_contiguous() and not t.is_conj() and not t.is_neg())


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy())


def copy_host(dst: torch.Tensor, src: torch.Tensor, *, non_blocking: bool = False) -> None:
    """dst.copy_(src, non_blocking=...); with non-temporal stores (see the module's docstring)
    where both are contiguous host tensors of one shape and dtype, at least STREAM_MIN_BYTES."""
    if (_stream_copy is not None and _plain_host(dst) and _plain_host(src) and dst.dtype == src.dtype
            and dst.shape == src.shape and dst.nbytes >= STREAM_MIN_BYTES):
        _stream_copy(_bytes(dst), _bytes(src))
    else:
        dst.copy_(src, non_blocking=non_blocking)


def copy_tensors(state: Any, buffer: Any, *, pool: ThreadPoolExecutor | None = None) -> None:
    """Copy every tensor of `state` (host memory) into its place in `buffer` (copy_host); with
    `pool`, in pieces of about COPY_PIECE_BYTES spread over its threads (both copies release the GIL)."""
    pairs = [(local_part(dst), local_part(src)) for src, dst in zip(tensors(state), tensors(buffer), strict=True)]
    if pool is None:
        for dst, src in pairs:
            copy_host(dst, src)
        return
    pieces = []
    for dst, src in pairs:
        if not (dst.is_contiguous() and src.is_contiguous()) or dst.nbytes <= COPY_PIECE_BYTES:
            pieces.append((dst, src))
            continue
        d, s = dst.view(-1), src.view(-1)
        step = max(1, COPY_PIECE_BYTES // dst.element_size())
        pieces += [(d[i : i + step], s[i : i + step]) for i in range(0, d.numel(), step)]
    for _ in pool.map(lambda piece: copy_host(*piece), pieces):
        pass  # map re-raises a copy's error here


def copy_threads(io: IOSettings | None = None) -> int:
    """Threads for a blocking host-to-host staging copy (see the module's docstring); `io`: default,
    the environment's."""
    threads = (IOSettings.from_environment() if io is None else io).staging_threads
    if threads is not None:
        return threads
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(MAX_COPY_THREADS, cores // local_world_size()))
