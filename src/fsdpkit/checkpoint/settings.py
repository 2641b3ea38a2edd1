"""The checkpoint library's settings, typed and validated here, passed in explicitly.

- `CheckpointConfig`: when and how to save, and what to resume from (one docstring per field; the
  trainer's `checkpoint.*` config group is this class). `validate_checkpoint` checks its values.
- `IOSettings`: the I/O tunables the library uses (read sizes, object-storage transfers, locks,
  staging threads, checksum pieces), as constructor arguments, as DCP's FileSystemWriter takes
  `thread_count`. `IOSettings.from_environment()` reads them from the FSDPKIT_* variables
  (fsdpkit.tunables, where each is declared once: name, default, unit, meaning); a `Checkpointer`
  or `find_checkpoint` given none uses that.

Nothing here imports torch, fsspec, Hydra or OmegaConf: `from fsdpkit.checkpoint import
Checkpointer` stays free of the trainer's configuration machinery (tests/unit/test_checkpoint_standalone.py).
"""

from __future__ import annotations

import dataclasses
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fsdpkit import tunables
from fsdpkit.checkpoint.storage.urls import check_url, is_url, refuse_url

REMOVED_KEYS = {
    "checkpoint.io": "every load now reads with DCP's own reader, checking every file's checksums "
                     "(checkpoint.verify_checksums)",
}
"""Keys that were settings once, with what replaced them: a config that still sets one is refused
with a sentence naming the key and saying so (fsdpkit.config.compose; the Checkpointer's keyword settings too)."""

# fsspec/s3fs option names that carry secrets (never in a config that every checkpoint records)
CREDENTIAL_KEYS = frozenset({"key", "secret", "token", "password", "aws_access_key_id", "aws_secret_access_key",
                             "aws_session_token", "account_key", "sas_token", "connection_string"})


