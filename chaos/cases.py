"""The chaos cases. Each case is a function (trial index, seeded RNG, context) -> Outcome; CASES lists
them with their trial counts. The issue-10 corruption fuzz and misuse cases plug in as more entries
of CASES (see the slot at the end)."""

from __future__ import annotations

import contextlib
import json
import random
import re
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePath

import psutil
from harness import (
    EXIT_BOUND_S,
    MAX_STEPS,
    TIMEOUTS,
    Job,
    Outcome,
    Reference,
    ckpt_root,
    last_step,
    latest_manifest,
    resumes,
    uncommitted,
)

from faults import env as faults_env
from faults import fired, stall_mid_write

EXIT_PREEMPTED = 75
STALL_S = 3  # a save held this long after its first shard bytes (tests/faults stall_mid_write): a wide window


@dataclass
class Context:
    work: Path
    reference: Reference
    seed: int


def _rerun_exact(ctx: Context, run: Path, out: Outcome, *, expect_resume: int | None) -> Outcome:
    """Run the same command again to the end; it must resume from `expect_resume` (the committed
    checkpoint a rerun should take; None: a fresh start) and end bit-identical to the reference."""
    before = len(resumes(run))
    job = Job(run, tag="rerun")
    rc = job.finish()
    if rc != 0:
        return _fail(out, f"the rerun exited {rc}: {_tail(job)}")
    got = resumes(run)[before:]
    if expect_resume is None and got:
        return _fail(out, f"the rerun resumed from step {got[0]}, expected a fresh start")
    if expect_resume is not None and got != [expect_resume]:
        return _fail(out, f"the rerun resumed from {got or 'nothing'}, expected step {expect_resume}")
    why = ctx.reference.judge(run)
    return _fail(out, why) if why else out


def _fail(out: Outcome, why: str) -> Outcome:
    out.ok, out.detail = False, why
    return out


def _unless_landed(out: Outcome, landed: bool, why: str) -> Outcome:
    """A trial whose fault did not land where its case says is "not exercised": counted apart,
    never as a pass (a failure found on the way still fails it)."""
    if out.ok and not landed:
        out.exercised, out.detail = False, why
    return out


def _tail(job: Job, n: int = 300) -> str:
    return " | ".join(job.stderr()[-n:].splitlines()[-3:])


def _committed_step(run: Path) -> int | None:
    """The step of the newest committed checkpoint (step_N or on_exception): what resume=auto takes."""
    steps = [json.loads((d / "manifest.json").read_text())["step"] for d in ckpt_root(run).glob("*")
             if (d / "manifest.json").is_file()] if ckpt_root(run).is_dir() else []
    return max(steps, default=None)


def _stalled_saves(run: Path) -> tuple[dict[str, str], Path]:
    """(the environment that holds every save of `run` STALL_S seconds after its first shard bytes,
    the marker file where each stall is recorded as it starts)."""
    marker = run.parent / f"{run.name}.faults.jsonl"
    return faults_env(stall_mid_write(seconds=STALL_S), marker=marker), marker


def _wait_in_save(job: Job, *, marker: Path | None = None, rank: int | None = None, since: float = 0.0,
                  timeout: float = 120) -> bool:
    """True once a save is in flight: with `marker` (_stalled_saves), once a new stall started (on `rank`,
    if given: that rank is then held in its shard write, the save uncommitted, for STALL_S); otherwise
    once an uncommitted directory written in since `since` appears."""
    if marker is not None:
        def stalls() -> int:
            return sum(rank is None or f["rank"] == rank for f in fired(marker, "stall_mid_write"))
        before = stalls()
        return job.wait_for(lambda: stalls() > before, timeout=timeout, poll=0.003)
    return job.wait_for(lambda: bool(uncommitted(job.run, since=since)), timeout=timeout, poll=0.003)


