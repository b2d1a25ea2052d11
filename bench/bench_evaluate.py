"""What `report.py evaluate` and the in-loop --eval-tasks cost beside the training they score, on the demo.

    python bench/bench_evaluate.py                          # 150 demo steps in bench/out/evaluate
    python bench/bench_evaluate.py --steps 1400 --corpus corpus/demo
    python bench/bench_evaluate.py --in-loop --steps 1400   # the demo at its length, --eval-tasks off and on

Trains the demo (`python train.py --no-report`, the demo defaults, --steps steps), exports the final
checkpoint, then times `python report.py evaluate` on the demo's held-out problems as a
multiple-choice task (evaluation.demo_choice_items: 260 items, 4 choices) and, for comparison, on
the exact-match task (greedy chat replies, the demo's CORPUS/eval). Prints each wall time, its
ratio to the training's, and the scores.

--in-loop instead trains the demo twice, the same steps, without and with `--eval-tasks` on that
multiple-choice file at the defaults (--eval-tasks-limit, --eval-tasks-every), and prints the wall
times, their ratio, and the scoring's own seconds (metrics.jsonl's "tasks" records) as a share of
the run with them: the 5% target of issue 22.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tinyllm.common import ArgumentParser, UserError, run_main  # noqa: E402
from tinyllm.data import build as data  # noqa: E402
from tinyllm.data import corpus_format  # noqa: E402
from tinyllm.outputs import evaluation, metrics_log  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--work", default=str(ROOT / "bench" / "out" / "evaluate"), help="folder (emptied first)")
    parser.add_argument("--corpus", default=None, help="copy this built demo corpus in instead of building it")
    parser.add_argument("--steps", type=int, default=150, help="demo training steps")
    parser.add_argument("--in-loop", action="store_true", help="time the in-loop --eval-tasks instead")
    return parser.parse_args(argv)


def timed(command: list[str], cwd: Path) -> float:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    started = time.perf_counter()
    result = subprocess.run([sys.executable, *command], cwd=cwd, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise UserError(f"{command[0]} exited {result.returncode}: {result.stderr.strip().splitlines()[-1:]}")
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:

    args = parse_args(argv)
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    if args.corpus:
        shutil.copytree(args.corpus, work / "corpus" / "demo")
    else:
        data.build_demo_corpus(work / "corpus" / "demo")
    tokenizer = corpus_format.load_tokenizer(work / "corpus" / "demo")
    items = work / "demo_choices.jsonl"
    items.write_text("".join(json.dumps(item) + "\n" for item in evaluation.demo_choice_items(tokenizer)))
    demo = [str(ROOT / "train.py"), "--target-tokens", str(args.steps * 32 * 128), "--no-report"]
    if args.in_loop:
        return in_loop(work, demo, items)
    train_seconds = timed(demo, work)
    timed([str(ROOT / "train.py"), "--export-only"], work)
    print(f"demo training, {args.steps} steps (--no-report): {train_seconds:.1f} s")
    for name, task in (("multiple choice (lm-eval)", items), ("exact match (greedy replies)", "corpus/demo/eval")):
        seconds = timed(
            [
                str(ROOT / "report.py"),
                "evaluate",
                "runs/demo",
                "--tasks",
                str(task),
                "--json",
                str(work / "scores.json"),
            ],
            work,
        )
        scores = next(iter(json.loads((work / "scores.json").read_text())["tasks"].values()))
        shown = {key: round(value, 4) for key, value in scores.items() if key in ("acc", "acc_norm", "exact_match")}
        print(
            f"report.py evaluate, {name}, {scores['n']} items: {seconds:.1f} s = "
            f"{seconds / train_seconds:.2f}x the training; {shown}"
        )
    print(f"load average (1 min) at the end: {os.getloadavg()[0]:.1f}")
    return 0


def in_loop(work: Path, demo: list[str], items: Path) -> int:
    """The demo without and with --eval-tasks (defaults): wall times, and the scoring's share of the second."""

    off = timed([*demo, "--out", "runs/off"], work)
    on = timed([*demo, "--out", "runs/on", "--eval-tasks", str(items)], work)
    records = [
        record
        for record in metrics_log.read_metrics(work / "runs" / "on" / "metrics.jsonl")
        if record["kind"] == "tasks"
    ]
    scoring = sum(record["seconds"] for record in records)
    print(f"demo training, --eval-tasks off: {off:.1f} s; on: {on:.1f} s = {on / off:.3f}x")
    print(
        f"scored at steps {[record['step'] for record in records]}, {records[-1]['local_demo_choices/n']} items "
        f"each: {scoring:.1f} s in all = {100 * scoring / on:.2f}% of the run with them"
    )
    print(
        "acc by step: "
        + ", ".join(f"{record['step']}: {record['local_demo_choices/acc']:.3f}" for record in records)
        + f" (chance {records[-1]['local_demo_choices/chance']})"
    )
    print(f"load average (1 min) at the end: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    run_main(main)
