"""The real texts the benches train on, read from this machine (no download): the King James Bible
(Debian's bible-kjv), Debian changelog entries, English man pages, Linux's documentation (Debian's
linux-doc-6.1: long documents, prose and reStructuredText). One module: bench_recipe.py,
bench_packing.py, bench_elementwise_quality.py, bench_budget.py and bench_mixture.py take them from here, and
build their corpora with `make_corpus` (the same splits everywhere); bench_vocab.py takes them and SPLITS, and
builds with `python data.py` itself (the command line is what it measures)."""

from __future__ import annotations

import gzip
import json
import os
import random
import re
import shutil
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tinyllm.common import UserError  # noqa: E402
from tinyllm.data import build as data  # noqa: E402

TEXTS = ("kjv", "manpages", "changelog", "linuxdoc")
# The benches' held-out documents: 2% validation, 5% test (held-out bits per byte is measured on the test split).
SPLITS = ("--val-fraction", "0.02", "--test-fraction", "0.05")
ENTRY_START = re.compile(r"^\S+ \([^)]*\) [^;]*; urgency=", re.MULTILINE)  # a Debian changelog entry's first line
MAN_SECTIONS = ("man1", "man2", "man3", "man5", "man7", "man8")
LINUX_DOCS = Path("/usr/share/doc/linux-doc-6.1/Documentation")


def text_documents(name: str, limit_bytes: int) -> list[str]:
    """The documents of a built-in text, at most `limit_bytes` of them."""
    if name == "manpages":
        return man_pages(limit_bytes)
    if name == "linuxdoc":
        return linux_documentation(limit_bytes)
    return changelog_entries(limit_bytes) if name == "changelog" else take_bytes(kjv_documents(), limit_bytes)


def install_package(package: str, why: str) -> None:
    """Debian's `package`, installed with apt-get where this runs as root (else left to the caller's message)."""
    if os.geteuid() == 0 and shutil.which("apt-get"):
        print(f"installing Debian's {package} ({why}) with apt-get", flush=True)
        subprocess.run(["apt-get", "install", "-y", "-q", package], check=False, stdout=subprocess.DEVNULL)


def kjv_documents() -> list[str]:
    """The KJV Bible, one document per chapter, from Debian's bible-kjv (installed when missing, as root)."""
    if shutil.which("bible") is None:
        install_package("bible-kjv", "the benchmark's real English text")
        if shutil.which("bible") is None:
            raise UserError(
                "the benchmark text needs Debian's bible-kjv package: sudo apt-get install bible-kjv "
                "(or pass --text FILE.jsonl of real English documents)"
            )
    dump = subprocess.run(
        ["bible", "-f", "Gen1:1-Rev22:21"], capture_output=True, text=True, stdin=subprocess.DEVNULL, check=True
    ).stdout
    chapters: dict[tuple[str, str], list[str]] = {}
    for line in dump.splitlines():
        verse = re.match(r"([1-3]?[A-Za-z]+)(\d+):\d+ (.*)", line)
        if verse:
            chapters.setdefault((verse[1], verse[2]), []).append(verse[3])
    if len(chapters) != 1189:
        raise UserError(f"bible -f printed {len(chapters)} chapters, expected 1189")
    return ["\n".join(verses) for verses in chapters.values()]


def changelog_entries(limit_bytes: int, seed: int = 0) -> list[str]:
    """Debian changelog entries (one per package version), shuffled, at most `limit_bytes` of text."""
    entries = []
    for path in sorted(Path("/usr/share/doc").glob("*/changelog.Debian.gz")):
        text = gzip.open(path, "rt", encoding="utf-8", errors="replace").read()
        starts = [match.start() for match in ENTRY_START.finditer(text)] + [len(text)]
        entries += [text[a:b].strip() for a, b in zip(starts, starts[1:]) if text[a:b].strip()]
    if len(entries) < 1000:
        raise UserError(
            f"found only {len(entries)} Debian changelog entries in /usr/share/doc; the short corpus "
            "needs at least 1,000"
        )
    random.Random(seed).shuffle(entries)
    return take_bytes(entries, limit_bytes)


