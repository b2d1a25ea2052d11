"""Attention for training: which kernel runs on which card, what a packed batch carries to it, and the
attention functions transformers calls (kernels and masks side by side, as torchtitan's
models/common/attention.py does).

Document attention (--packing masked): a token sees only the earlier tokens of its own document, and RoPE
positions restart where a document starts. A micro-batch carries its documents as a `Documents` record,
built on the host by the data reader (`documents_of`): each token's document, its position, and the
documents' starts in the flattened batch (cu_seqlens, as flash-attention's varlen kernels take them).
What each kernel computes is only what it keeps: per-document causal attention, never the C x C square.

The kernels, by card (`choose_attention`, a pure rule read off torch's dispatch, sdp_utils.cpp):
- sm_80+ in fp16/bf16, head_dim <= 256: flash attention over cu_seqlens (`torch.nn.attention.varlen
  .varlen_attn`, causal window (-1, 0)) with the K/V heads grouped (GQA kept); a micro-batch without a
  document boundary runs SDPA is_causal restricted to flash, enable_gqa;
- other CUDA cards (T4, V100, P100) and fp32: the memory-efficient kernel over cu_seqlens
  (`aten._efficient_attention_forward`, causal from the top left of each document), its K/V heads repeated
  (the kernel has no grouped heads); without a boundary, SDPA is_causal restricted to memory-efficient;
- bf16 below sm_80 (emulated, no fused kernel takes it) and CPU: SDPA with the block-diagonal boolean mask
  (the CPU flash kernel takes a mask, and at the CPU's contexts, 128-512, the square costs little).
cuDNN attention is never in a plan: with any mask it returns NaN gradients when the sequence length is
64 mod 128 (pytorch #196678, since 2.11), its backward is not deterministic, and flash covers the same
cards. `check_plan` refuses a plan that would hand cuDNN a mask at such a length.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from hardware import Device

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
        return {"position_ids": documents.positions, "document_starts": documents.cu_seqlens,
                "longest_document": documents.longest}
    return {"position_ids": documents.positions, "attention_mask": document_mask(documents.segments)}


# ----------------------------------------------------------------------------------------------
# Which kernel: a pure rule of the device, the dtype and the head size.


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


def choose_attention(device: Device, precision: str, head_dim: int) -> AttentionPlan:
    """The kernels for this device and autocast dtype (torch's dispatch rules, sdp_utils.cpp):

    - flash (check_flash_attention_hardware_support: sm_80+; fp16/bf16; head_dim <= 256, a multiple of 8)
      takes grouped K/V heads (enable_gqa) and, over cu_seqlens, causal windows per document;
    - memory-efficient: any CUDA card from sm_50, fp16/fp32 (bf16 from sm_80), head_dim a multiple of 8
      (4 in fp32); no grouped heads in its varlen entry, so K/V are repeated;
    - math: anything else (the scores in memory).
    Deterministic runs (--deterministic) need nothing else: flash's backward follows
    torch.use_deterministic_algorithms, and the memory-efficient backward then runs with num_splits_key = 1
    (attention_backward.cu); the CPU kernels are deterministic.
    """
    if not device.is_cuda:
        return AttentionPlan("masked cpu flash", "cpu flash", MASKED, (),
                             "CPU: SDPA's flash kernel, the document mask where a row holds several")
    where = device.label()
    half = precision in ("fp16", "bf16")
    if half and device.capability >= (8, 0) and head_dim <= 256 and head_dim % 8 == 0:
        return AttentionPlan("flash varlen", "flash", FLASH, ("flash",),
                             f"flash attention over each document, K/V heads grouped ({precision} on {where})")
    if (precision in ("fp16", "fp32") or device.native_bf16) and head_dim % 8 == 0:
        return AttentionPlan("efficient varlen", "efficient", EFFICIENT, ("efficient",),
                             f"memory-efficient attention over each document, K/V heads repeated "
                             f"({precision} on {where})")
    return AttentionPlan("masked math", "math", MASKED, ("math",),
                         f"math attention ({precision} on {where}: no fused kernel takes it)")


def check_plan(plan: AttentionPlan, context: int) -> str | None:
    """An `error:` text when `plan` would hand cuDNN a mask at a length where it gives NaN gradients
    (pytorch #196678), else None. choose_attention never does; a plan from anywhere else is checked."""
    modulus, bad = CUDNN_NAN_MODULUS
    mask_to_cudnn = plan.masked and (not plan.backends or "cudnn" in plan.backends)
    if mask_to_cudnn and plan.documents != "masked cpu flash" and context % modulus == bad:
        return (f"--context {context}: cuDNN attention with a mask returns NaN gradients at lengths of "
                f"{bad} mod {modulus} (pytorch issue 196678); use another --context (e.g. {context - bad})")
    return None


def attention_flops(kernel: str, lengths: list[int], context: int, heads: int, head_dim: int) -> float:
    """Forward + backward FLOPs one layer's attention computes over a row of documents of `lengths` tokens
    (summing to `context`): the per-document kernels the causal triangle of each document, the masked
    ones the whole C x C square (the mask zeroes what they compute, it does not skip it), the plain
    causal kernels the row's triangle. Scores and weighted sum: 4 h d per query-key pair forward, twice
    that backward (recomputing the scores: 2.5x forward for flash; counted as 2x, FlopCounterMode's rule)."""
    per_pair = 4 * heads * head_dim * 3
    if kernel.startswith("masked") or kernel == "math":
        pairs = context * context
    elif kernel.endswith("varlen"):
        pairs = sum(length * (length + 1) / 2 for length in lengths)
    else:
        pairs = context * (context + 1) / 2
    return per_pair * pairs


# ----------------------------------------------------------------------------------------------
# The attention functions transformers calls (registered with its AttentionInterface).


def _compute_dtype(query):
    import torch

    device_type = query.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return query.dtype


def flash_varlen(query, key, value, cu_seqlens, longest: int, scale: float | None):
    """Causal flash attention inside each document of the flattened batch: query (T, H, D), key and value
    (T, Hkv, D), grouped heads kept. sm_80+, fp16/bf16."""
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn(query, key, value, cu_seqlens, cu_seqlens, longest, longest, scale=scale,
                       window_size=(-1, 0), enable_gqa=True)


def efficient_varlen(query, key, value, cu_seqlens, longest: int, scale: float | None):
    """Causal memory-efficient attention inside each document of the flattened batch (the kernel SDPA
    uses for nested tensors): query (T, H, D), key and value (T, Hkv, D), repeated to H heads."""
    import torch

    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    output = torch.ops.aten._efficient_attention_forward(
        query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0), None, cu_seqlens, cu_seqlens, longest, longest,
        0.0, 1,  # custom_mask_type 1: causal from the top left, in each sequence of cu_seqlens
        needs_grad, scale=scale)[0]
    return output.squeeze(0)


VARLEN_KERNELS = {FLASH: flash_varlen, EFFICIENT: efficient_varlen}


def varlen_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                     document_starts=None, longest_document=None, **kwargs):
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
        output = F.scaled_dot_product_attention(query, key, value, dropout_p=dropout, scale=scaling,
                                                is_causal=tokens > 1, enable_gqa=grouped and groups > 1)
        return output.transpose(1, 2), None  # transformers' reshape after it makes the one copy
    dtype = _compute_dtype(query)
    flat = [tensor.transpose(1, 2).reshape(batch * tokens, tensor.shape[1], dim).to(dtype)
            for tensor in (query, key, value)]
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

    plain_causal = (torch.compiler.is_compiling() and kwargs.get("attention_mask") is None
                    and kwargs.get("local_size") is None and not kwargs.get("q_offset")
                    and not kwargs.get("kv_offset") and kwargs["q_length"] == kwargs["kv_length"])
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

    names = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
             "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
    return [names[name] for name in plan.backends]


