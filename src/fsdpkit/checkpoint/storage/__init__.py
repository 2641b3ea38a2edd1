"""Where checkpoints live: a local directory (the fast path, plain `pathlib.Path`) or an fsspec URL
(`s3://bucket/prefix`, `gs://...`, `az://...`, `memory://...`), as a `RemotePath`.

Why a path-shaped object rather than a new storage interface: the commit protocol, resolution,
verification and retention read and list checkpoints through a handful of `pathlib` methods
(`/`, `name`, `is_file`, `read_bytes`, `iterdir`, `stat().st_size`, `unlink`, `open`). `RemotePath`
implements exactly those over fsspec, so that code is the same for both. The few operations an
object store does not have (atomic rename, directory fsync, tmp-and-rename writes) go through the
functions at the bottom of this module, which keep the local behaviour byte for byte and say what
the remote one does instead:

- `write_atomic(path, data)`: local tmp + fsync + rename + directory fsync; remote one PUT (an
  object store shows a single PUT whole or not at all, never a mix).
- `remove_tree(path, first=...)`: the commit marker first, so an interrupted removal leaves no
  checkpoint.
- `move_tree(src, dst, last=...)`: local rename; remote copy every object (the marker last), then
  remove `src` (the marker first).

Credentials and endpoint come from the environment (`AWS_*`, `AWS_ENDPOINT_URL`, profiles) and
from `checkpoint.storage_options` (e.g. `{endpoint_url: ...}`), never from a checkpoint. The options
are passed where a URL is opened (`open_storage(url, options)`) and travel with the `RemotePath`
(its `fs`) and every path derived from it: nothing here is process-wide, so two Checkpointers in
one process (a model and its EMA) each keep their own. Listing caches are off: another rank or
process may have written since the last listing.

The rest of this package: safe_fsspec.py (DCP's fsspec writer and reader, with checksums and
without pickle), multipart.py (parallel multipart uploads), mirror.py (a local copy of what is
uploaded, `checkpoint.local_dir`) and object_lock.py (one run per directory, also on object storage).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import IO, Any

from omegaconf import DictConfig, OmegaConf

from fsdpkit import tunables
from fsdpkit.config.paths import URL


def is_url(value: str | os.PathLike) -> bool:
    return isinstance(value, RemotePath) or bool(URL.match(str(value)))


def _plain(options: Any) -> dict[str, Any]:
    """A plain, deep-copied dict (the config hands over DictConfigs)."""
    if isinstance(options, DictConfig):
        return OmegaConf.to_container(options, resolve=True)  # type: ignore[return-value]
    return json.loads(json.dumps(options or {}))


def _filesystem(url: str, options: dict[str, Any] | None = None):
    try:
        import fsspec
        from fsspec.core import split_protocol
    except ImportError:
        raise ValueError(f"{url} is a URL; reading or writing it needs fsspec and the scheme's driver: "
                         "pip install 'fsdpkit[remote]'") from None
    protocol, _ = split_protocol(url)
    opts = _plain(options)
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


def open_storage(url_or_path: str | os.PathLike, storage_options: dict[str, Any] | None = None) -> Path | RemotePath:
    """A local `Path` for a local path (the fast path: existing code, unchanged), a `RemotePath`
    for an fsspec URL (`file://` URLs count as local), whose filesystem is opened with
    `storage_options` (e.g. endpoint_url, profile; None: the environment's settings only)."""
    if isinstance(url_or_path, RemotePath):
        return url_or_path
    text = os.fspath(url_or_path)
    if text.startswith("file://"):
        return Path(text.removeprefix("file://"))
    if URL.match(text):
        return RemotePath(text, fs=_filesystem(text, storage_options))
    return Path(text)



class RemotePath:
    """The subset of `pathlib.Path` that checkpoint code uses, over an fsspec filesystem.
    Object stores have no directories: a "directory" is a key prefix, `mkdir` does nothing and
    `is_dir` is true when some object lies under the prefix."""

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
        return [RemotePath(f"{self.url.split('://', 1)[0]}://{key}", fs=self.fs)
                for key in self.fs.find(self.key)]

    def glob(self, pattern: str) -> list[RemotePath]:
        scheme = self.url.split("://", 1)[0]
        return [RemotePath(f"{scheme}://{key}", fs=self.fs) for key in self.fs.glob(f"{self.key}/{pattern}")]

    def mkdir(self, parents: bool = False, exist_ok: bool = False) -> None:
        """Nothing to do: prefixes exist once an object is written under them."""

    def stat(self) -> SimpleNamespace:
        info = self.fs.info(self.key)
        return SimpleNamespace(st_size=int(info["size"]))

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

    def read_range_into(self, view: memoryview, offset: int) -> int:
        """Fill `view` from byte `offset` with ranged GETs of at most FSDPKIT_REMOTE_RANGE_BYTES each
        (bounded memory); returns how many bytes the object had there (less than len(view): it ends early)."""
        done, most = 0, tunables.current().remote_range_bytes
        while done < len(view):
            data = self.read_range(offset + done, offset + min(len(view), done + most))
            if not data:
                break
            view[done:done + len(data)] = data
            done += len(data)
        return done

    def write_bytes(self, data: bytes) -> None:
        """One PUT: readers see the whole object or none of it."""
        self.fs.pipe_file(self.key, data)

    def write_text(self, text: str) -> None:
        self.write_bytes(text.encode())

    def unlink(self, missing_ok: bool = False) -> None:
        try:
            self.fs.rm_file(self.key)
        except FileNotFoundError:
            if not missing_ok:
                raise

    def open(self, mode: str = "rb", **kwargs: Any) -> IO[bytes]:
        """A file object; reads fetch FSDPKIT_REMOTE_OPEN_BLOCK_BYTES (1 MiB) ahead (s3fs would fetch 50 MiB after every
        seek, which parsing headers spread through a large object turns into gigabytes)."""
        if "r" in mode:
            kwargs.setdefault("block_size", tunables.current().remote_open_block_bytes)
        return self.fs.open(self.key, mode, **kwargs)


# -- the operations an object store lacks -------------------------------------------------------

def fsync_path(path: Path) -> None:
    """fsync a local file, or a directory (its entries: a rename or a new file in it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str | bytes) -> None:
    """Write `text` (or bytes, as they are) to the local `path` so that readers see the old content
    or the new, never a mix."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with tmp.open("wb" if isinstance(text, bytes) else "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # e.g. ENOSPC: leave no half-written temporary behind
        raise
    fsync_path(path.parent)


def write_atomic(path: Path | RemotePath, text: str | bytes) -> None:
    """Replace `path`'s content so readers see the old content or the new, never a mix: locally
    tmp + fsync + rename + directory fsync, remotely one PUT."""
    if isinstance(path, RemotePath):
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
    else:
        atomic_write_text(path, text)


def remove_tree(path: Path | RemotePath, *, first: str | None = None) -> None:
    """Delete a directory (prefix) and everything in it, the file named `first` before the rest.
    Missing paths are fine."""
    if first is not None:
        (path / first).unlink(missing_ok=True)
    if isinstance(path, RemotePath):
        files = path.walk_files()
        if files:
            path.fs.rm([f.key for f in files])
    else:
        shutil.rmtree(path, ignore_errors=True)


def move_tree(src: Path | RemotePath, dst: Path | RemotePath, *, last: str | None = None) -> None:
    """Move a directory (or one file) to `dst`. Locally one rename (atomic). Remotely copy every
    object, the one named `last` last, then remove `src`, that one first: when `last` is the commit
    marker, at every moment at least one of the two is whole and committed."""
    if not isinstance(src, RemotePath):
        os.rename(src, dst)
        fsync_path(Path(dst).parent)
        return
    if not isinstance(dst, RemotePath):
        raise ValueError(f"cannot move {src} to the local {dst}")
    if src.is_file():
        src.fs.copy(src.key, dst.key)
        src.unlink()
        return
    files = sorted(src.walk_files(), key=lambda f: f.name == last)
    for f in files:
        src.fs.copy(f.key, (dst / f.key[len(src.key):].lstrip("/")).key)
    remove_tree(src, first=last)
