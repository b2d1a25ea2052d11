"""bench/bench_loss_on.py's pure parts: tokens to a held-out accuracy, and each mode's train.py options."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import bench_loss_on  # noqa: E402

CURVE = [
    {"tokens": 100, "accuracy": 0.0},
    {"tokens": 200, "accuracy": 0.6},
    {"tokens": 300, "accuracy": 0.5},
    {"tokens": 400, "accuracy": 0.9},
]


@pytest.mark.parametrize(
    "threshold, tokens",
    [
        (0.0, 100),  # reached at the first measurement
        (0.5, 200),
        (0.6, 200),  # the first measurement at or above it, although the next one dips below
        (0.7, 400),
        (0.95, None),  # never
    ],
)
def test_tokens_to_is_the_first_measurement_at_or_above_the_threshold(threshold, tokens):
    assert bench_loss_on.tokens_to(CURVE, threshold) == tokens


def test_a_cell_lists_every_seed_and_the_median_only_when_all_reached():
    later = [{"tokens": 100, "accuracy": 0.0}, {"tokens": 200, "accuracy": 0.2}, {"tokens": 300, "accuracy": 0.7}]
    assert bench_loss_on.tokens_cell([CURVE, later], 0.5) == "200 / 300 (median 250)"
    assert bench_loss_on.tokens_cell([CURVE, later], 0.8) == "400 / not reached"
    assert bench_loss_on.tokens_cell([CURVE], 0.5) == "200"


def test_the_modes_differ_only_in_the_tokens_the_loss_counts():
    assert bench_loss_on.mode_options("all", "none") == []
    assert bench_loss_on.mode_options("assistant", "full") == ["--loss-on", "assistant", "--text-loss", "full"]
    options = bench_loss_on.parse_args([])
    assert options.text_loss == "none" and options.init_from is None and options.train_args == ""


def test_the_mean_curve_averages_the_seeds_at_each_measurement():
    other = [
        {"tokens": 100, "accuracy": 0.2},
        {"tokens": 200, "accuracy": 0.2},
        {"tokens": 300, "accuracy": 0.5},
        {"tokens": 400, "accuracy": 1.0},
    ]
    mean = bench_loss_on.mean_curve([CURVE, other])
    assert [point["tokens"] for point in mean] == [100, 200, 300, 400]
    assert [point["accuracy"] for point in mean] == pytest.approx([0.1, 0.4, 0.5, 0.95])


def test_paired_counts_the_seeds_where_assistant_reached_it_first_and_never_is_the_longest():
    never = [{"tokens": 100, "accuracy": 0.0}, {"tokens": 200, "accuracy": 0.1}]
    early = [{"tokens": 100, "accuracy": 0.8}]
    # seed by seed: all = CURVE, never, early, never; assistant = early, CURVE, early, never
    counts = bench_loss_on.paired([CURVE, never, early, never], [early, CURVE, early, never], 0.7)
    assert counts == {"fewer": 2, "same": 2, "more": 0}
    assert bench_loss_on.paired([early], [never], 0.5) == {"fewer": 0, "same": 0, "more": 1}
