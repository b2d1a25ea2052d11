"""--budget's check replayed over recorded runs (issue 49): which step time, taken at the check, is the steps
after it?

    python bench/bench_check.py W1 W2 ...
    python bench/bench_check.py --late W1 W2 ...

Each W is a bench/bench_budget_wall.py work folder (its results.json, and TEXT-MODE/metrics.jsonl per run).
For every run whose plan was checked, each estimate (`ESTIMATES`) is taken over the train rows logged up to
the check's step and set against the median of the rows logged after it, the steps it stands for. A row is one
step's time, logged every few steps (every step since bench_budget_wall.py gives --log-every 1, 2026-12-07): a
sample of the steps the check saw. The first step is left out: it is
one in a hundred of the check's times, one in ten of the rows. The check's own rule is
`budget.typical_step_seconds`, the session's median; the others are what a check that weighs a burst's slow
first steps less would use. A ratio above 1: the estimate was slower than the rest, the run re-planned too
short.

With --late, the runs whose plan had a late check (`Plan.late_check`, which times the steps since the check):
the session's median and the median of the rows since the check, each at the late check against the median of
the rows after it; and each run's end against its budget with the late check's re-plan and without it
(estimated: the end less the steps it added, or plus those it took, at the step time it measured).
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
    parser.add_argument("--late", action="store_true", help="replay the late checks, and their runs' ends")
    return parser.parse_args(argv)


def planned_runs(work: Path) -> list[tuple[str, str, dict]]:
    """(text, mode, run record) of each run in `work` with a --budget plan."""
    path = work / "results.json"
    if not path.is_file():
        raise UserError(f"{work}: no results.json (not a bench_budget_wall.py work folder)")
    runs = []
    for text, modes in json.loads(path.read_text()).items():
        for mode, run in modes.items() if isinstance(modes, dict) else ():
            if isinstance(run, dict) and run.get("plan"):
                runs.append((text, mode, run))
    return runs


def checked_runs(work: Path) -> list[tuple[str, str, dict]]:
    """(text, mode, check record) of each run in `work` whose plan was checked."""
    return [(text, mode, run["plan"]["check"]) for text, mode, run in planned_runs(work) if run["plan"].get("check")]


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
    """The mean ratio and the root mean square of its distance from 1 (a NaN, no estimate, left out)."""
    ratios = [ratio for ratio in ratios if not math.isnan(ratio)]
    rms = math.sqrt(statistics.fmean((ratio - 1) ** 2 for ratio in ratios))
    return f"{statistics.fmean(ratios):.4f} ({rms:.4f})"


def replay_late(rows: list[dict], check_step: int, late_step: int) -> dict[str, float] | None:
    """At the late check: the session's median and the median of the rows since the check (NaN: none logged)
    / the median of the rows after it (None: too few after)."""
    train = [(row["step"], row["step_seconds"]) for row in rows if row.get("kind") == "train" and row["step"] > 1]
    since = [seconds for step, seconds in train if check_step < step <= late_step]
    ratios = replay(rows, late_step)
    if ratios is None:
        return None
    rest = statistics.median(seconds for step, seconds in train if step > late_step)
    return {
        "session median": ratios["session median"],
        "rows since the check": statistics.median(since) / rest if since else math.nan,
    }


def late_check_ends(plan: dict, seconds: float) -> tuple[float, float]:
    """The run's end / its budget, and that end had its late check not re-planned: the steps the late check
    added (or took), at the step time it measured, taken off (or added)."""
    budget_seconds = budget.budget_seconds(plan["budget"])
    late = plan["late_check"]
    moved = (late["to_steps"] - late["from_steps"]) * late["step_seconds"]
    return seconds / budget_seconds, (seconds - moved) / budget_seconds


def report_late(replayed: list[tuple[str, str, str, dict, dict[str, float] | None, tuple[float, float]]]) -> list[str]:
    """One row per run with a late check, then the estimates' mean (rms error) and the ends with and without."""
    lines = [
        "| work | text | mode | check | late check | session median | rows since the check | end / budget | "
        "without its re-plan |",
        "|---|---|---|---|---|---:|---:|---:|---:|",
    ]
    for work, text, mode, plan, ratios, ends in replayed:
        check, late = plan["check"], plan["late_check"]
        cells = [f"{ratios[name]:.3f}" if ratios else "-" for name in ("session median", "rows since the check")]
        lines.append(
            f"| {work} | {text} | {mode} | step {check['at_step']}: {check['from_steps']} -> {check['to_steps']} | "
            f"step {late['at_step']}: {late['from_steps']} -> {late['to_steps']} | {cells[0]} | {cells[1]} | "
            f"{ends[0]:.3f} | {ends[1]:.3f} |"
        )
    estimated = [ratios for *_, ratios, _ in replayed if ratios]
    if estimated:
        cells = [summary([ratios[name] for ratios in estimated]) for name in ("session median", "rows since the check")]
        lines.append(f"| estimates: mean (rms error) | {len(estimated)} runs | | | | {cells[0]} | {cells[1]} | | |")
    for index, label in ((0, "with the late check"), (1, "without its re-plan")):
        ends = [run[-1][index] for run in replayed]
        rms = math.sqrt(statistics.fmean((end - 1) ** 2 for end in ends))
        outside = sum(abs(end - 1) > 0.05 for end in ends)
        lines.append(
            f"ends {label}: {min(ends):.3f}-{max(ends):.3f}x the budget, rms distance from 1 {rms:.4f}, "
            f"{outside} of {len(ends)} outside 5%"
        )
    return lines


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
    if args.late:
        return main_late(args.works)
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


def main_late(works: list[str]) -> int:
    replayed = []
    for work in map(Path, works):
        for text, mode, run in planned_runs(work):
            plan = run["plan"]
            if plan.get("late_check") and run.get("seconds"):
                rows = metrics_log.read_metrics(work / f"{text}-{mode}" / "metrics.jsonl")
                ratios = replay_late(rows, plan["check"]["at_step"], plan["late_check"]["at_step"])
                replayed.append((work.name, text, mode, plan, ratios, late_check_ends(plan, run["seconds"])))
    if not replayed:
        raise UserError("no run with a late check in " + ", ".join(works))
    print("\n".join(report_late(replayed)))
    return 0


if __name__ == "__main__":
    run_main(main)
