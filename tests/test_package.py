"""pyproject.toml: the package tinyllm installs as one top-level name, with commands on PATH that are the root
scripts (each calls the same module's `command`)."""

from __future__ import annotations

import importlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from project import MODULES, ROOT, SCRIPTS

from tinyllm.common import CONSOLE_SCRIPTS, SCRIPT_MODULES

PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_package_is_found_whole_and_alone():
    """setuptools finds tinyllm and its sub-packages (a new module needs no edit here); the root scripts stay out."""
    assert PROJECT["tool"]["setuptools"]["packages"]["find"] == {"include": ["tinyllm*"]}
    assert "py-modules" not in PROJECT["tool"].get("setuptools", {})


def test_every_root_script_and_every_command_runs_its_modules_command():
    """train.py and tinyllm-train both call tinyllm.training.train.command, ... (common.SCRIPT_MODULES)."""
    assert sorted(SCRIPT_MODULES) == sorted(path.stem for path in SCRIPTS)  # a new script is declared
    for script in SCRIPTS:
        assert f"from {SCRIPT_MODULES[script.stem]} import command\n" in script.read_text(), script.name
    commands = PROJECT["project"]["scripts"]
    assert commands == {console: f"{SCRIPT_MODULES[script]}:command" for script, console in CONSOLE_SCRIPTS.items()}
    for module_name in SCRIPT_MODULES.values():
        module = importlib.import_module(module_name)
        assert module.command.__module__ == module_name and callable(module.main), module_name
        assert "run_main(main, script=True)" in MODULES[module_name].read_text()
    assert set(commands) == {"tinyllm-train", "tinyllm-data", "tinyllm-report", "tinyllm-cloud", "tinyllm-gguf"}


def test_mutation_testing_copies_every_module():
    """mutmut runs the tests in a copy of the sources: all of tinyllm/, the root scripts beside it."""
    mutmut = PROJECT["tool"]["mutmut"]
    assert mutmut["source_paths"] == ["tinyllm/"]
    assert sorted(mutmut["also_copy"]) == sorted(path.name for path in SCRIPTS)
    assert mutmut["only_mutate"] and all((ROOT / path).is_file() for path in mutmut["only_mutate"])


def test_the_dependencies_are_requirements_txt():
    assert "dependencies" in PROJECT["project"]["dynamic"]
    assert PROJECT["tool"]["setuptools"]["dynamic"]["dependencies"] == {"file": ["requirements.txt"]}


def requirement_names(path: Path) -> set[str]:
    """The packages a requirements file names, those of the files it includes (`-r FILE`) too."""
    from packaging.requirements import Requirement

    lines = [line.split("#", 1)[0].strip() for line in path.read_text().splitlines()]
    included = set().union(
        *(requirement_names(path.parent / line[2:].strip()) for line in lines if line.startswith("-r "))
    )
    return included | {Requirement(line).name.lower() for line in lines if line and not line.startswith("-")}


def test_pip_install_never_pulls_torch():
    """requirements.txt (pip install -r, and pyproject's dependencies) names neither torch nor a package that
    requires it: the image's torch is kept; an old or missing one is hardware.torch_install_problem's line."""
    names = requirement_names(ROOT / "requirements.txt") | {
        name
        for extra in PROJECT["project"]["optional-dependencies"].values()
        for name in (re.split(r"[<>=!~\[ ]", spec, maxsplit=1)[0].lower() for spec in extra)
    }
    assert names and not names & {"torch", "torchvision", "torchaudio", "accelerate", "lm-eval", "lm_eval"}, names


def test_the_dev_requirements_leave_boto3_to_moto():
    """A boto3 line of our own made pip resolve boto3 before aiobotocore's narrow botocore pin and backtrack
    for 20 minutes and more (pip 23, issue 29); moto requires boto3 and s3fs botocore, so both are installed anyway."""
    names = requirement_names(ROOT / "requirements-dev.txt")
    assert {"s3fs", "moto"} <= names and not {"boto3", "botocore"} & names, names


def readme_api_snippet() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Python API", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def installed_names(site: Path) -> set[str]:
    """The importable top-level names an install put in `site` (its metadata and bin/ are not)."""
    return {
        path.stem if path.suffix == ".py" else path.name
        for path in site.iterdir()
        if path.name != "bin" and not path.name.endswith((".dist-info", ".egg-info")) and path.name != "__pycache__"
    }


@pytest.mark.slow
def test_installed_the_commands_and_the_readme_api_work_from_any_folder(tmp_path):
    """One top-level name (tinyllm) beside the console scripts; a module added to the package is installed with
    it (no pyproject.toml edit); the commands and the README's Python API run from another folder."""
    source = tmp_path / "source"  # a copy: the build leaves build/ behind
    source.mkdir()
    for path in [*SCRIPTS, ROOT / "pyproject.toml", ROOT / "requirements.txt", ROOT / "README.md"]:
        shutil.copy(path, source / path.name)
    shutil.copytree(ROOT / "tinyllm", source / "tinyllm", ignore=shutil.ignore_patterns("__pycache__"))
    (source / "tinyllm" / "outputs" / "added_module.py").write_text('"""A module added since."""\n')
    target = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(target),
            str(source),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    assert installed_names(target) == {"tinyllm"}
    assert (target / "tinyllm" / "outputs" / "added_module.py").is_file()
    assert {path.name for path in (target / "bin").iterdir()} == set(PROJECT["project"]["scripts"])
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(target), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [str(target / "bin" / "tinyllm-train"), "--preset", "nope"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and result.stderr.strip().splitlines()[-1].startswith("error: argument --preset")
    snippet = readme_api_snippet()
    result = subprocess.run(
        [sys.executable, "-c", snippet], cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    imported = subprocess.run(
        [sys.executable, "-c", "from tinyllm.training import train; print(train.__file__)"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert Path(imported.stdout.strip()) == target / "tinyllm" / "training" / "train.py"  # not a checkout's


def test_train_without_torch_is_one_error_line_with_the_install_command(tmp_path):
    """A fresh environment with the requirements but no torch (they no longer pull it): one line, exit 1."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    code = (
        "import runpy, sys; sys.modules['torch'] = None; sys.argv = ['train.py']; "
        f"sys.path.insert(0, {str(root)!r}); runpy.run_path({str(root / 'train.py')!r}, run_name='__main__')"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1, result.stderr
    assert lines[0].startswith("error: torch is not installed: tinyllm needs torch>=2.10") and "pip install" in lines[0]


def test_the_dev_constraints_pin_every_requirement_and_leave_torch_out():
    """constraints-dev.txt (.ci/run installs with it) must cover what the requirements name, or pip resolves those
    freely again; torch stays out (installed first, from its own index)."""
    from packaging.utils import canonicalize_name

    lines = [line for line in (ROOT / "constraints-dev.txt").read_text().splitlines() if line and line[0] != "#"]
    pinned = {canonicalize_name(line.split("==")[0]): line.split("==")[1] for line in lines}
    required = requirement_names(ROOT / "requirements-dev.txt")
    assert {"transformers", "pytest", "papermill", "llama-cpp-python"} <= required  # all three files
    # setuptools: each torch release bounds it (requirements-test.txt), so it is left to torch's
    assert {canonicalize_name(name) for name in required} - set(pinned) == {"setuptools"}
    assert "torch" not in pinned and all(pinned.values())
    assert "-c constraints-dev.txt" in (ROOT / ".ci" / "run").read_text()
