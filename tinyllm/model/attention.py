"""Attention for training: which kernel runs on which card, what a packed batch carries to it, and the
attention functions transformers calls (kernels and masks side by side, as torchtitan's
models/common/attention.py does).

Document attention (--packing masked): a token sees only the earlier tokens of its own document, and RoPE
positions restart where a document starts. A micro-batch carries its documents as a `Documents` record,
built on the host by the data reader (`documents_of`): each token's document, its position, and the
documents' starts in the flattened batch (cu_seqlens, as flash-attention's varlen kernels take them).
What each kernel computes is only what it keeps: per-document causal attention, never the C x C square.

The kernels, by card (`choose_attention`, a pure rule of the card, the dtype, the head size and what the
installed torch offers (`torch_kernels`), read off torch's dispatch, sdp_utils.cpp; one record per kernel in
`KERNELS`):
- sm_80+ in fp16/bf16, head_dim <= 256: flash attention over cu_seqlens (the custom op
  `tinyllm::flash_varlen`, varlen_ops.py, on aten._flash_attention_forward, causal) with the K/V heads
  grouped (GQA kept); a micro-batch without a document boundary runs SDPA is_causal restricted to flash,
  enable_gqa;
- other CUDA cards (T4, V100, P100), fp32, and sm_80+ where torch has no flash varlen: the memory-efficient
  kernel over cu_seqlens (the custom op `tinyllm::efficient_varlen` on aten._efficient_attention_forward,
  causal from the top left of each document), its K/V heads repeated (the kernel has no grouped heads);
  without a boundary, SDPA is_causal restricted to memory-efficient;
- bf16 below sm_80 (emulated, no fused kernel takes it) and CPU: SDPA with the block-diagonal boolean mask
  (the CPU flash kernel takes a mask, and at the CPU's contexts, 128-512, the square costs little).
cuDNN attention is never in a plan: with any mask it returns NaN gradients when the sequence length is
64 mod 128 (pytorch #196678, since 2.11), its backward is not deterministic, and flash covers the same
cards. `check_plan` refuses a plan that would hand cuDNN a mask at such a length.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

if TYPE_CHECKING:  # annotations only: hardware.py asks this module's kernel records
    from tinyllm.model.hardware import Device

FLASH = "tinyllm_fa_varlen"  # flash varlen / flash causal, GQA kept
EFFICIENT = "tinyllm_mem_efficient_varlen"  # memory-efficient varlen / causal, K/V heads repeated
MASKED = "tinyllm_masked"  # SDPA with the boolean document mask (CPU flash, or math), heads contiguous
VARLEN_IMPLEMENTATIONS = (FLASH, EFFICIENT)
CUDNN_NAN_MODULUS = (128, 64)  # cuDNN + any attn_mask: NaN in grad_q when seq_len % 128 == 64 (pytorch #196678)


# ----------------------------------------------------------------------------------------------
# What a batch carries: its documents.


class Documents(NamedTuple):
    """The documents of a (B, C) micro-batch. segments: each token's document, numbered from 0 in each
    row (increasing); positions: each token's RoPE position inside its document; cu_seqlens: int32, the
    start of each document in the flattened (B * C) batch, and B * C last (a row's start is always a
    document's); longest: the longest document, in tokens (a host int: no device sync to read it)."""

    segments: object  # torch.Tensor (B, C) int32
    positions: object  # torch.Tensor (B, C) int64
    cu_seqlens: object  # torch.Tensor (documents + 1,) int32
    longest: int

    @property
    def rows(self) -> int:
        return int(self.segments.shape[0])

    @property
    def count(self) -> int:
        return int(self.cu_seqlens.shape[0]) - 1

    @property
    def has_boundary(self) -> bool:
        """Whether some row holds more than one document (else plain causal attention is the same)."""
        return has_boundary(self)

    def to(self, device, non_blocking: bool = False) -> Documents:
        return Documents(*(tensor.to(device, non_blocking=non_blocking) for tensor in self[:3]), self.longest)

    def pin_memory(self) -> Documents:
        return Documents(*(tensor.pin_memory() for tensor in self[:3]), self.longest)


def documents_of(segments: np.ndarray) -> Documents:
    """The Documents of a batch from its (B, C) segments (numpy, each row numbered from 0, increasing),
    as CPU tensors. Pure and cheap: the data reader calls it on the host for every micro-batch."""
    import torch

    segments = np.ascontiguousarray(segments, dtype=np.int32)
    rows, context = segments.shape
    starts = np.ones_like(segments, dtype=bool)
    starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
    flat_starts = np.flatnonzero(starts.reshape(-1))
    cu_seqlens = np.append(flat_starts, rows * context).astype(np.int32)
    index = np.arange(rows * context, dtype=np.int64)
    last_start = np.maximum.accumulate(np.where(starts.reshape(-1), index, 0))
    positions = (index - last_start).reshape(rows, context)
    longest = int(np.diff(cu_seqlens).max()) if rows else 0
    return Documents(torch.from_numpy(segments), torch.from_numpy(positions), torch.from_numpy(cu_seqlens), longest)


def has_boundary(documents: Documents) -> bool:
    """Documents.has_boundary as a function, for the code torch.compile traces: torch 2.10's Dynamo cannot
    call a property of a NamedTuple (a graph break: "Data-dependent branching ... has_boundary")."""
    return documents.cu_seqlens.shape[0] - 1 > documents.segments.shape[0]


def document_mask(segments):
    """The (B, 1, C, C) boolean mask of document attention: block-diagonal and causal (True: attend)."""
    import torch

    same = segments[:, :, None] == segments[:, None, :]
    causal = torch.ones(segments.size(1), segments.size(1), dtype=torch.bool, device=segments.device).tril()
    return (same & causal)[:, None]


def decoder_inputs(model, documents: Documents | None) -> dict:
    """What `model.model(...)` is given besides the tokens so that attention and positions stay inside
    each document: nothing for a micro-batch without a boundary (plain causal, positions 0..C-1); the
    positions and cu_seqlens for the varlen kernels; the positions and the boolean mask otherwise."""
    if documents is None or not has_boundary(documents):
        return {}
    if model.config._attn_implementation in VARLEN_IMPLEMENTATIONS:
        return {
            "position_ids": documents.positions,
            "document_starts": documents.cu_seqlens,
            "longest_document": documents.longest,
        }
    return {"position_ids": documents.positions, "attention_mask": document_mask(documents.segments)}


# ----------------------------------------------------------------------------------------------
# What the installed torch offers: read once (torch_kernels), taken by the rule as data.


@dataclass(frozen=True)
class TorchKernels:
    """The per-document kernels the installed torch has. flash_varlen: aten._flash_attention_forward takes
    cu_seqlens (cum_seq_q) and a scale, and the build has flash attention; efficient_varlen:
    aten._efficient_attention_forward takes cu_seqlens, a custom_mask_type and a scale. Both hold for the
    CUDA wheels of 2.9 to 2.13 (their native_functions.yaml, tests/test_attention.py's table)."""

    version: str
    flash_varlen: bool
    efficient_varlen: bool


def kernels_of(version: str, flash_arguments, efficient_arguments, flash_built: bool) -> TorchKernels:
    """TorchKernels of a torch release from the argument names of its two forward ops (None: no such op)
    and whether its build has flash attention (torch.backends.cuda.is_flash_attention_available)."""
    flash = flash_built and {"cum_seq_q", "cum_seq_k", "scale"} <= set(flash_arguments or ())
    efficient = {"cu_seqlens_q", "cu_seqlens_k", "custom_mask_type", "scale"} <= set(efficient_arguments or ())
    return TorchKernels(version, flash, efficient)


def torch_kernels() -> TorchKernels:
    """The installed torch's TorchKernels (on a CPU build flash_varlen is False: no card to run it)."""
    import torch

    def arguments(name):
        op = getattr(torch.ops.aten, name, None)
        return None if op is None else [argument.name for argument in op.default._schema.arguments]

    return kernels_of(
        torch.__version__.split("+")[0],
        arguments("_flash_attention_forward"),
        arguments("_efficient_attention_forward"),
        torch.backends.cuda.is_flash_attention_available(),
    )


CUDA_WHEELS = TorchKernels("2.9-2.13 (CUDA)", flash_varlen=True, efficient_varlen=True)  # a card's own torch


# ----------------------------------------------------------------------------------------------
# The kernels: one record each (KERNELS), what it needs, computes and holds.


def flash_problem(device: Device, precision: str, head_dim: int, offered: TorchKernels) -> str | None:
    """Why flash varlen cannot run here (None: it can). check_flash_attention_hardware_support and
    check_head_dim_size_flash (sdp_utils.cpp): sm_80+, fp16/bf16, head_dim <= 256 and a multiple of 8."""
    if not offered.flash_varlen:
        return f"torch {offered.version} has no flash varlen kernel"
    if not device.is_cuda or device.capability < (8, 0):
        return f"flash attention needs sm_80+ ({device.label()})"
    if precision not in ("fp16", "bf16"):
        return f"flash attention takes fp16/bf16 only ({precision})"
    if head_dim > 256 or head_dim % 8:
        return f"flash attention takes head_dim <= 256, a multiple of 8 ({head_dim})"
    return None


def efficient_problem(device: Device, precision: str, head_dim: int, offered: TorchKernels) -> str | None:
    """Why efficient varlen cannot run here (None: it can): any CUDA card from sm_50, fp16/fp32 (bf16 from
    sm_80: check_tensor_dtype), head_dim a multiple of 8 (check_head_dim_size_mem_efficient: 4 in fp32)."""
    if not offered.efficient_varlen:
        return f"torch {offered.version} has no memory-efficient varlen kernel"
    if not device.is_cuda:
        return "the memory-efficient kernel needs CUDA"
    if precision == "bf16" and not device.native_bf16:
        return f"the memory-efficient kernel takes bf16 from sm_80 only ({device.label()})"
    if head_dim % 8:
        return f"the memory-efficient kernel takes head_dim a multiple of 8 ({head_dim})"
    return None


@dataclass(frozen=True)
class Kernel:
    """One attention kernel. takes: what carries the documents to it ("boundaries": cu_seqlens, "mask": the
    block-diagonal boolean mask, None: nothing, plain causal); computes: the query-key pairs it computes
    ("documents": each document's causal triangle, "row": the row's causal triangle, "square": all C x C, the
    mask zeroes what it computes, it does not skip it); holds: what it keeps for the backward beyond the
    layer's activations ("logsumexp", "mask", "mask and scores", None); repeats_kv: K/V heads repeated to the
    query heads before it; needs: what it needs of the card and of torch, in words; problem: the same as a
    rule (None where it runs); function: the varlen kernel's Python entry."""

    name: str
    implementation: str
    takes: str | None
    computes: str
    holds: str | None
    repeats_kv: bool
    needs: str
    problem: object = None  # (device, precision, head_dim, TorchKernels) -> str | None
    function: object = None
    aliases: tuple[str, ...] = ()

    @property
    def boundaries(self) -> bool:
        return self.takes == "boundaries"

    @property
    def masked(self) -> bool:
        return self.takes == "mask"

    @property
    def exact(self) -> bool:
        """Whether it computes document attention (not plain causal attention across documents)."""
        return self.takes is not None

    def pairs(self, lengths: list[int], context: int) -> float:
        if self.computes == "square":
            return context * context
        if self.computes == "documents":
            return sum(length * (length + 1) / 2 for length in lengths)
        return context * (context + 1) / 2

    def flops(self, lengths: list[int], context: int, heads: int, head_dim: int) -> float:
        """Forward + backward FLOPs of one layer over a row of documents of `lengths` tokens (summing to
        `context`): 4 h d per query-key pair forward, twice that backward (recomputing the scores: 2.5x
        forward for flash; counted as 2x, FlopCounterMode's rule)."""
        return 4 * heads * head_dim * 3 * self.pairs(lengths, context)

    def held_bytes(
        self, heads: int, kv_heads: int, head_dim: int, rows: int, context: int, element: int, layers: int
    ) -> int:
        """What a step over `rows` rows holds for it beyond the layers' activations, `layers` layers at a time:
        the masked kernels the (B, 1, C, C) boolean mask, and per layer the additive mask SDPA makes of it
        and keeps for the backward (B C^2 in the compute dtype: 16 MiB at 8 x 1024 in half, measured on CPU),
        math also the scores and their softmax (B H C^2, fp32 and the compute dtype); the varlen kernels per
        layer the fp32 logsumexp (H per token), and K/V repeated to the query heads where it repeats them."""
        tokens = rows * context
        if self.holds in ("mask", "mask and scores"):
            square = rows * context * context
            scores = heads * square * (4 + element) if self.holds == "mask and scores" else 0
            return square + layers * (square * element + scores)
        if self.holds == "logsumexp":
            repeated = 2 * (heads - kv_heads) * head_dim * element if self.repeats_kv else 0
            return layers * tokens * (4 * heads + repeated)
        return 0


def flash_varlen(query, key, value, cu_seqlens, longest: int, scale: float | None):
    """Causal flash attention inside each document of the flattened batch: query (T, H, D), key and value
    (T, Hkv, D), grouped heads kept (varlen_ops.flash_varlen). sm_80+, fp16/bf16."""
    import torch

    from tinyllm.model import varlen_ops  # noqa: F401 - registers torch.ops.tinyllm

    scale = query.shape[-1] ** -0.5 if scale is None else scale
    return torch.ops.tinyllm.flash_varlen(query, key, value, cu_seqlens, longest, scale)[0]


def efficient_varlen(query, key, value, cu_seqlens, longest: int, scale: float | None):
    """Causal memory-efficient attention inside each document of the flattened batch (the kernel SDPA
    uses for nested tensors): query (T, H, D), key and value (T, Hkv, D), repeated to H heads
    (varlen_ops.efficient_varlen)."""
    import torch

    from tinyllm.model import varlen_ops  # noqa: F401 - registers torch.ops.tinyllm

    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    output, _ = torch.ops.tinyllm.efficient_varlen(
        query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0), cu_seqlens, longest, scale
    )
    return output.squeeze(0)


