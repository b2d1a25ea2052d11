"""train.py's settings: every option in exactly one frozen group, and each bad value one clear error."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from tinyllm.common import UserError
from tinyllm.model import config as model_config
from tinyllm.training import train

GROUPS = (train.RunSettings, train.SessionSettings, train.Invocation)
DERIVED = {"demo", "argv"}  # Invocation's fields that no option sets (parse_args derives them)


def option_names() -> list[str]:
    return [action.dest for action in train.build_parser()._actions if action.dest != "help"]


def test_every_option_lands_in_exactly_one_group():
    names = option_names()
    for name in names:
        owners = [group.__name__ for group in GROUPS if name in {field.name for field in dataclasses.fields(group)}]
        assert len(owners) == 1, f"--{name.replace('_', '-')} is a field of {owners or 'no group'}"
    fields = [field.name for group in GROUPS for field in dataclasses.fields(group)]
    assert sorted(set(fields) - set(names)) == sorted(DERIVED)
    assert DERIVED <= {field.name for field in dataclasses.fields(train.Invocation)}


def test_help_opens_with_the_corpus_and_the_run_folder():
    """--help reads like a command: what to train on and where first, the mixture's phases later."""
    names = option_names()
    assert names[:2] == ["data", "out"]
    assert names.index("mixture_schedule") > names.index("packing")


def test_settings_are_built_once_and_never_change(tmp_path):
    settings = train.parse_args(["--data", str(tmp_path), "--out", str(tmp_path / "run"), "--lr", "1e-3"])
    assert settings.run.lr == 1e-3 and settings.session.out == str(tmp_path / "run")
    assert settings.invocation.argv == ("--data", str(tmp_path), "--out", str(tmp_path / "run"), "--lr", "1e-3")
    for group in (settings, settings.run, settings.session, settings.invocation):
        with pytest.raises(dataclasses.FrozenInstanceError):
            group.seed = 1


