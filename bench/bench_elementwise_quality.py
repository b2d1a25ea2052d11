"""Norms and RoPE in the autocast dtype (issue 31): held-out bits per byte at equal tokens, before and after.

    python bench/bench_elementwise_quality.py                       # both texts, seeds 1337 and 1338
    python bench/bench_elementwise_quality.py --texts changelog --seeds 1337 --steps 20

model_config.build_training_model gives the model's RMSNorms and rotary embedding forwards in the
autocast dtype (model_config.autocast_elementwise): under fp16/bf16 autocast the norms output the
autocast dtype instead of fp32 and RoPE rotates q and k in it; under fp32 the stock forwards run. On
CPU that is the one numerical change of issue 31 (the document attention is the same masked SDPA here),
so the comparison is train.py on CPU under `--precision bf16` (autocast bf16), `--packing masked`:

- before: model_config.autocast_elementwise replaced by a no-op in the training process (the stock
  transformers forwards: norms output fp32, RoPE in fp32): on CPU the code as it was before issue 31
  (bit for bit on short documents; bench/RESULTS.md has the check against that commit's own train.py);
- after: train.py as it is.

Each arm is a train.py process of its own, started by this script as
`python bench/bench_elementwise_quality.py train-arm ARM TRAIN.PY OPTIONS` (the arm's switch lives here
only: nothing a user runs can turn it off). Before training, that process probes the model train.py
built: the dtype the first RMSNorm, a q-norm and the rotary tables give under the run's autocast,
printed as one `elementwise arm:` JSON line that the results keep, so a table row says what it ran.

Two real texts found offline on a Debian machine, built into corpora by data.py (4,096-token BPE,
5% of the documents held out as the test split by data.py's own hash rule, 2% validation):
- manpages (long documents): the English man pages of sections 1 (gcloud's 16k generated pages left out),
  2, 3, 5, 7 and 8 under /usr/share/man, rendered to plain text by `man -l` at 80 columns, one document
  per page, in a shuffled order, up to --text-bytes;
- changelog (short documents): Debian changelog entries, one per package version, from
  /usr/share/doc/*/changelog.Debian.gz, shuffled, up to --text-bytes.

Both arms of a (text, seed) pair train the same model (same initial weights, same data order) on the
same tokens; they run at the same time (--jobs 2), one torch thread each. Score: train.py's own test
evaluation at the end (metrics.jsonl's test_bits_per_byte, over every test block: --eval-tokens is
set to cover the whole split), under the arm's autocast. Target (issue 31): after/before within 0.5%.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tinyllm.common import ArgumentParser, UserError, atomic_write_json, run_main  # noqa: E402
from tinyllm.data import corpus_format  # noqa: E402

sys.path.insert(0, str(ROOT / "bench"))
from bench_texts import changelog_entries, make_corpus, man_pages, write_jsonl  # noqa: E402

WORK = ROOT / "bench" / "out" / "elementwise"
TEXTS = ("manpages", "changelog")
ARMS = ("before", "after")
TARGET = 0.005  # issue 31: held-out bpb within 0.5% of the code before it
PROBE_PREFIX = "elementwise arm: "


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--work", default=str(WORK), help="folder for the corpora, runs and results")
    parser.add_argument("--texts", default=",".join(TEXTS), help=f"comma list of texts: {', '.join(TEXTS)}")
    parser.add_argument("--seeds", default="1337,1338", help="comma list of seeds (model init and data order)")
    parser.add_argument("--arms", default=",".join(ARMS), help="comma list of arms: before, after")
    parser.add_argument("--preset", default="nano", help="model preset")
    parser.add_argument("--context", type=int, default=256, help="tokens per block")
    parser.add_argument("--batch-size", type=int, default=16, help="blocks per optimizer step (grad-accum 1)")
    parser.add_argument("--steps", type=int, default=150, help="optimizer steps per run (equal tokens for all)")
    parser.add_argument("--precision", default="bf16", choices=["bf16", "fp16"], help="train.py --precision")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run")
    parser.add_argument("--jobs", type=int, default=2, help="runs at the same time (the two arms of a pair)")
    parser.add_argument("--text-bytes", type=int, default=4_000_000, help="UTF-8 bytes of each text")
    parser.add_argument("--vocab-size", type=int, default=4096, help="data.py's BPE vocabulary")
    parser.add_argument(
        "--corpus",
        action="append",
        default=[],
        metavar="NAME=JSONL",
        help="another text: a JSONL of {'text': ...} documents (repeatable; the tests' tiny one)",
    )
    parser.add_argument(
        "--fresh", action="store_true", help="train again even where a run with the same command has results"
    )
    parser.add_argument("--results", default=None, help="results JSON (None: WORK/results.json)")
    return parser.parse_args(argv)


# ----------------------------------------------------------------------------------------------
# The arms: what runs inside each train.py process.


def disable_autocast_elementwise() -> None:
    """The `before` arm: build_training_model leaves the stock RMSNorm and RoPE forwards in place."""
    from tinyllm.model import config as model_config

    model_config.autocast_elementwise = lambda model: None


def probe_elementwise(model, dtype) -> dict:
    """The dtypes `model`'s first RMSNorm, first q-norm and rotary tables give under CPU autocast in
    `dtype` (inputs made without the RNG, so the run's random numbers are untouched)."""
    import torch

    norms = [module for module in model.modules() if type(module).__name__.endswith("RMSNorm")]
    q_norm = next(module for name, module in model.named_modules() if name.endswith("q_norm"))
    rotary = next(module for module in model.modules() if type(module).__name__.endswith("RotaryEmbedding"))
    hidden = torch.ones(1, 2, norms[0].weight.numel())
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
        norm_out = norms[0](hidden)
        q_out = q_norm(torch.ones(1, 2, q_norm.weight.numel(), dtype=dtype))
        cos, _ = rotary(hidden, torch.arange(2).unsqueeze(0))
    return {
        "norm_class": type(norms[0]).__name__,
        "norm_dtype": str(norm_out.dtype).replace("torch.", ""),
        "q_norm_dtype": str(q_out.dtype).replace("torch.", ""),
        "rope_dtype": str(cos.dtype).replace("torch.", ""),
    }


def run_arm(arm: str, train_argv: list[str]) -> int:
    """`train-arm ARM OPTIONS`: train.py's main with OPTIONS, autocast_elementwise off for `before`;
    the model it builds is probed and the probe printed as one line before training starts."""
    if arm not in ARMS:
        raise UserError(f"train-arm {arm}: choose from {', '.join(ARMS)}")
    import torch

    from tinyllm.model import config as model_config
    from tinyllm.training import train

    if arm == "before":
        disable_autocast_elementwise()
    build = model_config.build_training_model
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[train_argv[train_argv.index("--precision") + 1]]

    def build_and_probe(*args, **kwargs):
        model = build(*args, **kwargs)
        print(PROBE_PREFIX + json.dumps({"arm": arm, **probe_elementwise(model, dtype)}), flush=True)
        return model

    model_config.build_training_model = build_and_probe
    return train.main(train_argv)


# ----------------------------------------------------------------------------------------------
# The texts.


def build_corpus(name: str, args: argparse.Namespace, extra: dict[str, Path]) -> Path:
    """The corpus of text `name` (built once and reused while data.py's format and the settings stay)."""

    work = Path(args.work)
    corpus, source = work / f"corpus-{name}", work / f"{name}.jsonl"
    manifest, stamp = corpus / corpus_format.CORPUS_MANIFEST, corpus / "bench_settings.json"
    settings = {
        "format_version": corpus_format.FORMAT_VERSION,
        "vocab_size": args.vocab_size,
        "text_bytes": None if name in extra else args.text_bytes,
        "source": str(extra[name]) if name in extra else name,
    }
    if manifest.exists() and stamp.exists() and json.loads(stamp.read_text()) == settings:
        return corpus
    if corpus.exists():
        shutil.rmtree(corpus)  # built by an older data.py or other settings: the bench's own folder, rebuilt
    work.mkdir(parents=True, exist_ok=True)
    if name in extra:
        source = extra[name]
    else:
        print(f"{name}: gathering {args.text_bytes:,} bytes of text", flush=True)
        texts = man_pages(args.text_bytes) if name == "manpages" else changelog_entries(args.text_bytes)
        write_jsonl(source, texts)
    make_corpus([source], corpus, vocab_size=args.vocab_size)
    atomic_write_json(stamp, settings)
    return corpus


def corpus_facts(corpus: Path) -> dict:
    """Documents, tokens and the median document length in tokens of the train and test splits."""
    from tinyllm.training import train_data

    manifest = corpus_format.load_manifest(corpus)
    facts = {}
    for split in ("train", "test"):
        tokens = train_data.TokenSplit(corpus, manifest, split, 1, None, "masked")
        ends = [int(end) for end in tokens.ends]
        lengths = [b - a for a, b in zip([0] + ends, ends)]
        facts[split] = {
            "documents": len(lengths),
            "tokens": tokens.tokens,
            "median_document_tokens": int(statistics.median(lengths)) if lengths else 0,
        }
    return facts


# ----------------------------------------------------------------------------------------------
# The runs.


def train_argv(args: argparse.Namespace, corpus: Path, out: Path, seed: int) -> list[str]:
    return [
        "--data",
        str(corpus),
        "--out",
        str(out),
        "--resume",
        "none",
        "--preset",
        args.preset,
        "--context",
        str(args.context),
        "--batch-size",
        str(args.batch_size),
        "--grad-accum",
        "1",
        "--target-tokens",
        str(args.steps * args.batch_size * args.context),
        "--seed",
        str(seed),
        "--packing",
        "masked",
        "--precision",
        args.precision,
        "--device",
        "cpu",
        "--threads",
        str(args.threads),
        "--eval-every",
        "0",
        "--eval-tokens",
        str(10**9),
        "--save-every",
        "0",
        "--save-seconds",
        "0",
        "--log-every",
        "25",
        "--peak-tflops",
        "1",
        "--no-report",
    ]  # a nominal peak: no matmul measured at start


def code_version() -> str:
    """The code a run trains with: the last commit that changed the scripts at the repository root
    (train.py and its siblings; not bench/ or tests/), "+changes" when one of them differs from it."""

    def git(*command: str) -> str:
        return subprocess.run(["git", *command], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    commit = git("log", "-1", "--format=%h", "--", ":(glob)*.py") or "unknown"
    return commit + ("+changes" if git("status", "--porcelain", "--untracked-files=no", "--", ":(glob)*.py") else "")


def arm_command(args: argparse.Namespace, corpus: Path, name: str, seed: int, arm: str) -> tuple[list[str], Path]:
    """One arm's command line and run folder (RUNS/NAME-sSEED-ARM)."""
    out = Path(args.work) / "runs" / f"{name}-s{seed}-{arm}"
    return [sys.executable, str(Path(__file__).resolve()), "train-arm", arm] + train_argv(args, corpus, out, seed), out


def reusable(args: argparse.Namespace, corpus: Path, name: str, seed: int, arm: str) -> dict | None:
    """The results of an earlier run of the same command (None: none, or --fresh); its `code` says which
    code it trained with."""
    command, out = arm_command(args, corpus, name, seed, arm)
    done = out.with_suffix(".json")
    if args.fresh or not done.exists():
        return None
    result = json.loads(done.read_text())
    return result if result.get("command") == command[2:] else None


def start_run(args: argparse.Namespace, corpus: Path, name: str, seed: int, arm: str) -> dict:
    """One arm's train.py process (its run folder emptied first), its output to RUNS/NAME.log."""
    command, out = arm_command(args, corpus, name, seed, arm)
    if out.exists():
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    log = open(out.with_suffix(".log"), "w", encoding="utf-8")
    print(f"  start {name} seed {seed} {arm}: {' '.join(command[1:])}", flush=True)
    process = subprocess.Popen(
        command,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    return {
        "process": process,
        "log": log,
        "out": out,
        "command": command[2:],
        "started": time.time(),
        "code": code_version(),
    }


def finish_run(run: dict) -> dict:
    """Wait for a run; its probe line, final line and test record (a UserError when it failed)."""
    code = run["process"].wait()
    run["log"].close()
    out: Path = run["out"]
    lines = out.with_suffix(".log").read_text(encoding="utf-8").splitlines()
    if code:
        tail = "\n".join(lines[-15:])
        raise UserError(f"{out.name}: train.py exited with {code}; the end of {out.with_suffix('.log')}:\n{tail}")
    result = parse_run(lines, out / "metrics.jsonl")
    result.update(command=run["command"], seconds=time.time() - run["started"], code=run["code"])
    atomic_write_json(out.with_suffix(".json"), result)
    return result


def parse_run(lines: list[str], metrics_path: Path) -> dict:
    """The probe, the final line and metrics.jsonl's test record of one finished run."""
    probes = [json.loads(line[len(PROBE_PREFIX) :]) for line in lines if line.startswith(PROBE_PREFIX)]
    finals = [line for line in lines if line.lower().startswith("complete: ")]
    tests = [record for record in map(json.loads, metrics_path.read_text().splitlines()) if record["kind"] == "test"]
    if len(probes) != 1 or not finals or not tests:
        raise UserError(
            f"{metrics_path.parent.name}: expected one probe line, a `complete:` line and a test record "
            f"(got {len(probes)}, {len(finals)}, {len(tests)})"
        )
    test = tests[-1]
    evals = [record for record in map(json.loads, metrics_path.read_text().splitlines()) if record["kind"] == "eval"]
    return {
        "probe": probes[0],
        "final_line": finals[-1],
        "test_bits_per_byte": test["test_bits_per_byte"],
        "val_bits_per_byte": evals[-1]["val_bits_per_byte"] if evals else None,
        "test_loss": test["test_loss"],
        "test_bytes": test["test_bytes"],
        "tokens": test["tokens"],
        "step": test["step"],
    }


def run_all(args: argparse.Namespace) -> dict:
    extra = dict(item.split("=", 1) for item in args.corpus)
    extra = {name: Path(path) for name, path in extra.items()}
    texts = args.texts.split(",")
    for name in texts:
        if name not in TEXTS and name not in extra:
            raise UserError(f"--texts {name}: choose from {', '.join(TEXTS + tuple(extra))}")
    arms = args.arms.split(",")
    if any(arm not in ARMS for arm in arms):
        raise UserError(f"--arms {args.arms}: choose from {', '.join(ARMS)}")
    seeds = [int(seed) for seed in args.seeds.split(",")]
    results = {"settings": {key: value for key, value in vars(args).items() if key != "fresh"}, "texts": {}}
    for name in texts:
        corpus = build_corpus(name, args, extra)
        results["texts"][name] = {"corpus": str(corpus), "facts": corpus_facts(corpus), "runs": {}}
    pending = []
    for name, seed, arm in [(name, seed, arm) for name in texts for seed in seeds for arm in arms]:
        result = reusable(args, Path(results["texts"][name]["corpus"]), name, seed, arm)
        if result is None:
            pending.append((name, seed, arm))
        else:
            report_run(results, name, seed, arm, result, "reused")
    while pending:
        batch, pending = pending[: max(1, args.jobs)], pending[max(1, args.jobs) :]
        started = [(key, start_run(args, Path(results["texts"][key[0]]["corpus"]), *key)) for key in batch]
        for (name, seed, arm), run in started:
            report_run(results, name, seed, arm, finish_run(run), "trained")
    return results


def report_run(results: dict, name: str, seed: int, arm: str, result: dict, how: str) -> None:
    results["texts"][name]["runs"][f"{seed}-{arm}"] = result
    print(
        f"  {name} seed {seed} {arm} ({how}, {result.get('code', '?')}): test {result['test_bits_per_byte']:.4f} "
        f"bits/byte (norms {result['probe']['norm_dtype']}, RoPE {result['probe']['rope_dtype']}) | "
        f"{result['final_line']}",
        flush=True,
    )


def validation_ratio(before: dict, after: dict) -> str:
    """after/before of the validation bits per byte at the end (the other held-out split: its spread shows
    how far two runs that differ only in rounding drift apart); "-" without one."""
    if not before.get("val_bits_per_byte") or not after.get("val_bits_per_byte"):
        return "-"
    return f"{after['val_bits_per_byte'] / before['val_bits_per_byte']:.4f}"


def table(results: dict) -> list[str]:
    """One row per (text, seed): each arm's held-out bpb, after/before and the 0.5% verdict."""
    lines = [
        "| text | seed | tokens | before bpb | after bpb | after / before | within 0.5% "
        "| validation after / before | code (before, after) |",
        "|---|---|---:|---:|---:|---:|---|---:|---|",
    ]
    ratios = []
    for name, text in results["texts"].items():
        for seed in results["settings"]["seeds"].split(","):
            before, after = text["runs"].get(f"{seed}-before"), text["runs"].get(f"{seed}-after")
            if before is None or after is None:
                continue
            ratio = after["test_bits_per_byte"] / before["test_bits_per_byte"]
            ratios.append(ratio)
            lines.append(
                f"| {name} | {seed} | {after['tokens']:,} | {before['test_bits_per_byte']:.4f} | "
                f"{after['test_bits_per_byte']:.4f} | {ratio:.4f} | "
                f"{'yes' if abs(ratio - 1) <= TARGET else 'NO'} | {validation_ratio(before, after)} | "
                f"{before.get('code', '?')}, {after.get('code', '?')} |"
            )
    if ratios:
        worst = max(ratios, key=lambda ratio: abs(ratio - 1))
        verdict = "MET" if abs(worst - 1) <= TARGET else "NOT MET"
        lines.append(
            f"\ntarget: after/before within {100 * TARGET:.1f}% in every row: {verdict} "
            f"(worst {worst:.4f}, {100 * (worst - 1):+.2f}%)"
        )
    return lines


def probes(results: dict) -> list[str]:
    """What each arm ran, from the probes of its processes."""
    seen = {}
    for text in results["texts"].values():
        for run in text["runs"].values():
            probe = run["probe"]
            seen.setdefault(probe["arm"], set()).add(
                (probe["norm_class"], probe["norm_dtype"], probe["q_norm_dtype"], probe["rope_dtype"])
            )
    return [
        f"{arm}: "
        + "; ".join(
            f"{cls}, norm out {norm}, q-norm out {q}, RoPE tables {rope}" for cls, norm, q, rope in sorted(found)
        )
        for arm, found in seen.items()
    ]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train-arm"]:
        if len(argv) < 2:
            raise UserError("train-arm ARM TRAIN.PY-OPTIONS")
        return run_arm(argv[1], argv[2:])
    args = parse_args(argv)
    results = run_all(args)
    path = Path(args.results or Path(args.work) / "results.json")
    atomic_write_json(path, results)
    for name, text in results["texts"].items():
        facts = text["facts"]
        print(
            f"{name}: train {facts['train']['documents']:,} documents, {facts['train']['tokens']:,} tokens "
            f"(median {facts['train']['median_document_tokens']:,} per document); test "
            f"{facts['test']['documents']:,} documents, {facts['test']['tokens']:,} tokens"
        )
    print("\n".join(probes(results)))
    print("\n".join(table(results)))
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    run_main(main)