FLASH_NEEDS = "sm_80+, fp16/bf16, head_dim <= 256 (a multiple of 8); torch's flash varlen (aten._flash_attention_*)"
EFFICIENT_NEEDS = (
    "CUDA (sm_50+), fp16/fp32 (bf16 from sm_80), head_dim a multiple of 8; torch's memory-efficient "
    "varlen (aten._efficient_attention_*)"
)
KERNELS = (
    Kernel(
        "flash varlen", FLASH, "boundaries", "documents", "logsumexp", False, FLASH_NEEDS, flash_problem, flash_varlen
    ),
    Kernel(
        "efficient varlen",
        EFFICIENT,
        "boundaries",
        "documents",
        "logsumexp",
        True,
        EFFICIENT_NEEDS,
        efficient_problem,
        efficient_varlen,
    ),
    Kernel(
        "flash",
        FLASH,
        None,
        "row",
        None,
        False,
        "as flash varlen; SDPA is_causal, flash only",
        aliases=("causal flash",),
    ),
    Kernel(
        "efficient",
        EFFICIENT,
        None,
        "row",
        None,
        True,
        "as efficient varlen; SDPA is_causal, memory-efficient only",
        aliases=("causal efficient",),
    ),
    Kernel("cpu flash", MASKED, None, "row", None, False, "CPU; SDPA is_causal (its CPU flash kernel)"),
    Kernel("math", MASKED, None, "square", None, True, "anything; SDPA is_causal, math only (the scores in memory)"),
    Kernel(
        "efficient or math",
        MASKED,
        None,
        "row",
        None,
        True,
        "CUDA; SDPA is_causal, memory-efficient where it takes the inputs, else math",
    ),
    Kernel(
        "masked cpu flash",
        MASKED,
        "mask",
        "square",
        "mask",
        False,
        "CPU; SDPA with the mask (its CPU flash kernel takes one)",
    ),
    Kernel("masked math", MASKED, "mask", "square", "mask and scores", True, "anything; SDPA with the mask, math only"),
    Kernel(
        "masked efficient or math",
        MASKED,
        "mask",
        "square",
        "mask",
        True,
        "CUDA; SDPA with the mask, "
        "memory-efficient where it takes the inputs, else math (never cuDNN: pytorch #196678)",
    ),
    Kernel(
        "masked sdpa",
        MASKED,
        "mask",
        "square",
        "mask",
        True,
        "SDPA with the mask, SDPA's own choice (the stock model; bench/ only)",
        aliases=("masked flash", "masked efficient"),
    ),
)
KERNEL_NAMES = {name: kernel for kernel in KERNELS for name in (kernel.name, *kernel.aliases)}
VARLEN_KERNELS = {kernel.implementation: kernel.function for kernel in KERNELS if kernel.boundaries}
KERNEL_OPS = ("flash_varlen", "flash_varlen_backward", "efficient_varlen", "efficient_varlen_backward")