@dataclass
class CheckpointConfig:
    """When and how to save, and what to resume from: the settings of a `Checkpointer` (keyword
    arguments of its constructor, or `settings=`) and of `find_checkpoint`, and the trainer's
    `checkpoint.*` config group (fsdpkit.config.schema uses this class). Check them with
    `validate_checkpoint`; the Checkpointer does."""

    dir: str = ""
    """Root of this run's checkpoints (the trainer's default: ${run_dir}/checkpoints): step_<N>/
    directories and the `latest` pointer. A local path, or an object-storage URL
    (s3://bucket/prefix; needs the `remote` extra): the same commit rule holds there, see
    docs/how-to/object-storage.md."""
    storage_options: dict[str, Any] = field(default_factory=dict)
    """fsspec options for URL checkpoint paths (dir, resume; and a URL export.dir that export.on_finish
    uploads to), e.g. {endpoint_url: http://host:9000} for an S3-compatible store, or {profile: name}.
    Credentials come from the environment (AWS_*, AWS_ENDPOINT_URL, profiles), never from a checkpoint:
    credential options (key, secret, token, ...) are refused here, since the resolved config is saved
    with every checkpoint."""
    local_dir: str = ""
    """With a URL checkpoint.dir: a node-local directory that keeps a copy of every checkpoint this
    node writes, for the fastest restart on the same node. The bucket stays the source of truth (a
    checkpoint is committed when its remote manifest exists); a restart reads the local copy when
    its manifest equals the remote one byte for byte and every file is there, else the bucket. One
    node and one run per directory; '' (default): no copy. See docs/how-to/object-storage.md."""
    every_steps: int = 0
    """Save every this many optimizer steps (0: not by step count)."""
    every_minutes: float = 0.0
    """Also save when this many minutes passed since the last save started (0: not by time). All
    ranks agree on the step, so clocks that differ between nodes are harmless."""
    save_at_end: bool = True
    """Save when training reaches train.max_steps."""
    resume: str = "auto"
    """`auto`: the newest committed, intact checkpoint under `dir` (on_exception when it is newer),
    or a fresh start if there is none. `none`: always start fresh. A path: that checkpoint, which
    must be committed and intact."""
    resume_mode: str = "full"
    """`full`: restore everything (model, optimizer, schedule, counters, data cursor, RNG).
    `model_only`: weights only; optimizer, schedule, counters and data start from zero."""
    existing: str = "error"
    """What a run that does not continue the run in `dir` (resume=none, resume_mode=model_only, or
    a resume from elsewhere) does when `dir` holds that other run's committed checkpoints: `error`
    (stop before the first step and say so) or `archive` (move them to `dir`/archive/<time>/).
    Nothing is ever deleted; two runs never share a directory."""
    verify_checksums: bool = True
    """Check every byte a resume uses against the manifest's checksums, and refuse corrupt files:
    with verify_on_load, from the load's own read (each file read once: `.metadata` and every item
    checked before they are decoded, the tensors' values by verify_on_load); otherwise, and for
    files without item checksums, in a pass over the files (spread over ranks) before the load reads
    them. With resume=auto a corrupt newest checkpoint is moved aside and the next older one loaded
    over whatever it had loaded."""
    verify_on_load: bool = True
    """After loading, compare per-tensor checksums and optimizer step counts with the manifest
    (with verify_checksums, this is what proves the tensors' values read in the one read)."""
    timeout_s: float = 600.0
    """Bound on every collective around a save or load: a dead or stuck rank fails the save on
    all ranks after this long instead of hanging them."""
    thread_count: int = 1
    """Writer threads per rank (DCP FileSystemWriter)."""
    share_frozen: bool = True
    """Write frozen weights once: parameters with requires_grad=False that the optimizer does not
    hold (a LoRA base, a frozen encoder) go to `dir`/shared/<name>/ at the run's first save, and
    later checkpoints reference them while their checksums (recomputed at every save) are
    unchanged. Retention never removes a referenced directory; resume, verify and export follow
    the references. Not with local_dir, state_dict_type=full or on_exception saves (those write
    everything). false: every checkpoint holds every tensor."""
    async_save: bool = False
    """Save in the background (`checkpoint.async` is accepted as an alias): the step blocks only
    while the state is copied into a reused host buffer (pinned on CUDA); writing, checksums and the
    commit follow on a background thread, and `latest` moves once every rank committed. At most one
    save is in flight; a failed background save stops training at the next step on every rank.
    Needs strategy.state_dict_type=sharded."""
    async_staging: str = "blocking"
    """With async_save, when the state is copied into the host buffer: `blocking` (the save step
    waits for the copy) or `background` (the copy too runs on the background thread; the next
    optimizer step waits for it if it is not done, so the checkpoint is still the state at its step).
    `background` applies to state in host memory (CPU training); on an accelerator the
    device-to-host copy always blocks (it is fast)."""
    keep_last: int = 0
    """Retention: keep the newest this many checkpoints. Retention is on when any keep_* is > 0;
    a checkpoint survives when any rule keeps it. The newest committed checkpoint, checkpoints
    being written and on_exception are never deleted, and deletion happens only after a newer
    checkpoint committed. All zero: keep everything."""
    keep_every: int = 0
    """Retention: also keep every checkpoint whose step is a multiple of this."""
    keep_best: int = 0
    """Retention: also keep the best this many checkpoints by keep_best_metric (checkpoints saved
    at a step without that metric do not compete)."""
    keep_best_metric: str = "val_loss"
    """The metric keep_best ranks by, as logged at the save step (val_loss, loss, ...)."""
    keep_best_mode: str = "min"
    """`min` or `max`: whether a smaller or a larger keep_best_metric is better."""
    preemption_signals: list[str] = field(default_factory=lambda: ["SIGTERM", "SIGUSR1"])
    """Signals that mean "about to be killed": every rank saves at the next step boundary, commits
    and exits with code 75 (resume with the same command). A second signal exits at once. []: off."""
    on_exception: bool = True
    """When the loop raises, save to on_exception/ if every rank can still take part (agreed within
    exception_timeout_s on a separate gloo group) and the state is at a step boundary; then
    re-raise the original error."""
    exception_timeout_s: float = 60.0
    """How long ranks wait for each other to agree on an on_exception save before giving up."""


def refuse_removed(key: str, *, fix: str | None = None) -> None:
    """Raise ValueError when `key` (dotted) is a setting that was removed (REMOVED_KEYS); `fix` says
    how to stop setting it (default: delete it from the command line and config files)."""
    if key in REMOVED_KEYS:
        fix = fix or f"delete {key} from your command line and config files"
        raise ValueError(f"config key '{key}' was removed: {REMOVED_KEYS[key]}; {fix}")


def check_one_of(key: str, value: object, allowed: Sequence[object]) -> None:
    """ValueError naming config key `key` when `value` is not one of `allowed`."""
    if value not in allowed:
        raise ValueError(f"config key '{key}' is {value!r}; expected one of {', '.join(map(str, allowed))}")


def check_positive(key: str, value: float, *, allow_zero: bool = False) -> None:
    """ValueError naming config key `key` when `value` is negative (or zero, unless `allow_zero`)."""
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"config key '{key}' is {value}; it must be {'>= 0' if allow_zero else '> 0'}")


