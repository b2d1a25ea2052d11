"""--budget's check replayed over recorded runs (issue 49): which step time, taken at the check, is the steps
after it?

    python bench/bench_check.py W1 W2 ...

Each W is a bench/bench_budget_wall.py work folder (its results.json, and TEXT-MODE/metrics.jsonl per run).
For every run whose plan was checked, each estimate (`ESTIMATES`) is taken over the train rows logged up to
the check's step and set against the median of the rows logged after it, the steps it stands for. A row is one
step's time, logged every few steps: a sample of the steps the check saw. The first step is left out: it is
one in a hundred of the check's times, one in ten of the rows. The check's own rule is
`budget.typical_step_seconds`, the session's median; the others are what a check that weighs a burst's slow
first steps less would use. A ratio above 1: the estimate was slower than the rest, the run re-planned too
short.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tinyllm.common import ArgumentParser, UserError, run_main  # noqa: E402
from tinyllm.outputs import metrics_log  # noqa: E402
from tinyllm.training import budget  # noqa: E402

ESTIMATES = {
    "session median": budget.typical_step_seconds,
    "later half": lambda times: statistics.median(times[len(times) // 2 :]),
    "last 4 rows": lambda times: statistics.median(times[-4:]),
}
MIN_ROWS_AFTER = 3  # a run with fewer rows after its check is left out: too few to stand for the rest


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("works", nargs="+", help="bench_budget_wall.py work folders")
    return parser.parse_args(argv)


def checked_runs(work: Path) -> list[tuple[str, str, dict]]:
    """(text, mode, check record) of each run in `work` whose plan was checked."""
    path = work / "results.json"
    if not path.is_file():
        raise UserError(f"{work}: no results.json (not a bench_budget_wall.py work folder)")
    runs = []
    for text, modes in json.loads(path.read_text()).items():
        for mode, run in modes.items() if isinstance(modes, dict) else ():
            check = ((run if isinstance(run, dict) else {}).get("plan") or {}).get("check")
            if check:
                runs.append((text, mode, check))
    return runs


def replay(rows: list[dict], at_step: int) -> dict[str, float] | None:
    """Each estimate over the train rows from step 2 up to `at_step` / the median of those after it (None: too
    few after)."""
    train = [(row["step"], row["step_seconds"]) for row in rows if row.get("kind") == "train" and row["step"] > 1]
    before = [seconds for step, seconds in train if step <= at_step]
    after = [seconds for step, seconds in train if step > at_step]
    if len(after) < MIN_ROWS_AFTER or not before:
        return None
    rest = statistics.median(after)
    return {name: estimate(before) / rest for name, estimate in ESTIMATES.items()}


def summary(ratios: list[float]) -> str:
    """The mean ratio and the root mean square of its distance from 1."""
    rms = math.sqrt(statistics.fmean((ratio - 1) ** 2 for ratio in ratios))
    return f"{statistics.fmean(ratios):.4f} ({rms:.4f})"


def report(replayed: list[tuple[str, str, str, dict[str, float]]]) -> list[str]:
    """One row per run, then the mean (rms error) of each estimate over all runs and over the burst modes."""
    lines = ["| work | text | mode | " + " | ".join(ESTIMATES) + " |", "|---|---|---|" + "---:|" * len(ESTIMATES)]
    for work, text, mode, ratios in replayed:
        lines.append(f"| {work} | {text} | {mode} | " + " | ".join(f"{ratios[name]:.3f}" for name in ESTIMATES) + " |")
    for label, keep in (("all", lambda mode: True), ("burst modes", lambda mode: "burst" in mode)):
        chosen = [ratios for _, _, mode, ratios in replayed if keep(mode)]
        if chosen:
            cells = " | ".join(summary([ratios[name] for ratios in chosen]) for name in ESTIMATES)
            lines.append(f"| {label}: mean (rms error) | {len(chosen)} runs | | {cells} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    replayed = []
    for work in map(Path, args.works):
        for text, mode, check in checked_runs(work):
            ratios = replay(metrics_log.read_metrics(work / f"{text}-{mode}" / "metrics.jsonl"), check["at_step"])
            if ratios is not None:
                replayed.append((work.name, text, mode, ratios))
    if not replayed:
        raise UserError("no checked run with rows after its check in " + ", ".join(args.works))
    print("\n".join(report(replayed)))
    return 0


if __name__ == "__main__":
    run_main(main)
