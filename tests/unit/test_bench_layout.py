"""bench/ stays readable: no module over MAX_LINES lines, and the bench modules' imports of each
other form a DAG. Read with `ast` only: nothing is imported, so no torch.

Every import of a sibling module counts, the ones inside functions too: an import moved into a
function still needs its module, it only hides the cycle until the function runs.
"""

from __future__ import annotations

import ast
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
MAX_LINES = 500  # STYLE.md, rule 1


def sibling_imports(folder: Path) -> dict[str, set[str]]:
    """{module: the modules of `folder` it imports, anywhere in its body} for every `folder/*.py`
    (the scripts run from `folder`, so a sibling is imported by its bare name)."""
    modules = {p.stem: p for p in sorted(folder.glob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        imported: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module.split(".")[0])
        graph[name] = (imported & modules.keys()) - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` as [a, b, ..., a], or None if it is a DAG."""
    done: set[str] = set()
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        if node in path:
            return path[path.index(node):] + [node]
        if node in done:
            return None
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if cycle := visit(nxt):
                return cycle
        path.pop()
        done.add(node)
        return None

    for start in sorted(graph):
        if cycle := visit(start):
            return cycle
    return None


def test_no_bench_module_over_the_line_limit():
    long = {p.name: n for p in sorted(BENCH.glob("*.py"))
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not long, (f"bench modules over {MAX_LINES} lines: {long}; split each by responsibility "
                      "(STYLE.md rule 1), as checkpoint_worker.py was into its scenarios and checkpoint_measure.py")


def test_bench_imports_form_a_dag():
    graph = sibling_imports(BENCH)
    assert "checkpoint_worker" in graph and graph["checkpoint_worker"], "no bench imports found: the parser is broken"
    cycle = find_cycle(graph)
    assert cycle is None, (f"bench modules import each other in a cycle: {' -> '.join(cycle)}; move what they "
                           "share into a leaf module (as checkpoint_common.py), not the import into a function")


def test_a_cycle_hidden_in_a_function_is_found(tmp_path):
    (tmp_path / "first.py").write_text("import os\nfrom second import helper\n")
    (tmp_path / "second.py").write_text("def helper():\n    from first import os\n    return os\n")
    (tmp_path / "leaf.py").write_text("X = 1\n")
    graph = sibling_imports(tmp_path)
    assert graph == {"first": {"second"}, "second": {"first"}, "leaf": set()}
    assert find_cycle(graph) == ["first", "second", "first"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