def held_in_save(marker: Path, rank: int, *, sent: tuple[float, float]) -> bool:
    """Whether a stall (_stalled_saves) held `rank` in a save's shard write through the whole of `sent`
    (wall-clock times just before and just after a signal went to it): the stall's own record says when
    it started, and a save cannot commit while one of its shard writes is held. The evidence comes from
    the fault, not from the directories the product leaves (or cleans up)."""
    return any(f["time"] <= sent[0] and sent[1] < f["time"] + f["seconds"]
               for f in fired(marker, "stall_mid_write") if f["rank"] == rank)


# -- the whole job SIGKILLed (launcher and every rank, by pid), 1-3 times, then a rerun ----------
def kill_job(mode: str) -> Callable[[int, random.Random, Context], Outcome]:
    def case(trial: int, rng: random.Random, ctx: Context) -> Outcome:
        run = ctx.work / f"kill_job_{mode}_{trial}"
        out = Outcome(case=f"SIGKILL whole job, {mode} saves", trial=trial, seed=ctx.seed, ok=True)
        extra = ["checkpoint.async=true"] if mode == "async" else []
        for _ in range(rng.randint(1, 3)):
            start = last_step(run)
            if start >= MAX_STEPS - 1:
                break
            target = rng.randint(start + 1, MAX_STEPS - 1)
            delay = rng.uniform(0.0, 0.3)
            launched = time.time()
            job = Job(run, *extra, tag="kill")
            job.wait_step(target)
            time.sleep(delay)
            job.kill_all()
            out.kills += 1
            # a save of this job was in flight: it left a directory without a manifest (nothing of the
            # product runs after a SIGKILL to clean it up); older ones are the debris of earlier kills
            out.kills_in_save += bool(uncommitted(run, since=launched))
        out = _rerun_exact(ctx, run, out, expect_resume=_committed_step(run))
        return _unless_landed(out, out.kills > 0, "no kill: the run had already reached its last steps")
    return case


# -- one rank SIGKILLed or SIGSTOPped, mid-step or mid-save: every process gone within the bound ----
def one_rank(sig: int, where: str, mode: str) -> Callable[[int, random.Random, Context], Outcome]:
    def case(trial: int, rng: random.Random, ctx: Context) -> Outcome:
        name = signal.Signals(sig).name
        run = ctx.work / f"one_rank_{name}_{where}_{mode}_{trial}"
        out = Outcome(case=f"{name} rank, {where}, {mode}", trial=trial, seed=ctx.seed, ok=True)
        victim = rng.randint(0, 1)
        extra = ["checkpoint.async=true"] if mode == "async" else []
        # mid-save: every save is held STALL_S in its shard writes, and the victim's own stall record
        # proves the signal landed inside one (a sync save of this model lasts ~0.2 s otherwise)
        env, marker = _stalled_saves(run) if where == "mid-save" else ({}, None)
        launched = time.time()
        job = Job(run, *extra, *TIMEOUTS, env=env)
        job.wait_step(rng.randint(3, 8))
        procs = job.processes()
        rank = job.rank(victim)
        if rank is None:
            job.kill_all()
            return _fail(out, f"rank {victim} not found")
        if marker is not None and not _wait_in_save(job, marker=marker, rank=victim):
            job.kill_all()
            return _fail(out, f"no save started on rank {victim}")
        t0, before = time.monotonic(), time.time()
        rank.send_signal(sig)
        sent = (before, time.time())
        in_save = (held_in_save(marker, victim, sent=sent) if marker is not None
                   else bool(uncommitted(run, since=launched)))  # mid-step: a background save may be in flight
        out.kills, out.kills_in_save = 1, int(in_save)
        gone = job.gone_after(procs, t_signal=t0, timeout=EXIT_BOUND_S)
        if gone is None:
            job.kill_all()
            return _fail(out, f"processes still alive {EXIT_BOUND_S} s after {name} to rank {victim}")
        out.exit_s.append(gone)
        rc = job.finish(timeout=10)
        text = job.stderr()
        if rc in (0, EXIT_PREEMPTED):
            return _fail(out, f"the job exited {rc} after {name} to rank {victim}")
        if sig == signal.SIGSTOP and f"rank {victim} stopped answering" not in text:
            return _fail(out, f"no log line named rank {victim} as stopped: {_tail(job)}")
        if sig == signal.SIGKILL and f"rank {victim} (pid" not in text:
            return _fail(out, f"the launcher did not name rank {victim}: {_tail(job)}")
        out = _rerun_exact(ctx, run, out, expect_resume=_committed_step(run))
        landed = where != "mid-save" or out.kills_in_save > 0
        return _unless_landed(out, landed, f"{name} reached rank {victim} outside its held save ({STALL_S} s "
                                           f"from its stall record)")
    return case


