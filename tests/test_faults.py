"""Issue 14: every fault ends in one clear `error:` line (exit 2) or a correct warning, nothing lost.

The faults come from tests/faults.py: a real small tmpfs or read-only mount where the machine
allows `mount`, simulated at the OS boundary (open/os.open failing) where it does not.
"""

from __future__ import annotations

import errno
import json
import random
import re
from pathlib import Path

import numpy as np
import pytest
from faults import fail_os_writes, mount_point, read_only_folder, small_disk
from project import ROOT
from tiny_runs import options, write_tiny_corpus

from tinyllm import common
from tinyllm.data import build as data
from tinyllm.data import corpus_format
from tinyllm.model import generation, hardware
from tinyllm.outputs import report
from tinyllm.store import checkpoint_store as store
from tinyllm.training import distributed, train


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_tiny_corpus(tmp_path_factory.mktemp("corpus"), documents=200)


@pytest.fixture
def text_folder(tmp_path) -> Path:
    folder = tmp_path / "texts"
    folder.mkdir()
    for index in range(6):
        (folder / f"book{index}.txt").write_text(" ".join(f"word{(index * 7 + i) % 97} and more" for i in range(4000)))
    return folder


def run_main_exit(capsys, function) -> tuple[int, str]:
    """(exit code, stderr) of run_main(function); the stderr must be exactly one `error:` line."""
    with pytest.raises(SystemExit) as exit_info:
        common.run_main(function)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return exit_info.value.code, lines[0]


def status(out: Path) -> dict:
    return json.loads((out / "run_status.json").read_text())


# ----------------------------------------------------------------------------------------------
# 2. A full disk.


@pytest.fixture(scope="module")
def checkpoint_bytes(corpus, tmp_path_factory) -> int:
    """The size of one checkpoint of options()'s tiny run (it depends on the optimizer's state)."""
    out = tmp_path_factory.mktemp("sized")
    assert train.main(options(corpus, out, "--eval-every", "0", "--stop-after-steps", "4")) == 0
    return (out / "checkpoints" / "step-00000004.pt").stat().st_size


def test_train_py_on_a_full_disk_stops_at_the_failed_save_and_names_the_last_good_checkpoint(
    corpus, tmp_path, capsys, checkpoint_bytes
):
    """A real tmpfs with room for one checkpoint: the second save fails inside torch.save (which
    reports it as `enforce fail at inline_container.cc`); the run stops at once with the cause."""
    with small_disk(tmp_path / "disk", free_bytes=int(checkpoint_bytes * 1.6)) as disk:
        out = disk / "run"
        code, line = run_main_exit(capsys, lambda: train.main(options(corpus, out, "--eval-every", "0")))
        assert code == 2
        assert "step-00000008.pt: no space left on device" in line, line
        assert "the last good checkpoint, step-00000004.pt, is intact" in line and "inline_container" not in line
        recorded = status(out)
        assert recorded["status"] == store.FAILED and "no space left on device" in recorded["reason"]
        assert recorded["last_checkpoint"] == "step-00000004.pt"
        assert recorded["step"] < 12  # noticed before the next save (the old code trained on to step 12)
        assert sorted(p.name for p in (out / "checkpoints").glob("*.pt")) == ["step-00000004.pt"]
        assert not list((out / "checkpoints").glob(".*.tmp"))  # no half-written file left
        assert json.loads((out / "checkpoints" / "latest.json").read_text())["step"] == 4


def test_a_checkpoint_that_cannot_be_created_fails_the_run_at_once(corpus, tmp_path, monkeypatch, capsys):
    """The same fault simulated at the OS boundary (no mount needed): every file opened for writing in
    RUN/checkpoints fails with ENOSPC."""
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    fail_os_writes(monkeypatch, out / "checkpoints")
    code, line = run_main_exit(capsys, lambda: train.main(options(corpus, out, "--eval-every", "0")))
    assert code == 2 and "no space left on device" in line and str(out / "checkpoints") in line
    assert "no checkpoint had been written yet" in line
    monkeypatch.undo()
    assert status(out)["status"] == store.FAILED and status(out)["step"] < 8


