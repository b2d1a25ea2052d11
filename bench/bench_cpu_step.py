"""A CPU run's steps: train.py's tokens/s before and after its first validation, for the loss's chunk (a card's
128 MiB of logits against a CPU's, hardware.CPU_LOGITS_CHUNK_ELEMENTS) and the allocator (glibc as it comes
against hardware.malloc_options).

    OMP_NUM_THREADS=1 python bench/bench_cpu_step.py --data CORPUS --work W --rounds 2

Each variant is one `train.py --preset nano --threads 1 --target-tokens T --grad-accum 2 --eval-every S/2
--log-every 1 --no-report` process in W (the variants in turns, --rounds times; nothing else should run), the chunk
and the allocator set in the child before train.main (a no-op `keep_freed_memory` for glibc's own). Each row: the
median tokens/s of the steps before the validation (the first two left out) and after it, and their ratios to
the same round's first variant, the defaults before 2026-12-06 (a card's chunk, glibc as it comes).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tinyllm.common import ArgumentParser, UserError, run_main  # noqa: E402
from tinyllm.model import config as model_config  # noqa: E402
from tinyllm.model import hardware  # noqa: E402

CARD_CHUNK = hardware.LOGITS_CHUNK_ELEMENTS
# name -> (the loss's chunk in logits on this CPU, the allocator set by malloc_options); the first is the baseline
VARIANTS = {
    "before": (CARD_CHUNK, False),
    "allocator": (CARD_CHUNK, True),
    "chunk": (hardware.CPU_LOGITS_CHUNK_ELEMENTS, False),
    "both (now)": (hardware.CPU_LOGITS_CHUNK_ELEMENTS, True),
}
CHILD = """import sys
sys.path.insert(0, {root!r})
from tinyllm.model import hardware
from tinyllm.training import train
hardware.CPU_LOGITS_CHUNK_ELEMENTS = {chunk}
if not {allocator}:
    hardware.keep_freed_memory = lambda device_type: False
sys.exit(train.main({argv!r}))
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, help="a corpus folder (data.py's)")
    parser.add_argument("--work", required=True, help="a folder for the runs (RUN-ROUND)")
    parser.add_argument("--preset", default="nano")
    parser.add_argument("--steps", type=int, default=40, help="steps a run; the validation at half of them")
    parser.add_argument("--batch-size", type=int, default=8, help="blocks a micro-step (two a step)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma list of: " + ", ".join(VARIANTS))
    args = parser.parse_args(argv)
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown or args.steps < 8:
        raise UserError(f"--variants: unknown {sorted(unknown)}" if unknown else "--steps: at least 8")
    return args


def train_argv(args: argparse.Namespace, out: Path) -> list[str]:
    context = model_config.PRESETS[args.preset].context
    tokens = args.steps * 2 * args.batch_size * context
    return [
        *("--data", str(args.data), "--out", str(out), "--preset", args.preset, "--threads", "1", "--no-report"),
        *("--batch-size", str(args.batch_size), "--grad-accum", "2", "--target-tokens", str(tokens)),
        *("--eval-every", str(args.steps // 2), "--log-every", "1", "--save-every", "0", "--seed", "1"),
    ]


def speeds(metrics: Path, validated_at: int) -> tuple[float, float]:
    """(median tokens/s of steps 3 .. validated_at, of steps validated_at + 2 .. the last but one)."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    rate = {row["step"]: row["tokens_per_second"] for row in rows if row.get("kind") == "train"}
    last = max(rate)
    before = [rate[step] for step in range(3, validated_at + 1)]
    after = [rate[step] for step in range(validated_at + 2, last)]
    return statistics.median(before), statistics.median(after)


def run_variant(args: argparse.Namespace, name: str, round_: int) -> tuple[float, float]:
    chunk, allocator = VARIANTS[name]
    out = Path(args.work) / f"{name.split()[0]}-{round_}"
    code = CHILD.format(root=str(ROOT), chunk=chunk, allocator=allocator, argv=train_argv(args, out))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    if done.returncode:
        raise UserError(f"train.py failed ({done.returncode}) in {out}: {done.stderr.strip()[-600:]}")
    return speeds(out / "metrics.jsonl", args.steps // 2)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    names = args.variants.split(",")
    Path(args.work).mkdir(parents=True, exist_ok=True)
    print("| variant | round | tokens/s before the validation | after it | before / baseline | after / baseline |")
    print("|---|---:|---:|---:|---:|---:|")
    ratios: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    for round_ in range(1, args.rounds + 1):
        base = None
        for name in names:
            before, after = run_variant(args, name, round_)
            base = base or (before, after)
            ratio = (before / base[0], after / base[1])
            ratios[name].append(ratio)
            row = f"| {name} | {round_} | {before:,.0f} | {after:,.0f} | {ratio[0]:.3f}x | {ratio[1]:.3f}x |"
            print(row, flush=True)
    for name in names:
        print(
            f"{name}: before {statistics.median(r[0] for r in ratios[name]):.3f}x, "
            f"after {statistics.median(r[1] for r in ratios[name]):.3f}x the baseline (median of {args.rounds} rounds)"
        )
    return 0


if __name__ == "__main__":
    run_main(main)
