"""Arms the faults of $FAULTS_SPEC (fault_hooks.py) in every Python process started with this
directory first on PYTHONPATH (see faults.env: a test's CLI launch, torchrun and its ranks), then
runs the sitecustomize module that this one shadows, if there is one."""

import importlib.machinery
import importlib.util
import os
import sys


def _arm() -> None:
    if not os.environ.get("FAULTS_SPEC"):
        return
    try:
        import fault_hooks

        fault_hooks.install_from_env()
    except Exception as e:  # noqa: BLE001 - a fault that cannot be armed must not let the run pass
        sys.stderr.write(f"[faults] cannot arm $FAULTS_SPEC: {type(e).__name__}: {e}\n")
        os._exit(86)


def _chain() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    others = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", others)
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


_arm()
_chain()
