"""train.py's Inductor options (hardware.INDUCTOR_OPTIONS): held-out bits per byte at equal tokens, with and without.

    python bench/bench_compile_quality.py                            # changelog, seeds 1337 and 1338
    python bench/bench_compile_quality.py --texts changelog --seeds 1337 --steps 20

hardware.INDUCTOR_OPTIONS raises Inductor's realize_reads_threshold, so a value several kernels use is
recomputed in each instead of written once; where that buffer was half precision, the users now see the fp32
value it was rounded from: on the T4's attention path (attention.EFFICIENT), the compiled gradients move by
bf16 rounding (up to 0.5% of an element's largest, 2 layers of think72's shape; the loss is bit for bit the
same), on CPU's masked path nothing moves. So the comparison is train.py `--compile` on CPU under `--precision
bf16`, `--packing masked`, on the T4's attention path (the memory-efficient varlen plan; on CPU its custom op
runs torch's CPU flash kernel one document at a time, varlen_ops.py):

- default: Inductor's own defaults (hardware.INDUCTOR_OPTIONS emptied in the training process);
- options: train.py as it is.

Each arm is a train.py process of its own, started by this script as `python bench/bench_compile_quality.py
train-arm ARM TRAIN.PY OPTIONS` (the switch lives here only). The texts, corpora and train.py options are
bench/bench_elementwise_quality.py's (its build_corpus and train_argv), plus `--compile`. Both arms of a (text,
seed) pair train the same model from the same seed on the same tokens, at the same time (one torch thread
each). Score: train.py's test evaluation at the end (metrics.jsonl's test_bits_per_byte, every test block).
Target (issue 46): options/default within 0.5%.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import bench_elementwise_quality as elementwise  # noqa: E402

from tinyllm.common import ArgumentParser, UserError, atomic_write_json, run_main  # noqa: E402

WORK = ROOT / "bench" / "out" / "compile_quality"
ARMS = ("default", "options")
TARGET = 0.005


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--work", default=str(WORK), help="folder for the corpora, runs and results")
    parser.add_argument("--texts", default="changelog", help="comma list of texts: manpages, changelog")
    parser.add_argument("--seeds", default="1337,1338", help="comma list of seeds (model init and data order)")
    parser.add_argument("--preset", default="nano", help="model preset")
    parser.add_argument("--context", type=int, default=256, help="tokens per block")
    parser.add_argument("--batch-size", type=int, default=16, help="blocks per optimizer step (grad-accum 1)")
    parser.add_argument("--steps", type=int, default=150, help="optimizer steps per run (equal tokens for all)")
    parser.add_argument("--precision", default="bf16", choices=["bf16", "fp16"], help="train.py --precision")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run")
    parser.add_argument("--text-bytes", type=int, default=4_000_000, help="UTF-8 bytes of each text")
    parser.add_argument("--vocab-size", type=int, default=4096, help="data.py's BPE vocabulary")
    parser.add_argument("--results", default=None, help="results JSON (None: WORK/results.json)")
    return parser.parse_args(argv)


def run_arm(arm: str, train_argv: list[str]) -> int:
    """`train-arm ARM OPTIONS`: train.py's main with OPTIONS on the memory-efficient varlen plan (the T4's),
    Inductor's defaults for `default`."""
    if arm not in ARMS:
        raise UserError(f"train-arm {arm}: choose from {', '.join(ARMS)}")
    from tinyllm.model import attention, hardware
    from tinyllm.training import train

    if arm == "default":
        hardware.INDUCTOR_OPTIONS = {}
    t4_path = attention.AttentionPlan(
        "efficient varlen", "cpu flash", attention.EFFICIENT, (), "bench: the T4's document path on CPU"
    )
    attention.attention_plans = lambda *args, **kwargs: [t4_path]
    print("compile arm: " + json.dumps({"arm": arm, "options": hardware.INDUCTOR_OPTIONS}), flush=True)
    return train.main(train_argv)


def arm_command(args: argparse.Namespace, corpus: Path, name: str, seed: int, arm: str) -> tuple[list[str], Path]:
    out = Path(args.work) / "runs" / f"{name}-s{seed}-{arm}"
    options = elementwise.train_argv(args, corpus, out, seed) + ["--compile"]
    return [sys.executable, str(Path(__file__).resolve()), "train-arm", arm, *options], out


def test_bits_per_byte(out: Path) -> float:
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    values = [line["test_bits_per_byte"] for line in lines if "test_bits_per_byte" in line]
    if not values:
        raise UserError(f"{out}: no test_bits_per_byte in metrics.jsonl")
    return values[-1]


def run_pair(args: argparse.Namespace, corpus: Path, name: str, seed: int) -> dict:
    """Both arms at once; each one's held-out bpb and wall time."""
    runs = {}
    for arm in ARMS:
        command, out = arm_command(args, corpus, name, seed, arm)
        out.parent.mkdir(parents=True, exist_ok=True)
        log = open(out.with_suffix(".log"), "w")
        runs[arm] = (subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT), out, log, time.time())
    result = {}
    for arm, (process, out, log, started) in runs.items():
        code = process.wait()
        log.close()
        if code:
            raise UserError(f"{name} seed {seed} arm {arm}: train.py exited {code} (see {out.with_suffix('.log')})")
        result[arm] = {"test_bits_per_byte": test_bits_per_byte(out), "seconds": round(time.time() - started)}
    result["ratio"] = result["options"]["test_bits_per_byte"] / result["default"]["test_bits_per_byte"]
    return result


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train-arm"]:
        if len(argv) < 2:
            raise UserError("train-arm ARM TRAIN.PY-OPTIONS")
        return run_arm(argv[1], argv[2:])
    args = parse_args(argv)
    results = {"settings": vars(args), "code": elementwise.code_version(), "pairs": {}}
    for name in args.texts.split(","):
        corpus = elementwise.build_corpus(name, args, {})
        for seed in (int(seed) for seed in args.seeds.split(",")):
            pair = run_pair(args, corpus, name, seed)
            results["pairs"][f"{name} {seed}"] = pair
            print(
                f"{name} seed {seed}: default {pair['default']['test_bits_per_byte']:.4f}, options "
                f"{pair['options']['test_bits_per_byte']:.4f} bpb: {pair['ratio']:.4f}x "
                f"({pair['default']['seconds']} / {pair['options']['seconds']} s)",
                flush=True,
            )
    worst = max(abs(pair["ratio"] - 1) for pair in results["pairs"].values())
    results["worst"] = worst
    verdict = "MET" if worst <= TARGET else "MISSED"
    print(f"options / default held-out bpb within {worst:.2%} (target {TARGET:.1%}): {verdict}")
    atomic_write_json(Path(args.results or Path(args.work) / "results.json"), results)
    return 0


if __name__ == "__main__":
    run_main(main)
