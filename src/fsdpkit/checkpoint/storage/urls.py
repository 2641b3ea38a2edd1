"""Which paths are URLs, and where a URL may go.

Checkpoint locations (checkpoint.dir, checkpoint.resume), the folder of model.init_from=hf: and
export destinations (export.dir, `fsdpkit ckpt export ... OUT`) may be fsspec URLs
(s3://bucket/run/checkpoints) when the scheme's driver is installed; every other path is local (or
mounted). A URL where only a local path works would otherwise be taken as a local directory named
`s3:`, and a run would write to local disk while the user believes the bucket holds its files.
"""

from __future__ import annotations

import os
import re

URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def is_url(value: str | os.PathLike) -> bool:
    """Whether `value` (a string, a path, or an opened storage location) names an fsspec URL."""
    return bool(URL.match(str(value)))


def refuse_url(value: str, *, setting: str) -> None:
    """Raise ValueError when `value` (the value of `setting`) is a URL rather than a local path."""
    if is_url(value):
        scheme = value.split("://", 1)[0]
        raise ValueError(
            f"{setting}={value!r} is a {scheme}:// URL; {setting} takes a local or mounted path only (nothing "
            "would reach the remote store; only checkpoint.dir, checkpoint.resume, model.init_from and export "
            "destinations take URLs). Use a local path, or a mount of the bucket (e.g. s3fs/gcsfuse/blobfuse2)")


def check_url(value: str, *, setting: str) -> None:
    """For settings that take URLs: raise ValueError when `value` is a URL whose scheme has no
    installed fsspec driver (checked without touching the network)."""
    if not is_url(value):
        return
    scheme = value.split("://", 1)[0]
    try:
        import fsspec

        fsspec.get_filesystem_class(scheme)
    except ImportError as e:
        raise ValueError(f"{setting}={value!r} needs the {scheme}:// driver, which is not installed ({e}); "
                         "pip install 'fsdpkit[remote]' (s3fs) or the scheme's fsspec package") from None
    except ValueError:
        raise ValueError(f"{setting}={value!r}: fsspec knows no {scheme}:// scheme; use s3://, gs://, az:// "
                         "or a local path") from None
