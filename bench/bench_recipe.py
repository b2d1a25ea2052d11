"""Training recipes on real English text: held-out bits per byte at equal tokens, and against wall-clock time.

    python bench/bench_recipe.py                      # the issue's comparison: baseline vs default, nano and micro
    python bench/bench_recipe.py --text changelog --presets nano --only nanogpt-muon,default \
        --reference nanogpt-muon                      # issue 30: against nanoGPT + torch Muon
    python bench/bench_recipe.py --presets nano --seeds 1 --steps 150 \\
        --recipe "muon-0.04=--optimizer muon --muon-lr 0.04"          # a sweep point beside the built-in two
    python bench/bench_recipe.py --presets nano --only stock,fp16 --recipe stock= --recipe fp16= \\
        --newton-schulz stock=bf16 --newton-schulz fp16=fp16   # Muon's Newton-Schulz dtype (issue 19)
    python bench/bench_recipe.py --report-only A.json B.json --results all.json  # merged tables and plot

The text (--text) is the King James Bible from Debian's `bible-kjv` package (kjv: public domain, ~4.2 MB of
English prose, one document per chapter; installed with apt-get when missing and run as root), Debian's
man pages (manpages: long documents) or changelog entries (changelog: short documents), the two texts of
bench/bench_elementwise_quality.py, or FILE.jsonl with one {"text": ...} document per line; at most
--text-bytes of it. data.py builds the corpus with a 4,096-token BPE and holds out 5% of the documents
(the test split) by its own hash rule.

Every recipe of a (preset, seed) group trains the same model shape from the same seed (same initial
weights and data order) on the same tokens, in one process with the same torch thread count; the
recipes take turns every --chunk steps, so load from other processes hits them alike. Held-out bits
per byte = summed next-token cross-entropy over every test block / (ln 2 x the UTF-8 bytes those
targets decode to); it is measured every --eval-every steps (not counted in the training seconds).

Recipes are train.py options: `baseline` is the classic small-GPT recipe (AdamW 1e-3 -> 1e-4, beta2 0.99,
100 warmup steps, cosine) and `default` is train.py with no recipe options. A recipe whose options hold
`--model nanogpt` trains bench/nanogpt.py's GPT-2 (nanoGPT's model, the preset's width, depth, heads and
context: the same parameter count) with stock torch.optim.Muon on its blocks' matrices and AdamW on the
rest, under the rest of the options (lrs, schedule, decay); `nanogpt-muon` is that baseline with its AdamW
lr tuned (bench/RESULTS.md). Targets, against --reference: baseline (issue 11), default bpb <= 0.95x at
equal tokens and the baseline's final bpb reached in <= 0.75x of its training seconds; nanogpt-muon
(issue 30), <= 0.85x and <= 0.70x.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shlex
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import nanogpt  # noqa: E402
import torch  # noqa: E402
from bench_texts import TEXTS, make_corpus, text_documents, write_jsonl  # noqa: E402

from tinyllm.common import ArgumentParser, UserError, atomic_write_json, run_main  # noqa: E402
from tinyllm.data import corpus_format  # noqa: E402
from tinyllm.model import config as model_config  # noqa: E402
from tinyllm.model.hardware import newton_schulz_flops  # noqa: E402
from tinyllm.training import (  # noqa: E402
    distributed,
    muon,
    optimization,
    train,
)

NANOGPT = "--model nanogpt"  # in a recipe's options: bench/nanogpt.py's GPT-2 instead of the Qwen3 model
BUILT_IN = {
    "baseline": "--optimizer adamw --lr 1e-3 --final-lr-fraction 0.1 --beta2 0.99 --warmup-steps 100 --schedule cosine",
    # nanoGPT's AdamW betas (0.9, 0.95) and torch.optim.Muon's default momentum, whatever train.py's defaults
    "nanogpt-muon": f"{NANOGPT} --optimizer muon --muon-lr 0.02 --lr 3e-2 --schedule cosine "
    "--final-lr-fraction 0.1 --beta1 0.9 --muon-momentum 0.95",
    "default": "",
}
# nanoGPT as its train.py runs on a CPU (no autocast there: fp32 whatever the CPU); nanogpt-muon takes the
# precision train.py picks for the device, as the default does (bf16 on a CPU with bf16 instructions)
BUILT_IN["nanogpt-muon-fp32"] = BUILT_IN["nanogpt-muon"] + " --precision fp32"
TARGETS = {"baseline": (0.95, 0.75), "nanogpt-muon": (0.85, 0.70)}  # (bpb ratio, time ratio) against the classic
# recipe (issue 11), against nanoGPT + Muon (issue 30: any --model nanogpt reference)
TARGET_NEWTON_SCHULZ = 0.005  # issue 19: fp16 Newton-Schulz held-out bpb within 0.5% of stock bf16
WORK = ROOT / "bench" / "out" / "recipe"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--text", default="kjv", help=f"{', '.join(TEXTS)} or a JSONL of {{'text': ...}} documents")
    parser.add_argument("--text-bytes", type=int, default=4_500_000, help="UTF-8 bytes of the text at most")
    parser.add_argument("--reference", default="baseline", help="the recipe the others are compared with")
    parser.add_argument("--work", default=str(WORK), help="folder for the corpus, results and plot")
    parser.add_argument("--presets", default="nano,micro", help="comma list of model presets")
    parser.add_argument("--seeds", type=int, default=2, help="seeds per preset (--first-seed, the next, ...)")
    parser.add_argument("--first-seed", type=int, default=1337, help="the first seed (another to add seeds to results)")
    parser.add_argument("--context", type=int, default=256, help="tokens per block")
    parser.add_argument("--batch-size", type=int, default=32, help="blocks per optimizer step")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per run (equal tokens for all)")
    parser.add_argument(
        "--micro-steps",
        type=int,
        default=None,
        help="steps for the micro preset (None: --steps); every recipe still gets the same tokens",
    )
    parser.add_argument("--eval-every", type=int, default=25, help="held-out bpb every N steps (and at the end)")
    parser.add_argument("--chunk", type=int, default=5, help="steps a recipe runs before the next one takes its turn")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the same for every recipe)")
    parser.add_argument(
        "--recipe", action="append", default=[], help="NAME=train.py options (repeatable), run beside the built-in ones"
    )
    parser.add_argument(
        "--newton-schulz",
        action="append",
        default=[],
        metavar="NAME=DTYPE",
        help="Muon's Newton-Schulz dtype for recipe NAME (repeatable): fp32, fp16 or bf16 (bf16 is "
        "stock torch.optim.Muon); recipes not named get hardware.newton_schulz_dtype's",
    )
    parser.add_argument(
        "--ema",
        type=float,
        default=None,
        metavar="BETA",
        help="also score each recipe's running average of the weights (NAME+emaBETA), e.g. 0.99",
    )
    parser.add_argument("--only", default=None, help="comma list: run only these recipes (built-in or --recipe)")
    parser.add_argument("--results", default=None, help="results JSON (None: WORK/results.json); runs are merged in")
    parser.add_argument(
        "--report-only",
        nargs="+",
        default=None,
        metavar="RESULTS",
        help="print the tables and plot of these results files (merged), no training",
    )
    return parser.parse_args(argv)


def build_corpus(args: argparse.Namespace, work: Path) -> Path:
    """The real-text corpus (built once per text and size, then reused): 4,096-token BPE, 5% test, 2% validation."""

    source = work / f"{args.text}.jsonl" if args.text in TEXTS else Path(args.text)
    corpus = work / f"corpus-{source.stem}-{args.text_bytes}"
    if corpus_format.is_current_corpus(corpus):
        return corpus
    if corpus.exists():
        shutil.rmtree(corpus)  # built by an older data.py: the bench's own folder, rebuilt
    work.mkdir(parents=True, exist_ok=True)
    if args.text in TEXTS:
        write_jsonl(source, text_documents(args.text, args.text_bytes))
    return make_corpus([source], corpus)


def heldout_bytes(training: train.Training) -> int:
    """UTF-8 bytes of the text the test blocks' targets decode to (special tokens are 0 bytes)."""
    from transformers import AutoTokenizer

    split = training.data.splits["test"]
    tokenizer = AutoTokenizer.from_pretrained(training.data.corpus / "tokenizer")
    ids = [int(token) for index in range(split.blocks) for token in split.block(index)[1:]]
    return len(tokenizer.decode(ids, skip_special_tokens=True).encode("utf-8"))


