"""Checkpoint cost on one CUDA GPU: fsdpkit's Checkpointer against DCP, with the machine's ceilings.

The state lives on the GPU (FSDP2 over a one-rank NCCL mesh, AdamW fused, after one real step):
params + exp_avg + exp_avg_sq, fp32, `--size-gib` in all. Each figure is the median of `--runs`
saves (min-max beside it); the first save of each kind is a warm-up and not counted.

- async stall: `Checkpointer(async_save=True).save()` until the loop may go on (a copy into its
  reused pinned buffer), against `dcp.async_save()` until it returns, and against the ceiling, one
  device-to-host copy of the same bytes into pinned memory (one stream, as the save uses);
- fair baseline (torchtitan's fast mode): `dcp.async_save(..., async_checkpointer_type=PROCESS,
  async_stager=DefaultStager(StagingOptions(pinned, shared memory, async staging, non-blocking
  copies)))`, the stager created once and reused, with `DefaultSavePlanner(enable_plan_caching=True)`
  and a dedicated gloo group; its stall is until the call returns and, as the figure to compare,
  until its staging has finished (the loop may not update the weights before that: torchtitan waits
  for it before the next optimizer step). Features this torch lacks are skipped with a line saying so;
- training-step slowdown during a background save: after each async save's stall, training steps
  (forward, backward, AdamW on the same model, a `--step-batch` x 4096 input) run until the save
  has finished; their mean time against steps with no save in flight, for fsdpkit, `dcp.async_save`
  with default settings and the fast mode;
- sync save: `Checkpointer.save()` (checksums, manifest, commit; no retention) against `dcp.save()` of the same
  state, and against one stream writing the same bytes with fsync (the fastest of plain writes,
  writes that start their write-back every 64 MiB, and O_DIRECT writes from reused buffers: the
  ways fsdpkit's writer writes);
- resume: a fresh Checkpointer's `resume()` of the newest sync checkpoint (resolution, a pass that
  checks every file's checksum, the load, restored-tensor checksums) against `dcp.load` +
  `set_state_dict` of the same checkpoint (both from the page cache).

Usage (a GPU machine): torchrun --nproc-per-node 1 bench/gpu_checkpoint.py [--size-gib 2] [--runs 5]
    [--parts async,sync,resume] [--out FILE]
`--cpu-smoke` runs the async part on the CPU (gloo, a small state, no pinned memory or CUDA-only
staging options): it checks the code, it measures nothing of interest.
Rank 0 prints a markdown table and writes bench/results/gpu_checkpoint.json (or --out).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as tdist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from fsdpkit.checkpoint import Checkpointer
from fsdpkit.checkpoint.io import hashing_writer
from fsdpkit.checkpoint.manifest import read_manifest
from raw_io import WriteBack
from raw_io import write_direct as raw_write_direct

RESULTS = Path(__file__).parent / "results" / "gpu_checkpoint.json"
WIDTH = 4096


def build(size_gib: float, device: torch.device, width: int = WIDTH) -> tuple[nn.Module, torch.optim.Optimizer]:
    n_layers = max(1, round(size_gib * 2**30 / (12 * width * width)))  # 3 fp32 copies of each weight
    mesh = init_device_mesh(device.type, (tdist.get_world_size(),))
    model = nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(n_layers))).to(device)
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    model(torch.randn(8, width, device=device)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, runs: int, before=None) -> list[float]:
    out = []
    for i in range(runs + 1):
        if before is not None:
            before()
        sync()
        t0 = time.perf_counter()
        fn()
        if i:  # the first is a warm-up (buffer allocation, planning caches)
            out.append(time.perf_counter() - t0)
    return out


def d2h_ceiling(nbytes: int, runs: int, device: torch.device) -> list[float]:
    """One device-to-host copy of `nbytes` into pinned memory (one stream, as the saves use)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).normal_()
    pinned = torch.empty(src.shape, dtype=src.dtype, pin_memory=device.type == "cuda")

    def d2h():
        pinned.copy_(src, non_blocking=True)
        sync()

    return timed(d2h, runs)


