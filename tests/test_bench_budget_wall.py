"""bench/bench_budget_wall.py: its corpora get data.py's default vocabulary, or --vocab-size's."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import bench_budget_wall  # noqa: E402


@pytest.mark.parametrize("given, expected", [([], []), (["--vocab-size", "8192"], ["--vocab-size", "8192"])])
def test_the_corpus_is_built_with_data_py_s_vocabulary_unless_one_is_given(tmp_path, monkeypatch, given, expected):
    calls = []
    monkeypatch.setattr(bench_budget_wall, "text_documents", lambda text, limit: [f"{text} one", f"{text} two"])
    monkeypatch.setattr(bench_budget_wall.data, "main", lambda argv: calls.append(argv) or 0)
    args = bench_budget_wall.parse_args(["--work", str(tmp_path), *given])
    corpus = bench_budget_wall.build_corpus(tmp_path, "kjv", args.text_bytes, args.vocab_size)
    source = tmp_path / "kjv.jsonl"
    assert calls == [["--data", str(source), "--out", str(corpus), "--no-progress", *expected]]
    assert [json.loads(line)["text"] for line in source.read_text().splitlines()] == ["kjv one", "kjv two"]


@pytest.mark.parametrize("threads", [1, 2])
def test_every_run_trains_at_the_threads_given(tmp_path, threads):
    args = bench_budget_wall.parse_args(["--work", str(tmp_path)] + (["--threads", "2"] if threads == 2 else []))
    argv, env = bench_budget_wall.train_command(tmp_path / "c", tmp_path / "r", args.threads, ["--budget", "60s"])
    assert argv[argv.index("--threads") + 1] == str(threads) and env["OMP_NUM_THREADS"] == str(threads)
    assert argv[-5:] == ["--log-every", "1", "--no-report", "--budget", "60s"]  # every step's time in metrics.jsonl


def run_record(seconds: float, bpb: float, plan: dict | None = None) -> dict:
    record = {"seconds": seconds, "bpb": bpb, "status": "COMPLETE", "steps": 10, "total_steps": 10}
    return record | {"tokens": 40_960, "preset": "tiny", "plan": plan, "load": [0.1, 2.0]}


@pytest.mark.parametrize(
    "mode, wall, expected",
    [
        ("quiet", 70.0, "**0.875x** (MISSED)"),  # 70 s of W = 80 s
        ("burst", 78.0, "**0.975x** (met)"),
        ("burst-wb", 96.0, "**0.960x** (met)"),  # its budget is the fixed run's under the same burst: 100 s
        ("burst-wb", 80.0, "**0.800x** (MISSED)"),  # within 5% of W, not of its own budget
    ],
)
def test_a_budget_run_s_wall_time_is_judged_against_the_run_that_gave_its_budget(mode, wall, expected):
    runs = {"fixed": run_record(80.0, 1.30), "fixed-burst": run_record(100.0, 1.30)}
    line = bench_budget_wall.row(
        "kjv", mode, run_record(wall, 1.27, {"candidates": []}), runs["fixed"], runs[bench_budget_wall.given_wall(mode)]
    )
    assert expected in line and "**0.9769x** (met)" in line  # bits per byte: against the fixed run's, always


@pytest.mark.parametrize(
    "checks, expected",
    [
        ({}, "| - |"),  # never checked
        ({"check": {"at_step": 9, "replanned": False}}, "| step 9: kept |"),
        (
            {
                "check": {"at_step": 9, "replanned": True, "from_steps": 40, "to_steps": 36},
                "late_check": {"at_step": 21, "replanned": True, "from_steps": 36, "to_steps": 39},
            },
            "| step 9: 40 -> 36 steps; step 21: 36 -> 39 steps |",
        ),
    ],
)
def test_a_run_s_row_shows_its_check_and_its_late_check(checks, expected):
    fixed = run_record(80.0, 1.30)
    line = bench_budget_wall.row("kjv", "quiet", run_record(80.0, 1.27, {"candidates": [], **checks}), fixed, fixed)
    assert expected in line


@pytest.mark.parametrize("given, length", [([], []), (["--fixed-tokens", "2457600"], ["--target-tokens", "2457600"])])
def test_the_fixed_choice_trains_one_epoch_or_the_tokens_given(tmp_path, given, length):
    args = bench_budget_wall.parse_args(["--work", str(tmp_path), "--seed", "7", *given])
    assert bench_budget_wall.fixed_options(args) == ["--preset", "nano", "--seed", "7", *length]
