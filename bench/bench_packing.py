"""Document-aware packing (train.py --packing): held-out bits per byte at equal tokens, and tokens/s.

    python bench/bench_packing.py                                  # short and long documents, every packing
    python bench/bench_packing.py --texts short --steps 100 --only stream,masked

Two real-text corpora, built once with data.py (4,096-token BPE, 5% of the documents held out as the
test split by data.py's own hash rule):
- short: the verses of the King James Bible, one document per verse (~40 tokens), shuffled with a fixed
  seed so that neighbours in the stream are unrelated, as the posts or chats of a real mix are;
- changelog: Debian changelog entries (one document per entry, from /usr/share/doc/*/changelog.Debian.gz,
  ~230 tokens), shuffled alike, at most --short-bytes of text;
- long: the King James Bible, one document per chapter (bench_recipe.py's text, ~850 tokens: several
  contexts long), in the Bible's order.

Every packing of a corpus trains the same model from the same seed on the same number of rows of
C tokens (equal tokens, padding included), in one process with the same thread count, the packings
taking turns every --chunk steps so the machine's load hits them alike. tokens/s = rows x C / training
seconds. Held-out bpb = summed next-token cross-entropy over every test block / (ln 2 x the UTF-8 bytes
of those targets), scored two ways for every model: `alone` (each document on its own, from position 0:
what an HF user calling the exported model on one document gets; the "masked" split of the test set)
and `stream` (blocks of the test stream, earlier unrelated documents in the context).
"""

from __future__ import annotations

import argparse
import math
import random
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402
from bench_texts import changelog_entries, kjv_documents, make_corpus, write_jsonl  # noqa: E402

from tinyllm.common import ArgumentParser, UserError, atomic_write_json, run_main  # noqa: E402
from tinyllm.data import corpus_format  # noqa: E402
from tinyllm.training import (  # noqa: E402
    distributed,
    train,
    train_data,
)

WORK = ROOT / "bench" / "out" / "packing"
CORPORA = ("short", "changelog", "long")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--work", default=str(WORK), help="folder for the corpora and results")
    parser.add_argument("--texts", default="short,long", help=f"comma list of corpora: {', '.join(CORPORA)}")
    parser.add_argument("--only", default=",".join(train_data.PACKINGS), help="comma list of packings")
    parser.add_argument("--preset", default="tiny", help="model preset")
    parser.add_argument("--context", type=int, default=128, help="tokens per row")
    parser.add_argument("--batch-size", type=int, default=16, help="rows per optimizer step")
    parser.add_argument("--steps", type=int, default=150, help="optimizer steps per run (equal tokens for all)")
    parser.add_argument("--chunk", type=int, default=5, help="steps a packing runs before the next takes its turn")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the same for every packing)")
    parser.add_argument("--seed", type=int, default=1337, help="model init and data order (the same for all)")
    parser.add_argument("--short-bytes", type=int, default=4_000_000, help="text of the short corpus")
    parser.add_argument("--results", default=None, help="JSON file for the results (None: WORK/results-*.json)")
    return parser.parse_args(argv)


def build_corpus(name: str, args: argparse.Namespace) -> Path:
    """The corpus `name` (built once and reused while data.py's format stays the same)."""
    work = Path(args.work)
    corpus, source = work / f"corpus-{name}", work / f"{name}.jsonl"
    if corpus_format.is_current_corpus(corpus):
        return corpus
    if corpus.exists():
        shutil.rmtree(corpus)  # built by an older data.py: the bench's own folder, rebuilt
    work.mkdir(parents=True, exist_ok=True)
    if name == "changelog":
        texts = changelog_entries(args.short_bytes)
    elif name == "short":
        texts = [verse for chapter in kjv_documents() for verse in chapter.split("\n")]
        random.Random(0).shuffle(texts)
    else:
        texts = kjv_documents()
    return make_corpus([write_jsonl(source, texts)], corpus)


