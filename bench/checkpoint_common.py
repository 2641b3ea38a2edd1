"""What both sides of bench/checkpoint.py agree on: the method names that the phases write into
their JSON and the report looks up, and the order of B7's in-process loads, which the report
rebuilds. No imports: the report needs neither torch nor fsdpkit, and every bench module may
import this one (it imports none of them).
"""

from __future__ import annotations

T0_ENV = "BENCH_T0"  # the orchestrator's wall clock when it launched torchrun (B7)

# B1 (and B3's sync saves)
OUR_SYNC = "fsdpkit save_checkpoint"
DCP_SYNC = "dcp.save"
TORCH_SYNC = "torch.save (rank 0, full)"
RAW_WRITE = "raw write + fsync of each rank's bytes (ceiling)"  # B1's in-run disk ceilings: this one,
RAW_WRITE_WB = "raw write + fsync, write-back started every"  # and (prefixes) this one and the O_DIRECT one;
RAW_WRITE_DIRECT = "raw write + fsync, O_DIRECT"  # the fastest counts

# B2, B3 and B6
OUR_ASYNC = "fsdpkit AsyncSaver"
OUR_ASYNC_BG = "fsdpkit AsyncSaver, background staging"
DCP_ASYNC = "dcp.async_save"
DCP_ASYNC_STAGER = "dcp.async_save + DefaultStager"
B6_MODES = ("no checkpoint", "fsdpkit sync", OUR_ASYNC, OUR_ASYNC_BG, DCP_ASYNC)

# B4 and B5
OUR_LOAD = "fsdpkit load_checkpoint"
OUR_LOAD_VERIFY = "fsdpkit load_checkpoint, verify=True"
DCP_LOAD = "dcp.load + set_state_dict"
RAW_READ = "raw read of each rank's share of the bytes (ceiling)"  # B4/B5's disk ceiling

# B7 and B8
FSDPKIT = "fsdpkit resume (each file read once)"
PASS_FIRST = "fsdpkit resume, a checksum pass first (before issue 56)"
PLAIN = DCP_LOAD
RESUME_METHODS = (FSDPKIT, PASS_FIRST, PLAIN)

DE_BRUIJN = {2: (0, 0, 1, 1), 3: (0, 0, 1, 0, 2, 1, 1, 2, 2)}
"""Per number of methods, a cycle in which each method comes as often as the others and follows
every method (itself too) once, but for the pair the cycle's wrap-around makes ((1, 0), (2, 0))."""


def balanced_order(methods: tuple[str, ...], runs: int, *, start: int) -> list[str]:
    """`runs` loads of each of 2 or 3 `methods` (rounded up to a whole number of DE_BRUIJN cycles:
    a multiple of 2 or 3), in an order where each follows each about equally often, the methods'
    roles rotated by `start`. Why: in one process, a load right after a `dcp.load` ran up to 2x
    slower than after a load of another kind (1 GiB, 2 ranks: fsdpkit's 1.34-1.68 s after a
    dcp.load, 0.56-0.92 s after its own; dcp.load's 0.60-0.73 s either way), so a plain rotation,
    in which one method follows dcp.load more often than dcp.load does, measured the order."""
    if len(methods) not in DE_BRUIJN:
        raise ValueError(f"balanced_order takes 2 or 3 methods, got {len(methods)}")
    cycle, names = DE_BRUIJN[len(methods)], methods[start:] + methods[:start]
    per_cycle = len(cycle) // len(methods)
    return [names[i] for _ in range(-(-runs // per_cycle)) for i in cycle]
