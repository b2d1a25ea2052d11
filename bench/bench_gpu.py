"""GPU training speed: think72 tokens/s and MFU in bf16 and in fp16 + GradScaler, eager and --compile.

    python bench/bench_gpu.py --json gpu.json     # on a CUDA machine (never run on one yet)
    python bench/bench_gpu.py --device cpu --preset tiny --vocab 0 --precisions bf16 --steps 2 --warmup 1
                                                  # a smoke run of the logic on CPU

Each side is train.py's own `Training` (built as train.py builds it, `--device cuda`) stepping
`train_step()`: data, forward and backward under autocast, gradient scaling (fp16), clipping,
fused AdamW. Sides run one after another in one process (a GPU is not shared the way this
project's CPU machine is), each with `--warmup` untimed steps first (compilation happens there),
then `--steps` timed ones; medians are reported.

MFU is `flops_per_token * tokens/s` against the GPU's dense half-precision peak from train.py's
table (what train.py's own metrics use; --peak-tflops overrides), and also against a square
matmul of the same dtype measured in the same run (what the chip gives in practice).

The model is think72-shaped at vocab 33,069 (--vocab) over the demo corpus (built in a temporary
folder unless --corpus is given): its token ids are all valid in the larger vocabulary, so the
model has think72's 72,000,000 parameters and the step its work.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import gc
import json
import platform
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import data  # noqa: E402
import model_config  # noqa: E402
import train  # noqa: E402
from common import ArgumentParser, UserError, atomic_write_text, run_main  # noqa: E402

THINK72_VOCAB = 33_069
MATMUL_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0],
                            formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--corpus", default=None,
                        help="corpus folder built by data.py (None: build the demo corpus in a temporary folder)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke run of the logic")
    parser.add_argument("--preset", default="think72", choices=list(model_config.PRESETS), help="model shape")
    parser.add_argument("--vocab", type=int, default=THINK72_VOCAB,
                        help="model vocabulary (0: the corpus tokenizer's)")
    parser.add_argument("--context", type=int, default=None, help="tokens per block (None: the preset's)")
    parser.add_argument("--batch-size", type=int, default=16, help="blocks per micro-step")
    parser.add_argument("--grad-accum", type=int, default=1, help="micro-steps per optimizer step")
    parser.add_argument("--precisions", default="bf16,fp16", help="comma list of bf16, fp16, fp32")
    parser.add_argument("--compile-modes", default="eager,compile", help="comma list of eager, compile")
    parser.add_argument("--warmup", type=int, default=8, help="untimed steps per side (compilation included)")
    parser.add_argument("--steps", type=int, default=30, help="timed optimizer steps per side (median reported)")
    parser.add_argument("--matmul-size", type=int, default=8192, help="side of the square matmul for the peak")
    parser.add_argument("--peak-tflops", type=float, default=0,
                        help="the chip's dense half-precision peak (0: train.py's table by GPU name)")
    parser.add_argument("--json", default=None, help="also write every figure to this JSON file")
    args = parser.parse_args(argv)
    for name in ("batch_size", "grad_accum", "steps", "warmup", "matmul_size"):
        if getattr(args, name) <= 0:
            raise UserError(f"--{name.replace('_', '-')} must be positive")
    if args.vocab < 0:
        raise UserError("--vocab must be 0 (the corpus') or a vocabulary size")
    args.precisions = [item.strip() for item in args.precisions.split(",") if item.strip()]
    args.compile_modes = [item.strip() for item in args.compile_modes.split(",") if item.strip()]
    if not args.precisions or set(args.precisions) - set(MATMUL_DTYPES):
        raise UserError(f"--precisions takes a comma list of bf16, fp16 and fp32, got {','.join(args.precisions)}")
    if not args.compile_modes or set(args.compile_modes) - {"eager", "compile"}:
        raise UserError(f"--compile-modes takes a comma list of eager and compile, got {','.join(args.compile_modes)}")
    return args


def side_options(corpus: Path, args: argparse.Namespace, precision: str, compiled: bool) -> argparse.Namespace:
    argv = ["--data", str(corpus), "--out", "unused", "--device", args.device, "--preset", args.preset,
            "--batch-size", str(args.batch_size), "--grad-accum", str(args.grad_accum), "--precision", precision,
            "--epochs", "1000", "--warmup-steps", "10"]
    if args.context:
        argv += ["--context", str(args.context)]
    if args.peak_tflops:
        argv += ["--peak-tflops", str(args.peak_tflops)]
    if compiled:
        argv.append("--compile")
    return train.parse_args(argv)


def synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_peak(device, precision: str, size: int, tries: int = 10) -> float:
    """FLOP/s of the fastest of `tries` square matmuls in the precision's dtype."""
    import torch

    dtype = getattr(torch, MATMUL_DTYPES[precision])
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, device=device, dtype=dtype, generator=generator)
    b = torch.randn(size, size, device=device, dtype=dtype, generator=generator)
    for _ in range(3):
        torch.mm(a, b)
    best = float("inf")
    for _ in range(tries):
        synchronize(device)
        started = time.perf_counter()
        torch.mm(a, b)
        synchronize(device)
        best = min(best, time.perf_counter() - started)
    del a, b
    return 2 * size**3 / best