def test_data_py_on_a_full_disk_is_one_line_and_leaves_nothing(text_folder, tmp_path, capsys):
    with small_disk(tmp_path / "disk", free_bytes=48 * 1024) as disk:
        out = disk / "corpus"
        code, line = run_main_exit(
            capsys,
            lambda: data.main(
                ["--data", str(text_folder), "--out", str(out), "--vocab-size", "300", "--tokenize-workers", "1"]
            ),
        )
        assert code == 2 and "no space left on device" in line and f"building {out} failed" in line, line
        assert sorted(p.name for p in disk.iterdir()) == [".filler"]  # no corpus, no temporary build folder


# ----------------------------------------------------------------------------------------------
# 3. A read-only or unusable --out.


def test_read_only_out_is_refused_before_the_work(corpus, text_folder, tmp_path, capsys, monkeypatch):
    with read_only_folder(tmp_path / "ro") as folder:
        built = []
        monkeypatch.setattr(data, "build_in_place", lambda *args: built.append(args))
        code, line = run_main_exit(
            capsys, lambda: data.main(["--data", str(text_folder), "--out", str(folder / "corpus")])
        )
        assert code == 2 and str(folder) in line and "cannot be written" in line and not built, line
        code, line = run_main_exit(capsys, lambda: train.main(options(corpus, folder / "run")))
        assert code == 2 and f"--out {folder / 'run'} cannot be written" in line, line


def test_train_py_out_on_a_simulated_read_only_folder_is_one_line(corpus, tmp_path, monkeypatch, capsys):
    fail_os_writes(monkeypatch, tmp_path / "ro", code=errno.EROFS)
    code, line = run_main_exit(capsys, lambda: train.main(options(corpus, tmp_path / "ro" / "run")))
    assert code == 2 and "read-only file system" in line and str(tmp_path / "ro" / "run") in line, line


def test_an_empty_mount_point_as_data_py_out_is_refused_before_the_work(text_folder, tmp_path, capsys, monkeypatch):
    with mount_point(tmp_path / "drive") as drive:
        built = []
        monkeypatch.setattr(data, "build_in_place", lambda *args: built.append(args))
        code, line = run_main_exit(capsys, lambda: data.main(["--data", str(text_folder), "--out", str(drive)]))
        assert code == 2 and "is a mount point" in line and str(drive / "corpus") in line and not built, line


def test_run_main_turns_any_os_error_into_one_line(capsys):
    def full():
        raise OSError(errno.ENOSPC, "No space left on device", "/data/x.bin")

    code, line = run_main_exit(capsys, full)
    assert code == 2 and line == "error: /data/x.bin: no space left on device"


# ----------------------------------------------------------------------------------------------
# 7. --export-only and the run lock.


def test_export_only_is_refused_while_a_training_run_holds_the_folder(corpus, tmp_path, capsys):
    out = tmp_path / "run"
    assert train.main(options(corpus, out, steps=4)) == 0
    lock = store.lock_run_folder(out)  # as a training run holds it
    try:
        code, line = run_main_exit(capsys, lambda: train.main([*options(corpus, out), "--export-only"]))
    finally:
        lock.close()
    assert code == 2 and f"run folder {out} is in use by another train.py" in line
    assert not (out / "model").exists()
    assert train.main([*options(corpus, out), "--export-only"]) == 0  # once the run is gone
    assert (out / "model" / "model.safetensors").is_file()


# ----------------------------------------------------------------------------------------------
# 11. MFU.


def test_mfu_is_never_above_100_percent_and_the_peak_is_recorded(corpus, tmp_path, monkeypatch):
    """A CPU peak measured under load (here: the first measurement far too low) gives MFU > 100%:
    it is measured again, the new peak recorded in hardware.json, and no impossible MFU is logged."""
    real = hardware.measure_cpu_matmul_flops
    calls = []

    def first_one_slowed(precision, *args, **kwargs):
        calls.append(precision)
        return 1e6 if len(calls) == 1 else real(precision, *args, **kwargs)

    monkeypatch.setattr(hardware, "measure_cpu_matmul_flops", first_one_slowed)
    out = tmp_path / "run"
    assert train.main(options(corpus, out, "--peak-tflops", "0", steps=4)) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    mfus = [r["mfu"] for r in records if r["kind"] == "train"]
    assert len(calls) >= 2 and all(mfu is None or 0 < mfu <= 1 for mfu in mfus) and any(mfus)
    recorded = json.loads((out / "hardware.json").read_text())
    assert recorded["peak_flops"] > 1e6 and "measured again" in recorded["peak_flops_source"]

    # a --peak-tflops far below what the run achieves: no MFU rather than an impossible one
    out = tmp_path / "wrong-peak"
    assert train.main(options(corpus, out, "--peak-tflops", "1e-9", steps=2)) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["mfu"] for r in records if r["kind"] == "train"] == [None, None]
    recorded = json.loads((out / "hardware.json").read_text())
    assert recorded["peak_flops"] == pytest.approx(1e3) and recorded["peak_flops_source"] == "--peak-tflops"


