"""common.py's one scheme for what is written beside its final name, and its JSON readers."""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tinyllm import common
from tinyllm.common import (
    PLAIN_FILE_MODE,
    PLAIN_FOLDER_MODE,
    UserError,
    atomic_folder,
    atomic_open,
    atomic_path,
    atomic_write_text,
    os_error_text,
    read_json,
    read_json_or,
    remove_temporaries,
    temporary_name,
    temporary_target,
)


def listing(folder: Path) -> list[str]:
    return sorted(path.name for path in folder.iterdir())


def mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


# ----------------------------------------------------------------------------------------------
# Names


@pytest.mark.parametrize(
    "name, target",
    [
        (".out.1a2b3c4d.tmp", "out"),
        (".model.0123abcd.old", "model"),
        (".step-00000010.pt.deadbeef.tmp", "step-00000010.pt"),
        (".a.b.json.00000000.tmp", "a.b.json"),
        (".corpus.12345678.tmp", "corpus"),
        ("out", None),
        (".out", None),
        (".out.tmp", None),
        ("out.1a2b3c4d.tmp", None),  # not hidden
        (".out.1a2b3c4.tmp", None),  # 7 hex digits
        (".out.1A2B3C4D.tmp", None),  # upper case is not what temporary_name writes
        (".out.1a2b3c4d.bak", None),
        (".out.1a2b3c4d.tmp.gz", None),
        (".out.k9x2abcd.tmp", None),  # mkstemp-style random part
        ("..1a2b3c4d.tmp", None),  # no final name
        (".out.building-1234", None),  # the old schemes are not swept
        (".model.partial-998", None),
        (".model.old-999", None),
    ],
)
def test_temporary_target(name, target):
    assert temporary_target(name) == target


@pytest.mark.parametrize("name", ["out", "model.safetensors", "step-00000010.pt", "a.b", ".hidden"])
@pytest.mark.parametrize("kind", ["tmp", "old"])
def test_temporary_name_round_trips_and_is_unique(name, kind):
    made = temporary_name(name, kind)
    assert made.startswith(f".{name}.") and made.endswith(f".{kind}") and temporary_target(made) == name
    assert len({temporary_name(name, kind) for _ in range(50)}) == 50


# ----------------------------------------------------------------------------------------------
# remove_temporaries


def populate(folder: Path, entries: dict[str, str]) -> None:
    """{name: "file" | "folder" | "link"} made in `folder` (a folder holds one file, a link points outside)."""
    for name, kind in entries.items():
        path = folder / name
        if kind == "file":
            path.write_text(name)
        elif kind == "folder":
            path.mkdir()
            (path / "inside.txt").write_text(name)
        else:
            path.symlink_to(folder.parent / "outside")


@pytest.mark.parametrize(
    "entries, target, removed, left",
    [
        # files and folders of every target; others' hidden files and the old schemes stay
        (
            {
                "a": "file",
                ".a.00000001.tmp": "file",
                ".b.00000002.tmp": "folder",
                "b": "folder",
                ".keep": "file",
                ".a.building-1": "folder",
            },
            None,
            [".a.00000001.tmp", ".b.00000002.tmp"],
            [".a.building-1", ".keep", "a", "b"],
        ),
        # only the target's
        (
            {"a": "file", ".a.00000001.tmp": "file", ".b.00000002.tmp": "folder"},
            "a",
            [".a.00000001.tmp"],
            [".b.00000002.tmp", "a"],
        ),
        # a target name that is a prefix of another's is not confused with it
        (
            {".a.00000001.tmp": "file", ".ab.00000002.tmp": "file", ".b.a.00000003.tmp": "file"},
            "a",
            [".a.00000001.tmp"],
            [".ab.00000002.tmp", ".b.a.00000003.tmp"],
        ),
        # a swap killed between its renames: the old folder is put back when the final name is missing ...
        (
            {".model.0000000a.old": "folder", ".model.0000000b.tmp": "folder"},
            "model",
            [".model.0000000b.tmp"],
            ["model"],
        ),
        # ... and deleted when the new one is in place
        ({"model": "folder", ".model.0000000a.old": "folder"}, "model", [".model.0000000a.old"], ["model"]),
        # a link is removed, never what it points to
        ({".x.0000000c.tmp": "link"}, None, [".x.0000000c.tmp"], []),
    ],
)
def test_remove_temporaries(tmp_path, entries, target, removed, left):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("not ours")
    folder = tmp_path / "folder"
    folder.mkdir()
    populate(folder, entries)
    assert remove_temporaries(folder, target) == removed
    assert listing(folder) == left
    assert (outside / "keep.txt").read_text() == "not ours"


