"""Checkpoints on object storage through fsspec (`s3://bucket/prefix`, `gs://...`, `az://...`,
`memory://...`): `RemotePath`, the StoragePath of a key.

Object stores have no directories: a "directory" is a key prefix, `mkdir` does nothing and
`is_dir` is true when some object lies under the prefix. What they lack is done another way:

- `write_atomic`: one PUT (an object store shows a single PUT whole or not at all, never a mix);
- `move_to`: copy every object (the one named `last` last), then remove the source, that one
  first: when `last` is the commit marker, at every moment at least one of the two is whole and
  committed;
- `replace_with`: the old checkpoint removed (its marker first), the replacement copied in (its
  marker last), so the committed replacement is the checkpoint until the copy is committed;
- `fsync`: nothing (an object is durable once its upload completed);
- `lock`: a heartbeat object (object_lock.py).

The filesystem is opened with the caller's storage options (`open_storage(url, options)`) and
travels with the `RemotePath` (its `fs`) and every path derived from it: nothing is process-wide.
Listing caches are off: another rank or process may have written since the last listing.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Mapping, Sequence
from types import SimpleNamespace
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fsdpkit.checkpoint.hashing import DigestFileSystem
    from fsdpkit.checkpoint.settings import IOSettings
    from fsdpkit.checkpoint.storage.mirror import Mirror
    from fsdpkit.checkpoint.storage.object_lock import ObjectLock
    from fsdpkit.checkpoint.storage.protocol import StoragePath


def _plain(value: Any) -> Any:
    """A plain, deep copy of `value`: mappings become dicts and sequences lists (the config may
    hand over OmegaConf containers)."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):
        return [_plain(v) for v in value]
    return value


def open_filesystem(url: str, options: Mapping[str, Any] | None = None) -> Any:
    """The fsspec filesystem of `url`'s scheme, opened with `options` (None: the environment's
    settings only). Raises ValueError when fsspec or the scheme's driver is missing."""
    try:
        import fsspec
        from fsspec.core import split_protocol
    except ImportError:
        raise ValueError(f"{url} is a URL; reading or writing it needs fsspec and the scheme's driver: "
                         "pip install 'fsdpkit[remote]'") from None
    protocol, _ = split_protocol(url)
    opts = _plain(options or {})
    if protocol in ("s3", "s3a"):
        # endpoint_url at the top level is the form users know from the AWS CLI; s3fs wants it
        # in client_kwargs (it reads AWS_ENDPOINT_URL itself when nothing is given)
        if "endpoint_url" in opts:
            opts.setdefault("client_kwargs", {})["endpoint_url"] = opts.pop("endpoint_url")
        opts.setdefault("use_listings_cache", False)
    try:
        return fsspec.filesystem(protocol, **opts)
    except (ImportError, ValueError) as e:
        raise ValueError(f"cannot open {url}: {e}. Install the driver for {protocol}:// "
                         "(pip install 'fsdpkit[remote]' for s3://) or use a local path") from None


def _default_io() -> IOSettings:
    from fsdpkit.checkpoint.settings import IOSettings

    return IOSettings.from_environment()


