"""bench/bench_batch.py: a batch as train.py's micro-steps, and the table against the baseline batch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import bench_batch  # noqa: E402
from tiny_runs import write_tiny_corpus  # noqa: E402

from tinyllm.common import UserError  # noqa: E402


@pytest.mark.parametrize(
    "batch, context, expected",
    [
        (4096, 256, (16, 8, 2)),  # nano: two micro-steps of train.py's 8 blocks
        (2048, 256, (8, 8, 1)),
        (1024, 256, (4, 4, 1)),  # one micro-step of the 4 blocks
        (4096, 128, (32, 8, 4)),  # tiny
    ],
)
def test_a_batch_is_whole_micro_steps_of_blocks(batch, context, expected):
    assert bench_batch.batch_split(batch, context) == expected


@pytest.mark.parametrize("batch, context", [(1000, 256), (128, 256), (3072, 256)])
def test_a_batch_that_is_no_whole_micro_steps_is_refused(batch, context):
    with pytest.raises(UserError, match="--batches"):
        bench_batch.batch_split(batch, context)


@pytest.mark.parametrize("spec", ["kjv:nano", "kjv:huge:1000", "kjv:nano:many", "kjv:nano:1:2"])
def test_a_run_that_is_not_text_preset_tokens_is_refused(spec):
    with pytest.raises(UserError, match="--runs"):
        bench_batch.run_spec(spec)
    assert bench_batch.run_spec("kjv:nano:471040") == ("kjv", "nano", 471_040)


def test_each_run_is_against_the_baseline_batch_of_its_text_preset_and_seed():
    def run(batch, seed, bpb, text="kjv"):
        return {
            "text": text,
            "preset": "nano",
            "tokens": 1000,
            "batch": batch,
            "seed": seed,
            "bpb": bpb,
            "steps": 1,
            "seconds": 9.0,
        }

    runs = [run(4096, 1, 1.2), run(2048, 1, 1.08), run(4096, 2, 1.5), run(2048, 2, 1.5), run(2048, 1, 1.0, "other")]
    rows = bench_batch.report(runs, baseline=4096)[2:]
    assert [row.split(" | ")[7] for row in rows] == ["1.0000x", "0.9000x", "1.0000x", "1.0000x", "-"]


def test_a_run_of_other_tokens_is_trained_not_read_from_a_complete_one(tmp_path, monkeypatch):
    """The folder a run is read back from names its tokens: a COMPLETE run at 2,621,440 tokens was read as the
    run at 3,276,800 (the same text, preset, batch and seed) when the name left them out."""
    trained = []

    def fake_train(command, **kwargs):
        out = Path(command[command.index("--out") + 1])
        trained.append(int(command[command.index("--target-tokens") + 1]))
        out.mkdir(parents=True)
        status = {"status": "COMPLETE", "step": trained[-1] // 8192, "test": {"bits_per_byte": 1.0 + len(trained)}}
        (out / "run_status.json").write_text(json.dumps(status))
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(bench_batch.subprocess, "run", fake_train)
    runs = [bench_batch.train(tmp_path, "kjv", "nano", tokens, 8192, 1337) for tokens in (2621440, 3276800, 2621440)]
    assert trained == [2621440, 3276800]  # the third is the first, read back
    assert [run["steps"] for run in runs] == [320, 400, 320] and runs[0]["bpb"] == runs[2]["bpb"] != runs[1]["bpb"]


@pytest.mark.parametrize(
    "batches, rounds, expected",
    [
        ([4096, 8192], 2, [(4096, 2), (8192, 1), (8192, 1), (4096, 2)]),  # equal tokens each turn, the order reversed
        ([2048, 4096, 8192], 1, [(2048, 4), (4096, 2), (8192, 1)]),
    ],
)
def test_step_time_takes_equal_tokens_of_each_batch_in_turns(batches, rounds, expected):
    assert bench_batch.turns(batches, rounds) == expected


def test_step_time_times_every_batch_in_one_process_against_the_baseline(tmp_path, capsys):
    """--step-time end to end on a tiny corpus: a row per batch, the baseline's ratios 1, the others' measured."""
    write_tiny_corpus(tmp_path / "corpus-tiny")
    assert (
        bench_batch.main(
            [
                "--work",
                str(tmp_path),
                "--runs",
                "tiny:tiny:0",
                "--batches",
                "128,256",
                "--baseline",
                "256",
                "--step-time",
                "2",
            ]
        )
        == 0
    )
    rows = [line.split("|") for line in capsys.readouterr().out.splitlines() if line.startswith("| tiny |")]
    assert [row[3].strip() for row in rows] == ["128", "256"]
    assert rows[1][5].strip() == "1.0000x" and rows[1][7].strip() == "1.0000x"
    assert float(rows[0][4]) > 0 and rows[0][5].strip().endswith("x")


def test_step_time_needs_the_baseline_among_the_batches():
    with pytest.raises(UserError, match="--baseline 4096"):
        bench_batch.step_time_report("kjv", "nano", {8192: {"wall": 1.0, "cpu": 1.0}}, 4096)


def test_step_time_refuses_a_baseline_it_does_not_time_before_timing_anything(tmp_path):
    """No corpus is read (there is none here): the refusal comes before minutes of timed steps."""
    with pytest.raises(UserError, match="--baseline 1024"):
        bench_batch.main(["--work", str(tmp_path), "--runs", "kjv:nano:0", "--baseline", "1024", "--step-time", "1"])