def test_remove_temporaries_puts_back_the_old_folder_whole(tmp_path):
    old = tmp_path / temporary_name("model", "old")
    old.mkdir()
    (old / "weights.bin").write_bytes(b"the last good export")
    assert remove_temporaries(tmp_path) == []
    assert listing(tmp_path) == ["model"]
    assert (tmp_path / "model" / "weights.bin").read_bytes() == b"the last good export"


def test_remove_temporaries_of_a_missing_folder(tmp_path):
    assert remove_temporaries(tmp_path / "nope") == []


# ----------------------------------------------------------------------------------------------
# atomic_folder


def write_tree(folder: Path, text: str) -> None:
    (folder / "sub").mkdir()
    (folder / "a.txt").write_text(text)
    (folder / "sub" / "b.txt").write_text(text)


def read_tree(folder: Path) -> dict[str, str]:
    return {path.relative_to(folder).as_posix(): path.read_text() for path in folder.rglob("*") if path.is_file()}


@pytest.mark.parametrize("existing", [None, "empty", "old"])
def test_atomic_folder_swaps_in_and_leaves_no_sibling(tmp_path, existing):
    out = tmp_path / "out"
    if existing:
        out.mkdir()
    if existing == "old":
        (out / "stale.txt").write_text("from the old folder")
    with atomic_folder(out) as temp:
        assert temp.parent == tmp_path and temporary_target(temp.name) == "out" and temp.is_dir()
        write_tree(temp, "new")
    assert read_tree(out) == {"a.txt": "new", "sub/b.txt": "new"}
    assert listing(tmp_path) == ["out"]


@pytest.mark.parametrize("error", [RuntimeError("disk full"), KeyboardInterrupt()])
def test_atomic_folder_failure_keeps_the_old_folder_and_no_temporary(tmp_path, error):
    out = tmp_path / "out"
    out.mkdir()
    write_tree(out, "old")
    with pytest.raises(type(error)):
        with atomic_folder(out) as temp:
            write_tree(temp, "new")
            raise error
    assert read_tree(out) == {"a.txt": "old", "sub/b.txt": "old"}
    assert listing(tmp_path) == ["out"]


