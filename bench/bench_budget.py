"""--budget's loss model: a sweep of presets x token counts on real text, the fit, and the CPU-budget targets.

    OMP_NUM_THREADS=1 python bench/bench_budget.py                  # sweep (~30 min of one idle thread), fit, targets
    python bench/bench_budget.py --fit-only                          # fit and targets from the saved results

The text: the King James Bible (Debian's bible-kjv, one document per chapter) and Debian changelog
entries (/usr/share/doc/*/changelog.Debian.gz), --changelog-bytes of them; data.py builds the corpus
with a --vocab-size BPE (4,096 unless given) and holds out 5% of the documents (the test split).

(a) The sweep. budget.probe measures each preset's tokens/s (train.py steps at one thread); for a
budget of --minutes, each preset trains the token counts that fit --fractions of it (a fraction above 1
is a longer budget: --fractions 3 of 10 minutes is 30), with the batch budget.candidate_outcome gives
and at most budget.max_passes over the train split (the planner's own rules), in-process through
train.py's Training, one run after another at one thread; the score is held-out bits per byte over
every test block.
(b) The fit: L(N, D) = E + A / N^alpha + B / D^beta over the runs (N: non-embedding parameters, D:
training tokens); for each (alpha, beta) on a grid, E, A and B are linear least squares (numpy), and
the (alpha, beta) with the least squared error wins. It prints the LossModel line budget.py holds.
(c) The targets: for a budget of --minutes and of each fraction of it, budget.choose with the fitted
model and the probe's speeds picks a (preset, tokens) that is one of the sweep's runs (the same rule
made both); its held-out bpb against the best run of the sweep that fits that budget (target: within
2%) and against the default preset (tiny) trained for the same time (target: ahead).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402
from bench_packing import heldout_bpb  # noqa: E402
from bench_texts import changelog_entries, kjv_documents, make_corpus, write_jsonl  # noqa: E402

from tinyllm.common import ArgumentParser, UserError, atomic_write_json, run_main  # noqa: E402
from tinyllm.data import corpus_format  # noqa: E402
from tinyllm.model import config as model_config  # noqa: E402
from tinyllm.training import (  # noqa: E402
    budget,
    distributed,
    train,
)

WORK = ROOT / "bench" / "out" / "budget"
TARGET_GRID_RATIO = 1.02  # the plan's bpb at most 2% above the best fixed choice that fits the budget
DEFAULT_PRESET = train.RunSettings().preset


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--work", default=str(WORK), help="folder for the corpus and results")
    parser.add_argument("--presets", default="tiny,nano,micro", help="comma list of presets to sweep")
    parser.add_argument("--minutes", type=float, default=5.0, help="the largest budget, in minutes of training")
    parser.add_argument("--fractions", default="0.125,0.25,0.5,1", help="token counts: these shares of it")
    parser.add_argument("--changelog-bytes", type=int, default=4_000_000, help="changelog text beside the KJV")
    parser.add_argument(
        "--vocab-size", type=int, default=4096, help="the corpus' BPE vocabulary (data.py's rule gives 8,192 here)"
    )
    parser.add_argument("--seed", type=int, default=1337, help="model init and data order")
    parser.add_argument("--fit-only", action="store_true", help="no training: fit and check the saved results")
    parser.add_argument(
        "--default-only",
        action="store_true",
        help="train only today's default run, stopped where the default preset's sweep runs stop",
    )
    parser.add_argument(
        "--fit-min-steps",
        type=int,
        default=100,
        help="fit only the runs of at least this many steps (shorter ones are the start's transient, "
        "off the longer runs' curve; with them the fit ran to alpha_N 3.6: docs/budget.md)",
    )
    return parser.parse_args(argv)


def build_corpus(work: Path, changelog_bytes: int, vocab_size: int) -> Path:
    """KJV chapters and changelog entries, one corpus (built once and reused while data.py's format stays)."""
    corpus, source = work / f"corpus-kjv-changelog-{vocab_size}", work / "kjv-changelog.jsonl"
    if corpus_format.is_current_corpus(corpus):
        return corpus
    work.mkdir(parents=True, exist_ok=True)
    documents = kjv_documents() + changelog_entries(changelog_bytes)
    return make_corpus([write_jsonl(source, documents)], corpus, vocab_size=vocab_size)


def base_argv(corpus: Path, work: Path, seed: int) -> list[str]:
    return [
        "--data",
        str(corpus),
        "--out",
        str(work / "unused"),
        "--threads",
        "1",
        "--seed",
        str(seed),
        "--budget",
        "1h",
    ]


def probe_speeds(corpus: Path, work: Path, presets: list[str], seed: int) -> list[budget.Candidate]:
    """budget.probe at one thread, every preset measured (no time limit)."""
    settings = train.parse_args(base_argv(corpus, work, seed))
    info = distributed.DistInfo(rank=0, local_rank=0, world=1, device=torch.device("cpu"))
    shapes = {name: model_config.PRESETS[name] for name in presets}
    vocab = corpus_format.load_manifest(corpus).vocab_size
    measure = train.measure_speed(settings, info, quiet_wait=0.0)  # one thread: no wait (budget.waits_for_quiet)
    return budget.probe(
        measure, info, shapes, settings.session.batch_size, math.inf, vocab, budget.probe_window("cpu", 1)
    )


def budget_request(seconds: float, results: dict) -> budget.Request:
    """The planner's request for `seconds` on this corpus (no probe time spent): train.py's, tokens capped at
    budget.max_passes over the train split."""
    tokens, passes = results["train_tokens"], results["max_passes"]
    return budget.Request(budget=f"{seconds:g}s", seconds=seconds, train_tokens=tokens, max_passes=passes)


def sweep_point(candidate: budget.Candidate, seconds: float, results: dict) -> dict:
    """What the planner's rule trains `candidate` on for a budget of `seconds`."""
    return budget.candidate_outcome(candidate, budget_request(seconds, results), budget.LOSS_MODEL)


def split_limits(corpus: Path) -> dict:
    """The train split's tokens and the passes over it the planner allows (budget.max_passes)."""
    manifest = corpus_format.load_manifest(corpus)
    tokens = manifest.split("train")["tokens"]
    passes = budget.max_passes(tokens, manifest.vocab_size)
    return {"train_tokens": tokens, "max_passes": passes, "vocab_size": manifest.vocab_size}


def train_point(corpus: Path, work: Path, seed: int, point: dict) -> dict:
    """Train one sweep point in-process: its held-out bpb and training seconds."""
    blocks = point["blocks"]
    size, accum = budget.split_batch(blocks, 1, 8)
    argv = base_argv(corpus, work, seed)[:-2] + [
        "--preset",
        point["preset"],
        "--target-tokens",
        str(point["tokens"]),
        "--batch-size",
        str(size),
        "--grad-accum",
        str(accum),
    ]
    info = distributed.DistInfo(rank=0, local_rank=0, world=1, device=torch.device("cpu"))
    training = train.build_training(train.parse_args(argv), info)
    seconds = 0.0
    while training.step < training.total_steps:
        seconds += training.train_step().seconds
    bpb = heldout_bpb(training, training.run.packing)
    return {
        **point,
        "parameters": budget.non_embedding_parameters(training.preset),
        "train_seconds": seconds,
        "bpb": bpb,
        "steps": training.total_steps,
        "precision": training.precision,
        "tied": training.preset.tie_embeddings,
    }


def default_run(corpus: Path, work: Path, seed: int, marks: list[int]) -> list[dict]:
    """Today's default run (the default preset, batch and length: one epoch, no --budget) stopped at each
    of `marks` tokens (as --max-hours stops it): its held-out bpb there, mid-schedule."""
    argv = base_argv(corpus, work, seed)[:-2]
    info = distributed.DistInfo(rank=0, local_rank=0, world=1, device=torch.device("cpu"))
    training = train.build_training(train.parse_args(argv), info)
    stops = []
    for mark in sorted(marks):
        while training.step < training.total_steps and training.step * training.tokens_per_step < mark:
            training.train_step()
        stops.append(
            {
                "tokens": mark,
                "trained": training.step * training.tokens_per_step,
                "steps": training.step,
                "total_steps": training.total_steps,
                "bpb": heldout_bpb(training, training.run.packing),
            }
        )
        print(
            f"default run at {mark:,} tokens: step {training.step}/{training.total_steps}, held-out "
            f"{stops[-1]['bpb']:.4f} bits/byte",
            flush=True,
        )
    return stops


FIT_PARAMETERS = 5  # E, N_c, alpha_N, D_c, alpha_D


def fit(runs: list[dict]) -> tuple[budget.LossModel, float]:
    """budget.LossModel's form over the runs by least squares in bits per byte (scipy's trust-region fit of
    E, log N_c, alpha_N, log D_c, alpha_D, all bounded, from a small grid of starts; the lowest error wins)."""
    import numpy as np
    from scipy.optimize import least_squares

    n = np.array([run["parameters"] for run in runs], dtype=float)
    d = np.array([run["tokens"] for run in runs], dtype=float)
    y = np.array([run["bpb"] for run in runs], dtype=float)

    def model_of(p) -> budget.LossModel:
        return budget.LossModel(p[0], math.exp(p[1]), p[2], math.exp(p[3]), p[4])

    def residuals(p):
        return model_of(p).loss(n, d) - y

    lower, upper = [0.0, -30.0, 0.01, -30.0, 0.01], [float(y.min()), 60.0, 5.0, 60.0, 3.0]
    best = None
    starts = itertools.product((0.1, 0.5, 2.0), (0.2, 0.5, 1.0), (1e4, 1e8), (1e5, 1e8))
    with np.errstate(over="ignore"):  # a start far from the fit overflows the power: that start loses
        for alpha_n, alpha_d, n_c, d_c in starts:
            start = [0.5 * float(y.min()), math.log(n_c), alpha_n, math.log(d_c), alpha_d]
            solution = least_squares(residuals, start, bounds=(lower, upper), x_scale="jac", xtol=1e-12, ftol=1e-12)
            if np.isfinite(solution.cost) and (best is None or solution.cost < best.cost):
                best = solution
    if best is None:
        raise UserError("no fit of the loss model")
    rms = math.sqrt(2 * best.cost / len(runs))
    return dataclasses.replace(model_of(best.x), error=rms), rms


def check_targets(results: dict, model: budget.LossModel) -> list[str]:
    """For each budget of the sweep: the plan's choice against the best fitting run, against the default
    preset planned for the same time, and against today's default run stopped at that time."""
    candidates = [budget.Candidate(**candidate) for candidate in results["candidates"]]
    stops = {stop["tokens"]: stop for stop in results.get("default_run", [])}
    lines = []
    for fraction in sorted({run["fraction"] for run in results["runs"]}):
        seconds = results["minutes"] * 60 * fraction
        try:
            plan = budget.choose(budget_request(seconds, results), candidates, model)
        except UserError:
            lines.append(f"| {seconds / 60:g} min | none: below the smallest sensible run |" + " |" * 8)
            continue
        fitting = [run for run in results["runs"] if run["fraction"] <= fraction]
        best = min(fitting, key=lambda run: run["bpb"])
        chosen = next(
            (run for run in fitting if (run["preset"], run["tokens"]) == (plan.preset, plan.target_tokens)), None
        )
        tiny = next((run for run in fitting if run["preset"] == DEFAULT_PRESET and run["fraction"] == fraction), None)
        if chosen is None or tiny is None:  # a sweep still under way
            missing = plan.preset if chosen is None else DEFAULT_PRESET
            lines.append(
                f"| {seconds / 60:g} min | {plan.preset}, {plan.target_tokens:,} tokens | not run yet "
                f"(--presets {missing} --fractions {fraction:g}) |" + " |" * 7
            )
            continue
        today = stops.get(tiny["tokens"])
        lines.append(
            f"| {seconds / 60:g} min | {plan.preset}, {plan.target_tokens:,} tokens | {chosen['bpb']:.4f} | "
            f"{best['preset']}, {best['tokens']:,} | {best['bpb']:.4f} | "
            f"{verdict(chosen['bpb'] / best['bpb'], TARGET_GRID_RATIO)} | {tiny['bpb']:.4f} | "
            f"{verdict(chosen['bpb'] / tiny['bpb'], 1.0)} | "
            + (
                f"{today['bpb']:.4f} (step {today['steps']}/{today['total_steps']}) | "
                f"{verdict(chosen['bpb'] / today['bpb'], 1.0)} |"
                if today
                else "not run | |"
            )
        )
    return [
        "| budget | --budget's choice | its bpb | best fixed choice that fits | its bpb | choice / best "
        "(target <= 1.02) | tiny planned for the same time | choice / it | today's default run stopped "
        "there | choice / it (target < 1) |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|",
        *lines,
    ]


def verdict(ratio: float, limit: float) -> str:
    return f"**{ratio:.4f}x**" + (
        " (met)" if ratio <= limit and (limit > 1 or ratio < 1) else " (equal)" if ratio == 1 else " (MISSED)"
    )


def run_lines(results: dict, model: budget.LossModel) -> list[str]:
    lines = [
        "| preset | N (non-embedding) | tokens | steps x tokens/step | training s | held-out bpb | fit |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for run in sorted(results["runs"], key=lambda run: (run["parameters"], run["tokens"])):
        lines.append(
            f"| {run['preset']} | {run['parameters']:,} | {run['tokens']:,} | {run['steps']} x "
            f"{run['tokens'] // run['steps']:,} | {run['train_seconds']:.0f} | {run['bpb']:.4f} | "
            f"{model.loss(run['parameters'], run['tokens']):.4f} |"
        )
    return lines


def sweep(args: argparse.Namespace, corpus: Path, work: Path, results: dict, results_path: Path) -> None:
    """Probe, then train every (preset, fraction) not yet in `results` (saved after each run)."""
    torch.set_num_threads(1)
    if not results.get("candidates"):
        started = time.monotonic()
        results["candidates"] = [
            dataclasses.asdict(candidate)
            for candidate in probe_speeds(corpus, work, args.presets.split(","), args.seed)
        ]
        results["probe_seconds"] = time.monotonic() - started
        atomic_write_json(results_path, results)
    done = {(run["preset"], run["fraction"]) for run in results["runs"]}
    for candidate in (
        budget.Candidate(**record) for record in results["candidates"] if record["preset"] in args.presets.split(",")
    ):
        for fraction in (float(text) for text in args.fractions.split(",")):
            if (candidate.preset, fraction) in done:
                continue
            point = sweep_point(candidate, results["minutes"] * 60 * fraction, results)
            run = {**train_point(corpus, work, args.seed, point), "fraction": fraction}
            print(
                f"{run['preset']} {run['tokens']:,} tokens ({fraction:g} of {results['minutes']:g} min): "
                f"{run['train_seconds']:.0f} s, held-out {run['bpb']:.4f} bits/byte",
                flush=True,
            )
            results["runs"].append(run)
            atomic_write_json(results_path, results)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    work = Path(args.work)
    results_path = work / "results.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {"runs": []}
    results.setdefault("minutes", args.minutes)
    if args.default_only and not results.get("candidates"):
        raise UserError(f"{results_path} has no probe yet: run the sweep first (without --default-only)")
    results["machine"] = {"cpu": platform.processor() or platform.machine(), "threads": 1, "torch": torch.__version__}
    if not args.fit_only:  # the pass cap (budget.max_passes) is the planner's, so the sweep's and the check's
        corpus = build_corpus(work, args.changelog_bytes, args.vocab_size)
        results.update(split_limits(corpus))
    if args.default_only:
        tiny = next(budget.Candidate(**c) for c in results["candidates"] if c["preset"] == DEFAULT_PRESET)
        marks = [
            sweep_point(tiny, results["minutes"] * 60 * float(f), results)["tokens"] for f in args.fractions.split(",")
        ]
        results["default_run"] = default_run(corpus, work, args.seed, marks)
        atomic_write_json(results_path, results)
    elif not args.fit_only:
        sweep(args, corpus, work, results, results_path)
    fitted = [run for run in results["runs"] if run["steps"] >= args.fit_min_steps]
    if len(fitted) <= FIT_PARAMETERS:
        raise UserError(
            f"{results_path} holds {len(fitted)} runs of at least {args.fit_min_steps} steps; the fit of "
            f"{FIT_PARAMETERS} constants needs more: run the sweep (without --fit-only) or lower "
            "--fit-min-steps"
        )
    model, rms = fit(fitted)
    print(
        f"\nfit over the {len(fitted)} runs of at least {args.fit_min_steps} steps (rms error {rms:.4f} bits/byte):\n"
        f"LOSS_MODEL = {model}\n"
    )
    speeds = ", ".join(f"{c['preset']} {c['tokens_per_second']:,.0f}" for c in results["candidates"])
    print(f"probe (tokens/s at one thread): {speeds}\n")
    for line in run_lines(results, model) + [""] + check_targets(results, model):
        print(line)
    return 0


if __name__ == "__main__":
    run_main(main)
