"""Export a checkpoint's model weights as safetensors, streaming, in one process.

Tensors are read a block of rows at a time (FSDPKIT_EXPORT_BLOCK_BYTES, 16 MiB), converted to the
output dtype and appended to the output file, with the next FSDPKIT_EXPORT_READ_AHEAD blocks read on
as many threads while the current one is written (local files are read with pread and written
with ordinary writes, then fsynced; the tunables are in fsdpkit.tunables). Peak memory is a few
blocks whatever the model size: a ring of READ_AHEAD + 2 of them, and as many more when converting
dtypes. Tensors that transformers stores in another layout than it holds in memory (fused MoE
experts, see fsdpkit.export.hub_layout) are the exception: each is read whole, one group at a time,
and converted by transformers' own reverse operations, so the files hold what `save_pretrained`
writes. The output (weights, config.json,
generation_config.json, the tokenizer: fsdpkit.export.hf_folder) is written under a temporary name
beside the target and renamed into place when complete (files fsynced first), so a reader never
sees half an export.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections import Counter, deque
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fsdpkit import __version__, tunables
from fsdpkit.checkpoint.errors import CheckpointCorruptError
from fsdpkit.checkpoint.manifest import check_files_present, dtype_name
from fsdpkit.checkpoint.resume import verify_files
from fsdpkit.checkpoint.storage import fsync_path
from fsdpkit.config.schema import ExportConfig
from fsdpkit.export.destination import (
    EXPORTED_BY,
    check_no_overlap,
    check_replaceable,
    exported_by_value,
    protected_paths,
)
from fsdpkit.export.expected_model import ExpectedModel, load_expected_model
from fsdpkit.export.hf_config import transformers_config
from fsdpkit.export.hf_folder import write_folder_files, write_json
from fsdpkit.export.hub_layout import (
    ConvertedGroup,
    HubLayout,
    meta_model_from_config,
    plan_hub_layout,
)
from fsdpkit.export.keys import is_non_model_namespace
from fsdpkit.export.naming import plan_names
from fsdpkit.export.safetensors_writer import StreamingSafetensorsWriter, plan_shards, shard_file_name
from fsdpkit.export.sources import OpenedCheckpoint, TensorInfo, iter_row_blocks, open_checkpoint
from fsdpkit.export.verification import extent_problems
from fsdpkit.hf.safetensors_reader import INDEX_FILE, SINGLE_FILE
from fsdpkit.tunables import parse_size

FORMATS = ("hf", "single")
DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "fp32": torch.float32, "float32": torch.float32}


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """`bf16`/`fp16`/`fp32` (or a torch floating dtype) -> torch.dtype; None keeps the stored dtype."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of bf16, fp16, fp32, got {dtype!r}")
    return DTYPES[dtype]