def test_atomic_folder_failed_swap_puts_the_old_folder_back(tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    write_tree(out, "old")
    real_replace = os.replace

    def replace(source, target):
        if Path(source).name.endswith(".tmp"):
            raise OSError(28, "No space left on device")
        real_replace(source, target)

    monkeypatch.setattr(common.os, "replace", replace)
    with pytest.raises(OSError):
        with atomic_folder(out) as temp:
            write_tree(temp, "new")
    assert read_tree(out) == {"a.txt": "old", "sub/b.txt": "old"}
    assert listing(tmp_path) == ["out"]


def test_atomic_folder_sweeps_what_a_killed_build_left(tmp_path):
    stale = tmp_path / temporary_name("out")
    stale.mkdir()
    (stale / "half.bin").write_bytes(b"half written")
    other = tmp_path / temporary_name("other")
    other.mkdir()
    with atomic_folder(tmp_path / "out") as temp:
        assert not stale.exists()
        write_tree(temp, "new")
    assert listing(tmp_path) == [other.name, "out"]


def test_atomic_folder_makes_everything_plainly_readable(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("private")
    outside.chmod(0o600)
    with atomic_folder(tmp_path / "out") as temp:
        write_tree(temp, "new")
        (temp / "a.txt").chmod(0o600)  # as safetensors and mkstemp write them
        (temp / "sub").chmod(0o700)
        (temp / "link").symlink_to(outside)
    out = tmp_path / "out"
    assert {mode(path) for path in [out / "a.txt", out / "sub" / "b.txt"]} == {PLAIN_FILE_MODE}
    assert mode(out) == mode(out / "sub") == PLAIN_FOLDER_MODE
    assert mode(outside) == 0o600  # not reached through the link


# ----------------------------------------------------------------------------------------------
# atomic_open and atomic_path


def write_with_open_binary(path: Path, data: str) -> None:
    with atomic_open(path, "wb") as handle:
        handle.write(data.encode())
        if data == "boom":
            raise RuntimeError("boom")


def write_with_open_text(path: Path, data: str) -> None:
    with atomic_open(path, "w") as handle:
        handle.write(data)
        if data == "boom":
            raise RuntimeError("boom")


def write_with_path(path: Path, data: str) -> None:
    with atomic_path(path) as temp:
        assert temp.parent == path.parent and temporary_target(temp.name) == path.name
        temp.write_text(data)
        if data == "boom":
            raise RuntimeError("boom")


WRITERS = [write_with_open_binary, write_with_open_text, write_with_path]


@pytest.mark.parametrize("write", WRITERS)
def test_atomic_file_writes_replace_the_target_with_plain_permissions(tmp_path, write):
    target = tmp_path / "sub" / "record.json"
    write(target, "first")
    write(target, "second")
    assert target.read_text() == "second" and mode(target) == PLAIN_FILE_MODE
    assert listing(target.parent) == ["record.json"]


@pytest.mark.parametrize("write", WRITERS)
def test_atomic_file_write_failure_leaves_the_target_and_no_temporary(tmp_path, write):
    target = tmp_path / "record.json"
    write(target, "good")
    with pytest.raises(RuntimeError, match="boom"):
        write(target, "boom")
    assert target.read_text() == "good" and listing(tmp_path) == ["record.json"]


def test_a_failed_atomic_write_names_the_target_not_its_temporary(tmp_path, monkeypatch):
    """A read-only folder, a full disk: the error names the file the caller asked for (os_error_text's line)."""
    import errno

    def refuse(path, *args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    monkeypatch.setattr(os, "open", refuse)
    monkeypatch.setattr(os, "unlink", refuse)  # a read-only disk refuses even to unlink a missing file
    with pytest.raises(OSError) as caught:
        atomic_write_text(tmp_path / "loss_curve.png", "x")
    assert os_error_text(caught.value) == f"{tmp_path / 'loss_curve.png'}: read-only file system"
    with pytest.raises(OSError) as caught:  # an error about another file keeps its name
        with atomic_path(tmp_path / "x.bin"):
            raise OSError(errno.ENOSPC, "No space left on device", "/elsewhere/file")
    assert caught.value.filename == "/elsewhere/file"


def test_atomic_path_when_the_writer_wrote_nothing(tmp_path):
    with pytest.raises(RuntimeError):
        with atomic_path(tmp_path / "x.bin"):
            raise RuntimeError("failed before writing")
    assert listing(tmp_path) == []


# ----------------------------------------------------------------------------------------------
# JSON readers


@pytest.mark.parametrize(
    "content, default, expected",
    [
        (None, {}, {}),  # missing
        (b'{"step": 4}', {}, {"step": 4}),
        (b'{"step": 4', {}, {}),  # cut short by a kill
        (b"", {}, {}),
        (b"\xff\xfe{}", {}, {}),  # not UTF-8
        (b"[1, 2]", {}, {}),  # not the default's type
        (b"[1, 2]", [], [1, 2]),
        (b"[1, 2]", None, [1, 2]),  # no default: any JSON
        (b"null", {}, {}),
        (b"3", None, 3),
        ("folder", {"x": 1}, {"x": 1}),  # a folder where the file should be
        (b"[" * 100_000, {}, {}),  # nested too deeply
    ],
)
def test_read_json_or(tmp_path, content, default, expected):
    path = tmp_path / "record.json"
    if content == "folder":
        path.mkdir()
    elif content is not None:
        path.write_bytes(content)
    assert read_json_or(path, default) == expected


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "settings not found: {path}"),
        (b'{"a": ', "settings {path} is not valid JSON (line 1: Expecting value)"),
        (b"\xff{}", "settings {path} is not valid JSON (not UTF-8 at byte 0)"),
    ],
)
def test_read_json_names_the_file(tmp_path, content, message):
    path = tmp_path / "settings.json"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(UserError) as caught:
        read_json(path, "settings")
    assert str(caught.value) == message.format(path=path)


def test_check_writable_folder_leaves_nothing_and_names_the_folder(tmp_path):
    common.check_writable_folder(tmp_path / "new", "the run folder")
    assert listing(tmp_path / "new") == []
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if os.access(locked, os.W_OK):
            pytest.skip("running as root: permissions do not stop writes")
        with pytest.raises(UserError, match=f"the run folder {locked} cannot be written: permission denied"):
            common.check_writable_folder(locked, "the run folder")
    finally:
        locked.chmod(0o700)


