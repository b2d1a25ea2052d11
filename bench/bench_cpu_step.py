"""A CPU run's steps: train.py's tokens/s before and after its first validation, for the loss's chunk (a card's
128 MiB of logits against a CPU's, hardware.CPU_LOGITS_CHUNK_ELEMENTS) and the allocator (glibc as it comes
against hardware.malloc_options).

    OMP_NUM_THREADS=1 python bench/bench_cpu_step.py --data CORPUS --work W --rounds 2
    OMP_NUM_THREADS=1 python bench/bench_cpu_step.py --heads 8192x128:2048,33069x512:4096 --chunks 256,1024,2048


Each variant is one `train.py --preset nano --threads 1 --target-tokens T --grad-accum 2 --eval-every S/2
--log-every 1 --no-report` process in W (the variants in turns, --rounds times; nothing else should run), the chunk
and the allocator set in the child before train.main (a no-op `keep_freed_memory` for glibc's own). Each row: the
median tokens/s of the steps before the validation (the first two left out) and after it, and their ratios to
the same round's first variant, the defaults before 2026-12-06 (a card's chunk, glibc as it comes).

With --heads, the loss alone instead (losses.ChunkedLinearCrossEntropy, forward and backward, one thread, bf16, random
weights, the allocator kept): for each LM head VOCABxHIDDEN:TOKENS, the median seconds of --repeats calls after one
at each of --chunks tokens a chunk, and the chunk hardware.logits_chunk_tokens gives a CPU.
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tinyllm.common import ArgumentParser, UserError, run_main  # noqa: E402
from tinyllm.model import config as model_config  # noqa: E402
from tinyllm.model import hardware, losses  # noqa: E402

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
from tinyllm.common import run_main
from tinyllm.model import hardware
from tinyllm.training import train
hardware.CPU_LOGITS_CHUNK_ELEMENTS = {chunk}
if not {allocator}:
    hardware.keep_freed_memory = lambda device_type: False
run_main(lambda: train.main({argv!r}), script=True)
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", help="a corpus folder (data.py's)")
    parser.add_argument("--work", help="a folder for the runs (RUN-ROUND)")
    parser.add_argument("--heads", help="comma list of VOCABxHIDDEN:TOKENS: time the loss alone at these heads")
    parser.add_argument("--chunks", default="128,256,512,1024,2048", help="comma list of chunk tokens (--heads)")
    parser.add_argument("--repeats", type=int, default=4, help="timed calls a chunk (--heads)")
    parser.add_argument("--preset", default="nano")
    parser.add_argument("--steps", type=int, default=40, help="steps a run; the validation at half of them")
    parser.add_argument("--batch-size", type=int, default=8, help="blocks a micro-step (two a step)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma list of: " + ", ".join(VARIANTS))
    args = parser.parse_args(argv)
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown or args.steps < 8:
        raise UserError(f"--variants: unknown {sorted(unknown)}" if unknown else "--steps: at least 8")
    if not args.heads and not (args.data and args.work):
        raise UserError("give --data and --work (train.py's steps), or --heads (the loss alone)")
    args.heads = [head_spec(spec) for spec in args.heads.split(",")] if args.heads else None
    return args


def head_spec(spec: str) -> tuple[int, int, int]:
    """(vocab, hidden, tokens) of one --heads item, VOCABxHIDDEN:TOKENS."""
    try:
        shape, tokens = spec.split(":")
        vocab, hidden = shape.split("x")
        return int(vocab), int(hidden), int(tokens)
    except ValueError:
        raise UserError(f"--heads: {spec!r} is not VOCABxHIDDEN:TOKENS (e.g. 8192x128:2048)") from None


def loss_seconds(vocab: int, hidden: int, tokens: int, chunk: int, repeats: int) -> float:
    """The median seconds of the chunked loss's forward and backward over `tokens` tokens, `chunk` at a time."""
    import torch

    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(vocab, hidden, generator=generator) * 0.02).requires_grad_()
    hidden_states = torch.randn(tokens, hidden, generator=generator).to(torch.bfloat16)
    targets = torch.randint(0, vocab, (tokens,), generator=generator)
    times = []
    for _ in range(repeats + 1):
        states = hidden_states.clone().requires_grad_()
        started = time.perf_counter()
        losses.ChunkedLinearCrossEntropy.apply(states, weight, targets, chunk, torch.bfloat16, 0.0).backward()
        times.append(time.perf_counter() - started)
        weight.grad = None
    return statistics.median(times[1:])


def time_heads(args: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(1)
    hardware.keep_freed_memory("cpu")
    print("| head (vocab x hidden) | tokens | chunk | ms | the CPU's chunk |\n|---|---:|---:|---:|---:|")
    for vocab, hidden, tokens in args.heads:
        rule = min(tokens, hardware.logits_chunk_tokens(vocab, "cpu", hidden))
        for chunk in sorted({int(c) for c in args.chunks.split(",")} | {rule}):
            ms = 1000 * loss_seconds(vocab, hidden, tokens, chunk, args.repeats)
            print(
                f"| {vocab:,} x {hidden} | {tokens:,} | {chunk:,} | {ms:.1f} | {'yes' if chunk == rule else ''} |",
                flush=True,
            )
    return 0


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
    if args.heads:
        return time_heads(args)
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
