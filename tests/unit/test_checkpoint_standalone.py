"""The checkpoint library stands alone: a loop that is not fsdpkit's trainer imports it without the
trainer's configuration machinery (Hydra, OmegaConf), and no checkpoint module imports the layers
above it (config, train, cli, export). Its settings are its own (fsdpkit.checkpoint.settings)."""

from __future__ import annotations

import ast
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest

import fsdpkit

CHECKPOINT = Path(fsdpkit.__file__).parent / "checkpoint"
ABOVE = ("fsdpkit.config", "fsdpkit.train", "fsdpkit.cli", "fsdpkit.export", "hydra", "omegaconf")


def test_importing_the_checkpointer_loads_neither_hydra_nor_omegaconf():
    code = ("from fsdpkit.checkpoint import Checkpointer, find_checkpoint; import sys; "
            "loaded = sorted(m for m in ('hydra', 'omegaconf') if m in sys.modules); "
            "assert not loaded, f'importing fsdpkit.checkpoint loaded {loaded}'")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(CHECKPOINT.parents[1]),
                                                         *filter(None, [os.environ.get("PYTHONPATH")])])}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_no_checkpoint_module_imports_the_layers_above_it():
    offenders = []
    for path in sorted(CHECKPOINT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            offenders += [f"{path.relative_to(CHECKPOINT.parent)}:{node.lineno} imports {name}"
                          for name in names if name.startswith(ABOVE)]
    assert not offenders, "\n".join(offenders)


def test_io_settings_are_passed_in_or_read_from_the_environment_once():
    from fsdpkit import tunables
    from fsdpkit.checkpoint import IOSettings

    with tunables.override(lock_wait_s=0.5):
        assert IOSettings.from_environment().lock_wait_s == 0.5
    assert IOSettings(lock_wait_s=2.0).lock_wait_s == 2.0
    with pytest.raises(ValueError, match=r"remote_part_bytes=-1 \(FSDPKIT_REMOTE_PART_BYTES\) is not accepted"):
        IOSettings(remote_part_bytes=-1)


def test_find_checkpoint_takes_the_settings_of_the_checkpointer():
    from fsdpkit.checkpoint import Checkpointer, find_checkpoint

    finding, constructing = inspect.signature(find_checkpoint).parameters, inspect.signature(Checkpointer).parameters
    assert finding["settings"].annotation == constructing["settings"].annotation.removesuffix(" | None")
    assert finding["io_settings"].annotation == constructing["io_settings"].annotation
