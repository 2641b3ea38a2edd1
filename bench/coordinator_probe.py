"""B9's instruments, installed in a rank's process: time inside the storage writer's write_data, the
reader's read_data and fsdpkit's checksum pass before a load (resume.verify_files) (so the rest of a
save or a resume is the coordination around the data),
bytes moved by the object collectives (what DCP and fsdpkit gather at rank 0), and peak RSS per
phase (Linux: VmHWM, reset through /proc/self/clear_refs).
"""

from __future__ import annotations

import pickle
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch.distributed as tdist


class IoClock:
    """Wall and process CPU time spent in the data I/O calls wrapped (nested calls counted once)."""

    def __init__(self) -> None:
        self.wall = self.cpu = 0.0
        self._depth = 0

    def wrap(self, owner: Any, name: str) -> None:
        """Time `owner.name` (a method of a class, or a function of a module) from now on."""
        if name not in vars(owner):
            return
        original = vars(owner)[name]
        clock = self

        def timed(*args: Any, **kwargs: Any) -> Any:
            clock._depth += 1
            t0, c0 = time.perf_counter(), time.process_time()
            try:
                return original(*args, **kwargs)
            finally:
                clock._depth -= 1
                if clock._depth == 0:
                    clock.wall += time.perf_counter() - t0
                    clock.cpu += time.process_time() - c0

        setattr(owner, name, timed)

    def reset(self) -> None:
        self.wall = self.cpu = 0.0


def install_io_clock() -> IoClock:
    from torch.distributed.checkpoint.filesystem import FileSystemReader, _FileSystemWriter

    from fsdpkit.checkpoint import resume

    clock = IoClock()
    clock.wrap(_FileSystemWriter, "write_data")
    clock.wrap(FileSystemReader, "read_data")
    # the checksum pass reads every file before the load (its one gather of what it found counts here too)
    clock.wrap(resume, "verify_files")
    return clock


class CollectiveBytes:
    """Pickled bytes of the object collectives, as seen by rank 0: `gathered` (gather_object and
    all_gather_object: every rank's payload, rank 0's own included), `sent` (scatter and broadcast
    from rank 0), and the tensor bytes of all_reduce. Counting pickles again: off while timing."""

    def __init__(self) -> None:
        self.on = False
        self.bytes: dict[str, int] = defaultdict(int)

    def install(self) -> None:
        probe = self

        def counted(name: str, original: Any, measure: Any) -> Any:
            def call(*args: Any, **kwargs: Any) -> Any:
                out = original(*args, **kwargs)
                if probe.on and tdist.get_rank() == 0:
                    probe.bytes[name] += measure(*args, **kwargs)
                return out
            return call

        def size(objs: Any) -> int:
            return sum(len(pickle.dumps(o)) for o in objs or [])

        tdist.gather_object = counted("gather_object", tdist.gather_object,
                                      lambda obj, object_gather_list=None, **_: size(object_gather_list))
        tdist.all_gather_object = counted("all_gather_object", tdist.all_gather_object,
                                          lambda object_list, obj, **_: size(object_list))
        tdist.scatter_object_list = counted("scatter_object_list", tdist.scatter_object_list,
                                            lambda scatter_object_output_list, scatter_object_input_list=None, **_:
                                            size(scatter_object_input_list))
        tdist.broadcast_object_list = counted("broadcast_object_list", tdist.broadcast_object_list,
                                              lambda object_list, *a, **_: size(object_list))
        tdist.all_reduce = counted("all_reduce", tdist.all_reduce, lambda tensor, *a, **_: tensor.nbytes)

    def take(self) -> dict[str, int]:
        out = dict(self.bytes)
        self.bytes.clear()
        out["gathered_total"] = out.get("gather_object", 0) + out.get("all_gather_object", 0)
        return out


def reset_peak_rss() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def peak_rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


@contextmanager
def measured(out: dict[str, float], clock: IoClock | None = None):
    """Fill `out` with wall_s, cpu_s (process), io_s, io_cpu_s, coord_s, coord_cpu_s (the rest)
    and peak_rss_mb of the block."""
    if clock is not None:
        clock.reset()
    reset_peak_rss()
    t0, c0 = time.perf_counter(), time.process_time()
    yield out
    out["wall_s"], out["cpu_s"] = time.perf_counter() - t0, time.process_time() - c0
    io_s, io_cpu = (clock.wall, clock.cpu) if clock is not None else (0.0, 0.0)
    out.update(io_s=io_s, io_cpu_s=io_cpu, coord_s=out["wall_s"] - io_s, coord_cpu_s=out["cpu_s"] - io_cpu,
               peak_rss_mb=peak_rss_mb())
