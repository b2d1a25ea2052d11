"""attention.py: the document layout a batch carries, the kernel rule per card (each card faked as data),
the varlen paths equal to the masked one on CPU (their CUDA kernels replaced by a per-document reference),
and their CUDA calls traced under FakeTensorMode (fake "cuda" tensors, no GPU)."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from cards import A10, A100, CARDS, CPU, H100, H200, L4, P100, T4, V100
from references import reference_varlen

from tinyllm.model import attention, hardware, losses
from tinyllm.model import config as model_config

# ----------------------------------------------------------------------------------------------
# The layout.


def test_documents_of_a_batch():
    segments = np.array([[0, 0, 0, 1, 1, 2], [0, 1, 1, 1, 1, 1]])
    documents = attention.documents_of(segments)
    assert documents.positions.tolist() == [[0, 1, 2, 0, 1, 0], [0, 0, 1, 2, 3, 4]]
    assert documents.cu_seqlens.tolist() == [0, 3, 5, 6, 7, 12] and documents.cu_seqlens.dtype == torch.int32
    assert documents.longest == 5 and documents.count == 5 and documents.rows == 2 and documents.has_boundary
    assert documents.segments.dtype == torch.int32 and documents.positions.dtype == torch.int64


def test_a_batch_of_whole_rows_has_no_boundary():
    documents = attention.documents_of(np.zeros((3, 4), dtype=np.int32))
    assert documents.cu_seqlens.tolist() == [0, 4, 8, 12] and documents.longest == 4
    assert not documents.has_boundary
    assert documents.positions.tolist() == [[0, 1, 2, 3]] * 3


def test_the_document_mask_is_the_hand_built_block_diagonal_causal_one():
    segments = torch.tensor([[0, 0, 0, 1, 1, 2], [0, 1, 1, 1, 1, 1]])
    first = [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [0, 0, 0, 1, 0, 0],
        [0, 0, 0, 1, 1, 0],
        [0, 0, 0, 0, 0, 1],
    ]
    second = [
        [1, 0, 0, 0, 0, 0],
        [0, 1, 0, 0, 0, 0],
        [0, 1, 1, 0, 0, 0],
        [0, 1, 1, 1, 0, 0],
        [0, 1, 1, 1, 1, 0],
        [0, 1, 1, 1, 1, 1],
    ]
    mask = attention.document_mask(segments)
    assert mask.shape == (2, 1, 6, 6) and mask.dtype == torch.bool
    assert mask[:, 0].int().tolist() == [first, second]


# ----------------------------------------------------------------------------------------------
# The rule.

# device, precision, head_dim -> documents kernel, causal kernel, implementation, SDPA backends
PLANS = [
    (CPU, "fp32", 128, "masked cpu flash", "cpu flash", attention.MASKED, ()),
    (CPU, "bf16", 16, "masked cpu flash", "cpu flash", attention.MASKED, ()),
    (P100, "fp16", 128, "efficient varlen", "efficient", attention.EFFICIENT, ("efficient",)),
    (V100, "fp16", 128, "efficient varlen", "efficient", attention.EFFICIENT, ("efficient",)),
    (T4, "fp16", 128, "efficient varlen", "efficient", attention.EFFICIENT, ("efficient",)),
    (T4, "fp32", 128, "efficient varlen", "efficient", attention.EFFICIENT, ("efficient",)),
    (T4, "bf16", 128, "masked math", "math", attention.MASKED, ("math",)),  # emulated bf16: no fused kernel
    (A10, "bf16", 128, "flash varlen", "flash", attention.FLASH, ("flash",)),
    (L4, "bf16", 128, "flash varlen", "flash", attention.FLASH, ("flash",)),
    (A100, "bf16", 128, "flash varlen", "flash", attention.FLASH, ("flash",)),
    (A100, "fp16", 128, "flash varlen", "flash", attention.FLASH, ("flash",)),
    (A100, "fp32", 128, "efficient varlen", "efficient", attention.EFFICIENT, ("efficient",)),  # flash: half only
    (H100, "bf16", 128, "flash varlen", "flash", attention.FLASH, ("flash",)),
    (H100, "bf16", 512, "efficient varlen", "efficient", attention.EFFICIENT, ("efficient",)),  # flash: <= 256
    (H200, "bf16", 128, "flash varlen", "flash", attention.FLASH, ("flash",)),
    (H200, "bf16", 100, "masked math", "math", attention.MASKED, ("math",)),  # no fused kernel: not a multiple of 8
]


@pytest.mark.parametrize("device, precision, head_dim, documents, causal, implementation, backends", PLANS)
def test_the_kernels_of_every_card(device, precision, head_dim, documents, causal, implementation, backends):
    plan = attention.choose_attention(device, precision, head_dim)
    assert (plan.documents, plan.causal, plan.implementation, plan.backends) == (
        documents,
        causal,
        implementation,
        backends,
    )
    assert plan.fused == (implementation != attention.MASKED)
    assert precision in plan.reason or not device.is_cuda


# What each release's torch offers, as its CUDA wheel says: the argument names of aten._flash_attention_forward
# and aten._efficient_attention_forward (torchgen/packaged/ATen/native/native_functions.yaml of torch 2.9.0,
# 2.10.0, 2.11.0, 2.12.0 and 2.13.0), and the arguments of torch.nn.attention.varlen.varlen_attn
# (torch/nn/attention/varlen.py), which wraps the flash pair and which the code does not call for that reason.
FLASH_ARGUMENTS = [
    "query",
    "key",
    "value",
    "cum_seq_q",
    "cum_seq_k",
    "max_q",
    "max_k",
    "dropout_p",
    "is_causal",
    "return_debug_mask",
    "scale",
    "window_size_left",
    "window_size_right",
    "seqused_k",
    "alibi_slopes",
]
EFFICIENT_ARGUMENTS = [
    "query",
    "key",
    "value",
    "bias",
    "cu_seqlens_q",
    "cu_seqlens_k",
    "max_seqlen_q",
    "max_seqlen_k",
    "dropout_p",
    "custom_mask_type",
    "compute_log_sumexp",
    "scale",
    "seqlen_k",
    "window_size",
]
VARLEN_ATTN = ["query", "key", "value", "cu_seq_q", "cu_seq_k", "max_q", "max_k"]
RELEASES = {  # release: (flash forward's arguments, efficient forward's, varlen_attn's or None)
    "2.9": (FLASH_ARGUMENTS, EFFICIENT_ARGUMENTS, None),
    "2.10": (FLASH_ARGUMENTS, EFFICIENT_ARGUMENTS, VARLEN_ATTN + ["is_causal", "return_aux"]),
    "2.11": (FLASH_ARGUMENTS, EFFICIENT_ARGUMENTS, VARLEN_ATTN + ["return_aux", "scale", "window_size"]),
    "2.12": (
        FLASH_ARGUMENTS + ["block_table", "num_splits"],
        EFFICIENT_ARGUMENTS,
        VARLEN_ATTN + ["return_aux", "scale", "window_size", "enable_gqa", "seqused_k", "block_table", "num_splits"],
    ),
    "2.13": (
        FLASH_ARGUMENTS + ["block_table", "num_splits"],
        EFFICIENT_ARGUMENTS,
        VARLEN_ATTN + ["return_aux", "scale", "window_size", "enable_gqa", "seqused_k", "block_table", "num_splits"],
    ),
}
# card, precision, head_dim -> the documents kernel on every release's CUDA wheel
RELEASE_PLANS = [
    (T4, "fp16", "efficient varlen"),
    (V100, "fp16", "efficient varlen"),
    (P100, "fp16", "efficient varlen"),
    (T4, "bf16", "masked math"),
    (A10, "bf16", "flash varlen"),
    (L4, "bf16", "flash varlen"),
    (A100, "bf16", "flash varlen"),
    (A100, "fp16", "flash varlen"),
    (A100, "fp32", "efficient varlen"),
    (H100, "bf16", "flash varlen"),
    (H200, "bf16", "flash varlen"),
]


@pytest.mark.parametrize("release", RELEASES)
def test_every_release_of_torch_gets_the_per_document_kernels(release):
    """torch 2.9 to 2.13 (Kaggle's 2.10, Colab's 2.11, ...): the aten ops the varlen custom ops call take the
    same arguments in each, so every card gets the same per-document kernel, whatever varlen_attn takes (it
    does not exist in 2.9, takes no scale in 2.10 and no enable_gqa in 2.11)."""
    flash_arguments, efficient_arguments, varlen_attn = RELEASES[release]
    offered = attention.kernels_of(release, flash_arguments, efficient_arguments, flash_built=True)
    assert offered.flash_varlen and offered.efficient_varlen
    for device, precision, documents in RELEASE_PLANS:
        plan = attention.choose_attention(device, precision, 128, offered)
        assert plan.documents == documents, (device.name, precision)
        assert "cudnn" not in plan.backends
        if device.capability >= (8, 0) and precision != "fp32":
            assert attention.kernel(plan.documents).boundaries  # sm_80+: never the square


@pytest.mark.parametrize("device", [A10, L4, A100, H100, H200], ids=lambda card: card.name)
def test_an_sm80_card_without_flash_varlen_takes_the_memory_efficient_one(device):
    """A torch built without flash attention (torch.backends.cuda.is_flash_attention_available() False), or
    one whose flash op took no cu_seqlens: the memory-efficient varlen, which runs on sm_80+, not the square."""
    for offered in (
        attention.kernels_of("2.13", FLASH_ARGUMENTS, EFFICIENT_ARGUMENTS, flash_built=False),
        attention.kernels_of("old", ["query", "key", "value"], EFFICIENT_ARGUMENTS, flash_built=True),
    ):
        assert not offered.flash_varlen and offered.efficient_varlen
        plan = attention.choose_attention(device, "bf16", 128, offered)
        assert (plan.documents, plan.implementation, plan.backends) == (
            "efficient varlen",
            attention.EFFICIENT,
            ("efficient",),
        )
    neither = attention.kernels_of("none", None, None, flash_built=False)
    plan = attention.choose_attention(device, "bf16", 128, neither)
    assert plan.documents == "masked math" and plan.backends == ("math",)
    assert "has no memory-efficient varlen kernel" in plan.reason


def test_the_installed_torch_is_read_from_its_own_ops():
    offered = attention.torch_kernels()
    assert offered.version == torch.__version__.split("+")[0]
    assert offered.efficient_varlen  # every torch the project accepts has it (RELEASES)
    assert offered.flash_varlen == torch.backends.cuda.is_flash_attention_available()


@pytest.mark.parametrize("device", CARDS, ids=[card.name for card in CARDS])
def test_auto_precision_gets_a_per_document_kernel_on_every_card(device):
    """think72 under --precision auto: attention computes each document's triangle, on every card."""
    plan = attention.choose_attention(device, hardware.choose_precision("auto", device).value, 128)
    assert attention.kernel(plan.documents).boundaries and plan.fused


