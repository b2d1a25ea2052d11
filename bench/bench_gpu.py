"""The first GPU's command: settles the open questions of issue 31 in one run of a few minutes.

    bash bench/gpu_check.sh OUTDIR                      # the one line to run on a lent card (budget 480 s)
    torchrun --nproc_per_node=$(nvidia-smi -L | wc -l) bench/bench_gpu.py --json OUTDIR/gpu.json --max-seconds 480
    python bench/bench_gpu.py --markdown-from OUTDIR/gpu.json   # the lines for bench/RESULTS.md again
    python bench/bench_gpu.py --device cpu --preset tiny --vocab 0 --context 32 ...   # tests/test_bench_gpu.py
    python bench/bench_gpu.py --predict-only            # the throughput prediction table of docs/training.md

It needs nothing beyond requirements.txt. The parts, in order of importance (PARTS; each starts only when
its estimate fits in what is left of --max-seconds, and its loops stop at its own share):

- versions: torch, CUDA, cuDNN, NCCL, Triton, transformers; SDPA's priority order and enabled backends,
  the backend SDPA would take (can_use_*) for think72's causal and masked calls; the plans of
  hardware.choose_precision / attention.choose_attention / hardware.newton_schulz_dtype;
- attention:kernels: each attention path once under torch.profiler: the backend and the kernel names
  that actually run (masked SDPA as transformers calls it today, flash varlen, efficient varlen, plain
  causal flash and efficient);
- attention:nan: cuDNN attention with a mask at seq_len 1088 (64 mod 128) and 1024: NaN in grad_q or not
  (pytorch #196678);
- attention:bench: each path at 8 x 1024 and 16 x 2048 (think72's heads), rows cut from a stream of
  documents of web-text-like lengths (sample_segments): forward + backward time, peak memory, the
  largest error of the output and gradients against an fp64 reference, the useful (per-document) TFLOP/s,
  and the time to build the mask (masked path) or the Documents (varlen paths) of the batch;
- newton_schulz: muon.newton_schulz over think72's 98 matrices per dtype (fp16, bf16, fp32): time,
  TFLOP/s and error against fp64;
- roofline:gemm / roofline:copy: think72's GEMM shapes (forward, input and weight gradients at micro-batch
  8 x 1024, the loss's chunk) in TFLOP/s, a long square matmul, and the copy / add bandwidth: the
  roofline's inputs, measured;
- step:MODE:B: train.py's own Training at micro-batch B (8, 32) and 65,536 tokens per step, eager then
  compiled: tokens/s, MFU, first-step loss (eager against compiled), Dynamo's graph breaks and
  recompiles, peak memory beside hardware.step_memory, and one profiled step's time split by category
  (matmul / attention / elementwise / optimizer / communication, kernel_category);
- fp16_vs_bf16: 150 steps from one seed in bf16 and in fp16 with fp16 Newton-Schulz forced (the T4 path,
  on a card that has both): the loss curves side by side;
- overflow, snapshot, resume: the fp16 overflow skips both optimizers; the staged snapshot equals the
  state; a save and resume through train.py's checkpoint code continues like the uninterrupted run.

Every part runs in its own try/except: an error (or CUDA out of memory) is recorded with its text and the
next part runs; parts that need CUDA are recorded as skipped on CPU with the reason. The JSON (--json) is
rewritten after every part (and while a long part runs), events go to a JSONL beside it, so a kill
still leaves the numbers so far. Under torchrun every rank runs every part (the steps are DDP, the
micro-benchmarks measure each rank's own card) and rank 0 writes. At the end it prints the markdown
lines to paste into bench/RESULTS.md. The model is the preset's shape at vocab 33,069 (--vocab) over the
demo corpus, built by data.py in a separate process while the first parts run.

This file is the command (the options, main, and Bench: every part of the plan); its parts live beside it,
one module per concept: gpu_plan.py (the parts, their estimates and the pure pieces), gpu_record.py (each
part's outcome, the JSON), gpu_measure.py (timing, profiling), gpu_bench.py (BenchContext: what every part
needs; the corpus), gpu_attention.py, gpu_roofline.py and gpu_steps.py (the parts by kind), gpu_report.py (the
facts and plan printed first, the markdown lines, the prediction table).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gpu_attention import AttentionParts  # noqa: E402
from gpu_bench import BenchContext, Corpus  # noqa: E402
from gpu_plan import DOCUMENT_MEDIAN, DOCUMENT_SIGMA, THINK72_VOCAB, parse_shape, part_seconds, plan_parts, split_list  # noqa: E402
from gpu_record import Recorder  # noqa: E402
from gpu_report import machine_facts, markdown_lines, prediction_table, print_plan  # noqa: E402
from gpu_roofline import RooflineParts  # noqa: E402
from gpu_steps import StepParts  # noqa: E402

from tinyllm.common import ArgumentParser, UserError, run_main  # noqa: E402
from tinyllm.model import config as model_config  # noqa: E402
from tinyllm.model import hardware  # noqa: E402
from tinyllm.training import distributed  # noqa: E402

PROCESS_STARTED = time.monotonic()  # the budget counts from here: gpu_check.sh's hard stop counts from the start


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--corpus",
        default=None,
        help="corpus folder built by data.py (None: build the demo corpus in a temporary folder)",
    )
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke run of the logic")
    parser.add_argument("--preset", default="think72", choices=list(model_config.PRESETS), help="the model")
    parser.add_argument("--vocab", type=int, default=THINK72_VOCAB, help="model vocabulary (0: the corpus tokenizer's)")
    parser.add_argument("--context", type=int, default=None, help="tokens per block (None: the preset's)")
    parser.add_argument(
        "--attention-shapes", default="8x1024,16x2048", help="comma list of ROWSxTOKENS for the attention parts"
    )
    parser.add_argument(
        "--document-median",
        type=float,
        default=DOCUMENT_MEDIAN,
        help="median document length (tokens) of the attention parts' rows (log-normal)",
    )
    parser.add_argument(
        "--document-sigma", type=float, default=DOCUMENT_SIGMA, help="sigma of the log-normal document lengths"
    )
    parser.add_argument("--step-batch-sizes", default="8,32", help="comma list of micro-batch sizes of the steps")
    parser.add_argument(
        "--step-tokens", type=int, default=65_536, help="tokens per optimizer step, all ranks (the grad-accum follows)"
    )
    parser.add_argument("--compile-modes", default="eager,compile", help="comma list of eager, compile")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per step part (compilation included)")
    parser.add_argument("--steps", type=int, default=3, help="timed optimizer steps per step part (median reported)")
    parser.add_argument("--compare-steps", type=int, default=150, help="steps of each run of fp16_vs_bf16")
    parser.add_argument("--compare-batch-size", type=int, default=8, help="micro-batch of fp16_vs_bf16 (grad-accum 1)")
    parser.add_argument(
        "--gemm-tokens",
        type=int,
        default=None,
        help="tokens of the GEMMs' micro-batch (None: 8 x the context on cuda, 64 on cpu)",
    )
    parser.add_argument(
        "--matmul-size", type=int, default=None, help="side of the square matmul (None: 8192 on cuda, 256 on cpu)"
    )
    parser.add_argument("--copy-mib", type=int, default=None, help="MiB copied (None: 1024 on cuda, 16 on cpu)")
    parser.add_argument("--check-batch-size", type=int, default=2, help="blocks per step of the checks")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats of each micro-benchmark (median)")
    parser.add_argument(
        "--peak-tflops", type=float, default=0, help="the card's dense peak for MFU (0: hardware.CARDS by GPU name)"
    )
    parser.add_argument(
        "--max-seconds",
        type=float,
        default=0,
        help="the budget: a part starts only when its estimate fits in what is left (0: none)",
    )
    parser.add_argument(
        "--collective-timeout",
        type=float,
        default=600,
        help="seconds a rank waits in a collective before the process ends (torchrun)",
    )
    parser.add_argument(
        "--json",
        default=None,
        help="write every figure here after each part (and events to NAME.events.jsonl beside it)",
    )
    parser.add_argument(
        "--only",
        default=None,
        metavar="PARTS",
        help="comma list: run only the parts whose names start with one of these (e.g. attention,step:eager)",
    )
    parser.add_argument(
        "--inject-failure", default=None, metavar="PART", help="raise in this part, to test that the others still run"
    )
    parser.add_argument(
        "--markdown-from",
        default=None,
        metavar="JSON",
        help="print the lines for bench/RESULTS.md from a gpu.json and exit",
    )
    parser.add_argument(
        "--predict-only", action="store_true", help="print the throughput prediction table (docs/training.md) and exit"
    )
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    defaults = {"matmul_size": 8192 if cuda else 256, "copy_mib": 1024 if cuda else 16}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    for name in (
        "document_median",
        "document_sigma",
        "steps",
        "warmup",
        "matmul_size",
        "check_batch_size",
        "compare_steps",
        "compare_batch_size",
        "copy_mib",
        "repeats",
        "step_tokens",
    ):
        if getattr(args, name) <= 0:
            raise UserError(f"--{name.replace('_', '-')} must be positive")
    if args.vocab < 0:
        raise UserError("--vocab must be 0 (the corpus') or a vocabulary size")
    args.attention_shapes = [parse_shape(text) for text in split_list(args.attention_shapes)]
    try:
        args.step_batch_sizes = [int(text) for text in split_list(args.step_batch_sizes)]
    except ValueError:
        raise UserError(f"--step-batch-sizes takes a comma list of integers, got {args.step_batch_sizes}") from None
    args.compile_modes = split_list(args.compile_modes)
    args.only = split_list(args.only) if args.only is not None else None
    if not args.compile_modes or set(args.compile_modes) - {"eager", "compile"}:
        raise UserError(f"--compile-modes takes a comma list of eager and compile, got {','.join(args.compile_modes)}")
    return args


class Bench(AttentionParts, RooflineParts, StepParts, BenchContext):
    """Every part of the plan, each a method of its concept's class (gpu_attention, gpu_roofline, gpu_steps)
    over what they all need (gpu_bench.BenchContext)."""

    def part(self, name: str):
        """The function of part `name`, run with its deadline set (twice its estimate, within the budget)."""
        if name.startswith("step:"):
            _, mode, size = name.split(":")
            function = lambda: self.step(mode == "compile", int(size))  # noqa: E731
        else:
            function = {
                "versions": self.versions,
                "attention:kernels": self.attention_kernels,
                "attention:nan": self.attention_nan,
                "attention:bench": self.attention_bench,
                "newton_schulz": self.newton_schulz,
                "roofline:gemm": self.gemm,
                "roofline:copy": self.copy,
                "fp16_vs_bf16": self.fp16_vs_bf16,
                "overflow": self.overflow,
                "snapshot": self.snapshot,
                "resume": self.resume,
            }[name]

        def run():
            self.deadline = time.monotonic() + 2 * part_seconds(name)
            if self.args.max_seconds:
                self.deadline = min(self.deadline, self.recorder.started + self.args.max_seconds)
            return function()

        return run


# ----------------------------------------------------------------------------------------------


def init_ranks(args: argparse.Namespace):
    """distributed.init_distributed, with the process group's timeout set to --collective-timeout first,
    and the start-up all-reduce (distributed.check_first_collective)."""
    import datetime

    import torch
    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        use_cuda = args.device == "cuda" and torch.cuda.is_available()
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if use_cuda:
            torch.cuda.set_device(local_rank)
        distributed.init_process_group(
            "nccl" if use_cuda else "gloo",
            timeout=datetime.timedelta(seconds=args.collective_timeout),
            device_id=torch.device("cuda", local_rank) if use_cuda else None,
        )
        info = distributed.init_distributed(args.device)
        distributed.check_first_collective(info)
        return info
    return distributed.init_distributed(args.device)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.predict_only:
        print("\n".join(prediction_table()))
        return 0
    if args.markdown_from:
        print("\n".join(markdown_lines(json.loads(Path(args.markdown_from).read_text()))))
        return 0
    warnings.filterwarnings("ignore")
    hardware.check_torch()
    info = init_ranks(args)
    try:
        facts = machine_facts(info, args)
        parts = plan_parts(args.step_batch_sizes, args.compile_modes, args.only)
        if info.is_main:
            print_plan(facts, parts)
        command = " ".join(
            [
                f"torchrun --nproc_per_node={info.world}" if info.world > 1 else "python",
                "bench/bench_gpu.py",
                *(sys.argv[1:] if argv is None else argv),
            ]
        )
        record = {"machine": facts, "command": command, "plan": parts, "parts": {}}
        recorder = Recorder(args, info, record, PROCESS_STARTED if argv is None else None)
        with tempfile.TemporaryDirectory(prefix="bench_gpu-") as temp:
            work = Path(distributed.broadcast_from_main(temp, info))
            corpus = Corpus(args, info, work)
            try:
                bench = Bench(args, info, corpus, work, recorder)
                for name in parts:
                    recorder.run(name, bench.part(name))
            finally:
                corpus.close()
        if info.is_main:
            print("\nfor bench/RESULTS.md:\n")
            print("\n".join(markdown_lines(record)))
            if args.json:
                print(f"\nwritten: {args.json} (and {recorder.events})")
        return 0
    finally:
        distributed.shutdown_distributed()


if __name__ == "__main__":
    run_main(main)  # a torchrun rank leaves without the interpreter's teardown (common.leave_without_teardown)
