"""The documentation holds together: every relative link in README.md, DESIGN.md and docs/*.md points to an existing
file (and, into a markdown file, to an existing heading), and the README gives the test command that CI runs."""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

import pytest
from project import MODULES, ROOT, SCRIPTS

DOCUMENTS = sorted([ROOT / "README.md", ROOT / "DESIGN.md", *(ROOT / "docs").glob("*.md")])
TEST_COMMAND = "python -m pytest -q -n auto --dist loadscope"

FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t#]*$", re.MULTILINE)


def prose(text: str) -> str:
    """The text without fenced code blocks and inline code, where a [x](y) is not a link."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def anchors(text: str) -> set[str]:
    """GitHub's heading ids: lowercase, punctuation dropped (except - and _), spaces to hyphens, -1, -2 ... for
    repeats."""
    seen: dict[str, int] = {}
    ids = set()
    for heading in HEADING.findall(FENCE.sub("", text)):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        ids.add(slug if count == 0 else f"{slug}-{count}")
    return ids


def relative_links(document: Path) -> list[str]:
    return [
        target
        for target in LINK.findall(prose(document.read_text(encoding="utf-8")))
        if not re.match(r"[a-z][a-z0-9+.-]*:", target, re.IGNORECASE)
    ]  # http:, https:, mailto: ...


def test_the_documents_are_found():
    names = {path.relative_to(ROOT).as_posix() for path in DOCUMENTS}
    assert {"README.md", "DESIGN.md", "docs/TROUBLESHOOTING.md"} <= names


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda path: path.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(document: Path):
    broken = []
    for target in relative_links(document):
        path_part, _, fragment = target.partition("#")
        linked = (document.parent / path_part).resolve() if path_part else document
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif fragment and linked.suffix == ".md" and fragment not in anchors(linked.read_text(encoding="utf-8")):
            broken.append(f"{target}: no heading with id #{fragment} in {linked.relative_to(ROOT)}")
    assert not broken, f"{document.relative_to(ROOT)}: broken links: {broken}"


def test_the_readme_gives_the_test_command_that_ci_runs():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    code_lines = {
        line.split("  #")[0].strip()  # a command without its comment
        for match in FENCE.finditer(readme)
        for line in match.group(0).splitlines()
    }
    assert TEST_COMMAND in code_lines, f"README.md must give `{TEST_COMMAND}` on its own line in a code block"
    ci = ROOT / ".ci" / "run"
    if ci.exists():
        assert TEST_COMMAND in ci.read_text(encoding="utf-8").splitlines(), ".ci/run must run the README's test command"


@pytest.mark.parametrize("cores, workers", [(1, 1), (2, 2), (4, 4), (8, 4), (None, 1)])
def test_the_test_commands_auto_workers_are_one_per_core_at_most_four(monkeypatch, cores, workers):
    """`-n auto` in TEST_COMMAND asks tests/conftest.py's pytest-xdist hook (os.cpu_count None: unknown)."""
    import conftest

    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    assert conftest.pytest_xdist_auto_num_workers(config=None) == workers


def test_the_link_checker_finds_what_it_should(tmp_path: Path):
    """The checker itself: code is not a link, URLs are not relative, GitHub's ids for headings with code."""
    text = (
        "# Building a corpus (`data.py`)\n## Backups (`--backup-to`, `checkpoint_cloud.py`)\n## A\n## A\n"
        "[x](a.md) `[y](b.md)` [z](https://example.com/c.md)\n```\n[w](d.md)\n# not a heading\n```\n"
    )
    (tmp_path / "doc.md").write_text(text)
    assert relative_links(tmp_path / "doc.md") == ["a.md"]
    assert anchors(text) == {"building-a-corpus-datapy", "backups---backup-to-checkpoint_cloudpy", "a", "a-1"}


# A module by its last name (`hardware.step_memory`: tinyllm.model.hardware), or by the name the code imports it
# under: `store` (checkpoint_store), `data` (tinyllm/data/build.py: data.py's), `model_config` (tinyllm/model/config.py)
SHORT = {name.rsplit(".", 1)[-1]: name for name, path in MODULES.items() if path.stem != "__init__"}
ALIASES = {
    **SHORT,
    "store": "tinyllm.store.checkpoint_store",
    "data": "tinyllm.data.build",
    "model_config": "tinyllm.model.config",
}
NAMED = re.compile(r"`((?:" + "|".join(map(re.escape, ALIASES)) + r")(?:\.[A-Za-z_]\w*)+)")
FILE_SUFFIXES = {"py", "md", "json", "jsonl", "toml", "txt", "ipynb", "sh", "pt", "gguf"}


def resolves(reference: str) -> bool:
    """Whether `module.name[.attr...]` names something that exists: a module attribute, a class attribute,
    or a field declared on a class (dataclass, NamedTuple or plain annotation)."""
    import importlib

    parts = reference.split(".")
    target = importlib.import_module(ALIASES[parts[0]])
    for name in parts[1:]:
        if hasattr(target, name):
            target = getattr(target, name)
            continue
        declared = {field for kind in getattr(target, "__mro__", ()) for field in getattr(kind, "__annotations__", {})}
        return name in declared
    return True


def test_every_backticked_module_name_in_docs_and_docstrings_resolves():
    """`hardware.step_memory` in a document or a docstring names a function that exists: a rename or a move
    fails here, not in a reader's hands."""
    sources = [*DOCUMENTS, *SCRIPTS, *MODULES.values(), *(ROOT / "bench").glob("*.py")]
    stale = []
    for source in sources:
        text = source.read_text(encoding="utf-8")
        for match in NAMED.finditer(text):
            reference = match.group(1)
            if reference.rsplit(".", 1)[-1] not in FILE_SUFFIXES and not resolves(reference):
                stale.append(f"{source.relative_to(ROOT)}:{text[: match.start()].count(chr(10)) + 1}: {reference}")
    assert stale == []
    assert resolves("hardware.step_memory") and resolves("attention.Documents.cu_seqlens")
    assert not resolves("train.Checkpointer") and not resolves("hardware.ASSUMED_MFU")  # what it would catch


def documented_parsers() -> dict[str, argparse.ArgumentParser]:
    """The command lines whose every option the docs name: export_gguf.py's, report.py samples' and evaluate's."""
    from tinyllm.outputs import export_gguf, report

    commands = next(action for action in report.build_parser()._actions if action.choices).choices
    return {
        "export_gguf.py": export_gguf.build_parser(),
        "report.py samples": commands["samples"],
        "report.py evaluate": commands["evaluate"],
    }


@pytest.mark.parametrize("command", documented_parsers())
def test_every_option_of_these_commands_is_in_the_docs(command):
    text = "\n".join(document.read_text(encoding="utf-8") for document in DOCUMENTS)
    flags = [flag for action in documented_parsers()[command]._actions for flag in action.option_strings]
    missing = [flag for flag in flags if flag.startswith("--") and flag != "--help" and not named(flag, text)]
    assert not missing, f"{command}: {missing} in its --help but nowhere in README.md or docs/"


def named(flag: str, text: str) -> bool:
    """Whether `text` names `flag` itself (`--name`, not only `--name-of-something`)."""
    return re.search(re.escape(flag) + r"(?![\w-])", text) is not None
