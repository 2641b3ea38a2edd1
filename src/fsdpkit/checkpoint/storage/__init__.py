"""Where checkpoints live: a local directory or an fsspec URL (`s3://bucket/prefix`, `gs://...`,
`az://...`, `memory://...`), behind one protocol.

Read first: protocol.py (`StoragePath`: what the checkpoint code may ask of storage), then its two
implementations, local.py (`LocalPath`, a pathlib path) and remote.py (`RemotePath`, over fsspec).
`open_storage` returns the one a path or URL needs; the checkpoint code asks the object, never its
type.

Credentials and endpoint come from the environment (`AWS_*`, `AWS_ENDPOINT_URL`, profiles) and
from `checkpoint.storage_options` (e.g. `{endpoint_url: ...}`), never from a checkpoint. The options
are passed where a URL is opened (`open_storage(url, options)`) and travel with the `RemotePath`
(its `fs`) and every path derived from it: nothing here is process-wide, so two Checkpointers in
one process (a model and its EMA) each keep their own.

The rest of this package: urls.py (which strings are URLs), safe_fsspec.py (DCP's fsspec writer and
reader, with checksums and without pickle), multipart.py (parallel multipart uploads), mirror.py (a
local copy of what is uploaded, `checkpoint.local_dir`) and object_lock.py (one run per prefix).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import PurePath
from typing import Any

from fsdpkit.checkpoint.storage.local import LocalPath, fsync_path
from fsdpkit.checkpoint.storage.protocol import Lock, RangeReader, StoragePath
from fsdpkit.checkpoint.storage.remote import RemotePath, open_filesystem
from fsdpkit.checkpoint.storage.urls import URL, is_url

__all__ = ["LocalPath", "Lock", "RangeReader", "RemotePath", "StoragePath", "fsync_path", "is_url", "open_storage"]


def open_storage(url_or_path: str | os.PathLike | StoragePath,
                 storage_options: Mapping[str, Any] | None = None) -> StoragePath:
    """The StoragePath of a local path (a `LocalPath`; `file://` URLs count as local) or of an
    fsspec URL (a `RemotePath`, whose filesystem is opened with `storage_options`, e.g.
    endpoint_url or profile; None: the environment's settings only). One already opened is
    returned as it is (it keeps its own options)."""
    if isinstance(url_or_path, LocalPath | RemotePath):
        return url_or_path
    text = os.fspath(url_or_path) if isinstance(url_or_path, PurePath | os.PathLike) else str(url_or_path)
    if text.startswith("file://"):
        return LocalPath(text.removeprefix("file://"))
    if URL.match(text):
        return RemotePath(text, fs=open_filesystem(text, storage_options))
    return LocalPath(text)