@pytest.mark.parametrize(
    "given, message",
    [
        (["--batch-size", "0"], "--batch-size must be positive, got 0"),
        (["--grad-accum", "-1"], "--grad-accum must be positive, got -1"),
        (["--eval-tokens", "0"], "--eval-tokens must be positive, got 0"),
        (["--log-every", "0"], "--log-every must be positive, got 0"),
        (["--max-overflow-steps", "0"], "--max-overflow-steps must be positive, got 0"),
        (["--warmup-steps", "-1"], "--warmup-steps must not be negative, got -1"),
        (["--save-every", "-1"], "--save-every must not be negative, got -1"),
        (["--save-seconds", "-5"], "--save-seconds must not be negative, got -5.0"),
        (["--keep-every", "-1"], "--keep-every must not be negative, got -1"),
        (["--eval-every", "-1"], "--eval-every must not be negative, got -1"),
        (["--max-hours", "-1"], "--max-hours must not be negative, got -1.0"),
        (["--stop-after-steps", "-1"], "--stop-after-steps must not be negative, got -1"),
        (["--threads", "-1"], "--threads must not be negative, got -1"),
        (["--require-gpus", "-1"], "--require-gpus must not be negative, got -1"),
        (["--peak-tflops", "-1"], "--peak-tflops must not be negative, got -1.0"),
        (["--weight-decay", "-0.1"], "--weight-decay must not be negative, got -0.1"),
        (["--grad-clip", "-1"], "--grad-clip must not be negative, got -1.0"),
        (["--backup-wait-seconds", "-1"], "--backup-wait-seconds must not be negative, got -1.0"),
        (["--keep-last", "0"], "--keep-last must be at least 1, got 0"),
        (["--lr", "nan"], "--lr must be a finite number, got nan"),
        (["--max-hours", "inf"], "--max-hours must be a finite number, got inf"),
        (["--final-lr-fraction", "inf"], "--final-lr-fraction must be a finite number, got inf"),
        (["--lr", "0"], "--lr must be positive, got 0.0"),
        (["--muon-lr", "-0.01"], "--muon-lr must be positive, got -0.01"),
        (["--beta1", "1"], "--beta1 must be in [0, 1), got 1.0"),
        (["--beta2", "-0.1"], "--beta2 must be in [0, 1), got -0.1"),
        (["--muon-momentum", "1.5"], "--muon-momentum must be in [0, 1), got 1.5"),
        (["--decay-fraction", "1.5"], "--decay-fraction must be in [0, 1], got 1.5"),
        (["--final-lr-fraction", "-0.5"], "--final-lr-fraction must be in [0, 1], got -0.5"),
        (["--optimizer", "adamw", "--muon-lr", "0.01"], "--muon-lr needs --optimizer muon"),
        (["--schedule", "cosine", "--decay-fraction", "0.2"], "--decay-fraction belongs to --schedule wsd"),
        (["--8bit-adam"], "--8bit-adam needs --optimizer adamw"),
        (["--target-tokens", "0"], "--target-tokens must be positive, got 0"),
        (["--epochs", "0"], "--epochs must be a positive finite number, got 0.0"),
        (["--epochs", "inf"], "--epochs must be a positive finite number, got inf"),
        (["--context", "1"], "--context must be at least 2, got 1"),
        (["--hidden", "0"], "hidden (--hidden) must be positive, got 0"),
        (["--kv-heads", "3"], "heads (4) must be a multiple of kv_heads (3)"),
        (["--text-loss", "full"], "--text-loss needs --loss-on assistant"),
        (["--init-from", "x", "--resume", "runs/a/step-00000004.pt"], "--init-from starts a new run and --resume PATH"),
        (["--resume", "Auto"], "--resume Auto: not a choice and no such file"),
    ],
)
def test_each_bad_value_is_one_error_naming_its_option(tmp_path, given, message):
    with pytest.raises(UserError, match=f"^{re.escape(message)}") as error:
        train.parse_args(["--data", str(tmp_path), "--out", str(tmp_path / "run"), *given])
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    "given",
    [
        ["--warmup-steps", "0"],
        ["--save-every", "0"],
        ["--keep-last", "1"],
        ["--grad-clip", "0"],
        ["--beta1", "0"],
        ["--decay-fraction", "1"],
        ["--final-lr-fraction", "0"],
        ["--weight-decay", "0"],
        ["--context", "2"],
        ["--optimizer", "adamw", "--8bit-adam"],
        ["--loss-on", "assistant", "--text-loss", "none"],
        ["--init-from", "x", "--resume", "none"],
    ],
)
def test_the_edges_are_accepted(tmp_path, given):
    train.parse_args(["--data", str(tmp_path), "--out", str(tmp_path / "run"), *given])


@pytest.mark.parametrize(
    "given, resume",
    [
        ([], "auto"),
        (["--resume"], "auto"),  # the restart command users are told about: the newest checkpoint of --out
        (["--resume", "none"], "none"),
        (["--resume=x.pt"], "x.pt"),
    ],
)
def test_resume_alone_means_auto(tmp_path, given, resume):
    for argv in (["--data", str(tmp_path), "--out", "run", *given], [*given, "--data", str(tmp_path), "--out", "run"]):
        settings = train.parse_args(argv)
        session = settings.session
        assert (settings.invocation.resume, session.out, session.data) == (resume, "run", str(tmp_path))


def test_data_needs_out():
    with pytest.raises(UserError, match=r"^--data needs --out RUN"):
        train.parse_args(["--data", "corpus/x"])


def write(path, text: str):
    path.write_text(text)
    return str(path)


def test_a_config_file_gives_options_and_the_command_line_wins(tmp_path):
    config = write(
        tmp_path / "run.toml",
        'preset = "nano"\nlr = 0.002\nbatch-size = 4\ncompile = true\nreport = false\ntarget_tokens = 3e5\n',
    )
    settings = train.parse_args(["--config", config, "--data", str(tmp_path), "--out", "o", "--lr", "0.005"])
    assert (settings.run.preset, settings.run.lr, settings.session.batch_size) == ("nano", 0.005, 4)
    assert settings.session.compile and not settings.session.report and settings.run.target_tokens == 300_000
    # --epochs on the command line replaces the file's --target-tokens (the two exclude each other)
    settings = train.parse_args(["--config", config, "--data", str(tmp_path), "--out", "o", "--epochs", "2"])
    assert settings.run.epochs == 2 and settings.run.target_tokens is None


