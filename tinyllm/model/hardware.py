"""Every per-device decision of a run, as pure functions of what the device is.

A `Device` is what torch says of a card (kind, name, compute capability, memory, how many):
`describe()` reads it (the only CUDA call here), every rule below takes it as data, so a table
test fakes a T4, an A100 or a CPU without one. The rules:

- precision: fp16 + GradScaler below sm_80 (P100, V100, T4 have fp16 tensor cores and no bf16
  ones: `torch.cuda.is_bf16_supported()` says True there because it counts emulation), bf16 from
  sm_80 (A100, A10, L4, H100); on CPU bf16 where it has bf16 dot-product instructions torch uses
  (avx512_bf16, AMX: its matmuls run several times faster than fp32's), else fp32;
- attention: attention.choose_attention takes a Device from here (the kernels live in attention.py);
- Newton-Schulz (Muon): the card's fast half type (fp16 below sm_80, bf16 from sm_80); on CPU the run's
  precision (bf16 where native, else fp32);
- the wrapping order (DDP around the compiled model or the compiled DDP model);
- peak FLOP/s and memory bandwidth per card (for MFU); the throughput model of docs/training.md, a
  roofline over what bench/bench_roofline.py counts and each card's sustained rates (predict_step);
- memory: what one step holds (step_memory, checked against a measured step in bench/bench_memory.py),
  and the split of the batch a CUDA out-of-memory error suggests (fitting_split, out_of_memory_advice);
  each optimizer's state per parameter is optimization.OPTIMIZERS' (OptimizerState); the loss's chunk
  (logits_chunk_tokens: a card's memory, a CPU's cache); a CPU run's allocator (malloc_options).

Nothing here imports torch at module level: the rules are table-tested on any machine.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
from dataclasses import dataclass

from tinyllm.common import UserError, atomic_write_json, read_json
from tinyllm.model import attention
from tinyllm.model.config import Preset, parameter_count

# The oldest torch the suite runs on (.ci/run: Kaggle's 2.10; Colab's 2.11 and 2.13 too). 2.9 has what the code
# calls (torch.optim.Muon) but no run of the suite: its Dynamo, gloo and varlen differ from 2.10's (issue 46).
MIN_TORCH = (2, 10)
MIN_TORCH_REASON = "the oldest release its tests run on, Kaggle's"


@dataclass(frozen=True)
class Device:
    """What a training device is, as the rules need it. kind: "cuda" or "cpu"."""

    kind: str
    name: str = ""
    capability: tuple[int, int] = (0, 0)
    memory_bytes: int = 0
    count: int = 1
    bf16_instructions: bool = False  # a CPU whose bf16 matmuls torch runs natively (cpu_bf16_instructions)

    @property
    def is_cuda(self) -> bool:
        return self.kind == "cuda"

    @property
    def native_bf16(self) -> bool:
        """bf16 tensor cores (sm_80 and later). Below that, bf16 runs emulated: slower than fp32."""
        return self.is_cuda and self.capability >= (8, 0)

    def label(self) -> str:
        if not self.is_cuda:
            return "CPU (bf16 instructions)" if self.bf16_instructions else "CPU"
        return f"{self.name} (sm_{self.capability[0]}{self.capability[1]})"


CPU = Device("cpu")
CPU_BF16 = Device("cpu", bf16_instructions=True)
ONEDNN_BF16_ISAS = ("AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX", "AVX10_1_512", "ALL")


def cpu_bf16_instructions(avx512_bf16: bool, amx: bool, aten_capability: str, onednn_max_isa: str | None) -> bool:
    """Whether torch runs this CPU's bf16 matmuls and elementwise kernels natively: it has avx512_bf16 or AMX,
    ATen dispatches its AVX-512 kernels (ATEN_CPU_CAPABILITY not capped below) and oneDNN, which runs the
    matmuls, is not capped below its bf16 ISAs (ONEDNN_MAX_CPU_ISA). Elsewhere bf16 is emulated: an
    8192x128 by 128x344 matmul took 528 ms in bf16 against 43 ms in fp32 with both capped at AVX2, 9.6 ms
    against 36 ms uncapped (bench/RESULTS.md, "bf16 on a CPU with bf16 instructions")."""
    capped = onednn_max_isa is not None and not onednn_max_isa.upper().startswith(ONEDNN_BF16_ISAS)
    return (avx512_bf16 or amx) and aten_capability.upper().startswith(("AVX512", "AMX")) and not capped


def describe(device) -> Device:
    """The Device of a torch.device (the one CUDA query of this module; on CPU, what torch says of its
    instructions)."""
    import torch

    if device.type != "cuda":
        native = cpu_bf16_instructions(
            torch.cpu._is_avx512_bf16_supported(),
            torch.cpu._is_amx_tile_supported(),
            torch.backends.cpu.get_cpu_capability(),
            os.environ.get("ONEDNN_MAX_CPU_ISA"),
        )
        return CPU_BF16 if native else CPU

    props = torch.cuda.get_device_properties(device)
    return Device("cuda", props.name, (props.major, props.minor), int(props.total_memory), torch.cuda.device_count())


@dataclass(frozen=True)
class Card:
    """Published figures of one GPU model: dense tensor-core TFLOP/s per dtype (0: none), fp32
    TFLOP/s (CUDA cores), memory bandwidth in GB/s. From NVIDIA's datasheets (SXM where both exist)."""

    key: str  # matched against torch's device name
    capability: tuple[int, int]
    fp16_tflops: float
    bf16_tflops: float
    fp32_tflops: float
    bandwidth_gbs: float
    memory_gib: float


# Longest key first: "A10G" before "A10", "H100" before "H10".
CARDS = [
    Card("P100", (6, 0), 18.7, 0, 9.3, 732, 16),  # fp16 on CUDA cores at twice fp32 (no tensor cores)
    Card("V100", (7, 0), 125, 0, 15.7, 900, 16),
    Card("T4", (7, 5), 65, 0, 8.1, 320, 15),
    Card("A10G", (8, 6), 125, 125, 31.2, 600, 24),
    Card("A10", (8, 6), 125, 125, 31.2, 600, 24),
    Card("3090", (8, 6), 71, 71, 35.6, 936, 24),
    Card("A100", (8, 0), 312, 312, 19.5, 2039, 80),
    Card("L40S", (8, 9), 362, 362, 91.6, 864, 48),
    Card("L4", (8, 9), 121, 121, 30.3, 300, 24),
    Card("4090", (8, 9), 165, 165, 82.6, 1008, 24),
    Card("H100", (9, 0), 989, 989, 67, 3350, 80),
    Card("H200", (9, 0), 989, 989, 67, 4800, 141),
]