def kernel(name: str) -> Kernel:
    """The record of a kernel by its name (AttentionPlan's documents and causal, bench/'s paths)."""
    return KERNEL_NAMES[name]


# ----------------------------------------------------------------------------------------------
# Which kernel: a pure rule of the device, the dtype, the head size and what torch offers.


@dataclass(frozen=True)
class AttentionPlan:
    documents: str  # the kernel of a micro-batch with document boundaries
    causal: str  # the kernel of one without (and of --packing stream / bestfit)
    implementation: str  # FLASH, EFFICIENT or MASKED: the attention function transformers calls
    backends: tuple[str, ...]  # the SDPA backends the causal path may use (sdpa_kernel); () = SDPA's choice
    reason: str

    @property
    def fused(self) -> bool:
        """Fused kernels only: a fallback to math would be an error, not silent (the start-up probe)."""
        return self.implementation in VARLEN_IMPLEMENTATIONS

    @property
    def masked(self) -> bool:
        return self.implementation == MASKED

    def label(self) -> str:
        return f"documents: {self.documents}; no boundary: {self.causal} ({self.reason})"


MASKED_FALLBACK = AttentionPlan(
    "masked efficient or math",
    "efficient or math",
    MASKED,
    ("efficient", "math"),
    "SDPA restricted to memory-efficient, then math; never cuDNN with a mask",
)