def validate_checkpoint(ck: CheckpointConfig, *, state_dict_type: str = "sharded") -> None:
    """The checkpoint settings on their own (the Checkpointer API checks them too); ValueError naming the key."""
    check_one_of("checkpoint.resume_mode", ck.resume_mode, ("full", "model_only"))
    check_one_of("checkpoint.existing", ck.existing, ("error", "archive"))
    check_positive("checkpoint.every_steps", ck.every_steps, allow_zero=True)
    check_positive("checkpoint.timeout_s", ck.timeout_s)
    check_positive("checkpoint.thread_count", ck.thread_count)
    check_positive("checkpoint.every_minutes", ck.every_minutes, allow_zero=True)
    check_positive("checkpoint.exception_timeout_s", ck.exception_timeout_s)
    for key in ("keep_last", "keep_every", "keep_best"):
        check_positive(f"checkpoint.{key}", getattr(ck, key), allow_zero=True)
    check_one_of("checkpoint.keep_best_mode", ck.keep_best_mode, ("min", "max"))
    check_one_of("checkpoint.async_staging", ck.async_staging, ("blocking", "background"))
    if ck.async_staging == "background" and not ck.async_save:
        raise ValueError("checkpoint.async_staging=background stages an async save in the background, and "
                         "checkpoint.async_save is off; set checkpoint.async_save=true, or leave "
                         "async_staging=blocking")
    for setting, value in (("checkpoint.dir", ck.dir), ("checkpoint.resume", ck.resume)):
        check_url(value, setting=setting)
    if is_url(ck.dir) and state_dict_type != "sharded":
        raise ValueError(f"checkpoint.dir={ck.dir} is a URL: object storage takes sharded checkpoints only "
                         "(strategy.state_dict_type=sharded)")
    if ck.local_dir:
        refuse_url(ck.local_dir, setting="checkpoint.local_dir")
        if not is_url(ck.dir):
            raise ValueError(f"checkpoint.local_dir={ck.local_dir} keeps a local copy of checkpoints on object "
                             f"storage, and checkpoint.dir={ck.dir} is local already; set checkpoint.dir to a URL "
                             "(s3://bucket/prefix) or leave checkpoint.local_dir empty")
    if not isinstance(ck.storage_options, Mapping):
        raise ValueError(f"config key 'checkpoint.storage_options' must be a mapping, got {ck.storage_options!r}")
    if secrets := sorted(k for k in ck.storage_options if str(k).lower() in CREDENTIAL_KEYS):
        raise ValueError(f"checkpoint.storage_options holds credentials ({', '.join(secrets)}); the resolved config "
                         "is saved with every checkpoint, so credentials come from the environment (AWS_ACCESS_KEY_ID, "
                         "AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN) or a profile (storage_options.profile) only")
    for name in ck.preemption_signals:
        if (name if name.startswith("SIG") else f"SIG{name}") not in signal.Signals.__members__:
            raise ValueError(f"config key 'checkpoint.preemption_signals' names an unknown signal {name!r}; "
                             "use names such as SIGTERM or SIGUSR1")
    if ck.async_save and state_dict_type != "sharded":
        raise ValueError("checkpoint.async_save needs strategy.state_dict_type=sharded (a full state dict is "
                         "gathered with collectives on the training ranks, which cannot run in the background)")


_DEFAULTS = tunables.DEFAULTS


@dataclass(frozen=True)
class IOSettings:
    """The I/O tunables of one Checkpointer (and of `find_checkpoint`, and the functions they call),
    each documented once in fsdpkit.tunables under its FSDPKIT_* name (the field in capitals).

    Raises:
        ValueError: a value the tunable does not accept (the message names it).
    """

    read_restart_bytes: int = _DEFAULTS.read_restart_bytes  # a file read start to end: a new descriptor this often
    hash_chunk_elems: int = _DEFAULTS.hash_chunk_elems  # elements per piece of the `linear` tensor checksum
    python_row_hash: bool = _DEFAULTS.python_row_hash  # the python loop for row checksums, even with the C one
    staging_threads: int | None = _DEFAULTS.staging_threads  # an async save's host copy; None: cores / local ranks
    remote_part_bytes: int = _DEFAULTS.remote_part_bytes  # multipart upload part size
    remote_parts_in_flight: int = _DEFAULTS.remote_parts_in_flight  # parts of one object uploaded at once
    remote_range_bytes: int = _DEFAULTS.remote_range_bytes  # largest ranged GET read into memory
    remote_open_block_bytes: int = _DEFAULTS.remote_open_block_bytes  # read-ahead of an object opened as a file
    lock_wait_s: float = _DEFAULTS.lock_wait_s  # how long a run waits for checkpoints/.lock
    object_lock_heartbeat_s: float = _DEFAULTS.object_lock_heartbeat_s  # the lock object's refresh period
    object_lock_stale_s: float = _DEFAULTS.object_lock_stale_s  # a lock object this silent is taken over

    def __post_init__(self) -> None:
        dataclasses.replace(_DEFAULTS, **dataclasses.asdict(self))  # fsdpkit.tunables checks every value

    @classmethod
    def from_environment(cls) -> IOSettings:
        """The values the FSDPKIT_* environment sets (fsdpkit.tunables.current(): read once; a
        `tunables.override` block reaches it).

        Raises:
            ValueError: an FSDPKIT_* variable holds a value it does not accept.
        """
        current = tunables.current()
        return cls(**{f.name: getattr(current, f.name) for f in dataclasses.fields(cls)})