def apply_attention_plan(model, plan: AttentionPlan, probe_step) -> tuple:
    """Make `plan` so on `model`: (a context manager factory every forward runs in, the plan's label, a
    warning or None). A fused plan is probed: `probe_step(kernels)` runs a forward and backward with a
    document boundary and one without (the real paths); a kernel that refuses the model falls back to
    the masked math path, with the warning."""
    from torch.nn.attention import sdpa_kernel

    use_attention(model, plan.implementation)
    kernels = (lambda: sdpa_kernel(sdpa_backends(plan))) if plan.backends else contextlib.nullcontext
    if not plan.fused:
        return kernels, plan.label(), None
    try:
        probe_step(kernels)
    except (RuntimeError, ValueError, NotImplementedError) as error:
        use_attention(model, MASKED)
        cause = str(error).splitlines()[0][:200] if str(error) else type(error).__name__
        return (contextlib.nullcontext, f"math fallback (planned: {plan.label()})",
                f"the planned {plan.documents} / {plan.causal} attention does not take this model ({cause}); "
                "attention uses the slower masked math kernel")
    finally:
        model.zero_grad(set_to_none=True)
    return kernels, plan.label(), None


def probe_documents(rows: int, context: int) -> Documents:
    """A probe batch's Documents: every row split into two documents (a boundary the varlen kernels must take)."""
    segments = np.zeros((rows, context), dtype=np.int32)
    segments[:, context // 2:] = 1
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
