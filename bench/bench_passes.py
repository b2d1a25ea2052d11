"""Held-out bits per byte against the passes over a corpus' train split (issue 49): where budget.max_passes is read
off.

    OMP_NUM_THREADS=1 python bench/bench_passes.py --corpus CORPUS --presets tiny,nano --passes 1,2,4 --seeds 1337
    python bench/bench_passes.py --corpus CORPUS --report-only

Each (preset, passes, seed) trains train.py's recipe in-process at one torch thread for that many passes over the
train split (whole steps of --budget's batch rule, budget.global_blocks), as bench_budget.py trains its sweep; the
score is held-out bits per byte over every block of the test split. A run's result is appended to
CORPUS-passes.jsonl beside the corpus (kept across calls; a run already there is not trained again), and the table
prints each preset's runs against its best number of passes and the number budget.max_passes allows.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402
from bench_budget import train_point  # noqa: E402

from tinyllm.common import ArgumentParser, run_main  # noqa: E402
from tinyllm.data import corpus_format  # noqa: E402
from tinyllm.model import config as model_config  # noqa: E402
from tinyllm.training import budget  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", required=True, help="a corpus folder data.py built")
    parser.add_argument("--presets", default="tiny,nano", help="comma list of presets")
    parser.add_argument("--passes", default="1,2,4", help="comma list of passes over the train split")
    parser.add_argument("--seeds", default="1337", help="comma list of seeds (model init and data order)")
    parser.add_argument("--report-only", action="store_true", help="no training: the table from the saved runs")
    return parser.parse_args(argv)


def run_tokens(passes: float, preset: str, train_tokens: int) -> tuple[int, int]:
    """(tokens, global batch blocks): whole steps of --budget's batch rule nearest `passes` over the split."""
    context = model_config.PRESETS[preset].context
    steps, blocks = budget.whole_steps(passes * train_tokens, context, 1, round)
    return steps * blocks * context, blocks


def report(runs: list[dict], allowed: int) -> list[str]:
    lines = [
        "| preset | passes | tokens | steps | bpb per seed | mean | / the preset's best |",
        "|---|---:|---:|---:|---|---:|---:|",
    ]
    for preset in dict.fromkeys(run["preset"] for run in runs):
        by_passes: dict[float, list[dict]] = {}
        for run in (run for run in runs if run["preset"] == preset):
            by_passes.setdefault(run["passes"], []).append(run)
        means = {passes: sum(r["bpb"] for r in group) / len(group) for passes, group in by_passes.items()}
        best = min(means.values())
        for passes in sorted(by_passes):
            group = sorted(by_passes[passes], key=lambda run: run["seed"])
            seeds = ", ".join(f"{run['bpb']:.4f} ({run['seed']})" for run in group)
            mark = " (max_passes)" if passes == allowed else ""
            lines.append(
                f"| {preset} | {passes:g}{mark} | {group[0]['tokens']:,} | {group[0]['steps']} | {seeds} | "
                f"{means[passes]:.4f} | {means[passes] / best:.4f} |"
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    corpus = Path(args.corpus)
    manifest = corpus_format.load_manifest(corpus)
    train_tokens = manifest.split("train")["tokens"]
    saved = corpus.with_name(corpus.name + "-passes.jsonl")
    runs = [json.loads(line) for line in saved.read_text().splitlines()] if saved.exists() else []
    done = {(run["preset"], run["passes"], run["seed"]) for run in runs}
    torch.set_num_threads(1)
    for preset in [] if args.report_only else args.presets.split(","):
        for passes in (float(text) for text in args.passes.split(",")):
            for seed in (int(text) for text in args.seeds.split(",")):
                if (preset, passes, seed) in done:
                    continue
                tokens, blocks = run_tokens(passes, preset, train_tokens)
                point = {"preset": preset, "tokens": tokens, "blocks": blocks}
                run = {**train_point(corpus, corpus.parent / "unused", seed, point), "passes": passes, "seed": seed}
                print(f"{preset} {passes:g} passes ({tokens:,} tokens), seed {seed}: {run['bpb']:.4f}", flush=True)
                with saved.open("a") as file:
                    file.write(json.dumps(run) + "\n")
                runs.append(run)
    allowed = budget.max_passes(train_tokens, manifest.vocab_size)
    per_entry = train_tokens / manifest.vocab_size
    print(
        f"\n{corpus}: {train_tokens:,} train tokens, vocabulary {manifest.vocab_size:,} ({per_entry:.0f} tokens an "
        f"entry): budget.max_passes {allowed}\n"
    )
    print("\n".join(report(runs, allowed)) if runs else "no runs yet")
    return 0 if runs or not args.report_only else 1


if __name__ == "__main__":
    run_main(main)
