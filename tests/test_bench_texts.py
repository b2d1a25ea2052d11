"""bench/bench_texts.py: the real texts the benches read from this machine."""

from __future__ import annotations

import gzip
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import bench_texts  # noqa: E402

from tinyllm.common import UserError  # noqa: E402


def write_gz(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt", encoding="utf-8") as handle:
        handle.write(text)


def test_linux_documentation_is_one_document_a_file_without_translations_or_stubs(tmp_path):
    for name in ("admin-guide/a.rst.gz", "b.rst.gz", "core-api/c.rst.gz"):
        write_gz(tmp_path / name, f"{name}\n" + "x" * 300)
    write_gz(tmp_path / "translations/zh_CN/d.rst.gz", "zh " * 300)
    write_gz(tmp_path / "stub.rst.gz", "too short")
    (tmp_path / "notes.txt").write_text("y" * 300)
    texts = bench_texts.linux_documentation(10**6, root=tmp_path)
    assert sorted(text.split("\n")[0] for text in texts) == ["admin-guide/a.rst.gz", "b.rst.gz", "core-api/c.rst.gz"]
    assert bench_texts.linux_documentation(10**6, root=tmp_path) == texts  # the same order every time
    assert len(bench_texts.linux_documentation(1, root=tmp_path)) == 1  # the first one crosses the limit


def test_linux_documentation_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setattr(bench_texts.os, "geteuid", lambda: 1000)  # not root: nothing is installed
    with pytest.raises(UserError, match="apt-get install linux-doc-6.1"):
        bench_texts.linux_documentation(10**6, root=tmp_path / "missing")
