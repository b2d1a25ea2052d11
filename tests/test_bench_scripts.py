"""Every bench/*.py script imports and answers --help, and every name it takes from a project module exists.

Nothing else runs most of them, so a stale reference (`train.DistInfo`, `train.GRAD_CLIP`: both moved)
would otherwise wait for the next benchmark run. The --help runs share one child process (one torch
import, ~10 s); the names are read off each script's syntax tree, so those inside functions count too."""

from __future__ import annotations

import ast
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from project import BENCH, MODULES, ROOT

SCRIPTS = sorted(BENCH.values())
KNOWN = {*MODULES, *BENCH}  # tinyllm.training.train, ..., bench_recipe, s3_server

# Each script as `python bench/NAME.py --help` runs it: as __main__, its own folder first on sys.path.
HELP_EACH = """
import contextlib, io, json, runpy, sys
target, results = sys.argv[1], {}
for path in sys.argv[2:]:
    sys.argv, sys.path[0], shown = [path, "--help"], path.rsplit("/", 1)[0], io.StringIO()
    try:
        with contextlib.redirect_stdout(shown):
            runpy.run_path(path, run_name="__main__")
        code = 0
    except SystemExit as exit:
        code = exit.code or 0
    except BaseException as error:
        code = f"{type(error).__name__}: {error}"
    results[path] = [code, shown.getvalue()]
open(target, "w").write(json.dumps(results))
"""


@pytest.fixture(scope="module")
def helps(tmp_path_factory) -> dict[str, list]:
    """{script name: [exit code or the exception, what --help printed]}."""
    out = tmp_path_factory.mktemp("helps") / "helps.json"
    done = subprocess.run(
        [sys.executable, "-c", HELP_EACH, str(out), *map(str, SCRIPTS)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.is_file(), done.stderr[-3000:]
    return {Path(path).name: result for path, result in json.loads(out.read_text()).items()}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.name)
def test_each_bench_script_imports_and_answers_help(helps, script):
    code, shown = helps[script.name]
    assert code == 0, code
    if 'if __name__ == "__main__":' in script.read_text():  # a script; the others are modules (s3_server)
        assert shown.startswith("usage:")


def project_names(tree: ast.AST) -> list[tuple[str, str, int]]:
    """(module, name, line) of each `from MODULE import name` and each `ALIAS.name` read, where MODULE is
    a project module (ALIAS: the name a script imports it as: `train` for `from tinyllm.training import train`,
    `store` for checkpoint_store)."""
    aliases, names = {}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases.update({alias.asname or alias.name: alias.name for alias in node.names if alias.name in KNOWN})
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                if f"{node.module}.{alias.name}" in KNOWN:  # a module of a package
                    aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
                elif node.module in KNOWN:
                    names.append((node.module, alias.name, node.lineno))
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Load)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
        ):
            names.append((aliases[node.value.id], node.attr, node.lineno))
    return names


def missing_names(script: Path) -> list[str]:
    names = project_names(ast.parse(script.read_text(), filename=str(script)))
    return [
        f"{script.name}:{line}: {module}.{name}"
        for module, name, line in sorted(set(names))
        if not hasattr(importlib.import_module(module), name)
    ]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.name)
def test_every_name_a_bench_script_takes_from_the_project_exists(script, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))  # bench_recipe, s3_server
    assert missing_names(script) == []


def test_a_moved_name_is_caught(tmp_path):
    stale = tmp_path / "bench_stale.py"
    stale.write_text(
        "from tinyllm.training import train\nfrom tinyllm.store import checkpoint_store as store\n"
        "from tinyllm.model.config import PRESETS, PRESET_NAMES\n\n\ndef main():\n"
        "    return train.GRAD_CLIP, store.Checkpointer, train.parse_args\n"
    )
    assert missing_names(stale) == [
        "bench_stale.py:3: tinyllm.model.config.PRESET_NAMES",
        "bench_stale.py:7: tinyllm.training.train.GRAD_CLIP",
    ]
