"""Seeded corruption fuzz: damage a committed checkpoint in every way a disk, a crash or a hand
can, then check what fsdpkit makes of it.

For each mutation of the newest checkpoint (or of `latest`), on a private copy of a run's
checkpoints root:
- `fsdpkit ckpt verify` (verify_checkpoint) must name the damage, or the damage changed nothing;
- auto-resume (resolution + load, as `fsdpkit train` does it, on one rank) must skip the damaged
  checkpoint and take the older one, or refuse with a CheckpointError, or load state identical to
  the undamaged checkpoint's. A load of any other state is a *silent wrong load*; any other
  exception is a *traceback*. Both fail the fuzz.

    python tests/fuzz/corruption.py --run RUN_DIR --count 64 --seed 0 --out report.json -- OVERRIDES...

RUN_DIR holds a finished run with at least two committed checkpoints; OVERRIDES are the ones it was
trained with (the model must be rebuilt the same way).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import shutil
import sys
import tempfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from fsdpkit import dist
from fsdpkit.checkpoint.errors import CheckpointError
from fsdpkit.checkpoint.layout import LATEST, MANIFEST
from fsdpkit.checkpoint.manager import CheckpointGroups
from fsdpkit.checkpoint.resume import committed_candidates
from fsdpkit.checkpoint.save import tensor_table
from fsdpkit.config import compose_config
from fsdpkit.export.verification import verify_checkpoint
from fsdpkit.train.run import attach_checkpointer, build_trainer

Mutation = Callable[[random.Random, Path, Path], str]  # (rng, checkpoint dir, root) -> description


# -- mutations -------------------------------------------------------------------------------------
def _flip_bit(rng: random.Random, path: Path) -> str:
    data = bytearray(path.read_bytes())
    i = rng.randrange(len(data))
    bit = rng.randrange(8)
    data[i] ^= 1 << bit
    path.write_bytes(bytes(data))
    return f"bit {bit} of byte {i}/{len(data)}"


def _truncate(rng: random.Random, path: Path) -> str:
    size = path.stat().st_size
    keep = rng.choice([0, rng.randrange(size), size - rng.randint(1, min(64, size))])
    with path.open("r+b") as f:
        f.truncate(keep)
    return f"truncated to {keep}/{size} bytes"


def _append(rng: random.Random, path: Path) -> str:
    junk = bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
    with path.open("ab") as f:
        f.write(junk)
    return f"{len(junk)} junk bytes appended"


def _shard(rng: random.Random, ckpt: Path) -> Path:
    return rng.choice(sorted(ckpt.glob("*.distcp")))


def shard_flip(rng, ckpt, root):
    p = _shard(rng, ckpt)
    return f"{p.name}: {_flip_bit(rng, p)}"


def shard_truncate(rng, ckpt, root):
    p = _shard(rng, ckpt)
    return f"{p.name}: {_truncate(rng, p)}"


def shard_append(rng, ckpt, root):
    p = _shard(rng, ckpt)
    return f"{p.name}: {_append(rng, p)}"


def shard_delete(rng, ckpt, root):
    p = _shard(rng, ckpt)
    p.unlink()
    return f"{p.name} deleted"


def metadata_flip(rng, ckpt, root):
    return f".metadata: {_flip_bit(rng, ckpt / '.metadata')}"


def metadata_truncate(rng, ckpt, root):
    return f".metadata: {_truncate(rng, ckpt / '.metadata')}"


def metadata_delete(rng, ckpt, root):
    (ckpt / ".metadata").unlink()
    return ".metadata deleted"


def manifest_flip(rng, ckpt, root):
    return f"manifest: {_flip_bit(rng, ckpt / MANIFEST)}"


def manifest_digit(rng, ckpt, root):
    path = ckpt / MANIFEST
    text = path.read_text()
    digits = [i for i, c in enumerate(text) if c.isdigit()]
    i = rng.choice(digits)
    new = rng.choice([d for d in "0123456789" if d != text[i]])
    path.write_text(text[:i] + new + text[i + 1:])
    line = text.count("\n", 0, i) + 1
    return f"manifest: digit {text[i]}->{new} on line {line} ({text.splitlines()[line - 1].strip()[:60]})"


def _leaves(tree: Any, prefix: tuple = ()) -> list[tuple]:
    if isinstance(tree, dict):
        return [leaf for k, v in tree.items() for leaf in _leaves(v, (*prefix, k))] or [prefix]
    if isinstance(tree, list):
        return [leaf for i, v in enumerate(tree) for leaf in _leaves(v, (*prefix, i))] or [prefix]
    return [prefix]


def _changed(rng: random.Random, value: Any) -> Any:
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + rng.choice([-1, 1, 1000])
    if isinstance(value, float):
        return value * rng.choice([0.5, 2.0, -1.0]) + 1e-3
    if isinstance(value, str):
        return value[:-1] + ("0" if not value.endswith("0") else "1") if value else "x"
    return None


def manifest_json_edit(rng, ckpt, root):
    """A valid-JSON edit of one field, as a hand or a careless tool makes it (not resealed)."""
    path = ckpt / MANIFEST
    manifest = json.loads(path.read_text())
    # Weight the fields that change training: trainer state and step are what matter most.
    focus = rng.random() < 0.5
    leaves = _leaves(manifest["trainer"], ("trainer",)) + [("step",)] if focus else _leaves(manifest)
    where = rng.choice(leaves)
    parent = manifest
    for k in where[:-1]:
        parent = parent[k]
    action = rng.choice(["change", "change", "delete"])
    if action == "delete" and isinstance(parent, dict):
        del parent[where[-1]]
        what = "deleted"
    else:
        parent[where[-1]] = _changed(rng, parent[where[-1]])
        what = f"set to {parent[where[-1]]!r:.40}"
    path.write_text(json.dumps(manifest, indent=1))
    return f"manifest: {'.'.join(map(str, where))} {what}"


WRONG_SHAPES = ["[]", "null", "7", '"manifest"', "{}", '{"format": "fsdpkit-checkpoint"}']


def manifest_wrong_shape(rng, ckpt, root):
    path = ckpt / MANIFEST
    manifest = json.loads(path.read_text())
    choice = rng.randrange(len(WRONG_SHAPES) + 6)
    if choice < len(WRONG_SHAPES):
        path.write_text(WRONG_SHAPES[choice])
        return f"manifest replaced by {WRONG_SHAPES[choice]}"
    field = ["files", "step", "tensors", "trainer", "fingerprint", "world_size"][choice - len(WRONG_SHAPES)]
    if rng.random() < 0.5:
        del manifest[field]
        what = "removed"
    else:
        manifest[field] = "oops"
        what = "a string"
    path.write_text(json.dumps(manifest, indent=1))
    return f"manifest: `{field}` {what}"


def manifest_truncate(rng, ckpt, root):
    return f"manifest: {_truncate(rng, ckpt / MANIFEST)}"


def manifest_delete(rng, ckpt, root):
    (ckpt / MANIFEST).unlink()
    return "manifest deleted (the checkpoint is no longer committed)"


def latest_junk(rng, ckpt, root):
    junk = rng.choice([b"", b"\xff\xfe\x00garbage", b"step_999\n", b"../../etc\n", b"step_4\x00\n"])
    (root / LATEST).write_bytes(junk)
    return f"latest = {junk!r}"


MUTATIONS: dict[str, Mutation] = {
    "shard bit flip": shard_flip, "shard truncation": shard_truncate, "shard junk appended": shard_append,
    "shard deleted": shard_delete, ".metadata bit flip": metadata_flip, ".metadata truncation": metadata_truncate,
    ".metadata deleted": metadata_delete, "manifest bit flip": manifest_flip, "manifest digit edit": manifest_digit,
    "manifest valid-JSON edit": manifest_json_edit, "manifest wrong shape": manifest_wrong_shape,
    "manifest truncation": manifest_truncate, "manifest deleted": manifest_delete, "junk latest": latest_junk,
}


# -- the checks -------------------------------------------------------------------------------------
class Resumer:
    """One rank's trainer, rebuilt once; every load overwrites all of its state."""

    def __init__(self, overrides: list[str], work: Path):
        cfg = compose_config([*overrides, f"run_dir={work / 'run'}", "diagnostics.enabled=false",
                              "train.progress=false"])
        self.cfg = cfg
        (work / "run").mkdir()
        self.trainer, plan = build_trainer(cfg, device=torch.device("cpu"), run_dir=work / "run", init=False)
        groups = CheckpointGroups(sync=None, background=None, agreement=None)
        self.checkpointer = attach_checkpointer(self.trainer, cfg, plan, groups=groups)

    def resume(self, root: Path) -> tuple[int | None, Any]:
        """Auto-resume from `root` as `fsdpkit train` does: (step, state signature) or (None, None)."""
        ckpt = self.checkpointer
        ckpt.cfg.dir, ckpt.root, ckpt.resumed = str(root), root, None
        try:
            ckpt.resume()
        finally:
            ckpt.close(wait=False)  # the lock: every mutation is a new run of fsdpkit
        if ckpt.resumed is None:
            return None, None
        return ckpt.resumed["step"], self.signature()

    def signature(self) -> Any:
        target = self.checkpointer.target
        _, tensors = tensor_table(target.tensor_state(rank=0), group=None)
        return {k: v["hash"] for k, v in tensors.items()}, json.dumps(target.json_state(), sort_keys=True)


