"""The reference pages, written from the code, so they cannot drift.

- reference/config.md: every config option, from the typed schema (fsdpkit.config.docs.iter_options,
  what `fsdpkit config docs` prints);
- reference/cli.md: every command and flag, from the argparse parsers of the `fsdpkit` command;
- reference/environment.md: every FSDPKIT_* variable, from fsdpkit.tunables.table();
- reference/api.md: every name of fsdpkit.checkpoint.__all__ (and its classes' public methods),
  signature and docstring.

They are committed under docs/reference/, readable in the repository: `make reference` (`python
docs/hooks.py`) writes them, and tests/unit/test_docs.py fails when one differs from what the code
gives now. On the built site (this module is also the MkDocs hook), the API page is rendered from
the same docstrings by mkdocstrings instead. test_docs.py also checks that nothing is missing.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))  # the checkout's own code, not an installed copy

GENERATED_NOTE = "*Generated from {source} by `make reference`; do not edit.*\n"


def _cell(text: str) -> str:
    """Text for a markdown table cell: pipes escaped, `<` outside code spans escaped (`<run_dir>`)."""
    parts = str(text).replace("|", "\\|").replace("\n", " ").split("`")
    return "`".join(p.replace("<", "&lt;") if i % 2 == 0 else p for i, p in enumerate(parts))


# -- config options --------------------------------------------------------------------------------

def config_page() -> str:
    from fsdpkit.config.docs import iter_options

    sections: dict[str, list[str]] = {}
    for key, typ, default, doc in iter_options():
        section = key.split(".")[0] if "." in key else "top level"
        sections.setdefault(section, []).append(f"| `{key}` | `{_cell(typ)}` | `{default!r}` | {_cell(doc)} |")
    out = ["# Config options", "", GENERATED_NOTE.format(source="src/fsdpkit/config/schema.py"),
           "Set any of them on the command line (`key=value`, Hydra syntax), in an experiment file or in "
           "`conf/config.yaml`; `fsdpkit config docs` prints the same list and `fsdpkit config show` the "
           "resolved values. How the layers combine: "
           "[the demo tutorial](../tutorials/demo.md#layered-configuration).", ""]
    for section, rows in sections.items():
        out += [f"## {section}", "", "| key | type | default | meaning |", "|---|---|---|---|", *rows, ""]
    return "\n".join(out)


# -- CLI -------------------------------------------------------------------------------------------

def _subcommands(parser: argparse.ArgumentParser, path: str):
    """Yield (command path, parser) for the parser and every subcommand under it, depth first."""
    yield path, parser
    for action in parser._actions:  # argparse has no public way to list subparsers
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _subcommands(sub, f"{path} {name}")


def cli_commands() -> list[tuple[str, argparse.ArgumentParser]]:
    from fsdpkit.cli.main import _parser  # the parser `fsdpkit` itself runs

    return list(_subcommands(_parser(), "fsdpkit"))


def _argument_rows(parser: argparse.ArgumentParser) -> list[str]:
    rows = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction | argparse._HelpAction):
            continue
        if action.option_strings:
            name = ", ".join(f"`{s}`" for s in action.option_strings)
            if action.nargs != 0:
                name += f" `{action.metavar or action.dest.upper()}`"
        else:
            name = f"`{action.metavar or action.dest}`"
        choices = f" One of: {', '.join(f'`{c}`' for c in action.choices)}." if action.choices else ""
        default = "" if action.default in (None, False, [], argparse.SUPPRESS) or not action.option_strings \
            else f"`{action.default!r}`"
        rows.append(f"| {name} | {default} | {_cell(action.help or '')}{choices} |")
    return rows


def cli_page() -> str:
    # argparse wraps usage lines at the terminal's width (COLUMNS): a fixed one, so that the page
    # is the same wherever it is written
    columns = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "120"
    try:
        return _cli_page()
    finally:
        if columns is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = columns


def _cli_page() -> str:
    out = ["# CLI", "", GENERATED_NOTE.format(source="the argparse parsers of src/fsdpkit/cli"),
           "Every command prints the same with `--help`.", ""]
    for path, parser in cli_commands():
        out += [f"## `{path}`", "", "```text", parser.format_usage().strip(), "```", ""]
        if parser.description:
            out += ["```text", parser.description.strip(), "```", ""]
        rows = _argument_rows(parser)
        if rows:
            out += ["| argument | default | meaning |", "|---|---|---|", *rows, ""]
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        for action in subs:
            out += ["| command | what it does |", "|---|---|"]
            out += [f"| [`{path} {c.dest}`](#{_anchor(f'{path} {c.dest}')}) | {_cell(c.help or '')} |"
                    for c in action._choices_actions]
            out.append("")
    return "\n".join(out)


def _anchor(title: str) -> str:
    """The id Python-Markdown's toc gives a heading `title` (code span markers dropped)."""
    return re.sub(r"[\s]+", "-", re.sub(r"[^\w\s-]", "", title).strip().lower())


# -- environment variables -------------------------------------------------------------------------

def environment_rows() -> list[tuple[str, str, str, str]]:
    """(variable, default, accepts, meaning) per tunable, cut from tunables.table() at its column starts."""
    from fsdpkit import tunables

    header, *lines = tunables.table().splitlines()
    starts = [header.index(h) for h in ("Variable", "Default", "Accepts", "Meaning")]
    bounds = list(zip(starts, [*starts[1:], None], strict=True))
    return [tuple(line[a:b].strip() for a, b in bounds) for line in lines]


