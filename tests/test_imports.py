"""The project's modules import one another one way: parsed from the source (every import, function-level ones
included), so a cycle fails here and not as a half-initialized module at some later import."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MODULES = sorted(path.stem for path in ROOT.glob("*.py"))


def imported_modules(source: str, known: set[str]) -> set[str]:
    """The names of `known` that `source` imports anywhere (top level or inside a function)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found & known


def import_graph() -> dict[str, set[str]]:
    return {name: imported_modules((ROOT / f"{name}.py").read_text(encoding="utf-8"), set(MODULES)) - {name}
            for name in MODULES}


def reaches(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module `start` imports, directly or through others."""
    seen, todo = set(), [start]
    while todo:
        for name in graph[todo.pop()] - seen:
            seen.add(name)
            todo.append(name)
    return seen


@pytest.mark.parametrize("source, known, expected", [
    ("import report\nimport numpy as np", {"report", "data"}, {"report"}),
    ("def f():\n    import report", {"report"}, {"report"}),
    ("from data import EOS\nimport checkpoint_store as store", {"data", "checkpoint_store"},
     {"data", "checkpoint_store"}),
    ("from .report import x\nimport reporting", {"report"}, set()),  # relative: not a root module
])
def test_imported_modules_finds_every_import_of_a_project_module(source, known, expected):
    assert imported_modules(source, known) == expected


def test_reaches_follows_imports_through_other_modules():
    graph = {"a": {"b"}, "b": {"c"}, "c": set(), "d": {"a"}}
    assert reaches(graph, "a") == {"b", "c"} and reaches(graph, "c") == set() and reaches(graph, "d") == {"a", "b", "c"}


def test_no_module_imports_itself_back():
    graph = import_graph()
    cycles = sorted(name for name in MODULES if name in reaches(graph, name))
    assert not cycles, f"import cycles through {cycles}: {({name: sorted(graph[name]) for name in cycles})}"


def test_report_evaluation_generation_import_one_way():
    """report -> evaluation -> generation: generating knows nothing of scores, scoring nothing of the report."""
    graph = import_graph()
    assert {"evaluation", "generation"} <= graph["report"] and "generation" in graph["evaluation"]
    assert not {"report", "evaluation"} & reaches(graph, "generation")
    assert "report" not in reaches(graph, "evaluation")
    assert "report" not in reaches(graph, "publishing")