class RemotePath:
    """A key (or key prefix) in an fsspec filesystem where checkpoints live (see the module docstring)."""

    checks_items = False  # a re-read costs a GET per item: files are checked whole instead

    def local_path(self) -> None:
        """None: an object has no local path."""
        return None

    def __init__(self, url: str, *, fs: Any):
        self.url, self.fs = url.rstrip("/"), fs
        self.key = fs._strip_protocol(self.url)

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"RemotePath({self.url!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RemotePath) and other.url == self.url

    def __lt__(self, other: RemotePath) -> bool:
        return self.url < other.url

    def __hash__(self) -> int:
        return hash(self.url)

    # -- names --------------------------------------------------------------------------------
    def __truediv__(self, name: str) -> RemotePath:
        return RemotePath(f"{self.url}/{name}", fs=self.fs)

    @property
    def name(self) -> str:
        return self.url.rsplit("/", 1)[-1]

    @property
    def parent(self) -> RemotePath:
        return RemotePath(self.url.rsplit("/", 1)[0], fs=self.fs)

    def with_name(self, name: str) -> RemotePath:
        return self.parent / name

    def _at(self, key: str) -> RemotePath:
        return RemotePath(f"{self.url.split('://', 1)[0]}://{key}", fs=self.fs)

    # -- looking --------------------------------------------------------------------------------
    def is_file(self) -> bool:
        return self.fs.isfile(self.key)

    def is_dir(self) -> bool:
        return self.fs.isdir(self.key)

    def exists(self) -> bool:
        return self.fs.exists(self.key)

    def iterdir(self) -> Iterator[RemotePath]:
        for entry in self.fs.ls(self.key, detail=False):
            yield self / entry.rstrip("/").rsplit("/", 1)[-1]

    def walk_files(self) -> list[RemotePath]:
        """Every object under this prefix (the "tree" of a checkpoint directory)."""
        return [self._at(key) for key in self.fs.find(self.key)]

    def glob(self, pattern: str) -> list[RemotePath]:
        return [self._at(key) for key in self.fs.glob(f"{self.key}/{pattern}")]

    def stat(self) -> SimpleNamespace:
        info = self.fs.info(self.key)
        return SimpleNamespace(st_size=int(info["size"]))

    # -- reading --------------------------------------------------------------------------------
    def read_bytes(self) -> bytes:
        try:
            return self.fs.cat_file(self.key)
        except FileNotFoundError:
            raise FileNotFoundError(f"{self.url} does not exist") from None

    def read_text(self, encoding: str = "utf-8") -> str:
        return self.read_bytes().decode(encoding)

    def read_range(self, start: int, end: int) -> bytes:
        """Bytes [start, end) in one ranged GET (fewer at the end of the object)."""
        return self.fs.cat_file(self.key, start=start, end=end)

    def read_range_into(self, view: memoryview, offset: int, *, range_bytes: int | None = None) -> int:
        """Fill `view` from byte `offset` with ranged GETs of at most `range_bytes` each (bounded
        memory; default IOSettings.remote_range_bytes from the environment); returns how many bytes
        the object had there (less than len(view): it ends early)."""
        done, most = 0, _default_io().remote_range_bytes if range_bytes is None else range_bytes
        while done < len(view):
            data = self.read_range(offset + done, offset + min(len(view), done + most))
            if not data:
                break
            view[done:done + len(data)] = data
            done += len(data)
        return done

    def open(self, mode: str = "rb", **kwargs: Any) -> IO[bytes]:
        """A file object; reads fetch `block_size` bytes ahead (default IOSettings.remote_open_block_bytes
        from the environment, 1 MiB: s3fs would fetch 50 MiB after every seek, which parsing headers
        spread through a large object turns into gigabytes)."""
        if "r" in mode and "block_size" not in kwargs:
            kwargs["block_size"] = _default_io().remote_open_block_bytes
        return self.fs.open(self.key, mode, **kwargs)

    def open_sequential(self, io: IOSettings) -> IO[bytes]:
        return self.open("rb", block_size=io.remote_open_block_bytes)

    def open_ranges(self, io: IOSettings | None = None) -> RemoteRanges:
        return RemoteRanges(self, range_bytes=(io or _default_io()).remote_range_bytes)

    # -- writing --------------------------------------------------------------------------------
    def mkdir(self, parents: bool = False, exist_ok: bool = False) -> None:
        """Nothing to do: prefixes exist once an object is written under them."""

    def write_bytes(self, data: bytes) -> None:
        """One PUT: readers see the whole object or none of it."""
        self.fs.pipe_file(self.key, data)

    def write_text(self, text: str) -> None:
        self.write_bytes(text.encode())

    def write_atomic(self, data: str | bytes) -> None:
        self.write_bytes(data if isinstance(data, bytes) else data.encode())

    def unlink(self, missing_ok: bool = False) -> None:
        try:
            self.fs.rm_file(self.key)
        except FileNotFoundError:
            if not missing_ok:
                raise

    def remove_tree(self, *, first: str | None = None) -> None:
        if first is not None:
            (self / first).unlink(missing_ok=True)
        files = self.walk_files()
        if files:
            self.fs.rm([f.key for f in files])

    def move_to(self, dst: StoragePath, *, last: str | None = None) -> None:
        if not isinstance(dst, RemotePath):
            raise ValueError(f"cannot move {self} to the local {dst}")
        if self.is_file():
            self.fs.copy(self.key, dst.key)
            self.unlink()
            return
        files = sorted(self.walk_files(), key=lambda f: f.name == last)
        for f in files:
            self.fs.copy(f.key, (dst / f.key[len(self.key):].lstrip("/")).key)
        self.remove_tree(first=last)

    def replace_with(self, incoming: StoragePath, *, marker: str) -> None:
        self.remove_tree(first=marker)
        incoming.move_to(self, last=marker)

    def fsync(self) -> None:
        """Nothing to do: an object is durable once its upload completed."""

    # -- the run's claim ----------------------------------------------------------------------------
    def lock(self, io: IOSettings) -> ObjectLock:
        from fsdpkit.checkpoint.storage.object_lock import ObjectLock

        return ObjectLock(self, heartbeat_s=io.object_lock_heartbeat_s, stale_s=io.object_lock_stale_s)

    def check_writable(self, *, setting: str) -> None:
        probe = self / f".fsdpkit-write-test-{uuid.uuid4().hex}"
        try:
            probe.write_bytes(b"ok")
            probe.unlink()
        except Exception as e:  # noqa: BLE001 - any client error (no credentials, no bucket, no endpoint) says the same
            raise ValueError(f"{setting}={self} cannot be written: {type(e).__name__}: {e}. Check the bucket name, "
                             "the credentials (AWS_* environment, profile) and the endpoint (AWS_ENDPOINT_URL or "
                             "checkpoint.storage_options.endpoint_url)") from None

    # -- DCP ------------------------------------------------------------------------------------
    def dcp_writer(self, *, thread_count: int, io: IOSettings,
                   mirror: Mirror | None = None) -> tuple[Any, DigestFileSystem]:
        from fsdpkit.checkpoint.storage.safe_fsspec import fsspec_writer

        return fsspec_writer(self, thread_count=thread_count, io=io, mirror=mirror)

    def dcp_reader(self, *, io: IOSettings, files: dict[str, Any] | None = None, covered: Any = ()) -> Any:
        from fsdpkit.checkpoint.storage.safe_fsspec import fsspec_reader

        reader = fsspec_reader(self, io=io)
        reader.expected_files = files
        return reader


class RemoteRanges:
    """An object read by ranged GETs (storage.protocol.RangeReader): nothing is held open."""

    noun = "object"

    def __init__(self, path: RemotePath, *, range_bytes: int) -> None:
        self.path, self.range_bytes = path, range_bytes

    def read_into(self, view: memoryview, offset: int) -> int:
        return self.path.read_range_into(view, offset, range_bytes=self.range_bytes)

    def close(self) -> None:
        """Nothing to close."""

    def __enter__(self) -> RemoteRanges:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
