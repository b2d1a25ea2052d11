"""The full default demo, timed: `python train.py` with no arguments in a fresh folder.

    python bench/bench_demo.py                      # runs in bench/out/demo (removed first)
    python bench/bench_demo.py --work /tmp/demo     # elsewhere
    python bench/bench_demo.py --corpus corpus/demo # reuse a built demo corpus (then not timed)

Prints the wall time of the whole demo (corpus build, training, evaluation, export) and of its
parts, and the held-out accuracy overall and by task from RUN/run_status.json; `--json` also
writes them to a file. The demo's target: >= 90% on held-out addition within ~10 minutes on
2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tinyllm.common import ArgumentParser, UserError, atomic_write_json, run_main  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument(
        "--work", default=str(ROOT / "bench" / "out" / "demo"), help="folder the demo runs in (emptied first)"
    )
    parser.add_argument("--corpus", default=None, help="copy this built demo corpus in instead of building it")
    parser.add_argument("--json", default=None, help="also write the figures to this JSON file")
    parser.add_argument("--timeout", type=float, default=1800, help="give up after this many seconds")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    if args.corpus:
        shutil.copytree(args.corpus, work / "corpus" / "demo")
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    result = subprocess.run(
        [sys.executable, str(ROOT / "train.py")],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=args.timeout,
    )
    wall = time.perf_counter() - started
    (work / "train_stdout.txt").write_text(result.stdout)
    (work / "train_stderr.txt").write_text(result.stderr)
    if result.returncode != 0:
        raise UserError(f"the demo exited {result.returncode}: {result.stderr.strip().splitlines()[-1:]}")
    run = work / "runs" / "demo"
    status = json.loads((run / "run_status.json").read_text())
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train_seconds = (
        sum(r["step_seconds"] for r in records if r["kind"] == "train")
        * status["total_steps"]
        / max(1, sum(1 for r in records if r["kind"] == "train"))
    )
    accuracy = status.get("task_accuracy") or {}
    figures = {
        "command": "python train.py",
        "status": status["status"],
        "wall_seconds": round(wall, 1),
        "corpus_built": not args.corpus,
        "steps": status["step"],
        "tokens": status["tokens"],
        "train_seconds_estimate": round(train_seconds, 1),
        "test_loss": status.get("test_loss"),
        "accuracy": accuracy.get("accuracy"),
        "by_task": {name: f"{task['correct']}/{task['total']}" for name, task in accuracy.get("by_task", {}).items()},
        "report_errors": status.get("report_errors"),
        "cpu_count": os.cpu_count(),
        "load_average_before": round(load_before, 2),
        "machine": platform.platform(),
        "last_line": result.stdout.strip().splitlines()[-1],
    }
    print(json.dumps(figures, indent=2))
    if args.json:
        atomic_write_json(args.json, figures)
    return 0


if __name__ == "__main__":
    run_main(main)