def classify(kind: str, mutate: Mutation, rng: random.Random, pristine: Path, resumer: Resumer,
             truth: dict[int, Any], newest: int, older: int, work: Path) -> dict[str, Any]:
    root = work / "root"
    shutil.rmtree(root, ignore_errors=True)
    shutil.copytree(pristine, root)
    ckpt = root / f"step_{newest}"
    description = mutate(rng, ckpt, root)
    record: dict[str, Any] = {"kind": kind, "mutation": description}
    target = root if kind == "junk latest" else ckpt
    try:
        report = verify_checkpoint(target)
        record["verify"] = "named" if not report["ok"] else "ok"
        record["verify_problem"] = (report["problems"] or [""])[0][:200]
    except (ValueError, FileNotFoundError, CheckpointError) as e:
        # `fsdpkit ckpt verify` prints these as one-paragraph errors (exit 2): fine if they name the file
        named = (LATEST if kind == "junk latest" else ckpt.name) in str(e) and not isinstance(e, UnicodeDecodeError)
        record["verify"] = "named" if named else f"unclear error: {type(e).__name__}: {e}"[:300]
        record["verify_problem"] = str(e)[:200]
    except Exception as e:  # noqa: BLE001 - a traceback is an outcome here
        record["verify"] = f"traceback: {type(e).__name__}: {e}"[:300]
    try:
        step, signature = resumer.resume(root)
        if step is None:
            record["resume"] = "fresh start"
        elif signature == truth[step] and step == older:
            record["resume"] = "skipped to older"
            record["moved_aside"] = any(p.name.startswith(f"step_{newest}.corrupt-") for p in root.iterdir())
        elif signature == truth[step]:
            record["resume"] = "loaded, unchanged"
        else:
            record["resume"] = f"SILENT WRONG LOAD of step {step}"
    except CheckpointError as e:
        record["resume"] = "refused"
        record["resume_error"] = str(e)[:300]
    except Exception as e:  # noqa: BLE001
        record["resume"] = f"traceback: {type(e).__name__}: {e}"[:300]
    return record


