"""Seeded corruption fuzz: damage a committed checkpoint in every way a disk, a crash or a hand
can, then check what fsdpkit makes of it.

For each mutation of the newest checkpoint (or of `latest`), on a private copy of a run's
checkpoints root:
- `fsdpkit ckpt verify` (verify_checkpoint) must name the damage — blame the damaged file and say
  its name in what it prints (a problem text or an error message) — or the damage changed nothing;
  blaming only other files, or an error that does not name the damaged file, fails;
- auto-resume (resolution + load, as `fsdpkit train` does it, on one rank) must skip the damaged
  checkpoint with a warning that names the damaged file (a deleted manifest excepted: that is an
  uncommitted directory, skipped quietly by design) and take the older one, or refuse with a
  CheckpointError that names the damaged file, or load state identical to the undamaged
  checkpoint's. A load of any other state is a *silent
  wrong load*; any other exception is a *traceback*. Both fail the fuzz.

"Identical" is judged without fsdpkit's checksums (the very thing that guards the load): every
model, optimizer (state and param groups), RNG and Stateful item is compared, with torch.equal or
==, against an independent copy of the undamaged checkpoint read by torch's own DCP reader
(`dcp_to_torch_save`), and the restored trainer state against the undamaged manifest's JSON.

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
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.tensor import DTensor

from fsdpkit import dist
from fsdpkit.checkpoint.errors import CheckpointError
from fsdpkit.checkpoint.layout import LATEST, MANIFEST
from fsdpkit.checkpoint.manager import CheckpointGroups
from fsdpkit.checkpoint.resolve import committed_candidates
from fsdpkit.config import compose_config
from fsdpkit.export.verification import verify_checkpoint
from fsdpkit.log import LOGGER_NAME
from fsdpkit.train.run import attach_checkpointer, build_trainer

METADATA = ".metadata"  # DCP's index file
Mutation = Callable[[random.Random, Path, Path], tuple[str, str]]
"""(rng, checkpoint dir, root) -> (the damaged file's name: in the checkpoint directory, or `latest`
in the root; what was done to it)."""


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
    return p.name, f"{p.name}: {_flip_bit(rng, p)}"


def shard_truncate(rng, ckpt, root):
    p = _shard(rng, ckpt)
    return p.name, f"{p.name}: {_truncate(rng, p)}"


def shard_append(rng, ckpt, root):
    p = _shard(rng, ckpt)
    return p.name, f"{p.name}: {_append(rng, p)}"


def shard_delete(rng, ckpt, root):
    p = _shard(rng, ckpt)
    p.unlink()
    return p.name, f"{p.name} deleted"


def metadata_flip(rng, ckpt, root):
    return METADATA, f".metadata: {_flip_bit(rng, ckpt / METADATA)}"


def metadata_truncate(rng, ckpt, root):
    return METADATA, f".metadata: {_truncate(rng, ckpt / METADATA)}"


def metadata_delete(rng, ckpt, root):
    (ckpt / METADATA).unlink()
    return METADATA, ".metadata deleted"


def manifest_flip(rng, ckpt, root):
    return MANIFEST, f"manifest: {_flip_bit(rng, ckpt / MANIFEST)}"


def manifest_digit(rng, ckpt, root):
    path = ckpt / MANIFEST
    text = path.read_text()
    digits = [i for i, c in enumerate(text) if c.isdigit()]
    i = rng.choice(digits)
    new = rng.choice([d for d in "0123456789" if d != text[i]])
    path.write_text(text[:i] + new + text[i + 1:])
    line = text.count("\n", 0, i) + 1
    return MANIFEST, f"manifest: digit {text[i]}->{new} on line {line} ({text.splitlines()[line - 1].strip()[:60]})"


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
    return MANIFEST, f"manifest: {'.'.join(map(str, where))} {what}"


WRONG_SHAPES = ["[]", "null", "7", '"manifest"', "{}", '{"format": "fsdpkit-checkpoint"}']


def manifest_wrong_shape(rng, ckpt, root):
    path = ckpt / MANIFEST
    manifest = json.loads(path.read_text())
    choice = rng.randrange(len(WRONG_SHAPES) + 6)
    if choice < len(WRONG_SHAPES):
        path.write_text(WRONG_SHAPES[choice])
        return MANIFEST, f"manifest replaced by {WRONG_SHAPES[choice]}"
    field = ["files", "step", "tensors", "trainer", "fingerprint", "world_size"][choice - len(WRONG_SHAPES)]
    if rng.random() < 0.5:
        del manifest[field]
        what = "removed"
    else:
        manifest[field] = "oops"
        what = "a string"
    path.write_text(json.dumps(manifest, indent=1))
    return MANIFEST, f"manifest: `{field}` {what}"


def manifest_truncate(rng, ckpt, root):
    return MANIFEST, f"manifest: {_truncate(rng, ckpt / MANIFEST)}"


def manifest_delete(rng, ckpt, root):
    (ckpt / MANIFEST).unlink()
    return MANIFEST, "manifest deleted (the checkpoint is no longer committed)"


def latest_junk(rng, ckpt, root):
    junk = rng.choice([b"", b"\xff\xfe\x00garbage", b"step_999\n", b"../../etc\n", b"step_4\x00\n"])
    (root / LATEST).write_bytes(junk)
    return LATEST, f"latest = {junk!r}"


MUTATIONS: dict[str, Mutation] = {
    "shard bit flip": shard_flip, "shard truncation": shard_truncate, "shard junk appended": shard_append,
    "shard deleted": shard_delete, ".metadata bit flip": metadata_flip, ".metadata truncation": metadata_truncate,
    ".metadata deleted": metadata_delete, "manifest bit flip": manifest_flip, "manifest digit edit": manifest_digit,
    "manifest valid-JSON edit": manifest_json_edit, "manifest wrong shape": manifest_wrong_shape,
    "manifest truncation": manifest_truncate, "manifest deleted": manifest_delete, "junk latest": latest_junk,
}


# -- the checks -------------------------------------------------------------------------------------
def flat_state(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts to DCP's dotted keys (lists are leaves: param_groups)."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(flat_state(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def independent_copy(ckpt: Path, work: Path) -> dict[str, Any]:
    """What the undamaged `ckpt` holds, read without fsdpkit: every item by torch's own DCP reader
    (format_utils.dcp_to_torch_save; no fsdpkit reader, no checksum), and the manifest's trainer
    state as plain JSON. {"state": {DCP key: value} (RNG: rank 0's only, the one a 1-rank
    resume restores), "trainer": {...}}."""
    out = work / f"independent_{ckpt.name}.pt"
    dcp_to_torch_save(ckpt, out)
    state = flat_state(torch.load(out, weights_only=True))
    out.unlink()
    return {"state": {k: v for k, v in state.items() if not k.startswith("rng.") or k.startswith("rng.rank0.")},
            "trainer": json.loads((ckpt / MANIFEST).read_text())["trainer"]}


def differences(live: dict[str, Any], truth: dict[str, Any]) -> list[str]:
    """Where the live state differs from an independent copy: tensors by torch.equal (with dtype and
    shape), everything else by ==; empty when they are the same."""
    a, b = live["state"], truth["state"]
    found = [f"{k}: missing after the load" for k in sorted(b.keys() - a.keys())]
    found += [f"{k}: loaded, not in the checkpoint" for k in sorted(a.keys() - b.keys())]
    for k in sorted(a.keys() & b.keys()):
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            same = (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dtype == y.dtype
                    and x.shape == y.shape and torch.equal(x, y))
        else:
            same = x == y
        if not same:
            found.append(f"{k}: differs")
    if live["trainer"] != truth["trainer"]:
        found.append("trainer state (JSON) differs")
    return found


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

    def resume(self, root: Path) -> tuple[int | None, dict[str, Any] | None]:
        """Auto-resume from `root` as `fsdpkit train` does: (step, live state) or (None, None)."""
        ckpt = self.checkpointer
        ckpt.cfg.dir, ckpt.root, ckpt.resumed = str(root), root, None
        try:
            ckpt.resume()
        finally:
            ckpt.close(wait=False)  # the lock: every mutation is a new run of fsdpkit
        if ckpt.resumed is None:
            return None, None
        return ckpt.resumed.step, self.live_state()

    def live_state(self) -> dict[str, Any]:
        """Everything the load restored, as `independent_copy` has it: model, optimizer (state and
        param groups), this rank's RNG, Stateful tensors (gathered whole), and the trainer JSON."""
        target = self.checkpointer.target
        state = flat_state(target.tensor_state(rank=0))
        state = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in state.items()}
        return {"state": state, "trainer": json.loads(json.dumps(target.json_state()))}