def choose_attention(
    device: Device, precision: str, head_dim: int, offered: TorchKernels = CUDA_WHEELS
) -> AttentionPlan:
    """The kernels for this device, autocast dtype and head size, from what torch offers (`offered`:
    torch_kernels() of the installed torch; by default a CUDA wheel's, as a card's own torch has): the
    first of attention_plans.
    Deterministic runs (--deterministic) need nothing else: flash's backward follows
    torch.use_deterministic_algorithms, and the memory-efficient backward then runs with num_splits_key = 1
    (attention_backward.cu); the CPU kernels are deterministic."""
    return attention_plans(device, precision, head_dim, offered)[0]


def attention_plans(
    device: Device, precision: str, head_dim: int, offered: TorchKernels = CUDA_WHEELS
) -> list[AttentionPlan]:
    """The plans that may run here, best first: flash varlen and efficient varlen where their needs hold
    (their `problem`: torch's dispatch rules in sdp_utils.cpp), else the masked math path. A card of sm_80+
    without a usable flash varlen takes the memory-efficient varlen, which runs there too; the start-up
    probe tries the next plan when one refuses the model (apply_attention_plan)."""
    if not device.is_cuda:
        return [
            AttentionPlan(
                "masked cpu flash",
                "cpu flash",
                MASKED,
                (),
                "CPU: SDPA's flash kernel, the document mask where a row holds several",
            )
        ]
    where = device.label()
    plans, problems = [], []
    for name, causal, backend, how in (
        ("flash varlen", "flash", "flash", "K/V heads grouped"),
        ("efficient varlen", "efficient", "efficient", "K/V heads repeated"),
    ):
        record = kernel(name)
        problem = record.problem(device, precision, head_dim, offered)
        if problem is None:
            kind = "flash" if record.implementation == FLASH else "memory-efficient"
            plans.append(
                AttentionPlan(
                    name,
                    causal,
                    record.implementation,
                    (backend,),
                    f"{kind} attention over each document, {how} ({precision} on {where})",
                )
            )
        problems.append(problem)
    return plans or [
        AttentionPlan(
            "masked math",
            "math",
            MASKED,
            ("math",),
            f"math attention ({precision} on {where}: no fused kernel takes it: {problems[-1]})",
        )
    ]


