"""fsdpkit.tunables: every FSDPKIT_* variable declared once, parsed and checked in one place,
overridable from tests, and no other FSDPKIT_* name anywhere in the repository."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from fsdpkit import tunables
from fsdpkit.checkpoint.io import page_cache

ROOT = Path(__file__).resolve().parents[2]
SPECS = tunables.declared()


def _written(spec: tunables.Tunable, value: object) -> str:
    """`value` as it would be written in the environment."""
    return str(int(value)) if isinstance(value, bool) else repr(value) if isinstance(value, float) else str(value)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.env)
def test_every_tunable_parses_its_default(spec):
    assert getattr(tunables.DEFAULTS, spec.name) == spec.default
    assert getattr(tunables.from_environ({}), spec.name) == spec.default
    if spec.default is not None:
        assert getattr(tunables.from_environ({spec.env: _written(spec, spec.default)}), spec.name) == spec.default
    assert getattr(tunables.from_environ({spec.env: ""}), spec.name) == spec.default  # empty: unset


def test_values_are_parsed_as_their_kind():
    got = tunables.from_environ({"FSDPKIT_REMOTE_PART_BYTES": "32MiB", "FSDPKIT_READ_RESTART_BYTES": "4096",
                                 "FSDPKIT_PYTHON_ROW_HASH": "true", "FSDPKIT_STAGING_THREADS": "3",
                                 "FSDPKIT_LOCK_WAIT_S": "2.5"})
    assert (got.remote_part_bytes, got.read_restart_bytes, got.python_row_hash,
            got.staging_threads, got.lock_wait_s) == (32 << 20, 4096, True, 3, 2.5)
    assert tunables.from_environ({"FSDPKIT_PYTHON_ROW_HASH": "0"}).python_row_hash is False


@pytest.mark.parametrize(("env", "text", "accepts"), [
    ("FSDPKIT_REMOTE_PART_BYTES", "abc", "bytes >= 5 MiB"),
    ("FSDPKIT_REMOTE_PART_BYTES", "1MiB", "bytes >= 5 MiB"),  # below S3's smallest part
    ("FSDPKIT_READ_RESTART_BYTES", "-1", "bytes >= 0"),
    ("FSDPKIT_PYTHON_ROW_HASH", "maybe", "0 or 1"),
    ("FSDPKIT_STAGING_THREADS", "two", "threads >= 1"),
    ("FSDPKIT_STAGING_THREADS", "0", "threads >= 1"),
    ("FSDPKIT_EXPORT_READ_AHEAD", "2.5", "blocks >= 1"),
    ("FSDPKIT_LOCK_WAIT_S", "-1", "seconds >= 0"),
    ("FSDPKIT_DIAG_GRAD_NORM_RTOL", "nan", "ratio > 0"),
])
def test_a_malformed_value_names_the_variable_the_value_and_what_it_accepts(env, text, accepts):
    with pytest.raises(ValueError, match=re.escape(f"{env}={text!r} is not accepted: it takes {accepts}")):
        tunables.from_environ({env: text})


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.env)
def test_every_tunable_refuses_garbage(spec):
    with pytest.raises(ValueError, match=re.escape(f"{spec.env}='abc' is not accepted")):
        tunables.from_environ({spec.env: "abc"})


def test_a_lock_that_goes_stale_between_two_heartbeats_is_refused():
    with pytest.raises(ValueError, match="FSDPKIT_OBJECT_LOCK_STALE_S=30 must exceed "
                                         "FSDPKIT_OBJECT_LOCK_HEARTBEAT_S=30"):
        tunables.from_environ({"FSDPKIT_OBJECT_LOCK_STALE_S": "30"})


def test_the_fsdpkit_command_stops_at_a_malformed_variable(tmp_path, monkeypatch, capsys):
    from fsdpkit.cli.main import main

    monkeypatch.setattr(tunables, "_current", None)  # read the environment afresh
    monkeypatch.setenv("FSDPKIT_REMOTE_PART_BYTES", "abc")
    assert main(["ckpt", "verify", str(tmp_path)]) == 2
    assert "fsdpkit ckpt: error: FSDPKIT_REMOTE_PART_BYTES='abc' is not accepted" in capsys.readouterr().err


def test_override_reaches_code_that_reads_at_use_and_ends_with_the_block(tune):
    default = tunables.current().read_restart_bytes
    with tunables.override(read_restart_bytes=4096) as tuned:
        assert tuned is tunables.current() and tuned.read_restart_bytes == 4096
        reader = page_cache.SequentialReader(__file__)  # reads its restart size when made
        with tunables.override(python_row_hash=True):
            assert tunables.current().python_row_hash and tunables.current().read_restart_bytes == 4096
    assert reader._restart == 4096
    reader.close()
    assert tunables.current().read_restart_bytes == default
    tune(read_restart_bytes=0)  # the fixture: until the test ends
    assert tunables.current().read_restart_bytes == 0


def test_override_checks_names_and_values():
    with pytest.raises(TypeError, match="read_restart_byte"), tunables.override(read_restart_byte=4):
        pass
    with pytest.raises(ValueError, match=r"remote_part_bytes=1048576 \(FSDPKIT_REMOTE_PART_BYTES\) is not accepted"):
        with tunables.override(remote_part_bytes=1 << 20):
            pass
    with pytest.raises(ValueError, match=r"python_row_hash=0 \(FSDPKIT_PYTHON_ROW_HASH\) is not accepted: it takes "
                                         r"True or False"):
        with tunables.override(python_row_hash=0):
            pass


def test_the_docstring_lists_every_tunable():
    assert tunables.table() in tunables.__doc__, "regenerate the table in tunables.py's docstring from tunables.table()"


def test_the_module_imports_nothing_of_fsdpkit():
    tree = ast.parse((ROOT / "src" / "fsdpkit" / "tunables.py").read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not [m for m in imported if m.startswith("fsdpkit")]


SCANNED = ("README.md", "Makefile", "docs", "tests", "bench", "chaos", "examples", "src")
SUFFIXES = {".py", ".md", ".txt", ".yaml", ".yml", ".toml", ".json", ".sh", ".cfg", ".ini", ".c", ""}


def test_every_fsdpkit_variable_named_in_the_repository_is_declared():
    declared = {spec.env for spec in SPECS}
    unknown: list[str] = []
    for top in SCANNED:
        paths = [ROOT / top] if (ROOT / top).is_file() else sorted((ROOT / top).rglob("*"))
        for path in paths:
            if (not path.is_file() or path.suffix not in SUFFIXES
                    or any(part == "__pycache__" or part.endswith(".egg-info") for part in path.parts)):
                continue  # not ours to scan: caches and pip's build metadata (a copy of an older README)
            for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                for name in re.findall(r"FSDPKIT_[A-Z0-9_]+", line):
                    if name not in declared:
                        unknown.append(f"{path.relative_to(ROOT)}:{number}: {name}")
    assert not unknown, "FSDPKIT_* names not declared in src/fsdpkit/tunables.py:\n" + "\n".join(unknown)
