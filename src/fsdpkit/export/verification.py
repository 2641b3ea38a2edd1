"""`fsdpkit ckpt verify`: is every byte of a checkpoint there and as it was written?

1. Checksums (fsdpkit checkpoints): every file's size and xxh3-64 recomputed and compared with
   the manifest, files spread over threads (fsdpkit.checkpoint.resume.verify_files).
2. Structure (any DCP checkpoint): the chunks of every tensor tile its shape; every chunk and
   non-tensor item listed in `.metadata` has a storage entry whose byte range lies inside an
   existing file; each chunk's `torch.save` blob is a well-formed archive holding the dtype and
   shape the metadata promises (zip directory and a vetted data.pkl only: nothing unpickled
   beyond the allow-lists). Safetensors files: headers parse and sizes add up.
3. Optionally (`tensors=True`), every tensor's world-size-independent checksum recomputed from
   the data and compared with the manifest's.

Only checksums tell a changed value from the saved one: a plain DCP or safetensors checkpoint with a
flipped bit inside a tensor passes every structural check. The report says whether tensor values
were checked (`values_checked`), so that a verdict never claims more than was looked at.

It speaks fsdpkit first: a `latest` pointer that cannot be followed, and a directory that fsdpkit
writes but never committed (no manifest.json; see fsdpkit.export.locate), are problems named as
such, never checked as if they were plain DCP directories.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata

from fsdpkit import tunables
from fsdpkit.checkpoint.catalog import LatestPointerError
from fsdpkit.checkpoint.errors import CheckpointError
from fsdpkit.checkpoint.frozen import SHARED, file_sets
from fsdpkit.checkpoint.hashing import LINEAR, MASK64, hash_part
from fsdpkit.checkpoint.layout import LATEST, MANIFEST
from fsdpkit.checkpoint.manifest import read_manifest
from fsdpkit.checkpoint.resume import verify_files
from fsdpkit.checkpoint.safe_io import METADATA_FILENAME, read_dcp_metadata
from fsdpkit.export.locate import (
    ACCELERATE_MODEL,
    accelerate_part,
    is_uncommitted_fsdpkit_dir,
    locate_checkpoint,
    not_committed_message,
)
from fsdpkit.export.sources import Chunk, DcpSource, chunk_problems, iter_row_blocks, with_shared
from fsdpkit.hf.safetensors_reader import INDEX_FILE, read_header, safetensors_files


class _Problems:
    """Problems, each attributed to the file it concerns (or to the checkpoint as a whole)."""

    def __init__(self) -> None:
        self.items: list[tuple[str, str]] = []

    def add(self, file: str, text: str) -> None:
        self.items.append((file, text))

    def bad_files(self) -> list[str]:
        return sorted({f for f, _ in self.items if f})


def _checksum_problems(ckpt: Path, manifest: dict[str, Any], problems: _Problems, *, threads: int) -> set[str]:
    """Recompute every recorded file checksum; returns the names of files that failed."""
    failed = set()
    names = {str(directory / n): n if directory == ckpt else f"{SHARED}/{directory.name}/{n}"
             for directory, files in file_sets(ckpt, manifest) for n in files}
    for text in verify_files(ckpt, manifest, threads=threads):
        name = next((n for path, n in names.items() if text.startswith(f"{path} ")), "")
        problems.add(name, text)
        failed.add(name)
    return failed


def extent_problem(path: Path, items: list[tuple[str, _StorageInfo]]) -> str | None:
    """Why the byte ranges `items` ((key, storage entry) pairs, all in the file `path`) do not
    all lie inside that file (None: they do)."""
    if not path.is_file():
        return f"{path} is missing ({len(items)} item(s) of the metadata live there)"
    size = path.stat().st_size
    beyond = [(k, s) for k, s in items if s.offset + s.length > size]
    if not beyond:
        return None
    k, s = min(beyond, key=lambda item: item[1].offset)
    return (f"{path} is truncated: {len(beyond)} item(s) lie beyond its end ({size} bytes), first {k} "
            f"at bytes {s.offset}..{s.offset + s.length}")


def extent_problems(ckpt: Path, metadata: Metadata, elsewhere: dict[str, Path] | None = None) -> list[str]:
    """Every file of the DCP checkpoint `ckpt` checked against the byte ranges its metadata lists
    there (tensor chunks and pickled items alike): sizes only, no data read. `elsewhere`: files
    that lie outside `ckpt` (sources.with_shared), by their name in the metadata."""
    by_file: dict[str, list[tuple[str, _StorageInfo]]] = defaultdict(list)
    for index, storage in (metadata.storage_data or {}).items():
        by_file[storage.relative_path].append((index.fqn, storage))
    where = elsewhere or {}
    return [text for name in sorted(by_file)
            if (text := extent_problem(where.get(name) or ckpt / name, by_file[name]))]


def _dcp_structure(ckpt: Path, problems: _Problems, *, threads: int, skip: frozenset[str] = frozenset(),
                   label: str = "") -> int:
    """Structural checks of a DCP directory (files in `skip` already failed: not re-reported;
    problems are filed under `label` + the file's name); returns the number of chunks checked."""
    try:
        metadata = read_dcp_metadata(ckpt)
    except CheckpointError as exc:  # unreadable or crafted: named, nothing run
        problems.add(label + METADATA_FILENAME, str(exc))
        return 0
    by_file: dict[str, list[tuple[str, Any, Any]]] = defaultdict(list)
    for key, item in metadata.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            for text in chunk_problems(key, item):
                problems.add(label + METADATA_FILENAME, text)
            entries = [(MetadataIndex(key, c.offsets),
                        tuple(c.sizes)) for c in item.chunks if all(c.sizes) or not c.sizes]
        else:
            entries = [(MetadataIndex(key), None)]
        for index, sizes in entries:
            storage = metadata.storage_data.get(index)
            if storage is None:
                problems.add(label + METADATA_FILENAME,
                             f"{key} at {list(index.offset or [])} is listed but no file holds it")
                continue
            by_file[storage.relative_path].append((key, sizes, Chunk(tuple(index.offset or ()), sizes or (), storage)))

    def check_file(name: str) -> list[str]:
        path = ckpt / name
        problem = extent_problem(path, [(k, c.storage) for k, _, c in by_file[name]])
        if problem:
            return [problem]
        source = DcpSource(ckpt, metadata=metadata)
        found = []
        try:
            for key, sizes, chunk in by_file[name]:
                if sizes is None:  # a pickled item: its byte range was checked, its content is never loaded
                    continue
                try:
                    source.payload(key, chunk)
                except CheckpointError as exc:
                    found.append(f"{path}: {exc}")
        finally:
            source.close()
        return found

    names = sorted(n for n in by_file if label + n not in skip)
    with ThreadPoolExecutor(max_workers=threads) as pool:
        for name, found in zip(names, pool.map(check_file, names), strict=True):
            for text in found:
                problems.add(label + name, text)
    return sum(len(v) for v in by_file.values())


def _tensor_checksums(ckpt: Path, manifest: dict[str, Any], problems: _Problems, *, threads: int) -> int:
    """Recompute the manifest's per-tensor checksums from the data, tensor by tensor, with the
    algorithm the checkpoint was saved with (row blocks hash independently: see hashing.py)."""
    opened = with_shared(ckpt, manifest) if manifest.get(SHARED) else DcpSource(ckpt)
    metadata, elsewhere = opened.metadata, opened.elsewhere
    opened.close()
    keys = sorted(manifest.get("tensors", {}))
    algorithm = manifest.get("tensor_hash", LINEAR)  # checkpoints from before it was recorded used `linear`

    def check(shard: list[str]) -> list[tuple[str, str]]:
        source = DcpSource(ckpt, metadata=metadata, files=elsewhere)
        tensors, found = source.tensors(), []
        try:
            for key in shard:
                if key not in tensors:
                    found.append((METADATA_FILENAME, f"{key} has a checksum in {MANIFEST} but is not in the metadata"))
                    continue
                info, total = tensors[key], 0
                for a, b in iter_row_blocks(info, block_bytes=tunables.current().export_block_bytes):
                    total += hash_part(source.read_rows(key, a, b), first_row=a, algorithm=algorithm)
                digest, expected = f"{total & MASK64:016x}", manifest["tensors"][key]["hash"]
                if digest != expected:
                    files = sorted({c.storage.relative_path for c in source.chunks(key)})
                    found.append((",".join(files), f"{key}: tensor checksum {digest}, the manifest says {expected} "
                                                   f"(data in {', '.join(files)} changed)"))
        finally:
            source.close()
        return found

    with ThreadPoolExecutor(max_workers=threads) as pool:
        for found in pool.map(check, [keys[i::threads] for i in range(threads)]):
            for file, text in found:
                problems.add(file, text)
    return len(keys)


def _safetensors_structure(folder: Path, files: list[Path], problems: _Problems) -> None:
    for file in files:
        if not file.is_file():
            problems.add(file.name, f"{file} is missing")
            continue
        try:
            header = read_header(file)
        except CheckpointError as exc:
            problems.add(file.name, str(exc))
            continue
        if (folder / INDEX_FILE).is_file():
            weight_map = json.loads((folder / INDEX_FILE).read_text())["weight_map"]
            listed = {k for k, f in weight_map.items() if f == file.name}
            if listed != set(header.tensors):
                problems.add(file.name, f"{file} holds {len(header.tensors)} tensors, the index assigns it "
                                        f"{len(listed)}")


def verify_checkpoint(path: str | os.PathLike, *, threads: int | None = None, tensors: bool = False) -> dict[str, Any]:
    """Verify a checkpoint; never raises for what it finds, only for a path that is no checkpoint.

    A `latest` pointer that cannot be followed and an fsdpkit checkpoint that was never
    committed (a directory fsdpkit writes, without manifest.json) are problems it finds.
    `threads`: parallel checks (default FSDPKIT_VERIFY_THREADS).

    Returns:
        {"path", "kind", "ok", "problems": [...], "bad_files": [...], "checked": {...}, "checksums": str,
        "values_checked": bool (every byte was compared with recorded checksums; False: structure only)}
    Raises:
        FileNotFoundError: nothing checkpoint-like at `path`.
    """
    try:
        located = locate_checkpoint(path)
    except LatestPointerError as exc:
        return {"path": str(path), "kind": "fsdpkit", "ok": False, "problems": [str(exc)], "bad_files": [LATEST],
                "checked": {}, "checksums": "none: no checkpoint to check", "values_checked": False, "notes": []}
    threads = tunables.current().verify_threads if threads is None else threads
    report = _verify_one(located.path, threads=threads, tensors=tensors)
    optimizer = accelerate_part(located.path.parent, "optimizer")
    if located.path.name == ACCELERATE_MODEL.format(0) and optimizer is not None:  # Accelerate: its optimizer too
        other = _verify_one(optimizer, threads=threads, tensors=tensors)
        report["problems"] += other["problems"]
        report["bad_files"] += [f"{optimizer.name}/{f}" for f in other["bad_files"]]
        report["checked"] = {k: report["checked"].get(k, 0) + other["checked"].get(k, 0)
                             for k in report["checked"].keys() | other["checked"].keys()}
        report["ok"] = report["ok"] and other["ok"]
        report["values_checked"] = report["values_checked"] and other["values_checked"]
        report["path"] = f"{located.path} and {optimizer}"
    report["notes"] = located.notes
    return report


def _verify_one(ckpt: Path, *, threads: int, tensors: bool) -> dict[str, Any]:
    problems = _Problems()
    checked: dict[str, int] = {}
    checksums = "none recorded"
    values_checked = False
    if is_uncommitted_fsdpkit_dir(ckpt):
        kind = "fsdpkit"
        checksums = "none: the checkpoint was never committed"
        problems.add(MANIFEST, not_committed_message(ckpt))
    elif ckpt.is_file():
        kind = "safetensors"
        checksums = "none recorded (safetensors): header and size checked only"
        _safetensors_structure(ckpt.parent, [ckpt], problems)
        checked["files"] = 1
    elif (ckpt / MANIFEST).is_file():
        kind = "fsdpkit"
        try:
            manifest = read_manifest(ckpt)
        except CheckpointError as exc:
            problems.add(MANIFEST, str(exc))
            checksums = f"none checked: {MANIFEST}, which holds them, cannot be trusted"
            manifest = None
        if manifest is not None:
            failed = _checksum_problems(ckpt, manifest, problems, threads=threads)
            sets = file_sets(ckpt, manifest)
            checked["files"] = sum(len(files) for _, files in sets)
            checksums = f"recomputed for {checked['files']} files"
            if len(sets) > 1:
                checksums += f" ({checked['files'] - len(manifest['files'])} of them shared: frozen tensors)"
            values_checked = True  # every byte of every file, tensor data included
            if manifest.get("state_dict_type", "sharded") == "full":
                kind = "fsdpkit-full"
                stored = [ckpt / n for n in manifest["files"] if n.endswith(".safetensors") and n not in failed]
                _safetensors_structure(ckpt, stored, problems)
            elif METADATA_FILENAME not in failed:
                checked["chunks"] = _dcp_structure(ckpt, problems, threads=threads, skip=frozenset(failed))
                for directory, _ in sets[1:]:  # the shared directories it references
                    label = f"{SHARED}/{directory.name}/"
                    if label + METADATA_FILENAME not in failed:
                        checked["chunks"] += _dcp_structure(directory, problems, threads=threads,
                                                            skip=frozenset(failed), label=label)
                if tensors and not problems.items:
                    checked["tensor_checksums"] = _tensor_checksums(ckpt, manifest, problems, threads=threads)
                    checksums += f" and {checked['tensor_checksums']} tensors"
    elif (ckpt / METADATA_FILENAME).is_file():
        kind = "dcp"
        checksums = "none recorded (plain DCP checkpoint): structure checked only"
        checked["chunks"] = _dcp_structure(ckpt, problems, threads=threads)
    else:
        kind = "safetensors"
        try:
            files = safetensors_files(ckpt)
        except CheckpointError as exc:
            problems.add(INDEX_FILE, str(exc))
            files = []
        checksums = "none recorded (safetensors): headers and sizes checked only"
        _safetensors_structure(ckpt, files, problems)
        checked["files"] = len(files)
    return {"path": str(ckpt), "kind": kind, "ok": not problems.items, "problems": [t for _, t in problems.items],
            "bad_files": problems.bad_files(), "checked": checked, "checksums": checksums,
            "values_checked": values_checked}