@torch.no_grad()
def heldout_bpb(training: train.Training, packing: str, batch: int = 16) -> float:
    """Bits per byte of `training`'s model over every block of the test split cut as `packing` says."""
    split = train_data.TokenSplit(training.data.corpus, training.data.manifest, "test", training.context, None, packing)
    nats, text_bytes = 0.0, 0
    training.model.eval()
    for start in range(0, split.blocks, batch):
        rows = split.batch(list(range(start, min(split.blocks, start + batch))), training.device)
        nats += training.loss_of(rows, model=training.model, reduction="sum").item()
        text_bytes += int(training.token_bytes[rows.targets[rows.targets != train_data.IGNORE_INDEX]].sum())
    training.model.train()
    return nats / math.log(2) / text_bytes


def run_corpus(name: str, args: argparse.Namespace) -> dict:
    corpus = build_corpus(name, args)
    info = distributed.DistInfo(rank=0, local_rank=0, world=1, device=torch.device("cpu"))
    tokens = args.steps * args.batch_size * args.context
    runs = {}
    for packing in args.only.split(","):
        argv = [
            "--data",
            str(corpus),
            "--out",
            str(Path(args.work) / "unused"),
            "--preset",
            args.preset,
            "--context",
            str(args.context),
            "--batch-size",
            str(args.batch_size),
            "--grad-accum",
            "1",
            "--target-tokens",
            str(tokens),
            "--seed",
            str(args.seed),
            "--threads",
            str(args.threads),
            "--packing",
            packing,
        ]
        runs[packing] = {"training": train.build_training(train.parse_args(argv), info), "seconds": 0.0}
    while any(run["training"].step < args.steps for run in runs.values()):
        for run in runs.values():
            training = run["training"]
            for _ in range(min(args.chunk, args.steps - training.step)):
                started = time.perf_counter()
                training.train_step()
                run["seconds"] += time.perf_counter() - started
    results = {}
    for packing, run in runs.items():
        training = run["training"]
        results[packing] = {
            "seconds": run["seconds"],
            "tokens_per_second": tokens / run["seconds"],
            "rows": training.data.splits["train"].blocks,
            "bpb_alone": heldout_bpb(training, "masked"),
            "bpb_stream": heldout_bpb(training, "stream"),
        }
        print(
            f"  {name} {packing}: bpb alone {results[packing]['bpb_alone']:.4f}, stream "
            f"{results[packing]['bpb_stream']:.4f}, {results[packing]['tokens_per_second']:,.0f} tokens/s, "
            f"{results[packing]['rows']} train rows",
            flush=True,
        )
    return {"tokens": tokens, "packings": results}


def table(name: str, result: dict) -> list[str]:
    """The markdown table of one corpus, ratios against `stream` measured in the same run."""
    packings = result["packings"]
    base = packings.get("stream")
    lines = [
        f"{name} ({result['tokens']:,} tokens per run)",
        "",
        "| packing | held-out bpb, alone | vs stream | bpb, stream eval | tokens/s | vs stream | train rows |",
        "|---|---|---|---|---|---|---|",
    ]
    for packing, row in packings.items():
        bpb_ratio = f"{row['bpb_alone'] / base['bpb_alone']:.3f}" if base else "-"
        speed_ratio = f"{row['tokens_per_second'] / base['tokens_per_second']:.3f}" if base else "-"
        lines.append(
            f"| {packing} | {row['bpb_alone']:.4f} | {bpb_ratio} | {row['bpb_stream']:.4f} | "
            f"{row['tokens_per_second']:,.0f} | {speed_ratio} | {row['rows']:,} |"
        )
    return lines + [""]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    results = {"settings": vars(args), "corpora": {}}
    for name in args.texts.split(","):
        if name not in CORPORA:
            raise UserError(f"--texts {name}: choose from {', '.join(CORPORA)}")
        print(f"{name} documents:", flush=True)
        results["corpora"][name] = run_corpus(name, args)
    path = Path(args.results or Path(args.work) / f"results-{args.texts.replace(',', '-')}.json")
    atomic_write_json(path, results)
    for name, result in results["corpora"].items():
        print("\n".join(table(name, result)))
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    run_main(main)
