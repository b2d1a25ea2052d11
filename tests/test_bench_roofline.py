"""bench/bench_roofline.py --smoke: the counts of a small model's step are sane (tests/ runs it in seconds)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import bench_roofline  # noqa: E402

from tinyllm.model import config as model_config  # noqa: E402
from tinyllm.model import hardware  # noqa: E402


@pytest.fixture(scope="module")
def smoke():
    return bench_roofline.run(bench_roofline.parse_args(["--smoke"]))


def side(result, label, precision):
    return next(s for s in result["sides"] if s.label == label and s.precision == precision)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_the_matmuls_are_6n(smoke, precision):
    """Matmul FLOPs per token within 5% of model_config.flops_per_token's 6N part, before and after."""
    preset = model_config.PRESETS[smoke["preset"]]
    six_n = 6 * model_config.matmul_parameters(preset, bench_roofline.VOCAB)
    for label in ("before", "after"):
        assert side(smoke, label, precision).per_token("matmul", "flops") == pytest.approx(six_n, rel=0.05)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_after_computes_and_moves_less(smoke, precision):
    before, after = side(smoke, "before", precision), side(smoke, "after", precision)
    per_document = bench_roofline.per_document_flops(after)
    if precision == "fp16":  # the T4's memory-efficient varlen at its tiles: more than the useful triangles
        assert per_document < after.per_token("attention", "flops") < 2 * per_document
    else:  # flash varlen: its triangles (its tiles are not modelled)
        assert after.per_token("attention", "flops") == pytest.approx(per_document)
    assert before.per_token("attention", "flops") > 2 * per_document  # the masked square (context 256: 2.3x)
    assert after.per_token("elementwise") < before.per_token("elementwise") / 1.5
    assert bench_roofline.outside_matmuls(after) < bench_roofline.outside_matmuls(before)
    assert after.per_token("loss") > 0 and after.per_token("embedding") > 0
    fused, kernels = smoke["fused"][id(after)]
    assert sum(v for k, v in fused.items() if k != "matmul") < after.tokens * bench_roofline.outside_matmuls(after)
    assert kernels < len(after.ops)


def test_the_counts_give_a_step_time(smoke):
    counts = smoke["counts"][("fp16", "eager")]
    assert counts.newton_schulz_flops > 0 and counts.optimizer_bytes > 0 and counts.launches > 0
    step = hardware.predict_card(
        hardware.card_of(hardware.Device("cuda", "Tesla T4", (7, 5))),
        counts,
        world=2,
        tokens_per_step=8 * counts.micro_batch_tokens,
    )
    assert step.total_s > step.matmul_s > 0 and step.all_reduce_s > 0


def test_packed_rows_cut_documents_at_row_ends():
    segments, lengths = bench_roofline.packed_rows(4, 512, seed=1)
    assert [sum(row) for row in lengths] == [512] * 4
    for row, row_lengths in zip(segments, lengths):
        assert row[0] == 0 and list(row[1:] >= row[:-1]).count(False) == 0
        assert len(set(row.tolist())) == len(row_lengths)