def card_of(device: Device) -> Card | None:
    if not device.is_cuda:
        return None
    for card in sorted(CARDS, key=lambda card: -len(card.key)):
        if card.key in device.name:
            return card
    return None


# ----------------------------------------------------------------------------------------------
# Precision.


@dataclass(frozen=True)
class Precision:
    value: str  # "fp32", "fp16" (with a GradScaler), "bf16"
    reason: str
    warning: str | None = None


def choose_precision(requested: str, device: Device) -> Precision:
    """--precision auto|fp32|fp16|bf16 on `device`. Explicit choices are kept; a slow one is warned about."""
    where = device.label()
    if requested == "auto":
        if not device.is_cuda and device.bf16_instructions:
            return Precision(
                "bf16",
                "auto: bf16 on a CPU with bf16 instructions (avx512_bf16 or AMX: its "
                "matmuls several times faster than fp32's; --precision fp32 for fp32)",
            )
        if not device.is_cuda:
            return Precision("fp32", "auto: fp32 on CPU (no bf16 instructions torch uses)")
        if device.native_bf16:
            return Precision("bf16", f"auto: bf16 on {where} (bf16 tensor cores, no loss scaling)")
        return Precision("fp16", f"auto: fp16 + loss scaling on {where} (no bf16 tensor cores below sm_80)")
    reason = f"--precision {requested}"
    if requested == "bf16" and device.is_cuda and not device.native_bf16:
        return Precision(
            "bf16",
            reason,
            f"--precision bf16 on {where} runs emulated (no bf16 tensor cores "
            "below sm_80: slower than fp32, and attention falls back to the math "
            "kernel); --precision auto picks fp16 with loss scaling here",
        )
    if requested == "bf16" and not device.is_cuda and not device.bf16_instructions:
        return Precision(
            "bf16",
            reason,
            "--precision bf16 on a CPU without bf16 instructions (avx512_bf16, "
            "AMX) runs emulated, many times slower than --precision fp32",
        )
    if requested == "fp16" and not device.is_cuda:
        return Precision(
            "fp16",
            reason,
            "--precision fp16 on CPU is slow and meant for testing the fp16 + loss "
            "scaling path; bf16 (or fp32) is the CPU choice",
        )
    return Precision(requested, reason)


def precision_change(old: str, new: str, device: Device) -> str | None:
    """What a resume says when the checkpoint's precision differs from this device's (None: the same).

    Sound in every direction: weights and optimizer states are fp32 in every precision, autocast only
    changes how the matmuls are computed; fp16's loss scale starts afresh (or is dropped under bf16)."""
    if old == new:
        return None
    scaler = {
        ("fp16", "bf16"): "the loss scaler is dropped",
        ("fp16", "fp32"): "the loss scaler is dropped",
        ("bf16", "fp16"): "a fresh loss scaler starts",
        ("fp32", "fp16"): "a fresh loss scaler starts",
    }
    note = scaler.get((old, new))
    return (
        f"precision changes from {old} (the checkpoint's) to {new} on {device.label()}: the run continues "
        "(weights and optimizer states are fp32 in both)"
        + (f"; {note}" if note else "")
        + "; the continuation is not bit-identical to one on the first card"
    )


# ----------------------------------------------------------------------------------------------
# Muon's Newton-Schulz iteration, and the order of torch.compile and DDP.


def newton_schulz_dtype(device: Device, precision: str) -> str:
    """The dtype Muon orthogonalizes in: the card's fast half type; on CPU the run's `precision` where its
    bf16 is native, else fp32. A bf16 run on a CPU with bf16 instructions iterates in bf16 as torch.optim.Muon
    does: nano's 28 matrices at one thread 12.6 against 27.1 ms, its 4,096-token steps 0.95x the time, held-out
    bits per byte within 0.1% at equal steps (bench/RESULTS.md "Muon's Newton-Schulz in bf16 on a CPU"). An
    fp32 run keeps fp32, where world size 1 and 2 stay equal to fp32 rounding (bf16 amplifies the gradients'
    reduction-order difference 3,500x)."""
    if not device.is_cuda:
        return "bf16" if device.bf16_instructions and precision == "bf16" else "fp32"
    return "bf16" if device.native_bf16 else "fp16"


def use_compile(requested: bool | None, device: Device) -> bool:
    """--compile / --no-compile as given; by default on CUDA (Inductor fuses the norms, RoPE, casts and
    the loss's elementwise work the card would otherwise wait on), off on CPU (its compile time outweighs
    what a CPU run gains, and the tests' runs stay eager)."""
    return device.is_cuda if requested is None else requested


# Inductor's options for the training step (torch.compile(options=...)). realize_reads_threshold: a value
# used by several kernels is written to memory once (realized) when its expression reads more than this many
# buffers, else each user recomputes it. At Inductor's default (4), RoPE's backward (the gradient read twice,
# itself and rolled, and the cos/sin tables) was written in fp32 and read back by the q/k norms' two
# reductions; at 10 each recomputes it from the half-precision gradient: the same fp32 expression, 190 KB a
# token fewer for think72 by Inductor's count (bench/RESULTS.md, "The step waits for less"; 8 gives 1,910,
# 10 and 16 alike 1,853 KB a token).
INDUCTOR_OPTIONS = {"realize_reads_threshold": 10}


def wrap_order(compile: bool, world: int) -> list[str]:
    """How the loss module is wrapped, innermost first. DDP goes inside torch.compile: compiling the
    DDP module lets Dynamo split the graph at DDP's buckets (DDPOptimizer), so each bucket's
    all-reduce overlaps the rest of the backward; DDP around a compiled module waits for the whole
    compiled backward before reducing."""
    order = ["loss"]
    if world > 1:
        order.append("ddp")
    if compile:
        order.append("compile")
    return order


# ----------------------------------------------------------------------------------------------
# Peak throughput (for MFU).


def peak_tflops(device: Device, precision: str) -> float | None:
    """Dense peak TFLOP/s of one card in `precision` (None: a card not in CARDS, or CPU)."""
    card = card_of(device)
    if card is None:
        return None
    if precision == "fp16":
        return card.fp16_tflops
    if precision == "bf16":
        return card.bf16_tflops or card.fp32_tflops  # emulated bf16 is no faster than fp32
    return card.fp32_tflops


# ----------------------------------------------------------------------------------------------
# Memory: what one training step holds on a card, and a split of the batch that fits.