@pytest.mark.parametrize("context", [1024, 1088, 2048, 2112, 4160])
@pytest.mark.parametrize("device", [CPU, *CARDS], ids=["cpu"] + [card.name for card in CARDS])
def test_cudnn_is_never_handed_a_mask(device, context):
    """pytorch #196678: cuDNN attention with a mask gives NaN gradients at lengths 64 mod 128. No plan
    lets SDPA choose cuDNN; check_plan refuses one that would, at such a length, with one line."""
    for precision in ("fp16", "bf16", "fp32"):
        plan = attention.choose_attention(device, precision, 128)
        assert "cudnn" not in plan.backends and (plan.backends or not device.is_cuda)
        assert attention.check_plan(plan, context) is None
    unrestricted = attention.AttentionPlan("masked sdpa", "sdpa", attention.MASKED, (), "SDPA's own choice")
    problem = attention.check_plan(unrestricted, context)
    assert (problem is not None) == (context % 128 == 64)
    if problem:
        assert problem.startswith(f"--context {context}: cuDNN") and "196678" in problem and "\n" not in problem


@pytest.mark.parametrize(
    "kernel, ratio",
    [
        ("flash varlen", 1.0),
        ("efficient varlen", 1.0),
        ("masked cpu flash", None),
        ("masked math", None),
        ("flash", None),
    ],
)
def test_attention_flops_count_what_each_kernel_computes(kernel, ratio):
    lengths = [300, 500, 224]
    per_document = attention.attention_flops("flash varlen", lengths, 1024, 8, 128)
    assert per_document == 12 * 8 * 128 * sum(n * (n + 1) / 2 for n in lengths)
    flops = attention.attention_flops(kernel, lengths, 1024, 8, 128)
    if ratio is not None:
        assert flops == per_document
    else:  # the square (masked) or the row's triangle (plain causal): what the documents do not need
        assert flops >= 2.5 * per_document


