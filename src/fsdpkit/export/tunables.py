"""Every tunable of export, import and inspection, with environment overrides (tests shrink them
to reach the multi-block and multi-shard paths with tiny models)."""

from __future__ import annotations

import os
import re

BLOCK_BYTES = int(os.environ.get("FSDPKIT_EXPORT_BLOCK_BYTES", str(16 << 20)))
"""Largest piece of a tensor read, converted and written at a time. Peak memory is about
3 x READ_AHEAD + WRITE_THREADS + 3 such buffers (READ_AHEAD + 2 more when converting dtypes: read
rings, a bounce buffer per read thread for O_DIRECT, WRITE_THREADS + 1 write buffers), whatever the model size."""

READ_AHEAD = int(os.environ.get("FSDPKIT_EXPORT_READ_AHEAD", "4"))
"""Blocks read ahead, in parallel threads, while the current one is written (at least 1). Four
keep an O_DIRECT read queue deep enough (2 GiB on a 2-core VM: 2.4-2.6 s with 4, 2.9 s with 2 on
one day; on a par, 3.1 s, on another, when reads and writes shared the disk's budget)."""

WRITE_THREADS = int(os.environ.get("FSDPKIT_EXPORT_WRITE_THREADS", "2"))
"""O_DIRECT blocks of an output file written at once, on as many threads, while the next is filled
(an O_DIRECT write returns only once the device has the bytes)."""

DIRECT_IO = os.environ.get("FSDPKIT_EXPORT_DIRECT_IO", "1") != "0"
"""Export reads and writes with O_DIRECT where the file system takes it (fsdpkit.checkpoint.direct_io;
FSDPKIT_DIRECT_IO=0 turns it off for checkpoint writes too)."""

FLUSH_BYTES = int(os.environ.get("FSDPKIT_EXPORT_FLUSH_BYTES", str(128 << 20)))
"""Writes through the page cache only (where O_DIRECT is off or refused, fsdpkit.checkpoint.direct_io):
start the disk write-back of an output file every this many bytes (posix_fadvise DONTNEED, which
does not wait), so that flushing overlaps reading instead of all happening in the final fsync;
0 leaves it all to the final fsync."""

DEFAULT_MAX_SHARD_SIZE = os.environ.get("FSDPKIT_EXPORT_MAX_SHARD_SIZE", "5GB")
"""Largest output safetensors file of an `hf` export (a tensor larger than this gets a file of its own)."""

VERIFY_THREADS = int(os.environ.get("FSDPKIT_VERIFY_THREADS", "4"))
"""Threads that recompute file checksums in `fsdpkit ckpt verify`."""

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str | int) -> int:
    """'5GB' -> 5e9, '500MiB' -> 500 * 2**20, 1024 -> 1024 (decimal units, as Hugging Face uses).

    Raises:
        ValueError: not a positive size.
    """
    if isinstance(text, int):
        value = text
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
        if not match or match.group(2).upper() not in _UNITS:
            raise ValueError(f"cannot read {text!r} as a size; write e.g. 5GB, 500MB, 2GiB or a number of bytes")
        value = int(float(match.group(1)) * _UNITS[match.group(2).upper()])
    if value <= 0:
        raise ValueError(f"a size must be positive, got {text!r}")
    return value
