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
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import gc
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import checkpoint_store as store  # noqa: E402
import distributed  # noqa: E402
import hardware  # noqa: E402
import model_config  # noqa: E402
from common import ArgumentParser, UserError, append_jsonl, atomic_write_json, run_main  # noqa: E402

PROCESS_STARTED = time.monotonic()  # the budget counts from here: gpu_check.sh's hard stop counts from the start
THINK72_VOCAB = 33_069
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp64": "float64"}
# Seconds each part is expected to take at most (a T4's pace; an H200 is faster): a part starts only when
# its estimate fits in what is left of --max-seconds, and its loops stop after twice its estimate.
PART_SECONDS = {"versions": 5, "attention:kernels": 20, "attention:nan": 10, "attention:bench": 45,
                "newton_schulz": 10, "roofline:gemm": 20, "roofline:copy": 5, "step:eager": 45,
                "fp16_vs_bf16": 60, "step:compile": 150, "overflow": 20, "snapshot": 15, "resume": 30}
ATTENTION_PATHS = ("masked sdpa", "flash varlen", "efficient varlen", "causal flash", "causal efficient")
# Document lengths of a web-text-like corpus: log-normal, median 400 tokens (mean ~660; most documents
# shorter than a context, a tail of long ones cut across rows, as --packing masked cuts the stream).
DOCUMENT_MEDIAN, DOCUMENT_SIGMA = 400, 1.0
NAN_LENGTHS = (1088, 1024)  # 64 mod 128 (cuDNN's NaN case, pytorch #196678) and a control
CATEGORIES = ("matmul", "attention", "elementwise", "optimizer", "communication")
# Lower-case patterns of profiler kernel and op names, tried in this order (kernel_category). cuDNN's
# and the memory-efficient kernel's names carry "flash" / "cutlass": attention is tried before matmul.
# cuBLAS names its GEMMs "...gemm..." (cutlass, xmma, sm90_xmma) or, from 12.8 on Hopper, "nvjet_...".
CATEGORY_PATTERNS = [
    ("communication", re.compile(r"nccl|all_?reduce|allgather|all_gather|broadcast|c10d|gloo")),
    ("attention", re.compile(r"flash|fmha|attention|sdpa|_sdp_|mha_")),
    ("matmul", re.compile(r"gemm|gemv|cutlass|cublas|nvjet|xmma|wgmma|hmma|s1688|s16816|s884|splitk|"
                          r"triton_tem_fused_(?:addmm|mm|bmm)|^aten::(?:mm|addmm|bmm|baddbmm|matmul|linear|"
                          r"_addmm_activation)$")),
]
OPTIMIZER_RANGES = ("Optimizer.step", "Optimizer.zero_grad", "tinyllm.optimizer")
# Substrings of the profiler's op and kernel names that belong to attention (lower case), by kernel.
ATTENTION_KINDS = [  # cuDNN's kernel names say "flash" too: it is looked for first
    ("cudnn", ("cudnn_attention", "cudnn_generated_fort_native_sdpa", "cudnn")),
    ("flash", ("flash",)),
    ("efficient", ("efficient_attention", "fmha", "mem_efficient")),
    ("math", ("attention_math",)),
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", default=None,
                        help="corpus folder built by data.py (None: build the demo corpus in a temporary folder)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke run of the logic")
    parser.add_argument("--preset", default="think72", choices=list(model_config.PRESETS), help="the model")
    parser.add_argument("--vocab", type=int, default=THINK72_VOCAB, help="model vocabulary (0: the corpus tokenizer's)")
    parser.add_argument("--context", type=int, default=None, help="tokens per block (None: the preset's)")
    parser.add_argument("--attention-shapes", default="8x1024,16x2048",
                        help="comma list of ROWSxTOKENS for the attention parts")
    parser.add_argument("--document-median", type=float, default=DOCUMENT_MEDIAN,
                        help="median document length (tokens) of the attention parts' rows (log-normal)")
    parser.add_argument("--document-sigma", type=float, default=DOCUMENT_SIGMA,
                        help="sigma of the log-normal document lengths")
    parser.add_argument("--step-batch-sizes", default="8,32", help="comma list of micro-batch sizes of the steps")
    parser.add_argument("--step-tokens", type=int, default=65_536,
                        help="tokens per optimizer step, all ranks (the grad-accum follows)")
    parser.add_argument("--compile-modes", default="eager,compile", help="comma list of eager, compile")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per step part (compilation included)")
    parser.add_argument("--steps", type=int, default=3, help="timed optimizer steps per step part (median reported)")
    parser.add_argument("--compare-steps", type=int, default=150, help="steps of each run of fp16_vs_bf16")
    parser.add_argument("--compare-batch-size", type=int, default=8, help="micro-batch of fp16_vs_bf16 (grad-accum 1)")
    parser.add_argument("--gemm-tokens", type=int, default=None,
                        help="tokens of the GEMMs' micro-batch (None: 8 x the context on cuda, 64 on cpu)")
    parser.add_argument("--matmul-size", type=int, default=None,
                        help="side of the square matmul (None: 8192 on cuda, 256 on cpu)")
    parser.add_argument("--copy-mib", type=int, default=None, help="MiB copied (None: 1024 on cuda, 16 on cpu)")
    parser.add_argument("--check-batch-size", type=int, default=2, help="blocks per step of the checks")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats of each micro-benchmark (median)")
    parser.add_argument("--peak-tflops", type=float, default=0,
                        help="the card's dense peak for MFU (0: hardware.CARDS by GPU name)")
    parser.add_argument("--max-seconds", type=float, default=0,
                        help="the budget: a part starts only when its estimate fits in what is left (0: none)")
    parser.add_argument("--collective-timeout", type=float, default=600,
                        help="seconds a rank waits in a collective before the process ends (torchrun)")
    parser.add_argument("--json", default=None, help="write every figure here after each part (and events to "
                                                     "NAME.events.jsonl beside it)")
    parser.add_argument("--only", default=None, metavar="PARTS",
                        help="comma list: run only the parts whose names start with one of these "
                             "(e.g. attention,step:eager)")
    parser.add_argument("--inject-failure", default=None, metavar="PART",
                        help="raise in this part, to test that the others still run")
    parser.add_argument("--markdown-from", default=None, metavar="JSON",
                        help="print the lines for bench/RESULTS.md from a gpu.json and exit")
    parser.add_argument("--predict-only", action="store_true",
                        help="print the throughput prediction table (docs/training.md) and exit")
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    defaults = {"matmul_size": 8192 if cuda else 256, "copy_mib": 1024 if cuda else 16}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    for name in ("document_median", "document_sigma", "steps", "warmup", "matmul_size", "check_batch_size",
                 "compare_steps", "compare_batch_size",
                 "copy_mib", "repeats", "step_tokens"):
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