# stderr a terminal?, the environment -> what run_main adds to it
@pytest.mark.parametrize(
    "terminal, environ, added",
    [
        (True, {}, {}),  # a terminal: the bars draw in place
        (False, {}, common.LIBRARY_PROGRESS_OFF),  # a notebook or a log: off
        (False, {"TQDM_DISABLE": "0"}, {"HF_DATASETS_DISABLE_PROGRESS_BARS": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}),
    ],
)
def test_library_progress_bars_are_off_when_stderr_is_not_a_terminal(terminal, environ, added):
    assert common.progress_bars_env(terminal, environ) == added


def test_run_main_turns_the_bars_off_in_a_log(monkeypatch):
    for name in common.LIBRARY_PROGRESS_OFF:
        monkeypatch.setenv(name, "unset below")
        monkeypatch.delenv(name)
    seen = {}
    common.run_main(lambda: seen.update(os.environ), script=False)  # stderr is pytest's capture, not a terminal
    assert {name: seen.get(name) for name in common.LIBRARY_PROGRESS_OFF} == common.LIBRARY_PROGRESS_OFF
    # a tqdm imported after run_main began (lm-eval's, under report.py evaluate) draws nothing into a log
    code = "from tinyllm import common; common.run_main(lambda: print(__import__('tqdm').tqdm(total=3).disable))"
    environ = {name: value for name, value in os.environ.items() if name not in common.LIBRARY_PROGRESS_OFF}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=Path(common.__file__).parents[1], capture_output=True, text=True, env=environ
    )
    assert result.stdout.strip() == "True", result.stderr


# SystemExit's code -> the exit status
@pytest.mark.parametrize("code, status", [(None, 0), (0, 0), (2, 2), (143, 143), ("a message", 1)])
def test_exit_code_is_what_system_exit_would_exit_with(code, status):
    assert common.exit_code(code) == status


@pytest.mark.parametrize("environ, rank", [({}, False), ({"WORLD_SIZE": "1"}, False), ({"WORLD_SIZE": "2"}, True)])
def test_a_rank_of_a_group_of_two_or_more_is_launched_as_one(environ, rank):
    assert common.launched_as_rank(environ) is rank


# A script's main that returns or raises `outcome`, with an exit hook that says it ran (the teardown)
RANK_MAIN = """
import atexit, sys
from tinyllm import common
atexit.register(lambda: print("teardown", flush=True))
def main():
    print("work done", flush=True)
    if sys.argv[1] == "error":
        raise common.UserError("the corpus is empty")
    return int(sys.argv[1])
common.run_main(main)
"""


@pytest.mark.parametrize(
    "world, outcome, status, stderr",
    [
        ("2", "0", 0, ""),  # a torchrun rank: its status, no teardown
        ("2", "3", 3, ""),
        ("2", "error", 2, "error: the corpus is empty"),
        ("1", "3", 3, ""),  # one process: the usual exit, with its teardown
    ],
)
def test_a_torchrun_rank_leaves_without_the_teardown_once_its_exit_code_is_decided(world, outcome, status, stderr):
    """pytorch #190489: gloo's threads abort an interpreter's teardown; a rank whose outcome is written skips it."""
    result = subprocess.run(
        [sys.executable, "-c", RANK_MAIN, outcome],
        cwd=Path(common.__file__).parents[1],
        capture_output=True,
        text=True,
        env={**os.environ, "WORLD_SIZE": world},
    )
    assert result.returncode == status, result.stderr
    assert result.stdout.split() == (["work", "done"] if world == "2" else ["work", "done", "teardown"])
    assert result.stderr.strip() == stderr


def test_python_common_py_lists_every_command_and_the_layers(capsys):
    """`python common.py`: each root script with its console script and its module's file, then the layers."""
    root = Path(common.__file__).parents[1]
    text = common.layout_text()
    for script, module in common.SCRIPT_MODULES.items():
        path = module.replace(".", "/") + ".py"
        line = next(line for line in text.splitlines() if line.split()[:2] == ["python", f"{script}.py"])
        assert line.split()[-1] == path and (root / path).is_file() and (root / f"{script}.py").is_file()
        assert line.split()[2] == common.CONSOLE_SCRIPTS.get(script, "-")
    assert all(f"{layer}/" in text for layer in ("data", "model", "store", "outputs", "training"))
    assert common.main([]) == 0 and capsys.readouterr().out == text + "\n"


