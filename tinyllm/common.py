"""Helpers shared by tinyllm's scripts: seeding, atomic writes, hashing, timestamps.

Every file a script promises to another (manifests, checkpoints, status files) is
written through `atomic_write_*`: a temporary name beside the target, fsync, rename,
and an fsync of the folder, so a crash leaves either the old file or the new one.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as _dt
import hashlib
import inspect
import json
import math
import os
import random
import re
import secrets
import shutil
import signal
import sys
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

import tinyllm

HASH_CHUNK_BYTES = 8 * 1024 * 1024


# While a progress bar is shown, what the scripts say goes through it (report.Progress registers its
# writer here), so a message never breaks the bar.
PROGRESS_WRITERS: list[Callable[[str, bool], None]] = []


def say(message: str, *, warning: bool = False, main: bool | None = None) -> None:
    """The one way tinyllm's scripts tell the user something. Rank-aware: under torchrun only rank 0
    speaks (`main`: whether this process speaks; default: RANK is 0 or unset). A warning goes to stderr
    as `warning: ...`, the rest to stdout; through the progress bar while one is shown."""
    if not (os.environ.get("RANK", "0") == "0" if main is None else main):
        return
    text = f"warning: {message}" if warning else message
    if PROGRESS_WRITERS:
        PROGRESS_WRITERS[-1](text, warning)
    else:
        print(text, file=sys.stderr if warning else sys.stdout, flush=True)


class UserError(Exception):
    """A mistake the user can fix (bad input, bad setting): printed as one `error:` line (plus
    indented detail lines where a tool's own diagnostics help), exit 2. `said`: the line is already
    out (say_error), printed where a signal could otherwise cut it off; run_main only exits."""

    def __init__(self, *args, said: bool = False):
        super().__init__(*args)
        self.said = said


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
    say_error(message)
    raise SystemExit(code)


def say_error(message: str) -> UserError:
    """Print the `error: ...` line now; the UserError to raise, which run_main will not print again."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    return UserError(message, said=True)


def os_error_cause(error: OSError) -> str:
    """'no space left on device', 'read-only file system': what an OSError means, without the path."""
    return os.strerror(error.errno).lower() if error.errno else (str(error) or type(error).__name__)


def os_error_text(error: OSError, path: str | os.PathLike | None = None) -> str:
    """'PATH: no space left on device': the file (`path`, else the error's) and the cause, in one line."""
    where = path if path is not None else error.filename
    return f"{where}: {os_error_cause(error)}" if where else os_error_cause(error)


def run_main(main: Callable[[], Any], script: bool | None = None) -> None:
    """Run a script's main(), turning UserError into a one-line message and exit code 2.

    An OSError that reaches here (a full disk, a read-only or vanished folder: the machine, not the
    code) is one line too, naming the file and the cause; the scripts catch the ones they can
    explain better (which checkpoint is the last good one, ...) before it gets here.

    A Ctrl-C is `error: interrupted` (exit 130) also when a library re-raised the KeyboardInterrupt
    as an exception of its own. Run as a script's entry point (`main` defined in __main__, or
    `script=True` from a console script), a Ctrl-C after main() has ended is ignored: the outcome is
    decided and recorded, and
    a traceback from the interpreter's teardown (or a death by the signal) would only hide it. For the same
    reason a torchrun rank (of two or more) run as a script leaves with its decided exit code without the
    teardown at all (leave_without_teardown).
    """
    if script is None:  # a console script (pyproject.toml) says so itself
        script = getattr(main, "__module__", None) == "__main__"
    os.environ.update(progress_bars_env(hasattr(sys.stderr, "isatty") and sys.stderr.isatty(), os.environ))
    try:
        run_reporting_errors(main, script)
    except SystemExit as decided:
        if script and launched_as_rank(os.environ):
            leave_without_teardown(decided.code)
        raise


def run_reporting_errors(main: Callable[[], Any], script: bool) -> None:
    """run_main's work: main(), its errors as one line each and an exit code, raised as SystemExit."""
    try:
        result = main()
    except UserError as error:
        if error.said:
            raise SystemExit(2) from None
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


def launched_as_rank(environ: Mapping[str, str]) -> bool:
    """A rank of a torchrun group of two or more (torchrun sets WORLD_SIZE)."""
    return int(environ.get("WORLD_SIZE", "1")) > 1


def exit_code(code: int | str | None) -> int:
    """The status SystemExit(code) exits with: None is 0, a message (printed to stderr) 1."""
    if code is None:
        return 0
    return code if isinstance(code, int) else 1


def leave_without_teardown(code: int | str | None = 0) -> None:
    """Exit as SystemExit(code) would, now, skipping the interpreter's teardown: for a torchrun rank whose
    outcome is decided and written (run_main does it). On torch 2.10 and 2.11 a gloo worker thread frees a finished
    collective's tensors after wait() has returned and takes the GIL to do so; if the interpreter is shutting
    down by then, the thread aborts the process ("terminate called without an active exception", pytorch
    #190489). destroy_process_group does not join those threads. Measured on torch 2.11: a world-size-2 child
    aborted in 5 of 20 runs, 3 of 50 with a barrier before the teardown, 0 of 40 leaving this way
    (docs/development.md)."""
    if isinstance(code, str):
        print(code, file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code(code))


# What turns the libraries' progress bars off (lm-eval's and datasets' tqdm bars, the Hub's downloads)
LIBRARY_PROGRESS_OFF = {
    "TQDM_DISABLE": "1",
    "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
}


def progress_bars_env(is_terminal: bool, environ: dict[str, str]) -> dict[str, str]:
    """The variables run_main sets when stderr is not a terminal (a notebook, a log file): there a tqdm bar
    is one carriage-return line that grows with every update. A value the user set stays; tinyllm's own
    progress (report.Progress, data.py's bar) already prints plain lines there."""
    if is_terminal:
        return {}
    return {name: value for name, value in LIBRARY_PROGRESS_OFF.items() if name not in environ}


# pyproject.toml's [project.scripts]: the command each script is on PATH as after `pip install -e .`
CONSOLE_SCRIPTS = {
    "train": "tinyllm-train",
    "data": "tinyllm-data",
    "report": "tinyllm-report",
    "checkpoint_cloud": "tinyllm-cloud",
    "export_gguf": "tinyllm-gguf",
}
# The scripts at a clone's root (`python train.py`), each calling its module's `command`, as the console
# scripts do; tests/test_package.py checks both against pyproject.toml and the scripts.
SCRIPT_MODULES = {
    "train": "tinyllm.training.train",
    "data": "tinyllm.data.build",
    "report": "tinyllm.outputs.report",
    "export_gguf": "tinyllm.outputs.export_gguf",
    "checkpoint_cloud": "tinyllm.store.checkpoint_cloud",
    "model_config": "tinyllm.model.config",
    "common": "tinyllm.common",
}


def console_script(script: str, argv0: str) -> str | None:
    """`tinyllm-train` when this process was started as script `script`'s ("train") console script
    (`argv0`, sys.argv[0], is then that command's path), else None."""
    name = CONSOLE_SCRIPTS.get(script)
    return name if name is not None and Path(argv0).name == name else None


def script_command(script: str) -> str:
    """How a printed command starts `script` ("data"): `tinyllm-data` when this process was started through a
    console script (the user has them on PATH), else `python data.py`."""
    argv0 = Path(sys.argv[0]).name if sys.argv else ""
    started_so = argv0 in CONSOLE_SCRIPTS.values()
    return CONSOLE_SCRIPTS[script] if started_so else f"python {script}.py"


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


def check_writable_folder(folder: str | os.PathLike, what: str) -> None:
    """Create `folder` if needed and write (then remove) a small file there, before any work: a
    read-only mount or a full disk is then one error naming the folder, not a traceback at the end."""
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / temporary_name("write-test")
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PLAIN_FILE_MODE)
        try:
            os.write(fd, b"x")
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as error:
        raise UserError(f"{what} {folder} cannot be written: {os_error_cause(error)}") from None