GIB = 1024**3
LOGITS_CHUNK_ELEMENTS = 2**25  # one chunk of the loss on an accelerator: 128 MiB of fp32 logits
# ... and on a CPU: 8 MiB, and at least CPU_CHUNK_HIDDEN_MULTIPLE x hidden tokens. The chunk's elementwise passes (the
# exp, the casts, the gradient) run from the cache when it is small: nano at vocabulary 8,192, one thread, 2,048-token
# micro-batches, 7.1-7.4K tokens/s at 2^25 elements (one chunk of 2,048 tokens), 8.5K at 2^22, 9.3K at 2^21, 9.0K at
# 2^20 (one run each; with `malloc_options`: 7.6-7.8K, 9.3K, 9.5-9.7K, 9.5K). But each chunk also reads the head and
# reads and writes its fp32 gradient (vocab x hidden), which small chunks repeat: the loss alone at think72's head
# (33,069 x 512, 4,096 tokens) took 2.07 s at 256-token chunks, 1.69 s at 1,024, 1.61 s at 2,048; at 16,384 x 256,
# 277 ms at 128, 215-220 ms at 256-512, 254 ms at 1,024 (bench/RESULTS.md "A CPU's step")
CPU_LOGITS_CHUNK_ELEMENTS = 2**21
CPU_CHUNK_HIDDEN_MULTIPLE = 2
USABLE_FRACTION = 0.9  # of a card's memory (a margin, not measured): the CUDA context, cuBLAS, fragmentation