def verdict(record: dict[str, Any]) -> str | None:
    """Why `record` fails the fuzz, or None."""
    resume, verify = record["resume"], record["verify"]
    if resume.startswith(("SILENT", "traceback")) or verify.startswith(("traceback", "unclear")):
        return f"resume: {resume}; verify: {verify}"
    if resume == "fresh start":
        return "auto-resume started fresh although an intact older checkpoint exists"
    if resume == "loaded, unchanged":
        return None  # the damage changed nothing that training reads (e.g. `latest`, see below)
    if verify != "named":
        return f"resume {resume}, but verify reported the damaged checkpoint OK"
    return None


def run_fuzz(run_dir: Path, overrides: list[str], *, count: int, seed: int) -> dict[str, Any]:
    logging.disable(logging.WARNING)  # the skips are the point here; the report says what happened
    pristine = run_dir / "checkpoints"
    steps = sorted(step for _, step in committed_candidates(pristine))
    if len(steps) < 2:
        raise SystemExit(f"{pristine} needs two committed checkpoints, found {steps}")
    older, newest = steps[-2], steps[-1]
    with tempfile.TemporaryDirectory(prefix="fsdpkit-fuzz-") as tmp:
        work = Path(tmp)
        resumer = Resumer(overrides, work)
        truth = {}
        for step in (older, newest):  # what an undamaged load of each gives
            clean = work / f"clean{step}"
            clean.mkdir()
            shutil.copytree(pristine / f"step_{step}", clean / f"step_{step}")
            got, signature = resumer.resume(clean)
            assert got == step, (got, step)
            truth[step] = signature
        rng = random.Random(seed)
        kinds = list(MUTATIONS)
        records = []
        for i in range(count):
            kind = kinds[i % len(kinds)]  # every kind equally often; what it damages is random
            record = classify(kind, MUTATIONS[kind], random.Random(rng.getrandbits(64)), pristine, resumer, truth,
                              newest, older, work)
            record["failure"] = verdict(record)
            records.append(record)
    table: dict[str, Counter] = {}
    for r in records:
        table.setdefault(r["kind"], Counter())[f"verify {r['verify'][:9]} / resume {r['resume'][:16]}"] += 1
    return {"seed": seed, "count": count, "records": records,
            "failures": [r for r in records if r["failure"]],
            "table": {k: dict(v) for k, v in table.items()}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", type=Path, required=True)
    p.add_argument("--count", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    dist.init_process_group(backend="gloo")
    try:
        report = run_fuzz(args.run, args.overrides, count=args.count, seed=args.seed)
    finally:
        dist.shutdown()
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    print(f"{'mutation kind':28} outcomes (seed {args.seed}, {args.count} mutations)")
    for kind, outcomes in report["table"].items():
        print(f"{kind:28} " + "; ".join(f"{n}x {o}" for o, n in sorted(outcomes.items())))
    for r in report["failures"]:
        print(f"FAIL {r['kind']}: {r['mutation']}: {r['failure']}")
    print(f"{len(report['failures'])} failed, {args.count - len(report['failures'])} passed")
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