# One scheme for everything written beside its final name, here and on a backup remote:
# `.NAME.<8 hex>.tmp` while it is written (a file or a folder), `.NAME.<8 hex>.old` for the folder an
# atomic swap moved away. A killed process leaves only such names, so `remove_temporaries` knows them all.
TEMPORARY = re.compile(r"\.(?P<target>.+)\.[0-9a-f]{8}\.(?P<kind>tmp|old)")


def temporary_name(name: str, kind: str = "tmp") -> str:
    """`.NAME.<random>.tmp`: hidden, unique, and recognised by remove_temporaries."""
    return f".{name}.{secrets.token_hex(4)}.{kind}"


def temporary_target(name: str) -> str | None:
    """The final name a temporary name was made for (None: not a temporary)."""
    match = TEMPORARY.fullmatch(name)
    return match.group("target") if match else None


def remove_temporaries(folder: str | os.PathLike, target: str | None = None) -> list[str]:
    """Delete what killed writes left in `folder` (of `target` only, when given); returns the names.

    A `.NAME.*.old` folder is put back as NAME when NAME is missing (a swap killed between its two
    renames), else deleted."""
    folder = Path(folder)
    removed = []
    for path in sorted(folder.iterdir()) if folder.is_dir() else []:
        match = TEMPORARY.fullmatch(path.name)
        if match is None or (target is not None and match.group("target") != target):
            continue
        final = folder / match.group("target")
        if match.group("kind") == "old" and not final.exists():
            os.replace(path, final)
            continue
        shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink(missing_ok=True)
        removed.append(path.name)
    return removed