@torch.no_grad()
def heldout_nats(training: train.Training, batch: int = 16) -> float:
    """Summed next-token cross-entropy (nats) over every block of the test split."""
    split = training.data.splits["test"]
    total = 0.0
    training.model.eval()
    for start in range(0, split.blocks, batch):
        rows = split.batch(list(range(start, min(split.blocks, start + batch))), training.device)
        total += training.loss_of(rows, model=training.model, reduction="sum").item()
    training.model.train()
    return total


def muon_extra_flops(training: train.Training) -> int:
    """Muon's Newton-Schulz FLOPs per optimizer step of this run (0 under adamw)."""
    if training.recipe.optimizer != "muon":
        return 0
    return sum(newton_schulz_flops(*param.shape) for param in optimization.hidden_matrices(training.model)[0])


def muon_share_on_gpus(preset: model_config.Preset, vocab: int, tokens_per_step: int, world: int) -> float:
    """Muon's extra FLOPs over a GPU's training FLOPs per step: each rank orthogonalizes 1/world of the matrices
    (muon.newton_schulz_owners balances them to within one matrix)."""
    attention = [
        (preset.heads * preset.head_dim, preset.hidden),
        (preset.kv_heads * preset.head_dim, preset.hidden),
        (preset.kv_heads * preset.head_dim, preset.hidden),
        (preset.hidden, preset.heads * preset.head_dim),
    ]
    mlp = [(preset.intermediate, preset.hidden)] * 2 + [(preset.hidden, preset.intermediate)]
    extra = preset.layers * sum(newton_schulz_flops(*shape) for shape in attention + mlp)
    return extra / world / (model_config.flops_per_token(preset, vocab) * tokens_per_step / world)