@pytest.mark.parametrize(
    "text, value, says",
    [
        ("3", 3, None),
        ("0", None, "must be positive, got 0"),
        ("-5", None, "must be positive, got -5"),
    ],
)
def test_checked_type_applies_the_option_checks_at_parse_time(text, value, says):
    count = common.checked_type(int, common.positive)
    if says is None:
        assert count(text) == value
    else:
        with pytest.raises(argparse.ArgumentTypeError, match=f"^{says}$"):
            count(text)


def test_a_checked_type_names_its_conversion_in_argparse_errors(capsys):
    parser = common.ArgumentParser(prog="tool")
    parser.add_argument("--steps", type=common.checked_type(int, common.positive))
    for given, says in (("x", "invalid int value: 'x'"), ("0", "must be positive, got 0")):
        with pytest.raises(SystemExit) as exited:
            parser.parse_args(["--steps", given])
        assert exited.value.code == 2
        assert capsys.readouterr().err == f"error: argument --steps: {says} (see tool --help)\n"


@pytest.mark.parametrize(
    "given, hint",
    [
        ("--max-steps", "; a run's length is --target-tokens or --epochs (or --budget); --stop-after-steps N stops it"),
        ("--max_steps", "; a run's length is --target-tokens or --epochs (or --budget); --stop-after-steps N stops it"),
        ("--output-dir", "; did you mean --out?"),
        ("--epohcs", "; did you mean --epochs?"),  # a typo: the closest spelling
        ("--eval-batches", "; held-out scores are over --eval-tokens N tokens' blocks (tinyllm before 2026-12-06"),
    ],
)
def test_another_trainers_option_name_points_at_this_ones(capsys, given, hint):
    """`--max-steps` (HF Trainer's) is closest in spelling to `--warmup-steps`, the wrong option: the names
    newcomers bring from other trainers get the option they need instead."""
    parser = common.ArgumentParser(prog="tool")
    for flag in ("--warmup-steps", "--stop-after-steps", "--target-tokens", "--epochs", "--out", "--eval-tokens"):
        parser.add_argument(flag)
    with pytest.raises(SystemExit) as exited:
        parser.parse_args([given, "5"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: unrecognized arguments: {given} 5{hint}") and err.count("\n") == 1, err
    assert "--warmup-steps" not in err
    bare = common.ArgumentParser(prog="tool")  # a parser without the option it names: no such hint
    bare.add_argument("--seed")
    with pytest.raises(SystemExit):
        bare.parse_args(["--max-steps", "5"])
    assert capsys.readouterr().err == "error: unrecognized arguments: --max-steps 5 (see tool --help)\n"


@pytest.mark.parametrize(
    "help, default, shown",
    [
        ("PNG to write (default: RUN/loss_curve.png)", None, "PNG to write (default: RUN/loss_curve.png)"),
        ("tokens per step", 8, "tokens per step (default: 8)"),
    ],
)
def test_help_says_an_options_default_once(help, default, shown):
    parser = common.ArgumentParser(prog="tool")
    parser.add_argument("--value", default=default, help=help)
    assert " ".join(parser.format_help().split()).endswith(f"--value VALUE {shown}")


@dataclasses.dataclass
class Lengths:
    epochs: int | None = common.option(None, "passes over the data", "length", exclusive="length")
    steps: int | None = common.option(None, "optimizer steps", "length", exclusive="length")
    lr: float = common.option(0.001, "learning rate", "length")


@pytest.mark.parametrize(
    "text, argv, tokens",
    [
        ("epochs = 2\nlr = 0.5\n", [], ["--epochs", "2", "--lr", "0.5"]),
        ("epochs = 2\n", ["--steps", "9"], []),  # the command line's option replaces the file's exclusive one
        ("epochs = 2\n", ["--epochs", "3"], []),
        ("epochs = 2\nsteps = 9\n", [], "'epochs' and 'steps' exclude each other; keep one"),
        ("steps = 9\nlr = 0.5\nepochs = 2\n", ["--lr", "1"], "'steps' and 'epochs' exclude each other; keep one"),
    ],
)
def test_a_config_files_exclusive_options(tmp_path, text, argv, tokens):
    parser = common.ArgumentParser(prog="tool")
    common.add_options(parser, ["length"], Lengths)
    config = tmp_path / "run.toml"
    config.write_text(text)
    argv = ["--config", str(config), *argv]
    if isinstance(tokens, list):
        assert common.config_argv(parser, argv) == tokens
    else:
        with pytest.raises(UserError, match=f"^--config {config}: {tokens}$"):
            common.config_argv(parser, argv)


# ----------------------------------------------------------------------------------------------
# A recorded command line: option_value, with_option_values, without_options


@pytest.mark.parametrize(
    "tokens, value",
    [
        (["--lr", "1", "--backup-to", "s3://b/run", "--out", "o"], "s3://b/run"),
        (["--lr", "1", "--backup-to=s3://b/run"], "s3://b/run"),
        (["--lr", "1", "--out", "o"], None),  # absent
        (["--lr", "1", "--backup-to"], None),  # last, without its value
        (["--backup-to=s3://b/run?k=a=b"], "s3://b/run?k=a=b"),  # an = inside the value is the value's
        (["--backup-to", "s3://b/run?k=a=b"], "s3://b/run?k=a=b"),
        (["--backup-to=", "--lr", "1"], ""),  # given, empty
        (["--backup-to", "a", "--backup-to=b"], "a"),  # the first
        (["--backup-to-x", "s3://b/run", "--backup-to-x=c"], None),  # a longer option is another one
    ],
)
def test_option_value_reads_both_spellings(tokens, value):
    assert common.option_value(tokens, "--backup-to") == value


@pytest.mark.parametrize(
    "tokens, changed",
    [
        (["--out", "o", "--backup-to", "S3://B"], ["--out", "NEW", "--backup-to", "s3://b"]),
        (["--out=o", "--backup-to=S3://B"], ["--out=NEW", "--backup-to=s3://b"]),
        (["--backup-to=S3://B?K=A=B"], ["--backup-to=s3://b?k=a=b"]),  # the whole value, = and all
        (["--lr", "1"], ["--lr", "1"]),  # absent: nothing added
        (["--lr", "1", "--out"], ["--lr", "1", "--out"]),  # last, without its value: left as it is
        (["--out", "a", "--out=b"], ["--out", "NEW", "--out=NEW"]),  # every occurrence
        (["--out", "--backup-to", "X"], ["--out", "NEW", "X"]),  # the token after a bare option is its value
        (["--backup-to", "--OUT", "o"], ["--backup-to", "--out", "o"]),  # a changed value is not read again
        (["--output", "o", "--out-dir=o"], ["--output", "o", "--out-dir=o"]),  # longer options are others
    ],
)
def test_with_option_values_changes_each_value_in_its_spelling(tokens, changed):
    change = {"--out": lambda _: "NEW", "--backup-to": str.lower}
    assert common.with_option_values(tokens, change) == changed
    assert common.with_option_values(tuple(tokens), change) == changed  # any sequence; a new list


@pytest.mark.parametrize(
    "tokens, kept",
    [
        (["--data", "c d", "--stop-after-steps", "5", "--lr", "1"], ["--data", "c d", "--lr", "1"]),
        (["--stop-after-steps=5", "--lr", "1"], ["--lr", "1"]),
        (["--resume", "x.pt", "--lr", "1"], ["--lr", "1"]),
        (["--resume", "--lr", "1"], ["--lr", "1"]),  # its value left out: the next option stays
        (["--lr", "1", "--resume"], ["--lr", "1"]),  # last, without its value
        (["--resume=a=b.pt", "--lr", "1"], ["--lr", "1"]),  # an = inside the value
        (["--resume", "x.pt", "--stop-after-steps=5", "--resume=none"], []),  # every occurrence
        (["--lr", "1"], ["--lr", "1"]),  # absent
        (["--resumes", "x", "--resume-from=y"], ["--resumes", "x", "--resume-from=y"]),  # others
    ],
)
def test_without_options_drops_each_with_its_value(tokens, kept):
    assert common.without_options(tokens, ("--resume", "--stop-after-steps")) == kept


@pytest.mark.parametrize(
    "argv, path",
    [
        (["--lr", "1", "--config", "c.toml"], "c.toml"),
        (["--config=c.yaml", "--lr", "1"], "c.yaml"),
        (["--lr", "1"], None),
        (["--config=a.toml", "--config"], "a.toml"),  # the first one names the file
    ],
)
def test_config_file_in(argv, path):
    assert common.config_file_in(argv) == path


def test_config_file_in_refuses_a_config_without_its_file():
    with pytest.raises(UserError, match=r"^--config needs a FILE \(TOML or YAML\)$"):
        common.config_file_in(["--lr", "1", "--config"])
