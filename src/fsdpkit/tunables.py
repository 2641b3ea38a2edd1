"""Every FSDPKIT_* environment variable, declared once: type, default, unit, meaning, accepted values.

These are low-level I/O and diagnostics knobs, for benchmarks, unusual file systems and tests that
must reach a chunked path with tiny tensors. What a user chooses for a run (directories, sizes of
outputs, timeouts) is a config field instead (fsdpkit.config.schema), saved with every checkpoint.

The environment is read once, on the first `current()`, and every variable is checked then: a
malformed one raises ValueError naming the variable, its value and what it accepts (the `fsdpkit`
command calls `current()` before doing anything). Code reads a value when it needs it,
`tunables.current().remote_part_bytes`, never into a global of its own at import time, so that
`override` reaches it. Byte counts take a number or a size (`16MiB`, `5MB`); switches take 0 or 1.
An empty variable counts as unset.

Tests change values with `with tunables.override(read_restart_bytes=4096): ...` (tests/conftest.py
has a `tune` fixture that keeps an override until the test ends).

Variable                         Default  Accepts         Meaning
FSDPKIT_READ_RESTART_BYTES       16 MiB   bytes >= 0      a file read start to end gets a new descriptor (a fresh kernel
                                                          readahead) this often; 0: never
FSDPKIT_HASH_CHUNK_ELEMS         4194304  elements >= 1   elements per piece of the `linear` tensor checksum (bounds its
                                                          memory; the sum is the same)
FSDPKIT_PYTHON_ROW_HASH          0        0 or 1          1: the python-xxhash loop for `xxh3_64-rows` checksums even
                                                          where the C extension is built
FSDPKIT_STAGING_THREADS          (unset)  threads >= 1    threads of an async save's blocking host copy; unset: the
                                                          cores / ranks on this host, at most 4
FSDPKIT_REMOTE_PART_BYTES        16 MiB   bytes >= 5 MiB  part size of a multipart upload to object storage (S3's
                                                          smallest part is 5 MiB)
FSDPKIT_REMOTE_PARTS_IN_FLIGHT   4        parts >= 1      parts of one object uploaded at once
FSDPKIT_REMOTE_RANGE_BYTES       16 MiB   bytes >= 1      largest ranged GET of an object read into memory
FSDPKIT_REMOTE_OPEN_BLOCK_BYTES  1 MiB    bytes >= 1      read-ahead of an object opened as a file
FSDPKIT_LOCK_WAIT_S              15       seconds >= 0    how long a run waits for checkpoints/.lock (a just-killed
                                                          predecessor still exiting)
FSDPKIT_OBJECT_LOCK_HEARTBEAT_S  30       seconds > 0     a run refreshes its lock object on object storage this often
FSDPKIT_OBJECT_LOCK_STALE_S      120      seconds > 0     a lock object not refreshed for this long is taken over (more
                                                          than the heartbeat)
FSDPKIT_EXPORT_BLOCK_BYTES       16 MiB   bytes >= 4 KiB  export reads, converts and writes tensors this many bytes at a
                                                          time
FSDPKIT_EXPORT_READ_AHEAD        4        blocks >= 1     blocks export reads ahead, on as many threads, while one is
                                                          written
FSDPKIT_VERIFY_THREADS           4        threads >= 1    threads that recompute checksums (`fsdpkit ckpt verify`
                                                          without --threads, verified exports)
FSDPKIT_DIAG_GRAD_NORM_RTOL      0.001    ratio > 0       relative tolerance of the gradient-norm check between norms
                                                          that should agree

A test (tests/unit/test_tunables.py) holds this table to the declarations below, and fails on an
FSDPKIT_* name in the repository that is not declared here.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
import textwrap
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

PREFIX = "FSDPKIT_"

_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def _size(text: str) -> int | None:
    """'16MiB' -> 16 * 2**20, '5GB' -> 5 * 10**9, '4096' -> 4096; None when `text` is no size."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).upper() not in _SIZE_UNITS:
        return None
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).upper()])


def parse_size(text: str | int) -> int:
    """'5GB' -> 5e9, '500MiB' -> 500 * 2**20, 1024 -> 1024 (decimal units, as Hugging Face uses).

    Raises:
        ValueError: not a positive size.
    """
    value = text if isinstance(text, int) else _size(text)
    if value is None:
        raise ValueError(f"cannot read {text!r} as a size; write e.g. 5GB, 500MB, 2GiB or a number of bytes")
    if value <= 0:
        raise ValueError(f"a size must be positive, got {text!r}")
    return value


def _tunable(default: Any, *, unit: str, meaning: str, minimum: float | None = None,
             above: float | None = None) -> Any:
    """A field of `Tunables`: `unit` is `switch`, `bytes`, `seconds`, `threads`, ... (a count);
    the value must be at least `minimum`, or more than `above`."""
    return field(default=default, metadata={"unit": unit, "meaning": meaning, "minimum": minimum, "above": above})