def newton_schulz_dtypes(specs: list[str]) -> dict[str, str]:
    """--newton-schulz NAME=DTYPE options as {recipe name: dtype}."""
    dtypes = {}
    for spec in specs:
        name, _, dtype = spec.partition("=")
        if dtype not in muon.DTYPES:
            raise UserError(f"--newton-schulz {spec}: give NAME=DTYPE with DTYPE one of {', '.join(muon.DTYPES)}")
        dtypes[name.strip()] = dtype
    return dtypes


def set_newton_schulz_dtype(training: train.Training, dtype: str | None) -> str | None:
    """Muon's Newton-Schulz dtype in this recipe's training (None: the recipe has no Muon)."""
    optimizer = training.optimizer.parts.get("muon")
    if optimizer is None:
        if dtype:
            raise UserError(f"--newton-schulz {dtype} names a recipe without Muon")
        return None
    optimizer.ns_dtype = dtype or optimizer.ns_dtype
    return optimizer.ns_dtype


def start_run(
    preset: str, seed: int, tokens: int, name: str, options: str, corpus: Path, args: argparse.Namespace
) -> dict:
    """One recipe's Training (bench/nanogpt.py's GPT-2 in place of the model under --model nanogpt)."""
    info = distributed.DistInfo(rank=0, local_rank=0, world=1, device=torch.device("cpu"))
    words = shlex.split(options)
    gpt2 = NANOGPT.split() == words[:2]
    argv = [
        "--data",
        str(corpus),
        "--out",
        str(Path(args.work) / "unused"),
        "--preset",
        preset,
        "--context",
        str(args.context),
        "--batch-size",
        str(args.batch_size),
        "--grad-accum",
        "1",
        "--target-tokens",
        str(tokens),
        "--seed",
        str(seed),
        "--threads",
        str(args.threads),
        *words[2 if gpt2 else 0 :],
    ]
    training = train.build_training(train.parse_args(argv), info)
    if gpt2:
        nanogpt.swap_into(training)
    dtype = None if gpt2 else set_newton_schulz_dtype(training, newton_schulz_dtypes(args.newton_schulz).get(name))
    print(
        f"  {name}: {'nanoGPT GPT-2, stock torch.optim.Muon; ' if gpt2 else ''}{training.recipe.describe()}"
        + (f"; Newton-Schulz in {dtype}" if dtype else ""),
        flush=True,
    )
    weights = [param.detach().clone() for param in training.model.parameters()] if args.ema else None
    return {
        "training": training,
        "seconds": 0.0,
        "curve": [],
        "ema": weights,
        "ema_curve": [],
        "options": options,
        "newton_schulz": dtype,
    }


