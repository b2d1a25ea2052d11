"""bench/bench_threads.py: the step time it reports for --budget's probe is the probe's rule over the steps."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import bench_threads  # noqa: E402


@pytest.mark.parametrize(
    "steps, threads, expected",
    [
        ([3.0, 1.0, 1.1, 1.0, 1.2, 1.0, 5.0], 2, 1.0),  # the first window that agrees (steps 2-6): its median
        ([3.0, 1.0, 1.1, 1.2, 1.3, 1.0, 5.0], 1, 1.1),  # one thread: a window of 3 (steps 2-4)
        ([0.04, 0.085] * 10, 2, 0.04),  # never agreeing within 15 steps: the fastest of the last window
        ([2.0, 1.0, 2.0], 2, 1.0),  # fewer than a window, all there is: the fastest
    ],
)
def test_the_probe_s_step_is_taken_as_budget_s_probe_takes_it(steps, threads, expected):
    assert bench_threads.probe_seconds(steps, threads) == expected
