"""The shape of manifest.json, checked before any field is used.

A manifest that parses as JSON can still be the wrong shape (a list, a number, `files` as a
string, a missing `trainer`). Every reader goes through `manifest_problems`, so a malformed
manifest is a named, corrupt checkpoint (skipped by auto-resume, refused when named), never a
KeyError or TypeError deep inside a load.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

Check = Callable[[Any], str | None]  # None: fine; else what is wrong


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def integer(minimum: int = 0) -> Check:
    def check(v: Any) -> str | None:
        if not _is_int(v):
            return f"must be an integer, got {type(v).__name__}"
        return None if v >= minimum else f"must be >= {minimum}, got {v}"
    return check


def string(v: Any) -> str | None:
    return None if isinstance(v, str) and v else f"must be a non-empty string, got {v!r:.40}"


def mapping(v: Any) -> str | None:
    return None if isinstance(v, dict) else f"must be an object, got {type(v).__name__}"


def one_of(*allowed: str) -> Check:
    def check(v: Any) -> str | None:
        return None if v in allowed else f"must be one of {', '.join(allowed)}, got {v!r:.40}"
    return check


def list_of(item: Check) -> Check:
    def check(v: Any) -> str | None:
        if not isinstance(v, list):
            return f"must be a list, got {type(v).__name__}"
        bad = next((p for p in map(item, v) if p), None)
        return f"holds an item that {bad}" if bad else None
    return check


def nullable(check: Check) -> Check:
    def checked(v: Any) -> str | None:
        return None if v is None else check(v)
    return checked


def boolean(v: Any) -> str | None:
    return None if isinstance(v, bool) else f"must be true or false, got {v!r:.40}"


def record(fields: dict[str, Check], optional: dict[str, Check] | None = None) -> Check:
    """An object with at least `fields`, and `optional` ones of the right shape where present
    (more are allowed: newer writers may add some)."""
    def check(v: Any) -> str | None:
        if not isinstance(v, dict):
            return f"must be an object, got {type(v).__name__}"
        for name, field_check in fields.items():
            if name not in v:
                return f"lacks `{name}`"
            if problem := field_check(v[name]):
                return f"`{name}` {problem}"
        for name, field_check in (optional or {}).items():
            if name in v and (problem := field_check(v[name])):
                return f"`{name}` {problem}"
        return None
    return check


def map_of(value: Check) -> Check:
    def check(v: Any) -> str | None:
        if not isinstance(v, dict):
            return f"must be an object, got {type(v).__name__}"
        for key, item in v.items():
            if problem := value(item):
                return f"entry {key!r:.80} {problem}"
        return None
    return check


def hex_digest(v: Any) -> str | None:
    ok = isinstance(v, str) and len(v) == 16 and all(c in "0123456789abcdef" for c in v)
    return None if ok else f"must be 16 lowercase hex digits, got {v!r:.40}"


HEX = re.compile(r"[0-9a-f]*")
SHARED_DIR = re.compile(r"^shared/[A-Za-z0-9][A-Za-z0-9_.-]*$")  # a reference to frozen tensors (frozen.py)


def shared_dir(v: Any) -> str | None:
    return None if isinstance(v, str) and SHARED_DIR.match(v) else f"must be shared/<name>, got {v!r:.60}"


def file_name(v: Any) -> str | None:
    ok = isinstance(v, str) and v not in ("", ".", "..") and "/" not in v and "\\" not in v
    return None if ok else f"must be a file name, got {v!r:.60}"


def item_digests(v: Any) -> str | None:
    """A file's `items`: 16 lowercase hex digits per item, concatenated (io/items.py)."""
    ok = isinstance(v, str) and len(v) % 16 == 0 and HEX.fullmatch(v) is not None
    return None if ok else f"must be 16 lowercase hex digits per item, got {v!r:.40}"


FILES = map_of(record({"size": integer(0), "xxh3_64": hex_digest}, optional={"items": item_digests}))


def files(v: Any) -> str | None:
    return FILES(v) or next((f"has the entry {p}" for p in map(file_name, v) if p), None)


TENSOR_INFO = record({"shape": list_of(integer()), "dtype": string})
REQUIRED: dict[str, Check] = {
    "format": string,
    "format_version": integer(1),
    "step": integer(0),
    "world_size": integer(1),
    "state_dict_type": one_of("sharded", "full"),
    # vocab_size and tied_embeddings: written since they were added; older manifests lack them
    "fingerprint": record({"tensors": map_of(TENSOR_INFO)},
                          optional={"vocab_size": integer(1), "tied_embeddings": boolean}),
    "trainer": map_of(mapping),
    "tensors": map_of(record({"shape": list_of(integer()), "dtype": string, "hash": hex_digest})),
    "files": files,
}
OPTIONAL: dict[str, Check] = {
    "run_id": string,
    "tensor_hash": string,
    "committed_at": string,
    "reason": string,
    "metrics": mapping,
    "optimizer": nullable(mapping),  # null: saved without an optimizer (an EMA copy, a frozen teacher)
    "config": mapping,
    "mesh": mapping,
    "bytes_per_rank": list_of(integer()),
    "optimizer_param_groups": list_of(mapping),
    # format 3: directories of frozen tensors this checkpoint references (frozen.py)
    "shared": list_of(record({"dir": shared_dir, "keys": list_of(string), "files": files})),
}


def manifest_problems(manifest: Any) -> list[str]:
    """What is wrong with the shape of a parsed manifest (empty: well-formed)."""
    if not isinstance(manifest, dict):
        return [f"the manifest must be a JSON object, got {type(manifest).__name__}"]
    problems = [f"lacks `{name}`" for name in REQUIRED if name not in manifest]
    for name, check in (REQUIRED | OPTIONAL).items():
        if name in manifest and (problem := check(manifest[name])):
            problems.append(f"`{name}` {problem}")
    if not problems and manifest["state_dict_type"] == "full" and "optimizer_param_groups" not in manifest:
        problems.append("lacks `optimizer_param_groups` (needed by a full checkpoint)")
    for ref in manifest.get("shared", []) if not problems else []:
        if unknown := [k for k in ref["keys"] if k not in manifest["tensors"]]:
            problems.append(f"`shared` entry {ref['dir']} holds keys with no checksum in `tensors`: {unknown[:3]}")
    return problems