# ----------------------------------------------------------------------------------------------
# 12. Samples and the final line fit the corpus.


def test_a_text_corpus_gets_continuations_of_held_out_openings_and_a_final_loss(corpus, tmp_path, capsys):
    text_corpus = write_tiny_corpus(tmp_path / "texts")  # plain text with held-out splits
    out = tmp_path / "run"
    assert train.main([*options(text_corpus, out, steps=4), "--report"]) == 0
    samples = json.loads((out / "sample_generations.json").read_text())
    assert samples["settings"]["chat_template"] is False and samples["samples"] and samples["error"] is None
    tokenizer = corpus_format.load_tokenizer(text_corpus / "tokenizer")
    manifest = json.loads((text_corpus / "corpus_manifest.json").read_text())
    first_test = np.fromfile(text_corpus / manifest["splits"]["test"]["files"][0]["name"], dtype="<u2").tolist()
    first_document = first_test[: first_test.index(2)]  # up to its <eos>
    assert samples["samples"][0]["prompt"] == tokenizer.decode(first_document[:24])  # a held-out opening
    assert not any("plus 7" in sample["prompt"] or "apples" in sample["prompt"] for sample in samples["samples"])
    assert "| test loss " in capsys.readouterr().out
    modes = {path.name: path.stat().st_mode & 0o777 for path in (out / "model").iterdir()}
    assert set(modes.values()) == {common.PLAIN_FILE_MODE}, modes  # model.safetensors too, not 0600
    from tinyllm.outputs import report  # report.py samples continues plain text too

    assert report.main(["samples", str(out / "model"), "--text", "--prompt", "99 plus", "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out.startswith("> 99 plus")
    assert report.main(["samples", str(out / "model"), "--max-new-tokens", "4"]) == 0  # no --prompt: the run's
    shown = capsys.readouterr().out
    assert shown.startswith("prompts: the text openings of the run's")
    assert f"> {samples['samples'][0]['prompt']}" in shown

    # no held-out split at all: the last line still shows a loss, the train loss
    texts = [{"text": f"{i} plus {i + 1} is {2 * i + 1}. the cat sees the dog."} for i in range(300)]
    no_held_out = data.build_corpus(
        [data.Source("generated", "generated", records=texts)],
        tmp_path / "bare",
        data.BuildSettings(vocab_size=300, val_fraction=0, test_fraction=0),
    )
    out = tmp_path / "no-held-out"
    assert train.main(options(no_held_out, out, steps=2)) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("COMPLETE: step 2/2") and "| train loss " in last and "(no held-out split)" in last


def test_a_chat_corpus_gets_its_held_out_questions_as_sample_prompts(tmp_path):
    chats = tmp_path / "chats.jsonl"
    chats.write_text(
        "".join(
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": f"Which river flows through town number {i}?"},
                        {"role": "assistant", "content": f"The river of town {i} is the Blue River."},
                    ]
                }
            )
            + "\n"
            for i in range(60)
        )
    )
    built = tmp_path / "corpus"
    assert (
        data.main(
            [
                "--data",
                str(chats),
                "--out",
                str(built),
                "--vocab-size",
                "300",
                "--no-progress",
                "--val-fraction",
                "0.2",
                "--test-fraction",
                "0.2",
            ]
        )
        == 0
    )
    tokenizer = corpus_format.load_tokenizer(built / "tokenizer")
    kind, prompts = generation.held_out_prompts(built, tokenizer)
    manifest = json.loads((built / "corpus_manifest.json").read_text())
    test_text = tokenizer.decode(
        np.concatenate(
            [np.fromfile(built / entry["name"], dtype="<u2") for entry in manifest["splits"]["test"]["files"]]
        ).tolist()
    )
    assert kind == "chat" and prompts and all(p.startswith("Which river flows through town number") for p in prompts)
    assert all(f"user\n{prompt}<|im_end|>" in test_text for prompt in prompts)  # held-out questions