@contextlib.contextmanager
def file_descriptor_to(fd: int, target) -> Iterator[None]:
    """Point file descriptor `fd` (1: stdout, 2: stderr) at the open file `target` while the block runs, so
    that what C code and child processes started meanwhile write there goes to it; Python's own buffered
    stdout and stderr are flushed on the way in and out, so their lines land where they were written."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(fd)
    try:
        os.dup2(target.fileno(), fd)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved, fd)
        os.close(saved)


def fsync_file(path: str | os.PathLike) -> None:
    """Flush a written file's bytes to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


def _process_umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


PLAIN_FILE_MODE = 0o666 & ~_process_umask()  # what open() gives a new file; read once, at import (no race)
PLAIN_FOLDER_MODE = 0o777 & ~_process_umask()


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """A fresh temporary path beside `path` for a writer that wants a name (torch.save, a GGUF writer);
    on success it is fsynced and renamed over `path`; on any exception removed, `path` untouched."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    temp = target.parent / temporary_name(target.name)
    try:
        yield temp
        fsync_file(temp)
        os.replace(temp, target)
        fsync_dir(target.parent)
    except OSError as error:
        if error.filename is not None and Path(error.filename) == temp:
            error.filename = str(target)  # name the file the user asked for, not its hidden temporary
        raise
    finally:
        if os.path.lexists(temp):  # (unlinking a missing file on a read-only disk is EROFS, not ENOENT)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp)


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "wb") -> Iterator[Any]:
    """Open a temporary file beside `path`; on success fsync and rename it over `path`.

    On any exception the temporary file is removed and `path` is untouched.
    """
    with atomic_path(path) as temp:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PLAIN_FILE_MODE)
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as handle:
            yield handle


@contextlib.contextmanager
def atomic_folder(path: str | os.PathLike) -> Iterator[Path]:
    """Build a folder beside `path` and swap it in whole when the block ends without an exception.

    Stale siblings of earlier killed builds are swept first; on failure the temporary folder is
    removed and `path` is as it was. Every file is fsynced and made plainly readable before the swap.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_temporaries(target.parent, target.name)
    temp = target.parent / temporary_name(target.name)
    temp.mkdir()
    old = target.parent / temporary_name(target.name, "old")
    try:
        yield temp
        for item in sorted(temp.rglob("*"), reverse=True):  # files before the folders that hold them
            if item.is_symlink():
                continue  # chmod and fsync would reach through it, to a file outside the folder
            item.chmod(PLAIN_FOLDER_MODE if item.is_dir() else PLAIN_FILE_MODE)
            (fsync_dir if item.is_dir() else fsync_file)(item)
        temp.chmod(PLAIN_FOLDER_MODE)
        fsync_dir(temp)
        if target.exists():
            os.replace(target, old)
        os.replace(temp, target)
    except BaseException:
        if old.exists() and not target.exists():
            os.replace(old, target)  # the swap failed halfway: the old folder goes back
        shutil.rmtree(temp, ignore_errors=True)
        raise
    fsync_dir(target.parent)
    shutil.rmtree(old, ignore_errors=True)


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
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        raise UserError(f"{what} not found: {path}") from None
    return parse_json(raw, f"{what} {path}")


