"""--budget against the wall clock (issue 49, item 0): given the wall time W of a fixed choice's run, does
`--budget W` end within 5% of W and at or below that run's held-out bits per byte, on a quiet machine and
with a burst of load during its probe?

    OMP_NUM_THREADS=1 python bench/bench_budget_wall.py --work W --texts kjv,changelog

For each text (bench_texts.py: one corpus each, data.py's default vocabulary or --vocab-size), three
train.py processes at --threads torch threads (1: one core of a shared machine), one after another: the
fixed choice (`--preset nano`, its defaults: one epoch, or --fixed-tokens), timed from launch to exit (W); `--budget W`
alone; `--budget W` with one busy-loop process per core for the first --burst-seconds after its launch
(the probe's whole time and the first steps); with --modes ...,fixed-burst,burst-wb also the fixed choice
with the same burst (its wall time W_b) and `--budget W_b` with it: both runs under the same load. Each row:
the run's wall time against its budget (W or W_b), its held-out
(test) bits per byte against the fixed choice's, the plan and its check (from training_settings.json),
and the load average (1 min) at its start and end: this machine is shared, so "quiet" is only as quiet
as the other users let it be.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_texts import text_documents  # noqa: E402

from tinyllm.common import ArgumentParser, UserError, atomic_write_json, run_main  # noqa: E402
from tinyllm.data import build as data  # noqa: E402

END_TOLERANCE = 0.05  # the target: the budget run ends within 5% of W


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", default=str(ROOT / "bench" / "out" / "budget-wall"), help="corpora, runs, results")
    parser.add_argument("--texts", default="kjv,changelog", help="comma list of bench_texts.py texts")
    parser.add_argument("--text-bytes", type=int, default=1_500_000, help="bytes of each text")
    parser.add_argument("--preset", default="nano", help="the fixed choice's preset")
    parser.add_argument("--burst-seconds", type=float, default=20.0, help="busy loops this long after launch")
    parser.add_argument(
        "--modes",
        default="fixed,quiet,burst",
        help="which runs (a rerun skips those done); fixed-burst: the fixed choice with the burst, its wall time "
        "what the burst costs; burst-wb: --budget that wall time, with the burst (both runs under the same load)",
    )
    parser.add_argument(
        "--fixed-tokens",
        type=int,
        help="the fixed choice's --target-tokens (default: its one epoch; the issue's example: 2457600)",
    )
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--vocab-size", type=int, help="the corpora's BPE vocabulary (default: data.py's rule)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads of every train.py run")
    return parser.parse_args(argv)


def build_corpus(work: Path, text: str, limit_bytes: int, vocab_size: int | None) -> Path:
    corpus, source = work / f"corpus-{text}", work / f"{text}.jsonl"
    if (corpus / "corpus_manifest.json").exists():
        return corpus
    work.mkdir(parents=True, exist_ok=True)
    with open(source, "w", encoding="utf-8") as handle:
        for document in text_documents(text, limit_bytes):
            handle.write(json.dumps({"text": document}) + "\n")
    argv = ["--data", str(source), "--out", str(corpus), "--no-progress"]
    argv += ["--vocab-size", str(vocab_size)] if vocab_size else []
    if data.main(argv):
        raise UserError(f"data.py could not build {corpus}")
    return corpus


def fixed_options(args: argparse.Namespace) -> list[str]:
    """train.py's options for the fixed choice: --preset, its seed and, with --fixed-tokens, its length."""
    length = ["--target-tokens", str(args.fixed_tokens)] if args.fixed_tokens else []
    return ["--preset", args.preset, "--seed", str(args.seed), *length]