# ----------------------------------------------------------------------------------------------
# The varlen paths through a real model on CPU: the CUDA kernels replaced by a per-document reference.

VOCAB, BATCH, CONTEXT = 300, 4, 32
SEGMENTS = np.array([[0] * 12 + [1] * 20, [0] * 32, [0] * 5 + [1] * 5 + [2] * 22, [0] * 31 + [1]])


def tiny(implementation: str):
    torch.manual_seed(0)
    model = model_config.build_model(model_config.PRESETS["tiny"], VOCAB)
    attention.use_attention(model, implementation)
    return model


def loss_and_gradients(model, documents, precision=None):
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randint(0, VOCAB, (BATCH, CONTEXT), generator=generator)
    targets = torch.randint(0, VOCAB, (BATCH, CONTEXT), generator=generator)
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=precision or torch.float32, enabled=precision is not None):
        loss = losses.language_model_loss(model, inputs, targets, "sum", documents=documents)
    loss.backward()
    return loss.item(), {name: parameter.grad.clone() for name, parameter in model.named_parameters()}


@pytest.mark.parametrize("implementation", attention.VARLEN_IMPLEMENTATIONS)
def test_the_varlen_paths_equal_the_masked_one(monkeypatch, implementation):
    """The varlen custom ops (their CPU kernel: torch's CPU flash one document at a time) through the model:
    the masked path's loss and gradients."""
    documents = attention.documents_of(SEGMENTS)
    expected_loss, expected = loss_and_gradients(tiny(attention.MASKED), documents)
    calls = []
    kernel = attention.VARLEN_KERNELS[implementation]

    def spy(*args):
        calls.append(args[3].tolist())
        return kernel(*args)

    monkeypatch.setitem(attention.VARLEN_KERNELS, implementation, spy)
    loss, gradients = loss_and_gradients(tiny(implementation), documents)
    assert calls and all(cu == documents.cu_seqlens.tolist() for cu in calls)
    assert len(calls) == model_config.PRESETS["tiny"].layers  # one kernel call per layer
    assert loss == pytest.approx(expected_loss, rel=1e-6)
    for name, gradient in gradients.items():
        assert torch.allclose(gradient, expected[name], rtol=1e-4, atol=1e-6 * expected[name].abs().max()), name


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("implementation", attention.VARLEN_IMPLEMENTATIONS)
def test_each_varlen_op_is_per_document_causal_attention(implementation, dtype, tolerance):
    """The custom op and its backward op against SDPA one document at a time (grouped K/V heads)."""
    generator = torch.Generator().manual_seed(3)
    layout = attention.documents_of(np.array([[0] * 7 + [1] * 19 + [2] * 6]))
    make = lambda heads: torch.randn(32, heads, 16, generator=generator).to(dtype).requires_grad_()  # noqa: E731
    query, key, value = make(4), make(2), make(2)
    grad = torch.randn(32, 4, 16, generator=generator).to(dtype)
    output = attention.VARLEN_KERNELS[implementation](query, key, value, layout.cu_seqlens, layout.longest, 0.3)
    found = [output, *torch.autograd.grad(output, (query, key, value), grad)]
    expected_output = reference_varlen(query, key, value, layout.cu_seqlens, layout.longest, 0.3)
    expected = [expected_output, *torch.autograd.grad(expected_output, (query, key, value), grad)]
    assert output.shape == query.shape and output.dtype == dtype
    for name, got, want in zip(("output", "query", "key", "value"), found, expected):
        assert (got.float() - want.float()).abs().max() <= tolerance * want.float().abs().max(), name


