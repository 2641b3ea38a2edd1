"""The `fsdpkit` command."""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
import time
import traceback
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from fsdpkit import tunables
from fsdpkit.checkpoint.errors import CheckpointError
from fsdpkit.checkpoint.preemption import EXIT_PREEMPTED
from fsdpkit.cli import ckpt as ckpt_cli
from fsdpkit.cli import plot as plot_cli

if TYPE_CHECKING:
    from fsdpkit.config import Config

ECHO_GRACE_S = 3.0  # how long other ranks wait before exiting on an error rank 0 reports
TRAIN_HELP = """\
Train with FSDP2. Overrides use Hydra syntax: key=value, +key=value (add), ++key=value (add or
override), ~key (delete: the schema default applies), experiment=[a,b] (compose experiment files
in order). The config is validated before any process starts.

exit codes: 0 trained to train.max_steps (or train.stop_at); 75 stopped by a preemption signal
after committing a checkpoint (run the same command to resume); 1 training failed; 2 a clear
error (a setting, a path, a checkpoint refused or not found, a save that failed: the message says
which and what to do).

examples:
  fsdpkit train experiment=demo
  fsdpkit train --nproc 4 experiment=[demo,bf16] train.max_steps=20
  fsdpkit train --nproc 2 --max-restarts 3 experiment=demo   # a failed rank: restart and resume
  torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
      -m fsdpkit train model=llama_1b experiment=bf16
"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fsdpkit", description="Train large models with FSDP2; trust every checkpoint.")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train a model", description=TRAIN_HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    t.add_argument("--nproc", type=int, default=None, metavar="N",
                   help="launch N local ranks through torch's elastic launcher (torchrun --standalone)")
    t.add_argument("--max-restarts", type=int, default=0, metavar="K",
                   help="with --nproc: when a rank fails, restart every rank up to K times; each restart "
                        "resumes from the newest committed checkpoint (torchrun --max-restarts)")
    t.add_argument("--config-dir", action="append", default=[], metavar="DIR",
                   help="extra directory searched for config groups (your own experiment/*.yaml); repeatable")
    t.add_argument("overrides", nargs="*", help="Hydra overrides")
    r = sub.add_parser("resume-check", help="prove that resuming your config is seamless",
                       description="Run the config uninterrupted, then saved at --save-at, interrupted and resumed "
                                   "(optionally on --resume-nproc ranks, with --resume-overrides); check from the "
                                   "resumed run's own records (the resume event in metrics.jsonl) that it loaded the "
                                   "full state of step --save-at saved on --nproc ranks; print per-step loss and "
                                   "grad-norm differences. Exit 1 if no such resume is recorded or any difference "
                                   "exceeds the tolerance (0 when the resumed run changes nothing, with "
                                   "deterministic=true; else 1e-6 relative when policy.mixed_precision keeps every "
                                   "dtype fp32, 5e-4 otherwise, custom _target_ policies included).")
    r.add_argument("--nproc", type=int, default=2, help="ranks of the uninterrupted and first run (default 2)")
    r.add_argument("--resume-nproc", type=_world_sizes, default=None, metavar="M[,M...]",
                   help="ranks of the resumed run (default: --nproc); several, e.g. 2,3, resume copies of the same "
                        "interrupted run once per world size and check each")
    r.add_argument("--resume-overrides", action="append", default=[], metavar="OVERRIDES",
                   help="Hydra overrides for the resumed run only, space-separated, e.g. "
                        "'strategy.sharding_strategy=FULL_SHARD' to resume an HSDP checkpoint under FULL_SHARD; "
                        "repeatable")
    r.add_argument("--steps", type=int, default=12, help="steps K of each run (default 12)")
    r.add_argument("--save-at", type=int, default=6, help="step S of the save and interruption (default 6)")
    r.add_argument("--work-dir", default=None,
                   help="where the three runs go; must not hold an earlier check's runs (default: a new temporary "
                        "directory)")
    r.add_argument("--config-dir", action="append", default=[], metavar="DIR")
    r.add_argument("overrides", nargs="*", help="Hydra overrides of your config")
    c = sub.add_parser("config", help="show the resolved config or document every option")
    c.add_argument("action", choices=["show", "docs"],
                   help="show: print the resolved config; docs: every key, type, default and meaning")
    c.add_argument("--config-dir", action="append", default=[], metavar="DIR")
    c.add_argument("--markdown", action="store_true",
                   help="docs: print a markdown table (what the docs' config reference holds)")
    c.add_argument("overrides", nargs="*", help="Hydra overrides (for show)")
    ckpt_cli.add_parser(sub)
    plot_cli.add_parser(sub)
    return p


def _train(args: argparse.Namespace) -> int:
    from fsdpkit.config import check_world_size, compose_config

    cfg = compose_config(args.overrides, config_dirs=args.config_dir)
    if args.nproc is not None:
        if args.nproc < 1:
            raise ValueError(f"--nproc must be at least 1, got {args.nproc}")
        if args.max_restarts < 0:
            raise ValueError(f"--max-restarts must be at least 0, got {args.max_restarts}")
        check_world_size(cfg, args.nproc, local_world_size=args.nproc)
        from fsdpkit.train.preflight import check_directories, check_packing

        check_directories(cfg)  # one message from the launcher, before any rank starts
        check_packing(cfg)
        return _launch_local(args, cfg)
    if args.max_restarts:
        raise ValueError("--max-restarts needs --nproc N (under torchrun, pass torchrun's own --max-restarts)")
    from fsdpkit.train.run import run

    summary = run(cfg)
    return EXIT_PREEMPTED if summary.get("stopped_by") else 0


def _launch_local(args: argparse.Namespace, cfg: Config) -> int:
    """Re-run this command as N local ranks under torch.distributed.run (elastic)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    child = ["-m", "fsdpkit", "train"] + [f"--config-dir={d}" for d in args.config_dir] + list(args.overrides)
    # The launcher forwards these to every rank (SIGUSR1 too: SLURM's --signal often sends it).
    preemption = [n if n.startswith("SIG") else f"SIG{n}" for n in cfg.checkpoint.preemption_signals]
    forwarded = ",".join(dict.fromkeys(["SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", *preemption]))
    launcher_args = get_args_parser().parse_args(["--standalone", f"--nproc-per-node={args.nproc}",
                                                  f"--max-restarts={args.max_restarts}",
                                                  f"--signals-to-handle={forwarded}", *child])
    started = datetime.now(UTC)
    try:
        run(launcher_args)
    except ChildFailedError as e:
        if any(f.exitcode == EXIT_PREEMPTED for f in e.failures.values()):
            return _preempted(cfg, "a preemption signal reached the ranks", since=started)
        from fsdpkit.cli.failures import describe_failures, order_failures, rerun_takes

        first_rank, first = order_failures(e.failures)[0]
        if first.exitcode == 2:
            # a clear error (a setting, a path, a checkpoint), printed above; the others stopped on it too
            # or were stopped by the launcher
            print(f"fsdpkit train: rank {first_rank} stopped with the error above (exit 2)", file=sys.stderr)
            return 2
        for line in [*describe_failures(e.failures, world_size=args.nproc), rerun_takes(cfg)]:
            print(f"fsdpkit train: {line}", file=sys.stderr)
        return 1
    except SignalException as e:  # the launcher itself was signalled; it passed the signal to the ranks
        return _preempted(cfg, f"the launcher received {e.sigval.name}", since=started, otherwise=128 + e.sigval.value)
    return 0


