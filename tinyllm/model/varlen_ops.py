"""The per-document attention kernels as torch custom ops (torch.library.custom_op): `tinyllm::flash_varlen`
and `tinyllm::efficient_varlen`, each with its shapes (register_fake) and its backward, a custom op of its own
(register_autograd).

Why custom ops: torch.compile then traces each kernel as one opaque node, forward and backward, and never
calls torch's meta kernels of the aten ops inside. torch's meta of aten._efficient_attention_backward is
broken in every release from 2.9 to 2.13 (it has no `out` parameter, so its arguments shift and `scale`
arrives twice: "meta__efficient_attention_backward() got multiple values for argument 'scale'"), which made
every compile of the memory-efficient document path fail and fall back to eager.

On CUDA each op calls torch's kernel (the thin glue: _flash_cuda, _efficient_cuda and their backwards):
- flash: aten._flash_attention_forward / _flash_attention_backward over cu_seqlens, causal, the grouped K/V
  heads as they are (flash's varlen kernel takes H a multiple of Hkv). torch.nn.attention.varlen.varlen_attn
  wraps exactly these two ops (2.10 to 2.13: torch/nn/attention/varlen.py), but its arguments change with
  every release (absent in 2.9; no scale in 2.10; no enable_gqa in 2.11), while the aten ops take the
  arguments passed here unchanged from 2.9 to 2.13 (native_functions.yaml of each wheel);
- efficient: aten._efficient_attention_forward / _efficient_attention_backward on a batch of one, the
  documents as the sequences of cu_seqlens, custom_mask_type 1 (causal from the top left of each).
On CPU (the tests, and the suite's compiled model on the varlen plans): torch's CPU flash kernel
(aten._scaled_dot_product_flash_attention_for_cpu and its backward), one document at a time.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor
CAUSAL_FROM_TOP_LEFT = 1  # aten's custom_mask_type (sdp::CustomMaskType::CausalFromTopLeft)
LSE_ALIGNMENT = 32  # the memory-efficient kernel pads each document's logsumexp to a multiple of 32 (kAlignLSE)


def padded_longest(longest):
    """The memory-efficient kernel's logsumexp length for documents of at most `longest` tokens."""
    return (longest + LSE_ALIGNMENT - 1) // LSE_ALIGNMENT * LSE_ALIGNMENT


# ----------------------------------------------------------------------------------------------
# The CPU reference: torch's CPU flash kernel over each document, K/V heads repeated to the query heads.


def _spans(cu_seqlens: Tensor) -> list[tuple[int, int]]:
    bounds = cu_seqlens.tolist()
    return list(zip(bounds[:-1], bounds[1:]))


def _heads_first(tensor: Tensor, start: int, end: int, groups: int = 1) -> Tensor:
    """(T, H, D) rows start:end as (1, H * groups, L, D), each head repeated `groups` times."""
    piece = tensor[start:end]
    if groups > 1:
        piece = piece.repeat_interleave(groups, dim=1)
    return piece.transpose(0, 1).unsqueeze(0)


def _cpu_forward(query, key, value, cu_seqlens, scale):
    """(output like query, [each document's (H, L) logsumexp]) of (T, H, D) query, (T, Hkv, D) key/value."""
    groups = query.shape[1] // key.shape[1]
    output, lse = torch.empty_like(query), []
    for start, end in _spans(cu_seqlens):
        out, document_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            _heads_first(query, start, end),
            _heads_first(key, start, end, groups),
            _heads_first(value, start, end, groups),
            0.0,
            True,
            scale=scale,
        )
        output[start:end] = out[0].transpose(0, 1)
        lse.append(document_lse[0])
    return output, lse


def _cpu_backward(grad, query, key, value, out, lse_of, cu_seqlens, scale):
    """(dq, dk, dv) of _cpu_forward; lse_of(i, length): document i's (H, L) logsumexp."""
    groups = query.shape[1] // key.shape[1]
    lse_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32  # what the CPU kernel takes
    grads = [torch.zeros_like(tensor) for tensor in (query, key, value)]
    for index, (start, end) in enumerate(_spans(cu_seqlens)):
        lse = lse_of(index, end - start).unsqueeze(0).to(lse_dtype).contiguous()
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            _heads_first(grad, start, end).contiguous(),
            _heads_first(query, start, end),
            _heads_first(key, start, end, groups),
            _heads_first(value, start, end, groups),
            _heads_first(out, start, end).contiguous(),
            lse,
            0.0,
            True,
            scale=scale,
        )
        for total, piece in zip(grads, (dq, dk, dv)):
            piece = piece[0].transpose(0, 1)  # (L, H, D)
            if total.shape[1] != piece.shape[1]:  # the repeated K/V heads' gradients go to their shared head
                piece = piece.unflatten(1, (total.shape[1], groups)).sum(2)
            total[start:end] = piece
    return tuple(grads)


# ----------------------------------------------------------------------------------------------
# Flash: query (T, H, D), key and value (T, Hkv, D); output (T, H, D), logsumexp (H, T) fp32.


@torch.library.custom_op("tinyllm::flash_varlen", mutates_args=(), device_types="cpu")
def flash_varlen(
    query: Tensor, key: Tensor, value: Tensor, cu_seqlens: Tensor, longest: int, scale: float
) -> tuple[Tensor, Tensor]:
    output, lse = _cpu_forward(query, key, value, cu_seqlens, scale)
    return output, torch.cat(lse, dim=1).float()


