"""The subpackages of src/fsdpkit import one way (STYLE.md rule 17): no two import each other,
directly or around a longer loop. Read with `ast` only: nothing is imported, so no torch.

A node is `fsdpkit.X`'s first component (model, export, checkpoint, train, ...); a top-level
module (dist.py, log.py, tunables.py, ...) is a node of its own, and `fsdpkit/__init__.py` is
`fsdpkit`. Every import counts: inside functions and under `if TYPE_CHECKING:` too. An import
moved into a function still needs its module; it only hides the cycle until the function runs.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "fsdpkit"
ROOT = "fsdpkit"  # the node of fsdpkit/__init__.py


def _module_parts(path: Path, src: Path) -> list[str]:
    """`fsdpkit/export/sources.py` -> ['fsdpkit', 'export', 'sources']; a package's __init__ is the package."""
    parts = [src.name, *path.relative_to(src).with_suffix("").parts]
    return parts[:-1] if parts[-1] == "__init__" else parts


def _is_module(dotted: str, src: Path) -> bool:
    """Whether `dotted` (fsdpkit.a.b) names a module or package inside `src`."""
    where = src.parent.joinpath(*dotted.split("."))
    return where.with_suffix(".py").is_file() or (where / "__init__.py").is_file()


def _imported_modules(path: Path, src: Path) -> list[str]:
    """Dotted names of every module `path` imports (relative imports resolved); for `from P import
    name`, `P.name` where that is a module of `src` (`from fsdpkit import dist`), else `P`."""
    here = _module_parts(path, src)
    package = here if path.name == "__init__.py" else here[:-1]
    out: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            out += [f"{base}.{alias.name}" if _is_module(f"{base}.{alias.name}", src) else base
                    for alias in node.names]
    return out


def _node(module: str, src: Path) -> str | None:
    """The graph node of a dotted module name, or None for a module outside `src`."""
    parts = module.split(".")
    if parts[0] != src.name:
        return None
    if len(parts) == 1:
        return ROOT
    return parts[1]


def subpackage_imports(src: Path = SRC) -> dict[str, dict[str, set[str]]]:
    """{node: {node it imports: the files (relative to src) whose imports make that edge}}."""
    graph: dict[str, dict[str, set[str]]] = {}
    for path in sorted(src.rglob("*.py")):
        rel = path.relative_to(src)
        me = ROOT if rel.parts == ("__init__.py",) else rel.parts[0].removesuffix(".py")
        edges = graph.setdefault(me, {})
        for module in _imported_modules(path, src):
            target = _node(module, src)
            if target is not None and target != me:
                edges.setdefault(target, set()).add(str(rel))
    return graph


def find_cycles(graph: dict[str, dict[str, set[str]]]) -> list[list[str]]:
    """The shortest cycle through each node that lies on one, each as [a, b, ..., a] starting at
    its smallest node, without repeats, shortest first; [] if the graph is a DAG."""
    found: set[tuple[str, ...]] = set()
    for start in sorted(graph):
        paths, seen = [[start]], {start}
        while paths and not any(p[-1] == start and len(p) > 1 for p in paths):
            paths = [[*p, n] for p in paths for n in sorted(graph.get(p[-1], ())) if n == start or n not in seen]
            seen |= {p[-1] for p in paths}
        cycle = next((p[:-1] for p in paths if p[-1] == start and len(p) > 1), None)
        if cycle:
            i = cycle.index(min(cycle))
            found.add(tuple(cycle[i:] + cycle[:i]))
    return [[*c, c[0]] for c in sorted(found, key=lambda c: (len(c), c))]


def describe(cycle: list[str], graph: dict[str, dict[str, set[str]]]) -> str:
    """`a -> b (a/x.py, a/y.py) -> ... -> a`: each edge with the files that make it."""
    steps = [cycle[0]]
    for a, b in zip(cycle, cycle[1:], strict=False):
        steps.append(f"{b} (by {', '.join(sorted(graph[a][b]))})")
    return " -> ".join(steps)


def test_subpackages_import_one_way():
    graph = subpackage_imports()
    assert "export" in graph.get("train", {}) and "checkpoint" in graph.get("export", {}), \
        "no imports found between subpackages: the parser is broken"
    cycles = find_cycles(graph)
    assert not cycles, ("subpackages of src/fsdpkit import each other in a cycle:\n  "
                        + "\n  ".join(describe(c, graph) for c in cycles)
                        + "\nmove what both need into the lower one (or a subpackage below both), not the import into "
                          "a function (STYLE.md rule 17)")


def test_a_cycle_hidden_in_a_function_or_a_relative_import_is_found(tmp_path):
    src = tmp_path / "fsdpkit"
    (src / "low").mkdir(parents=True)
    (src / "high").mkdir()
    (src / "__init__.py").write_text('__version__ = "0"\n')
    (src / "dist.py").write_text("from fsdpkit import __version__\n")
    (src / "low" / "__init__.py").write_text("from .core import thing\n")
    (src / "low" / "core.py").write_text("def thing():\n    from fsdpkit.high.top import x\n    return x\n")
    (src / "high" / "__init__.py").write_text("")
    (src / "high" / "top.py").write_text("from ..low import thing\nfrom fsdpkit import dist\nx = 1\n")
    graph = subpackage_imports(src)
    assert graph == {"fsdpkit": {}, "dist": {"fsdpkit": {"dist.py"}}, "high": {"low": {"high/top.py"},
                                                                              "dist": {"high/top.py"}},
                     "low": {"high": {"low/core.py"}}}
    assert find_cycles(graph) == [["high", "low", "high"]]
    assert describe(["high", "low", "high"], graph) == "high -> low (by high/top.py) -> high (by low/core.py)"
    assert find_cycles({"a": {"b": set()}, "b": {"c": set()}, "c": {}}) == []
    loops = {"a": {"b": set()}, "b": {"c": set(), "a": set()}, "c": {"a": set()}, "d": {"c": set()}}
    assert find_cycles(loops) == [["a", "b", "a"], ["a", "b", "c", "a"]]  # the shortest through each node


MODEL_MAY_IMPORT = {"config"}  # a model is built from config.schema's model section; nothing else of fsdpkit


def test_model_imports_no_other_layer():
    """STYLE.md's layout: model/ holds plain nn.Modules, never checkpoints, sharding or files."""
    graph = subpackage_imports()
    extra = {node: files for node, files in graph["model"].items() if node not in MODEL_MAY_IMPORT}
    assert not extra, "model/ imports " + "; ".join(f"{n} (by {', '.join(sorted(f))})"
                                                    for n, f in sorted(extra.items()))
