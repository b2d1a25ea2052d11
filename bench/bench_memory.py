"""Step memory: think72 (vocab 33,069) one forward + backward on CPU, the full-logits loss against the chunked one.

    python bench/bench_memory.py                      # think72 at 8 x 1024, fp32, 2 threads: a few minutes

Each variant runs in a fresh subprocess (peaks never mix): the same seed builds the same model and batch,
then one forward and backward of the loss; the subprocess reports its resident memory just before the
step and its peak (ru_maxrss) after, and the loss and gradient norm. Variants:

- full: the loss before issue 19, `F.cross_entropy(model(input_ids).logits.float(), targets)`;
- chunked: `losses.language_model_loss` (the LM head and cross-entropy over chunks of tokens).

Beside the measured peaks it prints hardware.step_memory's estimate of the same step's gradients,
activations and logits (no optimizer in this step), to check the memory model on a real step.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tinyllm.common import ArgumentParser, UserError, run_main  # noqa: E402
from tinyllm.model import (  # noqa: E402
    attention,
    hardware,
    losses,
)
from tinyllm.model import config as model_config  # noqa: E402
from tinyllm.training import optimization  # noqa: E402

THINK72_VOCAB = 33_069
VARIANTS = ["full", "chunked"]
GIB = 2**30


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--preset", default="think72", choices=list(model_config.PRESETS), help="model shape")
    parser.add_argument("--vocab", type=int, default=THINK72_VOCAB, help="model vocabulary")
    parser.add_argument("--batch-size", type=int, default=8, help="blocks in the step")
    parser.add_argument("--context", type=int, default=1024, help="tokens per block")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"], help="CPU autocast or not")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--variant", default=None, choices=VARIANTS, help=argparse.SUPPRESS)  # a child's one
    args = parser.parse_args(argv)
    for name in ("vocab", "batch_size", "context", "threads"):
        if getattr(args, name) <= 0:
            raise UserError(f"--{name.replace('_', '-')} must be positive")
    return args


def resident_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def full_logits_loss(model, inputs, targets):
    """losses.language_model_loss before the chunked loss: the whole batch's logits, in fp32."""
    import torch.nn.functional as F

    logits = model(input_ids=inputs).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))


def run_variant(args: argparse.Namespace) -> dict:
    """One forward and backward in this process; what it held."""
    import torch

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    preset = model_config.resolve_preset(args.preset, context=args.context)
    model = model_config.build_model(preset, args.vocab)
    model.config.use_cache = False
    attention.use_attention(model, attention.MASKED)  # as train.py runs on CPU
    model.train()
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randint(0, args.vocab, (args.batch_size, args.context), generator=generator)
    targets = torch.randint(0, args.vocab, (args.batch_size, args.context), generator=generator)
    loss_function = full_logits_loss if args.variant == "full" else losses.language_model_loss
    before = resident_bytes()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16"):
        loss = loss_function(model, inputs, targets)
    loss.backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    grad_norm = torch.nn.utils.get_total_norm([parameter.grad for parameter in model.parameters()])
    return {
        "variant": args.variant,
        "loss": loss.item(),
        "grad_norm": grad_norm.item(),
        "resident_before": before,
        "peak": peak,
    }


def run_child(variant: str, argv: list[str]) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": argv[argv.index("--threads") + 1], "PYTHONWARNINGS": "ignore"}
    result = subprocess.run(
        [sys.executable, __file__, *argv, "--variant", variant], cwd=ROOT, env=env, capture_output=True, text=True
    )
    if result.returncode != 0:
        raise UserError(f"the {variant} variant failed (exit {result.returncode}): {result.stderr.strip()[-500:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def estimate(args: argparse.Namespace, chunk_tokens: int | None) -> int:
    """hardware.step_memory's gradients + activations + logits for this step (its weights exist before it)."""
    preset = model_config.resolve_preset(args.preset, context=args.context)
    memory = hardware.step_memory(
        preset,
        args.vocab,
        args.batch_size,
        args.context,
        args.precision,
        optimization.OPTIMIZERS["adamw"].state,
        False,
        chunk_tokens,
    )
    return memory.gradients + memory.activations + memory.logits


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.variant:
        print(json.dumps(run_variant(args)))
        return 0
    child_argv = [
        "--preset",
        args.preset,
        "--vocab",
        str(args.vocab),
        "--batch-size",
        str(args.batch_size),
        "--context",
        str(args.context),
        "--precision",
        args.precision,
        "--threads",
        str(args.threads),
    ]
    print(
        f"{args.preset} at vocab {args.vocab:,}, one forward + backward of {args.batch_size} x {args.context} "
        f"tokens, {args.precision}, {args.threads} threads; each variant in a fresh process",
        flush=True,
    )
    results = {}
    for variant in VARIANTS:
        results[variant] = run_child(variant, child_argv)
        print(f"  {variant}: done", flush=True)
    tokens = args.batch_size * args.context
    hidden = model_config.resolve_preset(args.preset, context=args.context).hidden
    chunk = hardware.logits_chunk_tokens(args.vocab, "cpu", hidden)  # the chunked variant runs on CPU
    models = {"full": estimate(args, tokens), "chunked": estimate(args, chunk)}
    print(
        f"\n{'variant':<9} {'loss':>12} {'grad norm':>12} {'RSS before':>11} {'peak RSS':>9} {'step adds':>10} "
        f"{'model says':>11}"
    )
    for variant, result in results.items():
        added = result["peak"] - result["resident_before"]
        print(
            f"{variant:<9} {result['loss']:>12.7f} {result['grad_norm']:>12.7f} "
            f"{result['resident_before'] / GIB:>10.2f}G {result['peak'] / GIB:>8.2f}G {added / GIB:>9.2f}G "
            f"{models[variant] / GIB:>10.2f}G"
        )
    full, chunked = results["full"], results["chunked"]
    print(
        f"\npeak: chunked / full = {chunked['peak'] / full['peak']:.3f}, "
        f"{(full['peak'] - chunked['peak']) / GIB:.2f} GiB lower"
    )
    print(
        f"loss: relative difference {abs(chunked['loss'] - full['loss']) / abs(full['loss']):.1e}; "
        f"gradient norm: {abs(chunked['grad_norm'] - full['grad_norm']) / full['grad_norm']:.1e}"
    )
    return 0


if __name__ == "__main__":
    run_main(main)
