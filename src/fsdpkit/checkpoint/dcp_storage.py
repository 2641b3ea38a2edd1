"""The safe DCP reader of a checkpoint directory: local (safe_io.py) or a URL (DCP's fsspec
reader, see safe_fsspec.py). Either reads `.metadata` without running code from it."""

from __future__ import annotations

from pathlib import Path

from torch.distributed.checkpoint.filesystem import FileSystemReader

from fsdpkit.checkpoint.safe_io import SafeFileSystemReader
from fsdpkit.checkpoint.storage import RemotePath


def safe_reader(ckpt_dir: Path | RemotePath) -> FileSystemReader:
    """A DCP reader of `ckpt_dir` that never runs code from its `.metadata`."""
    if isinstance(ckpt_dir, RemotePath):
        from fsdpkit.checkpoint.safe_fsspec import fsspec_reader

        return fsspec_reader(ckpt_dir)
    return SafeFileSystemReader(ckpt_dir)
