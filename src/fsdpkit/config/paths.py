"""Where paths may go. fsdpkit reads and writes local (or mounted) filesystems only for now; a URL
such as s3://bucket/run would otherwise be taken as a local directory named `s3:`, and a run would
"checkpoint" to local disk while the user believes the bucket holds its checkpoints."""

from __future__ import annotations

import re

URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def refuse_url(value: str, *, setting: str) -> None:
    """Raise ValueError when `value` (the value of `setting`) is a URL rather than a local path."""
    if URL.match(value):
        scheme = value.split("://", 1)[0]
        raise ValueError(
            f"{setting}={value!r} is a {scheme}:// URL; this fsdpkit reads and writes local or mounted "
            "filesystems only (nothing would reach the remote store). Use a local path, or a mount of the "
            "bucket (e.g. s3fs/gcsfuse/blobfuse2), for now")