# -- preemption signals -------------------------------------------------------------------------
def preempt(kind: str) -> Callable[[int, random.Random, Context], Outcome]:
    """kind: launcher-SIGTERM, rank-SIGUSR1, rank-SIGTERM, second-signal (a second one during the save)."""
    def case(trial: int, rng: random.Random, ctx: Context) -> Outcome:
        run = ctx.work / f"preempt_{kind}_{trial}"
        out = Outcome(case=f"preemption: {kind}", trial=trial, seed=ctx.seed, ok=True)
        second = kind == "second-signal"
        env, marker = _stalled_saves(run) if second else ({}, None)
        job = Job(run, *(["checkpoint.async=true", "checkpoint.every_steps=0"] if second else []), env=env)
        job.wait_step(rng.randint(3, 10))
        before = _committed_step(run)
        procs = job.processes()
        rank0 = job.rank(0) if second else None
        t0 = time.monotonic()
        if kind == "launcher-SIGTERM" or second:
            job.proc.send_signal(signal.SIGTERM)
        else:
            target = job.rank(rng.randint(0, 1))
            target.send_signal(signal.SIGUSR1 if kind == "rank-SIGUSR1" else signal.SIGTERM)
        out.kills = 1
        if second:
            if rank0 is None or not _wait_in_save(job, marker=marker, rank=0, timeout=60):
                job.kill_all()
                return _fail(out, "the preemption save never started on rank 0")
            t_before = time.time()
            rank0.send_signal(signal.SIGTERM)
            out.kills, out.kills_in_save = 2, int(held_in_save(marker, 0, sent=(t_before, time.time())))
        gone = job.gone_after(procs, t_signal=t0, timeout=EXIT_BOUND_S + 60)
        if gone is None:
            job.kill_all()
            return _fail(out, "processes still alive after the preemption signal")
        out.exit_s.append(gone)
        rc = job.finish(timeout=10)
        after = _committed_step(run)
        if second:
            if out.kills_in_save and (rc in (0, EXIT_PREEMPTED) or after != before):
                return _fail(out, f"a second signal during the save: exit {rc}, latest {before} -> {after} "
                                  "(expected a non-zero exit and latest unchanged)")
        elif rc != EXIT_PREEMPTED or latest_manifest(run).get("reason") != "preempted":
            return _fail(out, f"exit {rc}, latest {after}: expected {EXIT_PREEMPTED} and a preempted checkpoint")
        out = _rerun_exact(ctx, run, out, expect_resume=after)
        held = not second or out.kills_in_save > 0
        return _unless_landed(out, held, f"the second signal reached rank 0 outside its held save ({STALL_S} s "
                                         "from its stall record)")
    return case


