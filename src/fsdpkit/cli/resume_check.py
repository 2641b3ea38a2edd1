"""`fsdpkit resume-check`: the user's proof, on their own config, that resuming is seamless.

Runs the config uninterrupted for K steps; runs it again, saving at step S and stopping there as
an interruption would; resumes it (optionally at another world size, or with other settings such
as another sharding strategy: --resume-overrides) to step K; then checks two things. Given several
world sizes (`--resume-nproc 2,3`), the interrupted run is copied once per extra world size and each
copy is resumed and checked on its own, so the first two runs are shared. (1) The resumed
run really resumed: its own records (the `resume` event in metrics.jsonl) say it loaded the full
state of step S of the second run, saved on the first run's world size. Equal losses alone prove
nothing: a deterministic fresh start gives the same numbers. (2) A per-step table of loss and
grad-norm differences stays within the tolerance: 0 when the resumed run changes nothing (same world
size, no resume overrides) in deterministic mode, else 1e-6 relative when the mixed-precision policy
is all fp32 and 5e-4 otherwise.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from fsdpkit.checkpoint.catalog import step_dir_name
from fsdpkit.checkpoint.storage.urls import is_url
from fsdpkit.config import check_world_size, compose_config
from fsdpkit.parallel.policies import mixed_precision_policy
from fsdpkit.train.metrics import read_records

ELASTIC_RTOL_FP32 = 1e-6
ELASTIC_RTOL_LOW_PRECISION = 5e-4
RESUME_EVENT = "resume"  # what Checkpointer.resume_from writes to metrics.jsonl


def _train(nproc: int, overrides: list[str], run_dir: Path, config_dirs: list[str]) -> None:
    cmd = [sys.executable, "-m", "fsdpkit", "train", "--nproc", str(nproc),
           *[f"--config-dir={d}" for d in config_dirs], *overrides, f"run_dir={run_dir}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd[2:])}` failed ({proc.returncode}):\n{proc.stderr[-4000:]}")


def _by_step(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_records(run_dir)}


def is_fp32(policy: MixedPrecisionPolicy) -> bool:
    """True when parameters, gradient reduction and outputs all stay fp32 (None means "as the
    parameter", which fsdpkit keeps in fp32)."""
    return all(d in (None, torch.float32) for d in (policy.param_dtype, policy.reduce_dtype, policy.output_dtype))


def tolerance(overrides: list[str], *, same_world_size: bool, config_dirs: list[str]) -> float:
    """The relative tolerance of the comparison.

    A preset name or a `_target_` mapping is turned into the MixedPrecisionPolicy that training
    will use (a custom factory runs here as it does in training); only a policy that keeps every
    dtype fp32 gets the fp32 tolerance, anything else the low-precision one.
    """
    cfg = compose_config(overrides, config_dirs=config_dirs)
    if same_world_size and cfg.deterministic:
        return 0.0
    fp32 = is_fp32(mixed_precision_policy(cfg.policy.mixed_precision))
    return ELASTIC_RTOL_FP32 if fp32 else ELASTIC_RTOL_LOW_PRECISION


def resume_problems(events: list[dict[str, Any]], *, step: int, saved_world_size: int, ckpt_root: Path) -> list[str]:
    """Why the records `events` (metrics.jsonl events of the interrupted-then-resumed run) do not
    show one full resume from `ckpt_root/step_<step>` saved on `saved_world_size` ranks (empty:
    they do)."""
    resumes = [e for e in events if e.get("event") == RESUME_EVENT]
    if not resumes:
        return [f"the resumed run recorded no `{RESUME_EVENT}` event: it started fresh instead of loading the "
                f"checkpoint of step {step} (were the checkpoints under {ckpt_root} deleted, or is checkpoint.resume "
                "overridden?)"]
    if len(resumes) > 1:
        return [f"the resumed run directory records {len(resumes)} resumes (steps {[e.get('step') for e in resumes]}); "
                "expected exactly one: use a new --work-dir"]
    event, problems = resumes[0], []
    if event.get("step") != step:
        problems.append(f"the run resumed from step {event.get('step')}, expected step {step}")
    if event.get("saved_world_size") != saved_world_size:
        problems.append(f"the checkpoint it resumed from was saved on {event.get('saved_world_size')} rank(s), "
                        f"expected {saved_world_size}")
    expected = (ckpt_root / step_dir_name(step)).resolve()
    if Path(str(event.get("path"))).resolve() != expected:
        problems.append(f"the run resumed from {event.get('path')}, expected {expected}")
    if event.get("mode") != "full":
        problems.append(f"the run restored {event.get('mode')!r} state (checkpoint.resume_mode), not the full state")
    return problems


def check_before_running(*, overrides: list[str], nproc: int, resume_nproc: list[int], steps: int, save_at: int,
                         config_dirs: list[str] = (), resume_overrides: list[str] = ()) -> None:
    """What resume_check refuses before it runs anything: bad step numbers, or a config that cannot
    run on --nproc ranks or, with the resume overrides, on a resume world size.

    Raises:
        ValueError: naming the option or setting to change.
    """
    if not 0 < save_at < steps:
        raise ValueError(f"--save-at must lie between 0 and --steps ({steps}), got {save_at}")
    if not resume_nproc or min(resume_nproc) < 1:
        raise ValueError(f"--resume-nproc needs world sizes of at least 1, got {resume_nproc}")
    try:
        check_world_size(compose_config(overrides, config_dirs=list(config_dirs)), nproc, local_world_size=nproc)
    except ValueError as e:
        raise ValueError(f"the first runs on {nproc} rank(s) (--nproc): {e}") from None
    resumed_cfg = compose_config([*overrides, *resume_overrides], config_dirs=list(config_dirs))
    for size in resume_nproc:
        try:
            check_world_size(resumed_cfg, size, local_world_size=size)
        except ValueError as e:
            hint = (", or resume under another strategy: --resume-overrides strategy.sharding_strategy=FULL_SHARD"
                    if resumed_cfg.strategy.sharding_strategy == "HYBRID_SHARD" else "")
            raise ValueError(f"the resumed run on {size} rank(s): {e}{hint}") from None


def resume_check(*, overrides: list[str], nproc: int, resume_nproc: int | list[int], steps: int, save_at: int,
                 work_dir: Path | None = None, config_dirs: list[str] = (), resume_overrides: list[str] = (),
                 before_resume: Callable[[Path], None] | None = None) -> int:
    """Returns the exit code: 0 when every resumed run resumed from step `save_at` and every step
    after it is within tolerance, else 1.

    Args:
        resume_nproc: ranks of the resumed run; a list resumes the same interrupted run once per
            entry (in `resumed/` for one entry, else `resumed-<M>/` each).
        resume_overrides: Hydra overrides for the resumed run(s) only (after `overrides`).
        before_resume: called with each resumed run's directory just before it is resumed.
            Tests use it to delete the checkpoints there and see the check fail.
    Raises:
        ValueError: what check_before_running refuses (bad step numbers, a config that cannot run
            on --nproc or a resume world size), several world sizes with a checkpoint.dir outside
            run_dir, or `work_dir` already holds runs of an earlier check.
    """
    sizes = [resume_nproc] if isinstance(resume_nproc, int) else list(dict.fromkeys(resume_nproc))
    check_before_running(overrides=overrides, nproc=nproc, resume_nproc=sizes, steps=steps, save_at=save_at,
                         config_dirs=config_dirs, resume_overrides=resume_overrides)
    work = Path(work_dir or tempfile.mkdtemp(prefix="fsdpkit-resume-check-"))
    full = work / "uninterrupted"
    resumed = {m: work / ("resumed" if len(sizes) == 1 else f"resumed-{m}") for m in sizes}
    for run in (full, *resumed.values()):
        if run.exists():  # its metrics.jsonl and checkpoints would mix with this check's
            raise ValueError(f"--work-dir {work} already holds {run.name}/ from an earlier check; give a new "
                             "--work-dir")
    common = [*overrides, f"train.max_steps={steps}", "train.eval_every=0", "train.progress=false",
              "checkpoint.save_at_end=false"]
    dirs = {m: compose_config([*common, f"run_dir={run}"], config_dirs=list(config_dirs)).checkpoint.dir
            for m, run in resumed.items()}
    if any(is_url(d) for d in dirs.values()):
        raise ValueError(f"checkpoint.dir={dirs[sizes[0]]}: resume-check keeps its runs' checkpoints in its local work "
                         "dir; drop the checkpoint.dir override (train with it to check a bucket)")
    roots = {m: Path(d) for m, d in dirs.items()}
    if len(sizes) > 1 and any(not root.resolve().is_relative_to(resumed[m].resolve()) for m, root in roots.items()):
        raise ValueError(f"--resume-nproc {','.join(map(str, sizes))} copies the interrupted run once per world size, "
                         f"which needs checkpoint.dir inside run_dir (it is {roots[sizes[0]]}); check one world size "
                         "at a time, or leave checkpoint.dir at its default")
    changed = f" with {' '.join(resume_overrides)}" if resume_overrides else ""
    print(f"resume-check: {steps} steps on {nproc} rank(s) uninterrupted, then saved at step {save_at}, "
          f"interrupted, resumed on {' and on '.join(map(str, sizes))} rank(s){changed}; work dir {work}", flush=True)
    _train(nproc, [*common, "checkpoint.resume=none", "checkpoint.every_steps=0"], full, list(config_dirs))
    first = resumed[sizes[0]]
    _train(nproc, [*common, "checkpoint.resume=none", f"checkpoint.every_steps={save_at}", f"train.stop_at={save_at}"],
           first, list(config_dirs))
    for m in sizes[1:]:  # before the first resume changes anything in `first`
        shutil.copytree(first, resumed[m], symlinks=True, ignore=shutil.ignore_patterns(".lock"))
    results = []
    for m in sizes:
        if before_resume is not None:
            before_resume(resumed[m])
        _train(m, [*common, *resume_overrides, "checkpoint.resume=auto", "checkpoint.every_steps=0"], resumed[m],
               list(config_dirs))
        rtol = tolerance(overrides, same_world_size=m == nproc and not resume_overrides, config_dirs=list(config_dirs))
        if len(sizes) > 1:
            print(f"resume-check: resumed on {m} rank(s) ({resumed[m]}):")
        results.append(_check(full, resumed[m], roots[m], nproc=nproc, steps=steps, save_at=save_at, rtol=rtol))
    if len(sizes) > 1:
        print(f"resume-check: {sum(results)} of {len(results)} resumed runs passed")
    return 0 if all(results) else 1


def _check(full: Path, resumed: Path, ckpt_root: Path, *, nproc: int, steps: int, save_at: int, rtol: float) -> bool:
    """Prints the proof of the resume and the comparison of one resumed run; True when both hold."""
    problems = resume_problems(read_records(resumed, events=True), step=save_at, saved_world_size=nproc,
                               ckpt_root=ckpt_root)
    if not problems:
        print(f"resume-check: the resumed run loaded the full state of step {save_at} (saved on {nproc} rank(s)) "
              f"from {ckpt_root / step_dir_name(save_at)}")
    a, b = _by_step(full), _by_step(resumed)
    missing = [s for s in range(save_at + 1, steps + 1) if s not in a or s not in b]
    if missing:
        problems.append(f"steps {missing} have no metrics record in {full} or {resumed}")
    worst = _print_table(a, b, range(save_at + 1, steps + 1), rtol=rtol) if not missing else float("inf")
    ok = not problems and worst <= rtol
    if problems:
        print("resume-check: FAIL: no proof of a resume from step "
              f"{save_at}:\n" + "\n".join(f"  {p}" for p in problems))
    print(f"resume-check: {'PASS' if ok else 'FAIL'}: worst relative difference {worst:.3e}, tolerance {rtol:.0e}"
          + ("" if worst <= rtol else " (state was lost or mismapped on resume: scheduler, data cursor, optimizer or "
                                      "RNG)"),
          flush=True)
    return ok


def _print_table(a: dict[int, dict], b: dict[int, dict], steps: range, *, rtol: float) -> float:
    """Prints the per-step comparison; returns the worst relative difference."""
    worst = 0.0
    print(f"{'step':>5} {'loss (uninterrupted)':>22} {'loss (resumed)':>22} {'rel diff':>10} "
          f"{'grad_norm rel diff':>19}")
    for step in steps:
        dl = abs(b[step]["loss"] - a[step]["loss"]) / abs(a[step]["loss"])
        dg = abs(b[step]["grad_norm"] - a[step]["grad_norm"]) / max(abs(a[step]["grad_norm"]), 1e-30)
        worst = max(worst, dl, dg)
        flag = "" if max(dl, dg) <= rtol else "  <-- beyond tolerance"
        print(f"{step:>5} {a[step]['loss']:>22.12f} {b[step]['loss']:>22.12f} {dl:>10.2e} {dg:>19.2e}{flag}")
    return worst
