"""Exports to object storage (`fsdpkit ckpt export SRC s3://bucket/out`, `export.dir=s3://...`).

The export is written as to a local output, into a temporary directory (`TMPDIR`; it needs the
export's size in free disk, and the memory bound is the local export's), then uploaded file by
file (S3: overlapping multipart parts, checkpoint/storage/multipart.py). The output never looks complete before it
is: each object appears whole when its upload completes, and the objects that make a folder
loadable come last: the weight files, then `model.safetensors.index.json`, then
`generation_config.json`, then `config.json`. The same rules as for a local output hold: an
existing output is refused unless `overwrite`, and then only an earlier fsdpkit export is
replaced (its files named as an export names them, each safetensors file carrying the
`exported_by: fsdpkit` marker); the old objects are deleted first, `config.json` and the index
first (an object store has no rename: between the deletion and the upload the prefix holds no
loadable export). An output inside the source checkpoint's prefix is refused.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fsdpkit.checkpoint.errors import CheckpointError
from fsdpkit.checkpoint.storage import RemotePath, is_url, open_storage
from fsdpkit.export.destination import EXPORT_FILES, EXPORTED_BY, exported_by_value
from fsdpkit.export.hf_folder import CHAT_TEMPLATES_DIR
from fsdpkit.hf.safetensors_reader import INDEX_FILE, read_header

LAST = (INDEX_FILE, "generation_config.json", "config.json", "adapter_config.json")  # uploaded last, in order
UPLOAD_BLOCK_BYTES = 8 << 20  # read from the local file per write into the upload stream


def export_to(out: str | Path, export: Callable[[str | Path], dict[str, Any]], *, fmt: str, overwrite: bool,
              source: str | Path, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """`export(out)` for a local `out`; for a URL, `export_to_url` (exported locally, then uploaded)."""
    if not is_url(str(out)):
        return export(out)
    return export_to_url(str(out), export, fmt=fmt, overwrite=overwrite, source=source,
                         storage_options=storage_options)


def export_to_url(out: str, export: Callable[[Path], dict[str, Any]], *, fmt: str, overwrite: bool,
                  source: str | Path, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run `export(local_out)` into a temporary directory, then upload it to the URL `out`, opened
    with `storage_options` (fsspec options such as endpoint_url; None: the environment's).

    Raises:
        ValueError: `out` overlaps the source, or exists and may not be replaced (see the module).
    """
    dest = open_storage(out, storage_options)
    old = check_destination(dest, fmt=fmt, overwrite=overwrite, source=source)
    with tempfile.TemporaryDirectory(prefix="fsdpkit-export-") as tmp:
        local = Path(tmp) / dest.name
        report = export(local)
        # files in subfolders too: a tokenizer's additional_chat_templates/<name>.jinja
        files = (sorted((p for p in local.rglob("*") if p.is_file()), key=_upload_order) if local.is_dir()
                 else [local])
        for path in sorted(old, key=_upload_order, reverse=True):  # config.json and the index first
            path.unlink(missing_ok=True)
        for file in files:
            _upload(file, dest / file.relative_to(local).as_posix() if local.is_dir() else dest)
    return {**report, "out": dest.url}


def check_destination(dest: RemotePath, *, fmt: str, overwrite: bool, source: str | Path) -> list[RemotePath]:
    """The objects of an earlier export at `dest` that the export will replace (see the module).

    Raises:
        ValueError: `dest` overlaps the source, or holds something that may not be replaced.
    """
    if not is_url(dest):
        raise ValueError(f"{dest} is not a URL")
    _check_no_overlap(dest, source)
    old = _existing(dest, fmt=fmt)
    if old:
        _check_replaceable(dest, old, overwrite=overwrite)
    return old


def _upload_order(file: Path | RemotePath) -> tuple[int, str]:
    return (LAST.index(file.name) + 1 if file.name in LAST else 0, file.name)


def _existing(dest: RemotePath, *, fmt: str) -> list[RemotePath]:
    if fmt == "single":
        return [dest] if dest.is_file() else []
    return dest.walk_files()


def _check_no_overlap(dest: RemotePath, source: str | Path) -> None:
    if not is_url(source):
        return
    src = open_storage(source)
    if type(src.fs) is not type(dest.fs):
        return
    a, b = dest.key.rstrip("/") + "/", src.key.rstrip("/") + "/"
    if a.startswith(b) or b.startswith(a):
        raise ValueError(f"refusing to export to {dest}: it overlaps the source {src}; an export there could "
                         "overwrite or delete it. Choose a prefix outside the checkpoints")


def _check_replaceable(dest: RemotePath, old: list[RemotePath], *, overwrite: bool) -> None:
    if not overwrite:
        raise ValueError(f"{dest} already exists; pass --overwrite to replace it (only an earlier fsdpkit export is "
                         "replaced)")
    single = old == [dest]
    foreign = [p.url[len(dest.url) + 1:] for p in old if not _written_by_export(p, dest)]
    if foreign and not single:  # a folder holds only what an export writes
        raise ValueError(f"refusing to replace {dest}: it holds {', '.join(foreign[:5])}, which an export does not "
                         "write; choose another output, or remove it yourself")
    for weights in (p for p in old if single or p.name.endswith(".safetensors")):
        try:
            marker = read_header(weights).metadata.get(EXPORTED_BY, "")
        except (CheckpointError, OSError):
            marker = ""
        if not marker.startswith(exported_by_value("")):
            raise ValueError(f"refusing to replace {dest}: {weights} was not written by fsdpkit's export (its metadata "
                             f"has no `{EXPORTED_BY}: fsdpkit ...`); choose another output, or remove it yourself")


def _written_by_export(path: RemotePath, dest: RemotePath) -> bool:
    """Whether `path` (under `dest`) is named as an export names its files."""
    if path.parent == dest:
        return bool(EXPORT_FILES.match(path.name))
    return path.parent == dest / CHAT_TEMPLATES_DIR and path.name.endswith(".jinja")


def _upload(local: Path, remote: RemotePath) -> None:
    """One object, complete when this returns (S3: a multipart upload with overlapping parts)."""
    from fsdpkit.checkpoint.storage.multipart import OverlappedUpload, is_s3

    if not is_s3(remote.fs):
        remote.fs.put_file(str(local), remote.key)
        return
    upload = OverlappedUpload(remote.fs, remote.key)
    try:
        with local.open("rb") as f:
            while block := f.read(UPLOAD_BLOCK_BYTES):
                upload.write(block)
        upload.commit()
    except BaseException:
        upload.abort()
        raise

