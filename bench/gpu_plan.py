"""bench_gpu.py's plan and its pure pieces: the parts and their estimates, the budget, which attention path
runs on which card, realistic document lengths, kernel names by category, compile counts, GEMM shapes, loss
curves (table-tested in tests/test_bench_gpu.py)."""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tinyllm.common import UserError  # noqa: E402
from tinyllm.model import attention, hardware  # noqa: E402
from tinyllm.model import config as model_config  # noqa: E402

THINK72_VOCAB = 33_069
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp64": "float64"}
# Seconds each part is expected to take at most (a T4's pace; an H200 is faster): a part starts only when
# its estimate fits in what is left of --max-seconds, and its loops stop after twice its estimate.
PART_SECONDS = {
    "versions": 5,
    "attention:kernels": 20,
    "attention:nan": 10,
    "attention:bench": 45,
    "newton_schulz": 10,
    "roofline:gemm": 20,
    "roofline:copy": 5,
    "step:eager": 45,
    "fp16_vs_bf16": 60,
    "step:compile": 150,
    "overflow": 20,
    "snapshot": 15,
    "resume": 30,
}
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
    (
        "matmul",
        re.compile(
            r"gemm|gemv|cutlass|cublas|nvjet|xmma|wgmma|hmma|s1688|s16816|s884|splitk|"
            r"triton_tem_fused_(?:addmm|mm|bmm)|^aten::(?:mm|addmm|bmm|baddbmm|matmul|linear|"
            r"_addmm_activation)$"
        ),
    ),
]
OPTIMIZER_RANGES = ("Optimizer.step", "Optimizer.zero_grad", "tinyllm.optimizer")
# Substrings of the profiler's op and kernel names that belong to attention (lower case), by kernel.
ATTENTION_KINDS = [  # cuDNN's kernel names say "flash" too: it is looked for first
    ("cudnn", ("cudnn_attention", "cudnn_generated_fort_native_sdpa", "cudnn")),
    ("flash", ("flash",)),
    ("efficient", ("efficient_attention", "fmha", "mem_efficient")),
    ("math", ("attention_math",)),
]


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


def plan_parts(batch_sizes: list[int], modes: list[str], only: list[str] | None = None) -> list[str]:
    """Part names in running order (importance first): the cheap answers, the eager steps, the precision
    comparison, the compiled steps, then the checks. `only`: the names starting with one of these."""
    parts = [
        "versions",
        "attention:kernels",
        "attention:nan",
        "attention:bench",
        "newton_schulz",
        "roofline:gemm",
        "roofline:copy",
    ]
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


def attention_path_problem(
    path: str, device: hardware.Device, precision: str, head_dim: int, offered: attention.TorchKernels | None = None
) -> str | None:
    """Why `path` cannot run on `device` in `precision` (None: it can): its kernel's needs as attention.KERNELS
    records them (the varlen kernel's `problem`: torch's dispatch rules, with what `offered` torch has; default
    a card's own wheel's). A causal path needs what its varlen kernel does, SDPA taking cu_seqlens' place, and
    flash's runs on CPU too (SDPA's CPU flash kernel); the masked path runs anywhere (SDPA's own choice)."""
    record = attention.kernel(path)
    if record.masked or (record.implementation == attention.FLASH and not device.is_cuda and not record.boundaries):
        return None
    varlen = next(
        kernel for kernel in attention.KERNELS if kernel.boundaries and kernel.implementation == record.implementation
    )
    return varlen.problem(device, precision, head_dim, offered or attention.CUDA_WHEELS)


def sample_segments(
    rows: int, context: int, seed: int, median: float = DOCUMENT_MEDIAN, sigma: float = DOCUMENT_SIGMA
) -> np.ndarray:
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
    stream = np.repeat(np.arange(lengths_all.size, dtype=np.int64), lengths_all)[offset : offset + needed]
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
    return {
        "frames_compiled": len(pairs),
        "recompiles": sum(1 for _, again in pairs if again > 0),
        "graph_breaks": int(sum(breaks.values())),
        "graph_break_reasons": [reason.strip().splitlines()[0][:160] for reason in list(breaks)[:5]],
        "unique_graphs": int(counters.get("stats", {}).get("unique_graphs", 0)),
    }


def gemm_shapes(preset: model_config.Preset, vocab: int, tokens: int) -> list[tuple[str, int, int, int, int]]:
    """(name, m, k, n, count per micro-step) of the GEMMs of one forward and backward of `tokens` tokens:
    per linear (in k -> out n) the forward (tokens x k x n), the input gradient (tokens x n x k) and the
    weight gradient (n x tokens x k); q, k, v, o, gate, up, down in every layer, and the LM head over
    one chunk of the loss (hardware.logits_chunk_tokens) as many times as the tokens need."""
    q, kv = preset.heads * preset.head_dim, preset.kv_heads * preset.head_dim
    linears = [
        ("q", preset.hidden, q, 1),
        ("k/v", preset.hidden, kv, 2),
        ("o", q, preset.hidden, 1),
        ("gate/up", preset.hidden, preset.intermediate, 2),
        ("down", preset.intermediate, preset.hidden, 1),
    ]
    shapes = []
    for name, k, n, count in linears:
        per_step = count * preset.layers
        shapes += [
            (f"{name} forward", tokens, k, n, per_step),
            (f"{name} input grad", tokens, n, k, per_step),
            (f"{name} weight grad", n, tokens, k, per_step),
        ]
    chunk = min(tokens, hardware.logits_chunk_tokens(vocab, "cuda"))
    pieces = [(chunk, tokens // chunk)] + ([(tokens % chunk, 1)] if tokens % chunk else [])
    for rows, count in pieces:
        last = " (last chunk)" if rows != chunk else ""
        shapes += [
            (f"lm head forward{last}", rows, preset.hidden, vocab, count),
            (f"lm head input grad{last}", rows, vocab, preset.hidden, count),
            (f"lm head weight grad{last}", vocab, rows, preset.hidden, count),
        ]
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
    return {
        "steps": steps,
        "last_mean_first": last_a,
        "last_mean_second": last_b,
        "last_relative_difference": relative,
        "max_running_mean_difference": float(running.max()),
        "close": relative <= 0.02,
    }
