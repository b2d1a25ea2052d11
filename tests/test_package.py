"""pyproject.toml: the flat scripts install as modules and as commands on PATH that are the scripts."""

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

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_script_is_a_module_and_every_command_runs_a_scripts_main():
    modules = PROJECT["tool"]["setuptools"]["py-modules"]
    assert sorted(modules) == sorted(path.stem for path in ROOT.glob("*.py"))  # a new script is not forgotten
    commands = PROJECT["project"]["scripts"]
    for command, target in commands.items():
        module_name, attribute = target.split(":")
        module = importlib.import_module(module_name)
        assert getattr(module, attribute).__module__ == module_name and callable(module.main), command
        assert "run_main(main, script=True)" in (ROOT / f"{module_name}.py").read_text()
    assert set(commands) == {"tinyllm-train", "tinyllm-data", "tinyllm-report", "tinyllm-cloud", "tinyllm-gguf"}


def test_mutation_testing_copies_every_module():
    """mutmut runs the tests in a copy of the sources: a module in neither list is missing there."""
    mutmut = PROJECT["tool"]["mutmut"]
    assert sorted(mutmut["source_paths"] + mutmut["also_copy"]) == sorted(path.name for path in ROOT.glob("*.py"))


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


@pytest.mark.slow
def test_installed_the_commands_and_the_readme_api_work_from_any_folder(tmp_path):
    source = tmp_path / "source"  # a copy: the build leaves build/ behind
    source.mkdir()
    for path in [*ROOT.glob("*.py"), ROOT / "pyproject.toml", ROOT / "requirements.txt", ROOT / "README.md"]:
        shutil.copy(path, source / path.name)
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
        [sys.executable, "-c", "import train; print(train.__file__)"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert Path(imported.stdout.strip()).parent == target  # the installed module, not a checkout's


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
