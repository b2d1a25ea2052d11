"""Held-out bits per byte against the batch, at equal tokens (issue 49): where budget.MIN_BATCH_TOKENS is read off.

    python bench/bench_batch.py --work W --runs kjv:nano:471040,changelog:nano:536576,kjv:tiny:700416 \
        --batches 4096,2048,1024 --seeds 1337,1338

W holds one corpus folder per text, W/corpus-TEXT (e.g. bench_budget_wall.py's). Each (text, preset, tokens,
batch, seed) is one `train.py --preset P --target-tokens T --batch-size B --grad-accum A --seed S --threads 1
--no-report` in W/TEXT-PRESET-tTOKENS-bBLOCKS-sSEED (a run already COMPLETE there is read, not trained again),
timed from launch to exit; the table gives each run's test bits per byte against the same (text, preset, seed) at the
baseline batch (--baseline, 4,096 tokens: the batch --budget's rule gave these runs before).

What a batch costs per token, without the machine's drift (budget.STEPS_PER_RUN is read off it too):

    OMP_NUM_THREADS=1 python bench/bench_batch.py --work W --runs kjv:nano:0 --batches 4096,8192 --baseline 8192 \
        --step-time 30

With --step-time ROUNDS, no runs: one process (one thread) holds a run of PRESET at each batch (train.py's
Training at the same seed and micro-batch) and takes their steps in turns, ROUNDS rounds of each batch's share of
the largest batch's tokens (the order reversed every other round), after 3 untimed steps each; the table gives
each batch's median milliseconds per 4,096 tokens, in wall and CPU time, and its ratio to the baseline batch's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tinyllm.common import ArgumentParser, UserError, run_main  # noqa: E402
from tinyllm.model import config as model_config  # noqa: E402
from tinyllm.training import distributed  # noqa: E402
from tinyllm.training import train as trainer  # noqa: E402

MICRO_BATCH = 8  # train.py's default --batch-size: blocks per micro-step


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", required=True, help="a folder holding corpus-TEXT folders; runs are written here")
    parser.add_argument("--runs", required=True, help="comma list of TEXT:PRESET:TOKENS")
    parser.add_argument("--batches", default="4096,2048", help="comma list of batches in tokens a step")
    parser.add_argument("--baseline", type=int, default=4096, help="the batch each run is compared with")
    parser.add_argument("--seeds", default="1337,1338", help="comma list of seeds")
    parser.add_argument(
        "--step-time", type=int, default=0, metavar="ROUNDS", help="time the batches' steps in turns (no runs)"
    )
    return parser.parse_args(argv)


def batch_split(batch_tokens: int, context: int) -> tuple[int, int, int]:
    """(blocks, --batch-size, --grad-accum) of a batch of `batch_tokens` at `context`: micro-steps of
    MICRO_BATCH blocks, or one smaller micro-step."""
    blocks = batch_tokens // context
    if blocks < 1 or blocks * context != batch_tokens:
        raise UserError(f"--batches: {batch_tokens} is not a whole number of {context}-token blocks")
    micro = min(blocks, MICRO_BATCH)
    if blocks % micro:
        raise UserError(f"--batches: {blocks} blocks do not split into micro-steps of {micro}")
    return blocks, micro, blocks // micro


def run_spec(spec: str) -> tuple[str, str, int]:
    """(text, preset, tokens) of one --runs item, TEXT:PRESET:TOKENS."""
    parts = spec.split(":")
    if len(parts) != 3 or parts[1] not in model_config.PRESETS or not parts[2].isdigit():
        raise UserError(f"--runs: {spec!r} is not TEXT:PRESET:TOKENS (presets: {', '.join(model_config.PRESETS)})")
    return parts[0], parts[1], int(parts[2])


def train(work: Path, text: str, preset: str, tokens: int, batch: int, seed: int) -> dict:
    """One run's {"bpb", "steps", "seconds"}: trained unless its folder holds a COMPLETE run already."""
    blocks, micro, accum = batch_split(batch, model_config.PRESETS[preset].context)
    out = work / f"{text}-{preset}-t{tokens}-b{blocks}-s{seed}"
    status_path, seconds_path = out / "run_status.json", out.with_suffix(".seconds")
    status = json.loads(status_path.read_text()) if status_path.exists() else {}
    if status.get("status") != "COMPLETE":
        command = [
            *(sys.executable, str(ROOT / "train.py"), "--data", str(work / f"corpus-{text}"), "--out", str(out)),
            *("--preset", preset, "--target-tokens", str(tokens), "--batch-size", str(micro)),
            *("--grad-accum", str(accum), "--seed", str(seed), "--threads", "1", "--no-report"),
        ]
        started = time.monotonic()
        done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        if done.returncode:
            raise UserError(f"train.py failed ({done.returncode}) in {out}: {done.stderr.strip()[-600:]}")
        seconds_path.write_text(f"{time.monotonic() - started:.2f}\n")
        status = json.loads(status_path.read_text())
    seconds = float(seconds_path.read_text()) if seconds_path.exists() else float("nan")
    return {"bpb": status["test"]["bits_per_byte"], "steps": status["step"], "seconds": seconds}


