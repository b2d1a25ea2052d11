"""bench/bench_check.py: the check's step-time estimates replayed against the steps after the check."""

from __future__ import annotations

import json
import math
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


def test_the_late_check_is_replayed_with_the_session_and_the_rows_since_the_check():
    # before the late check (step 45): 0.3, 0.3, 0.3 then, since the check (step 30), 0.6 and 0.6; after: 0.3 x 3
    rows = train_rows({1: 9.0, 10: 0.3, 20: 0.3, 30: 0.3, 35: 0.6, 45: 0.6, 50: 0.3, 60: 0.3, 70: 0.3})
    ratios = bench_check.replay_late(rows, check_step=30, late_step=45)
    assert ratios == pytest.approx({"session median": 1.0, "rows since the check": 2.0})
    assert math.isnan(bench_check.replay_late(rows, check_step=44, late_step=44)["rows since the check"])
    assert bench_check.replay_late(rows, check_step=30, late_step=60) is None  # too few rows after it


@pytest.mark.parametrize(
    "late, seconds, expected",
    [
        ({"from_steps": 284, "to_steps": 269, "step_seconds": 0.8}, 95.0, (0.95, 1.07)),  # 15 steps taken off
        ({"from_steps": 100, "to_steps": 110, "step_seconds": 0.5}, 105.0, (1.05, 1.0)),  # 10 steps added
        ({"from_steps": 100, "to_steps": 100, "step_seconds": 0.5}, 99.0, (0.99, 0.99)),  # kept
    ],
)
def test_a_run_s_end_without_its_late_re_plan(late, seconds, expected):
    assert bench_check.late_check_ends({"budget": "100s", "late_check": late}, seconds) == pytest.approx(expected)


def test_late_reports_each_run_with_a_late_check_and_the_ends_with_and_without(tmp_path, capsys):
    late = {"at_step": 45, "from_steps": 100, "to_steps": 90, "step_seconds": 0.5}
    plans = {
        "quiet": {"budget": "100s", "check": {"at_step": 30, "from_steps": 90, "to_steps": 100}, "late_check": late},
        "burst": {"budget": "100s", "check": {"at_step": 30, "from_steps": 90, "to_steps": 100}},  # no late check
    }
    results = {"kjv": {mode: {"plan": plan, "seconds": 96.0} for mode, plan in plans.items()}}
    (tmp_path / "results.json").write_text(json.dumps(results))
    for mode in plans:
        (tmp_path / f"kjv-{mode}").mkdir()
        rows = train_rows({10: 0.3, 20: 0.3, 30: 0.3, 35: 0.6, 45: 0.6, 50: 0.3, 60: 0.3, 70: 0.3})
        (tmp_path / f"kjv-{mode}" / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert bench_check.main(["--late", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len([line for line in lines if line.startswith(f"| {tmp_path.name} |")]) == 1
    assert "| step 45: 100 -> 90 | 1.000 | 2.000 | 0.960 | 1.010 |" in lines[2]
    with_late = "ends with the late check: 0.960-0.960x the budget, rms distance from 1 0.0400, 0 of 1 outside 5%"
    assert lines[-2] == with_late
    assert lines[-1].endswith("0 of 1 outside 5%") and "1.010-1.010x" in lines[-1]
    (tmp_path / "results.json").write_text(json.dumps({"kjv": {"burst": results["kjv"]["burst"]}}))
    with pytest.raises(UserError, match="no run with a late check"):
        bench_check.main(["--late", str(tmp_path)])