def _preempted(cfg: Config, what: str, *, since: datetime, otherwise: int = 1) -> int:
    """EXIT_PREEMPTED when the ranks committed a preemption checkpoint after `since`, else `otherwise`."""
    from fsdpkit.checkpoint.catalog import follow_latest
    from fsdpkit.checkpoint.manifest import read_manifest
    from fsdpkit.checkpoint.storage import open_storage

    try:
        root = open_storage(cfg.checkpoint.dir, cfg.checkpoint.storage_options)
        manifest = read_manifest(follow_latest(root))  # a junk `latest` is no preemption checkpoint
    except (OSError, CheckpointError):
        manifest = {}
    if manifest.get("reason") == "preempted" and datetime.fromisoformat(manifest["committed_at"]) >= since:
        print(f"fsdpkit train: {what}; every rank saved step {manifest['step']} and stopped. Run the same "
              f"command to resume (exit {EXIT_PREEMPTED})", file=sys.stderr)
        return EXIT_PREEMPTED
    print(f"fsdpkit train: {what}; no preemption checkpoint was committed", file=sys.stderr)
    return otherwise


def _config(args: argparse.Namespace) -> int:
    if args.action == "docs":
        from fsdpkit.config.docs import iter_options, markdown_table

        if args.markdown:
            print(markdown_table())
            return 0
        for key, typ, default, doc in iter_options():
            print(f"{key}  ({typ}, default {default!r})\n    {doc}\n")
        return 0
    from fsdpkit.config import compose_config, to_yaml

    print(to_yaml(compose_config(args.overrides, config_dirs=args.config_dir)), end="")
    return 0


