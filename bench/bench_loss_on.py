"""Tokens to held-out accuracy with `--loss-on assistant` vs `--loss-on all` on the demo corpus.

    python bench/bench_loss_on.py                          # builds the demo corpus in bench/out/loss_on
    python bench/bench_loss_on.py --corpus corpus/demo --steps 250 --seeds 1337,1338,1339,1340,1341,1342
    python bench/bench_loss_on.py --corpus corpus/demo --init-from runs/text   # stage 2 of docs/stages.md

Trains the demo's model (the tiny preset, 32 blocks of 128 tokens per step, the default recipe)
once per mode and seed, in this process, for the same number of steps (the same schedule), and
every --eval-every steps measures the held-out accuracy (greedy, exact match: evaluation.exact_match_accuracy
on the first --limit problems of the demo's eval file, which are additions). Prints, per run, the
accuracy curve; then per mode the training tokens (all tokens fed, counted by the loss or not) each
seed took to first reach each threshold, seed by seed whether `assistant` got there first, and the
seeds' mean accuracy curves. One run's climb to accuracy moves by 200,000 tokens or more from seed
to seed (bench/RESULTS.md): compare modes over several seeds. Under `assistant` the plain-text documents count as
--text-loss says (none: they teach nothing the eval asks). Every other option (--init-from,
--train-args) applies to both modes alike.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from tinyllm.common import ArgumentParser, atomic_write_json, run_main  # noqa: E402
from tinyllm.data import build as data  # noqa: E402
from tinyllm.data import (  # noqa: E402
    corpus_format,
    demo_corpus,
)
from tinyllm.outputs import evaluation  # noqa: E402
from tinyllm.store import checkpoint_store as store  # noqa: E402
from tinyllm.training import (  # noqa: E402
    distributed,
    train,
)

MODES = ("all", "assistant")


def mode_options(mode: str, text_loss: str) -> list[str]:
    return [] if mode == "all" else ["--loss-on", "assistant", "--text-loss", text_loss]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--work", default=str(ROOT / "bench" / "out" / "loss_on"), help="folder for the corpus")
    parser.add_argument("--corpus", default=None, help="a built demo corpus (default: build one in --work)")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per mode (4,096 tokens each)")
    parser.add_argument("--eval-every", type=int, default=25, help="measure the held-out accuracy every N steps")
    parser.add_argument("--limit", type=int, default=100, help="held-out problems per measurement")
    parser.add_argument("--thresholds", default="0.1,0.25,0.5,0.75,0.9,1.0", help="accuracies to report tokens for")
    parser.add_argument(
        "--seeds", default="1337,1338,1339,1340", help="train.py --seed values, one run per mode and seed"
    )
    parser.add_argument(
        "--text-loss",
        default="none",
        choices=("none", "full"),
        help="the plain-text documents under --loss-on assistant",
    )
    parser.add_argument("--init-from", default=None, help="both modes start from these weights (train.py --init-from)")
    parser.add_argument("--train-args", default="", help="more train.py options for both modes, e.g. '--muon-lr 0.01'")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--json", default=None, help="also write the figures to this JSON file")
    return parser.parse_args(argv)


def run_mode(corpus: Path, mode: str, seed: int, args: argparse.Namespace) -> list[dict]:
    """[{step, tokens, accuracy, seconds}] every --eval-every steps of one run."""
    options = [
        "--data",
        str(corpus),
        "--out",
        str(Path(args.work) / f"run-{mode}-{seed}"),
        "--preset",
        "tiny",
        "--batch-size",
        "32",
        "--grad-accum",
        "1",
        "--target-tokens",
        str(args.steps * 32 * 128),
        "--threads",
        str(args.threads),
        "--eval-tokens",
        str(32 * 128),
        "--seed",
        str(seed),
        *(["--init-from", args.init_from] if args.init_from else []),
        *shlex.split(args.train_args),
        *mode_options(mode, args.text_loss),
    ]
    training = train.build_training(
        train.parse_args(options), distributed.DistInfo(rank=0, local_rank=0, world=1, device=torch.device("cpu"))
    )
    if args.init_from:  # what train.train does for a new run (build_training leaves it out)
        train.start_from(training, store.read_init_source(args.init_from))
    tokenizer = corpus_format.load_tokenizer(corpus)
    curve, started = [], time.perf_counter()
    while training.step < training.total_steps:
        training.train_step()
        if training.step % args.eval_every == 0 or training.step == training.total_steps:
            training.model.eval()
            accuracy = evaluation.exact_match_accuracy(
                training.model, tokenizer, corpus / demo_corpus.DEMO_EVAL_FILE, limit=args.limit
            )["accuracy"]
            training.model.train()
            point = {
                "step": training.step,
                "tokens": training.step * training.tokens_per_step,
                "accuracy": accuracy,
                "seconds": round(time.perf_counter() - started, 1),
            }
            curve.append(point)
            print(
                f"{mode:>9} seed {seed} step {point['step']:5d}  tokens {point['tokens']:>10,}  "
                f"accuracy {accuracy:6.1%}  ({point['seconds']:.0f} s)",
                flush=True,
            )
    return curve


def tokens_to(curve: list[dict], threshold: float) -> int | None:
    """The training tokens at the first measurement with accuracy >= threshold (None: never)."""
    return next((point["tokens"] for point in curve if point["accuracy"] >= threshold), None)


def tokens_cell(curves: list[list[dict]], threshold: float) -> str:
    """One mode's table cell: each seed's tokens to the threshold, and their median when all reached it."""
    reached = [tokens_to(curve, threshold) for curve in curves]
    cell = " / ".join("not reached" if tokens is None else f"{tokens:,}" for tokens in reached)
    if len(reached) > 1 and None not in reached:
        cell += f" (median {statistics.median(reached):,.0f})"
    return cell


def mean_curve(curves: list[list[dict]]) -> list[dict]:
    """The seeds' mean accuracy at each measurement (every curve measured at the same tokens)."""
    return [
        {"tokens": points[0]["tokens"], "accuracy": statistics.fmean(point["accuracy"] for point in points)}
        for points in zip(*curves)
    ]