def test_a_yaml_config_reads_the_same(tmp_path):
    config = write(tmp_path / "run.yaml", "preset: nano\nlr: 0.002\n8bit-adam: false\n")
    settings = train.parse_args(["--config", config, "--data", str(tmp_path), "--out", "o"])
    assert (settings.run.preset, settings.run.lr, settings.run.adam8bit) == ("nano", 0.002, False)


@pytest.mark.parametrize(
    "text, message",
    [
        ("lerning_rate = 1\n", "unknown option 'lerning_rate'"),
        ("bach-size = 4\n", "unknown option 'bach-size'; did you mean batch-size?"),
        ("compile = 1\n", "compile is a switch: true or false, got 1"),
        ("preset = [1, 2]\n", "preset takes one value"),
        ("preset = \n", "not valid TOML"),
        ("config = 'other.toml'\n", "unknown option 'config'"),
        ("batch_size = 0\n", "--batch-size must be positive, got 0"),
        ("batch_size = 'eight'\n", "batch_size = 'eight' is not an int"),  # not argparse's words without the file
        ("lr = 'fast'\n", "lr = 'fast' is not a number"),
        ("target_tokens = 'lots'\n", "target_tokens = 'lots': not a number: 'lots'"),
        ("precision = 'fp8'\n", "precision = 'fp8' is not one of "),
        ("epochs = 1\ntarget-tokens = 5\n", "'epochs' and 'target-tokens' exclude each other; keep one"),
    ],
)
def test_each_bad_config_is_one_error_naming_the_file_and_key(tmp_path, text, message):
    config = write(tmp_path / "bad.toml", text)
    with pytest.raises(UserError, match=re.escape(message)) as error:
        train.parse_args(["--config", config, "--data", str(tmp_path), "--out", "o"])
    assert "\n" not in str(error.value)
    if "must be positive" not in message:
        assert str(error.value).startswith(f"--config {config}: ")


def test_a_missing_config_file_is_one_error(tmp_path):
    with pytest.raises(UserError, match=r"^--config .*missing\.toml: no such file"):
        train.parse_args(["--config", str(tmp_path / "missing.toml"), "--data", str(tmp_path), "--out", "o"])


def test_the_written_config_reads_back_as_the_same_settings(tmp_path):
    given = [
        "--data",
        str(tmp_path),
        "--out",
        "o",
        "--preset",
        "nano",
        "--epochs",
        "1.5",
        "--no-report",
        "--8bit-adam",
        "--optimizer",
        "adamw",
        "--backup-to",
        str(tmp_path / "store"),
        "--resume",
        "none",
        "--eval-tasks",
        "arc_easy",
        "mine.jsonl,piqa",
    ]
    settings = train.parse_args(given)
    assert settings.session.eval_tasks == ("arc_easy", "mine.jsonl,piqa")  # as report.py evaluate --tasks
    config = write(tmp_path / "config.toml", train.config_text(settings))
    again = train.parse_args(["--config", config])
    assert again.run == settings.run
    assert dataclasses.replace(again.session, backup_to=settings.session.backup_to) == settings.session
    assert again.session.backup_to is None and again.invocation.resume == "auto"  # neither is in the file


CONFIGS = sorted((Path(__file__).parent.parent / "docs" / "configs").glob("*.toml"))


@pytest.mark.parametrize("config", CONFIGS, ids=[path.stem for path in CONFIGS])
def test_every_example_config_in_docs_parses_with_its_preset(tmp_path, config):
    settings = train.parse_args(["--config", str(config), "--data", str(tmp_path), "--out", str(tmp_path / "run")])
    assert config.stem.startswith(settings.run.preset + "-")
    assert len(CONFIGS) == len(model_config.PRESETS)  # one per preset
