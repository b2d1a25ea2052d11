"""The project's files by kind, for the tests that read its source: tinyllm's modules by dotted name, the
root scripts (a clone's entry points) and bench/'s scripts."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "tinyllm"
LAYERS = ("data", "model", "store", "outputs", "training")  # tinyllm's sub-packages, lowest first


def dotted_name(path: Path) -> str:
    """tinyllm/training/train.py -> tinyllm.training.train; a package's __init__.py -> the package."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {dotted_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}  # packages included
SCRIPTS = sorted(ROOT.glob("*.py"))  # train.py, data.py, ...: each calls a module's command
BENCH = {path.stem: path for path in sorted((ROOT / "bench").glob("*.py"))}


def layer(name: str) -> str | None:
    """The sub-package a module of tinyllm is in ("training" for tinyllm.training.train); None for tinyllm's
    own modules (common) and the package itself."""
    parts = name.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in LAYERS) else None