@flash_varlen.register_kernel("cuda")
def _flash_cuda(query, key, value, cu_seqlens, longest, scale):
    output, lse, _, _, _ = torch.ops.aten._flash_attention_forward(
        query, key, value, cu_seqlens, cu_seqlens, longest, longest, 0.0, True, False, scale=scale
    )
    return output, lse


@flash_varlen.register_fake
def _flash_fake(query, key, value, cu_seqlens, longest, scale):
    return torch.empty_like(query), query.new_empty((query.shape[1], query.shape[0]), dtype=torch.float32)


@torch.library.custom_op("tinyllm::flash_varlen_backward", mutates_args=(), device_types="cpu")
def flash_varlen_backward(
    grad: Tensor,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    out: Tensor,
    lse: Tensor,
    cu_seqlens: Tensor,
    longest: int,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    starts = cu_seqlens.tolist()
    return _cpu_backward(
        grad, query, key, value, out, lambda i, length: lse[:, starts[i] : starts[i] + length], cu_seqlens, scale
    )


@flash_varlen_backward.register_kernel("cuda")
def _flash_backward_cuda(grad, query, key, value, out, lse, cu_seqlens, longest, scale):
    # dropout 0: the kernel reads neither rng_state nor the unused tensor (varlen_attn passes the same)
    rng_state = torch.zeros(2, dtype=torch.uint64, device=query.device)
    unused = torch.empty(0, device=query.device)
    return torch.ops.aten._flash_attention_backward(
        grad,
        query,
        key,
        value,
        out,
        lse,
        cu_seqlens,
        cu_seqlens,
        longest,
        longest,
        0.0,
        True,
        rng_state,
        unused,
        scale=scale,
    )


@flash_varlen_backward.register_fake
def _flash_backward_fake(grad, query, key, value, out, lse, cu_seqlens, longest, scale):
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


# ----------------------------------------------------------------------------------------------
# Memory-efficient: query, key and value (1, T, H, D), the K/V heads already repeated (no GQA in this
# kernel); output (1, T, H, D), logsumexp (documents, H, padded_longest) fp32.


@torch.library.custom_op("tinyllm::efficient_varlen", mutates_args=(), device_types="cpu")
def efficient_varlen(
    query: Tensor, key: Tensor, value: Tensor, cu_seqlens: Tensor, longest: int, scale: float
) -> tuple[Tensor, Tensor]:
    output, lse = _cpu_forward(query[0], key[0], value[0], cu_seqlens, scale)
    padded = query.new_zeros((len(lse), query.shape[2], padded_longest(longest)), dtype=torch.float32)
    for index, document_lse in enumerate(lse):
        padded[index, :, : document_lse.shape[1]] = document_lse
    return output.unsqueeze(0), padded


@efficient_varlen.register_kernel("cuda")
def _efficient_cuda(query, key, value, cu_seqlens, longest, scale):
    output, lse, _, _, _, _ = torch.ops.aten._efficient_attention_forward(
        query, key, value, None, cu_seqlens, cu_seqlens, longest, longest, 0.0, CAUSAL_FROM_TOP_LEFT, True, scale=scale
    )
    return output, lse


@efficient_varlen.register_fake
def _efficient_fake(query, key, value, cu_seqlens, longest, scale):
    lse = query.new_empty((cu_seqlens.shape[0] - 1, query.shape[2], padded_longest(longest)), dtype=torch.float32)
    return query.new_empty(query.shape), lse


@torch.library.custom_op("tinyllm::efficient_varlen_backward", mutates_args=(), device_types="cpu")
def efficient_varlen_backward(
    grad: Tensor,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    out: Tensor,
    lse: Tensor,
    cu_seqlens: Tensor,
    longest: int,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    grads = _cpu_backward(
        grad[0], query[0], key[0], value[0], out[0], lambda i, length: lse[i, :, :length], cu_seqlens, scale
    )
    return tuple(piece.unsqueeze(0) for piece in grads)


@efficient_varlen_backward.register_kernel("cuda")
def _efficient_backward_cuda(grad, query, key, value, out, lse, cu_seqlens, longest, scale):
    # dropout 0: the kernel never reads the philox seed and offset (attention_backward.cu: `if (use_dropout)`)
    seed = offset = torch.empty((), dtype=torch.int64, device=query.device)
    grad_query, grad_key, grad_value, _ = torch.ops.aten._efficient_attention_backward(
        grad,
        query,
        key,
        value,
        None,
        out,
        cu_seqlens,
        cu_seqlens,
        longest,
        longest,
        lse,
        0.0,
        seed,
        offset,
        CAUSAL_FROM_TOP_LEFT,
        False,
        scale=scale,
    )
    return grad_query, grad_key, grad_value


@efficient_varlen_backward.register_fake
def _efficient_backward_fake(grad, query, key, value, out, lse, cu_seqlens, longest, scale):
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape)


# ----------------------------------------------------------------------------------------------
# The backward of each op: its backward op over what the forward saved.


def _save(ctx, inputs, output):
    query, key, value, cu_seqlens, longest, scale = inputs
    out, lse = output
    ctx.save_for_backward(query, key, value, out, lse, cu_seqlens)
    ctx.longest, ctx.scale = longest, scale


def _backward_through(backward_op):
    def backward(ctx, grad, grad_lse):
        query, key, value, out, lse, cu_seqlens = ctx.saved_tensors
        grads = backward_op(grad.contiguous(), query, key, value, out, lse, cu_seqlens, ctx.longest, ctx.scale)
        return (*grads, None, None, None)

    return backward


flash_varlen.register_autograd(_backward_through(flash_varlen_backward), setup_context=_save)
efficient_varlen.register_autograd(_backward_through(efficient_varlen_backward), setup_context=_save)