# -- disk full: checkpoints on a size-limited tmpfs (a private mount namespace) -------------------
def disk_full(where: str) -> Callable[[int, random.Random, Context], Outcome]:
    """where: shard (the second checkpoint's shards do not fit) or manifest (they fit, its
    manifest does not). Sizes come from the reference run's first checkpoint."""
    def case(trial: int, rng: random.Random, ctx: Context) -> Outcome:
        run = ctx.work / f"disk_full_{where}_{trial}"
        out = Outcome(case=f"disk full in the {where}", trial=trial, seed=ctx.seed, ok=True)
        mnt = ctx.work / f"mnt_{where}_{trial}"
        mnt.mkdir(parents=True, exist_ok=True)
        size = _tmpfs_bytes(ctx.work / "reference" / "checkpoints" / "step_2", where)
        inner = (f"mount -t tmpfs -o size={size} chaos {mnt} && \"$@\"; rc=$?; "
                 f"mkdir -p {run}; cp -a {mnt}/ckpt {ckpt_root(run)} 2>/dev/null; exit $rc")
        job = Job(run, f"checkpoint.dir={mnt}/ckpt", "checkpoint.every_steps=2", *TIMEOUTS,
                  prefix=["unshare", "-m", "sh", "-c", inner, "sh"])
        rc = job.finish(timeout=300)  # its time to exit is not timed: when the disk filled is not observed
        if rc == 0:
            return _fail(out, f"the job finished although its disk was full (tmpfs {size} bytes)")
        landed = where_the_disk_filled(job.stderr())
        if landed is None:
            return _fail(out, f"exit {rc} without naming a file it could not write for want of space: {_tail(job)}")
        out = _rerun_exact(ctx, run, out, expect_resume=_committed_step(run))
        return _unless_landed(out, landed[0] == where, f"the disk filled in {landed[1]} (the {landed[0]}), "
                                                       f"not in the {where}")
    return case


# What the job itself reports when a file does not fit (the evidence of where the disk filled; the
# directory left behind is not: fsdpkit removes a failed save's files to give the space back):
# rank 0's commit names the manifest it could not write (checkpoint/save.py), and fsdpkit's stream
# notes which checkpoint file a failed write, flush or close was writing (checkpoint/hashing.py).
# tests/unit/test_chaos_report.py holds both to the messages the product's own code path produces.
_NO_SPACE = re.compile(r"could not write (?P<commit>[^\n]+?) \(\[Errno 28\]"
                       r"|\[Errno 28\][^\n]*\nfsdpkit: while writing checkpoint file (?P<write>[^\n]+)")


def where_the_disk_filled(text: str) -> tuple[str, str] | None:
    """(where, file) of the first file that `text` (a job's stderr, or an error) reports it could not
    write for want of space: where is "shard" (a *.distcp file), "metadata" (DCP's .metadata),
    "manifest" (manifest.json), or the file's name. None: no such report."""
    found = _NO_SPACE.search(text)
    if found is None:
        return None
    path = found.group("commit") or found.group("write")
    name = PurePath(path).name
    where = ("shard" if name.endswith(".distcp") else "metadata" if name in (".metadata", ".metadata.tmp")
             else "manifest" if name == "manifest.json" else name)
    return where, path