def ceilings(nbytes: int, runs: int, scratch: Path, device: torch.device) -> dict[str, list[float]]:
    """The fastest way of writing `nbytes` with fsync, from pinned host memory."""
    pinned = torch.empty(nbytes // 4, dtype=torch.float32, pin_memory=device.type == "cuda").normal_()

    block = pinned.view(torch.uint8).numpy()

    def write(writeback: bool) -> None:  # with writeback: started every 64 MiB as it goes
        with open(scratch / "ceiling.bin", "wb") as f:
            wb = WriteBack(f.fileno(), (64 << 20) if writeback else 0)
            for i in range(0, len(block), 64 << 20):
                f.write(block[i:i + (64 << 20)])
                f.flush()
                wb.written_to(min(i + (64 << 20), len(block)))
            os.fsync(f.fileno())
        (scratch / "ceiling.bin").unlink()

    def write_direct() -> None:  # O_DIRECT from a reused aligned buffer (bench/raw_io.py)
        raw_write_direct(scratch / "ceiling.bin", [pinned.view(torch.uint8)])
        (scratch / "ceiling.bin").unlink()

    ways = [timed(lambda: write(False), runs), timed(lambda: write(True), runs), timed(write_direct, runs)]
    faster = min(ways, key=statistics.median)  # the ceiling: the fastest way
    return {"write_fsync_s": faster}


def summary(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def fast_mode(device: torch.device) -> tuple[dict, list[str]]:
    """torchtitan's fast async mode as this torch offers it: (dcp.async_save keyword arguments,
    lines saying what this torch lacks). Empty arguments: the mode cannot run here."""
    notes: list[str] = []
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    except ImportError as e:
        return {}, [f"skipped: torchtitan's fast mode needs AsyncCheckpointerType and DefaultStager ({e})"]
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    cuda = device.type == "cuda"  # pinned memory, async staging and non-blocking copies need CUDA
    options = StagingOptions(use_pinned_memory=cuda, use_shared_memory=True, use_async_staging=cuda,
                             use_non_blocking_copy=cuda)
    if not cuda:
        notes.append("CPU: staging without pinned memory, async staging or non-blocking copies")
    if "enable_plan_caching" in inspect.signature(DefaultSavePlanner.__init__).parameters:
        planner = DefaultSavePlanner(enable_plan_caching=True)
    else:
        planner = DefaultSavePlanner()
        notes.append(f"skipped: DCP plan caching (DefaultSavePlanner has no enable_plan_caching in torch "
                     f"{torch.__version__}); the fast mode runs without it")
    class KeptStager:
        """torchtitan keeps one DefaultStager for the whole run: its cached pinned buffers are the point.
        Some torch releases (2.11 among them) empty the stager's caches at the end of every stage (its
        next stage then fails with `KeyError: <class 'type'>`); there each save gets a new stager (as
        good as that torch allows: the pinned buffers are allocated per save), counted in `renewed`."""

        def __init__(self) -> None:
            self.inner, self.renewed, self.saves = DefaultStager(options), 0, 0

        @property
        def should_synchronize_after_execute(self) -> bool:
            return self.inner.should_synchronize_after_execute

        def stage(self, state_dict, **kwargs):
            if self.saves and not self.inner._state_dict_stager._deepcopy_dispatch:  # emptied after its last stage
                self.inner.close()
                self.inner, self.renewed = DefaultStager(options), self.renewed + 1
            self.saves += 1
            return self.inner.stage(state_dict, **kwargs)

        def synchronize_staging(self) -> None:
            self.inner.synchronize_staging()

        def close(self) -> None:
            self.inner.close()

        def note(self) -> str | None:
            if not self.renewed:
                return None
            return (f"torch {torch.__version__}'s DefaultStager empties its staging cache after every stage and "
                    f"cannot stage again, so the fast mode got a new stager for {self.renewed} of {self.saves} "
                    "saves (pinned buffers allocated per save; a torch whose stager keeps its cache would stall less)")

    # A dedicated gloo group: with the default group the stager modes hit gloo collective mismatches.
    kwargs = dict(async_checkpointer_type=AsyncCheckpointerType.PROCESS, async_stager=KeptStager(),
                  planner=planner, process_group=tdist.new_group(backend="gloo"))
    return kwargs, notes


def step_fn(model: nn.Module, optimizer: torch.optim.Optimizer, batch: int, device: torch.device, width: int):
    x = torch.randn(batch, width, device=device)

    def step(before_update=None) -> None:
        model(x).square().mean().backward()
        if before_update is not None:
            before_update()  # a save whose staging still reads the weights must finish that first
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def steps_while(busy, step, *, before_update=None, at_least: int = 1) -> tuple[int, float]:
    """Run training steps while `busy()` (at least `at_least`); (steps, mean seconds per step)."""
    n, t0 = 0, time.perf_counter()
    while n < at_least or busy():
        step(before_update if n == 0 else None)
        sync()
        n += 1
    return n, (time.perf_counter() - t0) / n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-gib", type=float, default=2.0)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--parts", default="async,sync,resume", help="comma-separated: async, sync, resume")
    p.add_argument("--step-batch", type=int, default=2048, help="rows of the training step's input")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--dir", type=Path, default=None, help="scratch directory (default: a temporary one)")
    p.add_argument("--cpu-smoke", action="store_true", help="the async part on the CPU, small: checks the code")
    args = p.parse_args()
    parts = set(args.parts.split(","))
    width = WIDTH
    if args.cpu_smoke:
        device, width = torch.device("cpu"), 256
        args.size_gib, args.runs, args.step_batch, parts = min(args.size_gib, 0.01), min(args.runs, 2), 64, {"async"}
        tdist.init_process_group("gloo")
    else:
        if not torch.cuda.is_available():
            raise SystemExit("bench/gpu_checkpoint.py needs a CUDA GPU (or --cpu-smoke); bench/checkpoint.py "
                             "measures the CPU path")
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        tdist.init_process_group("cpu:gloo,cuda:nccl")  # dcp.async_save needs a CPU backend beside NCCL
    scratch = Path(tempfile.mkdtemp(prefix="fsdpkit-gpu-bench-", dir=args.dir))
    model, optimizer = build(args.size_gib, device, width)
    nbytes = sum(t.to_local().numel() * 4 for t in model.parameters()) * 3
    state = lambda: dict(zip(("model", "optim"), get_state_dict(model, optimizer), strict=True))  # noqa: E731
    times: dict[str, list[float]] = {"d2h_pinned_s": d2h_ceiling(nbytes, args.runs, device)}
    notes: list[str] = []
    if "sync" in parts:
        times |= ceilings(nbytes, args.runs, scratch, device)
    train_step = step_fn(model, optimizer, args.step_batch, device, width)

    if "async" in parts:
        for _ in range(3):  # warm-up
            train_step()
        sync()
        # steps with no save in flight, before and after the saves (their mean is the reference)
        quiet = [steps_while(lambda: False, train_step, at_least=10)[1] for _ in range(args.runs)]

        def measure(name: str, start, busy, *, before_update=None) -> None:
            """runs+1 saves (the first a warm-up): stall and the steps until the save is done."""
            stalls, staged, slow, counts = [], [], [], []
            for i in range(args.runs + 1):
                sync()
                t0 = time.perf_counter()
                handle = start(i)
                stall = time.perf_counter() - t0
                n, per_step = steps_while(lambda h=handle: busy(h), train_step,
                                          before_update=(lambda h=handle: before_update(h)) if before_update else None)
                if i:
                    stalls.append(stall)
                    slow.append(per_step)
                    counts.append(n)
                    if isinstance(handle, dict) and "staged_s" in handle:
                        staged.append(handle["staged_s"])
                finish(handle)
            times[f"{name}_stall_s"] = stalls
            if staged:
                times[f"{name}_stall_until_staged_s"] = staged
            times[f"{name}_step_during_save_s"] = slow
            times[f"{name}_steps_during_save"] = counts

        finishers = []

        def finish(handle) -> None:
            for f in finishers:
                f(handle)

        # fsdpkit: the stall is the save call (the copy into its reused pinned buffer)
        root = scratch / "fsdpkit-async"
        ckpt = Checkpointer(root, model=model, optimizer=optimizer, async_save=True, verify_checksums=False)
        ckpt.resume()
        finishers[:] = [lambda h: ckpt._async.wait()]  # the save's own result is collected at close()
        measure("fsdpkit_async", lambda i: ckpt.save(i + 1), lambda h: not ckpt._async.done())
        ckpt.close()
        shutil.rmtree(root)

        # dcp.async_save with its defaults (a thread, fresh unpinned staging on every call)
        def dcp_default(i):
            return dcp.async_save(state(), checkpoint_id=scratch / f"dcp-async-{i}")
        finishers[:] = [lambda h: h.result()]
        measure("dcp_async", dcp_default, lambda h: not h.done())

        kwargs, fast_notes = fast_mode(device)
        notes += fast_notes
        if kwargs:
            def fast(i):
                h = {"t0": time.perf_counter()}
                r = dcp.async_save(state(), checkpoint_id=scratch / f"dcp-fast-{i}", **kwargs)
                if hasattr(r, "staging_completion"):  # AsyncSaveResponse: staging runs in the background
                    h["staging"], h["upload"] = r.staging_completion, r.upload_completion
                else:
                    h["staging"], h["upload"] = None, r
                return h

            def wait_staged(h) -> None:
                if h["staging"] is not None:
                    h["staging"].result()
                h["staged_s"] = time.perf_counter() - h["t0"]

            def fast_start(i):
                h = fast(i)
                wait_staged(h)  # measured to here: nothing may update the weights before it
                return h

            finishers[:] = [lambda h: h["upload"].result()]
            try:
                # stall until staged (the figure to compare), and the call alone (steps overlap staging)
                measure("dcp_fast", fast_start, lambda h: not h["upload"].done())
                measure("dcp_fast_call", fast, lambda h: not h["upload"].done(), before_update=wait_staged)
            except Exception as e:  # noqa: BLE001 (a baseline failing must not lose fsdpkit's figures)
                import traceback

                frames = traceback.extract_tb(e.__traceback__)[-4:]
                where = " <- ".join(f"{f.name}:{f.lineno}" for f in reversed(frames))
                notes.append(f"failed: torchtitan's fast mode: {type(e).__name__}: {e} (at {where})"[:1000])
            finally:
                kwargs["async_stager"].close()
                if kwargs["async_stager"].note():
                    notes.append(kwargs["async_stager"].note())
        times["quiet_step_s"] = quiet + [steps_while(lambda: False, train_step, at_least=10)[1]
                                         for _ in range(args.runs)]
        for i in range(args.runs + 1):
            shutil.rmtree(scratch / f"dcp-async-{i}", ignore_errors=True)
            shutil.rmtree(scratch / f"dcp-fast-{i}", ignore_errors=True)

    def resume(root: Path) -> None:
        """fsdpkit's whole checkpoint part of a resume: resolution, a pass that checks every file's
        checksum, the load, the restored tensors' checksums against the manifest."""
        ckpt = Checkpointer(root, model=model, optimizer=optimizer)
        if ckpt.resume() != args.runs + 1:
            raise RuntimeError("the resume did not load the newest checkpoint")
        ckpt.close()

    def dcp_load(path: Path) -> None:
        sd = state()
        dcp.load(sd, checkpoint_id=path)
        set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

    if parts & {"sync", "resume"}:
        records: list[dict] = []
        root = scratch / "fsdpkit-sync"
        ckpt = Checkpointer(root, model=model, optimizer=optimizer, async_save=False,
                            verify_checksums=False, on_event=records.append)  # no retention: nothing deleted in a save
        ckpt.resume()
        for step in range(1, args.runs + 2):
            ckpt.save(step, wait=True)
        ckpt.close()
        if "sync" in parts:
            times["fsdpkit_sync_save_s"] = [r["stall_s"] for r in records if r["event"] == "checkpoint"][1:]
            manifests = [read_manifest(root / f"step_{step}")["timings"] for step in range(2, args.runs + 2)]
            times["fsdpkit_sync_dcp_write_s"] = [t["write_s"] for t in manifests]  # DCP write + file-list gather
        if "resume" in parts:
            times["fsdpkit_resume_s"] = timed(lambda r=root: resume(r), args.runs)
            times["dcp_load_s"] = timed(lambda r=root: dcp_load(r / f"step_{args.runs + 1}"), args.runs)
        shutil.rmtree(root)
    if "sync" in parts:
        times["dcp_save_s"] = timed(lambda: dcp.save(state(), checkpoint_id=scratch / "dcp"), args.runs,
                                    before=lambda: shutil.rmtree(scratch / "dcp", ignore_errors=True))
        times["dcp_save_hashing_writer_s"] = timed(  # the same dcp.save through fsdpkit's file-hashing writer alone
            lambda: dcp.save(state(), storage_writer=hashing_writer(scratch / "dcp-h", thread_count=1)[0]), args.runs,
            before=lambda: shutil.rmtree(scratch / "dcp-h", ignore_errors=True))

    if tdist.get_rank() == 0:
        report(args, times, notes, nbytes=nbytes, device=device)
    tdist.barrier()
    shutil.rmtree(scratch, ignore_errors=True)
    tdist.destroy_process_group()


ROWS = [  # (figure, key, against, key)
    ("fsdpkit async stall", "fsdpkit_async_stall_s", "d2h pinned copy (ceiling)", "d2h_pinned_s"),
    ("fsdpkit async stall", "fsdpkit_async_stall_s", "fast mode stall until staged (fair baseline)",
     "dcp_fast_stall_until_staged_s"),
    ("fsdpkit async stall", "fsdpkit_async_stall_s", "dcp.async_save default stall", "dcp_async_stall_s"),
    ("fast mode: the async_save call alone", "dcp_fast_call_stall_s", "d2h pinned copy (ceiling)", "d2h_pinned_s"),
    ("step during an fsdpkit save", "fsdpkit_async_step_during_save_s", "step, no save", "quiet_step_s"),
    ("step during a fast-mode save (staging waited before it)", "dcp_fast_step_during_save_s", "step, no save",
     "quiet_step_s"),
    ("step during a fast-mode save (overlapping its staging)", "dcp_fast_call_step_during_save_s", "step, no save",
     "quiet_step_s"),
    ("step during a default dcp.async_save", "dcp_async_step_during_save_s", "step, no save", "quiet_step_s"),
    ("fsdpkit sync save", "fsdpkit_sync_save_s", "dcp.save", "dcp_save_s"),
    ("fsdpkit sync save", "fsdpkit_sync_save_s", "1-stream write+fsync", "write_fsync_s"),
    ("fsdpkit sync: DCP write + gather", "fsdpkit_sync_dcp_write_s", "dcp.save", "dcp_save_s"),
    ("dcp.save through fsdpkit's file-hashing writer", "dcp_save_hashing_writer_s", "dcp.save", "dcp_save_s"),
    ("fsdpkit resume (checkpoint part)", "fsdpkit_resume_s", "dcp.load + set_state_dict", "dcp_load_s"),
]


def report(args, times: dict[str, list[float]], notes: list[str], *, nbytes: int, device: torch.device) -> None:
    med = {k: statistics.median(v) for k, v in times.items()}
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"\nstate: {nbytes / 1e9:.2f} GB on {name}, torch {torch.__version__}, medians of {args.runs}\n")
    print("| figure | s | against | s | ratio |\n|---|---|---|---|---|")
    rows = []
    for a, ka, b, kb in ROWS:
        if ka in med and kb in med:
            rows.append({"figure": a, "key": ka, "against": b, "against_key": kb, "ratio": med[ka] / med[kb]})
            print(f"| {a} | {med[ka]:.4f} | {b} | {med[kb]:.4f} | {med[ka] / med[kb]:.2f} |")
    print("\nmin-max: " + ", ".join(f"{k} {min(v):.4f}-{max(v):.4f}" for k, v in times.items()))
    for line in notes:
        print(line)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"bytes": nbytes, "device": name, "torch": torch.__version__,
                                    "commit": os.environ.get("COMMIT", ""), "runs": args.runs,
                                    "parts": sorted(set(args.parts.split(","))), "cpu_smoke": args.cpu_smoke,
                                    "step_batch": args.step_batch, "notes": notes, "rows": rows,
                                    **{k: summary(v) for k, v in times.items()}}, indent=1))


if __name__ == "__main__":
    main()