def report(runs: list[dict], baseline: int) -> list[str]:
    """The table: each run's bits per byte and wall time, and its bits per byte / the baseline batch's."""
    base = {(r["text"], r["preset"], r["seed"]): r["bpb"] for r in runs if r["batch"] == baseline}
    lines = [
        "| text | preset | tokens | batch | steps | seed | test bpb | / baseline | wall |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        reference = base.get((r["text"], r["preset"], r["seed"]))
        ratio = f"{r['bpb'] / reference:.4f}x" if reference else "-"
        lines.append(
            f"| {r['text']} | {r['preset']} | {r['tokens']:,} | {r['batch']:,} | {r['steps']} | {r['seed']} | "
            f"{r['bpb']:.4f} | {ratio} | {r['seconds']:.0f} s |"
        )
    return lines


def turns(batches: list[int], rounds: int) -> list[tuple[int, int]]:
    """(batch, steps) in the order --step-time takes them: each round every batch's share of the largest batch's
    tokens, the order reversed every other round (a machine that speeds up or slows down favours neither)."""
    largest = max(batches)
    order = []
    for index in range(rounds):
        for batch in batches if index % 2 == 0 else reversed(batches):
            order.append((batch, largest // batch))
    return order


def step_times(work: Path, text: str, preset: str, batches: list[int], rounds: int) -> dict[int, dict]:
    """{batch: {"wall", "cpu"}}: the median seconds per 4,096 tokens of each batch's steps, taken in turns."""
    torch.set_num_threads(1)
    info = distributed.init_distributed("cpu")
    runs = {}
    for batch in batches:
        _, micro, accum = batch_split(batch, model_config.PRESETS[preset].context)
        argv = [
            *("--data", str(work / f"corpus-{text}"), "--out", str(work / f"step-time-{batch}"), "--preset", preset),
            *("--batch-size", str(micro), "--grad-accum", str(accum), "--target-tokens", str(10**12)),
            *("--seed", "1337", "--threads", "1", "--no-report"),
        ]
        runs[batch] = trainer.build_training(trainer.parse_args(argv), info)
        for _ in range(3):
            runs[batch].train_step()
    times = {batch: {"wall": [], "cpu": []} for batch in batches}
    for batch, steps in turns(batches, rounds):
        for _ in range(steps):
            wall, cpu = time.perf_counter(), time.process_time()
            runs[batch].train_step()
            times[batch]["wall"].append((time.perf_counter() - wall) * 4096 / batch)
            times[batch]["cpu"].append((time.process_time() - cpu) * 4096 / batch)
    return {batch: {kind: statistics.median(seen) for kind, seen in kinds.items()} for batch, kinds in times.items()}


def require_baseline(batches: list[int], baseline: int) -> None:
    """--step-time compares each batch with the baseline's steps: one of the batches timed."""
    if baseline not in batches:
        raise UserError(f"--baseline {baseline} is not one of --batches")


def step_time_report(text: str, preset: str, times: dict[int, dict], baseline: int) -> list[str]:
    """--step-time's table: each batch's milliseconds per 4,096 tokens and their ratio to the baseline batch's."""
    require_baseline(list(times), baseline)
    lines = [
        "| text | preset | batch | ms per 4,096 tokens (wall) | / baseline | (CPU) | / baseline |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for batch, median in times.items():
        wall, cpu = median["wall"] / times[baseline]["wall"], median["cpu"] / times[baseline]["cpu"]
        lines.append(
            f"| {text} | {preset} | {batch:,} | {1000 * median['wall']:.1f} | {wall:.4f}x | "
            f"{1000 * median['cpu']:.1f} | {cpu:.4f}x |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = Path(args.work)
    batches = [int(value) for value in args.batches.split(",")]
    if args.step_time:
        require_baseline(batches, args.baseline)  # before minutes of timed steps
        for spec in args.runs.split(","):
            text, preset, _ = run_spec(spec)
            times = step_times(work, text, preset, batches, args.step_time)
            print("\n".join(step_time_report(text, preset, times, args.baseline)), flush=True)
        return 0
    runs = []
    for spec in args.runs.split(","):
        text, preset, tokens = run_spec(spec)
        for batch in batches:
            for seed in (int(value) for value in args.seeds.split(",")):
                run = train(work, text, preset, tokens, batch, seed)
                runs.append(
                    {"text": text, "preset": preset, "tokens": int(tokens), "batch": batch, "seed": seed, **run}
                )
                print(f"{text} {preset} {batch:,} tokens a step, seed {seed}: {run['bpb']:.4f}", flush=True)
    print("\n".join(report(runs, args.baseline)))
    return 0


if __name__ == "__main__":
    run_main(main)
