"""Tokens to held-out accuracy with `--loss-on assistant` vs `--loss-on all` on the demo corpus.

    python bench/bench_loss_on.py                          # builds the demo corpus in bench/out/loss_on
    python bench/bench_loss_on.py --corpus corpus/demo --steps 400 --eval-every 50 --limit 100

Trains the demo's model (the tiny preset, 32 blocks of 128 tokens per step, the default recipe)
once per mode, in this process, for the same number of steps (the same schedule), and every
--eval-every steps measures the held-out accuracy (greedy, exact match: report.task_accuracy on the
first --limit problems of the demo's eval file, which are additions). Prints, per mode, the
accuracy curve and the training tokens it took to first reach each threshold. Plain-text
documents do not count under `assistant` (--text-loss none): they teach nothing the eval asks.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import data  # noqa: E402
import report  # noqa: E402
import train  # noqa: E402
from common import ArgumentParser, atomic_write_json, run_main  # noqa: E402

MODES = {"all": [], "assistant": ["--loss-on", "assistant", "--text-loss", "none"]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0],
                            formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--work", default=str(ROOT / "bench" / "out" / "loss_on"), help="folder for the corpus")
    parser.add_argument("--corpus", default=None, help="a built demo corpus (default: build one in --work)")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per mode (4,096 tokens each)")
    parser.add_argument("--eval-every", type=int, default=50, help="measure the held-out accuracy every N steps")
    parser.add_argument("--limit", type=int, default=100, help="held-out problems per measurement")
    parser.add_argument("--thresholds", default="0.1,0.25,0.5,0.75,0.9", help="accuracies to report tokens for")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--json", default=None, help="also write the figures to this JSON file")
    return parser.parse_args(argv)


def run_mode(corpus: Path, mode: str, args: argparse.Namespace) -> list[dict]:
    """[{step, tokens, accuracy, val_loss}] every --eval-every steps of one run."""
    options = ["--data", str(corpus), "--out", str(Path(args.work) / f"run-{mode}"), "--preset", "tiny",
               "--batch-size", "32", "--grad-accum", "1", "--target-tokens", str(args.steps * 32 * 128),
               "--threads", str(args.threads), "--eval-batches", "1", *MODES[mode]]
    training = train.build_training(train.parse_args(options),
                                    train.DistInfo(rank=0, local_rank=0, world=1, device=torch.device("cpu")))
    tokenizer = data.load_tokenizer(corpus / data.TOKENIZER_DIR)
    curve, started = [], time.perf_counter()
    while training.step < training.total_steps:
        training.train_step()
        if training.step % args.eval_every == 0 or training.step == training.total_steps:
            training.model.eval()
            accuracy = report.task_accuracy(training.model, tokenizer, corpus / data.DEMO_EVAL_FILE,
                                            limit=args.limit)["accuracy"]
            training.model.train()
            point = {"step": training.step, "tokens": training.step * training.tokens_per_step,
                     "accuracy": accuracy, "seconds": round(time.perf_counter() - started, 1)}
            curve.append(point)
            print(f"{mode:>9} step {point['step']:5d}  tokens {point['tokens']:>10,}  accuracy {accuracy:6.1%}  "
                  f"({point['seconds']:.0f} s)", flush=True)
    return curve


def tokens_to(curve: list[dict], threshold: float) -> int | None:
    return next((point["tokens"] for point in curve if point["accuracy"] >= threshold), None)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = Path(args.work)
    corpus = Path(args.corpus) if args.corpus else work / "corpus"
    if not args.corpus:
        data.build_demo_corpus(corpus, overwrite=True, progress=False)
    torch.set_num_threads(args.threads)
    curves = {mode: run_mode(corpus, mode, args) for mode in MODES}
    thresholds = [float(value) for value in args.thresholds.split(",")]
    print(f"\ntokens to held-out accuracy (first {args.limit} eval problems, measured every {args.eval_every} steps"
          f" of {args.steps}):")
    print("| accuracy | " + " | ".join(f"--loss-on {mode}" for mode in MODES) + " |")
    print("|---|" + "---|" * len(MODES))
    for threshold in thresholds:
        cells = [tokens_to(curves[mode], threshold) for mode in MODES]
        print(f"| {threshold:.0%} | " + " | ".join("not reached" if c is None else f"{c:,}" for c in cells) + " |")
    if args.json:
        atomic_write_json(Path(args.json), {"settings": vars(args), "curves": curves})
    print(json.dumps({mode: [(p["tokens"], round(p["accuracy"], 3)) for p in curve] for mode, curve in
                      curves.items()}))
    return 0


if __name__ == "__main__":
    run_main(main)
