"""Weighted mixtures on real text: how the weights and a decay-phase mix move each source's held-out loss.

    python bench/bench_mixture.py                              # tiny, 120 steps of 2,048 tokens per mix
    python bench/bench_mixture.py --steps 300 --tech-bytes 400000 --json bench/out/mixture/results.json

Two real sources, one tokenizer: prose (the King James Bible, Debian's bible-kjv, one document per
chapter, as bench/bench_recipe.py) and technical documentation (the docstrings of Python's own
standard library, one document per module, class or function, capped at --tech-bytes). data.py
builds a 4,096-token BPE on both together, then each source's corpus with that tokenizer
(`--tokenizer`), 5% of the documents held out as the test split. Every mix trains the same model
from the same seed for the same steps (train.py's default recipe, wsd), in this process; the score
is each source's held-out bits per byte over every block of its test split, and the tokens each
source gave (the sampler's counters, against the mix's weights).

The mixes: `natural` weights the sources by their training tokens (what merging them into one
corpus reads); `balanced` is 0.5/0.5 (the small technical source upweighted); `prose` is 0.9/0.1
throughout; `anneal` is the same 0.9/0.1 until wsd's decay, then 0.3/0.7 (`--mixture-schedule
decay:prose=0.3,tech=0.7`). Expected: upweighting a source lowers its held-out loss and raises the
other's, and the decay-phase mix moves them the same way from the `prose` run's.
"""

from __future__ import annotations

import argparse
import inspect
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import bench_texts  # noqa: E402
import torch  # noqa: E402
from bench_texts import make_corpus, write_jsonl  # noqa: E402

from tinyllm.common import ArgumentParser, atomic_write_json, run_main  # noqa: E402
from tinyllm.data import corpus_format  # noqa: E402
from tinyllm.training import (  # noqa: E402
    distributed,
    train,
)

SOURCES = ("prose", "tech")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--work", default=str(ROOT / "bench" / "out" / "mixture"), help="folder for corpora and runs")
    parser.add_argument("--preset", default="tiny", help="train.py --preset")
    parser.add_argument("--steps", type=int, default=120, help="optimizer steps per mix")
    parser.add_argument("--batch-size", type=int, default=8, help="blocks of 256 tokens per step")
    parser.add_argument("--tech-bytes", type=int, default=500_000, help="cap on the technical source's text")
    parser.add_argument("--seed", type=int, default=1337, help="train.py --seed (the same for every mix)")
    parser.add_argument("--only", default=None, help="comma list of mixes to run (natural,balanced,prose,anneal)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--rebuild", action="store_true", help="build the corpora again (else reused from --work)")
    parser.add_argument("--json", default=None, help="also write the figures to this JSON file")
    return parser.parse_args(argv)


def docstring_documents(max_bytes: int) -> list[str]:
    """Python's standard library documentation: each public module, class and function docstring that
    says something (over 200 characters), headed by its qualified name; every k-th of them in a fixed
    order, so that about `max_bytes` are taken from the whole library."""
    documents = []
    names = sorted(
        name
        for name in sys.stdlib_module_names
        if not name.startswith("_")
        and name not in ("antigravity", "this", "idlelib", "turtledemo", "tkinter", "turtle")
    )
    for name in names:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                module = __import__(name)
            except Exception:  # noqa: BLE001 (platform-specific or deprecated modules)
                continue
        for qualified, obj in [(name, module)] + sorted(
            (f"{name}.{attribute}", getattr(module, attribute))
            for attribute in dir(module)
            if not attribute.startswith("_") and hasattr(module, attribute)
        ):
            if qualified != name and getattr(obj, "__module__", None) != name:
                continue  # re-exported from elsewhere
            text = (
                inspect.getdoc(obj) if (inspect.isclass(obj) or inspect.isroutine(obj) or qualified == name) else None
            )
            if text and len(text) > 200:
                documents.append(f"{qualified}\n\n{text}")
    stride = max(1, round(sum(len(text.encode("utf-8")) for text in documents) / max_bytes))
    return documents[::stride]


def build_corpora(args: argparse.Namespace, work: Path) -> dict[str, Path]:
    """prose/ and tech/, both with the tokenizer data.py trains on the two together (joint/)."""
    work.mkdir(parents=True, exist_ok=True)
    if not args.rebuild and all(corpus_format.is_current_corpus(work / name) for name in ("joint", *SOURCES)):
        return {name: work / name for name in SOURCES}
    texts = {"prose": bench_texts.kjv_documents(), "tech": docstring_documents(args.tech_bytes)}
    for name, documents in texts.items():
        write_jsonl(work / f"{name}.jsonl", documents)
        print(f"{name}: {len(documents):,} documents, {sum(len(t.encode()) for t in documents):,} bytes", flush=True)
    steps = [
        ("joint", [work / "prose.jsonl", work / "tech.jsonl"], []),
        *[(name, [work / f"{name}.jsonl"], ["--tokenizer", str(work / "joint")]) for name in SOURCES],
    ]
    for name, inputs, extra in steps:
        if corpus_format.is_current_corpus(work / name) and not args.rebuild:
            continue
        make_corpus(inputs, work / name, "--overwrite", *extra)
    return {name: work / name for name in SOURCES}