@dataclass(frozen=True)
class Tunables:
    """One value per tunable, each read from FSDPKIT_ + its name in capitals (`remote_part_bytes`:
    FSDPKIT_REMOTE_PART_BYTES)."""

    # -- checkpoint files on local disks (fsdpkit.checkpoint.hashing, staging, io.page_cache)
    read_restart_bytes: int = _tunable(16 << 20, unit="bytes", minimum=0, meaning=(
        "a file read start to end gets a new descriptor (a fresh kernel readahead) this often; 0: never"))
    hash_chunk_elems: int = _tunable(1 << 22, unit="elements", minimum=1, meaning=(
        "elements per piece of the `linear` tensor checksum (bounds its memory; the sum is the same)"))
    python_row_hash: bool = _tunable(False, unit="switch", meaning=(
        "1: the python-xxhash loop for `xxh3_64-rows` checksums even where the C extension is built"))
    staging_threads: int | None = _tunable(None, unit="threads", minimum=1, meaning=(
        "threads of an async save's blocking host copy; unset: the cores / ranks on this host, at most 4"))
    # -- object storage (fsdpkit.checkpoint.storage.multipart, storage, object_lock)
    remote_part_bytes: int = _tunable(16 << 20, unit="bytes", minimum=5 << 20, meaning=(
        "part size of a multipart upload to object storage (S3's smallest part is 5 MiB)"))
    remote_parts_in_flight: int = _tunable(4, unit="parts", minimum=1, meaning=(
        "parts of one object uploaded at once"))
    remote_range_bytes: int = _tunable(16 << 20, unit="bytes", minimum=1, meaning=(
        "largest ranged GET of an object read into memory"))
    remote_open_block_bytes: int = _tunable(1 << 20, unit="bytes", minimum=1, meaning=(
        "read-ahead of an object opened as a file"))
    # -- one run per checkpoint directory (fsdpkit.checkpoint.ownership, object_lock)
    lock_wait_s: float = _tunable(15.0, unit="seconds", minimum=0, meaning=(
        "how long a run waits for checkpoints/.lock (a just-killed predecessor still exiting)"))
    object_lock_heartbeat_s: float = _tunable(30.0, unit="seconds", above=0, meaning=(
        "a run refreshes its lock object on object storage this often"))
    object_lock_stale_s: float = _tunable(120.0, unit="seconds", above=0, meaning=(
        "a lock object not refreshed for this long is taken over (more than the heartbeat)"))
    # -- export, import and verification (fsdpkit.export)
    export_block_bytes: int = _tunable(16 << 20, unit="bytes", minimum=4096, meaning=(
        "export reads, converts and writes tensors this many bytes at a time"))
    export_read_ahead: int = _tunable(4, unit="blocks", minimum=1, meaning=(
        "blocks export reads ahead, on as many threads, while one is written"))
    verify_threads: int = _tunable(4, unit="threads", minimum=1, meaning=(
        "threads that recompute checksums (`fsdpkit ckpt verify` without --threads, verified exports)"))
    # -- diagnostics (fsdpkit.diagnostics.grad_norm)
    diag_grad_norm_rtol: float = _tunable(1e-3, unit="ratio", above=0, meaning=(
        "relative tolerance of the gradient-norm check between norms that should agree"))

    def __post_init__(self) -> None:
        for spec in declared():
            _check(spec, getattr(self, spec.name))
        if self.object_lock_stale_s <= self.object_lock_heartbeat_s:
            raise ValueError(
                f"FSDPKIT_OBJECT_LOCK_STALE_S={self.object_lock_stale_s:g} must exceed FSDPKIT_OBJECT_LOCK_HEARTBEAT_S="
                f"{self.object_lock_heartbeat_s:g}: a live run's lock would be taken over between two heartbeats")


@dataclass(frozen=True)
class Tunable:
    """The declaration of one tunable (a field of `Tunables`), as `declared()` lists them."""

    name: str  # the field of Tunables
    env: str
    kind: type  # bool, int or float: the value's type when set
    optional: bool  # unset means None
    default: Any
    unit: str
    meaning: str
    minimum: float | None
    above: float | None

    def accepts(self) -> str:
        """What a value may be, in words: `0 or 1`, `bytes >= 5 MiB`, `seconds > 0`."""
        if self.kind is bool:
            return "0 or 1"
        if self.minimum is not None:
            return f"{self.unit} >= {_show(self.minimum, self.unit)}"
        if self.above is not None:
            return f"{self.unit} > {_show(self.above, self.unit)}"
        return self.unit


_TYPES = {"bool": bool, "int": int, "float": float, "int | None": int}


def declared() -> tuple[Tunable, ...]:
    """Every tunable, in declaration order."""
    return _DECLARED