def environment_page() -> str:
    rows = [f"| `{env}` | {_cell(default)} | {_cell(accepts)} | {_cell(meaning)} |"
            for env, default, accepts, meaning in environment_rows()]
    return "\n".join([
        "# Environment variables", "", GENERATED_NOTE.format(source="src/fsdpkit/tunables.py"),
        "Low-level I/O knobs (read sizes, object-storage parts, lock timings, export blocks and "
        "threads). A malformed value stops any `fsdpkit` command at once, naming the variable. "
        "What a run chooses (directories, timeouts, shard sizes) is a [config option](config.md) instead. "
        "Byte counts take a number or a size (`16MiB`, `5MB`); switches take 0 or 1; an empty variable "
        "counts as unset.", "",
        "| variable | default | accepts | meaning |", "|---|---|---|---|", *rows, ""])


# -- Python API ------------------------------------------------------------------------------------

def api_names() -> dict[str, str]:
    """Each name of fsdpkit.checkpoint.__all__ -> the module that defines it (read from the sources:
    the package loads its names lazily, which static documentation tools cannot follow)."""
    import fsdpkit.checkpoint as package

    defined: dict[str, list[str]] = {}
    for path in sorted(Path(package.__file__).parent.glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef | ast.FunctionDef):
                names = [node.name]
            elif isinstance(node, ast.Assign):
                names = [t.id for t in node.targets if isinstance(t, ast.Name)]
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names = [node.target.id]
            else:
                names = []
            for name in names:
                defined.setdefault(name, []).append(f"fsdpkit.checkpoint.{path.stem}")
    out = {}
    for name in package.__all__:
        modules = defined.get(name, [])
        if len(modules) != 1:
            raise RuntimeError(f"fsdpkit.checkpoint.{name} is defined in {modules or 'no module'}; "
                               "expected exactly one")
        out[name] = modules[0]
    return out


def _api_entry(qualname: str, obj: object, module: str, level: int) -> list[str]:
    """A heading, the signature and the docstring of `obj`."""
    import inspect

    try:
        signature = f"{qualname.rsplit('.', 1)[-1]}{inspect.signature(obj)}"
    except (TypeError, ValueError):  # a constant, or a builtin without one
        signature = f"{qualname.rsplit('.', 1)[-1]} = {obj!r}"
    signature = re.sub(r" at 0x[0-9a-f]+>", ">", signature)  # a sentinel default: no address, the same every time
    doc = inspect.getdoc(obj) if callable(obj) else ""
    heading = f"{'#' * level} `{qualname}`" + (f" ({module})" if level == 2 else "")
    return [heading, "", "```python", signature, "```", "", *(["```text", doc, "```", ""] if doc else [])]


def api_page() -> str:
    """The API page as committed: plain markdown, readable in the repository."""
    import inspect

    import fsdpkit.checkpoint as package

    out = ["# Python API: `fsdpkit.checkpoint`", "",
           GENERATED_NOTE.format(source="the docstrings of src/fsdpkit/checkpoint"),
           "Import every name below from `fsdpkit.checkpoint` (e.g. `from fsdpkit.checkpoint import "
           "Checkpointer`); each heading names the module that defines it. A walk-through: "
           "[your own loop with Checkpointer](../tutorials/own-loop.md).", "",
           "```text", (package.__doc__ or "").strip(), "```", ""]
    for name, module in api_names().items():
        obj = getattr(package, name)
        out += _api_entry(name, obj, module, 2)
        if inspect.isclass(obj) and not issubclass(obj, BaseException):
            for method, member in inspect.getmembers(obj, callable):
                if not method.startswith("_") and method in vars(obj):
                    out += _api_entry(f"{name}.{method}", member, module, 3)
    return "\n".join(out)


def api_site_page() -> str:
    """The API page of the built site: the same docstrings, rendered by mkdocstrings."""
    import fsdpkit.checkpoint as package

    out = ["# Python API: `fsdpkit.checkpoint`", "",
           GENERATED_NOTE.format(source="the docstrings of src/fsdpkit/checkpoint"),
           "Import every name below from `fsdpkit.checkpoint` (e.g. `from fsdpkit.checkpoint import "
           "Checkpointer`); the headings name the module that defines it. A walk-through: "
           "[your own loop with Checkpointer](../tutorials/own-loop.md).", "",
           "```text", (package.__doc__ or "").strip(), "```", ""]
    for name, module in api_names().items():
        out += [f"::: {module}.{name}", ""]
    return "\n".join(out)


REFERENCE = Path(__file__).resolve().parent / "reference"
PAGES = {
    "config.md": config_page,
    "cli.md": cli_page,
    "environment.md": environment_page,
    "api.md": api_page,
}


def write_reference() -> list[Path]:
    """Write every committed reference page; returns the ones that changed."""
    changed = []
    for name, build in PAGES.items():
        path, text = REFERENCE / name, build() + "\n"
        if not path.is_file() or path.read_text() != text:
            path.write_text(text)
            changed.append(path)
    return changed


def on_files(files, config):
    from mkdocs.structure.files import File

    uri = "reference/api.md"
    files.remove(files.get_file_from_path(uri))
    files.append(File.generated(config, uri, content=api_site_page()))
    return files


if __name__ == "__main__":
    REFERENCE.mkdir(exist_ok=True)
    for path in write_reference():
        print(f"wrote {path.relative_to(ROOT)}")