def update_ema(run: dict, beta: float) -> None:
    """--ema: the running average of the weights, one lerp per step (counted in the training seconds)."""
    torch._foreach_lerp_(run["ema"], [param.detach() for param in run["training"].model.parameters()], 1 - beta)


def ema_nats(training: train.Training, weights: list[torch.Tensor]) -> float:
    """heldout_nats with the averaged weights in place of the model's (put back afterwards)."""
    params = list(training.model.parameters())
    kept = [param.detach().clone() for param in params]
    with torch.no_grad():
        torch._foreach_copy_(params, weights)
        nats = heldout_nats(training)
        torch._foreach_copy_(params, kept)
    return nats


def run_group(
    preset: str, seed: int, steps: int, recipes: dict[str, str], corpus: Path, args: argparse.Namespace
) -> dict:
    """Train every recipe for `steps` steps from the same seed, taking turns; their curves and timings."""
    tokens = steps * args.batch_size * args.context
    runs = {name: start_run(preset, seed, tokens, name, options, corpus, args) for name, options in recipes.items()}
    bytes_ = heldout_bytes(next(iter(runs.values()))["training"])

    def evaluate(run: dict) -> None:
        point = {
            "step": run["training"].step,
            "tokens": run["training"].step * args.batch_size * args.context,
            "seconds": run["seconds"],
        }
        run["curve"].append({**point, "bpb": heldout_nats(run["training"]) / (math.log(2) * bytes_)})
        if run["ema"]:
            run["ema_curve"].append({**point, "bpb": ema_nats(run["training"], run["ema"]) / (math.log(2) * bytes_)})

    for run in runs.values():
        evaluate(run)
    while any(run["training"].step < steps for run in runs.values()):
        for name, run in runs.items():
            training = run["training"]
            for _ in range(min(args.chunk, steps - training.step)):
                started = time.perf_counter()
                result = training.train_step()
                if run["ema"]:
                    update_ema(run, args.ema)
                run["seconds"] += time.perf_counter() - started
                if training.step % args.eval_every == 0 or training.step == steps:
                    evaluate(run)
            if training.step == steps and "done" not in run:
                run["done"] = True
                print(
                    f"  {preset} seed {seed} {name}: step {steps}, held-out bpb {run['curve'][-1]['bpb']:.4f}, "
                    f"{run['seconds']:.0f} s training, last loss {result.loss:.3f}",
                    flush=True,
                )
    first = next(iter(runs.values()))["training"]
    results = {}
    for name, run in runs.items():
        common = {
            "options": run["options"],
            "recipe": train.dataclasses.asdict(run["training"].recipe),
            "newton_schulz": run["newton_schulz"],
            "seconds": run["seconds"],
            "tokens": tokens,
            "muon_flops_per_step": muon_extra_flops(run["training"]),
            "train_flops_per_step": first.flops_per_token * first.tokens_per_step,
            "heldout_bytes": bytes_,
        }
        results[name] = {**common, "curve": run["curve"]}
        if run["ema"]:
            results[f"{name}+ema{args.ema:g}"] = {**common, "curve": run["ema_curve"]}
    return results


def time_to_reach(curve: list[dict], bpb: float) -> float | None:
    """Training seconds at which `curve` first reaches `bpb` (linear between evaluations), None if never."""
    for before, after in zip(curve, curve[1:]):
        if after["bpb"] <= bpb:
            if before["bpb"] <= bpb:
                return before["seconds"]
            share = (before["bpb"] - bpb) / (before["bpb"] - after["bpb"])
            return before["seconds"] + share * (after["seconds"] - before["seconds"])
    return None


