"""What the checkpoint code needs from the place checkpoints live: one Protocol, two implementations.

`StoragePath` is a file or directory there, named like a `pathlib` path. `LocalPath` (local.py) is
one on a local or mounted file system, `RemotePath` (remote.py) a key in an fsspec filesystem.
`open_storage` (storage/__init__.py) returns the one a path or URL needs. The checkpoint code
calls these methods and never asks which of the two it holds: where they differ (an atomic rename
or a copy, a flock or a heartbeat object, DCP's file writer or its fsspec one), the difference is
a method here.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from fsdpkit.checkpoint.hashing import DigestFileSystem
    from fsdpkit.checkpoint.settings import IOSettings
    from fsdpkit.checkpoint.storage.mirror import Mirror


class SequentialRead(Protocol):
    """A file read once from its start to its end (file checksums)."""

    def readinto(self, view: Any) -> int: ...

    def __enter__(self) -> SequentialRead: ...

    def __exit__(self, *exc: object) -> None: ...


class RangeReader(Protocol):
    """A file open for reads at any offset, from several threads at once (export's row readers)."""

    noun: str
    """What a message calls it: `file` (local) or `object` (object storage)."""

    def read_into(self, view: memoryview, offset: int) -> int:
        """Fill `view` from byte `offset`; returns the bytes read (fewer where the file ends)."""

    def close(self) -> None: ...

    def __enter__(self) -> RangeReader: ...

    def __exit__(self, *exc: object) -> None: ...


class Lock(Protocol):
    """A run's claim on a checkpoints root, held by its rank 0 (one run per directory)."""

    def acquire(self, *, wait_s: float | None = None) -> Lock:
        """Raises CheckpointError when another live run holds it after `wait_s`."""

    def release(self) -> None: ...


class StoragePath(Protocol):
    """A file or directory where checkpoints live."""

    checks_items: bool
    """Whether re-reading is cheap here (a local file, no request per read): a save records each
    data file's item checksums and a load checks every item as it reads it; elsewhere files are
    checked whole (docs/checkpoint-format.md)."""

    # -- names, as pathlib's
    @property
    def name(self) -> str: ...

    @property
    def parent(self) -> StoragePath: ...

    def __truediv__(self, name: str) -> StoragePath: ...

    def with_name(self, name: str) -> StoragePath: ...

    def local_path(self) -> Path | None:
        """This path on the local file system, for readers that take only such a path (safetensors'
        safe_open, DCP's FileSystemReader); None where it has none (object storage)."""

    # -- looking: list, and what is there
    def exists(self) -> bool: ...

    def is_file(self) -> bool: ...

    def is_dir(self) -> bool: ...

    def iterdir(self) -> Iterator[StoragePath]: ...

    def glob(self, pattern: str) -> Any: ...

    def stat(self) -> Any:
        """`.st_size`: the file's size in bytes."""

    # -- reading
    def open(self, mode: str = "rb", **kwargs: Any) -> IO[Any]: ...

    def read_bytes(self) -> bytes: ...

    def read_text(self, encoding: str = "utf-8") -> str: ...

    def open_sequential(self, io: IOSettings) -> SequentialRead:
        """A reader of the whole file, start to end, tuned for one pass (file checksums)."""

    def open_ranges(self, io: IOSettings | None = None) -> RangeReader:
        """A reader of byte ranges of this file at any offset (pread locally, ranged GETs of at most
        `io.remote_range_bytes` on object storage; default: the environment's)."""

    # -- writing
    def mkdir(self, parents: bool = False, exist_ok: bool = False) -> None: ...

    def write_atomic(self, data: str | bytes) -> None:
        """Replace this file's content so that readers see the old content or the new, never a mix
        (locally tmp + fsync + rename + directory fsync; on object storage one PUT)."""

    def unlink(self, missing_ok: bool = False) -> None: ...

    def remove_tree(self, *, first: str | None = None) -> None:
        """Delete this directory and everything in it, the file named `first` before the rest (the
        commit marker: an interrupted removal leaves no checkpoint). Missing paths are fine."""

    def move_to(self, dst: StoragePath, *, last: str | None = None) -> None:
        """Rename (publish) this directory or file as `dst`, in the same storage; where that takes
        a copy, the file named `last` is copied last and removed first."""

    def replace_with(self, incoming: StoragePath, *, marker: str) -> None:
        """Make the committed `incoming` (marked by the file `marker`) this directory; the one it
        replaces is deleted only once `incoming` can no longer be lost: a crash in between leaves
        `incoming` or this directory committed, never neither."""

    def fsync(self) -> None:
        """Make this file's content, or this directory's entries, durable."""

    # -- the run's claim
    def lock(self, io: IOSettings) -> Lock:
        """The lock of this checkpoints root (not yet acquired)."""

    def check_writable(self, *, setting: str) -> None:
        """Raise ValueError, naming `setting`, unless a file can be written and removed here."""

    # -- DCP's reader and writer for this place
    def dcp_writer(self, *, thread_count: int, io: IOSettings,
                   mirror: Mirror | None = None) -> tuple[Any, DigestFileSystem]:
        """(a DCP StorageWriter into this directory, the file system it writes through): after
        dcp.save, `fs.files` holds every written file's size and checksum."""

    def dcp_reader(self, *, io: IOSettings, files: dict[str, Any] | None = None, covered: Any = ()) -> Any:
        """A DCP StorageReader of this directory that never runs code from `.metadata`; with
        `files` (the manifest's) and `covered` (its `tensors` keys) it checks what it reads."""