@pytest.mark.parametrize("implementation", [*attention.VARLEN_IMPLEMENTATIONS, attention.MASKED])
def test_a_batch_without_a_boundary_is_plain_causal_attention(monkeypatch, implementation):
    """Every row one document: no varlen kernel, no mask, positions 0..C-1 - the stock model's loss."""
    monkeypatch.setitem(attention.VARLEN_KERNELS, implementation, None)  # calling it would fail
    whole_rows = attention.documents_of(np.zeros((BATCH, CONTEXT), dtype=np.int32))
    model = tiny(implementation)
    assert attention.decoder_inputs(model, whole_rows) == {}
    loss, _ = loss_and_gradients(model, whole_rows)
    stock, _ = loss_and_gradients(tiny(attention.MASKED), None)
    assert loss == pytest.approx(stock, rel=1e-6)


def test_varlen_models_get_no_mask_from_transformers(monkeypatch):
    """No mask function is registered for the varlen implementations: transformers builds no mask (and
    does not look for packed sequences in the position ids) - the kernels take cu_seqlens instead."""
    seen = []
    model = tiny(attention.FLASH)

    def kernel(*args):
        return reference_varlen(*args)

    original = attention.varlen_attention

    def spy(module, query, key, value, attention_mask, *args, **kwargs):
        seen.append(attention_mask)
        return original(module, query, key, value, attention_mask, *args, **kwargs)

    monkeypatch.setitem(attention.VARLEN_KERNELS, attention.FLASH, kernel)
    monkeypatch.setitem(attention.ATTENTION_FUNCTIONS, attention.FLASH, spy)
    attention.use_attention(model, attention.FLASH)
    loss_and_gradients(model, attention.documents_of(SEGMENTS))
    assert seen == [None] * model_config.PRESETS["tiny"].layers


def test_probe_documents_split_every_row():
    documents = attention.probe_documents(2, 10)
    assert documents.cu_seqlens.tolist() == [0, 5, 10, 15, 20] and documents.has_boundary


# ----------------------------------------------------------------------------------------------
# The CUDA calls, traced on fake "cuda" tensors (no GPU): the ops each path dispatches and their arguments.


