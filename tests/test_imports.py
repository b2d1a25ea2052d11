"""The project's modules import one another one way: parsed from the source (every import, function-level ones
included), so a cycle fails here and not as a half-initialized module at some later import. bench/'s modules are
read too; a test module imports no other test module (shared helpers live in tests/'s helper modules and
conftest.py); and a function-level import of a project module is one listed in docs/development.md."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MODULES = sorted(path.stem for path in ROOT.glob("*.py"))
BENCH = sorted(path.stem for path in (ROOT / "bench").glob("*.py"))
TESTS = ROOT / "tests"
DEVELOPMENT = ROOT / "docs" / "development.md"


def runtime_nodes(tree: ast.AST):
    """Every node of `tree` but those under `if TYPE_CHECKING:` (annotations only: no import at run time)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            yield from (child for other in node.orelse for child in [other, *runtime_nodes(other)])
            continue
        yield node
        yield from runtime_nodes(node)


def imported_modules(source: str, known: set[str]) -> set[str]:
    """The names of `known` that `source` imports anywhere at run time (top level or inside a function)."""
    found = set()
    for node in runtime_nodes(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found & known


def import_graph() -> dict[str, set[str]]:
    """The project's modules and bench/'s, each with the ones it imports."""
    paths = {name: ROOT / f"{name}.py" for name in MODULES} | {name: ROOT / "bench" / f"{name}.py" for name in BENCH}
    return {
        name: imported_modules(path.read_text(encoding="utf-8"), set(paths)) - {name} for name, path in paths.items()
    }


def function_level_imports(source: str, known: set[str]) -> set[tuple[str, str]]:
    """(function, module) for each module of `known` imported inside a function (FUNCTION or CLASS.FUNCTION)."""
    found = set()

    def visit(node: ast.AST, scope: list[str], inside: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                visit(child, [*scope, child.name], inside or not isinstance(child, ast.ClassDef))
            elif inside and isinstance(child, ast.Import | ast.ImportFrom):
                found.update((".".join(scope), name) for name in imported_modules(ast.unparse(child), known))
            else:
                visit(child, scope, inside)

    visit(ast.parse(source), [], False)
    return found


def listed_function_level_imports() -> set[tuple[str, str, str]]:
    """docs/development.md's list: lines "- `MODULE.FUNCTION` imports `MODULE`: why"."""
    return set(re.findall(r"^- `(\w+)\.([\w.]+)` imports `(\w+)`", DEVELOPMENT.read_text(), re.M))


def reaches(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module `start` imports, directly or through others."""
    seen, todo = set(), [start]
    while todo:
        for name in graph[todo.pop()] - seen:
            seen.add(name)
            todo.append(name)
    return seen


@pytest.mark.parametrize(
    "source, known, expected",
    [
        ("import report\nimport numpy as np", {"report", "data"}, {"report"}),
        ("def f():\n    import report", {"report"}, {"report"}),
        (
            "from data import EOS\nimport checkpoint_store as store",
            {"data", "checkpoint_store"},
            {"data", "checkpoint_store"},
        ),
        ("from .report import x\nimport reporting", {"report"}, set()),  # relative: not a root module
        ("if TYPE_CHECKING:\n    import report\nelse:\n    import data", {"report", "data"}, {"data"}),  # annotations
    ],
)
def test_imported_modules_finds_every_import_of_a_project_module(source, known, expected):
    assert imported_modules(source, known) == expected


def test_reaches_follows_imports_through_other_modules():
    graph = {"a": {"b"}, "b": {"c"}, "c": set(), "d": {"a"}}
    assert reaches(graph, "a") == {"b", "c"} and reaches(graph, "c") == set() and reaches(graph, "d") == {"a", "b", "c"}


def test_reaches_follows_a_cycle_back_to_its_start():
    graph = {"bench_a": {"bench_b"}, "bench_b": {"bench_a", "train"}, "train": set()}
    assert "bench_a" in reaches(graph, "bench_a") and "train" not in reaches(graph, "train")


def test_no_module_imports_itself_back():
    """The project's modules and bench/'s (bench_recipe, bench_packing and bench_elementwise_quality once took
    each other's texts: bench_texts.py holds them now)."""
    graph = import_graph()
    assert set(BENCH) <= set(graph) and {"bench_texts", "train"} <= graph["bench_recipe"]
    cycles = sorted(name for name in graph if name in reaches(graph, name))
    assert not cycles, f"import cycles through {cycles}: { ({name: sorted(graph[name]) for name in cycles}) }"


def test_no_test_module_imports_another():
    """Shared test support lives in conftest.py and tests/'s helper modules (tiny_runs, stores, cards, ...)."""
    tests = {path.stem for path in TESTS.glob("test_*.py")}
    imports = {
        path.name: sorted(imported_modules(path.read_text(encoding="utf-8"), tests) - {path.stem})
        for path in sorted(TESTS.glob("*.py"))
    }
    assert not {name: found for name, found in imports.items() if found}


@pytest.mark.parametrize(
    "source, expected",
    [
        ("import train\ndef f():\n    import report\n    from data import EOS", {("f", "report"), ("f", "data")}),
        ("class A:\n    import data\n    def g(self):\n        import report", {("A.g", "report")}),
        ("def f():\n    def g():\n        import numpy\n        import report", {("f.g", "report")}),
    ],
)
def test_function_level_imports_are_found_with_their_function(source, expected):
    assert function_level_imports(source, {"train", "report", "data"}) == expected


def test_every_function_level_import_of_a_project_module_is_listed():
    """None except where it defers a heavy or optional dependency, each in docs/development.md with its reason."""
    found = {
        (name, function, module)
        for name in MODULES
        for function, module in function_level_imports((ROOT / f"{name}.py").read_text(encoding="utf-8"), set(MODULES))
    }
    listed = listed_function_level_imports()
    assert listed, "docs/development.md lists no function-level imports"
    assert found == listed, f"not listed: {sorted(found - listed)}; listed but gone: {sorted(listed - found)}"


def test_report_evaluation_generation_import_one_way():
    """report -> evaluation -> generation: generating knows nothing of scores, scoring nothing of the report."""
    graph = import_graph()
    assert {"evaluation", "generation"} <= graph["report"] and "generation" in graph["evaluation"]
    assert not {"report", "evaluation"} & reaches(graph, "generation")
    assert "report" not in reaches(graph, "evaluation")
    assert "report" not in reaches(graph, "publishing")
