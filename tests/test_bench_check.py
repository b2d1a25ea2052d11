"""bench/bench_check.py: the check's step-time estimates replayed against the steps after the check."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import bench_check  # noqa: E402

from tinyllm.common import UserError  # noqa: E402


def train_rows(times: dict[int, float]) -> list[dict]:
    return [{"kind": "train", "step": step, "step_seconds": seconds} for step, seconds in times.items()]


def test_each_estimate_is_over_the_rows_before_the_check_against_the_median_after_it():
    # step 1 (allocations) is left out; before the check: 0.5 (a burst), 0.5, 0.3, 0.3, 0.3; after: 0.25, 0.3, 0.2
    rows = train_rows({1: 9.0, 10: 0.5, 20: 0.5, 30: 0.3, 40: 0.3, 50: 0.3, 60: 0.25, 70: 0.3, 80: 0.2})
    rows.insert(3, {"kind": "eval", "step": 30, "val_loss": 4.0})
    ratios = bench_check.replay(rows, at_step=50)
    assert ratios == pytest.approx({"session median": 0.3 / 0.25, "later half": 0.3 / 0.25, "last 4 rows": 0.3 / 0.25})
    ratios = bench_check.replay(rows, at_step=20)  # only the burst's rows before the check
    assert ratios["session median"] == pytest.approx(0.5 / 0.3)


def test_a_check_with_too_few_rows_after_it_is_left_out():
    rows = train_rows({10: 0.3, 20: 0.3, 30: 0.3, 40: 0.3})
    assert bench_check.replay(rows, at_step=20) is None
    assert bench_check.replay(rows, at_step=10) is not None  # three rows after it
    assert bench_check.replay(rows, at_step=5) is None  # none before it


def test_only_checked_runs_are_replayed_and_a_folder_without_results_is_one_error(tmp_path, capsys):
    results = {
        "kjv": {"fixed": {"plan": None}, "burst": {"plan": {"check": {"at_step": 20}}}, "quiet": {"plan": {}}},
        "sweep": ["not", "a", "text"],
    }
    (tmp_path / "results.json").write_text(json.dumps(results))
    run = tmp_path / "kjv-burst"
    run.mkdir()
    rows = train_rows({10: 0.4, 20: 0.4, 30: 0.2, 40: 0.2, 50: 0.2})
    (run / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert bench_check.checked_runs(tmp_path) == [("kjv", "burst", {"at_step": 20})]
    assert bench_check.main([str(tmp_path)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[2].split(" | ")[3:] == ["2.000", "2.000", "2.000 |"]
    assert table[-1].startswith("| burst modes: mean (rms error) | 1 runs | | 2.0000 (1.0000)")
    with pytest.raises(UserError, match="no results.json"):
        bench_check.main([str(tmp_path / "kjv-burst")])