def _world_sizes(text: str) -> list[int]:
    """`--resume-nproc 3` or `--resume-nproc 2,3`."""
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected world sizes such as 3 or 2,3, got {text!r}") from None
    if min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"world sizes must be at least 1, got {text!r}")
    return sizes


def _resume_check(args: argparse.Namespace) -> int:
    from fsdpkit.cli.resume_check import resume_check

    return resume_check(overrides=args.overrides, nproc=args.nproc, resume_nproc=args.resume_nproc or [args.nproc],
                        steps=args.steps, save_at=args.save_at, work_dir=args.work_dir, config_dirs=args.config_dir,
                        resume_overrides=[o for group in args.resume_overrides for o in shlex.split(group)])


def _stdout_closed() -> int:
    """The reader of stdout went away (`fsdpkit ckpt inspect ... | head -1`): stop quietly, as Unix
    tools do, with the status of a process ended by SIGPIPE. stdout is pointed at /dev/null so that
    the interpreter's final flush cannot raise (and print a traceback) again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + signal.SIGPIPE


def main(argv: list[str] | None = None) -> int:
    """The `fsdpkit` command; returns the exit code."""
    try:
        try:
            return _main(argv)
        finally:
            sys.stdout.flush()  # a closed pipe shows here, where it is handled, not at interpreter exit
    except BrokenPipeError:  # from any subcommand's output, or from --help
        return _stdout_closed()


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """The parsed command line. Hydra overrides may sit before, between or after options
    (`config show --config-dir DIR experiment=x`): argparse fills `overrides` from the first run of
    positionals only and leaves later ones over, so those are appended to it, in order."""
    parser = _parser()
    args, rest = parser.parse_known_args(argv)
    if rest and hasattr(args, "overrides") and not any(arg.startswith("-") for arg in rest):
        args.overrides = [*args.overrides, *rest]
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return args


def _main(argv: list[str] | None) -> int:
    args = _parse(argv)
    under_launcher = "TORCHELASTIC_RUN_ID" in os.environ
    try:
        tunables.current()  # a malformed FSDPKIT_* variable stops every command here, before any work
        code = {"train": _train, "config": _config, "resume-check": _resume_check, "ckpt": ckpt_cli.run,
                "plot": plot_cli.run}[args.command](args)
    except (ValueError, FileNotFoundError, CheckpointError) as e:
        if not getattr(e, "echoed", False):  # rank 0 reports an error that every rank raised (dist.on_main)
            print(f"fsdpkit {args.command}: error: {e}", file=sys.stderr)
        elif under_launcher:
            # Let rank 0 print and exit first: the launcher stops every rank at the first exit it sees,
            # and a rank 0 stopped mid-print would leave the user with no message at all.
            time.sleep(ECHO_GRACE_S)
        code = 2
    except Exception:
        if not under_launcher:
            raise
        # The original traceback, then a hard exit: a normal interpreter exit would join a
        # background checkpoint thread that may wait on a dead peer until its timeout.
        traceback.print_exc()
        code = 1
    if under_launcher:
        # A launched rank exits hard once its process group is torn down: gloo can abort in
        # static destructors at interpreter exit otherwise.
        try:
            sys.stdout.flush()
        except BrokenPipeError:
            code = code or _stdout_closed()
        sys.stderr.flush()
        os._exit(code)
    return code