def split_list(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def parse_shape(text: str) -> tuple[int, int]:
    rows, _, tokens = text.lower().partition("x")
    try:
        shape = int(rows), int(tokens)
    except ValueError:
        raise UserError(f"--attention-shapes: {text!r} is not ROWSxTOKENS (e.g. 8x1024)") from None
    if min(shape) <= 0:
        raise UserError(f"--attention-shapes: {text!r} must be positive")
    return shape


# ----------------------------------------------------------------------------------------------
# The plan and the pure pieces (tested in tests/test_bench_gpu.py).


def plan_parts(batch_sizes: list[int], modes: list[str], only: list[str] | None = None) -> list[str]:
    """Part names in running order (importance first): the cheap answers, the eager steps, the precision
    comparison, the compiled steps, then the checks. `only`: the names starting with one of these."""
    parts = ["versions", "attention:kernels", "attention:nan", "attention:bench", "newton_schulz",
             "roofline:gemm", "roofline:copy"]
    if "eager" in modes:
        parts += [f"step:eager:{size}" for size in batch_sizes]
    parts.append("fp16_vs_bf16")
    if "compile" in modes:
        parts += [f"step:compile:{size}" for size in batch_sizes]
    parts += ["overflow", "snapshot", "resume"]
    return parts if only is None else [name for name in parts if any(name.startswith(prefix) for prefix in only)]


def part_seconds(name: str) -> float:
    """The estimate of a part (PART_SECONDS by its name, or by its name without the micro-batch)."""
    return PART_SECONDS.get(name) or PART_SECONDS[name.rsplit(":", 1)[0]]


def starts_in_budget(elapsed: float, estimate: float, budget: float) -> bool:
    """Whether a part of `estimate` seconds starts at `elapsed` under --max-seconds `budget` (0: no budget)."""
    return not budget or elapsed + estimate <= budget


def attention_path_problem(path: str, device: hardware.Device, precision: str, head_dim: int) -> str | None:
    """Why `path` cannot run on `device` in `precision` (None: it can), by torch's dispatch rules."""
    if path == "masked sdpa":
        return None
    if not device.is_cuda and path != "causal flash":
        return f"{path} needs CUDA (the CPU has SDPA's flash and math kernels only)"
    if "flash" in path and device.is_cuda:
        if device.capability < (8, 0):
            return f"flash attention needs sm_80+ ({device.label()})"
        if precision not in ("fp16", "bf16") or head_dim > 256 or head_dim % 8:
            return f"flash attention takes fp16/bf16 with head_dim <= 256, a multiple of 8 ({precision}, {head_dim})"
    if "efficient" in path and precision == "bf16" and not device.native_bf16:
        return f"the memory-efficient kernel takes bf16 from sm_80 only ({device.label()})"
    return None


def sample_segments(rows: int, context: int, seed: int, median: float = DOCUMENT_MEDIAN,
                    sigma: float = DOCUMENT_SIGMA) -> np.ndarray:
    """(rows, context) int32 segments as --packing masked's blocks carry them: a stream of documents of
    log-normal lengths (median `median` tokens, at least 1) cut into rows of `context` tokens from a random
    offset into the first, each row's documents numbered from 0."""
    rng = np.random.default_rng(seed)
    needed = rows * context
    lengths: list[np.ndarray] = []
    total = 0
    while total < needed + context:
        drawn = np.maximum(1, np.rint(rng.lognormal(math.log(median), sigma, size=max(16, needed // int(median)))))
        lengths.append(drawn.astype(np.int64))
        total += int(drawn.sum())
    lengths_all = np.concatenate(lengths)
    offset = int(rng.integers(0, lengths_all[0]))
    stream = np.repeat(np.arange(lengths_all.size, dtype=np.int64), lengths_all)[offset:offset + needed]
    blocks = stream.reshape(rows, context)
    return (blocks - blocks[:, :1]).astype(np.int32)


def row_lengths(segments: np.ndarray) -> list[list[int]]:
    """Each row's document lengths, in order."""
    return [np.bincount(row).tolist() for row in segments]


def kernel_category(name: str) -> str:
    """The category of a profiler kernel or op name: matmul, attention, communication, else elementwise
    (copies, norms, RoPE, activations, casts, reductions, the loss' softmax)."""
    lowered = name.lower()
    for category, pattern in CATEGORY_PATTERNS:
        if pattern.search(lowered):
            return category
    return "elementwise"


def split_by_category(items) -> dict[str, float]:
    """{category: milliseconds} of (name, microseconds, launched inside the optimizer) items: the
    optimizer's own kernels (Newton-Schulz matmuls included) are its category, the rest kernel_category's."""
    split = {category: 0.0 for category in CATEGORIES}
    for name, microseconds, in_optimizer in items:
        split["optimizer" if in_optimizer else kernel_category(name)] += microseconds / 1000
    return split


def compile_counts(compile_ids: list[str], counters: dict) -> dict:
    """Dynamo's compilations from the compile ids it started ("frame/recompile", "[attempt]" prefixes and
    "_restart" suffixes ignored) and its counters: graph breaks (and their first reasons), recompiles
    (a frame compiled again: its second number above 0)."""
    pairs = set()
    for compile_id in compile_ids:
        found = re.search(r"(\d+)/(\d+)", str(compile_id))
        if found:
            pairs.add((int(found.group(1)), int(found.group(2))))
    breaks = counters.get("graph_break", {})
    return {"frames_compiled": len(pairs), "recompiles": sum(1 for _, again in pairs if again > 0),
            "graph_breaks": int(sum(breaks.values())),
            "graph_break_reasons": [reason.strip().splitlines()[0][:160] for reason in list(breaks)[:5]],
            "unique_graphs": int(counters.get("stats", {}).get("unique_graphs", 0))}


def gemm_shapes(preset: model_config.Preset, vocab: int, tokens: int) -> list[tuple[str, int, int, int, int]]:
    """(name, m, k, n, count per micro-step) of the GEMMs of one forward and backward of `tokens` tokens:
    per linear (in k -> out n) the forward (tokens x k x n), the input gradient (tokens x n x k) and the
    weight gradient (n x tokens x k); q, k, v, o, gate, up, down in every layer, and the LM head over
    one chunk of the loss (hardware.logits_chunk_tokens) as many times as the tokens need."""
    q, kv = preset.heads * preset.head_dim, preset.kv_heads * preset.head_dim
    linears = [("q", preset.hidden, q, 1), ("k/v", preset.hidden, kv, 2), ("o", q, preset.hidden, 1),
               ("gate/up", preset.hidden, preset.intermediate, 2), ("down", preset.intermediate, preset.hidden, 1)]
    shapes = []
    for name, k, n, count in linears:
        per_step = count * preset.layers
        shapes += [(f"{name} forward", tokens, k, n, per_step), (f"{name} input grad", tokens, n, k, per_step),
                   (f"{name} weight grad", n, tokens, k, per_step)]
    chunk = min(tokens, hardware.logits_chunk_tokens(vocab))
    pieces = [(chunk, tokens // chunk)] + ([(tokens % chunk, 1)] if tokens % chunk else [])
    for rows, count in pieces:
        last = " (last chunk)" if rows != chunk else ""
        shapes += [(f"lm head forward{last}", rows, preset.hidden, vocab, count),
                   (f"lm head input grad{last}", rows, vocab, preset.hidden, count),
                   (f"lm head weight grad{last}", vocab, rows, preset.hidden, count)]
    return shapes


def attention_kernels(names: list[str]) -> dict:
    """The attention kernels among the profiler's op and kernel names: {"kinds": [...], "names": [...]}.

    A cutlass GEMM is not attention; the memory-efficient kernel's cutlass names carry "fmha"."""
    kinds, matched = [], []
    for name in names:
        lowered = name.lower()
        for kind, needles in ATTENTION_KINDS:
            if any(needle in lowered for needle in needles):
                matched.append(name)
                if kind not in kinds:
                    kinds.append(kind)
                break
    return {"kinds": kinds, "names": sorted(set(matched))[:12]}


def relative_difference(a, b) -> float:
    """max |a - b| / max |a| over two tensors (0 for equal ones)."""
    scale = a.abs().max().item()
    diff = (a.double() - b.double()).abs().max().item()
    return diff / scale if scale else diff


def curves_close(first: list[float], second: list[float], window: int = 10) -> dict:
    """Two loss curves side by side: the means of their last `window` steps, their relative difference,
    the largest difference of their `window`-step running means, and whether they stay within 2%."""
    steps = min(len(first), len(second))
    if steps == 0:
        return {"steps": 0, "close": False}
    window = max(1, min(window, steps))
    a, b = np.asarray(first[:steps]), np.asarray(second[:steps])
    kernel = np.ones(window) / window
    running = np.abs(np.convolve(a, kernel, "valid") - np.convolve(b, kernel, "valid"))
    last_a, last_b = float(a[-window:].mean()), float(b[-window:].mean())
    relative = abs(last_a - last_b) / max(abs(last_a), 1e-12)
    return {"steps": steps, "last_mean_first": last_a, "last_mean_second": last_b,
            "last_relative_difference": relative, "max_running_mean_difference": float(running.max()),
            "close": relative <= 0.02}


# ----------------------------------------------------------------------------------------------
# Recording: every part in its own try/except, the JSON rewritten after each.


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:400] if text else ''}"


class NotHere(Exception):
    """A part (or a path of one) that cannot run on this device: recorded as skipped with the reason."""


class Recorder:
    """Runs the parts on every rank, records their outcomes on rank 0 (JSON after each, JSONL events)."""

    def __init__(self, args: argparse.Namespace, info, record: dict, started: float | None = None):
        self.args, self.info, self.record = args, info, record
        self.started = time.monotonic() if started is None else started
        self.current: str | None = None
        self.json = Path(args.json) if args.json and info.is_main else None
        self.events = self.json.with_name(self.json.stem + ".events.jsonl") if self.json else None
        if self.json:
            self.json.parent.mkdir(parents=True, exist_ok=True)
            if self.events.exists():
                self.events.unlink()
        self.save()

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def save(self) -> None:
        if self.json:
            self.record["elapsed_seconds"] = round(self.elapsed(), 1)
            atomic_write_json(self.json, self.record)

    def partial(self, figures: dict) -> None:
        """A running part's figures so far, in the JSON (a kill keeps them)."""
        if self.current is not None:
            self.record["parts"][self.current] = {"status": "running", **figures}
            self.save()

    def event(self, **fields) -> None:
        if self.events:
            append_jsonl(self.events, {"time": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                                       "elapsed_seconds": round(self.elapsed(), 1), **fields})

    def log(self, message: str) -> None:
        if self.info.is_main:
            print(message, flush=True)

    def fits(self, estimate: float) -> bool:
        """Whether a part of `estimate` seconds starts now: rank 0 decides for every rank."""
        fits = starts_in_budget(self.elapsed(), estimate, self.args.max_seconds)
        return distributed.broadcast_from_main(fits, self.info)

    def run(self, name: str, function) -> dict:
        parts = self.record["parts"]
        estimate = part_seconds(name)
        if not self.fits(estimate):
            outcome = {"status": "skipped", "reason": f"--max-seconds {self.args.max_seconds:g}: "
                                                      f"{max(0.0, self.args.max_seconds - self.elapsed()):.0f} s "
                                                      f"left, {estimate:g} s estimated"}
            parts[name] = outcome
            self.event(part=name, **outcome)
            self.save()
            self.log(f"{name}: skipped ({outcome['reason']})")
            return outcome
        self.log(f"{name} ...")
        self.event(part=name, status="started")
        started = time.perf_counter()
        details = None
        self.current = name
        try:
            if self.args.inject_failure == name:
                raise RuntimeError(f"injected failure (--inject-failure {name})")
            figures = function()
            outcome = {"status": "ok" if figures.get("passed", True) else "failed", **figures}
        except NotHere as reason:
            outcome = {"status": "skipped", "reason": str(reason)}
        except Exception as error:  # noqa: BLE001 - every failure is a finding to record, never the end
            import torch

            oom = isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower()
            outcome = {"status": "oom" if oom else "error", "error": first_line(error)}
            frames = traceback.extract_tb(error.__traceback__)
            if frames:
                outcome["where"] = f"{Path(frames[-1].filename).name}:{frames[-1].lineno} ({frames[-1].name})"
            details = traceback.format_exc()
        self.current = None
        free_memory()
        outcome["seconds"] = round(time.perf_counter() - started, 2)
        outcome = self.gather(outcome)
        parts[name] = outcome
        self.event(part=name, **outcome, **({"traceback": details} if details else {}))
        self.save()
        self.log(f"{name}: {summary(outcome)}")
        return outcome

    def gather(self, outcome: dict) -> dict:
        """Rank 0's outcome, with every other rank's status (and error) when one differs."""
        if self.info.world == 1:
            return outcome
        import torch.distributed as dist

        every = [None] * self.info.world
        dist.all_gather_object(every, {key: outcome.get(key) for key in ("status", "error")})
        if any(other != every[0] for other in every):
            outcome = {**outcome, "ranks": every}
            if outcome["status"] == "ok":
                outcome["status"] = "error"
        return outcome


def summary(outcome: dict) -> str:
    if outcome["status"] in ("error", "oom"):
        return f"{outcome['status']}: {outcome.get('error')} ({outcome.get('seconds')} s)"
    shown = {key: value for key, value in outcome.items() if isinstance(value, (int, float, str, bool))
             and key not in ("status",)}
    text = ", ".join(f"{key} {format_value(value)}" for key, value in list(shown.items())[:10])
    return f"{outcome['status']}: {text}"


def format_value(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def free_memory() -> None:
    import torch

    gc.collect()
    if "torch._dynamo" in sys.modules:  # compiled parts leave their graphs (importing it costs seconds)
        torch._dynamo.reset()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------------
# Measuring.


def time_on_device(function, device, repeats: int = 5, warmup: int = 2) -> float:
    """Median seconds of `function()` after `warmup` untimed calls: CUDA events on a GPU, perf_counter on CPU."""
    import torch

    for _ in range(warmup):
        function()
    seconds = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            function()
            end.record()
            end.synchronize()
            seconds.append(start.elapsed_time(end) / 1000)
        else:
            started = time.perf_counter()
            function()
            seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


def host_seconds(function, repeats: int = 5) -> float:
    """Median wall seconds of `function()` (host work, a CUDA sync inside if it needs one)."""
    seconds = []
    for _ in range(repeats + 1):
        started = time.perf_counter()
        function()
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds[1:])


class OptimizerTimer:
    """Times each call of `training.optimizer.parts[name].step` (CUDA events on a GPU, read only in
    seconds(): no sync of its own inside the step)."""

    def __init__(self, training, name: str, device):
        self.device, self.marks = device, []
        optimizer = training.optimizer.parts.get(name)
        if optimizer is None:
            return
        step = optimizer.step

        def timed(*args, **kwargs):
            start = self.mark()
            result = step(*args, **kwargs)
            self.marks.append((start, self.mark()))
            return result

        optimizer.step = timed

    def mark(self):
        import torch

        if self.device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def clear(self) -> None:
        self.marks = []

    def seconds(self) -> list[float]:
        if self.device.type != "cuda":
            return [end - start for start, end in self.marks]
        if self.marks:
            self.marks[-1][1].synchronize()
        return [start.elapsed_time(end) / 1000 for start, end in self.marks]


def in_optimizer(event) -> bool:
    """Whether a profiler event ran inside an optimizer range (OPTIMIZER_RANGES), itself or an ancestor."""
    while event is not None:
        if event.name.startswith(OPTIMIZER_RANGES):
            return True
        event = event.cpu_parent
    return False


def profiled_items(profiler, cuda: bool) -> tuple[list[tuple[str, float, bool]], float]:
    """(name, microseconds, inside the optimizer) of what one profiled step ran, and the device time no
    op claimed: on CUDA every kernel (attached to the op that launched it), on CPU each aten op's self time."""
    from torch.autograd import DeviceType

    items, claimed, total = [], 0.0, 0.0
    for event in profiler.events():
        if cuda:
            if event.device_type == DeviceType.CPU:
                for kernel in event.kernels:
                    items.append((kernel.name, float(kernel.duration), in_optimizer(event)))
                    claimed += kernel.duration
            elif event.device_type == DeviceType.CUDA:
                total += event.time_range.end - event.time_range.start
        elif event.device_type == DeviceType.CPU and event.name.startswith("aten::"):
            items.append((event.name, float(event.self_cpu_time_total), in_optimizer(event)))
    return items, max(0.0, total - claimed)


@contextlib.contextmanager
def optimizer_ranges(training):
    """The optimizer's part of train_step outside optimizer.step (the unscale, the gradient norm and clip,
    zero_grad) inside a "tinyllm.optimizer" profiler range, as the roofline counts them."""
    import torch

    import optimization

    def ranged(function):
        def call(*args, **kwargs):
            with torch.profiler.record_function("tinyllm.optimizer"):
                return function(*args, **kwargs)
        return call

    clip = optimization.clip_gradients
    optimization.clip_gradients = ranged(clip)
    training.scaler.unscale_ = ranged(training.scaler.unscale_)
    training.optimizer.zero_grad = ranged(training.optimizer.zero_grad)
    try:
        yield
    finally:
        optimization.clip_gradients = clip
        del training.scaler.unscale_, training.optimizer.zero_grad


def profile_step(training, device) -> dict:
    """One more training step under torch.profiler: its time split by category (ms), the attention
    kernels seen, and the ten costliest kernels (or CPU ops)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with optimizer_ranges(training), profile(activities=activities) as profiler:
        training.train_step()
    items, unclaimed = profiled_items(profiler, cuda)
    split = split_by_category(items)
    by_name: dict[str, float] = {}
    for name, microseconds, _ in items:
        by_name[name] = by_name.get(name, 0.0) + microseconds / 1000
    top = sorted(by_name.items(), key=lambda item: -item[1])[:10]
    return {"split_ms": split, "unattributed_ms": unclaimed / 1000, "split_of": "kernels" if cuda else "cpu ops",
            "top_ms": [[name[:120], round(ms, 3)] for name, ms in top],
            **{f"attention_{key}": value for key, value in attention_kernels(list(by_name)).items()}}


class CompileWatch:
    """Dynamo's compile ids and counters from here on (compile_counts)."""

    def __init__(self):
        from torch._dynamo.callback import callback_handler
        from torch._dynamo.utils import counters

        counters.clear()
        self.ids: list[str] = []
        self.handler = callback_handler
        callback_handler.register_start_callback(self.callback)

    def callback(self, *args) -> None:
        """A compile started (torch passes CallbackArgs with its compile id; an older torch nothing)."""
        self.ids.append(str(getattr(args[0], "compile_id", "?")) if args else "?")

    def counts(self) -> dict:
        from torch._dynamo.utils import counters

        return {**compile_counts(self.ids, {key: dict(value) for key, value in counters.items()}),
                "compile_starts": len(self.ids)}

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.handler.remove_start_callback(self.callback)


# ----------------------------------------------------------------------------------------------
# The corpus: data.py's demo, built in its own process while the first parts run.


class Corpus:
    """The corpus folder of the step parts: --corpus, or the demo corpus that rank 0 starts building at
    once in a separate process (CPU work off the GPU's clock), waited for when a part first needs it."""

    def __init__(self, args: argparse.Namespace, info, work: Path):
        self.info, self.folder, self.process, self.ready = info, Path(args.corpus) if args.corpus else None, None, None
        if self.folder is None and info.is_main:
            self.folder = work / "corpus"
            self.log = work / "corpus.log"
            with open(self.log, "w") as log:
                self.process = subprocess.Popen([sys.executable, str(ROOT / "data.py"), "--demo", "--out",
                                                 str(self.folder)], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)

    def path(self) -> Path:
        if self.ready is None:
            self.ready = Path(distributed.main_decides(self.wait, self.info))
        return self.ready

    def wait(self) -> str:
        if self.process is not None and self.process.wait() != 0:
            tail = self.log.read_text()[-600:].strip().replace("\n", " | ")
            raise UserError(f"building the demo corpus failed (exit {self.process.returncode}): {tail}")
        return str(self.folder)

    def close(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()


# ----------------------------------------------------------------------------------------------
# The parts.


def layer_stub(implementation: str, groups: int):
    """What attention.py's and transformers' attention functions read of a decoder layer."""
    from types import SimpleNamespace

    return SimpleNamespace(config=SimpleNamespace(_attn_implementation=implementation), num_key_value_groups=groups,
                           is_causal=True)


class Bench:
    """What every part needs: the options, the rank, the corpus, the device's description, the budget."""

    def __init__(self, args: argparse.Namespace, info, corpus: Corpus, work: Path, recorder: Recorder):
        self.args, self.info, self.corpus, self.work, self.recorder = args, info, corpus, work, recorder
        self.device = hardware.describe(info.device)
        self.vocab = args.vocab or None
        self.preset = model_config.resolve_preset(args.preset, context=args.context)
        self.precision = hardware.choose_precision("auto", self.device).value
        self.deadline = math.inf

    def part(self, name: str):
        """The function of part `name`, run with its deadline set (twice its estimate, within the budget)."""
        if name.startswith("step:"):
            _, mode, size = name.split(":")
            function = lambda: self.step(mode == "compile", int(size))  # noqa: E731
        else:
            function = {"versions": self.versions, "attention:kernels": self.attention_kernels,
                        "attention:nan": self.attention_nan, "attention:bench": self.attention_bench,
                        "newton_schulz": self.newton_schulz, "roofline:gemm": self.gemm, "roofline:copy": self.copy,
                        "fp16_vs_bf16": self.fp16_vs_bf16, "overflow": self.overflow, "snapshot": self.snapshot,
                        "resume": self.resume}[name]

        def run():
            self.deadline = time.monotonic() + 2 * part_seconds(name)
            if self.args.max_seconds:
                self.deadline = min(self.deadline, self.recorder.started + self.args.max_seconds)
            return function()

        return run

    def time_up(self) -> bool:
        """Whether this part's deadline has passed (rank 0 decides for every rank)."""
        return distributed.broadcast_from_main(time.monotonic() > self.deadline, self.info)

    def options(self, preset: str, precision: str, compiled: bool = False, batch_size: int = 8,
                grad_accum: int = 1, out: Path | None = None, extra: list[str] | None = None):
        import train

        argv = ["--data", str(self.corpus.path()), "--out", str(out or self.work / "unused"),
                "--device", self.args.device, "--preset", preset, "--batch-size", str(batch_size),
                "--grad-accum", str(grad_accum), "--precision", precision, "--epochs", "1000", "--warmup-steps", "10",
                *(extra or [])]
        if self.args.context:
            argv += ["--context", str(self.args.context)]
        if compiled:
            argv.append("--compile")
        elif "--no-compile" in train.build_parser()._option_string_actions:  # should compile become the default
            argv.append("--no-compile")
        return train.parse_args(argv)

    def build(self, options):
        import train

        return train.build_training(options, self.info, self.vocab)

    def synchronize(self) -> None:
        import torch

        if self.info.device.type == "cuda":
            torch.cuda.synchronize(self.info.device)

    def peak_flops(self, precision: str) -> float | None:
        if self.args.peak_tflops:
            return self.args.peak_tflops * 1e12
        tflops = hardware.peak_tflops(self.device, precision)
        return tflops * 1e12 if tflops else None

    def dtype(self, name: str | None = None):
        import torch

        return getattr(torch, DTYPES[name or self.precision])

    def needs_cuda(self, what: str) -> None:
        if not self.device.is_cuda:
            raise NotHere(f"{what} needs CUDA")

    # -- versions and SDPA's choice ------------------------------------------------------------

    def versions(self) -> dict:
        """The software, and what SDPA itself would pick for think72's two kinds of calls."""
        import torch

        found = {"torch": torch.__version__, "cuda": torch.version.cuda,
                 "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
                 "sdpa_priority": sdpa_priority()}
        with contextlib.suppress(Exception):
            found["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if self.device.is_cuda else None
        with contextlib.suppress(ImportError):
            import triton

            found["triton"] = triton.__version__
        found["sdpa_enabled"] = {"flash": torch.backends.cuda.flash_sdp_enabled(),
                                 "efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
                                 "cudnn": torch.backends.cuda.cudnn_sdp_enabled(),
                                 "math": torch.backends.cuda.math_sdp_enabled()}
        if not self.device.is_cuda:
            found["sdpa_choice"] = "n/a on CPU (can_use_* are CUDA's rules)"
            return found
        preset, dtype = self.preset, self.dtype()
        choice = {}
        for case, (length, masked) in {"causal, grouped heads": (preset.context, False),
                                       "masked, heads repeated": (preset.context, True),
                                       "masked at 1088": (1088, True)}.items():
            q = torch.randn(2, preset.heads, length, preset.head_dim, device=self.info.device, dtype=dtype)
            kv_heads = preset.heads if masked else preset.kv_heads
            k = torch.randn(2, kv_heads, length, preset.head_dim, device=self.info.device, dtype=dtype)
            mask = torch.ones(2, 1, length, length, dtype=torch.bool, device=self.info.device).tril() \
                if masked else None
            try:
                choice[case] = sdpa_choice(q, k, k, mask, causal=not masked, gqa=not masked)
            except Exception as error:  # noqa: BLE001 - one case's failure is its finding
                choice[case] = {"ran": first_line(error)}
        found["sdpa_choice"] = choice
        return found

    # -- attention: which kernels run, the NaN case, the micro-benchmark -------------------------

    def attention_inputs(self, rows: int, tokens: int, seed: int = 0) -> dict:
        """q, k, v (leaves laid out (B, C, H, D) as the projections give them), the output gradient, the
        segments of realistic documents, their mask and Documents, on the device."""
        import torch

        import attention

        preset = self.preset
        generator = torch.Generator(device=self.info.device).manual_seed(seed)
        make = lambda heads: (torch.randn(rows, tokens, heads, preset.head_dim, device=self.info.device,  # noqa: E731
                                          generator=generator) * 0.5).to(self.dtype()).requires_grad_()
        segments = sample_segments(rows, tokens, seed, self.args.document_median, self.args.document_sigma)
        documents = attention.documents_of(segments).to(self.info.device)
        return {"q": make(preset.heads), "k": make(preset.kv_heads), "v": make(preset.kv_heads),
                "grad": torch.randn(rows, tokens, preset.heads, preset.head_dim, device=self.info.device,
                                    generator=generator).to(self.dtype()),
                "segments": segments, "documents": documents, "mask": attention.document_mask(documents.segments)}

    def attention_call(self, path: str, inputs: dict):
        """One layer's attention by `path`, as training calls it: (B, C, H, D)."""
        from torch.nn.attention import SDPBackend, sdpa_kernel

        import attention

        q, k, v = (inputs[name].transpose(1, 2) for name in ("q", "k", "v"))
        groups, scale = self.preset.heads // self.preset.kv_heads, self.preset.head_dim ** -0.5
        if path == "masked sdpa":  # today's: transformers' sdpa with the boolean mask, SDPA's own backend
            return attention.masked_attention(layer_stub(attention.MASKED, groups), q, k, v, inputs["mask"],
                                              scaling=scale)[0]
        implementation = attention.FLASH if "flash" in path else attention.EFFICIENT
        stub = layer_stub(implementation, groups)
        if attention.kernel(path).boundaries:
            documents = inputs["documents"]
            return attention.varlen_attention(stub, q, k, v, None, scaling=scale, document_starts=documents.cu_seqlens,
                                              longest_document=documents.longest)[0]
        backend = SDPBackend.FLASH_ATTENTION if "flash" in path else SDPBackend.EFFICIENT_ATTENTION
        with sdpa_kernel([backend]):
            return attention.varlen_attention(stub, q, k, v, None, scaling=scale)[0]

    def attention_step(self, path: str, inputs: dict) -> None:
        for name in ("q", "k", "v"):
            inputs[name].grad = None
        self.attention_call(path, inputs).backward(inputs["grad"])

    def runnable_paths(self) -> dict[str, str | None]:
        return {path: attention_path_problem(path, self.device, self.precision, self.preset.head_dim)
                for path in ATTENTION_PATHS}

    def attention_kernels(self) -> dict:
        """Each path's forward + backward once under the profiler: the kernels that actually run."""
        import torch
        from torch.profiler import ProfilerActivity, profile

        rows, tokens = self.args.attention_shapes[0]
        inputs = self.attention_inputs(rows, tokens)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.is_cuda else [])
        result = {"shape": f"{rows}x{tokens}", "precision": self.precision, "paths": {}}
        for path, problem in self.runnable_paths().items():
            if problem:
                result["paths"][path] = {"status": "skipped", "reason": problem}
                continue
            try:
                self.attention_step(path, inputs)  # compiled kernels loaded before the profile
                with profile(activities=activities) as profiler:
                    self.attention_step(path, inputs)
                    self.synchronize()
                names = sorted({event.key for event in profiler.key_averages()})
                kernels = [name for name in names if kernel_category(name) == "attention"]
                result["paths"][path] = {"status": "ok", **attention_kernels(names), "attention_names": kernels[:8]}
            except Exception as error:  # noqa: BLE001 - one path's failure is its finding
                result["paths"][path] = {"status": "error", "error": first_line(error)}
            if self.device.is_cuda:
                torch.cuda.empty_cache()
            self.recorder.partial(result)
        return result

    def attention_nan(self) -> dict:
        """cuDNN attention with a boolean mask at 1088 (64 mod 128) and 1024 tokens: NaN in the gradients?"""
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel

        import attention

        self.needs_cuda("cuDNN attention")
        preset, result = self.preset, {"precision": self.precision, "lengths": {}}
        for length, precision in [(length, precision) for precision in dict.fromkeys([self.precision, "fp16"])
                                  for length in NAN_LENGTHS]:
            generator = torch.Generator(device=self.info.device).manual_seed(0)
            q, k, v = (torch.randn(2, preset.heads, length, preset.head_dim, device=self.info.device,
                                   generator=generator).to(self.dtype(precision)).requires_grad_() for _ in range(3))
            segments = torch.zeros(2, length, dtype=torch.int32, device=self.info.device)
            segments[:, length // 3:] = 1
            mask = attention.document_mask(segments)
            try:
                with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
                out.backward(torch.randn_like(out))
                self.synchronize()
                result["lengths"][f"{length} {precision}"] = {
                    "nan_output": bool(out.isnan().any()), "nan_grad_q": bool(q.grad.isnan().any()),
                    "nan_grad_k": bool(k.grad.isnan().any()), "nan_grad_v": bool(v.grad.isnan().any())}
            except Exception as error:  # noqa: BLE001 - a card without cuDNN attention says so here
                result["lengths"][f"{length} {precision}"] = {"error": first_line(error)}
        return result

    def attention_bench(self) -> dict:
        """Every path at every --attention-shapes: forward + backward, memory, error, prepare time."""
        import torch

        import attention

        preset, result = self.preset, {"precision": self.precision, "document_median": self.args.document_median,
                                       "document_sigma": self.args.document_sigma, "shapes": {}}
        for rows, tokens in self.args.attention_shapes:
            shape = f"{rows}x{tokens}"
            inputs = self.attention_inputs(rows, tokens)
            lengths = row_lengths(inputs["segments"])
            counts = [len(row) for row in lengths]
            figures = {"documents_per_row": statistics.mean(counts),
                       "mean_document_tokens": rows * tokens / sum(counts),
                       "longest_document": inputs["documents"].longest, "paths": {}}
            result["shapes"][shape] = figures
            useful = sum(attention.attention_flops("flash varlen", row, tokens, preset.heads, preset.head_dim)
                         for row in lengths)
            checked = min(rows, 2)
            references = {kind: self.attention_reference(inputs, checked, kind) for kind in ("documents", "causal")}
            for path, problem in self.runnable_paths().items():
                if problem:
                    figures["paths"][path] = {"status": "skipped", "reason": problem}
                    continue
                if self.time_up():
                    figures["paths"][path] = {"status": "skipped", "reason": "the part's time is spent"}
                    continue
                try:
                    figures["paths"][path] = self.attention_path(path, inputs, references, checked, useful, lengths)
                except Exception as error:  # noqa: BLE001 - one path's failure is its finding
                    figures["paths"][path] = {"status": "oom" if "out of memory" in str(error).lower() else "error",
                                              "error": first_line(error)}
                if self.device.is_cuda:
                    torch.cuda.empty_cache()
                self.recorder.partial(result)
            del inputs, references
            free_memory()
        return result

    def attention_path(self, path: str, inputs: dict, references: dict, checked: int, useful: float,
                       lengths: list[list[int]]) -> dict:
        import torch

        import attention

        preset = self.preset
        rows, tokens = inputs["segments"].shape
        seconds = time_on_device(lambda: self.attention_step(path, inputs), self.info.device, self.args.repeats)
        peak = None
        if self.device.is_cuda:
            for name in ("q", "k", "v"):
                inputs[name].grad = None
            self.synchronize()
            torch.cuda.reset_peak_memory_stats(self.info.device)
            base = torch.cuda.memory_allocated(self.info.device)
            self.attention_step(path, inputs)
            self.synchronize()
            peak = torch.cuda.max_memory_allocated(self.info.device) - base
        self.attention_step(path, inputs)
        output = self.attention_call(path, inputs).detach()
        reference = references["documents" if attention.kernel(path).exact else "causal"]
        errors = {"output": relative_difference(reference["output"], output[:checked])}
        for name in ("q", "k", "v"):
            errors[f"grad_{name}"] = relative_difference(reference[name], inputs[name].grad[:checked])
        segments = inputs["segments"]
        if attention.kernel(path).exact:  # the data reader's Documents (positions, cu_seqlens)
            prepare = host_seconds(lambda: attention.documents_of(segments).to(self.info.device), self.args.repeats)
            prepared = "documents_of on the host + copy"
            if path == "masked sdpa":  # and the mask, built on the device in every forward
                prepare += time_on_device(lambda: attention.document_mask(inputs["documents"].segments),
                                          self.info.device, self.args.repeats)
                prepared += ", document_mask on the device"
        else:
            prepare, prepared = 0.0, "none (plain causal: no mask, no documents)"
        computed = sum(attention.attention_flops(path, row, tokens, preset.heads, preset.head_dim) for row in lengths)
        return {"status": "ok", "forward_backward_ms": 1000 * seconds, "peak_memory_bytes": peak,
                "max_error": max(errors.values()), "errors": errors, "prepare_ms": 1000 * prepare,
                "prepared": prepared, "per_micro_batch_ms": 1000 * (preset.layers * seconds + prepare),
                "useful_tflops": useful / seconds / 1e12, "computed_over_useful": computed / useful,
                "exact": attention.kernel(path).exact}

    def attention_reference(self, inputs: dict, rows: int, kind: str) -> dict:
        """fp64 output and gradients of the first `rows` rows: per-document causal ("documents") or
        causal over the whole row ("causal"), by the softmax written out, the K/V heads repeated."""
        import torch

        groups, scale = self.preset.heads // self.preset.kv_heads, self.preset.head_dim ** -0.5
        found: dict[str, list] = {"output": [], "q": [], "k": [], "v": []}
        tokens = inputs["segments"].shape[1]
        causal = torch.ones(tokens, tokens, dtype=torch.bool, device=self.info.device).tril()
        for row in range(rows):
            q, k, v = (inputs[name][row].detach().double().requires_grad_() for name in ("q", "k", "v"))
            allowed = inputs["mask"][row, 0] if kind == "documents" else causal
            keys, values = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q, keys) * scale
            weights = scores.masked_fill(~allowed, -math.inf).softmax(dim=-1)
            output = torch.einsum("hqk,khd->qhd", weights, values)
            output.backward(inputs["grad"][row].double())
            for name, tensor in (("output", output.detach()), ("q", q.grad), ("k", k.grad), ("v", v.grad)):
                found[name].append(tensor)
            del scores, weights, output
        return {name: torch.stack(tensors) for name, tensors in found.items()}

    # -- Newton-Schulz, GEMMs, bandwidth -----------------------------------------------------------

    def newton_schulz(self) -> dict:
        """muon.newton_schulz over every hidden matrix of the preset, per dtype: time and error against fp64."""
        import torch
        from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, DEFAULT_NS_STEPS, EPS

        import muon

        coefficients = (DEFAULT_A, DEFAULT_B, DEFAULT_C)
        shapes = hardware.muon_matrix_shapes(self.preset)
        flops = sum(hardware.newton_schulz_flops(*shape) for shape in shapes)
        generator = torch.Generator(device=self.info.device).manual_seed(0)
        grads = [torch.randn(*shape, device=self.info.device, generator=generator) for shape in shapes]
        references = [muon.newton_schulz(grad, torch.float64, coefficients, DEFAULT_NS_STEPS, EPS) for grad in grads]
        result = {"preset": self.args.preset, "matrices": len(shapes), "flops_per_step": flops,
                  "train_dtype": hardware.newton_schulz_dtype(self.device), "dtypes": {}}
        for name in ("fp16", "bf16", "fp32"):
            dtype = self.dtype(name)
            run = lambda dtype=dtype: [muon.newton_schulz(grad, dtype, coefficients, DEFAULT_NS_STEPS, EPS)  # noqa: E731
                                       for grad in grads]
            seconds = time_on_device(run, self.info.device, self.args.repeats)
            errors = [(out.double() - ref).norm().item() / ref.norm().item() for out, ref in zip(run(), references)]
            result["dtypes"][name] = {"ms": 1000 * seconds, "tflops": flops / seconds / 1e12,
                                      "max_relative_error": max(errors), "mean_relative_error": statistics.mean(errors)}
            self.recorder.partial(result)
        return result

    def gemm(self) -> dict:
        """TFLOP/s of the preset's GEMM shapes at one micro-batch (gemm_shapes, their training layouts) and
        of a square matmul, in the card's auto precision."""
        import torch

        dtype = self.dtype()
        tokens = self.args.gemm_tokens or (8 * self.preset.context if self.device.is_cuda else 64)
        vocab = self.args.vocab or THINK72_VOCAB
        generator = torch.Generator(device=self.info.device).manual_seed(0)
        rand = lambda *shape: torch.randn(*shape, device=self.info.device, generator=generator).to(dtype)  # noqa: E731
        result = {"precision": self.precision, "tokens": tokens, "shapes": []}
        total_flops = total_seconds = 0.0
        for name, m, k, n, count in gemm_shapes(self.preset, vocab, tokens):
            if "forward" in name:  # x @ W^T, W stored (out, in)
                a, b = rand(m, k), rand(n, k).t()
            elif "weight grad" in name:  # grad^T @ x, grad stored (tokens, out)
                a, b = rand(k, m).t(), rand(k, n)
            else:  # grad @ W
                a, b = rand(m, k), rand(k, n)
            seconds = time_on_device(lambda a=a, b=b: torch.mm(a, b), self.info.device, self.args.repeats)
            flops = 2 * m * k * n
            total_flops += flops * count
            total_seconds += seconds * count
            result["shapes"].append({"name": name, "m": m, "k": k, "n": n, "count": count, "ms": 1000 * seconds,
                                     "tflops": flops / seconds / 1e12})
            del a, b
        result["weighted_tflops"] = total_flops / total_seconds / 1e12
        result["gemm_ms_per_micro_step"] = 1000 * total_seconds
        size = self.args.matmul_size
        a, b = rand(size, size), rand(size, size)
        result["square_size"] = size
        result["square_tflops"] = 2 * size**3 / time_on_device(lambda: torch.mm(a, b), self.info.device,
                                                               self.args.repeats) / 1e12
        return result

    def copy(self) -> dict:
        """The device's memory bandwidth: a copy (read + write) and an fp16 add (two reads, one write)."""
        import torch

        size = self.args.copy_mib * 2**20
        source = torch.ones(size // 2, dtype=torch.float16, device=self.info.device)
        target = torch.empty_like(source)
        copy_seconds = time_on_device(lambda: target.copy_(source), self.info.device, self.args.repeats)
        other = torch.ones_like(source)
        add_seconds = time_on_device(lambda: torch.add(source, other, out=target), self.info.device, self.args.repeats)
        return {"bytes": size, "copy_gbs": 2 * size / copy_seconds / 1e9, "add_gbs": 3 * size / add_seconds / 1e9}

    # -- whole steps ---------------------------------------------------------------------------------

    def step(self, compiled: bool, batch_size: int) -> dict:
        """train.py's Training at micro-batch `batch_size` and --step-tokens per step, eager or compiled."""
        import torch

        world, context = self.info.world, self.preset.context
        grad_accum = max(1, self.args.step_tokens // (batch_size * context * world))
        watch = CompileWatch() if compiled else None
        try:
            training = self.build(self.options(self.args.preset, "auto", compiled, batch_size, grad_accum))
            muon_timer = OptimizerTimer(training, "muon", self.info.device)
            if self.device.is_cuda:
                torch.cuda.reset_peak_memory_stats(self.info.device)
            started = time.perf_counter()
            first = training.train_step()
            first_step = time.perf_counter() - started
            for _ in range(self.args.warmup - 1):
                training.train_step()
            muon_timer.clear()
            seconds = []
            for _ in range(self.args.steps):
                seconds.append(training.train_step().seconds)
                if self.time_up():
                    break
            muon_seconds = muon_timer.seconds()
            peak_memory = torch.cuda.max_memory_allocated(self.info.device) if self.device.is_cuda else None
            estimate = hardware.step_memory(training.preset, training.vocab_size, batch_size, context,
                                            training.precision, training.recipe.rule.state, False,
                                            attention=training.attention_plan.documents)
            profiled = profile_step(training, self.info.device)
            counts = watch.counts() if watch else {}
        finally:
            if watch:
                watch.close()
        tokens_per_step = batch_size * grad_accum * world * context
        tokens_per_second = tokens_per_step / statistics.median(seconds)
        peak = self.peak_flops(training.precision)
        step_ms = 1000 * statistics.median(seconds)
        return {
            "preset": self.args.preset, "precision": training.precision, "compiled": compiled, "world": world,
            "batch_size": batch_size, "grad_accum": grad_accum, "context": context,
            "attention_plan": training.sdpa, "tokens_per_step": tokens_per_step,
            "tokens_per_second": tokens_per_second, "tokens_per_second_per_gpu": tokens_per_second / world,
            "compile_seconds": getattr(training, "compile_seconds", None),
            "compiled_in_the_end": getattr(training, "compile", compiled),  # False: the compile failed, eager
            "step_ms": step_ms, "step_seconds": seconds, "first_step_seconds": first_step,
            "first_step_loss": first.loss, "flops_per_token": training.flops_per_token,
            "mfu": training.flops_per_token * tokens_per_second / world / peak if peak else None,
            "peak_memory_bytes": peak_memory, "step_memory_bytes": estimate.total,
            "step_memory": dataclasses.asdict(estimate),
            "muon_step_ms": 1000 * statistics.median(muon_seconds) if muon_seconds else None,
            "profiled_step_ms_per_micro_step": {key: value / grad_accum for key, value in profiled["split_ms"].items()},
            **profiled, **counts,
        }

    def fp16_vs_bf16(self) -> dict:
        """--compare-steps steps from one seed in bf16 and in fp16 with fp16 Newton-Schulz (the T4's path)."""
        if self.device.is_cuda and not self.device.native_bf16:
            raise NotHere(f"{self.device.label()} has no bf16 tensor cores: the comparison needs an sm_80+ card")
        started, result = time.monotonic(), {"batch_size": self.args.compare_batch_size, "runs": {}}
        share = (self.deadline - started) / 2
        steps_limit = self.args.compare_steps
        for index, precision in enumerate(("bf16", "fp16")):
            training = self.build(self.options(self.args.preset, precision, batch_size=self.args.compare_batch_size))
            if precision == "fp16" and "muon" in training.optimizer.parts:
                training.optimizer.parts["muon"].ns_dtype = "fp16"
            until = started + share * (index + 1)
            losses, run_started = [], time.perf_counter()
            while len(losses) < steps_limit:
                losses.append(training.train_step().loss)
                if distributed.broadcast_from_main(time.monotonic() > until, self.info):
                    break
            steps_limit = len(losses)  # fp16 runs as many steps as bf16 did
            muon_dtype = training.optimizer.parts["muon"].ns_dtype if "muon" in training.optimizer.parts else None
            result["runs"][precision] = {"losses": losses, "newton_schulz_dtype": muon_dtype,
                                         "skipped_steps": training.scaler.skipped_total,
                                         "seconds": time.perf_counter() - run_started}
            self.recorder.partial(result)
            del training
            free_memory()
        return {**result, **curves_close(result["runs"]["bf16"]["losses"], result["runs"]["fp16"]["losses"])}

    # -- the fp16 overflow skips both optimizers ---------------------------------------------

    def overflow(self) -> dict:

        training = self.build(self.options(self.args.preset, "fp16", batch_size=self.args.check_batch_size,
                                           grad_accum=1))
        training.train_step()  # optimizer states exist (AdamW's moments, Muon's momentum)
        model_before = clone(training.model.state_dict())
        optimizer_before = clone(optimizer_states(training))
        scale_before = training.scaler.scaler.get_scale()
        step_before, skipped_before = training.step, training.scaler.skipped_total
        scale = training.scaler.scale
        training.scaler.scale = lambda loss: scale(loss) * math.inf
        try:
            forced = training.train_step()
        finally:
            del training.scaler.scale
        checks = {
            "step_not_applied": not forced.applied and training.step == step_before,
            "weights_unchanged": store.tensor_differences(training.model.state_dict(), model_before, "model") == [],
            "optimizer_states_unchanged":
                store.tensor_differences(optimizer_states(training), optimizer_before, "optimizer") == [],
            "scale_lowered": training.scaler.scaler.get_scale() < scale_before,
            "skip_counted": training.scaler.skipped_total == skipped_before + 1,
        }
        after = training.train_step()
        checks["next_step_applied"] = after.applied and training.step == step_before + 1 and \
            store.tensor_differences(training.model.state_dict(), model_before, "model") != []
        return {"passed": all(checks.values()), "optimizers": sorted(training.optimizer.parts), **checks,
                "scale_before": scale_before, "scale_after": training.scaler.scaler.get_scale()}

    # -- the staged snapshot equals the state ---------------------------------------------------

    def snapshot(self) -> dict:

        training = self.build(self.options(self.args.preset, "auto", batch_size=self.args.check_batch_size,
                                           grad_accum=1))
        checks, seconds = {}, []
        for round_ in (1, 2):  # the second snapshot refills the buffers of the first
            training.train_step()
            expected = {"model": clone(training.model.state_dict()),
                        "optimizer": clone(training.optimizer.state_dict()),
                        "scaler": training.scaler.state_dict()}
            started = time.perf_counter()
            staged = training.snapshot()
            seconds.append(time.perf_counter() - started)
            if staged is None:
                continue  # not rank 0
            differences = store.tensor_differences(staged["model"], expected["model"], "model") + \
                store.tensor_differences(staged["optimizer"], expected["optimizer"], "optimizer")
            checks[f"snapshot_{round_}_equal"] = not differences and staged["step"] == training.step \
                and staged["scaler"]["skipped_total"] == expected["scaler"]["skipped_total"]
            if differences:
                checks[f"snapshot_{round_}_differs_at"] = ", ".join(differences[:5])
            if self.info.device.type == "cuda":
                checks[f"snapshot_{round_}_pinned"] = all(
                    buffer.is_pinned() for buffer in training.staging.buffers.values())
        passed = all(value for key, value in checks.items() if not key.endswith("differs_at"))
        return {"passed": passed, "precision": training.precision, **checks,
                "snapshot_seconds": seconds, "staging_bytes": sum(
                    buffer.numel() * buffer.element_size() for buffer in training.staging.buffers.values())}

    # -- save, resume, continue: equal to the uninterrupted run ------------------------------

    def resume(self) -> dict:
        import train

        deterministic = "--deterministic" in train.build_parser()._option_string_actions
        out = Path(distributed.broadcast_from_main(tempfile.mkdtemp(prefix="resume-", dir=self.work), self.info))
        options = self.options(self.args.preset, "auto", batch_size=self.args.check_batch_size, grad_accum=2,
                               out=out, extra=["--deterministic"] if deterministic else [])
        before, after = 2, 2
        first = self.build(options)
        for _ in range(before):
            first.train_step()
        staged = first.snapshot()
        if self.info.is_main:
            checkpointer = store.Checkpointer(out / "checkpoints", first.run_id, keep_last=2, keep_every=0)
            checkpointer.save(staged, first.step)
            checkpointer.close()
        distributed.broadcast_from_main(None, self.info)  # the checkpoint is on disk before any rank reads it
        uninterrupted = [first.train_step().loss for _ in range(after)]
        expected = clone(first.model.state_dict())
        del first, staged
        free_memory()
        second = self.build(options)
        path = distributed.main_decides(lambda: store.find_resume_checkpoint(out, "auto"), self.info)
        second.load(store.load_checkpoint_file(path), path)
        resumed_at = second.step
        resumed = [second.train_step().loss for _ in range(after)]
        state = second.model.state_dict()
        bitwise = store.tensor_differences(state, expected, "model") == []
        worst = max(relative_difference(expected[name], state[name].detach().cpu()) for name in expected
                    if expected[name].is_floating_point())
        return {"passed": bitwise if deterministic else worst < 1e-2, "deterministic_option": deterministic,
                "resumed_at_step": resumed_at, "checkpoint": path.name, "losses_uninterrupted": uninterrupted,
                "losses_resumed": resumed, "losses_equal": uninterrupted == resumed, "bitwise": bitwise,
                "max_relative_weight_difference": worst}


def clone(obj):
    """A CPU copy of a state dict (tensors cloned, containers rebuilt)."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {key: clone(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(clone(value) for value in obj)
    return obj


def optimizer_states(training) -> dict:
    """Each optimizer's per-parameter state (moments, momentum, step counts), without the param groups
    (their lr follows the step the schedule is at)."""
    return {name: state["state"] for name, state in training.optimizer.state_dict().items()}




def sdpa_priority() -> list[str]:
    """SDPA's backend priority order as torch reports it (names), flash first by default."""
    import torch
    from torch.nn.attention import SDPBackend

    names = {int(getattr(SDPBackend, name)): name.lower() for name in
             ("MATH", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "OVERRIDEABLE")
             if hasattr(SDPBackend, name)}
    try:
        return [names.get(int(value), str(value)) for value in torch._C._get_sdp_priority_order()]
    except (AttributeError, RuntimeError):
        return []


def sdpa_choice(q, k, v, mask, causal: bool, gqa: bool) -> dict:
    """Which backends SDPA's own checks (torch.backends.cuda.can_use_*) accept for this call, the first of
    them in torch's global priority order, and the kernel that ran (a forward under the profiler: the
    effective choice, which on sm_90 may put cuDNN first whatever the global order says)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    checks = {"flash_attention": torch.backends.cuda.can_use_flash_attention,
              "efficient_attention": torch.backends.cuda.can_use_efficient_attention,
              "cudnn_attention": torch.backends.cuda.can_use_cudnn_attention}
    params = torch.backends.cuda.SDPAParams(q, k, v, mask, 0.0, causal, gqa)
    accepted = {}
    for name, check in checks.items():
        try:
            accepted[name] = bool(check(params, False))
        except (RuntimeError, TypeError) as error:
            accepted[name] = first_line(error)
    order = [name for name in sdpa_priority() if name != "overrideable"]
    first = next((name for name in order if name == "math" or accepted.get(name) is True), None)
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
            torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                                             enable_gqa=gqa)
            torch.cuda.synchronize()
        found = attention_kernels([event.key for event in profiler.key_averages()])
        ran = ", ".join(found["kinds"]) or "none seen"
    except Exception as error:  # noqa: BLE001 - what failed is the finding
        ran = first_line(error)
    return {"accepted": accepted, "first_in_global_order": first, "ran": ran}


# ----------------------------------------------------------------------------------------------
# What is printed first and last.


def predicted_step(card, preset, vocab: int, world: int, tokens_per_step: int, micro_batch_tokens: int) -> dict:
    """hardware's throughput model for `card`: the roofline over think72's counts at micro-batch 8 x 1,024
    (hardware.ROOFLINE_COUNTS, bench/bench_roofline.py; `preset`, `vocab` and `micro_batch_tokens` are
    those), for the cards of hardware.ROOFLINE_RATES."""
    step = hardware.predict_card(card, world=world, tokens_per_step=tokens_per_step)
    return {**dataclasses.asdict(step), "compute_s": step.compute_s, "total_s": step.total_s,
            "tokens_per_second": step.tokens_per_second, "mfu": "roofline",
            "hours_for_1.5B_tokens": step.hours_for(1.5e9)}


def machine_facts(info, args: argparse.Namespace) -> dict:
    import torch
    import transformers

    import attention

    device = hardware.describe(info.device)
    preset = model_config.resolve_preset(args.preset, context=args.context)
    precision = hardware.choose_precision("auto", device)
    plan = attention.choose_attention(device, precision.value, preset.head_dim)
    card = hardware.card_of(device)
    facts = {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "device": device.label(),
        "world": info.world, "torch": torch.__version__, "cuda": torch.version.cuda,
        "transformers": transformers.__version__, "python": platform.python_version(),
        "memory_gib": round(device.memory_bytes / 2**30, 1), "gpus": device.count if device.is_cuda else 0,
        "precision_auto": precision.value, "precision_reason": precision.reason,
        "attention_kernel": plan.label(), "attention_reason": plan.reason,
        "newton_schulz_dtype": hardware.newton_schulz_dtype(device),
        "card": dataclasses.asdict(card) if card else None,
        "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
    }
    if card:
        try:  # the throughput model is being replaced: its absence must not stop the measurements
            facts["prediction"] = predicted_step(card, preset, args.vocab or THINK72_VOCAB, max(1, info.world),
                                                 args.step_tokens, 8 * preset.context)
        except Exception as error:  # noqa: BLE001
            facts["prediction_error"] = first_line(error)
    return facts


def print_plan(facts: dict, parts: list[str]) -> None:
    print(f"device: {facts['device']} x{facts['world']}, torch {facts['torch']} (CUDA {facts['cuda']}), "
          f"transformers {facts['transformers']}", flush=True)
    print(f"--precision auto -> {facts['precision_auto']}: {facts['precision_reason']}")
    print(f"attention -> {facts['attention_kernel']}")
    print(f"Newton-Schulz dtype -> {facts['newton_schulz_dtype']}")
    if facts.get("prediction"):
        prediction = facts["prediction"]
        print(f"predicted (hardware.predict_card, {prediction['mfu']}): step "
              f"{prediction['total_s']:.3f} s, {prediction['tokens_per_second']:,.0f} tokens/s")
    print("parts: " + ", ".join(f"{name} (~{part_seconds(name):g} s)" for name in parts), flush=True)


def gib(value) -> str:
    return f"{value / 2**30:.2f} GiB" if value else "n/a"


def mib(value) -> str:
    return f"{value / 2**20:,.0f} MiB" if value is not None else "n/a"


def not_ok(name: str, part: dict) -> str:
    return f"- {name}: {part['status']}: {part.get('error') or part.get('reason', '')}"


def markdown_lines(record: dict) -> list[str]:
    """The lines for bench/RESULTS.md, part by part (a part that did not run: one line saying why)."""
    facts, parts = record["machine"], record["parts"]
    lines = [f"### GPU: {facts['device']} x{facts['world']} ({facts['date']}, torch {facts['torch']}, "
             f"CUDA {facts['cuda']})", "", f"`{record['command']}` ({record.get('elapsed_seconds', '?')} s)", ""]
    for name, part in parts.items():
        if part["status"] not in ("ok", "failed"):
            lines.append(not_ok(name, part))
            continue
        writer = PART_LINES.get(name.split(":")[0] if name.startswith("step:") else name)
        try:
            lines += writer(name, part) if writer else [f"- {name}: {part['status']}; " + check_text(name, part)]
        except (KeyError, TypeError, ValueError) as error:  # a figure missing: the JSON has the rest
            lines.append(f"- {name}: {part['status']} (not shown: {first_line(error)}; see gpu.json)")
    try:
        lines += step_table(parts)
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as error:
        lines.append(f"- steps: not shown ({first_line(error)}; see gpu.json)")
    return lines


def versions_lines(name: str, part: dict) -> list[str]:
    choice = part.get("sdpa_choice")
    chosen = ", ".join(f"{case}: {found['ran']}" for case, found in choice.items()) \
        if isinstance(choice, dict) else choice
    return [f"- versions: cuDNN {part.get('cudnn')}, NCCL {part.get('nccl')}, Triton {part.get('triton')}; "
            f"SDPA's global priority {' > '.join(part['sdpa_priority']) or 'n/a'}; SDPA ran (profiler): {chosen}"]


def kernels_lines(name: str, part: dict) -> list[str]:
    lines = [f"- attention kernels at {part['shape']} ({part['precision']}):"]
    for path, found in part["paths"].items():
        if found["status"] != "ok":
            lines.append(f"  - {path}: {found['status']}: {found.get('error') or found.get('reason')}")
        else:
            lines.append(f"  - {path}: {', '.join(found['kinds']) or 'none seen'}: "
                         f"{'; '.join(name[:90] for name in found['attention_names'][:3])}")
    return lines


def nan_lines(name: str, part: dict) -> list[str]:
    found = []
    for length, outcome in part["lengths"].items():
        found.append(f"{length}: {outcome['error']}" if "error" in outcome else
                     f"{length}: NaN in grad_q {outcome['nan_grad_q']} (output {outcome['nan_output']}, grad_k "
                     f"{outcome['nan_grad_k']}, grad_v {outcome['nan_grad_v']})")
    return ["- cuDNN attention with a mask (seq_len dtype): " + "; ".join(found)]


def attention_lines(name: str, part: dict) -> list[str]:
    lines = ["", f"Attention, one layer, {part['precision']}, documents log-normal (median {part['document_median']}, "
                 f"sigma {part['document_sigma']}):", "",
             "| shape | path | fwd+bwd | per micro-batch (x layers + prepare) | prepare | peak memory | max error "
             "| useful TFLOP/s | computed / useful |", "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for shape, figures in part["shapes"].items():
        label = f"{shape} ({figures['documents_per_row']:.1f} documents/row)"
        for path, found in figures["paths"].items():
            if found["status"] != "ok":
                lines.append(f"| {label} | {path} | {found['status']}: {found.get('error') or found.get('reason')} "
                             "| | | | | | |")
                continue
            error = f"{found['max_error']:.1e}" + ("" if found["exact"] else " (causal over the row)")
            lines.append(f"| {label} | {path} | {found['forward_backward_ms']:.3f} ms | "
                         f"{found['per_micro_batch_ms']:.2f} ms | {found['prepare_ms']:.3f} ms | "
                         f"{mib(found['peak_memory_bytes'])} | {error} | {found['useful_tflops']:.1f} | "
                         f"{found['computed_over_useful']:.2f} |")
    return lines + [""]


def newton_schulz_lines(name: str, part: dict) -> list[str]:
    figures = [f"{dtype} {found['ms']:.2f} ms ({found['tflops']:.3g} TFLOP/s, error {found['max_relative_error']:.1e})"
               for dtype, found in part["dtypes"].items()]
    return [f"- muon.newton_schulz over {part['matrices']} matrices of {part['preset']} (train.py uses "
            f"{part['train_dtype']}): " + ", ".join(figures)]


def gemm_lines(name: str, part: dict) -> list[str]:
    shapes = ", ".join(f"{shape['name']} {shape['tflops']:.3g}" for shape in part["shapes"])
    return [f"- GEMMs at {part['tokens']} tokens ({part['precision']}), TFLOP/s: {shapes}; weighted "
            f"{part['weighted_tflops']:.3g} ({part['gemm_ms_per_micro_step']:.2f} ms per micro-step); square "
            f"{part['square_size']}: {part['square_tflops']:.3g}"]


def copy_lines(name: str, part: dict) -> list[str]:
    return [f"- bandwidth ({part['bytes'] / 2**20:.0f} MiB): copy {part['copy_gbs']:.0f} GB/s, fp16 add "
            f"{part['add_gbs']:.0f} GB/s"]


def compare_lines(name: str, part: dict) -> list[str]:
    runs = part["runs"]
    if part.get("steps", 0) == 0:
        return [f"- fp16 vs bf16: no steps ({', '.join(runs)})"]
    return [f"- fp16 (Newton-Schulz {runs['fp16']['newton_schulz_dtype']}, {runs['fp16']['skipped_steps']} overflow "
            f"skips) vs bf16 over {part['steps']} steps at micro-batch {part['batch_size']}: last-10 mean loss "
            f"{part['last_mean_second']:.4f} vs {part['last_mean_first']:.4f} "
            f"({100 * part['last_relative_difference']:.2f}%), largest 10-step running-mean difference "
            f"{part['max_running_mean_difference']:.4f}: "
            f"{'close' if part['close'] else 'NOT close'}"]


def step_table(parts: dict) -> list[str]:
    steps = {name: part for name, part in parts.items() if name.startswith("step:") and part["status"] == "ok"}
    if not steps:
        return []
    lines = ["", "| step | tokens/s (all GPUs) | MFU | peak memory | step_memory | first loss | compile: seconds, "
                 "graph breaks / recompiles | per micro-step: matmul / attention / elementwise / optimizer / "
                 "communication (+ kernels no op claimed) (ms) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
    for name, part in steps.items():
        mfu = f"{100 * part['mfu']:.1f}%" if part.get("mfu") else "n/a"
        compiled = "eager"
        if part["compiled"]:
            seconds = part.get("compile_seconds")
            compiled = ("failed: eager" if part.get("compiled_in_the_end") is False else
                        f"{seconds:.0f} s" if seconds is not None else "?") + \
                f", {part.get('graph_breaks', 0)} / {part.get('recompiles', 0)}"
        split = " / ".join(f"{part['profiled_step_ms_per_micro_step'][category]:.2f}" for category in CATEGORIES) \
            + f" (+ {part.get('unattributed_ms', 0) / part['grad_accum']:.2f})"
        lines.append(f"| {name[5:]} (x{part['grad_accum']}) | {part['tokens_per_second']:,.0f} | {mfu} | "
                     f"{gib(part['peak_memory_bytes'])} | {gib(part['step_memory_bytes'])} | "
                     f"{part['first_step_loss']:.4f} | {compiled} | {split} |")
    for size in sorted({part["batch_size"] for part in steps.values()}):
        eager, compiled = steps.get(f"step:eager:{size}"), steps.get(f"step:compile:{size}")
        if eager and compiled:
            lines.append(f"- micro-batch {size}: first-step loss eager {eager['first_step_loss']:.6f}, compiled "
                         f"{compiled['first_step_loss']:.6f} (difference "
                         f"{abs(eager['first_step_loss'] - compiled['first_step_loss']):.2e}); compiled "
                         f"{compiled['tokens_per_second'] / eager['tokens_per_second']:.2f}x eager")
    return lines


def check_text(name: str, part: dict) -> str:
    if name == "resume":
        return (f"resumed at step {part['resumed_at_step']}, --deterministic "
                f"{'used' if part['deterministic_option'] else 'absent'}: bitwise {part['bitwise']}, losses equal "
                f"{part['losses_equal']}, max relative weight difference {part['max_relative_weight_difference']:.2e}")
    checks = [key for key, value in part.items() if isinstance(value, bool) and key != "passed"]
    return ", ".join(f"{key} {part[key]}" for key in checks)


PART_LINES = {"versions": versions_lines, "attention:kernels": kernels_lines, "attention:nan": nan_lines,
              "attention:bench": attention_lines, "newton_schulz": newton_schulz_lines, "roofline:gemm": gemm_lines,
              "roofline:copy": copy_lines, "fp16_vs_bf16": compare_lines, "step": lambda name, part: []}


def prediction_table(vocab: int = THINK72_VOCAB, tokens: float = 1.5e9) -> list[str]:
    """The think72 rows of docs/training.md's throughput table (bench/bench_roofline.py's, from the recorded
    counts hardware.ROOFLINE_COUNTS)."""
    sys.path.insert(0, str(ROOT / "bench"))
    import bench_roofline

    return bench_roofline.card_rows(hardware.ROOFLINE_COUNTS, tokens=tokens)


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
        distributed.init_process_group("nccl" if use_cuda else "gloo",
                                       timeout=datetime.timedelta(seconds=args.collective_timeout),
                                       device_id=torch.device("cuda", local_rank) if use_cuda else None)
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
        command = " ".join([f"torchrun --nproc_per_node={info.world}" if info.world > 1 else "python",
                            "bench/bench_gpu.py", *(sys.argv[1:] if argv is None else argv)])
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
    run_main(main)