def mixes(corpora: dict[str, Path]) -> dict[str, tuple[tuple[float, float], str | None]]:
    """name -> ((prose weight, tech weight), --mixture-schedule)."""
    tokens = [corpus_format.load_manifest(corpora[name]).split("train")["tokens"] for name in SOURCES]
    natural = tuple(round(count / sum(tokens), 4) for count in tokens)
    return {
        "natural": (natural, None),
        "balanced": ((0.5, 0.5), None),
        "prose": ((0.9, 0.1), None),
        "anneal": ((0.9, 0.1), "decay:prose=0.3,tech=0.7"),
    }


def run_mix(
    corpora: dict[str, Path], name: str, weights: tuple[float, float], schedule: str | None, args: argparse.Namespace
) -> dict:
    """Train one mix; its per-source test losses and the tokens each source gave."""
    options = [
        "--data",
        *(f"{source}={corpora[source]}:{weight}" for source, weight in zip(SOURCES, weights)),
        "--out",
        str(Path(args.work) / f"run-{name}"),
        "--preset",
        args.preset,
        "--context",
        "256",
        "--batch-size",
        str(args.batch_size),
        "--grad-accum",
        "1",
        "--seed",
        str(args.seed),
        "--target-tokens",
        str(args.steps * args.batch_size * 256),
        "--schedule",
        "wsd",
        "--threads",
        str(args.threads),
        "--eval-tokens",
        str(10**9),  # every block
        *(["--mixture-schedule", schedule] if schedule else []),
    ]
    training = train.build_training(
        train.parse_args(options), distributed.DistInfo(rank=0, local_rank=0, world=1, device=torch.device("cpu"))
    )
    started = time.perf_counter()
    while training.step < training.total_steps:
        training.train_step()
    seconds = time.perf_counter() - started
    test = train.heldout_loss(training, "test")
    read = training.data.progress(training.step)
    total = sum(read[f"tokens/{source}"] for source in SOURCES)
    result = {
        "mix": name,
        "weights": dict(zip(SOURCES, weights)),
        "schedule": schedule,
        "phase_steps": training.data.sampler.starts,
        "seconds": round(seconds, 1),
        "test_bits_per_byte": test["bits_per_byte"],
    }
    for source in SOURCES:
        part = test["sources"][source]
        result[source] = {
            "test_loss": part["loss"],
            "test_bits_per_byte": part["bits_per_byte"],
            "test_tokens": part["tokens"],
            "tokens_read": read[f"tokens/{source}"],
            "share_read": read[f"tokens/{source}"] / total,
            "epochs": read[f"epochs/{source}"],
        }
    print(
        f"{name}: "
        + ", ".join(
            f"{source} {result[source]['test_bits_per_byte']:.4f} bpb "
            f"({100 * result[source]['share_read']:.2f}% of tokens, "
            f"{result[source]['epochs']:.2f} epochs)"
            for source in SOURCES
        )
        + f" | {seconds:.0f} s",
        flush=True,
    )
    return result


def print_table(results: list[dict]) -> None:
    print(
        "\n| mix | weights (prose/tech) | decay phase | prose share read | tech share read | tech epochs "
        "| prose test bpb | tech test bpb | both test bpb |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for r in results:
        weights = "/".join(f"{r['weights'][source]:g}" for source in SOURCES)
        print(
            f"| {r['mix']} | {weights} | {r['schedule'] or '-'} (from step {r['phase_steps'][-1]}) "
            f"| {100 * r['prose']['share_read']:.2f}% | {100 * r['tech']['share_read']:.2f}% "
            f"| {r['tech']['epochs']:.2f} | {r['prose']['test_bits_per_byte']:.4f} "
            f"| {r['tech']['test_bits_per_byte']:.4f} | {r['test_bits_per_byte']:.4f} |"
        )
    by_name = {r["mix"]: r for r in results}
    checks = [
        ("balanced", "natural", "tech", "<"),
        ("balanced", "natural", "prose", ">"),
        ("anneal", "prose", "tech", "<"),
        ("anneal", "prose", "prose", ">"),
    ]
    for mix, baseline, source, direction in checks:
        if mix in by_name and baseline in by_name:
            ours, theirs = by_name[mix][source]["test_bits_per_byte"], by_name[baseline][source]["test_bits_per_byte"]
            expected = ours < theirs if direction == "<" else ours > theirs
            print(
                f"{source} held-out bpb, {mix} vs {baseline}: {ours:.4f} vs {theirs:.4f} "
                f"({ours / theirs:.3f}x; expected {direction}): {'AS EXPECTED' if expected else 'NOT as expected'}"
            )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    corpora = build_corpora(args, Path(args.work))
    chosen = mixes(corpora)
    if args.only:
        chosen = {name: chosen[name] for name in args.only.split(",")}
    results = [run_mix(corpora, name, weights, schedule, args) for name, (weights, schedule) in chosen.items()]
    print_table(results)
    if args.json:
        atomic_write_json(Path(args.json), {"options": vars(args), "results": results})
    return 0


if __name__ == "__main__":
    run_main(main)