def parse_json(raw: bytes, where: str) -> Any:
    """The JSON in `raw` (UTF-8), raising UserError that names `where` ("corpus manifest PATH") when broken."""
    try:
        return json.loads(raw.decode("utf-8"))
    except json.JSONDecodeError as error:
        raise UserError(f"{where} is not valid JSON (line {error.lineno}: {error.msg})") from None
    except UnicodeDecodeError as error:
        raise UserError(f"{where} is not valid JSON (not UTF-8 at byte {error.start})") from None


def json_safe(value: Any) -> Any:
    """`value` as JSON holds it: anything JSON has no type for (a Path, a tuple's kind) as its str or list."""
    return json.loads(json.dumps(value, default=str))


def read_json_or(path: str | os.PathLike, default: Any = None) -> Any:
    """The JSON in `path`, or `default` when it is missing, unreadable, broken or not of `default`'s type
    (a dict default: only a dict). For records that are a hint, not a promise: a broken one is no reason
    to stop."""
    try:
        with open(path, encoding="utf-8") as handle:
            value = json.load(handle)
    except (OSError, ValueError, RecursionError):  # ValueError: broken JSON or not UTF-8
        return default
    return value if default is None or isinstance(value, type(default)) else default


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


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's "(default: X)" after an option's help, unless the help says its default itself
    ("PNG to write (default: RUN/loss_curve.png)": a default worked out later, the option's own is None)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if "default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class ArgumentParser(argparse.ArgumentParser):
    """argparse with the house rules for every script: a bad option is one `error:` line (exit 2)
    instead of the whole usage text, and options are spelled out: `--epoch` is refused, not read
    as `--epochs` (a prefix that means something today can mean something else tomorrow)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)
        self.exclusive_groups: dict[str, list[argparse.Action]] = {}  # add_options' `exclusive` names -> options

    def error(self, message: str):
        self.exit(2, f"error: {message}{self.suggestion(message)} (see {self.prog} --help)\n")

    def suggestion(self, message: str) -> str:
        """ "; did you mean --epochs?" for an unrecognized option close to one of this parser's."""
        if not message.startswith("unrecognized arguments: "):
            return ""
        flags = [flag for flag in self._option_string_actions if flag.startswith("--")]
        tokens = message.removeprefix("unrecognized arguments: ").split()
        hints = (self.other_name(token.split("=", 1)[0], flags) for token in tokens if token.startswith("--"))
        return next((hint for hint in hints if hint), "")

    @staticmethod
    def other_name(word: str, flags: list[str]) -> str:
        """The hint for one unrecognized option: another tool's name for one of this parser's (OTHER_NAMES),
        else the closest spelling."""
        known = OTHER_NAMES.get(word.replace("_", "-"))
        if known and known[0] in flags:
            return f"; {known[1]}"
        return did_you_mean(word, flags)


# Options a newcomer brings from other trainers (HF Trainer, nanoGPT), whose closest spelling here is the
# wrong option (`--max-steps` is closest to `--warmup-steps`), and tinyllm's own former names: the option it
# needs, then the hint.
LENGTH_HINT = "a run's length is --target-tokens or --epochs (or --budget); --stop-after-steps N stops it resumably"
OTHER_NAMES = {
    "--max-steps": ("--stop-after-steps", LENGTH_HINT),
    "--max-iters": ("--stop-after-steps", LENGTH_HINT),
    "--num-train-epochs": ("--epochs", "did you mean --epochs?"),
    "--output-dir": ("--out", "did you mean --out?"),
    "--learning-rate": ("--lr", "did you mean --lr (AdamW's) or --muon-lr (Muon's)?"),
    "--eval-batches": (
        "--eval-tokens",
        "held-out scores are over --eval-tokens N tokens' blocks (tinyllm before 2026-12-06: --eval-batches)",
    ),
}


def did_you_mean(word: str, candidates: list[str]) -> str:
    """ "; did you mean CANDIDATE?" for the candidate closest to `word` (difflib's), "" when none is close."""
    import difflib

    close = difflib.get_close_matches(word, candidates, n=1)
    return f"; did you mean {close[0]}?" if close else ""


# ----------------------------------------------------------------------------------------------
# A recorded command line (its argv tokens: a run's resume_command, a --config lookup): an option's
# value read, changed or dropped, in both spellings, `--out DIR` and `--out=DIR`.


def option_value(tokens: Sequence[str], option: str) -> str | None:
    """The value of the first `option` ("--out") in `tokens`; None when it has none (absent, or last)."""
    for index, token in enumerate(tokens):
        if token.startswith(option + "="):
            return token[len(option) + 1 :]
        if token == option and index + 1 < len(tokens):
            return tokens[index + 1]
    return None


def with_option_values(tokens: Sequence[str], change: Mapping[str, Callable[[str], str]]) -> list[str]:
    """`tokens` with the value of every occurrence of each option in `change` replaced by change[option](value);
    a value is never read as an option itself, and a bare option last (no value) stays as it is."""
    changed, index = list(tokens), 0
    while index < len(changed):
        flag, equals, value = changed[index].partition("=")
        if flag in change and equals:
            changed[index] = f"{flag}={change[flag](value)}"
        elif flag in change and index + 1 < len(changed):
            index += 1
            changed[index] = change[flag](changed[index])
        index += 1
    return changed


def without_options(tokens: Sequence[str], options: Collection[str]) -> list[str]:
    """`tokens` without any of `options`, in either spelling. A bare one takes the token after it along unless
    that is an option itself (starts with "-"): the value may be left out, as `--resume` alone leaves it."""
    spelled_with_value = tuple(option + "=" for option in options)
    kept, value_next = [], False
    for token in tokens:
        if value_next:
            value_next = False
            if not token.startswith("-"):
                continue
        if token in options:
            value_next = True
        elif not token.startswith(spelled_with_value):
            kept.append(token)
    return kept


# ----------------------------------------------------------------------------------------------
# Options declared once: a settings dataclass field carries its default, help, group and checks
# (`option`); `add_options` builds the argparse options from the fields, `check_options` applies
# the checks, and `read_config` turns a --config file into the same options.


def option(
    default: Any,
    help: str,
    group: str,
    *,
    checks: tuple = (),
    choices: Any = None,
    type: Callable | None = None,
    flag: str | None = None,
    metavar: str | None = None,
    exclusive: str | None = None,
    nargs: str | None = None,
) -> Any:
    """A settings field that is a command-line option (`--field-name`, or `flag`) in help `group`.

    `checks`: functions value -> problem text (None: fine), applied in order by check_options.
    `type`: what argparse converts the text with (default: the field's annotated type; a bool is a
    switch). `exclusive`: options with the same name are mutually exclusive. `nargs`: argparse's ("+":
    one or more values, a list; "?": the flag alone gives the default)."""
    return dataclasses.field(
        default=default,
        metadata={
            "help": help,
            "group": group,
            "checks": checks,
            "choices": choices,
            "type": type,
            "flag": flag,
            "metavar": metavar,
            "exclusive": exclusive,
            "nargs": nargs,
        },
    )


def option_fields(*kinds) -> list[dataclasses.Field]:
    """The fields of these settings dataclasses that are options, in declaration order."""
    return [field for kind in kinds for field in dataclasses.fields(kind) if "help" in field.metadata]


def option_flag(field: dataclasses.Field) -> str:
    return field.metadata["flag"] or "--" + field.name.replace("_", "-")


def option_flags(*kinds) -> dict[str, str]:
    """Each option of these settings dataclasses: its name -> its flag (e.g. adam8bit -> --8bit-adam)."""
    return {field.name: option_flag(field) for field in option_fields(*kinds)}


def _value_type(field: dataclasses.Field) -> Callable:
    """int, float or str from a field's annotation ("int | None" -> int)."""
    annotation = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", "str")
    names = [part.strip() for part in annotation.split("|") if part.strip() != "None"]
    return {"int": int, "float": float, "bool": bool}.get(names[0] if names else "str", str)


def add_options(parser: ArgumentParser, groups: Iterable[str], *kinds) -> None:
    """One argparse option per option field of `kinds`, under its group (`groups` gives their order); the
    options of one `exclusive` name are also recorded in `parser.exclusive_groups`."""
    sections = {title: parser.add_argument_group(title) for title in groups}
    order = list(sections)
    exclusive: dict[str, Any] = {}
    for field in sorted(option_fields(*kinds), key=lambda field: order.index(field.metadata["group"])):
        meta = field.metadata
        target = sections[meta["group"]]
        if meta["exclusive"]:
            if meta["exclusive"] not in exclusive:
                exclusive[meta["exclusive"]] = target.add_mutually_exclusive_group()
            target = exclusive[meta["exclusive"]]
        kwargs: dict[str, Any] = {"dest": field.name, "default": field.default, "help": meta["help"]}
        value_type = meta["type"] or _value_type(field)
        if value_type is bool:
            # a switch on by default, or decided later when None, can be turned off: --no-NAME
            kwargs["action"] = argparse.BooleanOptionalAction if field.default is not False else "store_true"
        else:
            kwargs.update(type=value_type, choices=meta["choices"], metavar=meta["metavar"])
            if meta.get("nargs"):
                kwargs["nargs"] = meta["nargs"]
                if meta["nargs"] == "?":
                    kwargs["const"] = field.default
        action = target.add_argument(option_flag(field), **kwargs)
        if meta["exclusive"]:
            parser.exclusive_groups.setdefault(meta["exclusive"], []).append(action)


def check_options(settings: Any) -> None:
    """Each option field's checks on its value: the first broken one is a UserError naming the option."""
    for field in option_fields(type(settings)):
        value = getattr(settings, field.name)
        if value is None:
            continue
        for check in field.metadata["checks"]:
            problem = check(value)
            if problem:
                raise UserError(f"{option_flag(field)} must {problem}, got {value}")


def positive(value) -> str | None:
    return None if value > 0 else "be positive"


def not_negative(value) -> str | None:
    return None if value >= 0 else "not be negative"


def finite(value) -> str | None:
    return None if math.isfinite(value) else "be a finite number"


def below_one(value) -> str | None:
    return None if 0 <= value < 1 else "be in [0, 1)"


def fraction(value) -> str | None:
    return None if 0 <= value <= 1 else "be in [0, 1]"


def at_least(lowest: int) -> Callable:
    def check(value) -> str | None:
        return None if value >= lowest else f"be at least {lowest}"

    return check


def checked_type(convert: Callable, *checks: Callable) -> Callable:
    """An argparse `type` for an option that is no settings field: `convert` the text, then apply `checks`
    (positive, ...) as check_options does: `error: argument --N: must be positive, got 0` at parse time."""

    def parse(text: str):
        value = convert(text)
        problem = next(filter(None, (check(value) for check in checks)), None)
        if problem:
            raise argparse.ArgumentTypeError(f"must {problem}, got {value}")
        return value

    parse.__name__ = convert.__name__  # argparse's "invalid int value: 'x'" names the conversion
    return parse


def config_file_in(argv: list[str]) -> str | None:
    """The FILE of `--config FILE` (or `--config=FILE`) in a command line, None without one."""
    path = option_value(argv, "--config")
    if path is None and argv[-1:] == ["--config"]:
        raise UserError("--config needs a FILE (TOML or YAML)")
    return path


def read_config(path: str) -> dict:
    """A --config file's options: a TOML (.toml) or YAML (.yaml, .yml) mapping of option names to values."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as error:
        raise UserError(f"--config {os_error_text(error, path)}") from None
    try:
        if Path(path).suffix in (".yaml", ".yml"):
            import yaml

            values = yaml.safe_load(text) or {}
        else:
            import tomllib

            values = tomllib.loads(text)
    except Exception as error:  # tomllib.TOMLDecodeError, yaml.YAMLError
        raise UserError(
            f"--config {path}: not valid {'YAML' if Path(path).suffix != '.toml' else 'TOML'}: "
            f"{str(error).splitlines()[0]}"
        ) from None
    if not isinstance(values, dict):
        raise UserError(f"--config {path}: expected a mapping of option names to values")
    return values


def config_argv(parser: ArgumentParser, argv: list[str]) -> list[str]:
    """The options of the --config file named in `argv` as command-line tokens, to go before `argv` (so
    the command line wins). A key is an option's long name (dashes or underscores); an unknown key is one
    UserError naming it and the closest option; a key whose option (or a mutually exclusive one) the
    command line gives is left out."""
    path = config_file_in(argv)
    if path is None:
        return []
    by_name = {
        flag[2:].replace("-", "_"): action
        for action in parser._actions
        for flag in action.option_strings
        if flag.startswith("--")
    }
    given = {
        by_name[token[2:].split("=", 1)[0].replace("-", "_")]
        for token in argv
        if token.startswith("--") and token[2:].split("=", 1)[0].replace("-", "_") in by_name
    }
    given |= {other for group in parser.exclusive_groups.values() if given & set(group) for other in group}
    tokens: list[str] = []
    taken: dict[argparse.Action, str] = {}  # the file's options, each by its key: two of one exclusive group clash
    for key, value in read_config(path).items():
        action = by_name.get(str(key).replace("-", "_"))
        if action is None or action.dest in ("config", "help"):
            hint = did_you_mean(str(key).replace("_", "-"), [name.replace("_", "-") for name in by_name])
            raise UserError(f"--config {path}: unknown option {key!r}{hint}")
        check_exclusive(parser, action, taken, path, key)
        taken[action] = str(key)
        if action not in given:
            tokens += config_tokens(action, value, path, key)
    return tokens


def check_exclusive(
    parser: ArgumentParser, action: argparse.Action, taken: dict[argparse.Action, str], path: str, key: str
) -> None:
    """One UserError naming the file when `action` (its `key`) and an option the file already gave are exclusive."""
    for group in parser.exclusive_groups.values():
        if action in group:
            for other in group:
                if other is not action and other in taken:
                    raise UserError(f"--config {path}: {taken[other]!r} and {key!r} exclude each other; keep one")


def given_options(parser: ArgumentParser, argv: list[str] | tuple[str, ...]) -> set[str]:
    """The option names (argparse dests) `argv` gives, on its command line or in its --config file."""
    tokens = config_argv(parser, list(argv)) + list(argv)
    flags = {flag: action.dest for action in parser._actions for flag in action.option_strings}
    return {flags[token.split("=", 1)[0]] for token in tokens if token.split("=", 1)[0] in flags}


def config_tokens(action: argparse.Action, value: Any, path: str, key: str) -> list[str]:
    """One config value as the command-line tokens of its option."""
    flag = next(flag for flag in action.option_strings if flag.startswith("--") and not flag.startswith("--no-"))
    if value is None:
        return []
    if isinstance(action, argparse.BooleanOptionalAction) or action.nargs == 0:
        if not isinstance(value, bool):
            raise UserError(f"--config {path}: {key} is a switch: true or false, got {value!r}")
        if isinstance(action, argparse.BooleanOptionalAction):
            return [flag if value else "--no-" + flag[2:]]
        return [flag] if value else []
    if isinstance(value, list) and action.nargs in ("+", "*") and value:
        for item in value:
            check_config_value(action, item, path, key)
        return [flag, *map(str, value)]
    if isinstance(value, (dict, list)):
        raise UserError(f"--config {path}: {key} takes one value, got {value!r}")
    check_config_value(action, value, path, key)
    return [flag, str(value).lower() if isinstance(value, bool) else str(value)]


TYPE_NAMES = {int: "an int", float: "a number", str: "a text"}


def config_value_problem(action: argparse.Action, text: str) -> str | None:
    """Why argparse would refuse `text` as `action`'s value ('is not an int', 'is not one of a, b'), else None."""
    convert = action.type or str
    try:
        value = convert(text)
    except argparse.ArgumentTypeError as error:
        return str(error)
    except (TypeError, ValueError):
        return f"is not {TYPE_NAMES.get(convert, 'a valid value')}"
    if action.choices is not None and value not in action.choices:
        return "is not one of " + ", ".join(map(str, action.choices))
    return None


def check_config_value(action: argparse.Action, value: Any, path: str, key: str) -> None:
    """A config value argparse would refuse is one UserError naming the file, the key and the value (the
    command line's own error would name only the option)."""
    problem = config_value_problem(action, str(value).lower() if isinstance(value, bool) else str(value))
    if problem is not None:
        raise UserError(
            f"--config {path}: {key} = {value!r} {problem}"
            if problem.startswith("is ")
            else f"--config {path}: {key} = {value!r}: {problem}"
        )


def jsonl_records(path: str | os.PathLike) -> Iterator[tuple[int, Any]]:
    """(line number, parsed JSON) of each non-blank line of a JSONL file; a line that is not JSON is one
    UserError naming the file and the line."""
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                yield number, json.loads(line)
            except json.JSONDecodeError as error:
                raise UserError(f"{path}:{number}: not valid JSON ({error.msg})") from None


# ----------------------------------------------------------------------------------------------
# `python common.py`: the commands and the layers.


def layout_text() -> str:
    """The commands (a clone's script, its console script, its code) and the layers (tinyllm/__init__.py)."""
    rows = [
        (f"python {script}.py", CONSOLE_SCRIPTS.get(script, "-"), module.replace(".", "/") + ".py")
        for script, module in SCRIPT_MODULES.items()
    ]
    widths = [max(len(row[column]) for row in rows) for column in range(2)]
    lines = [f"  {script:<{widths[0]}}  {console:<{widths[1]}}  {code}" for script, console, code in rows]
    return "\n".join(
        [
            "The commands (`--help` on each), their console scripts, their code:",
            *lines,
            "",
            inspect.cleandoc(tinyllm.__doc__),
        ]
    )


def main(argv: list[str] | None = None) -> int:
    ArgumentParser(description="tinyllm's commands and where the code of each layer lives.").parse_args(argv)
    print(layout_text())
    return 0


def command() -> None:
    """`python common.py` at a clone's root."""
    run_main(main, script=True)
