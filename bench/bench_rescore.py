"""Held-out bits per byte of finished runs over every block of their corpus' validation and test splits.

    python bench/bench_rescore.py --corpus CORPUS RUN [RUN ...] [--json F]

Until 2026-12-06 train.py scored --eval-batches global batches of blocks: a run at a quarter of another's
batch scored a quarter of its blocks (other blocks, a noisier number), so the benches that compared runs of
different batches compared different blocks. This scores each RUN's newest checkpoint as train.py scores a
split (train.heldout_loss) over all of its blocks (--eval-tokens past the split's size), with the shape and
precision its training_settings.json records, and prints each run's bits per byte over validation,
test and both, and the ratio to the first RUN's.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tinyllm.common import ArgumentParser, UserError, atomic_write_json, option_flags, run_main  # noqa: E402
from tinyllm.model import config as model_config  # noqa: E402
from tinyllm.store import checkpoint_store as store  # noqa: E402
from tinyllm.training import distributed, train  # noqa: E402

EVERY_BLOCK = str(10**12)  # --eval-tokens past any split's size


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", required=True, help="the corpus folder the runs trained on")
    parser.add_argument("runs", nargs="+", help="run folders (the first is the baseline)")
    parser.add_argument("--json", help="write the results here")
    return parser.parse_args(argv)


def run_options(recorded: dict) -> list[str]:
    """train.py's options for scoring a run as it scored itself, from its training_settings.json: its preset with
    every shape field, packing, loss and precision."""
    training, precision = recorded["training"], recorded["runtime"]["precision"]
    shape, flags = model_config.recorded_preset(training), option_flags(train.RunSettings)
    options = ["--preset", training["preset"], "--packing", training["packing"], "--loss-on", training["loss_on"]]
    for name in model_config.OVERRIDABLE_FIELDS:
        value = getattr(shape, name)
        if isinstance(value, bool):  # a tri-state option: --name / --no-name
            options.append(flags[name] if value else "--no-" + flags[name].removeprefix("--"))
        else:
            options += [flags[name], str(value)]
    options += ["--text-loss", training["text_loss"]] if training.get("text_loss") else []
    return options + ["--precision", precision]


def rescore(corpus: Path, run: Path, scratch: Path) -> dict:
    """{split: bits per byte} over every block of validation and test, and "both" over the two together."""
    newest = store.latest_checkpoint_name(run)
    if newest is None:
        raise UserError(f"{run}: no checkpoint to score")
    recorded = json.loads((run / "training_settings.json").read_text())
    argv = ["--data", str(corpus), "--out", str(scratch), "--eval-tokens", EVERY_BLOCK, "--no-report"]
    settings = train.parse_args([*argv, *run_options(recorded)])
    training = train.build_training(settings, distributed.init_distributed("cpu"))
    state = store.load_checkpoint_file(run / "checkpoints" / newest)
    training.model.load_state_dict(state["model"])
    scores = {split: train.heldout_loss(training, split) for split in ("validation", "test")}
    nats = sum(scores[split]["loss"] * scores[split]["tokens"] for split in scores)
    return {
        "checkpoint": newest,
        "validation": scores["validation"]["bits_per_byte"],
        "test": scores["test"]["bits_per_byte"],
        "both": nats / math.log(2) / sum(scores[split]["bytes"] for split in scores),
        "test_tokens": scores["test"]["tokens"],
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        for run in args.runs:
            results[run] = rescore(Path(args.corpus), Path(run), Path(scratch) / "run")
    first = results[args.runs[0]]
    print("| run | checkpoint | validation bpb | test bpb | both | test / first's | both / first's |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for run, result in results.items():
        print(
            f"| {run} | {result['checkpoint']} | {result['validation']:.4f} | {result['test']:.4f} | "
            f"{result['both']:.4f} | {result['test'] / first['test']:.4f}x | {result['both'] / first['both']:.4f}x |"
        )
    if args.json:
        atomic_write_json(Path(args.json), results)
    return 0


if __name__ == "__main__":
    run_main(main)
