"""bench/bench_passes.py: the tokens a number of passes trains, and the table against each preset's best."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import bench_passes  # noqa: E402


@pytest.mark.parametrize(
    "passes, preset, train_tokens, expected",
    [
        (1, "tiny", 397_093, (397_312, 32)),  # 97 whole steps of 4,096 tokens, the nearest to one pass
        (4, "tiny", 397_093, (1_589_248, 32)),  # 388 steps of 4,096 (the rule: 1.59M / 250 -> 4,096)
        (4, "nano", 10_000_000, (40_009_728, 128)),  # 1,221 steps of 32,768 (the root of 40M x 8,192 / 250: 36,204)
        (0.001, "nano", 10_000, (4_096, 16)),  # at least one step
    ],
)
def test_the_tokens_of_a_number_of_passes_are_whole_steps_of_the_batch_rule(passes, preset, train_tokens, expected):
    assert bench_passes.run_tokens(passes, preset, train_tokens) == expected


def test_the_table_gives_each_preset_s_runs_against_its_best_and_marks_max_passes():
    runs = [
        {"preset": "nano", "passes": 2.0, "seed": 1338, "bpb": 1.6, "tokens": 800, "steps": 2},
        {"preset": "nano", "passes": 2.0, "seed": 1337, "bpb": 1.4, "tokens": 800, "steps": 2},
        {"preset": "nano", "passes": 4.0, "seed": 1337, "bpb": 1.65, "tokens": 1600, "steps": 4},
        {"preset": "tiny", "passes": 1.0, "seed": 1337, "bpb": 2.0, "tokens": 400, "steps": 1},
    ]
    lines = bench_passes.report(runs, allowed=2)
    assert lines[2] == "| nano | 2 (max_passes) | 800 | 2 | 1.4000 (1337), 1.6000 (1338) | 1.5000 | 1.0000 |"
    assert lines[3] == "| nano | 4 | 1,600 | 4 | 1.6500 (1337) | 1.6500 | 1.1000 |"
    assert lines[4] == "| tiny | 1 | 400 | 1 | 2.0000 (1337) | 2.0000 | 1.0000 |"