# ----------------------------------------------------------------------------------------------
# 13. The smaller ones.


def test_sigterm_during_data_py_says_so_and_leaves_no_build_folder(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    texts = tmp_path / "texts"
    texts.mkdir()
    for index in range(40):
        (texts / f"book{index}.txt").write_text(" ".join(f"w{(index * 31 + i) % 5003}" for i in range(20_000)))
    out = tmp_path / "corpus"

    def building() -> bool:  # the build's temporary folder .corpus.<hex>.tmp is there
        return any(common.temporary_target(path.name) == "corpus" for path in tmp_path.iterdir())

    process = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "data.py"),
            "--data",
            str(texts),
            "--out",
            str(out),
            "--vocab-size",
            "2000",
            "--no-progress",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    while not building() and process.poll() is None:
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    err = process.communicate(timeout=120)[1]
    assert process.returncode == 143, err
    assert err.strip().splitlines()[-1].startswith("error: terminated (SIGTERM)") and "Traceback" not in err
    assert not list(tmp_path.glob(".corpus.*")) and not out.exists()


def test_sigterm_before_train_py_s_loop_is_one_error_line(tmp_path):
    """A SIGTERM while train.py starts (a --budget probe, a restore from the backup: no checkpoint to save
    yet; here from hardware.check_torch, train.main's first call) ends in one line, exit 143, and `finally`
    blocks run; it used to kill the process without a word."""
    import subprocess
    import sys

    script = (
        "import os, signal, sys, time\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "from tinyllm.model import hardware\n"
        "from tinyllm.training import train\n"
        "hardware.check_torch = lambda: (os.kill(os.getpid(), signal.SIGTERM), time.sleep(30))\n"
        f"sys.argv = ['train.py', '--data', {str(tmp_path / 'corpus')!r}, '--out', {str(tmp_path / 'run')!r}]\n"
        "train.command()\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 143, result.stderr
    assert result.stderr.strip().splitlines() == ["error: terminated (SIGTERM); nothing half-written was kept"]


def test_data_py_small_faults_are_clear(tmp_path, capsys):
    texts = tmp_path / "texts"
    texts.mkdir()
    for index in range(8):
        (texts / f"book{index}.txt").write_text(f"Book {index} tells of rivers and hills, page after page. " * 40)
    (texts / "latin1.txt").write_bytes("Caf\xe9 au lait, a book in Latin-1. ".encode("latin-1") * 40)
    outside = tmp_path / "outside.txt"
    outside.write_text("A file outside the folder, linked into it, is read like the others. " * 20)
    (texts / "link.txt").symlink_to(outside)
    out = tmp_path / "corpus"
    assert data.main(["--data", str(texts), "--out", str(out), "--vocab-size", "300", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "1 record(s) dropped for invalid UTF-8" in printed and "whole files" in printed
    inputs = {
        Path(entry["source"]).name: entry for entry in json.loads((out / "source_manifest.json").read_text())["inputs"]
    }
    assert inputs["link.txt"]["documents_kept"] == 1  # a symlinked file is read (documented in docs/TROUBLESHOOTING.md)

    # --vocab-size with --tokenizer is not ignored silently
    assert (
        data.main(
            [
                "--data",
                str(texts),
                "--out",
                str(tmp_path / "b"),
                "--tokenizer",
                str(out),
                "--vocab-size",
                "500",
                "--preset",
                "micro",
                "--no-progress",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().err
    assert f"warning: --vocab-size 500 is not used: --tokenizer {out} has 300 tokens" in printed
    assert "warning: --preset micro is not used: --tokenizer's vocabulary is the corpus'" in printed

    config_only = tmp_path / "tok"
    config_only.mkdir()
    (config_only / "tokenizer_config.json").write_text("{}")
    with pytest.raises(common.UserError, match="has no tokenizer.json") as error:
        corpus_format.load_tokenizer(config_only)
    assert "\n" not in str(error.value) and "sentencepiece" not in str(error.value)

    noise = tmp_path / "noise.txt"  # random bytes: the error alone, no note on the vocabulary before it
    noise.write_bytes(random.Random(0).randbytes(20_000))
    with pytest.raises(common.UserError, match="^no documents left after reading and filtering"):
        data.main(["--data", str(noise), "--out", str(tmp_path / "noise"), "--no-progress"])
    assert "note:" not in capsys.readouterr().err

    for record, message in (
        ({"text": 12345}, "'text' is a number, expected text"),  # JSON's words, not Python's ('a int')
        ({"text": None}, "'text' is null, expected text"),
        ({"text": {"a": 1}}, "'text' is an object, expected text"),
        (None, "record is null, expected an object or text"),
        ([1, 2], "record is a list, expected an object or text"),
        ({"messages": [{"role": "user", "content": 3.5}]}, "message content is a number, expected text"),
    ):
        with pytest.raises(data.RecordError, match=f"^{re.escape(message)}$"):
            data.to_document(record, corpus_format.CHAT_TEMPLATE, True)


def test_train_py_small_faults_are_clear(tmp_path):
    with pytest.raises(SystemExit):
        train.parse_args(["--target-tokens", "1e30"])
    assert train.parse_args(["--target-tokens", "3e9"]).run.target_tokens == 3_000_000_000
    info = distributed.DistInfo(rank=0, local_rank=0, world=1, device=train.torch.device("cpu"))
    command = train.resume_command(
        info, ["--backup-to", "s3://bucket/runs/x?key=secret", "--lr", "1", "--backup-to=gs://user:secret@other/x"]
    )
    assert "secret" not in command and "--backup-to URL" in command and "--backup-to=URL" in command
    command = train.resume_command(info, ["--backup-to", "s3://bucket/runs/x", "--backup-to=/tmp/my backups"])
    assert "--backup-to s3://bucket/runs/x" in command and "'--backup-to=/tmp/my backups'" in command
    with pytest.raises(common.UserError, match="--backup-to URL is a placeholder: give the real URL"):
        train.parse_args(["--backup-to", "URL"])
    line = report.final_line(
        tmp_path,
        store.NEEDS_RESUME,
        {
            "step": 5,
            "total_steps": 12,
            "reason": "stopped by --max-hours budget",
            "resume_command": "python train.py --resume auto",
        },
    )
    assert "stopped by --max-hours budget" in line and line.endswith("continue with: python train.py --resume auto")


def test_a_late_or_wrapped_ctrl_c_is_exit_130_or_ignored_never_a_traceback(tmp_path, capsys):
    """Issue 14.13: a second Ctrl-C right after the end died by the signal or printed a traceback."""

    def wrapped():
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as interrupt:
            raise RuntimeError("compilation interrupted") from interrupt

    code, line = run_main_exit(capsys, wrapped)
    assert code == 130 and line == "error: interrupted"

    import subprocess
    import sys

    script = tmp_path / "late.py"
    script.write_text(
        "import atexit, os, signal, sys, time\n"
        f"sys.path.insert(0, {str(Path(common.__file__).parents[1])!r})\n"
        "from tinyllm.common import run_main\n"
        "def main():\n"
        "    print('done', flush=True)\n"
        "    atexit.register(lambda: (os.kill(os.getpid(), signal.SIGINT), time.sleep(0.5)))  # Ctrl-C at exit\n"
        "    return 0\n"
        "if __name__ == '__main__':\n"
        "    run_main(main)\n"
    )
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stdout, result.stderr) == (0, "done\n", "")


# ----------------------------------------------------------------------------------------------
# Issue 20.9: a --backup-to that cannot be written is refused at start-up, not after hours of failed uploads.


def test_a_read_only_backup_folder_is_refused_before_training(corpus, tmp_path, monkeypatch, capsys):
    from tinyllm.store import checkpoint_cloud

    with read_only_folder(tmp_path / "ro-backup") as folder:  # a real read-only mount (skips without one)
        with pytest.raises(common.UserError, match="cannot be written .*read-only file system"):
            checkpoint_cloud.check_backup_target(str(folder / "run"))
    fail_os_writes(monkeypatch, tmp_path / "sim-ro", code=errno.EROFS)
    (tmp_path / "sim-ro").mkdir()
    trained = []
    monkeypatch.setattr(train, "train", lambda *args, **kwargs: trained.append(args))
    code, line = run_main_exit(
        capsys, lambda: train.main(options(corpus, tmp_path / "run") + ["--backup-to", str(tmp_path / "sim-ro" / "b")])
    )
    assert code == 2 and not trained, line
    assert line.startswith("error: --backup-to: the remote cannot be written") and "read-only file system" in line
    assert list((tmp_path / "sim-ro").rglob("*")) in ([], [tmp_path / "sim-ro" / "b"]), "the probe left a file"
