"""`fsdpkit resume-check`: the user's proof, on their own config, that resuming is seamless.

Runs the config uninterrupted for K steps; runs it again, saving at step S and stopping there as
an interruption would; resumes it (optionally at another world size, or with other settings such
as another sharding strategy) to step K; then prints a per-step table of loss and grad-norm
differences and fails if any exceeds the tolerance: 0 when the resumed run changes nothing (same
world size, no resume overrides) in deterministic mode, else 1e-6 relative in fp32 and 5e-4 in bf16.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from fsdpkit.config import check_world_size, compose_config
from fsdpkit.train.metrics import read_records

ELASTIC_RTOL = {"fp32": 1e-6}
ELASTIC_RTOL_LOW_PRECISION = 5e-4


def _train(nproc: int, overrides: list[str], run_dir: Path, config_dirs: list[str]) -> None:
    cmd = [sys.executable, "-m", "fsdpkit", "train", "--nproc", str(nproc),
           *[f"--config-dir={d}" for d in config_dirs], *overrides, f"run_dir={run_dir}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd[2:])}` failed ({proc.returncode}):\n{proc.stderr[-4000:]}")


def _by_step(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_records(run_dir)}


def tolerance(overrides: list[str], *, same_world_size: bool, config_dirs: list[str]) -> float:
    cfg = compose_config(overrides, config_dirs=config_dirs)
    if same_world_size and cfg.deterministic:
        return 0.0
    return ELASTIC_RTOL.get(cfg.policy.mixed_precision, ELASTIC_RTOL_LOW_PRECISION)


def resume_check(*, overrides: list[str], nproc: int, resume_nproc: int, steps: int, save_at: int,
                 work_dir: Path | None = None, config_dirs: list[str] = (), resume_overrides: list[str] = ()) -> int:
    """Returns the exit code: 0 when every step after the resume is within tolerance.
    `resume_overrides` apply to the resumed run only (after `overrides`)."""
    if not 0 < save_at < steps:
        raise ValueError(f"--save-at must lie between 0 and --steps ({steps}), got {save_at}")
    # The resumed run's config is validated now, not after the first two runs.
    resumed_cfg = compose_config([*overrides, *resume_overrides], config_dirs=list(config_dirs))
    try:
        check_world_size(resumed_cfg, resume_nproc, local_world_size=resume_nproc)
    except ValueError as e:
        hint = (", or resume under another strategy: --resume-overrides strategy.sharding_strategy=FULL_SHARD"
                if resumed_cfg.strategy.sharding_strategy == "HYBRID_SHARD" else "")
        raise ValueError(f"the resumed run on {resume_nproc} rank(s): {e}{hint}") from None
    unchanged = nproc == resume_nproc and not resume_overrides
    rtol = tolerance(overrides, same_world_size=unchanged, config_dirs=list(config_dirs))
    work = Path(work_dir or tempfile.mkdtemp(prefix="fsdpkit-resume-check-"))
    common = [*overrides, f"train.max_steps={steps}", "train.eval_every=0", "train.progress=false",
              "checkpoint.save_at_end=false"]
    full, resumed = work / "uninterrupted", work / "resumed"
    changed = f" with {' '.join(resume_overrides)}" if resume_overrides else ""
    print(f"resume-check: {steps} steps on {nproc} rank(s) uninterrupted, then saved at step {save_at}, "
          f"interrupted, resumed on {resume_nproc} rank(s){changed}; work dir {work}", flush=True)
    _train(nproc, [*common, "checkpoint.resume=none", "checkpoint.every_steps=0"], full, list(config_dirs))
    _train(nproc, [*common, "checkpoint.resume=none", f"checkpoint.every_steps={save_at}", f"train.stop_at={save_at}"],
           resumed, list(config_dirs))
    _train(resume_nproc, [*common, *resume_overrides, "checkpoint.resume=auto", "checkpoint.every_steps=0"], resumed,
           list(config_dirs))
    a, b = _by_step(full), _by_step(resumed)
    worst = 0.0
    print(f"{'step':>5} {'loss (uninterrupted)':>22} {'loss (resumed)':>22} {'rel diff':>10} {'grad_norm rel diff':>19}")
    for step in range(save_at + 1, steps + 1):
        dl = abs(b[step]["loss"] - a[step]["loss"]) / abs(a[step]["loss"])
        dg = abs(b[step]["grad_norm"] - a[step]["grad_norm"]) / max(abs(a[step]["grad_norm"]), 1e-30)
        worst = max(worst, dl, dg)
        flag = "" if max(dl, dg) <= rtol else "  <-- beyond tolerance"
        print(f"{step:>5} {a[step]['loss']:>22.12f} {b[step]['loss']:>22.12f} {dl:>10.2e} {dg:>19.2e}{flag}")
    ok = worst <= rtol
    print(f"resume-check: {'PASS' if ok else 'FAIL'}: worst relative difference {worst:.3e}, tolerance {rtol:.0e}"
          + ("" if ok else " (state was lost or mismapped on resume: scheduler, data cursor, optimizer or RNG)"))
    return 0 if ok else 1