def export_checkpoint(
    ckpt: str | os.PathLike,
    out: str | os.PathLike,
    *,
    dtype: str | torch.dtype | None = None,
    max_shard_size: int | str = ExportConfig.max_shard_size,
    fmt: str = "hf",
    namespace: str | None = None,
    strip_prefixes: Sequence[str] = (),
    add_prefix: str = "",
    reader: str = "direct",
    overwrite: bool = False,
    write_config: bool = True,
    config: str | os.PathLike | None = None,
    verify: bool = False,
    block_bytes: int | None = None,
    run_dirs: Sequence[str | os.PathLike] = (),
    hub_layout: bool = True,
) -> dict[str, Any]:
    """Write the model weights of `ckpt` to `out` as safetensors; one process, no process group.

    Args:
        ckpt: an fsdpkit checkpoint (sharded or `state_dict_type=full`), a checkpoints or run
            directory (its `latest` is used), a plain DCP directory, an Accelerate save_state
            folder, a folder of step directories (the newest is used) or a safetensors folder/file.
        out: `fmt="hf"`: a directory that gets `model.safetensors` (or `model-0000X-of-0000N`
            shards and `model.safetensors.index.json` above `max_shard_size`), plus `config.json`
            and `generation_config.json` when the run config is known, and the run's tokenizer
            (fsdpkit.export.hf_folder). `fmt="single"`: one file.
        dtype: `bf16`, `fp16` or `fp32` for floating tensors (integer tensors are never cast);
            None keeps what the checkpoint stores (fp32 master weights for fsdpkit runs).
        max_shard_size: bytes or a size such as `5GB` (hf format only).
        namespace, strip_prefixes, add_prefix: which tensors are the model's and how to rename
            them (see fsdpkit.export.keys); wrapper components are always removed. Without
            strip_prefixes or add_prefix, a prefix that is not the model's is detected and
            stripped (fsdpkit.export.naming); strip_prefixes=[""] turns that off. A namespace of
            optimizer state is refused for fmt="hf" (it would pass for model weights).
        reader: `direct` (byte ranges) or `dcp` (through dcp.load) for DCP checkpoints.
        overwrite: replace an existing `out`, only once the new export is complete, and only when
            it is an earlier fsdpkit export (see fsdpkit.export.destination); anything else there
            is never deleted.
        write_config: write config.json/generation_config.json (hf format, when the run config is
            known). The tokenizer is written either way.
        config: a Hugging Face config.json or model folder: its config.json (and
            generation_config.json) are written into the export, and the names are checked against
            (and tied tensors written as in) the model transformers builds from it.
        verify: first recompute every file checksum of an fsdpkit checkpoint (one more read of
            it); without it, every file is only checked to be present and long enough: with its
            recorded size (fsdpkit) or holding every byte range the DCP metadata lists (any DCP).
        block_bytes: a tensor is read, converted and written this many bytes at a time (default
            FSDPKIT_EXPORT_BLOCK_BYTES).
        run_dirs: run directories `out` must not be or contain, besides the one found above the
            checkpoint (training passes its own).
        hub_layout: when the model is known (a `model.kind=hf` run, or `config`), write the names
            and layouts `save_pretrained` writes (fsdpkit.export.hub_layout); False keeps those of
            `model.state_dict()` that the checkpoint holds.
    Returns:
        A report: files written, tensors, dtypes and why they differ from the checkpoint, what
        was dropped (a tied lm_head), config notes, the files added beside the weights (`added`)
        and those that could not be (`not_added`, each with how to add it), timing.
    Raises:
        ValueError: bad options; `out` overlaps the checkpoint, its checkpoints root or the run
            directory; or `out` exists and is not an earlier export that `overwrite` may replace.
        FileNotFoundError: no checkpoint at `ckpt`.
        CheckpointError: an uncommitted, incomplete, corrupt or unsafe checkpoint.
    """
    if fmt not in FORMATS:
        raise ValueError(f"--format must be `hf` or `single`, got {fmt!r}")
    target = parse_dtype(dtype)
    shard_limit = parse_size(max_shard_size)
    out = Path(out)
    part = _check_namespace(namespace, fmt=fmt, out=out)
    if config is not None and fmt != "hf":
        raise ValueError("--config writes config.json into a Hugging Face folder: use it with --format hf")
    expected_model = load_expected_model(config) if config is not None else None
    t0 = time.perf_counter()
    with open_checkpoint(ckpt, reader=reader, part=part) as opened:
        _check_destination(out, fmt=fmt, overwrite=overwrite,
                           protected=protected_paths(opened.path, run_dirs=[Path(d) for d in run_dirs]))
        _check_integrity(opened, verify=verify)
        tensors = opened.source.tensors()
        plan = plan_names(opened, namespace=namespace, strip_prefixes=tuple(strip_prefixes), add_prefix=add_prefix,
                          expected_model=expected_model)
        names, dropped = plan.names, plan.dropped
        layout = plan_hub_layout(_layout_model(opened, expected_model) if hub_layout else None,
                                 {name: tensors[key] for name, key in names.items()})
        items = _output_items(names, tensors, layout)
        out_dtypes = {name: _out_dtype(item.info.dtype, target) for name, item in items.items()}
        sizes = [(name, TensorInfo(item.info.shape, out_dtypes[name]).nbytes) for name, item in items.items()]
        total = sum(n for _, n in sizes)
        groups, files = _plan_files(sizes, out=out, fmt=fmt, total=total, shard_limit=shard_limit)
        tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
        folder_files = None
        try:
            written = _write_files(opened, names, items, layout, out_dtypes, groups, files,
                                   tmp_dir=tmp if fmt == "hf" else None, tmp_file=tmp if fmt == "single" else None,
                                   block_bytes=block_bytes or tunables.current().export_block_bytes)
            if fmt == "hf":
                if len(groups) > 1:
                    weight_map = {name: file for group, file in zip(groups, files, strict=True) for name in group}
                    write_json(tmp / INDEX_FILE,
                               {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})
                folder_files = write_folder_files(tmp, opened, target=target, out_dtypes=out_dtypes,
                                                  expected_model=expected_model, out=out, write_config=write_config)
                fsync_path(tmp)
            _publish(tmp, out, overwrite=overwrite)
        except BaseException:
            if tmp.is_dir():
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                tmp.unlink(missing_ok=True)
            raise
        seconds = time.perf_counter() - t0
        read_bytes = sum(tensors[key].nbytes for key in names.values())
        return {
            "source": str(opened.path),
            "source_kind": opened.kind,
            "step": (opened.manifest or {}).get("step"),
            "out": str(out),
            "format": fmt,
            "files": written,
            "index": INDEX_FILE if fmt == "hf" and len(groups) > 1 else None,
            "num_tensors": len(items),
            "total_size": total,
            "dtypes": dict(Counter(dtype_name(d) for d in out_dtypes.values())),
            "source_dtypes": dict(Counter(dtype_name(tensors[k].dtype) for k in names.values())),
            "dtype_note": _dtype_note(opened, target, {tensors[k].dtype for k in names.values()}),
            "dropped": dropped,
            "notes": [*opened.notes, *plan.notes,
                      *([expected_model.note] if expected_model and expected_model.note else []),
                      *([layout.note] if layout.note else [])],
            "config": folder_files.config if folder_files else "",
            "added": folder_files.added if folder_files else [],
            "not_added": folder_files.not_added if folder_files else [],
            "seconds": seconds,
            "read_bytes": read_bytes,
            "gb_per_s": read_bytes / seconds / 1e9 if seconds else None,
        }


