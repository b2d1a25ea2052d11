"""The roofline of a training step: FLOPs and bytes counted per op, turned into a step time per card.

    python bench/bench_roofline.py                  # think72, micro-batch 8 x 1024, fp16 and bf16 (a few minutes)
    python bench/bench_roofline.py --smoke          # `nano` at 2 x 256, seconds (tests/test_bench_roofline.py)
    python bench/bench_roofline.py --json out.json  # the counts as well

What it counts: one forward and backward of the model through the training loss
(losses.language_model_loss, chunked) under fp16 and under bf16 autocast on CPU, op by op at the
dispatcher (a TorchDispatchMode; FLOPs from torch.utils.flop_counter's registry, the formulas FlopCounterMode
uses). The tensors are fake (torch._subclasses.FakeTensorMode): every op of the real model, loss, autocast
and autograd runs with its real shapes and dtypes, nothing computes, so think72 at 8 x 1024 takes seconds.
Bytes of an op: the sizes of its tensor inputs (read) and outputs (written); views and allocations are
free; an in-place op reads and writes its tensor (copy_ only writes it).

Where the CPU and the card dispatch differently, the count follows the card:
- the attention kernel: the op the CPU runs is counted as the card plan's kernel
  (attention.choose_attention): its FLOPs are those it executes (executed_attention_flops: the T4's kernel
  at its tiles, the others attention.attention_flops) over the packed rows' documents, its bytes a fused
  kernel's (q, k, v, o, the logsumexp; backward also dO, dQ, dK, dV and the row sums; K/V heads repeated
  where the plan repeats them; the masked kernels' bias read once per pass);
  the varlen kernels' CUDA-only ops are stood in for (their outputs made with the right shapes);
- F.rms_norm: one fused op forward (aten._fused_rms_norm) and one backward, as CUDA runs it (the CPU
  decomposes it);
- an op that is one dispatch but several CUDA kernels (below_dispatch, read in torch's CUDA sources): the
  kernels it launches and the bytes they move beyond reading its inputs and writing its outputs once
  (eager only: the compiled estimate has its own model).

Categories: matmul (every op in the FLOP registry but attention), attention (the kernel), loss (the
chunked cross-entropy outside the matmuls), embedding (the lookup and its backward), and norm/RoPE/
elementwise (everything else: norms, RoPE, residual adds, SiLU, autocast casts, the attention path's
layout copies, K/V repeats and masks), by the module the op runs in (torch.utils.module_tracker, which
follows the backward too).

"before" is the stock model (model_config.build_model) with the masked path (attention.MASKED and the
block-diagonal mask: transformers repeats K/V and every card computes the full C x C square); "after" is
the training model (model_config.build_training_model's autocast_elementwise) with the card's plan (the
memory-efficient varlen kernel under fp16, T4; flash varlen with grouped heads under bf16, sm_80+).

The compiled step's bytes outside matmuls and the attention kernel are Inductor's own count, not a model
(inductor_bytes, `--inductor`: think72's shape at 1 and 2 layers compiled by Inductor on CPU on the T4's
attention path, the bytes of each kernel it generates as its scheduler counts them; recorded in
INDUCTOR_RECORDED, the second layer's figures taken as each layer's); matmuls and the attention kernel
stay as counted. For a shape with no Inductor count recorded (the --smoke run) the compiled figure is the
old fusion model (fused_bytes: every maximal group of non-matmul ops Inductor could fuse reads its
external inputs once and writes what leaves it once), said so in the last line.

Documents: each row of the micro-batch is cut from a stream of documents whose lengths are drawn from a
lognormal of median 243 tokens and sigma 1.0 (mean 400 tokens), laid end to end as the packed stream lays
them (a document crossing a row's end continues as a new document in the next row). The attention's FLOPs
are averaged over 4,000 rows of the project's own packer (train_data.MaskedPacking) on such a stream
(population), the T4's memory-efficient kernel at its sm_75 tiles (EFFICIENT_TILES, executed_attention_flops).

The step time (hardware.predict_step, one card's rates from hardware.ROOFLINE_RATES): per micro-step,
matmul FLOPs at the sustained matmul rate (or their bytes at the bandwidth, whichever is longer),
attention FLOPs at the attention kernel's rate, every other byte at the bandwidth, plus the host's launch
time where it exceeds the device's; per step the optimizer (counted here too, on fake tensors: the fp16
unscale, the gradient norm and clip, fused AdamW on embeddings and norms, muon.Muon with Newton-Schulz in
the card's dtype on the matrices, zero_grad), the gradient accumulation adds and what the backward leaves
exposed of the DDP all-reduce (DDP's buckets, distributed.bucket_bytes; hardware.exposed_all_reduce).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import functools
import json
import logging
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils.flop_counter import flop_registry  # noqa: E402
from torch.utils.module_tracker import ModuleTracker  # noqa: E402

from tinyllm.model import (  # noqa: E402
    attention,
    hardware,
    losses,
)
from tinyllm.model import config as model_config  # noqa: E402
from tinyllm.training import distributed, muon, optimization, train_data  # noqa: E402

VOCAB = 33_069
CARD_CHUNK = hardware.logits_chunk_tokens(VOCAB, "cuda")  # the loss's chunk on a card, counted here on CPU
TOKENS = 1.5e9
README_SPLIT = {"batch_size": 8, "grad_accum": 4, "world": 2}  # the README's command: 65,536 tokens per step
MEDIAN_DOCUMENT, DOCUMENT_SIGMA = 243.0, 1.0  # lognormal: mean = 243 x e^(1/2) = 400 tokens
CATEGORIES = ("matmul", "attention", "elementwise", "loss", "embedding")
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
CARD_PLANS = {"fp16": hardware.Device("cuda", "T4", (7, 5)), "bf16": hardware.Device("cuda", "A100", (8, 0))}
# The cards of the per-card table: (key, ranks), each in its --precision auto dtype.
TABLE_CARDS = [("T4", 2), ("T4", 1), ("L4", 1), ("A100", 1), ("H100", 1), ("H200", 1)]

aten = torch.ops.aten
FREE = {
    aten.empty.memory_format,
    aten.empty_like.default,
    aten.empty_strided.default,
    aten.detach.default,
    aten.lift_fresh.default,
    aten._local_scalar_dense.default,
    aten._unsafe_view.default,
    aten.alias.default,
    aten.new_empty.default,
    aten.new_empty_strided.default,
    aten.resize_.default,
    aten.set_.source_Storage,
}
WRITE_ONLY = {
    aten.zeros.default,
    aten.zeros_like.default,
    aten.ones_like.default,
    aten.full.default,
    aten.full_like.default,
    aten.fill_.Scalar,
    aten.zero_.default,
    aten.scalar_tensor.default,
    aten.ones.default,
    aten.new_zeros.default,
    aten.new_ones.default,
    aten.new_full.default,
}
SCATTERS = {"scatter_add_", "scatter_", "index_put_", "index_add_"}
GATHERS = {"gather", "embedding", "index_select", "index"}  # read only the rows or elements they pick
NOT_KERNELS = {"_record_function_enter_new", "_record_function_exit", "promote_types"}
STAND_IN = {
    "_efficient_attention_forward",
    "_efficient_attention_backward",
    "_varlen_attn",
    "_varlen_attn_backward",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_efficient_attention_backward",
    "_flash_attention_forward",
    "_flash_attention_backward",
    *attention.KERNEL_OPS,
}


# ----------------------------------------------------------------------------------------------
# The documents of a micro-batch.


def packed_rows(
    rows: int, context: int, seed: int = 0, median: float = MEDIAN_DOCUMENT, sigma: float = DOCUMENT_SIGMA
) -> tuple[np.ndarray, list[list[int]]]:
    """(segments (rows, context), each row's document lengths): documents of lognormal lengths laid end
    to end and cut into rows, a document crossing a row's end continuing as a new one in the next row."""
    rng = np.random.default_rng(seed)
    segments = np.zeros((rows, context), dtype=np.int32)
    lengths: list[list[int]] = []
    left = 0  # what remains of the current document
    for row in range(rows):
        position, number, row_lengths = 0, 0, []
        while position < context:
            if left == 0:
                left = max(1, int(round(rng.lognormal(math.log(median), sigma))))
            take = min(left, context - position)
            segments[row, position : position + take] = number
            row_lengths.append(take)
            position, left, number = position + take, left - take, number + 1
        lengths.append(row_lengths)
    return segments, lengths


# ----------------------------------------------------------------------------------------------
# The counting mode.


@dataclasses.dataclass
class Op:
    name: str
    phase: str  # "forward", "backward" or "optimizer"
    category: str
    detail: str
    flops: float
    read: float
    written: float
    inputs: list  # [(key, view, bytes)] read
    outputs: list  # [(key, bytes)] written
    boundary: bool  # a matmul or the attention kernel: never fused
    extra: float = 0.0  # bytes its CUDA kernels move beyond read + written (below_dispatch), eager only
    kernels: int = 1  # CUDA kernels it launches, eager

    @property
    def moved(self) -> float:
        """Bytes its eager CUDA kernels read and write."""
        return self.read + self.written + self.extra


LABEL = "bench_roofline"


def module_label(name: str | None) -> tuple[str, str]:
    """(category, detail) of an op in the module of qualified name `name` (None: outside the decoder)."""
    if name is None:  # language_model_loss outside the decoder (model.model)
        return "loss", "cross-entropy"
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "embed_tokens":
        return "embedding", "lookup"
    if leaf.endswith("norm"):
        return "elementwise", "norms"
    if leaf == "rotary_emb" or leaf == "self_attn":
        return "elementwise", "RoPE, attention layout, K/V repeats"
    if leaf in ("mlp", "act_fn"):
        return "elementwise", "SiLU and product"
    if ".layers." in name and leaf.isdigit():
        return "elementwise", "residual adds"
    return "elementwise", "decoder (masks, positions; backward: sums of gradients)"


def label_backward(names: dict):
    """Global forward pre-hook and hook: label the autograd nodes a module's forward made (those created
    since it started: sequence numbers grow) with its module_label, inner modules first (they finish
    first), so each node carries its innermost module's label, for Counter.where in the backward."""
    starts: dict = {}

    def pre_hook(module, args):
        starts.setdefault(id(module), []).append(torch._C._autograd._get_sequence_nr())

    def hook(module, args, output):
        start = starts[id(module)].pop()
        name = names.get(id(module))
        if name is None:
            return
        label = module_label(name)
        stack = [tensor.grad_fn for tensor in tensors_in(output) if tensor.grad_fn is not None]
        seen = set()
        while stack:
            node = stack.pop()
            if node is None or node in seen or node._sequence_nr() < start:
                continue
            seen.add(node)
            node.metadata.setdefault(LABEL, label)
            stack.extend(following for following, _ in node.next_functions)

    return pre_hook, hook


def tensors_in(value) -> list[torch.Tensor]:
    found = []
    if isinstance(value, torch.Tensor):
        found.append(value)
    elif isinstance(value, (list, tuple)):
        for item in value:
            found.extend(tensors_in(item))
    elif isinstance(value, dict):
        for item in value.values():
            found.extend(tensors_in(item))
    return found


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class Counter(TorchDispatchMode):
    """Records every op: its FLOPs (flop_registry), its bytes, its category, and which tensor versions it
    reads and writes (for the fusion model). `kernel_cost(name, args, out)` gives the attention kernel's
    (flops, read, written) as the card computes them; `stand_in(name, args)` makes the outputs of a
    CUDA-only kernel."""

    def __init__(self, tracker: ModuleTracker, kernel_cost, stand_in):
        super().__init__()
        self.tracker, self.kernel_cost, self.stand_in = tracker, kernel_cost, stand_in
        self.ops: list[Op] = []
        self.versions: dict[int, int] = {}
        self.keep: list = []  # storages stay alive, so an id is never reused while counting
        self.phase = "forward"
        self.recording = True

    def key(self, tensor: torch.Tensor) -> tuple[int, int]:
        storage = tensor.untyped_storage()
        cdata = storage._cdata
        if cdata not in self.versions:
            self.versions[cdata] = 0
            self.keep.append(storage)
        return cdata, self.versions[cdata]

    def where(self) -> tuple[str, str]:
        """(category, detail) of the op: in the forward by the module it runs in (its innermost), in the
        backward by the module whose forward made the autograd node it runs for (label_backward)."""
        if self.phase == "backward":
            node = torch._C._current_autograd_node()
            label = node.metadata.get(LABEL) if node is not None else None
            return label or ("loss", "cross-entropy")  # nodes no module made: the chunked loss's
        parents = [name for name in self.tracker.parents if name != "Global"]
        return module_label(max(parents, key=len) if parents else None)

    active: Counter | None = None

    def __enter__(self):
        Counter.active = self
        return super().__enter__()

    def __exit__(self, *exc):
        Counter.active = None
        return super().__exit__(*exc)

    @staticmethod
    @contextlib.contextmanager
    def paused():
        """The active Counter (or None), not recording while the block runs."""
        counter = Counter.active
        if counter is not None:
            counter.recording = False
        try:
            yield counter
        finally:
            if counter is not None:
                counter.recording = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        out = self.stand_in(name, args) if name in STAND_IN else None
        if out is None:
            out = func(*args, **kwargs)
        if self.recording:
            self.record(func, args, kwargs, out)
        return out

    def record(self, func, args, kwargs, out) -> None:
        name = func.overloadpacket.__name__
        if func in FREE or getattr(func, "is_view", False) or func.namespace == "prim" or name in NOT_KERNELS:
            return
        schema = func._schema
        mutated = [
            tensor
            for argument, value in zip(schema.arguments, args)
            if argument.alias_info is not None and argument.alias_info.is_write
            for tensor in tensors_in(value)
        ]
        read_tensors = (
            []
            if func in WRITE_ONLY
            else [t for t in tensors_in((args, kwargs)) if not (name == "copy_" and t is args[0])]
        )
        inputs = [
            (self.key(t), (t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype), nbytes(t))
            for t in read_tensors
        ]
        for tensor in mutated:
            cdata = tensor.untyped_storage()._cdata
            self.versions[cdata] = self.versions.get(cdata, 0) + 1
        written = mutated or tensors_in(out)
        outputs = [(self.key(t), nbytes(t)) for t in written]
        if name in SCATTERS or name in GATHERS:
            inputs, outputs = touched(name, args, inputs, outputs, out)
        category, detail = self.where()
        boundary = False
        if name in STAND_IN:
            flops, read, write = self.kernel_cost(name, args, out)
            category, detail, boundary = "attention", "kernel", True
        else:
            flops = 0.0
            if func.overloadpacket in flop_registry:
                flops = float(flop_registry[func.overloadpacket](*args, **kwargs, out_val=out))
                category, detail, boundary = "matmul", name, True
            elif name == "embedding_dense_backward":
                boundary = True  # a scatter-add over the vocabulary: its own kernel, compiled or not
            elif name == "_to_copy" and category == "elementwise":
                detail = "casts"
            read = sum(size for _, _, size in inputs)
            write = sum(size for _, size in outputs)
        extra, kernels = (0.0, 1) if name in STAND_IN else below_dispatch(name, args, out)
        self.ops.append(
            Op(name, self.phase, category, detail, flops, read, write, inputs, outputs, boundary, extra, kernels)
        )


def touched(name: str, args, inputs: list, outputs: list, out) -> tuple[list, list]:
    """(inputs, outputs) of a gather or a scatter as what its kernel touches, not the whole tensor it
    indexes: a gather (gather, embedding, index_select, index) reads of its source only the elements it
    writes out; a scatter (scatter_add_, scatter_, index_add_, index_put_) reads its index and source and
    reads and writes only the elements it updates (the source's size in the updated tensor's dtype).

    The indexed tensor is told apart by its storage (an input's key is taken before the op bumps the
    version, an output's after: comparing keys would exclude nothing)."""
    source = args[0]
    storage = source.untyped_storage()._cdata
    if name in GATHERS:
        if name == "embedding":  # embedding(weight, indices): the weight is first
            picked = nbytes(out)
        else:
            picked = nbytes(out) if isinstance(out, torch.Tensor) else 0
        return [(key, view, picked if key[0] == storage else size) for key, view, size in inputs], outputs
    values = next((a for a in reversed(args) if isinstance(a, torch.Tensor) and a is not source), None)
    if name == "index_put_":  # index_put_(self, indices, values, accumulate)
        values = args[2]
    elements = values.numel() if isinstance(values, torch.Tensor) else 0
    size = elements * source.element_size()
    others = [entry for entry in inputs if entry[0][0] != storage]
    accumulates = name in ("scatter_add_", "index_add_") or (name == "index_put_" and len(args) > 3 and args[3])
    reads = others + ([((storage, -1), ("touched",), size)] if accumulates else [])
    return reads, [(outputs[0][0], size)]


# ----------------------------------------------------------------------------------------------
# Ops that are one dispatch but several kernels on CUDA, as torch's CUDA sources run them.

CHUNK, MAX_BLOCKS, MAX_TENSORS = 65_536, 320, (110, 64, 48, 36, 30)  # MultiTensorApply.cuh, by depth
MULTI_TENSOR_DEPTH = {
    "_amp_foreach_non_finite_check_and_unscale_": 1,
    "_foreach_norm": 1,
    "_foreach_mul_": 1,
    "_foreach_zero_": 1,
    "_foreach_add_": 1,
    "_fused_adamw_": 4,
}
EMBEDDING_ROWS_PER_THREAD = 10  # EmbeddingBackwardKernel.cu's NROWS_PER_THREAD


def multi_tensor_launches(numels: list[int], depth: int) -> int:
    """Kernels multi_tensor_apply launches over tensors of these sizes: one per 65,536-element chunk and
    block, launched when 320 blocks or depth's most tensors are queued, and once at the end."""
    launches, tensors, blocks = 0, 0, 0
    for numel in (n for n in numels if n > 0):
        tensors += 1
        chunks = -(-numel // CHUNK)
        for chunk in range(chunks):
            blocks += 1
            if (tensors == MAX_TENSORS[depth - 1] and chunk == chunks - 1) or blocks == MAX_BLOCKS:
                launches, blocks = launches + 1, 0
                tensors = 0 if chunk == chunks - 1 else 1
    return launches + (1 if blocks else 0)


def below_dispatch(name: str, args, out) -> tuple[float, int]:
    """(bytes beyond reading each input and writing each output once, kernels) of an op on CUDA."""
    if name == "slice_backward":  # at::zeros of the input's size, then the gradient copied into its slice
        return float(nbytes(args[0])), 2
    if name == "_fused_rms_norm_backward":  # layer_norm_kernel.cu: dX, then dgamma reads dY, X, rstd again
        grad, input, _, rstd = args[:4]
        return float(nbytes(grad) + nbytes(input) + nbytes(rstd)), 2
    if name == "embedding_dense_backward":
        return embedding_backward(args[0], args[1], args[2])
    if name in MULTI_TENSOR_DEPTH:
        launches = multi_tensor_launches([t.numel() for t in args[0]], MULTI_TENSOR_DEPTH[name])
        return 0.0, launches + (1 if name == "_foreach_norm" else 0)  # its partial norms' cleanup kernel
    return 0.0, 1


def embedding_backward(grad: torch.Tensor, indices: torch.Tensor, rows: int) -> tuple[float, int]:
    """Embedding.cu: up to 3,072 indices, zeros and one kernel that adds each gradient row into its token's
    row; beyond, the indices sorted, then EmbeddingBackwardKernel.cu's two-pass path: per-segment partial
    sums in fp32 (written, then read; at most indices / 10 + min(indices, rows) partials) and the sums
    scattered into the touched rows. Kernels: zeros, the index sort and the segment scans counted one
    each (cub launches a few), krn_partials_per_segment, compute_num_of_partial_segments,
    krn_partial_segment_offset, compute_grad_weight, sum_and_scatter."""
    tokens, width = indices.numel(), grad.shape[-1]
    touched = min(tokens, rows) * width * grad.element_size()
    if tokens <= 3072:
        return float(touched), 2
    partials = (tokens // EMBEDDING_ROWS_PER_THREAD + min(tokens, rows)) * width * 4
    index_passes = 4 * tokens * indices.element_size()  # the sort reads and writes keys and positions
    return float(2 * partials + touched + index_passes), 10


# ----------------------------------------------------------------------------------------------
# The card's attention kernel, and the stand-ins for the CUDA-only ones.


# The memory-efficient kernel's tiles on sm_75 at think72's head size 128 (queries x keys), as torch's
# dispatch picks them (aten/src/ATen/native/transformers/cuda/mem_eff_attention/kernels/generate_kernels.py
# and the cutlassF.h / cutlassB.h it generates, attention.cu / attention_backward.cu's launchKernel: the first
# kernel in sort order whose kMaxK holds the head size and whose shared memory fits the card):
# forward fmha_cutlassF_f16_aligned_32x128_rf_sm75 (64x64 holds head sizes <= 64 only); backward
# fmha_cutlassB_f16_aligned_64x64_k128_sm75 (the 128x64 k128 kernel sorts first but needs more than the
# T4's 64 KiB of shared memory per block: "fallback to 64 for GPUs with less shmem (Sm75, Sm86 ...)").
# Causal from the top left inside each document (kernel_forward.h: a query block computes the key blocks up
# to its last query; kernel_backward.h getSmallestQueryForKey: a key block computes the query blocks from
# its first key), every tile whole. FLOPs per computed query-key pair and head dimension: 4 forward (QK^T,
# PV), 10 backward (QK^T again, dO V^T, dV, dQ, dK).
EFFICIENT_TILES = {"small": ((64, 64), (64, 64)), "large": ((32, 128), (64, 64))}  # head size <= 64 / <= 128
POPULATION_ROWS = 4000  # rows of the packer's output the attention is counted over


def efficient_tiles(head_dim: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """((forward queries, keys), (backward queries, keys)) of the sm_75 memory-efficient kernel's tiles."""
    return EFFICIENT_TILES["small" if head_dim <= 64 else "large"]


def tiled_pairs(length: int, tile: tuple[int, int], backward: bool) -> int:
    """Query-key pairs the kernel computes over one document of `length` tokens, causal, whole tiles."""
    queries, keys = tile
    if backward:  # each key block: the query blocks from the one holding its first key to the end
        blocks = -(-length // queries)
        return sum(blocks - (start // queries) for start in range(0, length, keys)) * queries * keys
    # each query block: the key blocks up to its last query
    return sum(-(-min(length, start + queries) // keys) for start in range(0, length, queries)) * queries * keys


def executed_attention_flops(
    kernel: str, lengths: list[int], context: int, heads: int, head_dim: int, parts: tuple = ("forward", "backward")
) -> float:
    """FLOPs one layer's attention kernel executes over a row of documents (its forward and/or backward):
    the memory-efficient varlen kernel at its sm_75 tiles (EFFICIENT_TILES); the others as
    attention.attention_flops counts them, a third forward (the flash kernels' tiles are not read here:
    their triangle, a lower bound)."""
    if kernel != "efficient varlen":
        whole = attention.attention_flops(kernel, lengths, context, heads, head_dim)
        return whole * (("forward" in parts) / 3 + ("backward" in parts) * 2 / 3)
    forward_tile, backward_tile = efficient_tiles(head_dim)
    forward = sum(tiled_pairs(length, forward_tile, False) for length in lengths) if "forward" in parts else 0
    backward = sum(tiled_pairs(length, backward_tile, True) for length in lengths) if "backward" in parts else 0
    return heads * head_dim * (4 * forward + 10 * backward)


@functools.lru_cache(maxsize=4)
def population(
    context: int,
    rows: int = POPULATION_ROWS,
    seed: int = 0,
    median: float = MEDIAN_DOCUMENT,
    sigma: float = DOCUMENT_SIGMA,
) -> tuple[tuple[int, ...], ...]:
    """Each row's document lengths over `rows` rows of the project's own packer (train_data.MaskedPacking,
    --packing masked) on a stream of documents of lognormal lengths (median, sigma)."""

    rng = np.random.default_rng(seed)
    needed = rows * context + 1
    lengths = []
    while sum(lengths) < needed:
        lengths.extend(np.maximum(1, np.round(rng.lognormal(math.log(median), sigma, 4096))).astype(np.int64))
    packing = train_data.MaskedPacking(np.cumsum(lengths).astype(np.uint64), context)
    return tuple(tuple(int(n) for n in np.bincount(packing.segments(row))) for row in range(rows))


@dataclasses.dataclass(frozen=True)
class KernelPlan:
    kernel: str  # attention.AttentionPlan.documents ("efficient varlen", "flash varlen") or "masked ..."
    repeated: bool  # K/V heads repeated to the query heads before the kernel
    lengths: tuple  # each micro-batch row's document lengths (the rows the model is counted on)
    preset: model_config.Preset
    context: int
    element: int  # bytes per element of q, k, v
    rows_population: tuple = ()  # each row's document lengths over thousands of packed rows (population)

    def flops(self, per_row=attention.attention_flops) -> float:
        """Forward + backward FLOPs of one layer over the micro-batch: `per_row` (attention.attention_flops:
        useful; executed_attention_flops: at the kernel's tiles) averaged over the population of packed
        rows (the micro-batch's own rows where none is given), times the micro-batch's rows."""
        rows = self.rows_population or self.lengths
        total = sum(
            per_row(self.kernel, list(row), self.context, self.preset.heads, self.preset.head_dim) for row in rows
        )
        return total / len(rows) * len(self.lengths)

    def bytes(self, backward: bool) -> tuple[float, float]:
        """(read, written) by one layer's fused kernel over the micro-batch, each tensor once."""
        p = self.preset
        tokens = len(self.lengths) * self.context
        q = tokens * p.heads * p.head_dim * self.element
        kv = tokens * (p.heads if self.repeated else p.kv_heads) * p.head_dim * self.element
        lse = tokens * p.heads * 4
        bias = (
            len(self.lengths) * self.context * self.context * self.element
            if attention.kernel(self.kernel).masked
            else 0
        )
        if not backward:
            return q + 2 * kv + bias, q + lse
        # read q, k, v, o, dO, the logsumexp and the row sums dO.O (written by the kernel's first pass)
        return 3 * q + 2 * kv + 2 * lse + bias + q + q, q + 2 * kv + lse


def kernel_costs(plan: KernelPlan):
    """The attention kernel's (FLOPs executed, read, written) for the Counter: forward or backward."""
    forward = plan.flops(functools.partial(executed_attention_flops, parts=("forward",)))
    backward = plan.flops(functools.partial(executed_attention_flops, parts=("backward",)))

    def cost(name: str, args, out) -> tuple[float, float, float]:
        is_backward = name.endswith("backward")
        read, written = plan.bytes(is_backward)
        return backward if is_backward else forward, read, written

    return cost


def stand_in(name: str, args):
    """Outputs of the CUDA-only attention kernels with their shapes and dtypes (the CPU ones run)."""
    if name == "_efficient_attention_forward":
        query, key, value = args[:3]
        batch, tokens, heads, dim = query.shape
        return (
            query.new_empty(batch, tokens, heads, value.shape[-1]),
            query.new_empty(batch if args[4] is None else len(args[4]) - 1, heads, tokens, dtype=torch.float32),
            torch.empty(2, dtype=torch.int64),
            torch.empty(0, dtype=torch.int64),
            0,
            0,
        )
    if name == "_efficient_attention_backward":
        query, key, value = args[1:4]
        return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value), query.new_empty(0)
    return None


# ----------------------------------------------------------------------------------------------
# One forward and backward, counted.


def fused_rms_norm(input, normalized_shape, weight=None, eps=None):
    """F.rms_norm as CUDA runs it: one aten._fused_rms_norm forward, its own backward (the CPU decomposes it)."""
    return FusedRMSNorm.apply(input, tuple(normalized_shape), weight, eps)


class FusedRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, normalized_shape, weight, eps):
        # on CPU the op decomposes before a dispatch mode sees it: counted as the one op CUDA runs
        with Counter.paused() as counter:
            output, rstd = aten._fused_rms_norm(input, list(normalized_shape), weight, eps)
        if counter is not None:
            counter.record(
                aten._fused_rms_norm.default, (input, list(normalized_shape), weight, eps), {}, (output, rstd)
            )
        ctx.save_for_backward(input, rstd, weight)
        ctx.normalized_shape = list(normalized_shape)
        return output

    @staticmethod
    def backward(ctx, grad):
        input, rstd, weight = ctx.saved_tensors
        grad_input, grad_weight = aten._fused_rms_norm_backward(
            grad, input, ctx.normalized_shape, rstd, weight, [True, weight is not None]
        )
        return grad_input, None, grad_weight, None


@dataclasses.dataclass
class Side:
    label: str  # "before" or "after"
    precision: str
    kernel: str
    ops: list
    tokens: int
    parameters: int
    plan: KernelPlan

    def per_token(self, category: str | None = None, field: str = "bytes", phases=("forward", "backward")) -> float:
        total = 0.0
        for op in self.ops:
            if op.phase in phases and (category is None or op.category == category):
                total += op.flops if field == "flops" else op.moved
        return total / self.tokens


def count_side(label: str, preset: model_config.Preset, precision: str, batch: int, seed: int = 0) -> Side:
    """One forward + backward through losses.language_model_loss on fake CPU tensors under `precision`
    autocast: "before" the stock model on the masked path, "after" the training model on the card's plan."""
    segments, lengths = packed_rows(batch, preset.context, seed)
    documents = attention.documents_of(segments)
    card_plan = attention.choose_attention(CARD_PLANS[precision], precision, preset.head_dim)
    element = 2
    if label == "before":
        implementation, kernel, repeated = attention.MASKED, "masked " + card_plan.causal, True
    else:
        implementation, kernel = card_plan.implementation, card_plan.documents
        repeated = implementation == attention.EFFICIENT
    plan = KernelPlan(
        kernel,
        repeated,
        tuple(tuple(row) for row in lengths),
        preset,
        preset.context,
        element,
        population(preset.context),
    )
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with fake:
        torch.manual_seed(0)
        model = model_config.build_model(preset, VOCAB)
        model.config.use_cache = False
        if label == "after":
            model_config.autocast_elementwise(model)
        model.train()
        inputs = torch.randint(0, VOCAB, (batch, preset.context))
        targets = torch.randint(0, VOCAB, (batch, preset.context))
    attention.use_attention(model, implementation)
    tracker = ModuleTracker()
    counter = Counter(tracker, kernel_costs(plan), stand_in)
    rms_norm = torch.nn.functional.rms_norm
    torch.nn.functional.rms_norm = fused_rms_norm  # the stock model's norms never call it
    names = {
        id(module): f"{type(model.model).__name__}.{name}".rstrip(".") for name, module in model.model.named_modules()
    }
    pre_hook, hook = label_backward(names)
    hooks = [
        torch.nn.modules.module.register_module_forward_pre_hook(pre_hook),
        torch.nn.modules.module.register_module_forward_hook(hook),
    ]
    try:
        with fake, tracker, counter, torch.autocast("cpu", dtype=DTYPES[precision]):
            loss = losses.language_model_loss(model, inputs, targets, chunk_tokens=CARD_CHUNK, documents=documents)
            counter.phase = "backward"
            loss.backward()
    finally:
        torch.nn.functional.rms_norm = rms_norm
        for handle in hooks:
            handle.remove()
    parameters = model_config.parameter_count(preset, VOCAB)
    return Side(label, precision, kernel, counter.ops, batch * preset.context, parameters, plan)


# ----------------------------------------------------------------------------------------------
# The optimizer step, counted the same way.


def count_optimizer(preset: model_config.Preset, precision: str, world: int) -> list[Op]:
    """One optimizer step of one rank as train.py runs it (GradScaler's unscale under fp16, the gradient
    norm and clip, muon.Muon on the hidden matrices with Newton-Schulz in the card's dtype, fused AdamW on
    the rest, zero_grad in place under DDP), on fake tensors. Under DDP each rank orthogonalizes its share
    (muon.newton_schulz_owners) and receives the others' (muon.Muon.orthogonalize): counted here for the rank
    with the largest share, its iterations' every op (the matmuls and the casts and norms around them)."""

    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with fake:
        model = model_config.build_model(preset, VOCAB)
        for parameter in model.parameters():
            parameter.grad = torch.zeros_like(parameter)
    hidden, rest, head = optimization.hidden_matrices(model)
    rest = rest + head
    card = CARD_PLANS[precision]
    ns_dtype = hardware.newton_schulz_dtype(card, precision)
    shapes = [tuple(parameter.shape) for parameter in hidden]
    owners = muon.newton_schulz_owners(shapes, world)
    loads = [
        sum(hardware.newton_schulz_flops(*shape) for shape, owner in zip(shapes, owners) if owner == rank)
        for rank in range(world)
    ]
    rank = loads.index(max(loads))
    with fake:  # the first step makes the optimizers' state: not counted
        optimizers = [
            muon.Muon(hidden, ns_dtype=ns_dtype, lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True),
            torch.optim.AdamW([{"params": rest, "weight_decay": 0.0}], lr=1e-3, fused=True),
        ]
        for optimizer in optimizers:
            optimizer.step()
    own_share = optimizers[0]

    def orthogonalize(updates, group):  # this rank's share; the others' arrive over the link (not device work)
        return [
            own_share.newton_schulz(update, group)
            if owner == rank
            else torch.empty(update.shape, dtype=muon.DTYPES[ns_dtype], device=update.device)
            for update, owner in zip(updates, owners)
        ]

    own_share.orthogonalize = orthogonalize
    tracker = ModuleTracker()
    counter = Counter(tracker, None, lambda name, args: None)
    counter.phase = "optimizer"
    with fake, tracker, counter:
        grads = [parameter.grad for parameter in model.parameters()]
        if precision == "fp16":
            found_inf = torch.zeros(1)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, torch.ones(1))
        # optimization.clip_gradients, clipping (the costlier case); foreach as on CUDA (one kernel per list)
        norm = torch.nn.utils.get_total_norm(grads, foreach=True)
        torch.nn.utils.clip_grads_with_norm_(list(model.parameters()), 1.0, norm, foreach=True)
        for optimizer in optimizers:
            optimizer.step()
        torch._foreach_zero_(grads)  # zero_grad(set_to_none=False) under DDP
    for op in counter.ops:
        op.category = "newton-schulz" if op.category == "matmul" else "optimizer"
    return counter.ops


# ----------------------------------------------------------------------------------------------
# The compiled estimate: fusion groups.


def fused_bytes(ops: list[Op]) -> tuple[dict, int]:
    """({category: bytes} and the kernel count) when every fusable group of non-boundary ops reads its
    external inputs once and writes what leaves it once (the module docstring's model of Inductor).

    A non-boundary op joins the groups of the non-boundary ops that produced its inputs when they are at
    its level: the number of boundary ops (matmuls, the attention kernel) on the longest path from the
    step's inputs, so that no group waits on a matmul that waits on the group itself."""
    producer: dict = {}  # key -> op index
    level: dict = {}  # key -> level of the tensor
    op_level = [0] * len(ops)
    parent = list(range(len(ops)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    consumers: dict = collections.defaultdict(set)
    for index, op in enumerate(ops):
        levels = [level.get(key, 0) for key, _, _ in op.inputs]
        op_level[index] = max(levels, default=0)
        for key, _, _ in op.inputs:
            consumers[key].add(index)
        if not op.boundary:
            for key, _, _ in op.inputs:
                source = producer.get(key)
                if (
                    source is not None
                    and not ops[source].boundary
                    and ops[source].phase == op.phase
                    and op_level[source] == op_level[index]
                ):
                    parent[find(source)] = find(index)
        for key, _ in op.outputs:
            producer[key] = index
            level[key] = op_level[index] + (1 if op.boundary else 0)
    totals: dict = collections.defaultdict(float)
    groups: dict = collections.defaultdict(list)
    for index, op in enumerate(ops):
        if op.boundary:
            totals[op.category] += op.read + op.written
        else:
            groups[find(index)].append(index)
    for members in groups.values():
        inside = set(members)
        seen_reads, seen_writes = set(), set()
        for index in members:
            op = ops[index]
            for key, view, size in op.inputs:
                if producer.get(key) in inside and producer[key] < index or (key, view) in seen_reads:
                    continue
                seen_reads.add((key, view))
                totals[op.category] += size
            for key, size in op.outputs:
                if key in seen_writes:
                    continue
                leaves = not consumers.get(key) or any(
                    find(c) != find(index) or ops[c].boundary for c in consumers[key] if c > index
                )
                if leaves or producer.get(key) != index:
                    seen_writes.add(key)
                    totals[op.category] += size
    kernels = sum(1 for op in ops if op.boundary) + len(groups)
    return dict(totals), kernels


# ----------------------------------------------------------------------------------------------
# The compiled bytes: what Inductor itself fuses (its scheduler's kernels and their buffers).


def inductor_bytes(preset_name: str, layers: int, batch: int, seed: int = 0, ddp: bool = False) -> dict:
    """torch.compile (Inductor, CPU) of losses.LanguageModelLoss over the training model (think72's shape
    with `layers` layers, vocab 33,069) on the T4 plan's attention path (attention.efficient_varlen: the K/V
    repeat and the kernel, a custom op Inductor keeps opaque, varlen_ops.py; on CPU it runs each document
    through SDPA), one forward and backward under bf16 autocast on `batch` rows of packed documents;
    Inductor's own count of each scheduled kernel's buffers
    (GraphLowering.count_bytes: what torch._inductor.metrics.num_bytes_accessed sums). Returns per graph
    (forward, backward) the bytes of Inductor's generated kernels, of the extern kernels (matmuls, the
    attention kernel), and of the kernels touching a vocabulary-sized buffer (the loss and the LM head).
    `ddp`: the module wrapped as train.py wraps it on 2 cards (distributed.data_parallel inside torch.compile:
    Dynamo's DDPOptimizer splits the graph at DDP's buckets, and Inductor fuses nothing across a split), in a
    gloo group of one process."""
    import torch._functorch.config as functorch_config
    import torch._inductor.compile_fx as compile_fx
    import torch._inductor.config as inductor_config
    import torch._inductor.graph as inductor_graph
    from torch._inductor.scheduler import ExternKernelSchedulerNode

    preset = dataclasses.replace(model_config.PRESETS[preset_name], layers=layers)
    graphs: list[dict] = []
    count_bytes = inductor_graph.GraphLowering.count_bytes

    def recording_count_bytes(graph):
        total, node_counts, runtimes = count_bytes(graph)
        record = {"fused": 0, "extern": 0, "vocabulary": 0, "kernels": 0, "externs": 0, "nodes": []}
        for node, elements in node_counts:
            size = elements * 4
            extern = isinstance(node, ExternKernelSchedulerNode)
            record["extern" if extern else "fused"] += size
            record["externs"] += extern
            if not extern:
                record["kernels"] += 1
                origins = [
                    origin
                    for sub in node.get_nodes()
                    if getattr(sub, "node", None) is not None
                    for origin in sub.node.origins
                ]
                touches_vocabulary = any(
                    VOCAB in tuple(getattr(origin.meta.get("val"), "shape", ())) for origin in origins
                )
                names = sorted({origin.name for origin in origins})
                record["nodes"].append((size, node.get_name(), touches_vocabulary, names[:8]))
                if touches_vocabulary:
                    record["vocabulary"] += size
        graphs.append(record)
        return total, node_counts, runtimes

    segments, _ = packed_rows(batch, preset.context, seed)
    documents = attention.documents_of(segments)
    level = compile_fx.inductor_metrics_log.level
    inductor_graph.GraphLowering.count_bytes = recording_count_bytes
    compile_fx.inductor_metrics_log.setLevel(logging.INFO)
    caches = inductor_config.fx_graph_cache, functorch_config.enable_autograd_cache
    inductor_config.fx_graph_cache = functorch_config.enable_autograd_cache = False  # a cached graph is not counted
    torch._dynamo.reset()
    with ddp_group() if ddp else contextlib.nullcontext():
        try:
            torch.manual_seed(seed)
            model = model_config.build_model(preset, VOCAB)
            model.config.use_cache = False
            model_config.autocast_elementwise(model)
            attention.use_attention(model, attention.EFFICIENT)
            module = losses.LanguageModelLoss(model.train(), chunk_tokens=CARD_CHUNK)
            if ddp:
                module = distributed.data_parallel(module, distributed.DistInfo(0, 0, 1, torch.device("cpu")))
            module = distributed.compiled(module)  # as train.py compiles it
            inputs = torch.randint(0, VOCAB, (batch, preset.context))
            targets = torch.randint(0, VOCAB, (batch, preset.context))
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = module(inputs, targets, documents=documents)
            loss.backward()
            del module  # DDP's reducer, before its process group goes
        finally:
            inductor_config.fx_graph_cache, functorch_config.enable_autograd_cache = caches
            inductor_graph.GraphLowering.count_bytes = count_bytes
            compile_fx.inductor_metrics_log.setLevel(level)
            torch._dynamo.reset()
    return {"layers": layers, "batch": batch, "tokens": batch * preset.context, "graphs": graphs}


@contextlib.contextmanager
def ddp_group():
    """A gloo process group of one (this process), for DDP on CPU."""
    import socket

    import torch.distributed as dist

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------
# Per-token figures for hardware.predict_step.


# Inductor's own count (torch 2.13.0+cpu, `python bench/bench_roofline.py --inductor`): {layers: (bytes of
# its generated kernels, those kernels, extern kernels, bytes of the kernels touching a vocabulary-sized
# tensor)} per micro-step, forward and backward graphs together, at 1 and 2 layers of the preset's shape, and
# ("ddp") at its full depth compiled under DDP as train.py runs it on 2 cards (DDPOptimizer's graph splits).
# Measured 2026-12-05 on think72 at 8 x 1,024 with train.py's Inductor options (hardware.INDUCTOR_OPTIONS) and
# the layer's attention in the kernels' layout (bench/RESULTS.md, "The step waits for less"): 114.6 KB a token
# each layer (was 141.2), 249 KB outside the layers; under DDP 51.4 KB a token more.
INDUCTOR_RECORDED: dict = {
    (model_config.PRESETS["think72"], 8192): {
        1: (2979681804, 60, 55, 2023657520),
        2: (3918077964, 93, 83, 2023657520),
        "ddp": (15599825012, 515, 419, 1939154992),
    },
}


def inductor_summary(measured: dict) -> dict:
    """{layers: (bytes of Inductor's own kernels, its kernels, extern kernels, bytes of the kernels that touch
    a vocabulary-sized tensor)} per micro-step, forward and backward graphs together, from inductor_bytes'
    results ({layers: result})."""
    summary = {}
    for layers, result in measured.items():
        graphs = result["graphs"]
        summary[layers if layers == "ddp" else int(layers)] = tuple(
            sum(graph[field] for graph in graphs) for field in ("fused", "kernels", "externs", "vocabulary")
        )
    return summary


def inductor_micro_step(summary: dict, layers: int) -> tuple[float, float, float, float]:
    """What Inductor's kernels move per micro-step at `layers` layers, from its counts at 1 and 2 layers
    (the layers are alike: the second layer's figures are each layer's)."""
    one, two = summary[1], summary[2]
    return tuple(a + (layers - 1) * (b - a) for a, b in zip(one, two))


def compiled_other(side: Side) -> tuple[float, float, float, str] | None:
    """(bytes per micro-step outside matmuls and the attention kernel, what DDP's graph splits add to them,
    kernels per micro-step, source) of the compiled step: Inductor's own count where one is recorded for this
    shape (INDUCTOR_RECORDED)."""
    recorded = INDUCTOR_RECORDED.get((side.plan.preset, side.tokens))
    if recorded is None or side.label != "after":
        return None
    fused, kernels, externs, _ = inductor_micro_step(recorded, side.plan.preset.layers)
    split = recorded["ddp"][0] - fused if "ddp" in recorded else 0.0
    return fused, split, kernels + externs, "Inductor"


def counted_step(side: Side, optimizer_ops: list[Op], world: int, compiled: bool) -> hardware.CountedStep:
    ops = [op for op in side.ops if op.phase in ("forward", "backward")]
    inductor = compiled_other(side) if compiled else None
    split = 0.0
    if inductor is not None:
        totals = collections.defaultdict(float)
        for op in ops:
            if op.boundary and op.category in ("matmul", "attention"):
                totals[op.category] += op.read + op.written
        totals["other"], split, kernels = inductor[0], inductor[1], inductor[2]
    elif compiled:
        totals, kernels = fused_bytes(ops)
    else:
        totals = collections.defaultdict(float)
        for op in ops:
            totals[op.category] += op.moved
        kernels = sum(op.kernels for op in ops)
    tokens = side.tokens
    # Newton-Schulz's matmuls are timed by their FLOPs (compute-bound at these shapes), the rest by bytes
    optimizer_bytes = sum(op.moved for op in optimizer_ops if op.category == "optimizer")
    shapes = hardware.muon_matrix_shapes(side.plan.preset)
    exchange = muon.exchange_order(muon.newton_schulz_owners(shapes, world), world)
    return hardware.CountedStep(
        micro_batch_tokens=tokens,
        matmul_flops=side.per_token("matmul", "flops"),
        matmul_bytes=totals.get("matmul", 0.0) / tokens,
        attention_flops=side.per_token("attention", "flops"),
        attention_bytes=totals.get("attention", 0.0) / tokens,
        other_bytes=sum(value for key, value in totals.items() if key not in ("matmul", "attention")) / tokens,
        ddp_split_bytes=split / tokens,
        launches=kernels,
        optimizer_bytes=optimizer_bytes,
        optimizer_launches=sum(op.kernels for op in optimizer_ops),
        newton_schulz_flops=sum(op.flops for op in optimizer_ops),
        gradient_bytes=4 * side.parameters,
        broadcast_bytes=2 * sum(a * b for a, b in shapes) if world > 1 else 0.0,  # fp16 / bf16 on a card
        bucket_bytes=ddp_buckets(side.plan.preset),
        last_broadcast_bytes=2 * math.prod(shapes[exchange[-1]]) if world > 1 and exchange else 0.0,
    )


@functools.cache
def ddp_buckets(preset: model_config.Preset) -> tuple[int, ...]:
    """Bytes of DDP's buckets of gradients for the model, in the order reduced (distributed.bucket_bytes; the
    model built on "meta")."""
    with torch.device("meta"):
        model = model_config.build_model(preset, VOCAB)
    return tuple(distributed.bucket_bytes(model))


# ----------------------------------------------------------------------------------------------
# Reports.


def thousands(value: float) -> str:
    return f"{value:,.0f}"


def category_table(sides: list[Side], fused: dict) -> list[str]:
    lines = [
        "| per token | " + " | ".join(f"{side.label} {side.precision}" for side in sides) + " |",
        "| --- |" + " ---: |" * len(sides),
    ]
    rows = [
        ("matmul MFLOP", lambda s: s.per_token("matmul", "flops") / 1e6),
        ("attention MFLOP (the card's kernel)", lambda s: s.per_token("attention", "flops") / 1e6),
        ("per-document causal attention MFLOP", lambda s: per_document_flops(s) / 1e6),
    ]
    for category in CATEGORIES:
        rows.append((f"{category} KB (eager)", lambda s, c=category: s.per_token(c) / 1e3))
    rows.append(("outside matmuls KB (eager)", lambda s: outside_matmuls(s) / 1e3))
    rows.append(
        (
            "outside matmuls and attention KB (compiled: Inductor's count, else the fusion model)",
            lambda s: compiled_outside(s, fused) / s.tokens / 1e3,
        )
    )
    rows.append(
        (
            "kernels per micro-step (eager / compiled)",
            lambda s: f"{sum(op.kernels for op in s.ops):,} / {(compiled_other(s) or (0, 0, fused[id(s)][1]))[2]:,.0f}",
        )
    )
    for title, value in rows:
        cells = []
        for side in sides:
            figure = value(side)
            cells.append(figure if isinstance(figure, str) else f"{figure:,.1f}")
        lines.append(f"| {title} | " + " | ".join(cells) + " |")
    return lines


def compiled_outside(side: Side, fused: dict) -> float:
    """Bytes a micro-step outside matmuls and the attention kernel, compiled: Inductor's count where recorded."""
    inductor = compiled_other(side)
    if inductor is not None:
        return inductor[0]
    return sum(value for key, value in fused[id(side)][0].items() if key not in ("matmul", "attention"))


def detail_table(sides: list[Side]) -> list[str]:
    """Bytes per token outside matmuls by what they are (eager)."""
    details = collections.defaultdict(lambda: collections.defaultdict(float))
    for side in sides:
        for op in side.ops:
            if op.category != "matmul":
                details[(op.category, op.detail)][id(side)] += op.moved / side.tokens
    lines = [
        "| bytes per token (eager), KB | " + " | ".join(f"{s.label} {s.precision}" for s in sides) + " |",
        "| --- |" + " ---: |" * len(sides),
    ]
    for (category, detail), values in sorted(details.items()):
        lines.append(f"| {category}: {detail} | " + " | ".join(f"{values[id(s)] / 1e3:,.1f}" for s in sides) + " |")
    return lines


def per_document_flops(side: Side) -> float:
    plan = dataclasses.replace(side.plan, kernel="flash varlen")
    return plan.flops() * side.plan.preset.layers / side.tokens


def outside_matmuls(side: Side) -> float:
    return sum(side.per_token(category) for category in CATEGORIES if category != "matmul")


def card_rows(counts: dict, tokens_per_step: int = 65_536, tokens: float = TOKENS) -> list[str]:
    """The per-card table of docs/training.md: hardware.predict_card over `counts` ({(precision, mode):
    CountedStep}), eager and compiled (Inductor's bytes outside matmuls and attention)."""
    lines = [
        "| card | precision | matmul / attention TFLOP/s, GB/s (assumed) | step (65,536 tokens) eager | "
        "of which matmul / attention / other bytes / launch / Newton-Schulz / optimizer / all-reduce | "
        "tokens/s eager | 1.5B tokens eager | compiled |",
        "| --- | --- | --- | ---: | --- | ---: | ---: | ---: |",
    ]
    cards = {card.key: card for card in hardware.CARDS}
    for key, world in TABLE_CARDS:
        card = cards[key]
        precision = hardware.choose_precision("auto", hardware.Device("cuda", key, card.capability)).value
        rates = hardware.ROOFLINE_RATES[key]
        eager = hardware.predict_card(card, counts[(precision, "eager")], world=world, tokens_per_step=tokens_per_step)
        compiled = hardware.predict_card(
            card, counts[(precision, "compiled")], world=world, tokens_per_step=tokens_per_step
        )
        parts = " / ".join(
            f"{value:.3f}"
            for value in (
                eager.matmul_s,
                eager.attention_s,
                eager.memory_s,
                eager.launch_s,
                eager.newton_schulz_s,
                eager.optimizer_s,
                eager.all_reduce_s,
            )
        )
        lines.append(
            f"| {key}{f' x{world}' if world > 1 else ''} | {precision} | {rates.matmul_tflops:g} / "
            f"{rates.attention_tflops:g}, {rates.bandwidth_gbs:g} | {eager.total_s:.3f} s | {parts} s | "
            f"{eager.tokens_per_second:,.0f} | {eager.hours_for(tokens):.1f} h | "
            f"{compiled.hours_for(tokens):.1f} h ({compiled.tokens_per_second:,.0f}/s) |"
        )
    return lines


def rates_table() -> list[str]:
    lines = [
        "| card | matmul TFLOP/s | attention TFLOP/s | GB/s | launch us | link GB/s | source |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for key, _ in TABLE_CARDS[1:] if TABLE_CARDS[0][0] == TABLE_CARDS[1][0] else TABLE_CARDS:
        r = hardware.ROOFLINE_RATES[key]
        lines.append(
            f"| {key} | {r.matmul_tflops:g} | {r.attention_tflops:g} | {r.bandwidth_gbs:g} | "
            f"{r.launch_us:g} | {r.link_gbs:g} | {r.source} |"
        )
    return lines


def t4_hours(counts: dict, preset_name: str, tokens: float = TOKENS) -> dict:
    """{(mode, rates): hours for `tokens`} on 2x T4 at the README's command, eager and compiled, at the
    central rates (hardware.ROOFLINE_RATES["T4"]) and at the optimistic and pessimistic ones
    (hardware.T4_RATE_RANGE)."""
    card = hardware.card_of(hardware.Device("cuda", "T4", (7, 5)))
    world, micro = README_SPLIT["world"], README_SPLIT["batch_size"]
    tokens_per_step = micro * README_SPLIT["grad_accum"] * world * model_config.PRESETS[preset_name].context
    rates = {"central": hardware.ROOFLINE_RATES["T4"], **hardware.T4_RATE_RANGE}
    return {
        (mode, name): hardware.predict_card(
            card, counts[("fp16", mode)], world=world, rates=card_rates, tokens_per_step=tokens_per_step
        ).hours_for(tokens)
        for mode in ("eager", "compiled")
        for name, card_rates in rates.items()
    }


def final_line(counts: dict, preset_name: str, tokens: float = TOKENS, compiled_source: str = "Inductor") -> str:
    """The figure for the README's command: compiled (train.py's default on CUDA) at the central rates, the
    eager one beside it (train.py's fallback where compilation fails), and the compiled range from the
    optimistic to the pessimistic rates."""
    hours = t4_hours(counts, preset_name, tokens)
    rates = hardware.ROOFLINE_RATES["T4"]
    return (
        f"{preset_name} on 2x T4: {hours[('compiled', 'central')]:.1f} h for {tokens / 1e9:g}B tokens (compiled, "
        f"central rates {rates.matmul_tflops:g} / {rates.attention_tflops:g} TFLOP/s matmul / attention, "
        f"{rates.bandwidth_gbs:g} GB/s, link {rates.link_gbs:g} GB/s, compiled bytes by {compiled_source}; "
        f"eager {hours[('eager', 'central')]:.1f} h; range {hours[('compiled', 'optimistic')]:.1f}-"
        f"{hours[('compiled', 'pessimistic')]:.1f} h)"
    )


def range_table(counts: dict, preset_name: str, tokens: float = TOKENS) -> list[str]:
    hours = t4_hours(counts, preset_name, tokens)
    rates = {"central": hardware.ROOFLINE_RATES["T4"], **hardware.T4_RATE_RANGE}
    lines = [
        "| 2x T4, rates | matmul / attention TFLOP/s, GB/s, link GB/s | eager | compiled |",
        "| --- | --- | ---: | ---: |",
    ]
    for name in ("optimistic", "central", "pessimistic"):
        r = rates[name]
        lines.append(
            f"| {name} | {r.matmul_tflops:g} / {r.attention_tflops:g}, {r.bandwidth_gbs:g}, {r.link_gbs:g} | "
            f"{hours[('eager', name)]:.1f} h | {hours[('compiled', name)]:.1f} h |"
        )
    return lines


# ----------------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="the nano preset at 2 x 256: seconds (the test)")
    parser.add_argument("--preset", default=None)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--precisions", default="fp16,bf16")
    parser.add_argument("--json", default=None, help="write the counts here")
    parser.add_argument("--record", action="store_true", help="print the counts as hardware.ROOFLINE_COUNTS' literal")
    parser.add_argument(
        "--inductor",
        action="store_true",
        help="compile the preset's shape at 1 and 2 layers with Inductor on CPU and print its byte "
        "count as INDUCTOR_RECORDED's entry (minutes)",
    )
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> dict:
    preset_name = args.preset or ("nano" if args.smoke else "think72")
    preset = model_config.PRESETS[preset_name]
    batch = args.batch_size or (2 if args.smoke else README_SPLIT["batch_size"])
    world = README_SPLIT["world"]
    sides, counts, fused = [], {}, {}
    for precision in args.precisions.split(","):
        optimizer_ops = count_optimizer(preset, precision, world)
        for label in ("before", "after"):
            started = time.perf_counter()
            side = count_side(label, preset, precision, batch)
            fused[id(side)] = fused_bytes([op for op in side.ops if op.phase != "optimizer"])
            print(
                f"counted {label} {precision}: {len(side.ops):,} ops in {time.perf_counter() - started:.1f} s",
                flush=True,
            )
            sides.append(side)
            if label == "after":
                for mode in ("eager", "compiled"):
                    counts[(precision, mode)] = counted_step(side, optimizer_ops, world, mode == "compiled")
    after = [side for side in sides if side.label == "after"]
    source = "Inductor" if after and compiled_other(after[0]) else "the fusion model (no Inductor count recorded)"
    return {
        "preset": preset_name,
        "batch": batch,
        "sides": sides,
        "counts": counts,
        "fused": fused,
        "compiled_source": source,
    }


def measure_inductor(preset_name: str, batch: int) -> dict:
    """inductor_bytes at 1 and 2 layers, and at the preset's depth under DDP (DDPOptimizer's splits), printed per
    token and as INDUCTOR_RECORDED's entry."""
    preset = model_config.PRESETS[preset_name]
    measured = {}
    for layers, ddp in ((1, False), (2, False), (preset.layers, True)):
        started = time.perf_counter()
        torch._dynamo.utils.counters.clear()
        measured["ddp" if ddp else layers] = inductor_bytes(preset_name, layers, batch, ddp=ddp)
        breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
        print(
            f"Inductor, {preset_name} with {layers} layer(s){' under DDP' if ddp else ''} at {batch} x "
            f"{preset.context}: {len(measured['ddp' if ddp else layers]['graphs'])} graphs, {breaks} graph breaks, "
            f"{time.perf_counter() - started:.0f} s",
            flush=True,
        )
    summary = inductor_summary(measured)
    tokens = batch * preset.context
    fused, kernels, externs, vocabulary = inductor_micro_step(summary, preset.layers)
    per_layer = summary[2][0] - summary[1][0]
    print(
        f"per token: {fused / tokens / 1e3:,.1f} KB in Inductor's kernels at {preset.layers} layers "
        f"({per_layer / tokens / 1e3:,.1f} KB a layer; {vocabulary / tokens / 1e3:,.1f} KB in the kernels "
        f"that touch a vocabulary-sized tensor: the loss, the LM head's and the embedding's), "
        f"{kernels:.0f} kernels and {externs:.0f} extern kernels a micro-step; under DDP "
        f"{summary['ddp'][0] / tokens / 1e3:,.1f} KB ({(summary['ddp'][0] - fused) / tokens / 1e3:+,.1f} KB: "
        f"its graph splits)"
    )
    print(f"INDUCTOR_RECORDED entry: (model_config.PRESETS[{preset_name!r}], {tokens}): {summary!r}")
    return summary


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.inductor:
        measure_inductor(args.preset or "think72", args.batch_size or README_SPLIT["batch_size"])
        return 0
    torch.set_num_threads(1)  # nothing computes (fake tensors): a second thread would only wait
    result = run(args)
    sides, counts = result["sides"], result["counts"]
    preset = model_config.PRESETS[result["preset"]]
    segments, lengths = packed_rows(result["batch"], preset.context)
    flat = [length for row in lengths for length in row]
    print(
        f"\n{result['preset']}, vocab {VOCAB:,}, micro-batch {result['batch']} x {preset.context}: "
        f"{len(flat)} documents (lognormal lengths, median {MEDIAN_DOCUMENT:g}, sigma {DOCUMENT_SIGMA:g}, "
        f"mean 400 tokens; in the rows: mean {np.mean(flat):.0f}, longest {max(flat)})"
    )
    print("\n" + "\n".join(category_table(sides, result["fused"])))
    print("\n" + "\n".join(detail_table(sides)))
    print()
    for precision in dict.fromkeys(side.precision for side in sides):  # fp16 first, as counted
        before = next(s for s in sides if s.label == "before" and s.precision == precision)
        after = next(s for s in sides if s.label == "after" and s.precision == precision)
        ratio_before = before.per_token("attention", "flops") / per_document_flops(before)
        ratio_after = after.per_token("attention", "flops") / per_document_flops(after)
        bytes_ratio = outside_matmuls(before) / outside_matmuls(after)
        rows = len(after.plan.rows_population)
        print(
            f"{precision}: attention FLOPs executed / useful per-document causal (over {rows:,} "
            f"packed rows): before {ratio_before:.2f}x, after {ratio_after:.2f}x ({after.kernel}"
            f"{', at its sm_75 tiles' if after.kernel == 'efficient varlen' else ''}); bytes outside matmuls "
            f"before / after: {bytes_ratio:.2f}x eager"
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps({f"{p} {m}": dataclasses.asdict(c) for (p, m), c in counts.items()}, indent=1)
        )
    if result["preset"] == "think72" and set(counts) >= {("fp16", "eager"), ("bf16", "eager")}:
        print("\ninputs (hardware.ROOFLINE_RATES; assumptions until the GPU command measures them):")
        print("\n".join(rates_table()))
        print("\n" + "\n".join(card_rows(counts)))
        print("\n" + recorded_check(counts, args.record))
    elif "fp16" in args.precisions.split(","):
        print("\n(the per-card table and the recorded counts are think72's; this is a smoke run)")
    if ("fp16", "eager") in counts:
        print("\n" + "\n".join(range_table(counts, result["preset"])))
        print("\n" + final_line(counts, result["preset"], compiled_source=result["compiled_source"]))
    return 0


def recorded_check(counts: dict, record: bool) -> str:
    """Whether hardware.ROOFLINE_COUNTS (what predict_card and docs/training.md use) are these counts."""
    recorded = hardware.ROOFLINE_COUNTS

    def close(a, b) -> bool:
        if isinstance(a, tuple) or isinstance(b, tuple):
            return len(a) == len(b) and all(close(x, y) for x, y in zip(a, b))
        return math.isclose(a, b, rel_tol=5e-3)

    def literal_of(value) -> str:
        return repr(tuple(int(x) for x in value)) if isinstance(value, tuple) else f"{value:.6g}"

    same = set(recorded) == set(counts) and all(
        close(getattr(recorded[key], field.name), getattr(counts[key], field.name))
        for key in counts
        for field in dataclasses.fields(hardware.CountedStep)
    )
    if record or not same:
        rows = []
        for key, step in sorted(counts.items()):
            fields = ", ".join(
                f"{field.name}={literal_of(getattr(step, field.name))}" for field in dataclasses.fields(step)
            )
            rows.append(f"    {key!r}: CountedStep({fields}),")
        literal = "\n".join(rows)
        return (
            "hardware.ROOFLINE_COUNTS "
            + ("is these counts" if same else "differs from these counts (the tables above use these)")
            + "; as a literal:\nROOFLINE_COUNTS = {\n"
            + literal
            + "\n}"
        )
    return "hardware.ROOFLINE_COUNTS (predict_card, docs/training.md) is these counts, to 0.5%"


if __name__ == "__main__":
    sys.exit(main())