def busy_loop(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def load_average() -> float:
    return os.getloadavg()[0]


def train_command(corpus: Path, out: Path, threads: int, extra: list[str]) -> tuple[list[str], dict]:
    """train.py's command line and environment for one run at `threads` torch threads. Every step's time is
    logged (--log-every 1), so that bench_check.py replays a check over the very steps it timed."""
    argv = [sys.executable, "train.py", "--data", str(corpus), "--out", str(out), "--threads", str(threads)]
    return argv + ["--log-every", "1", "--no-report", *extra], {**os.environ, "OMP_NUM_THREADS": str(threads)}


def timed_run(corpus: Path, out: Path, threads: int, extra: list[str], burst: float) -> dict:
    """train.py in a process, from launch to exit; `burst` seconds of one busy loop per core from launch."""
    argv, env = train_command(corpus, out, threads, extra)
    loads = [load_average()]
    loops = [multiprocessing.Process(target=busy_loop, args=(burst,)) for _ in range(os.cpu_count() if burst else 0)]
    started = time.monotonic()
    for loop in loops:
        loop.start()
    result = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True)
    seconds = time.monotonic() - started
    for loop in loops:
        loop.join()
    loads.append(load_average())
    if result.returncode != 0:
        raise UserError(f"train.py failed ({out}): {result.stderr[-2000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    test = next((record for record in records if "test_bits_per_byte" in record), {})  # none: stopped saved
    settings = json.loads((out / "training_settings.json").read_text())
    status = json.loads((out / "run_status.json").read_text())
    return {
        "seconds": seconds,
        "bpb": test.get("test_bits_per_byte"),
        "status": status["status"],
        "steps": status["step"],
        "total_steps": status["total_steps"],
        "tokens": settings["training"]["total_steps"] * settings["training"]["tokens_per_step"],
        "preset": settings["training"]["preset"],
        "plan": settings.get("budget"),
        "load": loads,
        "last_lines": result.stdout.splitlines()[-3:],
        "probe_lines": [line for line in result.stdout.splitlines() if line.startswith("--budget: ")],
    }


BUDGET_MODES = ("quiet", "burst", "burst-wb")


def given_wall(mode: str) -> str:
    """The fixed run whose wall time a mode's --budget is: burst-wb's is the fixed run's under the same burst."""
    return "fixed-burst" if mode == "burst-wb" else "fixed"


def row(text: str, mode: str, run: dict, fixed: dict, given: dict) -> str:
    """A run's table row: its wall time against the `given` run's (its budget), its bits per byte against
    the `fixed` run's."""
    plan = run.get("plan")
    ratio = run["seconds"] / given["seconds"]
    within = "" if plan is None else (" (met)" if abs(ratio - 1) <= END_TOLERANCE else " (MISSED)")
    probed = ", ".join(
        f"{c['preset']} {c['tokens_per_second']:,.0f}" for c in (plan or {}).get("candidates", []) if c["probed"]
    )
    checks = [check for check in ((plan or {}).get("check"), (plan or {}).get("late_check")) if check]
    how = "; ".join(
        f"step {check['at_step']}: "
        + (f"{check['from_steps']} -> {check['to_steps']} steps" if check["replanned"] else "kept")
        for check in checks
    )
    if run["bpb"] is None:
        bpb_text = f"none: stopped at step {run['steps']}/{run['total_steps']} | (MISSED)"
    else:
        bpb = run["bpb"] / fixed["bpb"]
        verdict = "" if plan is None else (" (met)" if bpb <= 1 else " (MISSED)")
        bpb_text = f"{run['bpb']:.4f} | **{bpb:.4f}x**{verdict}"
    return (
        f"| {text} | {mode} | {run['preset']}, {run['tokens']:,} tokens ({run['steps']} steps, {run['status']}) | "
        f"{probed or '-'} | {how or '-'} | {run['seconds']:.0f} s | **{ratio:.3f}x**{within} | {bpb_text} | "
        f"{run['load'][0]:.1f} / {run['load'][1]:.1f} |"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    results_path = work / "results.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    modes = args.modes.split(",")
    for text in args.texts.split(","):
        corpus = build_corpus(work, text, args.text_bytes, args.vocab_size)
        runs = results.setdefault(text, {})
        fixed = fixed_options(args)
        for mode in ("fixed", "fixed-burst"):
            if mode in modes and mode not in runs:
                burst = args.burst_seconds if mode == "fixed-burst" else 0
                runs[mode] = timed_run(corpus, work / f"{text}-{mode}", args.threads, fixed, burst)
                atomic_write_json(results_path, results)
        for mode in BUDGET_MODES:
            if mode in modes and mode not in runs:
                burst = args.burst_seconds if mode != "quiet" else 0
                planned = ["--budget", f"{runs[given_wall(mode)]['seconds']:.0f}s", "--seed", str(args.seed)]
                runs[mode] = timed_run(corpus, work / f"{text}-{mode}", args.threads, planned, burst)
                atomic_write_json(results_path, results)
            done = runs.get(mode, {})
            print(f"{text} {mode}: {done.get('probe_lines', [])} {done.get('last_lines')}", flush=True)
    print(
        "\n| text | run | what it trained | probe (tokens/s) | check | wall | / its budget (target 0.95-1.05) | "
        "test bpb | / fixed (target <= 1) | load avg start / end |\n|---|---|---|---|---|---:|---:|---:|---:|---|"
    )
    for text, runs in results.items():
        for mode in ("fixed", "fixed-burst", *BUDGET_MODES):
            if mode in runs:
                print(row(text, mode, runs[mode], runs["fixed"], runs[given_wall(mode)]))
    return 0


if __name__ == "__main__":
    run_main(main)