def summarize(results: dict, reference: str = "baseline") -> list[str]:
    """Per preset: each recipe's final bpb per seed, its ratio to the reference recipe's, and the time it took
    to reach the reference's final bpb over the reference's time."""
    lines = []
    for preset, seeds in results["groups"].items():
        names = [name for name in next(iter(seeds.values())) if all(name in group for group in seeds.values())]
        lines.append(
            f"\n{preset} ({len(seeds)} seed(s), {next(iter(next(iter(seeds.values())).values()))['tokens']:,} "
            "tokens per run)"
        )
        lines.append(
            f"| recipe | held-out bpb per seed | mean | vs {reference} | training s | "
            f"time to {reference}'s final bpb | Muon NS FLOPs / step FLOPs |"
        )
        lines.append("|---|---|---:|---:|---:|---:|---:|")
        base = (
            statistics.mean(group[reference]["curve"][-1]["bpb"] for group in seeds.values())
            if reference in names
            else None
        )
        for name in names:
            finals = [group[name]["curve"][-1]["bpb"] for group in seeds.values()]
            seconds = statistics.mean(group[name]["seconds"] for group in seeds.values())
            ratio = f"{statistics.mean(finals) / base:.3f}x" if base else "-"
            reach = []
            for group in seeds.values():
                if reference in group:
                    reached = time_to_reach(group[name]["curve"], group[reference]["curve"][-1]["bpb"])
                    reach.append(None if reached is None else reached / group[reference]["seconds"])
            reach_text = "-" if not reach else ("never" if None in reach else f"{statistics.mean(reach):.2f}x")
            extra = statistics.mean(
                group[name]["muon_flops_per_step"] / group[name]["train_flops_per_step"] for group in seeds.values()
            )
            lines.append(
                f"| {name} | {', '.join(f'{value:.4f}' for value in finals)} | "
                f"{statistics.mean(finals):.4f} | {ratio} | {seconds:.0f} | {reach_text} | {extra:.4f} |"
            )
        if base and "default" in names:
            lines.append(target_line(seeds, reference))
        lines.extend(newton_schulz_lines(seeds))
    lines.append(
        "\nMuon's Newton-Schulz work on GPUs by FLOP accounting (each rank orthogonalizes its share), "
        "as a share of a GPU's training FLOPs per step, vocab 33,069, 65,536 tokens/step on 2 GPUs "
        "(the Kaggle recipe's global batch); at equal MFU this is the step time it adds:"
    )
    for name, preset in model_config.PRESETS.items():
        lines.append(f"  {name}: {muon_share_on_gpus(preset, 33_069, 65_536, 2):.2%}")
    return lines


def target_line(seeds: dict, reference: str) -> str:
    """Whether the default meets the targets against `reference` (TARGETS, by the kind of reference): every
    seed's bpb ratio, and the mean time to the reference's final bpb over the reference's training seconds."""
    gpt2 = next(iter(seeds.values()))[reference]["options"].startswith(NANOGPT)
    bpb_target, time_target = TARGETS["nanogpt-muon" if gpt2 else "baseline"]
    ratios = [group["default"]["curve"][-1]["bpb"] / group[reference]["curve"][-1]["bpb"] for group in seeds.values()]
    reach = [time_to_reach(group["default"]["curve"], group[reference]["curve"][-1]["bpb"]) for group in seeds.values()]
    time_ratio = (
        None
        if None in reach
        else statistics.mean(value / group[reference]["seconds"] for value, group in zip(reach, seeds.values()))
    )
    bpb_ok = max(ratios) <= bpb_target
    time_ok = time_ratio is not None and time_ratio <= time_target
    return (
        f"target bpb: default/{reference} {', '.join(f'{ratio:.3f}' for ratio in ratios)} (per seed) <= "
        f"{bpb_target}: {'MET' if bpb_ok else 'NOT MET'}; target time: "
        f"{'never' if time_ratio is None else f'{time_ratio:.2f}'} <= {time_target}: "
        f"{'MET' if time_ok else 'NOT MET'}"
    )


