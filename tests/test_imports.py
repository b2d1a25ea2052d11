"""The project's modules import one another one way: parsed from the source (every import, function-level ones
included), so a cycle fails here and not as a half-initialized module at some later import. tinyllm's layers
import only downward (common, data, model, store, outputs, training: tinyllm/__init__.py); bench/'s modules are
read too; a test module imports no other test module (shared helpers live in tests/'s helper modules and
conftest.py); and a function-level import of a project module is one listed in docs/development.md."""

from __future__ import annotations

import ast
import re

import pytest
from project import BENCH, LAYERS, MODULES, ROOT, SCRIPTS, layer

TESTS = ROOT / "tests"
DEVELOPMENT = ROOT / "docs" / "development.md"
SOURCES = {**MODULES, **BENCH}  # every module the graph holds: tinyllm's by dotted name, bench's by stem


def runtime_nodes(tree: ast.AST):
    """Every node of `tree` but those under `if TYPE_CHECKING:` (annotations only: no import at run time)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            yield from (child for other in node.orelse for child in [other, *runtime_nodes(other)])
            continue
        yield node
        yield from runtime_nodes(node)


def imported_by(node: ast.AST, known: set[str]) -> set[str]:
    """The modules of `known` an import statement imports: `from tinyllm.training import train` and
    `from tinyllm.training.train import command` both import tinyllm.training.train."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names} & known
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        found = {f"{node.module}.{alias.name}" for alias in node.names} & known
        named = {node.module} & known if len(found) < len(node.names) else set()
        return found | named
    return set()


def imported_modules(source: str, known: set[str]) -> set[str]:
    """The names of `known` that `source` imports anywhere at run time (top level or inside a function)."""
    return set().union(*(imported_by(node, known) for node in runtime_nodes(ast.parse(source))))


def import_graph() -> dict[str, set[str]]:
    """tinyllm's modules and bench/'s, each with the ones it imports."""
    return {
        name: imported_modules(path.read_text(encoding="utf-8"), set(SOURCES)) - {name}
        for name, path in SOURCES.items()
    }


def rank(name: str) -> int:
    """A module's place in the layers, lowest first: the package, common, then the sub-packages of LAYERS."""
    if layer(name) is None:
        return ["tinyllm", "tinyllm.common"].index(name)
    return 2 + LAYERS.index(layer(name))


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Each import of tinyllm's that goes up its layers ("tinyllm.data.build -> tinyllm.model.config")."""
    return sorted(
        f"{name} -> {target}"
        for name, targets in graph.items()
        if name.startswith("tinyllm")
        for target in targets
        if target.startswith("tinyllm") and rank(target) > rank(name)
    )


def function_level_imports(source: str, known: set[str]) -> set[tuple[str, str]]:
    """(function, module) for each module of `known` imported inside a function (FUNCTION or CLASS.FUNCTION)."""
    found = set()

    def visit(node: ast.AST, scope: list[str], inside: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                visit(child, [*scope, child.name], inside or not isinstance(child, ast.ClassDef))
            elif inside and isinstance(child, ast.Import | ast.ImportFrom):
                found.update((".".join(scope), name) for name in imported_by(child, known))
            else:
                visit(child, scope, inside)

    visit(ast.parse(source), [], False)
    return found


def short(name: str) -> str:
    """How docs/development.md names a module: its last part (tinyllm.training.muon -> muon)."""
    return name.rsplit(".", 1)[-1]


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
    "source, expected",
    [
        ("from tinyllm.outputs import report\nimport numpy as np", {"tinyllm.outputs.report"}),
        ("def f():\n    from tinyllm.outputs import report", {"tinyllm.outputs.report"}),
        (
            "from tinyllm.data.build import EOS\nfrom tinyllm.store import checkpoint_store as store",
            {"tinyllm.data.build", "tinyllm.store.checkpoint_store"},
        ),
        ("from tinyllm.outputs import report, reporting", {"tinyllm.outputs.report", "tinyllm.outputs"}),
        ("import tinyllm.outputs.report\nimport tinyllm", {"tinyllm.outputs.report", "tinyllm"}),
        ("from .report import x\nimport report", set()),  # relative, or not tinyllm's
        (
            "if TYPE_CHECKING:\n    from tinyllm.outputs import report\nelse:\n    from tinyllm.data import build",
            {"tinyllm.data.build"},  # annotations only: no arrow
        ),
    ],
)
def test_imported_modules_finds_every_import_of_a_project_module(source, expected):
    known = {
        "tinyllm",
        "tinyllm.outputs",
        "tinyllm.outputs.report",
        "tinyllm.data.build",
        "tinyllm.store.checkpoint_store",
    }
    assert imported_modules(source, known) == expected


def test_reaches_follows_imports_through_other_modules():
    graph = {"a": {"b"}, "b": {"c"}, "c": set(), "d": {"a"}}
    assert reaches(graph, "a") == {"b", "c"} and reaches(graph, "c") == set() and reaches(graph, "d") == {"a", "b", "c"}


