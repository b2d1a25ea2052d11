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

import attention
import hardware
import losses
import model_config

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
    first = [[1, 0, 0, 0, 0, 0],
             [1, 1, 0, 0, 0, 0],
             [1, 1, 1, 0, 0, 0],
             [0, 0, 0, 1, 0, 0],
             [0, 0, 0, 1, 1, 0],
             [0, 0, 0, 0, 0, 1]]
    second = [[1, 0, 0, 0, 0, 0],
              [0, 1, 0, 0, 0, 0],
              [0, 1, 1, 0, 0, 0],
              [0, 1, 1, 1, 0, 0],
              [0, 1, 1, 1, 1, 0],
              [0, 1, 1, 1, 1, 1]]
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
    assert (plan.documents, plan.causal, plan.implementation, plan.backends) == (documents, causal, implementation,
                                                                                 backends)
    assert plan.fused == (implementation != attention.MASKED)
    assert precision in plan.reason or not device.is_cuda


@pytest.mark.parametrize("device", CARDS, ids=[card.name for card in CARDS])
def test_auto_precision_gets_a_per_document_kernel_on_every_card(device):
    """think72 under --precision auto: attention computes each document's triangle, on every card."""
    plan = attention.choose_attention(device, hardware.choose_precision("auto", device).value, 128)
    assert plan.documents.endswith("varlen") and plan.fused


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


@pytest.mark.parametrize("kernel, ratio", [("flash varlen", 1.0), ("efficient varlen", 1.0),
                                           ("masked cpu flash", None), ("masked math", None), ("flash", None)])
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
    documents = attention.documents_of(SEGMENTS)
    expected_loss, expected = loss_and_gradients(tiny(attention.MASKED), documents)
    calls = []

    def kernel(*args):
        calls.append(args[3].tolist())
        return reference_varlen(*args)

    monkeypatch.setitem(attention.VARLEN_KERNELS, implementation, kernel)
    loss, gradients = loss_and_gradients(tiny(implementation), documents)
    assert calls and all(cu == documents.cu_seqlens.tolist() for cu in calls)
    assert len(calls) == model_config.PRESETS["tiny"].layers  # one kernel call per layer
    assert loss == pytest.approx(expected_loss, rel=1e-6)
    for name, gradient in gradients.items():
        assert torch.allclose(gradient, expected[name], rtol=1e-4, atol=1e-6 * expected[name].abs().max()), name


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


ATTENTION_OPS = {"torch_attn._varlen_attn", "aten._efficient_attention_forward", "F.scaled_dot_product_attention",
                 "aten._scaled_dot_product_flash_attention", "aten._scaled_dot_product_efficient_attention",
                 "aten._scaled_dot_product_cudnn_attention", "aten.bmm"}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_flash_varlen_calls_the_varlen_kernel_causal_with_grouped_heads(dtype, monkeypatch):
    [(name, args, kwargs)] = kernel_calls(traced(attention.FLASH, dtype, True, monkeypatch), ATTENTION_OPS)
    query, key, value, cu_q, cu_k, max_q, max_k, is_causal = args[:8]
    assert name == "torch_attn._varlen_attn"
    assert query.shape == (2048, 8, 128) and key.shape == value.shape == (2048, 4, 128)  # grouped heads kept
    assert query.dtype == key.dtype == dtype and cu_q is cu_k and cu_q.dtype == torch.int32
    assert (max_q, max_k, is_causal) == (500, 500, True)
    enable_gqa = args[10] if len(args) > 10 else kwargs.get("enable_gqa")
    assert enable_gqa is True


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_efficient_varlen_calls_the_memory_efficient_kernel_per_document(dtype, monkeypatch):
    [(name, args, kwargs)] = kernel_calls(traced(attention.EFFICIENT, dtype, True, monkeypatch), ATTENTION_OPS)
    query, key, value, bias, cu_q, cu_k, max_q, max_k, dropout, mask_type = args[:10]
    assert name == "aten._efficient_attention_forward"
    assert query.shape == key.shape == value.shape == (1, 2048, 8, 128)  # K/V repeated: no GQA in this kernel
    assert bias is None and cu_q.dtype == torch.int32 and (max_q, max_k, dropout) == (500, 500, 0.0)
    assert mask_type == 1  # causal from the top left of each sequence
    assert kwargs.get("scale") == pytest.approx(128**-0.5)


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


def test_a_plan_whose_kernel_refuses_the_model_falls_back_to_the_masked_math_path():
    plan = attention.choose_attention(H200, "bf16", 128)
    model = tiny(attention.MASKED)

    def refusing(kernels):
        raise RuntimeError("No available kernel. Aborting execution.\nmore detail")

    kernels, label, warning = attention.apply_attention_plan(model, plan, refusing)
    assert model.config._attn_implementation == attention.MASKED and label.startswith("math fallback")
    assert "flash varlen / flash attention does not take this model (No available kernel. Aborting" in warning
    assert "\n" not in warning
    probed = []
    kernels, label, warning = attention.apply_attention_plan(model, plan, probed.append)
    assert model.config._attn_implementation == attention.FLASH and warning is None and label == plan.label()
    assert len(probed) == 1 and probed[0] is kernels  # the probe ran inside the plan's sdpa_kernel restriction
    cpu = attention.choose_attention(CPU, "fp32", 128)
    assert attention.apply_attention_plan(model, cpu, refusing)[2] is None  # the CPU plan needs no probe
