"""bench/bench_cpu_step.py: the steps' speeds around the validation, and a run of its variants."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from tiny_runs import write_tiny_corpus

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import bench_cpu_step  # noqa: E402

from tinyllm.common import UserError  # noqa: E402


def test_the_speeds_are_the_medians_before_and_after_the_validation(tmp_path):
    rates = {1: 10.0, 2: 20.0, 3: 100.0, 4: 110.0, 5: 90.0, 6: 5.0, 7: 80.0, 8: 70.0, 9: 75.0, 10: 1.0}
    rows = [{"kind": "train", "step": step, "tokens_per_second": rate} for step, rate in rates.items()]
    rows.insert(5, {"kind": "eval", "step": 5, "val_loss": 3.0})
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(row) + "\n" for row in rows))
    # before: steps 3-5 (the first two warm up); after: 7-9 (step 6 follows the validation, 10 is the last)
    assert bench_cpu_step.speeds(metrics, 5) == (100.0, 75.0)


@pytest.mark.parametrize("argv", [["--variants", "before,fast"], ["--steps", "4"]])
def test_a_variant_it_does_not_know_or_too_few_steps_is_refused(argv, tmp_path):
    with pytest.raises(UserError):
        bench_cpu_step.parse_args(["--data", "c", "--work", str(tmp_path), *argv])


def test_each_variant_trains_in_a_process_of_its_own_with_its_chunk_and_allocator(tmp_path, capsys):
    corpus = write_tiny_corpus(tmp_path / "corpus")
    argv = ["--data", str(corpus), "--work", str(tmp_path / "w"), "--preset", "tiny", "--steps", "8"]
    assert bench_cpu_step.main([*argv, "--rounds", "1", "--variants", "before,both (now)"]) == 0
    printed = capsys.readouterr().out
    assert "| before | 1 |" in printed and "| 1.000x | 1.000x |" in printed and "| both (now) | 1 |" in printed
    for run in ("before-1", "both-1"):
        status = json.loads((tmp_path / "w" / run / "run_status.json").read_text())
        assert (status["status"], status["step"]) == ("COMPLETE", 8)


def test_the_loss_alone_is_timed_at_each_chunk_and_the_cpus_own(capsys):
    assert bench_cpu_step.main(["--heads", "65536x64:256", "--chunks", "64,256", "--repeats", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 65,536 x 64 |")]
    assert [row.split(" | ")[2] for row in rows] == ["64", "128", "256"]  # the CPU's: twice the hidden size
    assert rows[1].endswith("| yes |") and all(float(row.split(" | ")[3]) > 0 for row in rows)


@pytest.mark.parametrize("spec", ["512x64", "512:256", "ax64:256"])
def test_a_head_that_is_not_vocab_x_hidden_tokens_is_refused(spec):
    with pytest.raises(UserError, match="--heads"):
        bench_cpu_step.head_spec(spec)