class OpLog(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append((str(func.overloadpacket), args, kwargs or {}))
        return func(*args, **(kwargs or {}))


def traced(implementation, dtype, documents: bool, monkeypatch):
    """The calls varlen_attention makes on fake "cuda" tensors. SDPA is recorded at its Python entry (a CPU
    build of torch would decompose it into math ops under fake CUDA, which is not what a card dispatches)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    batch, heads, kv_heads, context, dim = 2, 8, 4, 1024, 128
    module = types.SimpleNamespace(config=types.SimpleNamespace(_attn_implementation=implementation))
    layout = attention.documents_of(np.repeat([[0] * 300 + [1] * 500 + [2] * 224], batch, axis=0))
    sdpa_calls = []

    def sdpa(*args, **kwargs):
        sdpa_calls.append(("F.scaled_dot_product_attention", args, kwargs))
        return torch.empty_like(args[0])

    monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa)
    with FakeTensorMode():
        query = torch.empty(batch, heads, context, dim, device="cuda", dtype=dtype)
        key = torch.empty(batch, kv_heads, context, dim, device="cuda", dtype=dtype)
        value = torch.empty(batch, kv_heads, context, dim, device="cuda", dtype=dtype)
        kwargs = {}
        if documents:
            starts = torch.tensor(layout.cu_seqlens.tolist(), dtype=torch.int32, device="cuda")
            kwargs = {"document_starts": starts, "longest_document": layout.longest}
        with OpLog() as log:
            output, _ = attention.varlen_attention(module, query, key, value, None, scaling=dim**-0.5, **kwargs)
        assert output.shape == (batch, context, heads, dim) and output.dtype == dtype and output.device.type == "cuda"
    return log.calls + sdpa_calls


def kernel_calls(calls, names):
    return [(name, args, kwargs) for name, args, kwargs in calls if name in names]


ATTENTION_OPS = {
    "tinyllm.flash_varlen",
    "tinyllm.efficient_varlen",
    "torch_attn._varlen_attn",
    "aten._efficient_attention_forward",
    "aten._flash_attention_forward",
    "F.scaled_dot_product_attention",
    "aten._scaled_dot_product_flash_attention",
    "aten._scaled_dot_product_efficient_attention",
    "aten._scaled_dot_product_cudnn_attention",
    "aten.bmm",
}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_flash_varlen_calls_the_flash_op_with_grouped_heads(dtype, monkeypatch):
    [(name, args, kwargs)] = kernel_calls(traced(attention.FLASH, dtype, True, monkeypatch), ATTENTION_OPS)
    query, key, value, cu_seqlens, longest, scale = args
    assert name == "tinyllm.flash_varlen"
    assert query.shape == (2048, 8, 128) and key.shape == value.shape == (2048, 4, 128)  # grouped heads kept
    assert query.dtype == key.dtype == dtype and cu_seqlens.dtype == torch.int32
    assert longest == 500 and scale == pytest.approx(128**-0.5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_efficient_varlen_calls_the_efficient_op_with_repeated_heads(dtype, monkeypatch):
    [(name, args, kwargs)] = kernel_calls(traced(attention.EFFICIENT, dtype, True, monkeypatch), ATTENTION_OPS)
    query, key, value, cu_seqlens, longest, scale = args
    assert name == "tinyllm.efficient_varlen"
    assert query.shape == key.shape == value.shape == (1, 2048, 8, 128)  # K/V repeated: no GQA in this kernel
    assert cu_seqlens.dtype == torch.int32 and longest == 500 and scale == pytest.approx(128**-0.5)


# The CUDA glue of the custom ops (varlen_ops), called on fake "cuda" tensors: the aten kernels and their
# arguments. torch's meta of _efficient_attention_backward is broken (the repro), so that one call
# is recorded and answered with empty gradients, as a card's kernel would shape them.


class GlueLog(OpLog):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func.overloadpacket) == "aten._efficient_attention_backward":
            self.calls.append((str(func.overloadpacket), args, kwargs or {}))
            return torch.empty_like(args[1]), torch.empty_like(args[2]), torch.empty_like(args[3]), None
        return super().__torch_dispatch__(func, types, args, kwargs)


def glue_inputs(repeated: bool, dtype=torch.float16):
    heads, kv_heads = 8, 8 if repeated else 4
    starts = [0, 300, 800, 1024, 1324, 1824, 2048]  # two rows of documents of 300, 500 and 224 tokens
    shape = (1, 2048) if repeated else (2048,)
    query = torch.empty(*shape, heads, 128, device="cuda", dtype=dtype)
    key = torch.empty(*shape, kv_heads, 128, device="cuda", dtype=dtype)
    cu_seqlens = torch.tensor(starts, dtype=torch.int32, device="cuda")
    return query, key, torch.empty_like(key), cu_seqlens, 500


def test_the_flash_op_calls_torchs_flash_varlen_kernel_on_cuda():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tinyllm.model import varlen_ops

    with FakeTensorMode():
        query, key, value, cu_seqlens, longest = glue_inputs(repeated=False)
        fake = torch.ops.tinyllm.flash_varlen(query, key, value, cu_seqlens, longest, 0.125)
        with GlueLog() as log:
            output, lse = varlen_ops._flash_cuda(query, key, value, cu_seqlens, longest, 0.125)
            grads = varlen_ops._flash_backward_cuda(output, query, key, value, output, lse, cu_seqlens, longest, 0.125)
        for real, declared in zip((output, lse), fake):  # register_fake says what the kernel returns
            assert (real.shape, real.dtype, real.stride()) == (declared.shape, declared.dtype, declared.stride())
    [(forward, args, kwargs), (backward, back_args, back_kwargs)] = kernel_calls(
        log.calls, {"aten._flash_attention_forward", "aten._flash_attention_backward"}
    )
    assert forward == "aten._flash_attention_forward" and args[0] is query and args[1] is key  # grouped heads
    assert args[3] is args[4] is cu_seqlens and args[5:10] == (500, 500, 0.0, True, False)
    assert kwargs == {"scale": 0.125}
    assert backward == "aten._flash_attention_backward" and back_args[6] is back_args[7] is cu_seqlens
    assert back_args[8:12] == (500, 500, 0.0, True) and back_kwargs == {"scale": 0.125}
    assert [grad.shape for grad in grads] == [query.shape, key.shape, value.shape]


def test_the_efficient_op_calls_torchs_memory_efficient_kernel_on_cuda():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tinyllm.model import varlen_ops

    with FakeTensorMode():
        query, key, value, cu_seqlens, longest = glue_inputs(repeated=True)
        fake = torch.ops.tinyllm.efficient_varlen(query, key, value, cu_seqlens, longest, 0.125)
        with GlueLog() as log:
            output, lse = varlen_ops._efficient_cuda(query, key, value, cu_seqlens, longest, 0.125)
            grads = varlen_ops._efficient_backward_cuda(
                output, query, key, value, output, lse, cu_seqlens, longest, 0.125
            )
        for real, declared in zip((output, lse), fake):
            assert (real.shape, real.dtype, real.stride()) == (declared.shape, declared.dtype, declared.stride())
        assert lse.shape == (6, 8, 512)  # documents, heads, the longest (500) padded to a multiple of 32
    [(forward, args, kwargs), (backward, back_args, back_kwargs)] = kernel_calls(
        log.calls, {"aten._efficient_attention_forward", "aten._efficient_attention_backward"}
    )
    assert forward == "aten._efficient_attention_forward" and args[0] is query and args[3] is None
    assert args[4] is args[5] is cu_seqlens and args[6:11] == (500, 500, 0.0, 1, True)  # 1: causal, top left
    assert kwargs == {"scale": 0.125}
    assert backward == "aten._efficient_attention_backward" and back_args[5] is output and back_args[10] is lse
    assert back_args[6] is back_args[7] is cu_seqlens and back_args[8:10] == (500, 500)
    assert back_args[11] == 0.0 and back_args[14:16] == (1, False) and back_kwargs == {"scale": 0.125}
    assert [grad.shape for grad in grads] == [query.shape, key.shape, value.shape]


@pytest.mark.parametrize("implementation", attention.VARLEN_IMPLEMENTATIONS)
def test_the_varlen_ops_run_forward_and_backward_on_fake_cuda_tensors(implementation):
    """The issue's repro, on the custom ops: fake fp16 (1, 64, 2, 16) q/k/v with requires_grad and
    cu_seqlens [0, 20, 64], forward and backward. The backward is the custom backward op, never aten's
    _efficient_attention_backward (whose meta raises "got multiple values for argument 'scale'"). Fake CPU
    tensors: the ops' fake kernels serve every device, and a CPU build's autograd engine aborts on a backward
    over "cuda" ones, fake or not."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        query, key, value = (torch.empty(64, 2, 16, dtype=torch.float16, requires_grad=True) for _ in range(3))
        cu_seqlens = torch.tensor([0, 20, 64], dtype=torch.int32)
        with OpLog() as log:
            output = attention.VARLEN_KERNELS[implementation](query, key, value, cu_seqlens, 44, 0.25)
            output.sum().backward()
        assert query.grad.shape == key.grad.shape == value.grad.shape == (64, 2, 16)
    names = {name for name, _, _ in log.calls}
    prefix = "tinyllm.flash_varlen" if implementation == attention.FLASH else "tinyllm.efficient_varlen"
    assert {prefix, prefix + "_backward"} <= names
    assert not {
        name
        for name in names
        if name.startswith("aten._efficient_attention") or name.startswith("aten._flash_attention")
    }


@pytest.mark.parametrize("implementation, repeated", [(attention.FLASH, False), (attention.EFFICIENT, True)])
def test_a_batch_without_documents_calls_sdpa_is_causal_without_a_mask(implementation, repeated, monkeypatch):
    [(name, args, kwargs)] = kernel_calls(traced(implementation, torch.float16, False, monkeypatch), ATTENTION_OPS)
    assert name == "F.scaled_dot_product_attention"
    query, key = args[:2]
    assert key.shape[1] == (8 if repeated else 4) and query.shape[1] == 8
    assert kwargs.get("is_causal") is True and kwargs.get("attn_mask") is None
    assert kwargs.get("enable_gqa", False) is not repeated


def test_ddp_moves_a_batchs_documents_whole():
    """DDP moves a forward's inputs with _recursive_to (device_ids set, as on CUDA): a Documents comes out a
    Documents, its host int kept."""
    from torch.distributed.utils import _recursive_to

    documents = attention.documents_of(SEGMENTS)
    [(inputs, reduction, moved)] = _recursive_to((torch.zeros(2), "mean", documents), torch.device("cpu"), False)
    assert isinstance(moved, attention.Documents) and moved.longest == documents.longest == 32
    assert torch.equal(moved.cu_seqlens, documents.cu_seqlens) and reduction == "mean"


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("No available kernel. Aborting execution.\nmore detail"),
        TypeError("varlen_attn() got an unexpected keyword argument 'scale'"),
        ImportError("No module named 'torch.nn.attention.varlen'"),
    ],
    ids=["RuntimeError", "TypeError", "ImportError"],
)
def test_a_plan_whose_kernel_refuses_the_model_falls_back_to_the_named_masked_kernels(error):
    """Whatever a refusing kernel raises, the run falls back to the masked path with SDPA restricted to
    memory-efficient, then math: never cuDNN with a mask (pytorch #196678), and the label says so."""
    plan = attention.choose_attention(H200, "bf16", 128)
    model = tiny(attention.MASKED)

    def refusing(kernels):
        raise error

    kernels, label, warning, in_effect = attention.apply_attention_plan(model, plan, refusing)
    assert model.config._attn_implementation == attention.MASKED and in_effect == attention.MASKED_FALLBACK
    assert label.startswith("masked efficient or math fallback (planned: documents: flash varlen")
    first = str(error).splitlines()[0]
    assert f"flash varlen / flash attention does not take this model ({type(error).__name__}: {first})" in warning
    assert "memory-efficient, then math; never cuDNN" in warning and "\n" not in warning
    with kernels():
        assert torch.backends.cuda.mem_efficient_sdp_enabled() and torch.backends.cuda.math_sdp_enabled()
        assert not torch.backends.cuda.cudnn_sdp_enabled() and not torch.backends.cuda.flash_sdp_enabled()
    probed = []
    kernels, label, warning, in_effect = attention.apply_attention_plan(model, plan, probed.append)
    assert model.config._attn_implementation == attention.FLASH and warning is None and label == plan.label()
    assert in_effect == plan
    assert len(probed) == 1 and probed[0] is kernels  # the probe ran inside the plan's sdpa_kernel restriction
    cpu = attention.choose_attention(CPU, "fp32", 128)
    assert attention.apply_attention_plan(model, cpu, refusing)[2] is None  # the CPU plan needs no probe