def _declare() -> tuple[Tunable, ...]:
    out = []
    for f in dataclasses.fields(Tunables):
        out.append(Tunable(name=f.name, env=PREFIX + f.name.upper(), kind=_TYPES[str(f.type)],
                           optional=str(f.type).endswith("| None"), default=f.default, unit=f.metadata["unit"],
                           meaning=f.metadata["meaning"], minimum=f.metadata["minimum"], above=f.metadata["above"]))
    return tuple(out)


def _show(value: Any, unit: str) -> str:
    """A value as the table shows it: 16 MiB, 0.001, 1 (a switch), (unset)."""
    if value is None:
        return "(unset)"
    if isinstance(value, bool):
        return str(int(value))
    if unit == "bytes" and value >= 1024:
        for name, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
            if value % size == 0:
                return f"{value // size} {name}"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _check(spec: Tunable, value: Any, *, text: str | None = None) -> None:
    """Raises ValueError naming the variable when `value` is not one it accepts; `text`: what the
    environment held (None: `value` was given in Python, to Tunables or `override`)."""
    if value is None and spec.optional:
        return
    if spec.kind is bool:
        ok = isinstance(value, bool)
    else:  # an int for an int; an int or a finite float for a float (never a bool)
        numbers = int if spec.kind is int else int | float
        ok = (isinstance(value, numbers) and not isinstance(value, bool) and math.isfinite(value)
              and (spec.minimum is None or value >= spec.minimum) and (spec.above is None or value > spec.above))
    if ok:
        return
    if text is not None:
        default = "unset by default" if spec.default is None else f"default {_show(spec.default, spec.unit)}"
        example = " (a number of bytes or a size such as 16MiB)" if spec.unit == "bytes" else ""
        raise ValueError(f"{spec.env}={text!r} is not accepted: it takes {spec.accepts()}{example}; set such a "
                         f"value or unset it ({default}). {spec.env}: {spec.meaning}")
    accepts = "True or False" if spec.kind is bool else spec.accepts()
    raise ValueError(f"tunable {spec.name}={value!r} ({spec.env}) is not accepted: it takes {accepts} "
                     f"(default {spec.default!r})")


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _parse(spec: Tunable, text: str) -> Any:
    """The value of `spec` written as `text`, checked here so that an error quotes the text."""
    if spec.kind is bool:
        low = text.strip().lower()
        value: Any = True if low in _TRUE else False if low in _FALSE else text
    elif spec.unit == "bytes":
        value = _size(text)
    elif spec.kind is int:
        value = int(text) if re.fullmatch(r"\s*[+-]?\d+\s*", text) else None
    else:
        try:
            value = float(text)
        except ValueError:
            value = None
    _check(spec, value if value is not None else text, text=text)
    return value


def from_environ(environ: Mapping[str, str]) -> Tunables:
    """The tunables `environ` sets (unset or empty variables keep their defaults).

    Raises:
        ValueError: a variable holds a value it does not accept (the message names it).
    """
    return Tunables(**{spec.name: _parse(spec, environ[spec.env])
                       for spec in declared() if environ.get(spec.env, "").strip()})


_DECLARED = _declare()
DEFAULTS = Tunables()
"""Every tunable at its default (what the CLI's help shows)."""

_current: Tunables | None = None


def current() -> Tunables:
    """The tunables in force: the environment's, read on the first call, or an `override`.

    Raises:
        ValueError: (the first call) an FSDPKIT_* variable holds a value it does not accept.
    """
    global _current
    if _current is None:
        _current = from_environ(os.environ)
    return _current


@contextmanager
def override(**values: Any) -> Iterator[Tunables]:
    """Tunables changed until the block ends (nests; for tests and benchmarks):
    `with override(read_restart_bytes=0): ...`.

    Raises:
        TypeError: a name that is not a tunable.
        ValueError: a value it does not accept.
    """
    global _current
    before = _current
    _current = dataclasses.replace(current(), **values)
    try:
        yield _current
    finally:
        _current = before


def table() -> str:
    """The module docstring's table of every tunable (a test keeps the two equal)."""
    rows = [("Variable", "Default", "Accepts", "Meaning")]
    rows += [(s.env, _show(s.default, s.unit), s.accepts(), s.meaning) for s in declared()]
    widths = [max(len(r[i]) for r in rows) + 2 for i in range(3)]
    # the meaning wraps under its own column, so that every line of the docstring fits in 120 characters
    wrap = functools.partial(textwrap.wrap, width=120 - sum(widths), break_long_words=False, break_on_hyphens=False)
    continued = "\n" + " " * sum(widths)
    return "\n".join("".join(c.ljust(w) for c, w in zip(r[:3], widths, strict=True)) + continued.join(wrap(r[3]))
                     for r in rows)
