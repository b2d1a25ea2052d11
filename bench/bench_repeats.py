"""What a repeated token is worth (issue 49): a preset trains the same number of tokens over the whole train split
once, over half of it twice, over a quarter four times, on one held-out set; Muennighoff et al.'s (2023) discount
of repeats fitted to the differences.

    OMP_NUM_THREADS=1 python bench/bench_repeats.py --work W --text changelog --presets tiny,nano --seeds 1337
    python bench/bench_repeats.py --work W --text changelog --report-only

The text (bench_texts.py, --text-bytes of it) is built once with data.py at --vocab-size; each share of its train
documents (drawn at random, by bytes) is built again with that corpus' tokenizer and every held-out document,
so each corpus holds the same validation and test documents (checked: the same test tokens) and a train split of
1, 1/2, 1/4 of the full one. Each (preset, share, seed) trains train.py's recipe in-process at one thread for the
full split's one pass of tokens (whole steps of --budget's batch rule: the same steps and batch at every share),
scored in held-out bits per byte over the whole test split. Runs are appended to W/TEXT-repeats.jsonl (a rerun
skips those done); the table and the fit take every text's runs in W. The fit: D tokens over U unique are worth
U (1 + R (1 - exp(-(D / U - 1) / R))) new ones (Muennighoff's form; R: how many passes' worth repeating a split
can add at most), R chosen so that LOSS_MODEL at the effective tokens predicts best each 2-pass run's difference
from the full split's run of its text, preset and seed.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402
from bench_budget import train_point  # noqa: E402
from bench_passes import run_tokens  # noqa: E402
from bench_texts import SPLITS, make_corpus, text_documents, write_jsonl  # noqa: E402

from tinyllm.common import ArgumentParser, UserError, run_main  # noqa: E402
from tinyllm.data import build as data  # noqa: E402
from tinyllm.data import corpus_format  # noqa: E402
from tinyllm.training import budget  # noqa: E402

VAL_FRACTION, TEST_FRACTION = float(SPLITS[1]), float(SPLITS[3])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", required=True, help="corpora and runs")
    parser.add_argument("--text", default="changelog", help="a bench_texts.py text (the one trained)")
    parser.add_argument("--text-bytes", type=int, default=3_000_000, help="bytes of the text")
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--shares", default="1,2,4", help="comma list: train on 1/k of the split, k passes")
    parser.add_argument("--presets", default="tiny,nano", help="comma list of presets")
    parser.add_argument("--seeds", default="1337", help="comma list of seeds")
    parser.add_argument("--report-only", action="store_true", help="no training: the table and fit of saved runs")
    return parser.parse_args(argv)


def held_out(text: str) -> bool:
    """Whether data.py puts this document in validation or test (its hash rule, the benches' fractions)."""
    return data.split_of(data.document_hash(text)[1], VAL_FRACTION, TEST_FRACTION) != "train"


def share_documents(documents: list[str], share: int) -> list[str]:
    """Every held-out document and 1/`share` of the train documents' bytes, drawn at random (seed 0: a text in
    order, as KJV's books, would leave the held-out chapters of its later books out of a share's domain)."""
    documents = list(dict.fromkeys(documents))  # data.py keeps one of each duplicate
    train = [text for text in documents if not held_out(text)]
    random.Random(0).shuffle(train)
    limit, taken, kept = sum(map(len, train)) / share, 0, set()
    for text in train:
        if taken + len(text) / 2 > limit:
            break
        kept.add(text)
        taken += len(text)
    return [text for text in documents if held_out(text) or text in kept]


def build_corpora(args: argparse.Namespace, work: Path, shares: list[int]) -> dict[int, Path]:
    """{share: corpus}: the full text at --vocab-size, each share with its tokenizer (built once, kept)."""
    documents = text_documents(args.text, args.text_bytes)
    corpora = {}
    for share in sorted(shares):
        corpus = work / f"corpus-{args.text}-{share}"
        if not corpus_format.is_current_corpus(corpus):
            source = write_jsonl(work / f"{args.text}-{share}.jsonl", share_documents(documents, share))
            tokenizer = [] if share == 1 else ["--tokenizer", str(corpora[1])]
            make_corpus([source], corpus, "--overwrite", *tokenizer, vocab_size=args.vocab_size)
        corpora[share] = corpus
    test = {share: corpus_format.load_manifest(corpus).split("test")["tokens"] for share, corpus in corpora.items()}
    if len(set(test.values())) != 1:
        raise UserError(f"the shares' test splits differ: {test} tokens")
    return corpora


def effective_tokens(tokens: float, unique: float, repeat_passes: float) -> float:
    """Muennighoff et al.'s effective data: D tokens over U unique are worth U (1 + R (1 - e^-((D/U - 1)/R)))."""
    if tokens <= unique:
        return tokens
    if repeat_passes <= 0:
        return unique
    return unique * (1 + repeat_passes * (1 - math.exp(-(tokens / unique - 1) / repeat_passes)))


def differences(runs: list[dict]) -> list[dict]:
    """Each repeated run against the full split's run of its text, preset and seed: the measured difference."""
    full = {(run["text"], run["preset"], run["seed"]): run for run in runs if run["share"] == 1}
    pairs = []
    for run in runs:
        base = full.get((run["text"], run["preset"], run["seed"]))
        if run["share"] > 1 and base is not None:
            pairs.append({**run, "measured": run["bpb"] - base["bpb"]})
    return pairs


def predicted(pair: dict, repeat_passes: float) -> float:
    model = budget.LOSS_MODEL
    effective = effective_tokens(pair["tokens"], pair["train_tokens"], repeat_passes)
    return model.loss(pair["parameters"], effective) - model.loss(pair["parameters"], pair["tokens"])


def fit_repeats(pairs: list[dict]) -> tuple[float, float]:
    """(R, rms error in bits/byte) of the discount that predicts the measured differences best (a log grid),
    over the runs a plan may make on these splits: at most budget.SMALL_CORPUS_EPOCHS passes (every share here
    holds fewer than budget.TOKENS_PER_VOCAB_ENTRY tokens an entry; past that, a pass overfits, which no
    discount of this form can say: it only ever adds)."""
    pairs = [pair for pair in pairs if pair["share"] <= budget.SMALL_CORPUS_EPOCHS]
    grid = [10 ** (exponent / 100) for exponent in range(-200, 301)]

    def rms(repeat_passes: float) -> float:
        return math.sqrt(sum((predicted(p, repeat_passes) - p["measured"]) ** 2 for p in pairs) / len(pairs))

    best = min(grid, key=rms)
    return best, rms(best)


def report(runs: list[dict]) -> list[str]:
    lines = [
        "| text | preset | share | train tokens | tokens (passes) | bpb per seed | mean | - full split's |",
        "|---|---|---:|---:|---:|---|---:|---:|",
    ]
    pairs = differences(runs)
    for text, preset, share in dict.fromkeys((run["text"], run["preset"], run["share"]) for run in runs):
        group = [run for run in runs if (run["text"], run["preset"], run["share"]) == (text, preset, share)]
        group.sort(key=lambda run: run["seed"])
        seeds = ", ".join(f"{run['bpb']:.4f} ({run['seed']})" for run in group)
        mean = sum(run["bpb"] for run in group) / len(group)
        measured = [p["measured"] for p in pairs if (p["text"], p["preset"], p["share"]) == (text, preset, share)]
        delta = f"{sum(measured) / len(measured):+.4f}" if measured else ""
        lines.append(
            f"| {text} | {preset} | 1/{share} | {group[0]['train_tokens']:,} | {group[0]['tokens']:,} "
            f"({group[0]['tokens'] / group[0]['train_tokens']:.2f}) | {seeds} | {mean:.4f} | {delta} |"
        )
    if pairs:
        repeat_passes, error = fit_repeats(pairs)
        fitted = sum(pair["share"] <= budget.SMALL_CORPUS_EPOCHS for pair in pairs)
        lines += [
            "",
            f"fit: R = {repeat_passes:.3g}, rms {error:.4f} bits/byte over the {fitted} differences at 2 passes",
            "",
            f"| text | preset | share | seed | measured | R = {repeat_passes:.3g} | R = 15.4 (Muennighoff) |",
            "|---|---|---:|---:|---:|---:|---:|",
        ]
        for pair in pairs:
            lines.append(
                f"| {pair['text']} | {pair['preset']} | 1/{pair['share']} | {pair['seed']} | {pair['measured']:+.4f} | "
                f"{predicted(pair, repeat_passes):+.4f} | {predicted(pair, 15.4):+.4f} |"
            )
    return lines


def train_missing(args: argparse.Namespace, work: Path, runs: list[dict]) -> None:
    """Train every (seed, preset, share) of --text not yet in `runs`, each appended to W/TEXT-repeats.jsonl."""
    shares = sorted({1, *(int(text) for text in args.shares.split(","))})
    corpora = build_corpora(args, work, shares)
    full_tokens = corpus_format.load_manifest(corpora[1]).split("train")["tokens"]
    done = {(run["preset"], run["share"], run["seed"]) for run in runs if run["text"] == args.text}
    torch.set_num_threads(1)
    for seed, preset, share in itertools.product(
        (int(text) for text in args.seeds.split(",")), args.presets.split(","), shares
    ):
        if (preset, share, seed) in done:
            continue
        tokens, blocks = run_tokens(1.0, preset, full_tokens)
        point = {"preset": preset, "tokens": tokens, "blocks": blocks}
        train_tokens = corpus_format.load_manifest(corpora[share]).split("train")["tokens"]
        run = {
            **train_point(corpora[share], work / "unused", seed, point),
            **{"share": share, "seed": seed, "train_tokens": train_tokens, "text": args.text},
        }
        print(f"{preset} 1/{share} ({tokens:,} tokens), seed {seed}: {run['bpb']:.4f}", flush=True)
        with (work / f"{args.text}-repeats.jsonl").open("a") as file:
            file.write(json.dumps(run) + "\n")
        runs.append(run)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    runs = [json.loads(line) for path in sorted(work.glob("*-repeats.jsonl")) for line in path.read_text().splitlines()]
    if not args.report_only:
        train_missing(args, work, runs)
    print("\n".join(report(runs)) if runs else "no runs yet")
    return 0 if runs or not args.report_only else 1


if __name__ == "__main__":
    run_main(main)