def test_a_refused_flash_varlen_gives_way_to_the_memory_efficient_varlen_not_the_square():
    flash, efficient = attention.attention_plans(A100, "bf16", 128)
    assert (flash.documents, efficient.documents) == ("flash varlen", "efficient varlen")
    model = tiny(attention.MASKED)
    probed = []

    def flash_refuses(kernels):
        probed.append(model.config._attn_implementation)
        if model.config._attn_implementation == attention.FLASH:
            raise RuntimeError("FlashAttention only supports Ampere GPUs or newer.")

    kernels, label, warning, in_effect = attention.apply_attention_plan(model, flash, flash_refuses, [efficient])
    assert probed == [attention.FLASH, attention.EFFICIENT] and in_effect == efficient
    assert model.config._attn_implementation == attention.EFFICIENT and label == efficient.label()
    assert warning == (
        "the planned flash varlen / flash attention does not take this model (RuntimeError: "
        "FlashAttention only supports Ampere GPUs or newer.); attention uses efficient varlen"
    )

    def both_refuse(kernels):
        raise RuntimeError(f"{model.config._attn_implementation} refuses")

    kernels, label, warning, in_effect = attention.apply_attention_plan(model, flash, both_refuse, [efficient])
    assert in_effect == attention.MASKED_FALLBACK and model.config._attn_implementation == attention.MASKED
    assert warning.startswith(
        "the planned flash varlen / flash attention does not take this model (RuntimeError: "
        f"{attention.FLASH} refuses); the planned efficient varlen / efficient attention"
    )
    assert warning.endswith(
        "attention uses the slower masked kernels (SDPA restricted to memory-efficient, then "
        "math; never cuDNN with a mask)"
    )
    assert [plan.documents for plan in attention.attention_plans(T4, "fp16", 128)] == ["efficient varlen"]
    assert [plan.documents for plan in attention.attention_plans(T4, "bf16", 128)] == ["masked math"]