def _check_integrity(opened: OpenedCheckpoint, *, verify: bool) -> None:
    """fsdpkit checkpoints: every file present with its recorded size (and checksum, if `verify`).
    Any DCP checkpoint (plain ones carry no sizes or checksums): every file holds every byte
    range its metadata lists, optimizer state included, though only the model is read."""
    problems = []
    if opened.manifest is not None:
        problems = check_files_present(opened.path, opened.manifest)
        if verify and not problems:
            problems = verify_files(opened.path, opened.manifest, threads=tunables.current().verify_threads)
    if not problems and opened.kind in ("fsdpkit", "dcp"):  # DcpSource and DcpLoadSource
        problems = extent_problems(opened.path, opened.source.metadata, getattr(opened.source, "elsewhere", None))
    if problems:
        raise CheckpointCorruptError(f"{opened.path} failed verification; nothing was exported:\n  "
                                     + "\n  ".join(problems)
                                     + f"\n(`fsdpkit ckpt verify {opened.path}` checks it in full)")


def _plan_files(sizes: list[tuple[str, int]], *, out: Path, fmt: str, total: int,
                shard_limit: int) -> tuple[list[list[str]], list[str]]:
    """(tensor names per file, file names): one file, or Hugging Face shards above the limit."""
    if fmt == "single":
        return [[n for n, _ in sizes]], [out.name]
    if total <= shard_limit:
        return [[n for n, _ in sizes]], [SINGLE_FILE]
    groups = plan_shards(sizes, max_shard_size=shard_limit)
    return groups, [shard_file_name(i + 1, len(groups)) for i in range(len(groups))]


def _check_destination(out: Path, *, fmt: str, overwrite: bool, protected: list[tuple[str, Path, bool]]) -> None:
    if fmt == "single" and out.is_dir():
        raise ValueError(f"{out} is a directory; --format single writes one file: give a file path such as "
                         f"{out / SINGLE_FILE}")
    if fmt == "hf" and out.is_file():
        raise ValueError(f"{out} is a file; --format hf writes a directory")
    check_no_overlap(out, protected)
    check_replaceable(out, overwrite=overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)


def _out_dtype(stored: torch.dtype, target: torch.dtype | None) -> torch.dtype:
    return target if target is not None and stored.is_floating_point else stored


