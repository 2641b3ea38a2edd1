"""B9's simulation: rank 0's coordinator work for N ranks, in one process, on the inputs N ranks send.

Runs under torch's fake process group (world size N, this process is rank 0). Save: rank 0's
real local plan; the N local plans it gathers (built by coordinator_plans, pickled as each rank
would, unpickled here as gather_object does); DefaultSavePlanner.create_global_plan and the
writer's prepare_global_plan; the scatter (pickling N global plans); finish_plan; the N write
results gathered; the writer's finish (.metadata: pickle, fsync, rename); the metadata broadcast.
fsdpkit's save runs that inside its real commit (`save._commit`, private): the directory
preparation, the checksum all-reduce, the file lists gathered from N ranks (synthetic, one data
file per rank, as DigestFileSystem reports), the manifest built, sealed and written, `latest`.
Load: reading `.metadata` (DCP: pickle; fsdpkit: its allow-list unpickler, and the file's
checksum first), rank 0's local load plan, the N load plans gathered, create_global_plan, the
scatter, finish_plan; fsdpkit adds resolution (committed_candidates: manifest read and checked,
every file's presence and size), the fingerprint checks, and the gather of every rank's checksum
problems (resume.verify_files, before the load). No tensor data is written or read (of rank 0's
share of the checksum pass, only `.metadata` is hashed), and the other ranks' own work (their
local plans, their pickling) is done outside the timed phases.

Usage: python bench/coordinator_sim.py --world N --repeats R --dir D --out F.json
"""

from __future__ import annotations

import argparse
import gc
import json
import pickle
import statistics
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner

from coordinator_plans import (
    load_plan_for_rank,
    rank0_state,
    remember_sizes,
    save_plan_for_rank,
    write_results,
)
from coordinator_probe import peak_rss_mb, reset_peak_rss
from coordinator_state import LAYERS, Llama70BShape, manifest_meta
from fsdpkit.checkpoint import save as fsave
from fsdpkit.checkpoint.catalog import step_dir_name
from fsdpkit.checkpoint.hashing import HASH_NAME, file_checksum
from fsdpkit.checkpoint.io import hashing_writer, safe_reader
from fsdpkit.checkpoint.layout import MANIFEST
from fsdpkit.checkpoint.manifest import check_files_present, check_fingerprint, read_manifest
from fsdpkit.checkpoint.resolve import committed_candidates
from fsdpkit.checkpoint.resume import check_optimizer
from fsdpkit.checkpoint.safe_io import METADATA_FILENAME, SafeLoadPlanner
from fsdpkit.checkpoint.settings import IOSettings
from fsdpkit.checkpoint.state import CheckpointTarget


class Phases:
    """Wall and process CPU per named phase of rank 0's own work; bytes by what moved."""

    def __init__(self) -> None:
        self.wall: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        self.bytes: dict[str, int] = {}

    @contextmanager
    def __call__(self, name: str):
        t0, c0 = time.perf_counter(), time.process_time()
        yield
        self.wall[name] = self.wall.get(name, 0.0) + time.perf_counter() - t0
        self.cpu[name] = self.cpu.get(name, 0.0) + time.process_time() - c0

    def record(self) -> dict[str, Any]:
        return {"wall_s": sum(self.wall.values()), "cpu_s": sum(self.cpu.values()), "phases_s": dict(self.wall),
                "bytes": dict(self.bytes)}


def received(ph: Phases, name: str, payloads: list[bytes]) -> list[Any]:
    """Rank 0's side of a gather: unpickle every rank's payload."""
    ph.bytes[name] = ph.bytes.get(name, 0) + sum(map(len, payloads))
    with ph(name):
        return [pickle.loads(b) for b in payloads]


def sent(ph: Phases, name: str, objs: list[Any]) -> None:
    with ph(name):
        size = sum(len(pickle.dumps(o)) for o in objs)
    ph.bytes[name] = ph.bytes.get(name, 0) + size


