"""The documentation site: it builds with no warning, its reference (committed in docs/reference/,
current with the code) names every config option, CLI flag, environment variable and public name of
fsdpkit.checkpoint, and the snippets marked runnable in docs/ run.

A snippet is runnable when the line before its fence is `<!-- runnable -->`; the blocks of one page
run in order in one fresh directory (a later block may use what an earlier one wrote), `bash` blocks
with `set -euo pipefail` and `fsdpkit` meaning this checkout's `python -m fsdpkit`, `python` blocks
with this interpreter. Keep them to seconds.
"""

from __future__ import annotations

import html
import importlib.util
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import zygote  # noqa: E402
from fsdpkit import tunables
from fsdpkit.config.docs import iter_options

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
RUNNABLE = re.compile(r"^<!-- runnable -->\n```(bash|python)[^\n]*\n(.*?)^```", re.M | re.S)
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
       "NO_MKDOCS_2_WARNING": "1", "OMP_NUM_THREADS": "1"}
SNIPPET_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", DOCS / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)], cwd=ROOT,
                          env=ENV, capture_output=True, text=True, timeout=300)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"mkdocs build --strict failed (run `make docs`):\n{log[-6000:]}"
    assert "WARNING" not in log, f"mkdocs build warned:\n{log[-6000:]}"
    return out


def _page(site: Path, name: str) -> str:
    return html.unescape((site / "reference" / name / "index.html").read_text())


def test_the_site_builds_strictly(site):
    for page in ("index.html", "checkpoint-format/index.html", "results/index.html", "reference/cli/index.html"):
        assert (site / page).is_file(), page


def test_the_committed_reference_pages_are_current():
    """docs/reference/*.md, readable in the repository, are what the code gives now."""
    hooks = _hooks()
    stale = [name for name, build in hooks.PAGES.items()
             if not (DOCS / "reference" / name).is_file() or (DOCS / "reference" / name).read_text() != build() + "\n"]
    assert not stale, f"docs/reference/{stale} differ from the code: run `make reference` and commit them"


def test_every_config_option_is_in_the_reference(site):
    text = _page(site, "config")
    missing = [key for key, *_ in iter_options() if f"<code>{key}</code>" not in text]
    assert not missing, f"reference/config.md lacks {missing} (docs/hooks.py config_page)"


def test_every_cli_command_and_flag_is_in_the_reference(site):
    text = _page(site, "cli")
    missing = []
    for path, parser in _hooks().cli_commands():
        if f"<code>{path}</code>" not in text:
            missing.append(path)
        for action in parser._actions:  # argparse lists its arguments nowhere public
            for flag in action.option_strings:
                if flag not in ("-h", "--help") and f"<code>{flag}</code>" not in text:
                    missing.append(f"{path} {flag}")
    assert len(_hooks().cli_commands()) >= 8  # fsdpkit, train, resume-check, config, ckpt and its four, plot
    assert not missing, f"reference/cli.md lacks {missing} (docs/hooks.py cli_page)"


def test_every_environment_variable_is_in_the_reference(site):
    text = _page(site, "environment")
    missing = [spec.env for spec in tunables.declared() if f"<code>{spec.env}</code>" not in text]
    assert not missing, f"reference/environment.md lacks {missing}"


# The tables of docs/how-to/coming-from.md: header -> the fewest rows it may have
MIGRATION_TABLES = {"| `TrainingArguments` | fsdpkit |": 20, "| Accelerate `fsdp_config` | fsdpkit |": 12,
                    "| torchtitan TOML | fsdpkit |": 25}


def _table_rows(header: str) -> list[list[str]]:
    """The cells of each row of the table under `header` in coming-from.md."""
    text = (DOCS / "how-to" / "coming-from.md").read_text()
    lines = text[text.index(header):].splitlines()[2:]
    rows = []
    for line in lines:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


@pytest.mark.parametrize("header", MIGRATION_TABLES)
def test_the_migration_tables_name_real_settings(header):
    """docs/how-to/coming-from.md maps another tool's settings to fsdpkit's: each setting the fsdpkit
    column names exists (a renamed option fails here, not in a user's run); a row without one says
    `-` and its note says why."""
    rows = _table_rows(header)
    options = {key for key, *_ in iter_options()}
    named = [re.findall(r"`([^`]+)`", row[1]) for row in rows]
    assert len(rows) >= MIGRATION_TABLES[header], rows
    assert all(keys or row[1] == "-" for keys, row in zip(named, rows, strict=True)), rows
    if header.startswith("| `TrainingArguments`"):
        assert all(named), rows
    unknown = [key for keys in named for key in keys if key not in options]
    assert not unknown, f"coming-from.md names settings the config does not have: {unknown}"


def test_the_accelerate_table_names_keys_accelerate_writes():
    """Its left column: keys of `accelerate config`'s fsdp_config (the installed Accelerate's own
    source) or of its config file's top level."""
    accelerate = pytest.importorskip("accelerate")
    import dataclasses

    from accelerate.commands.config.config_args import ClusterConfig

    cluster = Path(accelerate.__file__).parent / "commands" / "config" / "cluster.py"
    known = set(re.findall(r"fsdp_\w+", cluster.read_text())) | {f.name for f in dataclasses.fields(ClusterConfig)}
    rows = _table_rows("| Accelerate `fsdp_config` | fsdpkit |")
    keys = [key for row in rows for key in re.findall(r"`([^`]+)`", row[0])]
    assert keys and not [k for k in keys if k not in known], [k for k in keys if k not in known]


def test_every_public_name_of_fsdpkit_checkpoint_is_in_the_api_reference(site):
    import fsdpkit.checkpoint as package

    text = _page(site, "api")
    modules = _hooks().api_names()
    ids = [f"{modules[name]}.{name}" for name in package.__all__]
    for name in package.__all__:  # and the public methods of its classes
        obj = getattr(package, name)
        if inspect.isclass(obj) and not issubclass(obj, BaseException):
            ids += [f"{modules[name]}.{name}.{m}" for m, _ in inspect.getmembers(obj, callable)
                    if not m.startswith("_") and m in vars(obj)]
    missing = [i for i in ids if f'id="{i}"' not in text]
    assert "fsdpkit.checkpoint.manager.Checkpointer.resume" in ids
    assert not missing, f"reference/api.md lacks {missing}"


def _runnable_pages() -> dict[str, list[tuple[str, str]]]:
    pages = {}
    for path in sorted(DOCS.rglob("*.md")):
        blocks = RUNNABLE.findall(path.read_text())
        if blocks:
            pages[str(path.relative_to(DOCS))] = blocks
    return pages


def test_the_runnable_snippets_are_where_the_docs_say():
    assert {"tutorials/demo.md", "tutorials/own-loop.md"} <= set(_runnable_pages())


@pytest.mark.parametrize("page", sorted(_runnable_pages()))
def test_runnable_snippets(page, tmp_path):
    python = zygote.executable()  # the snippets' Python launches fork from the zygote (fsdpkit is installed)
    for number, (language, code) in enumerate(_runnable_pages()[page], 1):
        if language == "bash":
            script = f'set -euo pipefail\nfsdpkit() {{ "{python}" -m fsdpkit "$@"; }}\n{code}'
            cmd = ["bash", "-c", script]
        else:
            (tmp_path / f"snippet{number}.py").write_text(code)
            cmd = [python, f"snippet{number}.py"]
        proc = subprocess.run(cmd, cwd=tmp_path, env=SNIPPET_ENV, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, (f"{page}: runnable snippet {number} ({language}) failed "
                                      f"({proc.returncode}):\n{code}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