class _BlockBuffers:
    """A few fixed buffers that blocks are read (and converted) into, reused round-robin.

    Why not a fresh tensor per block: blocks are allocated on the read-ahead threads and freed on
    the writing thread, and glibc then keeps much of that memory in its arenas; reusing fixed
    buffers keeps the resident size flat, whatever the number of blocks.
    """

    def __init__(self, count: int, nbytes: int) -> None:
        self._count, self._nbytes = count, nbytes
        self._raw: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def view(self, index: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        numel = 1
        for s in shape:
            numel *= s
        nbytes = numel * dtype.itemsize
        if nbytes > self._nbytes:  # one row larger than a block: a buffer of its own
            return torch.empty(shape, dtype=dtype)
        with self._lock:  # allocated on first use (a ring that is never needed costs nothing)
            while len(self._raw) < self._count:
                self._raw.append(torch.empty(self._nbytes, dtype=torch.uint8))
        return self._raw[index % self._count][:nbytes].view(dtype).view(shape)


def _prefetched(opened: OpenedCheckpoint, jobs: list[tuple[str, int, int, torch.dtype]], *, block_bytes: int,
                read_ahead: int | None = None) -> Iterator[torch.Tensor]:
    """The row blocks `jobs` name, converted, with the next `read_ahead` ones read (and converted)
    in parallel threads meanwhile.

    At most read_ahead + 1 blocks are alive at once (the one the caller writes and those being
    read), so rings of read_ahead + 2 buffers leave one spare; a block must be consumed before
    asking for the next.
    """
    tensors = opened.source.tensors()
    depth = max(1, tunables.current().export_read_ahead if read_ahead is None else read_ahead)
    raw, converted = _BlockBuffers(depth + 2, block_bytes), _BlockBuffers(depth + 2, block_bytes)

    def load(i: int) -> torch.Tensor:
        key, start, stop, out_dtype = jobs[i]
        info = tensors[key]
        shape = (stop - start, *info.shape[1:]) if info.shape else ()
        block = opened.source.read_rows(key, start, stop, out=raw.view(i, shape, info.dtype))
        if block.dtype == out_dtype:
            return block
        return converted.view(i, shape, out_dtype).copy_(block)

    if not jobs:
        return
    with ThreadPoolExecutor(max_workers=depth, thread_name_prefix="fsdpkit-export-read") as pool:
        ahead = deque(pool.submit(load, i) for i in range(min(depth, len(jobs))))
        for i in range(len(jobs)):
            block = ahead.popleft().result()
            if i + depth < len(jobs):
                ahead.append(pool.submit(load, i + depth))
            yield block
            del block


@dataclass
class _OutputItem:
    """One tensor of the export: its stored shape and dtype, and where its data comes from."""

    info: TensorInfo
    key: str | None = None  # streamed from this checkpoint key, a block of rows at a time
    group: int | None = None  # or produced by converting layout.groups[group] (read whole)


def _layout_model(opened: OpenedCheckpoint, expected_model: ExpectedModel | None) -> Any:
    """The transformers model (meta device) whose save layout the export writes, or None: the one
    --config describes, else the one a `model.kind=hf` run trained (from `model.hf_config`)."""
    if expected_model is not None:
        return expected_model.model
    model_cfg = ((opened.manifest or {}).get("config") or {}).get("model") or {}
    if model_cfg.get("kind") != "hf":
        return None  # fsdpkit's reference Llama: its names are LlamaForCausalLM's files' already
    try:
        import transformers  # noqa: F401
    except ImportError:
        return None
    return meta_model_from_config(transformers_config(model_cfg))


def _output_items(names: dict[str, str], tensors: dict[str, TensorInfo], layout: HubLayout) -> dict[str, _OutputItem]:
    """Output name -> item, in the checkpoint's order; a converted group's outputs together, where
    its first input was (so that one group at a time is held while writing)."""
    renamed = {mem: out for out, mem in layout.renamed.items()}
    first = {group.inputs[0]: i for i, group in enumerate(layout.groups)}
    items: dict[str, _OutputItem] = {}
    for name, key in names.items():
        if name in renamed:
            items[renamed[name]] = _OutputItem(info=tensors[key], key=key)
        elif name in first:
            items.update({out: _OutputItem(info=info, group=first[name])
                          for out, info in layout.groups[first[name]].outputs.items()})
    return items


class _ConvertedTensors:
    """The outputs of one converted group at a time: its inputs are read whole (all of them at
    once: a reverse converter may need several, as a concatenation does), converted, and each
    output is handed out once."""

    def __init__(self, opened: OpenedCheckpoint, names: dict[str, str], layout: HubLayout) -> None:
        self._opened, self._names, self._layout = opened, names, layout
        self._index: int | None = None
        self._outputs: dict[str, torch.Tensor] = {}

    def take(self, index: int, name: str) -> torch.Tensor:
        if index != self._index:
            self._outputs = {}  # the previous group's are written by now: free them first
            group: ConvertedGroup = self._layout.groups[index]
            self._outputs = self._layout.convert(group, {n: self._read(self._names[n]) for n in group.inputs})
            self._index = index
        return self._outputs.pop(name)

    def _read(self, key: str) -> torch.Tensor:
        info = self._opened.source.tensors()[key]
        return self._opened.source.read_rows(key, 0, info.rows).reshape(info.shape)


def _write_files(opened: OpenedCheckpoint, names: dict[str, str], items: dict[str, _OutputItem], layout: HubLayout,
                 out_dtypes: dict[str, torch.dtype], groups: list[list[str]], files: list[str], *,
                 tmp_dir: Path | None, tmp_file: Path | None, block_bytes: int) -> dict[str, dict[str, int]]:
    tensors = opened.source.tensors()
    streamed = {name: item.key for name, item in items.items() if item.key is not None}
    blocks = {name: list(iter_row_blocks(tensors[key], block_bytes=block_bytes)) for name, key in streamed.items()}
    jobs = [(streamed[name], a, b, out_dtypes[name]) for group in groups for name in group if name in streamed
            for a, b in blocks[name]]
    stream = _prefetched(opened, jobs, block_bytes=block_bytes)
    converted = _ConvertedTensors(opened, names, layout)
    written: dict[str, dict[str, int]] = {}
    if tmp_dir is not None:
        tmp_dir.mkdir()
    try:
        for group, file in zip(groups, files, strict=True):
            path = tmp_file if tmp_file is not None else tmp_dir / file
            file_layout = [(name, items[name].info.shape, out_dtypes[name]) for name in group]
            writer = StreamingSafetensorsWriter(path, file_layout,
                                                metadata={"format": "pt", EXPORTED_BY: exported_by_value(__version__)})
            try:
                for name in group:
                    if name in streamed:
                        writer.write_tensor(name, (next(stream) for _ in blocks[name]))
                    else:
                        writer.write_tensor(name, [converted.take(items[name].group, name).to(out_dtypes[name])])
            except BaseException:
                writer.abort()
                raise
            writer.close()
            written[file] = {"bytes": writer.file_bytes, "tensors": len(group)}
    finally:
        stream.close()  # stops the read-ahead threads at once if writing failed
    return written


def _check_namespace(namespace: str | None, *, fmt: str, out: Path) -> str:
    """The part of an Accelerate folder to read; refuses to pass optimizer state off as weights."""
    if namespace is None or not is_non_model_namespace(namespace):
        return "model"
    if fmt == "hf":
        raise ValueError(f"--namespace {namespace} selects optimizer (or other non-model) state, but --format hf "
                         "writes model.safetensors, which transformers would load as the model's weights; write it to "
                         f"a file of its own: --format single {out.with_suffix('')}-{namespace}.safetensors")
    if out.name.startswith("model"):
        raise ValueError(f"--namespace {namespace}: {out.name} would pass for model weights; name the file after what "
                         f"it holds, e.g. {out.with_name(f'{namespace}.safetensors')}")
    return "optimizer" if namespace.startswith("optim") else "model"


def _publish(tmp: Path, out: Path, *, overwrite: bool) -> None:
    """Move the finished export into place; an old export is removed only afterwards (checked
    again: something may have appeared there while exporting)."""
    old = None
    if check_replaceable(out, overwrite=overwrite):
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.replace(out, old)
    elif out.is_dir():
        out.rmdir()  # an empty directory the user created for us
    os.replace(tmp, out)
    fsync_path(out.parent)
    if old is not None and old.is_dir():
        shutil.rmtree(old)
    elif old is not None:
        old.unlink()


def _dtype_note(opened: OpenedCheckpoint, target: torch.dtype | None, stored: set[torch.dtype]) -> str:
    """Which dtype the export wrote and why it is (or is not) what the checkpoint holds."""
    floating = sorted(dtype_name(d) for d in stored if d.is_floating_point)
    stored_text = "/".join(floating) or "no floating-point tensors"
    why = ""
    if opened.kind.startswith("fsdpkit"):
        precision = (((opened.manifest or {}).get("config") or {}).get("policy") or {}).get("mixed_precision")
        why = " (the run's master weights" + (f"; policy.mixed_precision={precision!r} computed in lower precision "
                                              "from them"
                                               if precision not in (None, "fp32") else "") + ")"
    if target is None or [dtype_name(target)] == floating:
        hint = "; pass --dtype bf16 to halve the export" if floating == ["float32"] else ""
        return f"wrote {stored_text} as stored in the checkpoint{why}{hint}"
    return (f"wrote {dtype_name(target)}, converted from the checkpoint's {stored_text}{why} because the export "
            "asked for it (--dtype); integer tensors are kept as stored")