def linux_documentation(limit_bytes: int, seed: int = 0, root: Path = LINUX_DOCS) -> list[str]:
    """Linux's documentation, one document per reStructuredText file (translations left out), shuffled, at most
    `limit_bytes` of text: Debian's linux-doc-6.1 (installed when missing, as root), 21 MB in all."""
    if not root.is_dir():
        install_package("linux-doc-6.1", "a benchmark text of long documents")
    paths = sorted(
        (path for path in root.rglob("*.rst.gz") if "translations" not in path.relative_to(root).parts), key=str
    )
    if not paths:
        raise UserError(f"no Linux documentation under {root}: sudo apt-get install linux-doc-6.1")
    random.Random(seed).shuffle(paths)
    texts = (gzip.open(path, "rt", encoding="utf-8", errors="replace").read() for path in paths)
    return take_bytes((text for text in texts if len(text) >= 200), limit_bytes)  # read only as many as kept


def take_bytes(texts: Iterable[str], limit_bytes: int) -> list[str]:
    """The first texts, in order, until `limit_bytes` of UTF-8 are reached (the one that crosses it included)."""
    kept, size = [], 0
    for text in texts:
        if size >= limit_bytes:
            break
        kept.append(text)
        size += len(text.encode("utf-8"))
    return kept


def man_pages(limit_bytes: int, seed: int = 0) -> list[str]:
    """English man pages rendered to plain text (one per page), in a shuffled order, at most `limit_bytes`."""
    if shutil.which("man") is None or shutil.which("col") is None:
        raise UserError("the long text needs man and col (Debian's man-db and bsdextrautils)")
    pages = sorted(
        path
        for section in MAN_SECTIONS
        for path in (Path("/usr/share/man") / section).glob("*")
        if not path.name.startswith("gcloud")
    )
    random.Random(seed).shuffle(pages)
    env = {**os.environ, "MANWIDTH": "80", "MAN_KEEP_FORMATTING": "", "LC_ALL": "C.UTF-8"}
    texts, size = [], 0
    for page in pages:
        if size >= limit_bytes:
            break
        rendered = subprocess.run(["man", "-l", str(page)], capture_output=True, env=env, stdin=subprocess.DEVNULL)
        plain = subprocess.run(["col", "-bx"], input=rendered.stdout, capture_output=True, env=env).stdout
        text = re.sub(r"\n{3,}", "\n\n", plain.decode("utf-8", errors="replace")).strip()
        if rendered.returncode == 0 and len(text) >= 200:  # a rendered page, not a stub or an error
            texts.append(text)
            size += len(text.encode("utf-8"))
    if size < limit_bytes // 2:
        raise UserError(f"rendered only {size:,} bytes of man pages from /usr/share/man (wanted {limit_bytes:,})")
    return texts


def write_jsonl(path: Path, texts: list[str]) -> Path:
    """One {"text": ...} record a line: what data.py reads."""
    with open(path, "w", encoding="utf-8") as handle:
        handle.writelines(json.dumps({"text": text}) + "\n" for text in texts)
    return path


def make_corpus(sources: list[Path], corpus: Path, *options: str, vocab_size: int = 4096) -> Path:
    """data.py over the JSONL `sources` into `corpus`, with the benches' splits (SPLITS) and a `vocab_size` BPE;
    `options`: more of data.py's options (e.g. --tokenizer, --overwrite)."""
    inputs = [str(source) for source in sources]
    vocab = ["--vocab-size", str(vocab_size)]
    if data.main(["--data", *inputs, "--out", str(corpus), *vocab, *SPLITS, "--no-progress", *options]):
        raise UserError(f"data.py could not build {corpus}")
    return corpus
