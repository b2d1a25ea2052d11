"""Reference computations the tests compare the project's fast paths against (tests/test_attention.py,
tests/test_bench_gpu.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def reference_varlen(query, key, value, cu_seqlens, longest, scale):
    """What flash_varlen and efficient_varlen compute, one document at a time with SDPA is_causal."""
    assert longest == int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    groups = query.shape[1] // key.shape[1]
    pieces = []
    for start, end in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        q, k, v = (tensor[start:end].transpose(0, 1) for tensor in (query, key, value))
        k, v = k.repeat_interleave(groups, dim=0), v.repeat_interleave(groups, dim=0)
        pieces.append(F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale).transpose(0, 1))
    return torch.cat(pieces)