def names(damaged: str, texts: list[str]) -> bool:
    return any(damaged in text for text in texts)


class Warnings(logging.Handler):
    """fsdpkit's warnings (what a user reads when auto-resume skips a checkpoint), kept, not shown."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    @classmethod
    def install(cls) -> Warnings:
        handler, logger = cls(), logging.getLogger(LOGGER_NAME)
        logger.handlers[:] = [handler]
        logger.propagate = False
        return handler


def classify(kind: str, mutate: Mutation, rng: random.Random, pristine: Path, resumer: Resumer,
             truth: dict[int, Any], newest: int, older: int, work: Path, warnings: Warnings) -> dict[str, Any]:
    root = work / "root"
    shutil.rmtree(root, ignore_errors=True)
    shutil.copytree(pristine, root)
    ckpt = root / f"step_{newest}"
    damaged, description = mutate(rng, ckpt, root)
    record: dict[str, Any] = {"kind": kind, "mutation": description, "damaged": damaged}
    target = root if kind == "junk latest" else ckpt
    try:
        report = verify_checkpoint(target)
        if report["ok"]:
            record["verify"] = "ok"
        elif damaged in report["bad_files"] and names(damaged, report["problems"]):
            record["verify"] = "named"  # the damaged file is blamed, and the text the user reads says so
        else:
            record["verify"] = f"misnamed: blamed {report['bad_files']}, not {damaged}"
        record["verify_problem"] = (report["problems"] or [""])[0][:200]
    except (ValueError, FileNotFoundError, CheckpointError) as e:
        # `fsdpkit ckpt verify` prints these as one-paragraph errors (exit 2): fine if they name the file
        named = names(damaged, [str(e)]) and not isinstance(e, UnicodeDecodeError)
        record["verify"] = "named" if named else f"unclear error: {type(e).__name__}: {e}"[:300]
        record["verify_problem"] = str(e)[:200]
    except Exception as e:  # noqa: BLE001 - a traceback is an outcome here
        record["verify"] = f"traceback: {type(e).__name__}: {e}"[:300]
    warnings.messages.clear()
    try:
        step, live = resumer.resume(root)
        wrong = differences(live, truth[step]) if step in truth else None
        if step is None:
            record["resume"] = "fresh start"
        elif wrong == [] and step == older:
            quiet = kind == "manifest deleted"  # no manifest: never committed, skipped without a warning
            record["resume"] = ("skipped to older" if quiet or names(damaged, warnings.messages)
                                else f"skipped to older without naming {damaged}")
            record["resume_warning"] = " | ".join(warnings.messages)[:300]
            record["moved_aside"] = any(p.name.startswith(f"step_{newest}.corrupt-") for p in root.iterdir())
        elif wrong == []:
            record["resume"] = "loaded, unchanged"
        else:
            record["resume"] = f"SILENT WRONG LOAD of step {step}: " + "; ".join((wrong or ["no such step"])[:3])
    except CheckpointError as e:
        named = names(damaged, [str(e)])
        record["resume"] = "refused" if named else f"refused without naming {damaged}"
        record["resume_error"] = str(e)[:300]
    except Exception as e:  # noqa: BLE001
        record["resume"] = f"traceback: {type(e).__name__}: {e}"[:300]
    return record


def verdict(record: dict[str, Any]) -> str | None:
    """Why `record` fails the fuzz, or None."""
    resume, verify = record["resume"], record["verify"]
    if (resume.startswith(("SILENT", "traceback",
                           "refused without")) or resume.endswith("without naming " + record["damaged"])
            or verify.startswith(("traceback", "unclear", "misnamed"))):
        return f"resume: {resume}; verify: {verify}"
    if resume == "fresh start":
        return "auto-resume started fresh although an intact older checkpoint exists"
    if resume == "loaded, unchanged":
        return None  # the damage changed nothing that training reads (e.g. `latest`, see below)
    if verify != "named":
        return f"resume {resume}, but verify reported the damaged checkpoint OK"
    return None


def run_fuzz(run_dir: Path, overrides: list[str], *, count: int, seed: int) -> dict[str, Any]:
    warnings = Warnings.install()  # the skips are the point here; the report says what happened
    pristine = run_dir / "checkpoints"
    steps = sorted(step for _, step in committed_candidates(pristine))
    if len(steps) < 2:
        raise SystemExit(f"{pristine} needs two committed checkpoints, found {steps}")
    older, newest = steps[-2], steps[-1]
    with tempfile.TemporaryDirectory(prefix="fsdpkit-fuzz-") as tmp:
        work = Path(tmp)
        resumer = Resumer(overrides, work)
        truth = {step: independent_copy(pristine / f"step_{step}", work) for step in (older, newest)}
        rng = random.Random(seed)
        kinds = list(MUTATIONS)
        records = []
        for i in range(count):
            kind = kinds[i % len(kinds)]  # every kind equally often; what it damages is random
            record = classify(kind, MUTATIONS[kind], random.Random(rng.getrandbits(64)), pristine, resumer, truth,
                              newest, older, work, warnings)
            record["failure"] = verdict(record)
            records.append(record)
    table: dict[str, Counter] = {}
    for r in records:
        table.setdefault(r["kind"], Counter())[f"verify {r['verify'][:9]} / resume {r['resume'][:32]}"] += 1
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