def check_plan(plan: AttentionPlan, context: int) -> str | None:
    """An `error:` text when `plan` would hand cuDNN a mask at a length where it gives NaN gradients
    (pytorch #196678), else None. choose_attention never does; a plan from anywhere else is checked."""
    modulus, bad = CUDNN_NAN_MODULUS
    mask_to_cudnn = plan.masked and (not plan.backends or "cudnn" in plan.backends)
    if mask_to_cudnn and plan.documents != "masked cpu flash" and context % modulus == bad:
        return (
            f"--context {context}: cuDNN attention with a mask returns NaN gradients at lengths of "
            f"{bad} mod {modulus} (pytorch issue 196678); use another --context (e.g. {context - bad})"
        )
    return None


def attention_flops(name: str, lengths: list[int], context: int, heads: int, head_dim: int) -> float:
    """Forward + backward FLOPs one layer's attention computes over a row of documents of `lengths` tokens
    (summing to `context`), by the kernel's record (Kernel.flops)."""
    return kernel(name).flops(lengths, context, heads, head_dim)


# ----------------------------------------------------------------------------------------------
# The attention functions transformers calls (registered with its AttentionInterface).


def _compute_dtype(query):
    import torch

    device_type = query.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return query.dtype


def varlen_attention(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout=0.0,
    scaling=None,
    is_causal=None,
    document_starts=None,
    longest_document=None,
    **kwargs,
):
    """The FLASH and EFFICIENT attention functions: per-document kernels when the batch has
    document_starts (decoder_inputs), else causal SDPA (grouped heads under flash, repeated otherwise).
    query (B, H, C, D), key and value (B, Hkv, C, D) after RoPE; returns (B, C, H, D) as transformers'
    attention functions do."""
    import torch
    import torch.nn.functional as F

    implementation = module.config._attn_implementation
    batch, heads, tokens, dim = query.shape
    if document_starts is None:
        groups = heads // key.shape[1]
        grouped = implementation == FLASH
        if not grouped and groups > 1:
            key = key.repeat_interleave(groups, dim=1)
            value = value.repeat_interleave(groups, dim=1)
        output = F.scaled_dot_product_attention(
            query, key, value, dropout_p=dropout, scale=scaling, is_causal=tokens > 1, enable_gqa=grouped and groups > 1
        )
        return output.transpose(1, 2), None  # transformers' reshape after it makes the one copy
    dtype = _compute_dtype(query)
    flat = [
        tensor.transpose(1, 2).reshape(batch * tokens, tensor.shape[1], dim).to(dtype) for tensor in (query, key, value)
    ]
    with torch.autocast(query.device.type, enabled=False):
        output = VARLEN_KERNELS[implementation](*flat, document_starts, longest_document, scaling)
    return output.view(batch, tokens, heads, dim), None