def test_running_out_of_memory_in_the_probe_is_no_refusal():
    plan = attention.choose_attention(T4, "fp16", 128)

    def out_of_memory(kernels):
        raise torch.OutOfMemoryError("CUDA out of memory")

    with pytest.raises(torch.OutOfMemoryError):
        attention.apply_attention_plan(tiny(attention.MASKED), plan, out_of_memory)


# ----------------------------------------------------------------------------------------------
# The record of each kernel.


def test_every_plan_names_kernels_of_the_table():
    """Every label a plan, the fallback or bench/ uses is a kernel record; what it takes and computes."""
    labels = {
        attention.MASKED_FALLBACK.documents,
        attention.MASKED_FALLBACK.causal,
        "masked sdpa",
        "masked flash",
        "masked efficient",
        "causal flash",
        "causal efficient",
    }
    for device in (CPU, *CARDS):
        for precision in ("fp16", "bf16", "fp32"):
            for head_dim in (64, 100, 128, 512):
                plan = attention.choose_attention(device, precision, head_dim)
                labels |= {plan.documents, plan.causal}
                record = attention.kernel(plan.documents)
                assert record.implementation == plan.implementation and record.exact
                assert attention.kernel(plan.causal).implementation == plan.implementation
    for label in labels:
        record = attention.kernel(label)
        assert record.exact == (record.boundaries or record.masked)
        assert record.boundaries == (record.computes == "documents") == (record.function is not None)
        assert record.masked == (record.computes == "square" and record.takes == "mask")
    with pytest.raises(KeyError):
        attention.kernel("flash-ish")