def newton_schulz_lines(seeds: dict) -> list[str]:
    """Each recipe with a --newton-schulz dtype against the one in bf16 (stock torch.optim.Muon): mean bpb ratio."""
    first = next(iter(seeds.values()))
    stock = next((name for name, run in first.items() if run.get("newton_schulz") == "bf16"), None)
    if stock is None:
        return []

    def mean_bpb(name: str) -> float:
        return statistics.mean(group[name]["curve"][-1]["bpb"] for group in seeds.values())

    lines = []
    for name, run in first.items():
        if name != stock and run.get("newton_schulz"):
            ratio = mean_bpb(name) / mean_bpb(stock)
            met = "MET" if abs(ratio - 1) <= TARGET_NEWTON_SCHULZ else "NOT MET"
            lines.append(
                f"Newton-Schulz {run['newton_schulz']} ({name}) / stock bf16 ({stock}): bpb {ratio:.4f}x, "
                f"target within {TARGET_NEWTON_SCHULZ:.1%}: {met}"
            )
    return lines


def plot(results: dict, path: Path) -> None:
    """Held-out bpb against tokens and against training seconds, every recipe, one row per preset."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    presets = list(results["groups"])
    figure, axes = plt.subplots(len(presets), 2, figsize=(12, 4.2 * len(presets)), squeeze=False)
    colors = {}
    for row, preset in enumerate(presets):
        for seed, group in results["groups"][preset].items():
            for name, run in group.items():
                color = colors.setdefault(name, f"C{len(colors)}")
                label = name if seed == next(iter(results["groups"][preset])) else None
                for column, key in enumerate(("tokens", "seconds")):
                    axes[row][column].plot(
                        [point[key] for point in run["curve"][1:]],
                        [point["bpb"] for point in run["curve"][1:]],
                        color=color,
                        label=label,
                        linewidth=1.5,
                        alpha=0.85,
                    )
        for column, key in enumerate(("training tokens", "training seconds (CPU)")):
            axis = axes[row][column]
            axis.set_xlabel(key)
            axis.set_ylabel("held-out bits per byte")
            axis.set_title(f"{preset}: held-out bpb vs {key.split()[1]}")
            axis.grid(alpha=0.3)
            axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = Path(args.work)
    results_path = Path(args.results or (args.report_only or [work / "results.json"])[0])
    if args.report_only:
        results = {"groups": {}}
        for path in args.report_only:
            for preset, seeds in json.loads(Path(path).read_text())["groups"].items():
                for seed, group in seeds.items():
                    results["groups"].setdefault(preset, {}).setdefault(seed, {}).update(group)
        if args.results:
            atomic_write_json(results_path, results)
    else:
        recipes = dict(BUILT_IN)
        for spec in args.recipe:
            name, _, options = spec.partition("=")
            recipes[name.strip()] = options
        if args.only:
            wanted = [name.strip() for name in args.only.split(",")]
            missing = [name for name in wanted if name not in recipes]
            if missing:
                raise UserError(f"--only names unknown recipes: {', '.join(missing)}")
            recipes = {name: recipes[name] for name in wanted}
        unknown = set(newton_schulz_dtypes(args.newton_schulz)) - set(recipes)
        if unknown:
            raise UserError(f"--newton-schulz names recipes not run: {', '.join(sorted(unknown))}")
        corpus = build_corpus(args, work)
        results = json.loads(results_path.read_text()) if results_path.exists() else {"groups": {}}
        results["machine"] = {
            "cpu": platform.processor() or platform.machine(),
            "threads": args.threads,
            "torch": torch.__version__,
            "corpus": str(corpus),
        }
        for preset in args.presets.split(","):
            steps = args.micro_steps if preset == "micro" and args.micro_steps else args.steps
            for seed in range(args.first_seed, args.first_seed + args.seeds):
                print(
                    f"{preset}, seed {seed}: {len(recipes)} recipes x {steps} steps "
                    f"({model_config.PRESETS[preset].hidden} wide)",
                    flush=True,
                )
                group = run_group(preset, seed, steps, recipes, corpus, args)
                stored = results["groups"].setdefault(preset, {}).setdefault(str(seed), {})
                stored.update(group)
                atomic_write_json(results_path, results)
    for line in summarize(results, args.reference):
        print(line)
    picture = results_path.with_suffix(".png")
    plot(results, picture)
    print(f"\nresults: {results_path}\nplot: {picture}")
    return 0


if __name__ == "__main__":
    run_main(main)
