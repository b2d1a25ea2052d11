"""bench/bench_vocab.py: its pure parts (the token count a speed buys, the vocabularies a text supports, the
report) and --smoke end to end (data.py and train.py as subprocesses, a generated text, seconds)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import bench_vocab  # noqa: E402

from tinyllm.model import config as model_config  # noqa: E402
from tinyllm.training import budget  # noqa: E402


@pytest.mark.parametrize(
    "tokens, preset, train_tokens, vocab, expected",
    [
        (1_000_000, "tiny", 10**8, 4096, (999_424, 32)),  # 244 whole steps of 4,096 tokens (32 blocks of 128)
        (4_000_000, "tiny", 10**8, 4096, (3_997_696, 64)),  # under 250 x 16,384: the batch rule's 8,192
        (4_000_000, "tiny", 500_000, 4096, (1_998_848, 32)),  # at most 4 passes over the train split (4,096 a step)
        (4_000_000, "tiny", 500_000, 8192, (999_424, 32)),  # 2 at 61 tokens a vocabulary entry
        (100, "nano", 10**8, 4096, (4_096, 16)),  # at least one step
    ],
)
def test_the_tokens_a_speed_buys_follow_the_budget_batch_rule(tokens, preset, train_tokens, vocab, expected):
    assert bench_vocab.planned_tokens(tokens, preset, train_tokens, vocab) == expected
    planned, blocks = expected
    step = blocks * model_config.PRESETS[preset].context
    assert planned % step == 0 and planned <= max(tokens, step)
    assert planned <= budget.max_passes(train_tokens, vocab) * train_tokens or planned == step


def test_a_vocabulary_the_text_cannot_support_is_measured_once():
    data = {"corpora": {f"t/{v}": {"vocab": min(v, 15_195)} for v in (1024, 4096, 16_384, 32_768)}}
    assert bench_vocab.distinct_vocabs(data, "t", ["32768", "1024", "16384", "4096", "1024"]) == [1024, 4096, 16_384]
    assert bench_vocab.actual_vocab(data, "t", 16_384) == "16,384 (15,195 built)"
    assert bench_vocab.actual_vocab(data, "t", 4096) == "4,096"


def test_the_report_marks_the_best_vocabulary_and_todays_rule():
    def run(vocab, seed, bpb):
        return {"text": "t", "preset": "tiny", "vocab": vocab, "seed": seed, "mode": "time", "bpb": bpb}

    runs = [run(1024, 1, 1.50), run(1024, 2, 1.52), run(2048, 1, 1.40), run(2048, 2, 1.44), run(4096, 1, 1.45)]
    data = {
        "texts": {"t": {"bytes": 4_000_000, "today_vocab": 1024}},
        "corpora": {f"t/{v}": {"vocab": v} for v in (1024, 2048, 4096)},
        "runs": [{**r, "rate": 1000.0, "tokens": 10_000, "bytes_per_token": 4.0} for r in runs],
    }
    lines = bench_vocab.report(data)
    assert "today's rule: 1,024" in lines[1]
    row = {line.split(" |")[0]: line for line in lines if line.startswith("| ")}
    assert row["| 1,024 (today)"].endswith("| 1.5100 | 1.0634 |")  # (1.50 + 1.52) / 2 against (1.40 + 1.44) / 2
    assert row["| 2,048 (best)"].endswith("| 1.4000 | 1.4400 | 1.4200 | 1.0000 |")
    assert "| 1.4500 | - | 1.4500 |" in row["| 4,096"]  # a seed not yet run


def test_smoke_builds_times_and_trains_through_the_command_line(tmp_path, capsys):
    assert bench_vocab.main(["--smoke", "--work", str(tmp_path), "--jobs", "1"]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    today = results["texts"]["smoke"]["today_vocab"]
    assert today == results["corpora"]["smoke/default"]["vocab"] <= 512  # data.py's own rule, asked for nothing
    assert {t["vocab"] for t in results["timing"]} == {300, 400}
    assert all(t["tokens_per_second"] > 0 and t["steps"] == 3 for t in results["timing"])
    assert len(results["runs"]) == 2
    for run in results["runs"]:
        assert math.isfinite(run["bpb"]) and 0 < run["bpb"] < 8 and run["test_bytes"] > 0
        assert run["bytes_per_token"] > 1  # a BPE token is more than a byte
    shown = capsys.readouterr().out
    assert "equal wall time" in shown and "(best)" in shown
    assert not (tmp_path / "runs" / "timing").exists() or not any((tmp_path / "runs").rglob("*.pt"))