def test_the_varlen_records_hold_their_logsumexp_and_the_masked_ones_the_square():
    preset = model_config.PRESETS["think72"]
    held = {
        name: attention.kernel(name).held_bytes(preset.heads, preset.kv_heads, preset.head_dim, 8, 1024, 2, 14)
        for name in ("flash varlen", "efficient varlen", "masked cpu flash", "masked math", "flash")
    }
    tokens = 8 * 1024
    assert held["flash varlen"] == 14 * tokens * 4 * 8
    assert held["efficient varlen"] == 14 * tokens * (4 * 8 + 2 * 4 * 128 * 2)  # + K/V repeated to 8 heads
    assert held["masked cpu flash"] == 8 * 1024**2 * (1 + 14 * 2)
    assert held["masked math"] > 8 * held["masked cpu flash"] and held["flash"] == 0


# ----------------------------------------------------------------------------------------------
# Compiled: the varlen custom ops are opaque nodes of the graphs, forward and backward.

COMPILED_SEGMENTS = np.array([[0] * 20 + [1] * 30 + [2] * 14, [0] * 9 + [1] * 55])


def compiled_against_eager(implementation: str, backend):
    """(eager loss and gradients, compiled ones) of a think72-shaped model of 2 layers (its width, heads and
    head size; a small vocabulary) on `implementation`, in fp32 on CPU, compiled whole (fullgraph: a graph
    break is an error)."""
    import dataclasses

    torch.manual_seed(0)
    model = model_config.build_model(dataclasses.replace(model_config.PRESETS["think72"], layers=2), VOCAB)
    model.config.use_cache = False  # as Training builds it
    attention.use_attention(model, implementation)
    documents = attention.documents_of(COMPILED_SEGMENTS)
    generator = torch.Generator().manual_seed(1)
    inputs, targets = (torch.randint(0, VOCAB, COMPILED_SEGMENTS.shape, generator=generator) for _ in range(2))
    module = losses.LanguageModelLoss(model)

    def run(forward):
        model.zero_grad(set_to_none=True)
        loss = forward(inputs, targets, "sum", documents)
        loss.backward()
        return loss.item(), {name: parameter.grad.clone() for name, parameter in model.named_parameters()}

    torch._dynamo.reset()
    return run(module), run(torch.compile(module, backend=backend, fullgraph=True))


def graph_recorder(graphs: list):
    """aot_eager that keeps the forward and backward graphs AOTAutograd traced."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def keep(graph_module, example_inputs):
        graphs.append(graph_module)
        return make_boxed_func(graph_module.forward)

    return aot_autograd(fw_compiler=keep, bw_compiler=keep)


def assert_equal_to_eager(eager, compiled):
    (eager_loss, eager_grads), (loss, grads) = eager, compiled
    assert loss == pytest.approx(eager_loss, rel=1e-6)
    for name, gradient in grads.items():
        expected = eager_grads[name]
        assert torch.allclose(gradient, expected, rtol=1e-4, atol=1e-4 * expected.abs().max()), name


@pytest.mark.parametrize("implementation", attention.VARLEN_IMPLEMENTATIONS)
def test_the_varlen_plans_trace_whole_with_the_kernels_as_opaque_ops(implementation):
    """The T4 plan (EFFICIENT) and the sm_80+ one (FLASH): one graph (no break), the custom op forward and its
    backward op in the backward graph, and none of torch's attention ops whose meta kernels AOTAutograd would
    otherwise call (_efficient_attention_backward's is broken in torch 2.9 to 2.13)."""
    graphs = []
    eager, compiled = compiled_against_eager(implementation, graph_recorder(graphs))
    assert_equal_to_eager(eager, compiled)
    forward, backward = graphs  # one forward graph, one backward graph: no graph break
    name = "flash_varlen" if implementation == attention.FLASH else "efficient_varlen"
    targets = [[str(node.target) for node in graph.graph.nodes if node.op == "call_function"] for graph in graphs]
    assert targets[0].count(f"tinyllm.{name}.default") == 2  # one per layer
    assert targets[1].count(f"tinyllm.{name}_backward.default") == 2
    assert not [target for graph in targets for target in graph if "_attention" in target]


@pytest.mark.parametrize("implementation", attention.VARLEN_IMPLEMENTATIONS)
def test_the_varlen_plans_compile_with_inductor_like_eager(implementation):
    eager, compiled = compiled_against_eager(implementation, "inductor")
    assert_equal_to_eager(eager, compiled)