def _tmpfs_bytes(first: Path, where: str) -> int:
    page = 4096

    def pages(p: Path) -> int:
        return -(-p.stat().st_size // page)

    files = [p for p in first.iterdir() if p.is_file()]
    manifest = first / "manifest.json"
    data = sum(pages(p) for p in files if p != manifest)
    one = data + pages(manifest) + 2  # + latest and its temporary file
    if where == "shard":
        return (one + data // 2) * page
    return (one + data + max(1, pages(manifest) // 2)) * page


def _stopped_run(ctx: Context, name: str, rng: random.Random) -> tuple[Path, int, str | None]:
    """A run stopped at a random even step (committed checkpoints there and 2 steps before):
    (run, stop, why it failed or None)."""
    run = ctx.work / name
    stop = rng.choice(range(4, MAX_STEPS - 2, 2))
    job = Job(run, f"train.stop_at={stop}")
    rc = job.finish()
    return run, stop, None if rc == 0 else f"the first run exited {rc}: {_tail(job)}"


# -- a corrupted checkpoint: the rerun must refuse it and resume from the one before --------------
def corrupt(kind: str) -> Callable[[int, random.Random, Context], Outcome]:
    """kind: bitflip (one bit of one shard) or truncate (a shard cut short)."""
    def case(trial: int, rng: random.Random, ctx: Context) -> Outcome:
        out = Outcome(case=f"corrupt shard: {kind}", trial=trial, seed=ctx.seed, ok=True)
        run, stop, failed = _stopped_run(ctx, f"corrupt_{kind}_{trial}", rng)
        if failed:
            return _fail(out, failed)
        victim = ckpt_root(run) / f"step_{stop}"
        shards = sorted(victim.glob("*.distcp"))
        shard = rng.choice(shards)
        size = shard.stat().st_size
        with shard.open("r+b") as f:
            if kind == "bitflip":
                pos = rng.randrange(size)
                f.seek(pos)
                byte = f.read(1)[0]
                f.seek(pos)
                f.write(bytes([byte ^ (1 << rng.randrange(8))]))
            else:
                f.truncate(rng.randrange(size))
        return _rerun_exact(ctx, run, out, expect_resume=stop - 2)
    return case


# -- issue 10's corruption fuzz and misuse, end to end through `fsdpkit train` -----------------------
def fuzz(kind: str) -> Callable[[int, random.Random, Context], Outcome]:
    """One mutation of tests/fuzz/corruption.py (every file kind: bit flips, digit and valid-JSON edits
    of the manifest, truncations, deletions, wrong-shaped JSON, junk `latest`) applied to the newest
    checkpoint of a stopped run; the rerun must skip it, resume from the one before (or, for `latest`,
    which resolution does not trust, from the newest) and end bit-identical."""
    def case(trial: int, rng: random.Random, ctx: Context) -> Outcome:
        from corruption import MUTATIONS  # tests/fuzz, on the path (see run.py)

        out = Outcome(case=f"fuzz: {kind}", trial=trial, seed=ctx.seed, ok=True)
        run, stop, failed = _stopped_run(ctx, f"fuzz_{kind.replace(' ', '_')}_{trial}", rng)
        if failed:
            return _fail(out, failed)
        _, what = MUTATIONS[kind](rng, ckpt_root(run) / f"step_{stop}", ckpt_root(run))
        out.detail = what
        done = _rerun_exact(ctx, run, out, expect_resume=stop if kind == "junk latest" else stop - 2)
        if done.ok and kind != "junk latest" and kind != "manifest deleted":
            if not list(ckpt_root(run).glob(f"step_{stop}.corrupt-*")):
                return _fail(out, f"{what}: the damaged step_{stop} was not moved aside")
        return done
    return case


def reuse_dir(trial: int, rng: random.Random, ctx: Context) -> Outcome:
    """A new run over a finished run's directory: refused (exit 2, nothing touched); with
    checkpoint.existing=archive the old checkpoints move to archive/ intact and the new run trains."""
    run = ctx.work / f"reuse_{trial}"
    out = Outcome(case="misuse: a new run reuses a directory", trial=trial, seed=ctx.seed, ok=True)
    first = Job(run, "train.stop_at=6")
    if (rc := first.finish()) != 0:
        return _fail(out, f"the first run exited {rc}: {_tail(first)}")
    before = sorted(p.name for p in ckpt_root(run).iterdir())
    refused = Job(run, "checkpoint.resume=none", tag="refused")
    if (rc := refused.finish()) != 2 or "holds committed checkpoints of another run" not in refused.stderr():
        return _fail(out, f"a new run over another run's checkpoints exited {rc}: {_tail(refused)}")
    if sorted(p.name for p in ckpt_root(run).iterdir()) != before:
        return _fail(out, "the refused run changed the checkpoint directory")
    archived = Job(run, "checkpoint.resume=none", "checkpoint.existing=archive", tag="archived")
    if (rc := archived.finish()) != 0:
        return _fail(out, f"checkpoint.existing=archive exited {rc}: {_tail(archived)}")
    kept = sorted(p.name for p in (ckpt_root(run) / "archive").glob("*/step_*"))
    if kept != sorted(n for n in before if n.startswith("step_")):
        return _fail(out, f"archive holds {kept}, expected {before}")
    return out


# -- elastic restarts: `fsdpkit train --nproc 2 --max-restarts 2`, one rank SIGKILLed 1-2 times ----
def restart(trial: int, rng: random.Random, ctx: Context) -> Outcome:
    mode = rng.choice(["sync", "async"])
    where = rng.choice(["mid-step", "mid-save"])
    kills = rng.choice([1, 2])
    run = ctx.work / f"restart_{trial}"
    out = Outcome(case="elastic restart", trial=trial, seed=ctx.seed, ok=True)
    extra = ["checkpoint.async=true"] if mode == "async" else []
    job = Job(run, *extra, *TIMEOUTS, extra=("--max-restarts", "2"))
    victims = []
    since = time.time()  # the directories of this attempt's saves are written in after this
    for _ in range(kills):
        if not job.wait_step(min(MAX_STEPS - 4, max(4, last_step(run) + rng.randint(2, 6))), timeout=300):
            break
        if where == "mid-save":
            _wait_in_save(job, since=since, timeout=30)
        victim = rng.randint(0, 1)
        rank = job.rank(victim)
        if rank is None:
            break
        with contextlib.suppress(psutil.Error):
            rank.kill()
        victims.append(victim)
        out.kills += 1
        out.kills_in_save += bool(uncommitted(run, since=since))  # after the kill: a save that committed is not counted
        n = len(resumes(run))
        job.wait_for(lambda n=n: len(resumes(run)) > n, timeout=300)  # the restarted ranks resumed
        since = time.time()  # every rank of the killed attempt is gone: what it left is debris from now on
    rc = job.finish(timeout=600)
    out.restarts = job.stderr().count("resolved config (also in") - 1  # rank 0 logs it once per attempt
    out.case = f"elastic restart ({mode}, {where}, {kills} kill(s))"
    if rc != 0:
        return _fail(out, f"exit {rc} after killing rank(s) {victims}: {_tail(job)}")
    if out.restarts != out.kills:
        return _fail(out, f"{out.kills} kill(s) but {out.restarts} restart(s)")
    why = ctx.reference.judge(run)
    return _fail(out, why) if why else out


Case = Callable[[int, random.Random, Context], Outcome]


def cases(scale: float) -> list[tuple[str, int, Case]]:
    """(name, trials, case). `scale` multiplies the trial counts of the repeated cases (1.0 = the
    full suite; a quick run uses e.g. 0.1, at least one trial each)."""
    def n(full: int) -> int:
        return max(1, round(full * scale))

    out: list[tuple[str, int, Case]] = [
        ("kill-job-sync", n(25), kill_job("sync")),
        ("kill-job-async", n(25), kill_job("async")),
    ]
    for sig in (signal.SIGKILL, signal.SIGSTOP):
        for where in ("mid-step", "mid-save"):
            for mode in ("sync", "async"):
                out.append((f"one-rank-{sig.name}-{where}-{mode}", 1, one_rank(sig, where, mode)))
    for kind in ("launcher-SIGTERM", "rank-SIGUSR1", "rank-SIGTERM", "second-signal"):
        out.append((f"preempt-{kind}", 1, preempt(kind)))
    for where in ("shard", "manifest"):
        out.append((f"disk-full-{where}", 1, disk_full(where)))
    for kind in ("bitflip", "truncate"):
        out.append((f"corrupt-{kind}", 1, corrupt(kind)))
    from corruption import MUTATIONS  # tests/fuzz (run.py puts it on the path)

    for kind in MUTATIONS:  # issue 10's corruption fuzz, end to end
        out.append((f"fuzz-{kind.replace(' ', '-')}", n(2), fuzz(kind)))
    out.append(("misuse-reuse-dir", 1, reuse_dir))
    out.append(("elastic-restart", n(20), restart))
    return out