class Sim:
    def __init__(self, *, world: int, root: Path, layers: int = LAYERS) -> None:
        self.world, self.root = world, root
        self.state = rank0_state(world=world, layers=layers)
        model = Llama70BShape(layers)
        opt = torch.optim.AdamW(model.parameters())
        self.meta = manifest_meta(model, opt, step=1)
        self.target = CheckpointTarget(model, opt)
        self.step = 0
        self.plans = fsave.PlanCache()  # a Checkpointer's: fsdpkit's saves after its first reuse the plan
        self.final_plans: list[Any] = []

    def dcp_save(self, ph: Phases, writer: FileSystemWriter, planner: DefaultSavePlanner | None = None, *,
                 other: Phases | None = None) -> Any:
        """DCP's save coordination on rank 0 (state_dict_saver._save_state_dict without write_data).
        With a caching `planner` (fsdpkit's save.PlanCache) whose cache holds this state's plans, every
        rank sends an empty plan (nothing changed) and writes its cached final plan. The other ranks'
        work (their plans and write results, pickled) is timed in `other`, for a caller that times
        around this call to subtract."""
        planner = planner or DefaultSavePlanner()
        other = other or Phases()
        with ph("local_plan"):
            planner.set_up_planner(self.state, storage_meta=writer.storage_meta(), is_coordinator=True)
            writer.set_up_storage_writer(True)
            plan0 = writer.prepare_local_plan(planner.create_local_plan())
        with other("other_ranks"):
            if plan0.usable:
                payloads = [pickle.dumps(plan0)] + [pickle.dumps(save_plan_for_rank(plan0, rank=r, world=self.world))
                                                    for r in range(1, self.world)]
            else:  # cached: every rank's plan is unchanged, as rank 0's is
                payloads = [pickle.dumps(plan0)] * self.world
        plans = received(ph, "gather_plans", payloads)
        del payloads
        with ph("global_plan"):
            plans, metadata = planner.create_global_plan(plans)
            plans = writer.prepare_global_plan(plans)
        sent(ph, "scatter_plans", plans)
        with ph("finish_plan"):
            planner.finish_plan(plans[0])
        if all(p.usable for p in plans):
            self.final_plans = plans  # what each rank writes while its plan stays cached
        with other("other_ranks"):  # their writes
            payloads = [pickle.dumps(write_results(p, rank=r)) for r, p in enumerate(self.final_plans)]
        del plans
        results = received(ph, "gather_results", payloads)
        del payloads
        with ph("finish_metadata"):
            writer.finish(metadata=metadata, results=results)
        sent(ph, "broadcast_metadata", [metadata])
        return metadata

    def plain_save(self) -> dict[str, Any]:
        self.step += 1
        ph = Phases()
        self.dcp_save(ph, FileSystemWriter(self.root / "dcp" / step_dir_name(self.step)))
        return ph.record()

    def fsdpkit_save(self) -> dict[str, Any]:
        """fsdpkit's commit (save._commit) around DCP's coordination; the synthetic files of the
        other ranks are built outside the timed phases (their time is subtracted)."""
        self.step += 1
        ph, other = Phases(), Phases()

        def write(into: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
            writer, fs = hashing_writer(into, thread_count=1)
            self.dcp_save(ph, writer, self.plans.planner(), other=other)
            with other("other_ranks"):
                mine = dict(fs.files)
                per_rank = [{f"__{r}_0.distcp": {"size": 4096 + r, HASH_NAME: f"{r:016x}"}} for r in range(self.world)]
                per_rank[0].update(mine)
                payloads = [pickle.dumps(f) for f in per_rank]
            return received(ph, "gather_files", payloads), {}

        snapshot = fsave.Snapshot(step=self.step, state=self.state, trainer={}, meta=self.meta)
        t0, c0 = time.perf_counter(), time.process_time()
        manifest = fsave._commit(snapshot, ckpt_dir=self.root / "fsdpkit" / step_dir_name(self.step), group=None,
                                 kind="sharded", write=write, io=IOSettings.from_environment())
        wall = time.perf_counter() - t0 - other.wall["other_ranks"]
        cpu = time.process_time() - c0 - other.cpu["other_ranks"]
        record = ph.record()
        record["phases_s"]["fsdpkit_commit"] = wall - record["wall_s"]
        record.update(wall_s=wall, cpu_s=cpu)
        record["bytes"]["hash_all_reduce"] = 8 * len(manifest["tensors"])
        self._materialise(manifest)
        return record

    def dcp_load(self, ph: Phases, reader: FileSystemReader, planner: DefaultLoadPlanner, *, reads: int = 1) -> None:
        with ph("read_metadata"):
            for _ in range(reads):
                metadata = reader.read_metadata()
        with ph("local_plan"):
            planner.set_up_planner(self.state, metadata, True)
            reader.set_up_storage_reader(metadata, True)
            plan0 = reader.prepare_local_plan(planner.create_local_plan())
        remember_sizes(metadata)
        payloads = [pickle.dumps(plan0)] + [pickle.dumps(load_plan_for_rank(plan0, rank=r, world=self.world))
                                            for r in range(1, self.world)]
        plans = received(ph, "gather_plans", payloads)
        del payloads
        with ph("global_plan"):
            plans = reader.prepare_global_plan(planner.create_global_plan(plans))
        sent(ph, "scatter_plans", plans)
        with ph("finish_plan"):
            planner.finish_plan(plans[0])

    def plain_load(self) -> dict[str, Any]:
        ph = Phases()
        self.dcp_load(ph, FileSystemReader(self.root / "dcp" / step_dir_name(self.step)), DefaultLoadPlanner())
        return ph.record()

    def fsdpkit_load(self) -> dict[str, Any]:
        ph = Phases()
        root = self.root / "fsdpkit"
        with ph("resolve"):
            path = committed_candidates(root)[0][0]
        with ph("manifest_checks"):
            manifest = read_manifest(path)
            problems = check_files_present(path, manifest)
            check_fingerprint(manifest["fingerprint"], self.meta["fingerprint"], ckpt_dir=path)
            check_optimizer(manifest, self.target, ckpt_dir=path)
        assert not problems, problems[:3]
        with ph("metadata_checksum"):  # rank 0's share of resume.verify_files: .metadata sorts first
            file_checksum(path / METADATA_FILENAME)
        problems = received(ph, "gather_problems", [pickle.dumps([]) for _ in range(self.world)])
        assert not [p for mine in problems for p in mine]
        # resume._load_sharded reads the metadata once for its RNG check, then dcp.load reads it again
        self.dcp_load(ph, safe_reader(path), SafeLoadPlanner(), reads=2)
        return ph.record()

    def _materialise(self, manifest: dict[str, Any]) -> None:
        """Sparse stand-ins for the data files the manifest lists (resolution checks their sizes)."""
        path = self.root / "fsdpkit" / step_dir_name(self.step)
        for name, info in manifest["files"].items():
            if not (path / name).exists():
                with open(path / name, "wb") as f:
                    f.truncate(info["size"])


def run(world: int, *, repeats: int, root: Path) -> dict[str, Any]:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    tdist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    t0 = time.perf_counter()
    sim = Sim(world=world, root=root)
    out: dict[str, Any] = {"world": world, "setup_s": time.perf_counter() - t0}
    for method in ("dcp", "fsdpkit"):
        save = sim.plain_save if method == "dcp" else sim.fsdpkit_save
        load = sim.plain_load if method == "dcp" else sim.fsdpkit_load
        runs, loads = [], []
        # Each timed save and load starts from a full collection, so that a collection owed by earlier work
        # (the simulation's, the other method's) cannot land in it (at 1,024 ranks, before this, the same
        # read_metadata took 32.6 s on one side and 0.96 s on the other).
        for _ in range(max(2, repeats) if method == "fsdpkit" else repeats):  # fsdpkit: its first save, then cached
            gc.collect()
            reset_peak_rss()
            runs.append(save() | {"peak_rss_mb": peak_rss_mb()})
        for _ in range(repeats):
            gc.collect()
            reset_peak_rss()
            loads.append(load() | {"peak_rss_mb": peak_rss_mb()})
        last = root / method / step_dir_name(sim.step)
        out[method] = {"save_first": runs[0], "save": _median(runs[1:] or runs), "resume": _median(loads),
                       "metadata_bytes": (last / METADATA_FILENAME).stat().st_size,
                       "manifest_bytes": (last / MANIFEST).stat().st_size if (last / MANIFEST).exists() else 0}
    tdist.destroy_process_group()
    return out


def _median(runs: list[dict[str, Any]]) -> dict[str, Any]:
    best = sorted(runs, key=lambda r: r["wall_s"])[len(runs) // 2]
    return best | {"wall_s": statistics.median(r["wall_s"] for r in runs),
                   "cpu_s": statistics.median(r["cpu_s"] for r in runs), "runs_s": [r["wall_s"] for r in runs]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--repeats", type=int, default=3, help="saves and resumes per method (fsdpkit saves at least 2)")
    p.add_argument("--dir", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    Path(args.out).write_text(json.dumps(run(args.world, repeats=args.repeats, root=Path(args.dir)), indent=1))


if __name__ == "__main__":
    main()
