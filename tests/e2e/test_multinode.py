"""Two nodes on one host: two torchrun launchers joined through a c10d rendezvous on loopback run
`fsdpkit train` with HYBRID_SHARD 2x2 (replicate across the nodes, shard within each), and match
the single-process reference. (FULL_SHARD on 4 ranks of one launcher matches the same reference in
tests/multirank/test_training.py.)"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fsdpkit.cli.main import main  # noqa: E402
from fsdpkit.config import compose_config  # noqa: E402
from fsdpkit.train.metrics import read_records  # noqa: E402
from nodes import run_nodes  # noqa: E402
from reference import reference_run  # noqa: E402

pytestmark = pytest.mark.e2e
RTOL = 1e-6
# fp32, deterministic; global batch 16 = 4 ranks x 2 micro-batches of 2: gradient accumulation is on.
ARGS = ["deterministic=true", "train.max_steps=10", "train.global_batch_size=16", "train.micro_batch_size=2",
        "train.grad_clip=0.5", "train.eval_samples=20", "train.progress=false", "optim.warmup_steps=3",
        "model.vocab_size=1001"]
HSDP_2X2 = ["strategy.sharding_strategy=HYBRID_SHARD", "strategy.hsdp_shard_size=2"]


def max_rel(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) and a
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def test_two_launchers_hsdp_2x2_match_the_reference(tmp_path):
    hsdp = tmp_path / "hsdp"
    nodes = run_nodes([*ARGS, *HSDP_2X2, f"run_dir={hsdp}"], logs=tmp_path / "logs")

    # The two launchers formed one world of 4 with a (replicate=2, shard=2) mesh.
    logs = "".join(n.stderr() for n in nodes)
    assert "world size 4" in logs
    assert "mesh (2, 2) ('replicate', 'shard'), placements Replicate(), Shard(dim=0): HYBRID_SHARD" in logs
    manifest = json.loads((hsdp / "checkpoints" / "step_10" / "manifest.json").read_text())
    assert manifest["world_size"] == 4 and manifest["mesh"] == {"shape": [2, 2], "dim_names": ["replicate", "shard"]}

    ref = reference_run(compose_config(ARGS))
    a = read_records(hsdp)
    assert [r["step"] for r in a] == list(range(1, 11))
    for key in ("loss", "grad_norm"):
        assert max_rel([r[key] for r in a], ref[key]) < RTOL, key
    assert abs(a[-1]["val_loss"] - ref["val_loss"]) / ref["val_loss"] < RTOL
    assert min(ref["grad_norm"]) > 0.5  # clipping (grad_clip=0.5) was active


def test_resume_check_validates_the_resumed_mesh_before_running_anything(tmp_path, capsys):
    # HSDP 2x2 cannot run on 3 ranks: the error comes at once and names the way out.
    common = ["resume-check", "--nproc", "4", "--resume-nproc", "3", *HSDP_2X2, "train.global_batch_size=12",
              "train.micro_batch_size=1", "--work-dir", str(tmp_path)]
    assert main(common) == 2
    err = capsys.readouterr().err
    assert ("the resumed run on 3 rank(s): strategy.hsdp_shard_size=2 does not divide the world size 3" in err
            and "--resume-overrides strategy.sharding_strategy=FULL_SHARD" in err), err
    # The overrides reach the resumed run's config (here a bad value, so that nothing runs).
    assert main([*common, "--resume-overrides", "strategy.sharding_strategy=FULL_SHARD train.global_batch_size=2"]) == 2
    assert "the resumed run on 3 rank(s): train.global_batch_size=2 is smaller than the world size" in \
        capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # no run was started
