"""Helpers shared by tinyllm's scripts: seeding, atomic writes, hashing, timestamps.

Every file a script promises to another (manifests, checkpoints, status files) is
written through `atomic_write_*`: a temporary name beside the target, fsync, rename,
and an fsync of the folder, so a crash leaves either the old file or the new one.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import hashlib
import json
import os
import random
import signal
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

HASH_CHUNK_BYTES = 8 * 1024 * 1024


class UserError(Exception):
    """A mistake the user can fix (bad input, bad setting): printed as one `error:` line (plus
    indented detail lines where a tool's own diagnostics help), exit 2."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread (see stop_on_sigterm): cleaned up like a Ctrl-C."""


def stop_on_sigterm() -> None:
    """Make SIGTERM raise Terminated, so `finally` blocks remove what is half-built and run_main says
    `error: terminated` (exit 143) instead of a silent death that leaves temporary folders."""

    def terminate(signum, frame):
        raise Terminated()

    signal.signal(signal.SIGTERM, terminate)


def fail(message: str, code: int = 2) -> None:
    """Print one clear `error: ...` line to stderr and exit non-zero."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(code)


def os_error_cause(error: OSError) -> str:
    """'no space left on device', 'read-only file system': what an OSError means, without the path."""
    return os.strerror(error.errno).lower() if error.errno else (str(error) or type(error).__name__)


def os_error_text(error: OSError, path: str | os.PathLike | None = None) -> str:
    """'PATH: no space left on device': the file (`path`, else the error's) and the cause, in one line."""
    where = path if path is not None else error.filename
    return f"{where}: {os_error_cause(error)}" if where else os_error_cause(error)


def run_main(main: Callable[[], Any]) -> None:
    """Run a script's main(), turning UserError into a one-line message and exit code 2.

    An OSError that reaches here (a full disk, a read-only or vanished folder: the machine, not the
    code) is one line too, naming the file and the cause; the scripts catch the ones they can
    explain better (which checkpoint is the last good one, ...) before it gets here.

    A Ctrl-C is `error: interrupted` (exit 130) also when a library re-raised the KeyboardInterrupt
    as an exception of its own. Run as a script's entry point (`main` defined in
    __main__), a Ctrl-C after main() has ended is ignored: the outcome is decided and recorded, and
    a traceback from the interpreter's teardown (or a death by the signal) would only hide it.
    """
    script = getattr(main, "__module__", None) == "__main__"
    try:
        result = main()
    except UserError as error:
        fail(str(error))
    except Terminated:
        fail("terminated (SIGTERM); nothing half-written was kept", code=143)
    except KeyboardInterrupt:
        fail("interrupted", code=130)
    except OSError as error:
        if not error.errno:
            raise
        fail(os_error_text(error))
    except Exception as error:
        if caused_by_interrupt(error):
            fail("interrupted", code=130)
        raise
    finally:
        if script:
            with contextlib.suppress(ValueError):  # ValueError: not the main thread
                signal.signal(signal.SIGINT, signal.SIG_IGN)
    if isinstance(result, int):
        raise SystemExit(result)


def caused_by_interrupt(error: BaseException) -> bool:
    """Whether a KeyboardInterrupt is in `error`'s chain of causes (a library re-raised it as its own)."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, KeyboardInterrupt):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and (when installed) torch generators."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    try:
        import torch
    except ImportError:
        return
    torch.manual_seed(seed)


def utc_now() -> str:
    """An ISO-8601 UTC timestamp with a trailing Z, to the second."""
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def sha256_file(path: str | os.PathLike, chunk_bytes: int = HASH_CHUNK_BYTES) -> str:
    """Hex sha256 of a file, read in chunks so size never matters."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk_bytes):
            digest.update(block)
    return digest.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_tree(folder: str | os.PathLike) -> str:
    """One sha256 over every file of a folder (relative names and contents, sorted)."""
    root = Path(folder)
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(sha256_file(path).encode() + b"\n")
    return digest.hexdigest()


def fsync_dir(folder: str | os.PathLike) -> None:
    """Make a rename inside `folder` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def check_writable_folder(folder: str | os.PathLike, what: str) -> None:
    """Create `folder` if needed and write (then remove) a small file there, before any work: a
    read-only mount or a full disk is then one error naming the folder, not a traceback at the end."""
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=".write-test-", dir=folder)
        try:
            os.write(fd, b"x")
        finally:
            os.close(fd)
            os.unlink(name)
    except OSError as error:
        raise UserError(f"{what} {folder} cannot be written: {os_error_cause(error)}") from None


def _process_umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


PLAIN_FILE_MODE = 0o666 & ~_process_umask()  # what open() gives a new file; read once, at import (no race)


def temporary_file_beside(target: Path) -> tuple[int, str]:
    """mkstemp beside `target`, with the permissions a plain open() would give (mkstemp's are owner-only)."""
    fd, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.fchmod(fd, PLAIN_FILE_MODE)
    return fd, name


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "wb") -> Iterator[Any]:
    """Open a temporary file beside `path`; on success fsync and rename it over `path`.

    On any exception the temporary file is removed and `path` is untouched.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, temp_name = temporary_file_beside(target)
    try:
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp_name, target)
        fsync_dir(target.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp_name)
        raise


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with atomic_open(path, "wb") as handle:
        handle.write(data)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_open(path, "w") as handle:
        handle.write(text)


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    """Write JSON (indented, keys in insertion order, trailing newline) atomically."""
    atomic_write_text(path, json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def read_json(path: str | os.PathLike, what: str = "file") -> Any:
    """Read a JSON file, raising UserError that names the file when it is missing or broken."""
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except FileNotFoundError:
        raise UserError(f"{what} not found: {path}") from None
    except json.JSONDecodeError as error:
        raise UserError(f"{what} {path} is not valid JSON (line {error.lineno}: {error.msg})") from None


def append_jsonl(path: str | os.PathLike, record: dict) -> None:
    """Append one JSON line and flush it to disk (metrics logs survive a kill)."""
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(json.dumps(record, ensure_ascii=False) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def human_count(value: float) -> str:
    """12345678 -> '12.3M' (for logs and model cards)."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(value) >= size:
            return f"{value / size:.1f}{unit}"
    return f"{value:.0f}"


class ArgumentParser(argparse.ArgumentParser):
    """argparse with the house rules for every script: a bad option is one `error:` line (exit 2)
    instead of the whole usage text, and options are spelled out: `--epoch` is refused, not read
    as `--epochs` (a prefix that means something today can mean something else tomorrow)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", argparse.ArgumentDefaultsHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")