def paired(all_curves: list[list[dict]], assistant_curves: list[list[dict]], threshold: float) -> dict:
    """Per seed, whether `assistant` reached the threshold in fewer, the same or more tokens than `all`
    (a run that never reached it counts as the longest)."""
    counts = {"fewer": 0, "same": 0, "more": 0}
    for all_curve, assistant_curve in zip(all_curves, assistant_curves, strict=True):
        first, second = (tokens_to(curve, threshold) for curve in (all_curve, assistant_curve))
        first, second = (math.inf if tokens is None else tokens for tokens in (first, second))
        counts["fewer" if second < first else "same" if second == first else "more"] += 1
    return counts


def print_tables(curves: dict[str, list[list[dict]]], thresholds: list[float]) -> None:
    """Markdown tables: tokens to each threshold per seed, their pairing, and the mean accuracy curves."""
    means = {mode: mean_curve(curves[mode]) for mode in MODES}
    print("| accuracy | --loss-on all | --loss-on assistant | assistant fewer / same / more tokens | mean curves |")
    print("|---|---|---|---|---|")
    for threshold in thresholds:
        pairs = paired(curves["all"], curves["assistant"], threshold)
        on_means = " / ".join(
            "not reached" if tokens is None else f"{tokens:,}"
            for tokens in (tokens_to(means[mode], threshold) for mode in MODES)
        )
        print(
            f"| {threshold:.0%} | {tokens_cell(curves['all'], threshold)} | "
            f"{tokens_cell(curves['assistant'], threshold)} | {pairs['fewer']} / {pairs['same']} / {pairs['more']} "
            f"| {on_means} |"
        )
    print("\n| tokens | mean accuracy, --loss-on all | mean accuracy, --loss-on assistant |\n|---|---|---|")
    for first, second in zip(means["all"], means["assistant"]):
        print(f"| {first['tokens']:,} | {first['accuracy']:.1%} | {second['accuracy']:.1%} |")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = Path(args.work)
    corpus = Path(args.corpus) if args.corpus else work / "corpus"
    if not args.corpus:
        data.build_demo_corpus(corpus, overwrite=True, progress=False)
    torch.set_num_threads(args.threads)
    seeds = [int(seed) for seed in args.seeds.split(",")]
    curves = {mode: [run_mode(corpus, mode, seed, args) for seed in seeds] for mode in MODES}
    thresholds = [float(value) for value in args.thresholds.split(",")]
    print(
        f"\ntokens to held-out accuracy (first {args.limit} eval problems, measured every {args.eval_every} steps"
        f" of {args.steps}; seeds {', '.join(map(str, seeds))}; assistant: --text-loss {args.text_loss}):"
    )
    print_tables(curves, thresholds)
    if args.json:
        atomic_write_json(Path(args.json), {"settings": vars(args), "curves": curves})
    print(
        json.dumps(
            {
                f"{mode} {seed}": [(p["tokens"], round(p["accuracy"], 3)) for p in curve]
                for mode in MODES
                for seed, curve in zip(seeds, curves[mode])
            }
        )
    )
    return 0


if __name__ == "__main__":
    run_main(main)
