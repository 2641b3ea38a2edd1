"""Field documentation read straight from the schema's source (the docstring under each
field), so `fsdpkit config docs` and the docs' config reference can never drift from the code."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap

from fsdpkit.config import schema


def field_docs(cls: type) -> dict[str, str]:
    """Map each field of a schema dataclass to the docstring written under it."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:], strict=False):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def iter_options(cls: type = schema.Config, prefix: str = "", *, defaults: object | None = None):
    """Yield (dotted key, type, default, doc) for every leaf option of the schema. A group's
    defaults are those of the instance its parent's field makes (`defaults`), which may differ
    from its class's own (the checkpoint library's `dir` has none; the trainer's is under run_dir)."""
    docs = field_docs(cls)
    defaults = cls() if defaults is None else defaults
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        default = getattr(defaults, f.name)
        if dataclasses.is_dataclass(default):
            yield from iter_options(type(default), prefix=f"{key}.", defaults=default)
        else:
            yield key, str(f.type), default, docs.get(f.name, "")


def markdown_table() -> str:
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for key, typ, default, doc in iter_options():
        rows.append(f"| `{key}` | `{typ}` | `{default!r}` | {doc} |")
    return "\n".join(rows)