def masked_attention(module, query, key, value, *args, **kwargs):
    """The MASKED attention function: transformers' "sdpa" (with the document mask where decoder_inputs
    gives one) with query, key and value laid out (batch, heads, tokens, dim) in memory first.

    Why contiguous: the projections give head-transposed views, and PyTorch's CPU flash kernel runs slower
    on those (forward + backward of one `micro` layer: ~20 ms on views, ~17 ms contiguous)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query.contiguous(), key.contiguous(), value.contiguous(), *args, **kwargs)


def causal_sdpa_mask(**kwargs):
    """transformers' sdpa_mask, except that under torch.compile a causal mask without padding or cache
    offset is left to SDPA's is_causal, as it is eagerly.

    Why: while tracing, transformers cannot tell whether the position ids restart (packed sequences)
    and builds the full mask; SDPA then repeats the K/V heads and computes the whole masked square.
    The compiled model only ever sees whole blocks: no padding; document masks come in ready-made."""
    import torch
    from transformers.masking_utils import sdpa_mask

    plain_causal = (
        torch.compiler.is_compiling()
        and kwargs.get("attention_mask") is None
        and kwargs.get("local_size") is None
        and not kwargs.get("q_offset")
        and not kwargs.get("kv_offset")
        and kwargs["q_length"] == kwargs["kv_length"]
    )
    return None if plain_causal else sdpa_mask(**kwargs)


ATTENTION_FUNCTIONS = {FLASH: varlen_attention, EFFICIENT: varlen_attention, MASKED: masked_attention}


def use_attention(model, name: str) -> None:
    """Switch `model` to one of ATTENTION_FUNCTIONS. MASKED gets the masks transformers' "sdpa" gets;
    the varlen ones no mask function, so transformers builds no mask at all for them (its
    _preprocess_mask_arguments skips implementations without one) and their kernels take cu_seqlens."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, ATTENTION_FUNCTIONS[name])
    if name == MASKED:
        AttentionMaskInterface.register(name, causal_sdpa_mask)
    model.set_attn_implementation(name)