def logits_chunk_tokens(vocab: int, device_type: str, hidden: int = 0) -> int:
    """Tokens per chunk of losses.language_model_loss on a device of `device_type` ("cuda", "cpu", ...), for an LM
    head of `vocab` x `hidden`: 1,014 on a card at think72's vocabulary of 33,069; on a CPU 256 at nano's 8,192 x
    128, 512 at micro's 8,192 x 256, 1,024 at think72's."""
    if device_type != "cpu":
        return max(1, LOGITS_CHUNK_ELEMENTS // vocab)
    return max(1, CPU_LOGITS_CHUNK_ELEMENTS // vocab, CPU_CHUNK_HIDDEN_MULTIPLE * hidden)


# The host's allocator. glibc's malloc, as it comes, returns a freed block above its mmap threshold to the kernel (the
# threshold follows the largest block freed, up to 32 MiB) and trims its heap's top, so a training step, which frees
# and takes the same blocks every micro-step, gets them back as fresh pages, faulted in and zeroed each time. On a CPU
# run that is measurable: nano, one thread, 1.05-1.10x the tokens/s with these at a card's chunk of the loss, and
# 1.32-1.38x (against 1.17-1.22x without them) at a CPU's (bench/bench_cpu_step.py, bench/RESULTS.md).
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)
MMAP_THRESHOLD_MAX = 32 * 1024**2  # the largest glibc takes on a 64-bit machine (DEFAULT_MMAP_THRESHOLD_MAX)
KEEP_ALL = 2**31 - 1  # mallopt takes an int: a heap whose free top stays below 2 GiB is never trimmed


def malloc_options(device_type: str, system: str, libc: str) -> tuple[tuple[int, int], ...]:
    """The (mallopt parameter, value) pairs a run on `device_type` sets under `system` (platform.system())
    and its C library (platform.libc_ver()'s name): on a CPU under glibc, blocks up to 32 MiB from the heap and
    a heap that keeps what is freed (the process holds its peak, which every step reaches anyway); none on an
    accelerator (its memory is the card's) or another C library (macOS, musl: not measured)."""
    if device_type != "cpu" or system != "Linux" or libc != "glibc":
        return ()
    return ((M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX), (M_TRIM_THRESHOLD, KEEP_ALL))


def keep_freed_memory(device_type: str) -> bool:
    """This process' allocator set as malloc_options says (glibc's mallopt, through ctypes); whether it was."""
    import ctypes
    import platform

    options = malloc_options(device_type, platform.system(), platform.libc_ver()[0])
    if not options:
        return False
    mallopt = ctypes.CDLL(None).mallopt
    return all(mallopt(parameter, value) == 1 for parameter, value in options)


@dataclass(frozen=True)
class OptimizerState:
    """Bytes of optimizer state per parameter (optimization.OPTIMIZERS gives each optimizer's)."""

    hidden: int  # per parameter of the hidden matrices (attention and MLP projections)
    rest: int  # per parameter of the embeddings and norms


@dataclass(frozen=True)
class StepMemory:
    """Bytes one rank holds at the peak of a training step, by kind."""

    weights: int  # fp32 parameters, and their autocast copies under fp16/bf16
    gradients: int  # fp32 (DDP's buckets are these same tensors: gradient_as_bucket_view)
    optimizer: int  # AdamW: two fp32 moments; Muon: one fp32 momentum (the hidden matrices)
    activations: int  # what the decoder keeps for the backward
    logits: int  # one chunk of the loss at a time
    attention: int = 0  # the attention path's own: document masks, or the varlen kernels' logsumexp

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations + self.logits + self.attention


def layer_activation_bytes(preset: Preset, precision: str) -> int:
    """Bytes a Qwen3 decoder layer saves for the backward per token, counted from transformers' code
    (SDPA's fused kernels keep no attention scores). `element`: the linears' inputs and outputs under
    autocast (2 bytes) or fp32 (4); the residual stream, the RMSNorms and RoPE are fp32 in every precision:
    - the two RMSNorms: each its fp32 input and normalized output, plus the linears' casts of its output
      (q, k, v; gate, up) under autocast: 16h + 5 * 2h (fp32: 24h, the linears share the norm's output);
    - attention: the q and k norms and RoPE in fp32 (4 tensors of 4 bytes each), SDPA's q, k, v and output,
      o_proj's input;
    - the MLP: gate, up, silu(gate), their product (4 tensors of `element` bytes)."""
    h, i = preset.hidden, preset.intermediate
    q, kv = preset.heads * preset.head_dim, preset.kv_heads * preset.head_dim
    element = 2 if precision in ("fp16", "bf16") else 4
    norms = 16 * h + (5 * 2 * h if element == 2 else 8 * h)
    attention = 16 * q + 16 * kv + element * (3 * q + 2 * kv)
    return norms + attention + 4 * element * i


def attention_bytes(
    kernel: str, preset: Preset, batch_size: int, context: int, precision: str, grad_checkpoint: bool
) -> int:
    """What one step's attention holds beyond layer_activation_bytes for micro-batches with document
    boundaries, by its kernel's record (attention.kernel(kernel).held_bytes: the masked kernels' mask, the
    varlen kernels' logsumexp). Under --grad-checkpoint only one layer's is held at a time."""
    element = 2 if precision in ("fp16", "bf16") else 4
    layers = 1 if grad_checkpoint else preset.layers
    return attention.kernel(kernel).held_bytes(
        preset.heads, preset.kv_heads, preset.head_dim, batch_size, context, element, layers
    )


def step_memory(
    preset: Preset,
    vocab: int,
    batch_size: int,
    context: int,
    precision: str,
    optimizer: OptimizerState,
    grad_checkpoint: bool,
    chunk_tokens: int | None = None,
    attention: str = "flash",
) -> StepMemory:
    """The memory model of one step at micro-batch batch_size x context. An estimate for choosing a split,
    checked against a measured CPU step in bench/bench_memory.py. `chunk_tokens`: the loss's chunk
    (default: a card's logits_chunk_tokens; batch_size * context is the whole batch's logits at once, the loss before
    chunking). Under --grad-checkpoint a layer keeps only its fp32 input, and the backward recomputes one
    layer at a time. `attention`: the kernel of a micro-batch with document boundaries (attention_bytes)."""
    parameters = parameter_count(preset, vocab)
    matrices = preset.layers * (
        preset.hidden * preset.head_dim * 2 * (preset.heads + preset.kv_heads) + 3 * preset.hidden * preset.intermediate
    )
    half = precision in ("fp16", "bf16")
    weights = 4 * parameters + (2 * parameters if half else 0)
    optimizer_bytes = optimizer.hidden * matrices + optimizer.rest * (parameters - matrices)
    tokens = batch_size * context
    per_layer = layer_activation_bytes(preset, precision)
    kept = 4 * preset.hidden * preset.layers + per_layer if grad_checkpoint else per_layer * preset.layers
    activations = tokens * (kept + 16 * preset.hidden)  # + the embedding, the final norm, the loss's gradient
    chunk = min(tokens, chunk_tokens or logits_chunk_tokens(vocab, "cuda"))
    logits = chunk * vocab * (12 if half else 8) + vocab * preset.hidden * 4  # + the head's fp32 gradient
    attention_held = attention_bytes(attention, preset, batch_size, context, precision, grad_checkpoint)
    return StepMemory(weights, 4 * parameters, optimizer_bytes, activations, logits, attention_held)


@dataclass(frozen=True)
class Split:
    batch_size: int
    grad_accum: int
    grad_checkpoint: bool
    memory: StepMemory

    def options(self) -> str:
        return f"--batch-size {self.batch_size} --grad-accum {self.grad_accum}" + (
            " --grad-checkpoint" if self.grad_checkpoint else ""
        )


def usable_memory_bytes(device: Device) -> int:
    return int(device.memory_bytes * USABLE_FRACTION)


def fitting_split(
    preset: Preset,
    vocab: int,
    batch_size: int,
    grad_accum: int,
    context: int,
    precision: str,
    optimizer: OptimizerState,
    grad_checkpoint: bool,
    device: Device,
    attention: str = "flash",
) -> Split | None:
    """The first split smaller than batch_size x grad_accum (the same global batch: every step reads the
    same samples) whose step_memory fits `device`, or None. Smaller micro-batches come first (each a
    divisor of batch_size, the largest first), then --grad-checkpoint (a third more compute) from the
    whole micro-batch down."""

    def split(micro: int, checkpoint: bool) -> Split:
        memory = step_memory(preset, vocab, micro, context, precision, optimizer, checkpoint, attention=attention)
        return Split(micro, grad_accum * batch_size // micro, checkpoint, memory)

    smaller = [micro for micro in range(batch_size - 1, 0, -1) if batch_size % micro == 0]
    candidates = [split(micro, grad_checkpoint) for micro in smaller]
    if not grad_checkpoint:
        candidates += [split(micro, True) for micro in [batch_size, *smaller]]
    usable = usable_memory_bytes(device)
    return next((candidate for candidate in candidates if candidate.memory.total <= usable), None)


def memory_text(size: int) -> str:
    return f"{size / GIB:.1f} GiB" if size >= GIB else f"{size / 2**20:.1f} MiB"


def out_of_memory_advice(
    preset_name: str,
    preset: Preset,
    vocab: int,
    batch_size: int,
    grad_accum: int,
    context: int,
    precision: str,
    optimizer: OptimizerState,
    grad_checkpoint: bool,
    device: Device,
    attention: str = "flash",
) -> str:
    """What a CUDA out-of-memory error in a step says: the micro-batch, the estimate, a split that fits."""
    now = step_memory(preset, vocab, batch_size, context, precision, optimizer, grad_checkpoint, attention=attention)
    flags = Split(batch_size, grad_accum, grad_checkpoint, now).options()
    text = (
        f"CUDA out of memory on {device.label()} ({memory_text(device.memory_bytes)}): {preset_name} at "
        f"micro-batch {batch_size} x {context} tokens ({flags}, {precision}) needs about "
        f"{memory_text(now.total)} by hardware.step_memory"
    )
    split = fitting_split(
        preset, vocab, batch_size, grad_accum, context, precision, optimizer, grad_checkpoint, device, attention
    )
    if now.total <= usable_memory_bytes(device):
        text += " (it should fit: is another process using the card? nvidia-smi shows)"
    if split is None:
        return (
            text + f"; no split of this batch fits {memory_text(usable_memory_bytes(device))} (even micro-batch 1 "
            "with --grad-checkpoint): use a smaller --preset or --context, or a larger card"
        )
    return (
        text + f"; {split.options()} keeps the global batch (the same samples every step) and needs about "
        f"{memory_text(split.memory.total)}"
    )


# ----------------------------------------------------------------------------------------------
# The torch this code needs.


# The CUDA builds torch publishes from MIN_TORCH on (download.pytorch.org/whl/cuXYZ), newest first: a driver
# runs a build of its own CUDA version or older. requirements.txt leaves torch out, so pip never swaps the torch an
# image has (Kaggle's, Colab's) for a multi-GB wheel the driver may not run; these say which one to install.
TORCH_CUDA_BUILDS = ((13, 0), (12, 8), (12, 6))
TORCH_INDEX = "https://download.pytorch.org/whl/"


def torch_too_old(version: str) -> bool:
    """Whether `version` (torch.__version__, or its distribution's) is older than MIN_TORCH; a development
    build that does not parse is let run."""
    try:
        return tuple(int(part) for part in version.split("+")[0].split(".")[:2]) < MIN_TORCH
    except ValueError:
        return False


def driver_cuda_version(nvidia_smi: str) -> tuple[int, int] | None:
    """The CUDA version the NVIDIA driver supports, from `nvidia-smi`'s header ('CUDA Version: 12.4'); None: none."""
    match = re.search(r"CUDA Version:\s*(\d+)\.(\d+)", nvidia_smi)
    return (int(match.group(1)), int(match.group(2))) if match else None


def read_driver_cuda() -> tuple[int, int] | None:
    """driver_cuda_version of this machine's nvidia-smi; None without one (no NVIDIA card or driver)."""
    try:
        text = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return driver_cuda_version(text)


def torch_install_command(driver_cuda: tuple[int, int] | None) -> str | None:
    """The pip command that installs a torch this code runs on this machine: the CPU build without an NVIDIA
    driver, else the newest CUDA build the driver runs; None when the driver is older than every build."""
    need = ".".join(map(str, MIN_TORCH))
    if driver_cuda is None:
        return f"pip install 'torch>={need}' --index-url {TORCH_INDEX}cpu"
    build = next((build for build in TORCH_CUDA_BUILDS if driver_cuda >= build), None)
    return None if build is None else f"pip install 'torch>={need}' --index-url {TORCH_INDEX}cu{build[0]}{build[1]}"


def torch_install_problem(version: str | None, driver_cuda: tuple[int, int] | None) -> str | None:
    """None when the installed torch (`version`; None: not installed) is new enough: install nothing
    torch-related. Else one line: what is wrong and the exact command for this machine's card."""
    if version is not None and not torch_too_old(version):
        return None
    need = ".".join(map(str, MIN_TORCH))
    found = "torch is not installed" if version is None else f"torch {version} is too old"
    machine = (
        "no NVIDIA driver: the CPU build"
        if driver_cuda is None
        else f"the NVIDIA driver runs CUDA {driver_cuda[0]}.{driver_cuda[1]}"
    )
    command = torch_install_command(driver_cuda)
    if command is None:
        oldest = ".".join(map(str, TORCH_CUDA_BUILDS[-1]))
        return (
            f"{found}: tinyllm needs torch>={need} ({MIN_TORCH_REASON}), and {machine}, older than every build "
            f"of it (CUDA {oldest} and up): update the driver, or use an image with torch>={need}"
        )
    return (
        f"{found}: tinyllm needs torch>={need} ({MIN_TORCH_REASON}); for this machine ({machine}): {command} "
        "(in a notebook, then restart its session)"
    )


def torch_problem(version: str) -> str | None:
    """An `error:` text when `version` (torch.__version__) is older than MIN_TORCH, else None."""
    return torch_install_problem(version, read_driver_cuda()) if torch_too_old(version) else None


def check_torch() -> None:
    import torch

    problem = torch_problem(torch.__version__)
    if problem:
        raise UserError(problem)


ACCELERATORS = {"cuda": "CUDA", "mps": "MPS"}  # --device values that need torch to see such a device


def device_problem(choice: str, available: bool) -> str | None:
    """Why `--device CHOICE` cannot run (None: it can): an accelerator torch does not see (`available`)."""
    if choice in ACCELERATORS and not available:
        return f"--device {choice}, but torch sees no {ACCELERATORS[choice]} device"
    return None


def accelerator_available(choice: str) -> bool:
    """Whether torch sees a device of kind `choice` (cpu: always)."""
    import torch

    if choice == "cuda":
        return torch.cuda.is_available()
    if choice == "mps":
        return torch.backends.mps.is_available()
    return True


def check_device(choice: str) -> None:
    """--device (train.py, report.py): a UserError when torch cannot use the device asked for."""
    problem = device_problem(choice, accelerator_available(choice))
    if problem:
        raise UserError(problem)


# ----------------------------------------------------------------------------------------------
# Throughput model: what a training step should take on a card before any GPU has run it, a roofline over
# what bench/bench_roofline.py counts (docs/training.md, "Throughput on GPUs"; bench/bench_gpu.py prints
# it beside what it measures).

# Effective NCCL bus bandwidth between two PCIe cards without NVLink, in GB/s (Kaggle's 2x T4: PCIe 3.0
# x16 is 15.8 GB/s each way on paper; without peer-to-peer NCCL goes through host memory, and
# nccl-tests on such pairs typically show 4-6 GB/s). An assumption: the first 2-GPU run measures it.
PCIE_ALL_REDUCE_GBS = 5.0
# A micro-step adds its fp32 gradient into .grad (AccumulateGrad: read both, write one): every micro-step
# after the first on one card (train.py zero_grad(set_to_none=True): the first gradient is kept as made),
# every micro-step under DDP (train.py zeroes the gradients in place, DDP's bucket views, so even the first adds).
ACCUMULATE_BYTES_PER_PARAMETER = 12
# DDP divides each fp32 gradient by the world size in place before its all-reduce (Reducer::
# mark_variable_ready_dense: bucket_view.div_(div_factor_) when no comm hook is registered): read and write.
DDP_DIVIDE_BYTES_PER_PARAMETER = 8


@dataclass(frozen=True)
class CardRates:
    """What one card sustains on a training step's work, the inputs of the roofline: dense matmuls of the
    model's shapes in the --precision auto dtype, the attention kernel of its plan (useful FLOPs: each
    document's causal triangle), memory bandwidth on elementwise kernels, the host's time per launched
    kernel (eager PyTorch), and the link of the gradient all-reduce. `source`: where each comes from."""

    matmul_tflops: float
    attention_tflops: float
    bandwidth_gbs: float
    launch_us: float
    link_gbs: float
    newton_schulz_tflops: float  # Muon's iteration in hardware.newton_schulz_dtype (small square matmuls)
    source: str


# Assumptions, each with its reason, until bench/bench_gpu.py measures them on the card (its think72 GEMM
# shapes' TFLOP/s and copy bandwidth): a sustained figure, never the datasheet's (hardware.CARDS).
ROOFLINE_RATES = {
    "T4": CardRates(
        17,
        7,
        200,
        15,
        PCIE_ALL_REDUCE_GBS,
        12,
        "central: matmul 17 TFLOP/s, 0.7 of the ~24 TFLOP/s a 4096^3 fp16 cuBLAS matmul sustains "
        "under the T4's 70 W cap (NVIDIA developer forum, 'About GPU peak performance', 2023; "
        "65 TFLOP/s on the datasheet is the boost clock's) at think72's K = 512 products (few "
        "waves over 40 SMs); attention 7 TFLOP/s of the FLOPs the sm_75 memory-efficient kernel "
        "executes at its tiles (assumed: 0.3 of that cuBLAS rate, its softmax between two MMAs "
        "on 32-query tiles, no cp.async on sm_75); 200 GB/s, 62% of the datasheet's 320 GB/s "
        "GDDR6 (NVIDIA T4 datasheet) with ECC on as cloud T4s run it (assumed); 15 us a kernel of "
        "eager PyTorch on Kaggle's 4 shared vCPUs (2 ranks); 5 GB/s PCIe all-reduce (nccl-tests "
        "on PCIe pairs without peer-to-peer: 4-6). bench/bench_gpu.py's roofline:gemm, "
        "roofline:copy and attention:bench measure them on the first T4",
    ),
    "L4": CardRates(
        60,
        25,
        240,
        10,
        0,
        30,
        "assumed: bf16 121 TFLOP/s dense on paper, the same 72 W cap as the T4 (about half "
        "sustained); flash ~0.4 of the matmul rate on short documents; 80% of 300 GB/s; 10 us "
        "a kernel of eager PyTorch on a cloud host (L4, A100, H100, H200 alike)",
    ),
    "A100": CardRates(
        180,
        110,
        1700,
        10,
        0,
        90,
        "assumed: ~270 of 312 TFLOP/s on long bf16 GEMMs, ~2/3 of that on think72's "
        "8192x512x1536-sized products (few waves); FlashAttention-2 ~0.6 of the matmul rate "
        "on short documents; ~83% of 2,039 GB/s (A100 80GB)",
    ),
    "H100": CardRates(
        350,
        180,
        3000,
        10,
        0,
        150,
        "assumed: ~700 of 989 TFLOP/s on long bf16 GEMMs, half of that on think72's small "
        "shapes; flash (FA2-class) ~0.5 of the matmul rate; ~3,000 of 3,350 GB/s (a measured "
        "D2D copy reaches ~3,020)",
    ),
    "H200": CardRates(350, 180, 4300, 10, 0, 150, "as the H100 (the same compute); ~90% of 4,800 GB/s"),
}


# The T4's optimistic and pessimistic rates beside the central ones (ROOFLINE_RATES["T4"]): the range of
# bench/bench_roofline.py's last line.
T4_RATE_RANGE = {
    "optimistic": CardRates(
        20,
        10,
        240,
        15,
        PCIE_ALL_REDUCE_GBS,
        12,
        "0.83 of the forum's 24 TFLOP/s on think72's shapes; attention 0.4 of it; 75% of "
        "320 GB/s (a streaming copy on GDDR6 without ECC); the link at 5 GB/s",
    ),
    "pessimistic": CardRates(
        14,
        5,
        180,
        15,
        4.0,
        10,
        "0.58 of the forum's 24 TFLOP/s (the 70 W cap under a hot, shared host); attention "
        "0.2 of it; 56% of 320 GB/s; the link at 4 GB/s, the low end of nccl-tests on PCIe "
        "pairs without peer-to-peer",
    ),
}


@dataclass(frozen=True)
class CountedStep:
    """What bench/bench_roofline.py counts for one model, micro-batch and card path. Per token of a
    micro-step (forward + backward): FLOPs and bytes by part; per micro-step: kernels launched; per
    optimizer step of one rank: the optimizer's bytes, kernels and Newton-Schulz FLOPs (its share of the
    matrices under DDP), the fp32 gradients the all-reduce moves (DDP's buckets of them in the order they are
    reduced: distributed.bucket_bytes) and Muon's broadcast of the others' orthogonalized shares."""

    micro_batch_tokens: int
    matmul_flops: float
    matmul_bytes: float
    attention_flops: float
    attention_bytes: float
    other_bytes: float  # outside matmuls and the attention kernel: norms, RoPE, casts, the loss, the embedding
    ddp_split_bytes: float  # what compiling under DDP adds to them (DDPOptimizer's graph splits; 0 eager)
    launches: float
    optimizer_bytes: float
    optimizer_launches: float
    newton_schulz_flops: float
    gradient_bytes: float
    broadcast_bytes: float  # Muon's exchange: every rank's orthogonalized matrices, each over the link once
    bucket_bytes: tuple[float, ...]  # DDP's buckets, reduced in this order; the last waits for the backward's end
    last_broadcast_bytes: float  # the matrix exchanged last (muon.exchange_order)


# The share of a micro-step's forward and backward that is its backward, over which DDP's all-reduce of
# every bucket but the last runs: the backward's matmuls are two products for the forward's one (the
# attention kernel's 2.5, the elementwise bytes ~1.5: 2/3 is the matmuls', the largest part).
BACKWARD_SHARE = 2 / 3


@dataclass(frozen=True)
class StepTime:
    """Predicted seconds of one optimizer step, by part, and the tokens it trains (all ranks)."""

    matmul_s: float  # the rank's micro-steps: matmul FLOPs at the sustained rate (or bytes, if longer)
    attention_s: float  # the attention kernel's FLOPs at its rate (or bytes, if longer)
    memory_s: float  # every other byte at the bandwidth
    launch_s: float  # the host's launch time beyond the device's (eager PyTorch's per-op cost)
    newton_schulz_s: float  # Muon's orthogonalization of this rank's share
    optimizer_s: float  # unscale, norm, clip, optimizer updates, zero_grad, gradient accumulation, DDP's divide
    all_reduce_s: float  # what the backward does not hide of DDP's all-reduce, and Muon's broadcast
    tokens_per_step: int

    @property
    def compute_s(self) -> float:
        """Forward and backward of the rank's micro-steps."""
        return self.matmul_s + self.attention_s + self.memory_s + self.launch_s

    @property
    def total_s(self) -> float:
        return self.compute_s + self.newton_schulz_s + self.optimizer_s + self.all_reduce_s

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_per_step / self.total_s

    def hours_for(self, tokens: float) -> float:
        return tokens / self.tokens_per_second / 3600


def exposed_all_reduce(buckets, seconds_a_byte: float, backward: float) -> float:
    """Seconds the step waits for DDP's all-reduce after a `backward` of that many seconds: each bucket is
    ready when the backward has made its gradients (taken as proportional to the parameters before it: the
    matmuls' work is), the last when the backward ends; the link reduces them one after another, each as soon
    as it is ready and the link is free."""
    if not buckets:
        return 0.0
    before_last = sum(buckets[:-1])
    free = made = 0.0
    for index, size in enumerate(buckets):
        made += size
        ready = backward if index == len(buckets) - 1 or not before_last else backward * made / before_last
        free = max(free, ready) + size * seconds_a_byte
    return free - backward


def predict_step(counts: CountedStep, rates: CardRates, *, tokens_per_step: int, world: int = 1) -> StepTime:
    """A step's time from counted work and a card's rates (a roofline, each part at its own limit).

    tokens_per_step is the global batch (all ranks); each rank runs tokens_per_step / world of it in
    micro-steps of counts.micro_batch_tokens. Device time of the micro-steps: matmuls max(FLOPs / rate,
    bytes / bandwidth), attention likewise at its kernel's rate, the other bytes at the bandwidth; the host
    launches every kernel at launch_us each while the device runs, so only the excess counts. The ring
    all-reduce moves 2 (world - 1) / world of the gradients at link_gbs (needed when world > 1), and what of
    it the step waits for is what train.py's loop leaves exposed: the micro-steps but the last run under
    DDP's no_sync (nothing to reduce); in the last, DDP all-reduces each bucket as soon as its gradients are
    all in, while the backward goes on (compiled: DDPOptimizer splits the graph at the buckets, hardware.
    wrap_order), so the backward (BACKWARD_SHARE of the micro-step) hides what it can of them
    (exposed_all_reduce), never the last, whose gradients are complete only when the backward ends (the tied
    embedding's takes the lookup's, the last op). Muon's exchange: each matrix is
    broadcast as soon as its owner has orthogonalized it (muon.Muon.orthogonalize), the broadcasts one after
    another on the link while the iterations go on, so the step waits for the last matrix's transfer, and
    for whatever of the transfers outlasts Newton-Schulz. Not counted: the SMs NCCL's copies take from the
    backward and from Newton-Schulz meanwhile (a channel or two of the T4's 40 SMs for the ~40 ms of
    think72's buckets and the ~22 ms of its exchange: ~3 ms).
    """
    if not (
        rates.matmul_tflops > 0
        and rates.attention_tflops > 0
        and rates.bandwidth_gbs > 0
        and world >= 1
        and rates.newton_schulz_tflops > 0
        and tokens_per_step >= counts.micro_batch_tokens * world > 0
    ):
        raise ValueError("predict_step needs positive rates and at least one micro-batch per rank")
    if world > 1 and not rates.link_gbs > 0:
        raise ValueError("predict_step: world > 1 needs the card's link_gbs")
    tokens = tokens_per_step / world
    micro_steps = tokens / counts.micro_batch_tokens
    bandwidth = rates.bandwidth_gbs * 1e9
    matmul = tokens * max(counts.matmul_flops / (rates.matmul_tflops * 1e12), counts.matmul_bytes / bandwidth)
    attention = tokens * max(
        counts.attention_flops / (rates.attention_tflops * 1e12), counts.attention_bytes / bandwidth
    )
    memory = tokens * (counts.other_bytes + (counts.ddp_split_bytes if world > 1 else 0.0)) / bandwidth
    host = counts.launches * micro_steps * rates.launch_us * 1e-6
    launch = max(0.0, host - (matmul + attention + memory))
    newton_schulz = counts.newton_schulz_flops / (rates.newton_schulz_tflops * 1e12)
    parameters = counts.gradient_bytes / 4
    accumulate = ACCUMULATE_BYTES_PER_PARAMETER * parameters * (micro_steps if world > 1 else micro_steps - 1)
    divide = DDP_DIVIDE_BYTES_PER_PARAMETER * parameters if world > 1 else 0.0
    optimizer = max(
        (counts.optimizer_bytes + accumulate + divide) / bandwidth, counts.optimizer_launches * rates.launch_us * 1e-6
    )
    all_reduce = 0.0
    if world > 1:
        link = rates.link_gbs * 1e9
        ring = 2 * (world - 1) / world / link  # seconds a byte of gradients
        backward = BACKWARD_SHARE * (matmul + attention + memory) / micro_steps
        exchange = counts.last_broadcast_bytes / link + max(0.0, counts.broadcast_bytes / link - newton_schulz)
        all_reduce = exposed_all_reduce(counts.bucket_bytes, ring, backward) + exchange
    return StepTime(matmul, attention, memory, launch, newton_schulz, optimizer, all_reduce, tokens_per_step)


# think72 (vocab 33,069) at micro-batch 8 x 1024, per --precision auto dtype and mode, as
# `python bench/bench_roofline.py` counts them (the training model on the card's attention plan, its FLOPs
# as the kernel executes them over 4,000 packed rows: the T4's at its sm_75 tiles; the compiled bytes outside
# matmuls and attention are Inductor's own count, bench_roofline.INDUCTOR_RECORDED). bench_roofline.py checks
# that these are its counts.
def _think72(
    attention_flops: float,
    attention_bytes: float,
    other_bytes: float,
    ddp_split_bytes: float,
    launches: int,
    optimizer_bytes: float,
    optimizer_launches: int,
) -> CountedStep:
    """think72's counts at 8 x 1024: what the dtypes and modes share (matmuls, Muon, gradients)."""
    return CountedStep(
        micro_batch_tokens=8192,
        matmul_flops=4.31889e8,
        matmul_bytes=1.29959e6,
        attention_flops=attention_flops,
        attention_bytes=attention_bytes,
        other_bytes=other_bytes,
        ddp_split_bytes=ddp_split_bytes,
        launches=launches,
        optimizer_bytes=optimizer_bytes,
        optimizer_launches=optimizer_launches,
        newton_schulz_flops=3.47624e11,
        gradient_bytes=2.88e8,
        broadcast_bytes=1.1010e8,
        bucket_bytes=(37765120, 36711424, 35661824, 37763072, 36711424, 35661824, 67725312),
        last_broadcast_bytes=1.57286e6,
    )


ROOFLINE_COUNTS: dict[tuple[str, str], CountedStep] = {
    ("fp16", "eager"): _think72(6.65079e7, 403200, 4.86837e6, 0.0, 1623, 5.36596e9, 1400),
    ("fp16", "compiled"): _think72(6.65079e7, 403200, 1.85288e6, 51390.8, 908, 5.36596e9, 1400),
    ("bf16", "eager"): _think72(4.48701e7, 317184, 4.66699e6, 0.0, 1567, 4.62481e9, 1345),
    ("bf16", "compiled"): _think72(4.48701e7, 317184, 1.85288e6, 51390.8, 908, 4.62481e9, 1345),
}


def predict_card(
    card: Card,
    counts: CountedStep | None = None,
    *,
    world: int = 1,
    tokens_per_step: int = 65_536,
    mode: str = "eager",
    rates: CardRates | None = None,
) -> StepTime:
    """predict_step for `card` in its --precision auto dtype: `counts` (default: the recorded think72 counts
    of that dtype and `mode`, ROOFLINE_COUNTS), at ROOFLINE_RATES unless `rates` is given."""
    device = Device("cuda", card.key, card.capability)
    precision = choose_precision("auto", device).value
    counts = counts or ROOFLINE_COUNTS[(precision, mode)]
    return predict_step(counts, rates or ROOFLINE_RATES[card.key], tokens_per_step=tokens_per_step, world=world)


def newton_schulz_flops(rows: int, columns: int, steps: int = 5) -> int:
    """FLOPs of torch.optim.Muon's quintic Newton-Schulz on one rows x columns matrix (m <= n after the
    transpose): per step X X^T (2 m^2 n), the polynomial's A @ A (2 m^3) and B @ X (2 m^2 n)."""
    m, n = sorted((rows, columns))
    return steps * (2 * m * m * n + 2 * m * m * m + 2 * m * m * n)


def muon_matrix_shapes(preset) -> list[tuple[int, int]]:
    """The (out, in) shapes of the hidden matrices Muon trains (optimization.hidden_matrices), for a
    model_config.Preset: per layer q, k, v, o and the MLP's gate, up, down."""
    q, kv = preset.heads * preset.head_dim, preset.kv_heads * preset.head_dim
    per_layer = [
        (q, preset.hidden),
        (kv, preset.hidden),
        (kv, preset.hidden),
        (preset.hidden, q),
        (preset.intermediate, preset.hidden),
        (preset.intermediate, preset.hidden),
        (preset.hidden, preset.intermediate),
    ]
    return per_layer * preset.layers


# ----------------------------------------------------------------------------------------------
# Measuring this machine (the glue around the rules above; torch imported where it is used).


def machine_record(device, world: int, precision: str, sdpa: str) -> dict:
    """hardware.json: the software, the cards and the choices made for them."""
    import platform

    import torch
    import transformers

    record = {
        "device": device.type,
        "world_size": world,
        "precision": precision,
        "sdpa_kernels": sdpa,
        "newton_schulz_dtype": newton_schulz_dtype(describe(device), precision),  # Muon's iteration
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.version.cuda,
        "gpus": [],
    }
    if device.type == "cuda":
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            record["gpus"].append(
                {"name": props.name, "memory_bytes": props.total_memory, "capability": f"{props.major}.{props.minor}"}
            )
    return record


def check_required_gpus(require_gpus: int | None, require_gpu_name: str | None, device_type: str) -> None:
    """--require-gpus / --require-gpu-name: a UserError naming the GPUs here when they are not met."""
    import torch

    gpus = (
        [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    )
    if require_gpus and len(gpus) < require_gpus:
        raise UserError(f"--require-gpus {require_gpus}: this machine shows {len(gpus)} GPU(s) {gpus}")
    if require_gpu_name:
        wrong = [name for name in gpus if require_gpu_name.lower() not in name.lower()]
        if not gpus or wrong:
            raise UserError(f"--require-gpu-name {require_gpu_name}: GPUs here are {gpus or 'none'}")
    if require_gpus and device_type != "cuda":
        raise UserError(f"--require-gpus {require_gpus} but training would run on {device_type}")


def peak_flops(device, precision: str, given_tflops: float | None) -> tuple[float | None, str]:
    """(peak FLOP/s of one device for MFU, where the figure comes from): --peak-tflops, the card
    table, or a matmul measured on this CPU."""
    if given_tflops:
        return given_tflops * 1e12, "--peak-tflops"
    if device.type == "cuda":
        card = describe(device)
        tflops = peak_tflops(card, precision)
        return (tflops * 1e12 if tflops else None), f"hardware.CARDS ({card.name}, {precision})"
    return (
        measure_cpu_matmul_flops(precision),
        f"a {'bf16' if precision == 'bf16' else 'fp32'} CPU matmul measured at the start of the run",
    )


def measure_cpu_matmul_flops(precision: str, size: int = 1024, seconds: float = 0.5, tries: int = 5) -> float:
    """FLOP/s of a square matmul on this CPU (bf16 for "bf16", else fp32) with the current thread count:
    the fastest of at least `tries` runs spread over `seconds` (the one least slowed by other load)."""
    import math
    import time

    import torch

    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    a = torch.randn(size, size, generator=torch.Generator().manual_seed(0)).to(dtype)
    b = torch.randn(size, size, generator=torch.Generator().manual_seed(1)).to(dtype)
    torch.mm(a, b)
    best, deadline, runs = math.inf, time.perf_counter() + seconds, 0
    while runs < tries or time.perf_counter() < deadline:
        started = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - started)
        runs += 1
    return 2 * size**3 / best


def plausible_mfu(
    peak: float, mfu: float, device, precision: str, given_tflops: float | None, record=None
) -> tuple[float, float | None]:
    """(peak, mfu) after an MFU above 100%, which only a peak measured too low gives (a CPU matmul timed
    under other load at the start): the peak is measured again and the higher one kept (and written into
    the hardware.json at `record`, when given); an MFU that is still impossible (a wrong --peak-tflops,
    say) is not shown."""
    if device.type == "cpu" and not given_tflops:
        measured = measure_cpu_matmul_flops(precision)
        if measured > peak:
            mfu, peak = mfu * peak / measured, measured
            if record is not None:
                with contextlib.suppress(UserError, OSError):
                    atomic_write_json(
                        record,
                        {
                            **read_json(record),
                            "peak_flops": peak,
                            "peak_flops_source": "a CPU matmul measured again during the run "
                            "(the first measurement was slowed by other load)",
                        },
                    )
    return peak, (mfu if mfu <= 1 else None)


def peak_memory_bytes(device) -> int:
    """The most memory this process has held: CUDA's allocator peak, or the CPU's resident set."""
    import resource

    import torch

    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


# ----------------------------------------------------------------------------------------------
# The machine's CPU load beside a run (Linux's /proc/stat): what --budget's probe waits out.

PROC_STAT = "/proc/stat"


@dataclass(frozen=True)
class CpuTimes:
    """The machine's CPU seconds since boot, all cores together: `busy` (user, nice, system, irq, softirq,
    steal; guests are in user) and `cores` (the cpuN lines)."""

    busy: float
    cores: int


def cpu_times(stat: str, ticks_per_second: int) -> CpuTimes | None:
    """/proc/stat's text as CpuTimes (None: not that format)."""
    lines = stat.splitlines()
    fields = lines[0].split() if lines else []
    if len(fields) < 9 or fields[0] != "cpu" or not all(field.isdigit() for field in fields[1:]):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(field) for field in fields[1:9])
    cores = sum(1 for line in lines if re.match(r"cpu\d+ ", line))
    return CpuTimes((user + nice + system + irq + softirq + steal) / ticks_per_second, max(1, cores))


def read_cpu_times() -> CpuTimes | None:
    """This machine's CpuTimes now; None where there is no /proc/stat (macOS, Windows)."""
    try:
        with open(PROC_STAT) as stat:
            return cpu_times(stat.read(), os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, AttributeError):
        return None