def test_reaches_follows_a_cycle_back_to_its_start():
    graph = {"bench_a": {"bench_b"}, "bench_b": {"bench_a", "train"}, "train": set()}
    assert "bench_a" in reaches(graph, "bench_a") and "train" not in reaches(graph, "train")


def test_the_graph_holds_every_module_with_its_imports():
    graph = import_graph()
    assert {"tinyllm.training.train", "tinyllm.data.build", "bench_recipe", "bench_texts"} <= set(graph)
    assert {"bench_texts", "tinyllm.training.train"} <= graph["bench_recipe"]
    assert {"tinyllm.outputs.report", "tinyllm.store.checkpoint_store"} <= graph["tinyllm.training.train"]


def test_no_module_imports_itself_back():
    """tinyllm's modules and bench/'s (bench_recipe, bench_packing and bench_elementwise_quality once took
    each other's texts: bench_texts.py holds them now)."""
    graph = import_graph()
    cycles = sorted(name for name in graph if name in reaches(graph, name))
    assert not cycles, f"import cycles through {cycles}: { ({name: sorted(graph[name]) for name in cycles}) }"


def test_every_module_is_in_a_layer():
    """common.py at the top; every other module in one of the sub-packages LAYERS names, in that order."""
    packages = {path.parent.name for path in MODULES.values() if path.parent.name != "tinyllm"}
    assert packages == set(LAYERS)
    assert all(layer(name) in LAYERS for name in MODULES if name not in ("tinyllm", "tinyllm.common"))


@pytest.mark.parametrize(
    "graph, expected",
    [
        ({"tinyllm.model.config": {"tinyllm.data.build", "tinyllm.common"}}, []),
        ({"tinyllm.training.train": {"tinyllm.outputs.report", "tinyllm.training.budget"}}, []),
        ({"tinyllm.data.build": {"tinyllm.model.config"}}, ["tinyllm.data.build -> tinyllm.model.config"]),
        ({"tinyllm.common": {"tinyllm.store.remote_store"}}, ["tinyllm.common -> tinyllm.store.remote_store"]),
        (
            {"tinyllm.outputs.artifacts": {"tinyllm.training.train"}},
            ["tinyllm.outputs.artifacts -> tinyllm.training.train"],
        ),
    ],
)
def test_upward_imports_are_found(graph, expected):
    assert upward_imports(graph) == expected


def test_the_layers_import_only_downward():
    """data <- model <- store <- outputs <- training, all on common: a layer imports none above it."""
    assert upward_imports(import_graph()) == []


def test_each_root_script_imports_only_its_command():
    """train.py, data.py, ...: entry points of a few lines, no code of their own."""
    for script in SCRIPTS:
        tree = ast.parse(script.read_text(encoding="utf-8"))
        imports = [node for node in tree.body if isinstance(node, ast.Import | ast.ImportFrom)]
        assert len(imports) == 1 and [alias.name for alias in imports[0].names] == ["command"], script.name
        assert imports[0].module in MODULES, script.name


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
        (
            "import train\ndef f():\n    from tinyllm.outputs import report\n    from tinyllm.data.build import EOS",
            {("f", "tinyllm.outputs.report"), ("f", "tinyllm.data.build")},
        ),
        (
            "class A:\n    from tinyllm.data import build\n    def g(self):\n"
            "        from tinyllm.outputs import report",
            {("A.g", "tinyllm.outputs.report")},
        ),
        (
            "def f():\n    def g():\n        import numpy\n        from tinyllm.outputs import report",
            {("f.g", "tinyllm.outputs.report")},
        ),
    ],
)
def test_function_level_imports_are_found_with_their_function(source, expected):
    assert function_level_imports(source, {"tinyllm.outputs.report", "tinyllm.data.build"}) == expected


def test_every_function_level_import_of_a_project_module_is_listed():
    """None except where it defers a heavy or optional dependency, each in docs/development.md with its reason:
    tinyllm's modules and bench's."""
    found = {
        (short(name), function, short(module))
        for name, path in SOURCES.items()
        for function, module in function_level_imports(path.read_text(encoding="utf-8"), set(SOURCES))
    }
    listed = listed_function_level_imports()
    assert listed, "docs/development.md lists no function-level imports"
    assert found == listed, f"not listed: {sorted(found - listed)}; listed but gone: {sorted(listed - found)}"


def test_report_evaluation_generation_import_one_way():
    """report -> evaluation -> generation: generating knows nothing of scores, scoring nothing of the report."""
    graph = import_graph()
    report, evaluation, generation = "tinyllm.outputs.report", "tinyllm.outputs.evaluation", "tinyllm.model.generation"
    assert {evaluation, generation} <= graph[report] and generation in graph[evaluation]
    assert not {report, evaluation} & reaches(graph, generation)
    # a chat prompt is rendered by corpus_format's chat render, as a training chat is: not through the builder
    assert "tinyllm.data.build" not in reaches(graph, generation)
    assert report not in reaches(graph, evaluation)
    assert report not in reaches(graph, "tinyllm.outputs.publishing")