def test_smoke_main_ends_with_the_line(capsys):
    assert bench_roofline.main(["--smoke", "--precisions", "fp16"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("nano on 2x T4: ")


def test_the_fake_count_is_flop_counter_s_on_real_tensors():
    """The fake-tensor count misses no matmul: FlopCounterMode over a real forward + backward of the same
    model and batch (the tiny preset, bf16 autocast, the masked path; the CPU attention kernel is not in its
    registry) gives the matmul FLOPs bench_roofline counts."""
    import numpy as np
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from tinyllm.model import attention, losses

    preset = model_config.PRESETS["tiny"]
    counted = bench_roofline.count_side("before", preset, "bf16", 2)
    segments, _ = bench_roofline.packed_rows(2, preset.context)
    torch.manual_seed(0)
    model = model_config.build_model(preset, bench_roofline.VOCAB)
    model.config.use_cache = False
    attention.use_attention(model, attention.MASKED)
    tokens = torch.randint(0, bench_roofline.VOCAB, (2, preset.context))
    with FlopCounterMode(display=False) as flops, torch.autocast("cpu", dtype=torch.bfloat16):
        losses.language_model_loss(
            model, tokens, tokens, documents=attention.documents_of(np.asarray(segments))
        ).backward()
    assert counted.per_token("matmul", "flops") * counted.tokens == pytest.approx(flops.get_total_flops(), rel=1e-6)


@pytest.mark.parametrize(
    "numels, depth, launches",
    [
        ([], 1, 0),
        ([10], 1, 1),
        ([65_536 * 320], 1, 1),  # exactly 320 blocks: one launch, nothing left over
        ([65_536 * 320 + 1], 1, 2),  # one more chunk: a second launch
        ([1] * 110, 1, 1),  # depth 1 holds 110 tensors
        ([1] * 111, 1, 2),
        ([1] * 36, 4, 1),  # depth 4 (fused AdamW) holds 36
        ([1] * 37, 4, 2),
        ([0, 0, 5], 1, 1),  # empty tensors are skipped
    ],
)
def test_multi_tensor_launches(numels, depth, launches):
    assert bench_roofline.multi_tensor_launches(numels, depth) == launches


def test_ops_that_are_several_kernels_on_cuda():
    """slice_backward (zeros, then a copy), the RMSNorm backward (dX, then dgamma rereading dY, X and rstd)
    and the embedding backward (sorted past 3,072 indices) launch more than one kernel and move more than
    their inputs and outputs once; an ordinary op launches one and moves nothing more."""
    import torch

    grad = torch.empty(4, 8, 16)
    assert bench_roofline.below_dispatch("slice_backward", (grad, [4, 8, 32], 2, 0, 16, 1), None) == (
        grad.numel() * 4,
        2,
    )
    rstd = torch.empty(4, 8, 1)
    extra, kernels = bench_roofline.below_dispatch("_fused_rms_norm_backward", (grad, grad, [16], rstd, None), None)
    assert (extra, kernels) == (2 * grad.numel() * 4 + rstd.numel() * 4, 2)
    small = bench_roofline.below_dispatch(
        "embedding_dense_backward", (grad, torch.empty(4, 8, dtype=torch.long), 100, -1, False), None
    )
    large = bench_roofline.below_dispatch(
        "embedding_dense_backward",
        (torch.empty(8, 1024, 16), torch.empty(8, 1024, dtype=torch.long), 100, -1, False),
        None,
    )
    assert small[1] == 2 and large[1] > small[1] and large[0] > small[0] > 0
    assert bench_roofline.below_dispatch("mul", (grad, grad), grad) == (0.0, 1)
    assert bench_roofline.below_dispatch("_foreach_norm", ([grad] * 3, 2), None) == (0.0, 2)


@pytest.mark.parametrize(
    "length, forward, backward",
    [
        (1, 1, 1),
        (100, 4, 3),  # query blocks of 32 each see one 128-key tile; key blocks of 64: 2 + 1 query tiles
        (128, 4, 3),
        (129, 4 + 2, 3 + 3),  # a fifth query block (one query) computes two key tiles; a third key block
        (1024, 144, 136),  # forward: sum of ceil(i / 4) for i in 1..32; backward: 16 + 15 + ... + 1
    ],
)
def test_the_sm75_kernel_computes_whole_tiles(length, forward, backward):
    """The memory-efficient kernel at think72's head size: 32 x 128 forward, 64 x 64 backward tiles, causal."""
    assert bench_roofline.efficient_tiles(128) == ((32, 128), (64, 64))
    assert bench_roofline.efficient_tiles(64) == ((64, 64), (64, 64))
    assert bench_roofline.tiled_pairs(length, (32, 128), backward=False) == forward * 32 * 128
    assert bench_roofline.tiled_pairs(length, (64, 64), backward=True) == backward * 64 * 64
    flops = bench_roofline.executed_attention_flops("efficient varlen", [length], length, 8, 128)
    assert flops == 8 * 128 * (4 * forward * 4096 + 10 * backward * 4096)
    useful = bench_roofline.attention.attention_flops("efficient varlen", [length], length, 8, 128)
    assert flops > useful


def test_the_population_is_the_packer_s_rows():
    """Thousands of rows of train_data.MaskedPacking over lognormal documents: each row's lengths sum to the
    context, and a document crossing a row's end continues at the next row's start."""
    rows = bench_roofline.population(256, rows=2000)
    assert len(rows) == 2000 and all(sum(row) == 256 for row in rows)
    assert sum(len(row) for row in rows) > 2000  # rows hold several documents


def test_gathers_and_scatters_count_what_they_touch():
    """The loss's gather reads one logit per row, its scatter reads and writes one per row; the embedding
    lookup reads the rows it returns, not the table (and a scatter's tensor is told apart by its storage:
    the key of an input is taken before the op bumps its version)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.module_tracker import ModuleTracker

    counter = bench_roofline.Counter(ModuleTracker(), None, lambda name, args: None)
    with FakeTensorMode(), counter:
        logits = torch.empty(64, 1000)
        rows = torch.zeros(64, 1, dtype=torch.long)
        logits.gather(1, rows)
        logits.scatter_add_(1, rows, torch.ones(64, 1))
        table = torch.empty(1000, 32)
        torch.nn.functional.embedding(torch.zeros(8, dtype=torch.long), table)
    gather, scatter, embedding = (
        next(op for op in counter.ops if op.name == name) for name in ("gather", "scatter_add_", "embedding")
    )
    assert gather.read == 64 * 4 + 64 * 8 and gather.written == 64 * 4  # picked logits + index; output
    assert scatter.read == 64 * 8 + 64 * 4 + 64 * 4 and scatter.written == 64 * 4  # index, source, touched
    assert embedding.read == 8 * 32 * 4 + 8 * 8 and embedding.written == 8 * 32 * 4


def test_inductor_counts_its_kernels_and_fuses_the_loss_into_one_a_chunk():
    """bench_roofline.inductor_bytes (the compiled count's source) on nano at 2 x 256, one layer: Inductor compiles
    the training loss whole (two graphs, no break), and the loss's softmax, one-hot and cast for the matmuls are
    one kernel a chunk that reads the half logits and writes the half gradient: about 4 bytes a logit."""
    import torch

    from tinyllm.model import hardware

    result = bench_roofline.inductor_bytes("nano", layers=1, batch=2)
    assert len(result["graphs"]) == 2 and sum(torch._dynamo.utils.counters["graph_break"].values()) == 0
    forward = result["graphs"][0]
    loss_kernels = [size for size, _, vocabulary, names in forward["nodes"] if vocabulary and "amax" in " ".join(names)]
    chunks = -(-result["tokens"] // hardware.logits_chunk_tokens(bench_roofline.VOCAB, "cuda"))
    assert len(loss_kernels) == chunks
    logits = result["tokens"] * bench_roofline.VOCAB
    assert 4 * logits <= sum(loss_kernels) < 4.2 * logits
    assert forward["fused"] > 0 and forward["externs"] > 0 and forward["kernels"] > 0