def sdpa_backends(plan: AttentionPlan) -> list:
    from torch.nn.attention import SDPBackend

    names = {
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "math": SDPBackend.MATH,
    }
    return [names[name] for name in plan.backends]


def apply_attention_plan(model, plan: AttentionPlan, probe_step, alternatives: list[AttentionPlan] = ()) -> tuple:
    """Make `plan` so on `model`: (a context manager factory every forward runs in, the label, a warning or
    None, the plan in effect). A fused plan is probed: `probe_step(kernels)` runs a forward and backward with
    a document boundary and one without (the real paths). A kernel that refuses the model, whatever it
    raises (a RuntimeError from the kernel, a TypeError or ImportError from a torch without it), gives way
    to the next of `alternatives` (attention_plans' others: flash's to the memory-efficient varlen), and the
    last to the masked path restricted to memory-efficient, then math (MASKED_FALLBACK: never cuDNN with a
    mask), with the warning. Running out of memory is no refusal: it propagates."""
    import torch

    use_attention(model, plan.implementation)
    kernels = sdpa_context(plan)
    if not plan.fused:
        return kernels, plan.label(), None, plan
    try:
        probe_step(kernels)
    except Exception as error:  # noqa: BLE001 - a refusing kernel's error has no common base but Exception
        if isinstance(error, torch.OutOfMemoryError):
            raise
        cause = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
        refused = (
            f"the planned {plan.documents} / {plan.causal} attention does not take this model "
            f"({type(error).__name__}: {cause})"
        )
        if alternatives:
            kernels, label, warning, in_effect = apply_attention_plan(
                model, alternatives[0], probe_step, alternatives[1:]
            )
            return kernels, label, f"{refused}; {warning or 'attention uses ' + alternatives[0].documents}", in_effect
        use_attention(model, MASKED)
        return (
            sdpa_context(MASKED_FALLBACK),
            f"{MASKED_FALLBACK.documents} fallback (planned: {plan.label()})",
            f"{refused}; attention uses the slower masked kernels ({MASKED_FALLBACK.reason})",
            MASKED_FALLBACK,
        )
    finally:
        model.zero_grad(set_to_none=True)
    return kernels, plan.label(), None, plan


def sdpa_context(plan: AttentionPlan):
    """A factory of the context every forward of `plan` runs in: SDPA restricted to the plan's backends
    (torch.nn.attention.sdpa_kernel, in the order given), or as it is where the plan names none (CPU)."""
    from torch.nn.attention import sdpa_kernel

    return (lambda: sdpa_kernel(sdpa_backends(plan))) if plan.backends else contextlib.nullcontext


def probe_documents(rows: int, context: int) -> Documents:
    """A probe batch's Documents: every row split into two documents (a boundary the varlen kernels must take)."""
    segments = np.zeros((rows, context), dtype=np.int32)
    segments[:, context // 2 :] = 1
    return documents_of(segments)


@contextlib.contextmanager
def exportable(model):
    """The model as transformers loads it anywhere, for the length of an export: KV cache on, the
    standard "sdpa" attention (which computes what ATTENTION_FUNCTIONS do); as it was again afterwards."""
    config = model.config
    use_cache, attention = config.use_cache, config._attn_implementation
    config.use_cache = True
    if attention in ATTENTION_FUNCTIONS:
        model.set_attn_implementation("sdpa")
    try:
        yield model
    finally:
        config.use_cache = use_cache
        if attention in ATTENTION_FUNCTIONS:
            use_attention(model, attention)