def run_side(corpus: Path, args: argparse.Namespace, info, precision: str, compiled: bool) -> dict:
    """Median tokens/s, MFU and peak memory of one (precision, compiled) side."""
    import torch

    options = side_options(corpus, args, precision, compiled)
    training = train.build_training(options, info, args.vocab or None)
    if info.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(info.device)
    started = time.perf_counter()
    training.train_step()
    first_step = time.perf_counter() - started
    for _ in range(args.warmup - 1):
        training.train_step()
    seconds, skipped_before = [], training.scaler.skipped_total
    for _ in range(args.steps):
        seconds.append(training.train_step().seconds)
    tokens_per_step = args.batch_size * args.grad_accum * training.context
    tokens_per_second = tokens_per_step / statistics.median(seconds)
    peak = train.peak_flops(options.session, info, precision)
    result = {
        "precision": precision, "compiled": compiled, "tokens_per_step": tokens_per_step,
        "first_step_seconds": first_step, "step_seconds": seconds, "tokens_per_second": tokens_per_second,
        "best_tokens_per_second": tokens_per_step / min(seconds), "flops_per_token": training.flops_per_token,
        "parameters": model_config.parameter_count(training.preset, training.vocab_size), "peak_flops": peak,
        "mfu": training.flops_per_token * tokens_per_second / peak if peak else None,
        "peak_memory_bytes": train.peak_memory_bytes(info.device),
        "overflow_skipped_steps": training.scaler.skipped_total - skipped_before,
        "attention": getattr(training, "sdpa", None),
    }
    del training
    gc.collect()
    torch._dynamo.reset()
    if info.device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def machine_facts(device) -> dict:
    import torch
    import transformers

    facts = {"date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "torch": torch.__version__,
             "transformers": transformers.__version__, "python": platform.python_version()}
    if device.type == "cuda":
        facts.update(gpu=torch.cuda.get_device_name(device), cuda=torch.version.cuda,
                     bf16_supported=torch.cuda.is_bf16_supported())
    else:
        facts.update(cpu=platform.processor() or platform.machine(), threads=torch.get_num_threads())
    return facts


def print_table(sides: list[dict], matmul: dict[str, float]) -> None:
    print(f"\n{'side':<14} {'tokens/s':>10} {'best':>10} {'MFU (table)':>12} {'MFU (matmul)':>13} "
          f"{'peak mem':>9} {'1st step':>9} {'skipped':>8}  attention")
    for side in sides:
        name = f"{side['precision']} {'compile' if side['compiled'] else 'eager'}"
        table = f"{100 * side['mfu']:.1f}%" if side["mfu"] else "n/a"
        measured = side["flops_per_token"] * side["tokens_per_second"] / matmul[side["precision"]]
        print(f"{name:<14} {side['tokens_per_second']:>10,.0f} {side['best_tokens_per_second']:>10,.0f} "
              f"{table:>12} {100 * measured:>12.1f}% {side['peak_memory_bytes'] / 2**30:>8.2f}G "
              f"{side['first_step_seconds']:>8.1f}s {side['overflow_skipped_steps']:>8}  {side['attention']}")
    for precision, flops in matmul.items():
        print(f"matmul {precision} (best of 10 square products): {flops / 1e12:,.1f} TFLOP/s")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    warnings.filterwarnings("ignore")
    info = train.init_distributed(args.device)
    facts = machine_facts(info.device)
    print("machine: " + ", ".join(f"{key} {value}" for key, value in facts.items()), flush=True)
    matmul = {precision: matmul_peak(info.device, precision, args.matmul_size) for precision in args.precisions}
    sides = []
    with tempfile.TemporaryDirectory(prefix="bench_gpu-") as temp:
        corpus = Path(args.corpus) if args.corpus else data.build_demo_corpus(Path(temp) / "corpus", progress=False)
        for precision in args.precisions:
            for mode in args.compile_modes:
                print(f"{precision} {mode}: {args.warmup} + {args.steps} steps ...", flush=True)
                sides.append(run_side(corpus, args, info, precision, compiled=mode == "compile"))
    preset = model_config.resolve_preset(args.preset, context=args.context)
    print(f"\n{args.preset} ({sides[0]['parameters']:,} parameters), context {preset.context}, "
          f"batch {args.batch_size} x grad-accum {args.grad_accum}, {sides[0]['flops_per_token'] / 1e6:.0f} "
          f"MFLOP/token; medians of {args.steps} steps")
    print_table(sides, matmul)
    if args.json:
        record = {"machine": facts, "argv": sys.argv[1:], "matmul_flops": matmul, "sides": sides}
        with contextlib.suppress(FileNotFoundError):
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(Path(args.json), json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    run_main(main)
