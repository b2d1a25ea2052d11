"""hardware.py's per-device rules, each card faked as data (no GPU needed)."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest
from cards import A10, A100, CPU, CPU_BF16, GIB, H100, H200, L4, P100, T4, V100

from tinyllm.common import UserError
from tinyllm.model import config as model_config
from tinyllm.model import hardware

ROOT = Path(__file__).resolve().parent.parent

# device, auto precision, Newton-Schulz dtype (attention's kernels: tests/test_attention.py)
TABLE = [
    (P100, "fp16", "fp16"),
    (V100, "fp16", "fp16"),
    (T4, "fp16", "fp16"),
    (A10, "bf16", "bf16"),
    (L4, "bf16", "bf16"),
    (A100, "bf16", "bf16"),
    (H100, "bf16", "bf16"),
    (H200, "bf16", "bf16"),
    (CPU, "fp32", "fp32"),
    (CPU_BF16, "bf16", "bf16"),
]


@pytest.mark.parametrize(
    "device, precision, newton_schulz", TABLE, ids=[row[0].name or row[0].label() for row in TABLE]
)
def test_every_card(device, precision, newton_schulz):
    choice = hardware.choose_precision("auto", device)
    assert choice.value == precision and choice.warning is None
    assert hardware.newton_schulz_dtype(device, precision) == newton_schulz
    # the emulation trap: every card "supports" bf16 in torch's default sense; only sm_80+ has it natively
    assert device.native_bf16 == (precision == "bf16" and device.is_cuda)


@pytest.mark.parametrize(
    "device, precision, newton_schulz",
    [(CPU_BF16, "fp32", "fp32"), (CPU, "bf16", "fp32"), (T4, "fp32", "fp16"), (A100, "fp32", "bf16")],
    ids=["bf16 CPU, --precision fp32", "CPU, bf16 emulated", "T4, fp32", "A100, fp32"],
)
def test_a_cpu_orthogonalizes_in_the_runs_precision_where_bf16_is_native_a_card_in_its_own(
    device, precision, newton_schulz
):
    # an fp32 run keeps fp32 (world size 1 and 2 equal to fp32 rounding); a card's half type is its own
    assert hardware.newton_schulz_dtype(device, precision) == newton_schulz


def test_explicit_bf16_below_sm80_is_kept_with_a_warning_and_takes_the_math_kernel():
    choice = hardware.choose_precision("bf16", T4)
    assert choice.value == "bf16" and "emulated" in choice.warning and "fp16" in choice.warning
    assert hardware.choose_precision("bf16", A100).warning is None
    assert "emulated" in hardware.choose_precision("bf16", CPU).warning
    assert hardware.choose_precision("bf16", CPU_BF16).warning is None


@pytest.mark.parametrize(
    "avx512_bf16, amx, capability, onednn, native",
    [
        (True, False, "AVX512", None, True),  # e.g. AMD Zen 4, Intel Cooper Lake
        (False, True, "AVX512", None, True),  # Intel Sapphire Rapids (AMX; it has avx512_bf16 too)
        (True, False, "AVX512", "AVX512_CORE_BF16", True),
        (True, False, "AVX512", "ALL", True),
        (True, False, "AVX2", None, False),  # ATEN_CPU_CAPABILITY=avx2: ATen's bf16 kernels emulate
        (True, False, "AVX512", "AVX2", False),  # ONEDNN_MAX_CPU_ISA=AVX2: the matmuls emulate
        (True, False, "AVX512", "AVX512_CORE", False),  # AVX-512 without its bf16 instructions
        (False, False, "AVX512", None, False),  # Skylake-SP, Ice Lake
        (False, False, "AVX2", None, False),
        (False, False, "DEFAULT", None, False),  # ARM and others: torch's bf16 paths are not asked for
    ],
)
def test_cpu_bf16_instructions(avx512_bf16, amx, capability, onednn, native):
    assert hardware.cpu_bf16_instructions(avx512_bf16, amx, capability, onednn) == native


def test_explicit_choices():
    assert hardware.choose_precision("fp32", T4) == hardware.Precision("fp32", "--precision fp32")
    assert hardware.choose_precision("fp16", A100).value == "fp16"
    assert "testing" in hardware.choose_precision("fp16", CPU).warning


@pytest.mark.parametrize(
    "old, new, says",
    [
        ("fp16", "fp16", None),
        ("fp16", "bf16", "loss scaler is dropped"),
        ("bf16", "fp16", "fresh loss scaler"),
        ("fp32", "bf16", "continues"),
    ],
)
def test_precision_change_on_another_card(old, new, says):
    text = hardware.precision_change(old, new, A100)
    assert text is None if says is None else says in text


@pytest.mark.parametrize(
    "device, precision, peak",
    [
        (T4, "fp16", 65),
        (T4, "bf16", 8.1),
        (T4, "fp32", 8.1),
        (A100, "bf16", 312),
        (A10, "bf16", 125),
        (H200, "bf16", 989),
        (CPU, "bf16", None),
        (hardware.Device("cuda", "Some Future GPU", (12, 0)), "bf16", None),
    ],
)
def test_peak_tflops(device, precision, peak):
    assert hardware.peak_tflops(device, precision) == peak


def test_card_names_match_the_longest_key():
    assert hardware.card_of(A10).key == "A10G"
    assert hardware.card_of(hardware.Device("cuda", "NVIDIA A10", (8, 6))).key == "A10"
    assert hardware.card_of(L4).key == "L4"
    assert hardware.card_of(hardware.Device("cuda", "NVIDIA L40S", (8, 9))).key == "L40S"
    assert hardware.card_of(CPU) is None


def test_card_capabilities_agree_with_the_rules():
    """Each table card's capability gives the precision its dtype columns say it has natively."""
    for card in hardware.CARDS:
        device = hardware.Device("cuda", card.key, card.capability)
        assert device.native_bf16 == (card.bf16_tflops > 0), card.key


@pytest.mark.parametrize(
    "compile, world, order",
    [
        (False, 1, ["loss"]),
        (True, 1, ["loss", "compile"]),
        (False, 2, ["loss", "ddp"]),
        (True, 2, ["loss", "ddp", "compile"]),
    ],
)
def test_wrap_order(compile, world, order):
    assert hardware.wrap_order(compile, world) == order


@pytest.mark.parametrize(
    "version, ok",
    [
        ("2.13.0+cpu", True),
        ("2.10.0", True),
        ("3.0.1", True),
        ("2.9.1+cu126", False),
        ("2.4.0", False),
        ("1.13.1", False),
        ("2.10.0a0+git1234", True),
    ],
)
def test_torch_version(version, ok):
    problem = hardware.torch_problem(version)
    assert (problem is None) == ok
    if not ok:
        assert "torch>=2.10" in problem and version in problem


WHY = "the oldest release its tests run on, Kaggle's"  # hardware.MIN_TORCH_REASON, in words
CPU_INDEX, CUDA_INDEX = (
    "--index-url https://download.pytorch.org/whl/cpu",
    "--index-url https://download.pytorch.org/whl/cu",
)


# the torch installed (None: none), the driver's CUDA (None: no NVIDIA driver) -> the one line, or None: install nothing
@pytest.mark.parametrize(
    "version, driver, problem",
    [
        ("2.13.0+cpu", None, None),
        ("2.10.0+cu126", (12, 4), None),  # a working torch is kept, whatever the driver
        ("2.10.0a0+git1234", (12, 8), None),
        (
            None,
            None,
            f"torch is not installed: tinyllm needs torch>=2.10 ({WHY}); for this machine (no NVIDIA driver: "
            f"the CPU build): pip install 'torch>=2.10' {CPU_INDEX} (in a notebook, then restart its session)",
        ),
        (
            "2.6.0+cu124",
            (12, 9),
            f"torch 2.6.0+cu124 is too old: tinyllm needs torch>=2.10 ({WHY}); for this machine "
            f"(the NVIDIA driver runs CUDA 12.9): pip install 'torch>=2.10' {CUDA_INDEX}128 "
            "(in a notebook, then restart "
            "its session)",
        ),
        ("2.8.0", (13, 1), f"pip install 'torch>=2.10' {CUDA_INDEX}130"),
        ("2.9.1", (12, 6), f"pip install 'torch>=2.10' {CUDA_INDEX}126"),
        (
            None,
            (12, 2),
            f"torch is not installed: tinyllm needs torch>=2.10 ({WHY}), and the NVIDIA driver runs CUDA 12.2, "
            "older than every build of it (CUDA 12.6 and up): update the driver, or use an image with torch>=2.10",
        ),
    ],
)
def test_the_torch_install_check(version, driver, problem):
    found = hardware.torch_install_problem(version, driver)
    assert found == problem if problem is None or problem.startswith("torch") else problem in found


@pytest.mark.parametrize(
    "text, cuda",
    [
        ("| NVIDIA-SMI 550.54.15   Driver Version: 550.54.15   CUDA Version: 12.4     |", (12, 4)),
        ("NVIDIA-SMI 580.65   Driver Version: 580.65   CUDA Version: 13.0", (13, 0)),
        ("", None),
        ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.", None),
    ],
)
def test_the_drivers_cuda_version_is_read_off_nvidia_smi(text, cuda):
    assert hardware.driver_cuda_version(text) == cuda


def test_check_torch_raises_a_user_error(monkeypatch):
    import torch

    monkeypatch.setattr(torch, "__version__", "2.5.1")
    with pytest.raises(UserError, match="torch 2.5.1 is too old"):
        hardware.check_torch()


@pytest.mark.parametrize(
    "choice, available, problem",
    [
        ("cuda", False, "--device cuda, but torch sees no CUDA device"),
        ("mps", False, "--device mps, but torch sees no MPS device"),
        ("cuda", True, None),
        ("mps", True, None),
        ("cpu", False, None),
        ("auto", False, None),  # train.py's: CUDA when torch sees it, else CPU
    ],
)
def test_a_device_torch_does_not_see_is_refused(choice, available, problem):
    assert hardware.device_problem(choice, available) == problem


def test_check_device_asks_torch(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError, match="^--device cuda, but torch sees no CUDA device$"):
        hardware.check_device("cuda")
    hardware.check_device("cpu")


# -- the throughput model ------------------------------------------------------------------------

# A counted step and a card's rates (hardware.CountedStep, hardware.CardRates) with round numbers: 1,000-token
# micro-batches of 1 GFLOP/token of matmuls, 0.1 of attention, 1 MB/token of other bytes, 100 kernels; an
# optimizer step of 1 GB and 10 kernels, 0.1 TFLOP of Newton-Schulz, 1M parameters (4 MB of gradients).
COUNTED = dict(
    micro_batch_tokens=1000,
    matmul_flops=1e9,
    matmul_bytes=1e5,
    attention_flops=1e8,
    attention_bytes=1e4,
    other_bytes=1e6,
    ddp_split_bytes=0,
    launches=100,
    optimizer_bytes=1e9,
    optimizer_launches=10,
    newton_schulz_flops=1e11,
    gradient_bytes=4e6,
    broadcast_bytes=0,
    bucket_bytes=(2e6, 1e6, 1e6),
    last_broadcast_bytes=0,
)
RATES = dict(
    matmul_tflops=100,
    attention_tflops=50,
    bandwidth_gbs=1000,
    launch_us=10,
    link_gbs=5,
    newton_schulz_tflops=50,
    source="test",
)

# changes to COUNTED, tokens per step, world -> matmul, attention, memory, launch, Newton-Schulz, optimizer,
# all-reduce seconds (worked by hand)
STEPS = [
    ({}, 1000, 1, (0.01, 0.002, 0.001, 0.0, 0.002, 0.001, 0.0)),
    # 4 micro-steps: each part of the micro-steps x4; 3 gradient accumulations of 12 bytes a parameter
    ({}, 4000, 1, (0.04, 0.008, 0.004, 0.0, 0.002, 0.001036, 0.0)),
    # two ranks: each runs half the tokens; the ring moves 2 x 1/2 x 4 MB of fp32 gradients at 5 GB/s in 3
    # buckets (2, 1, 1 MB): the first is reduced during the backward (2/3 of the micro-step's 13 ms), the second
    # is ready with the backward's last layer gradients (its end), the last after it: 0.2 + 0.2 ms wait. The
    # gradients zeroed in place: the one micro-step adds into them (12 MB), and DDP divides them by 2 (8 MB):
    # 20 us more of optimizer bytes
    ({}, 2000, 2, (0.01, 0.002, 0.001, 0.0, 0.002, 0.00102, 0.0004)),
    # Muon's exchange runs during Newton-Schulz (2 ms): the last matrix's 0.1 MB (20 us) shows; 20 MB (4 ms)
    # would show 2 ms more
    (
        {"broadcast_bytes": 1e6, "last_broadcast_bytes": 1e5},
        2000,
        2,
        (0.01, 0.002, 0.001, 0.0, 0.002, 0.00102, 0.00042),
    ),
    (
        {"broadcast_bytes": 2e7, "last_broadcast_bytes": 1e5},
        2000,
        2,
        (0.01, 0.002, 0.001, 0.0, 0.002, 0.00102, 0.00242),
    ),
    # 100 MB of gradients, 98 MB in the first bucket: ready at 98/99 of the backward, reduced in 19.6 ms, then
    # 0.2 + 0.2 ms: 20 ms after it was ready, the backward's last 1/99 hidden
    (
        {"gradient_bytes": 1e8, "bucket_bytes": (9.8e7, 1e6, 1e6)},
        2000,
        2,
        (
            0.01,
            0.002,
            0.001,
            0.0,
            0.002,
            0.001 + 0.0005,
            0.02 - 0.013 * 2 / 3 / 99,
        ),
    ),
    # matmuls bound by their bytes: 1,000 x 100 MB at 1 TB/s
    ({"matmul_bytes": 1e8}, 1000, 1, (0.1, 0.002, 0.001, 0.0, 0.002, 0.001, 0.0)),
    # the host launches 10,000 kernels at 10 us (0.1 s) while the device works 0.013 s: 0.087 s waiting on it
    ({"launches": 10_000}, 1000, 1, (0.01, 0.002, 0.001, 0.087, 0.002, 0.001, 0.0)),
    # the optimizer bound by its launches: 1,000 x 10 us against 1 ms of bytes
    ({"optimizer_launches": 1000}, 1000, 1, (0.01, 0.002, 0.001, 0.0, 0.002, 0.01, 0.0)),
]


@pytest.mark.parametrize(
    "buckets, backward, exposed",
    [
        ((), 1.0, 0.0),
        ((10,), 1.0, 10.0),  # one bucket: ready at the backward's end
        # ready at 50 and at 100 (the bytes made before each, of the 20 before the last): done at 60, then 100-110,
        # the last 110-115
        ((10, 10, 5), 100.0, 15.0),
        ((60, 40, 5), 100.0, 65.0),  # the first done at 120, the second 120-160, the last 160-165
        ((60, 40, 5), 10.0, 101.0),  # a short backward: ready at 6 and 10, the link the limit: 6-66, 66-106, 106-111
    ],
)
def test_exposed_all_reduce(buckets, backward, exposed):
    """What the step waits for of DDP's all-reduce (1 second a byte here): each bucket ready as the backward has
    made the bytes before it (the last at the end), the link reducing them one after another."""
    assert hardware.exposed_all_reduce(buckets, 1.0, backward) == pytest.approx(exposed)


def test_ddp_splits_cost_bytes_on_two_cards_only():
    counts = hardware.CountedStep(**{**COUNTED, "ddp_split_bytes": 1e6})
    rates = hardware.CardRates(**RATES)
    one = hardware.predict_step(counts, rates, tokens_per_step=1000, world=1)
    two = hardware.predict_step(counts, rates, tokens_per_step=2000, world=2)
    assert one.memory_s == pytest.approx(0.001) and two.memory_s == pytest.approx(0.002)


@pytest.mark.parametrize("changes, tokens, world, seconds", STEPS)
def test_predict_step(changes, tokens, world, seconds):
    counts = hardware.CountedStep(**{**COUNTED, **changes})
    step = hardware.predict_step(counts, hardware.CardRates(**RATES), tokens_per_step=tokens, world=world)
    parts = (
        step.matmul_s,
        step.attention_s,
        step.memory_s,
        step.launch_s,
        step.newton_schulz_s,
        step.optimizer_s,
        step.all_reduce_s,
    )
    assert parts == pytest.approx(seconds)
    assert step.compute_s == pytest.approx(sum(seconds[:4]))
    assert step.total_s == pytest.approx(sum(seconds))
    assert step.tokens_per_second == pytest.approx(tokens / sum(seconds))
    assert step.hours_for(3.6e6 * tokens) == pytest.approx(1000 * sum(seconds))


@pytest.mark.parametrize(
    "counted, rates, tokens, world",
    [
        ({}, {"matmul_tflops": 0}, 1000, 1),
        ({}, {"bandwidth_gbs": 0}, 1000, 1),
        ({}, {"attention_tflops": 0}, 1000, 1),
        ({}, {"link_gbs": 0}, 2000, 2),
        ({}, {}, 1000, 2),
        ({}, {}, 500, 1),
        ({}, {}, 1000, 0),
    ],
)
def test_predict_step_refuses_impossible_inputs(counted, rates, tokens, world):
    with pytest.raises(ValueError):
        hardware.predict_step(
            hardware.CountedStep(**{**COUNTED, **counted}),
            hardware.CardRates(**{**RATES, **rates}),
            tokens_per_step=tokens,
            world=world,
        )


def test_muon_matrices_are_the_hidden_matrices():
    from tinyllm.model import config as model_config
    from tinyllm.training import optimization

    preset = model_config.PRESETS["tiny"]
    model = model_config.build_model(preset, 512)
    shapes = [tuple(param.shape) for param in optimization.hidden_matrices(model).hidden]
    assert sorted(hardware.muon_matrix_shapes(preset)) == sorted(shapes)
    assert (
        hardware.newton_schulz_flops(64, 192)
        == hardware.newton_schulz_flops(192, 64)
        == 5 * (4 * 64**2 * 192 + 2 * 64**3)
    )


def test_the_kaggle_prediction_uses_the_readme_split_and_the_t4_rules():
    """think72 on 2x T4 at 65,536 tokens/step: the fp16 counts (memory-efficient varlen attention), 4 micro-steps
    per rank, Newton-Schulz at the T4's fp16 rate, the all-reduce over PCIe; compiled faster than eager, and
    the optimistic rates faster than the central, the pessimistic slower (the hours themselves are
    bench/bench_roofline.py's to print: no timing target in a unit test)."""
    t4 = hardware.card_of(T4)
    counts = hardware.ROOFLINE_COUNTS[("fp16", "eager")]
    rates = hardware.ROOFLINE_RATES["T4"]
    step = hardware.predict_card(t4, world=2)
    assert step == hardware.predict_step(counts, rates, tokens_per_step=65_536, world=2)
    assert step.matmul_s == pytest.approx(32_768 * counts.matmul_flops / (rates.matmul_tflops * 1e12))
    assert step.memory_s == pytest.approx(32_768 * counts.other_bytes / (rates.bandwidth_gbs * 1e9))
    # the last two buckets after the backward (layer 0's gradients are the last the layers make, the tied
    # embedding's after them), the others hidden by it; Muon's exchange but for its last matrix hidden
    exposed = counts.bucket_bytes[-2] + counts.bucket_bytes[-1] + counts.last_broadcast_bytes
    assert counts.broadcast_bytes / 5e9 < step.newton_schulz_s
    assert step.all_reduce_s == pytest.approx(exposed / 5e9)
    assert counts.bucket_bytes[-1] == 33_069 * 512 * 4 and sum(counts.bucket_bytes) == counts.gradient_bytes
    hours = {
        name: hardware.predict_card(t4, world=2, mode="compiled", rates=rates).hours_for(1.5e9)
        for name, rates in {"central": rates, **hardware.T4_RATE_RANGE}.items()
    }
    assert hours["optimistic"] < hours["central"] < hours["pessimistic"] < step.hours_for(1.5e9) * 1.5
    assert hardware.predict_card(t4, world=2, mode="compiled").total_s < step.total_s
    assert hardware.predict_card(t4, world=1).all_reduce_s == 0
    a100 = hardware.predict_card(hardware.card_of(A100))  # bf16: flash varlen, K/V heads not repeated
    assert a100 == hardware.predict_step(
        hardware.ROOFLINE_COUNTS[("bf16", "eager")], hardware.ROOFLINE_RATES["A100"], tokens_per_step=65_536
    )


def test_the_recorded_counts_are_think72_s():
    """hardware.ROOFLINE_COUNTS (bench/bench_roofline.py's think72 counts): matmuls 6N per token within 1% (N:
    model_config.parameter_count, the tied head's matmul included, the lookup not), attention the per-document
    triangles (far below the C x C term of model_config.flops_per_token), the gradients 4 bytes a parameter."""
    preset = model_config.PRESETS["think72"]
    parameters = model_config.parameter_count(preset, 33_069)
    square = model_config.flops_per_token(preset, 33_069) - 6 * parameters
    for counts in hardware.ROOFLINE_COUNTS.values():
        assert counts.matmul_flops == pytest.approx(6 * parameters, rel=0.01)
        assert 0 < counts.attention_flops < square / 2
        assert counts.gradient_bytes == 4 * parameters
        assert counts.micro_batch_tokens == 8 * preset.context
    assert (
        hardware.ROOFLINE_COUNTS[("fp16", "compiled")].other_bytes
        < hardware.ROOFLINE_COUNTS[("fp16", "eager")].other_bytes / 2
    )


# ----------------------------------------------------------------------------------------------
# The memory model and the split an out-of-memory error suggests (think72's vocabulary, muon).

VOCAB = 33_069
MUON = hardware.OptimizerState(hidden=4, rest=8)  # optimization.OPTIMIZERS["muon"].state (tests/test_optimization.py)
MEDIUM_T4_ADVICE = "--batch-size 4 --grad-accum 8 keeps the global batch"

# preset, card, precision, micro-batch 8 x 1024 fits (chunked loss), fitted before the chunked loss,
# what fitting_split offers after an out-of-memory error at --batch-size 8 --grad-accum 4
MEMORY_TABLE = [
    ("think72", T4, "fp16", True, True, "--batch-size 4 --grad-accum 8"),
    ("think72", L4, "bf16", True, True, "--batch-size 4 --grad-accum 8"),
    ("think72", A100, "bf16", True, True, "--batch-size 4 --grad-accum 8"),
    ("small125", T4, "fp16", True, True, "--batch-size 4 --grad-accum 8"),
    ("small125", L4, "bf16", True, True, "--batch-size 4 --grad-accum 8"),
    ("small125", A100, "bf16", True, True, "--batch-size 4 --grad-accum 8"),
    ("medium350", T4, "fp16", False, False, "--batch-size 4 --grad-accum 8"),  # the issue's ~21.5 GiB case
    ("medium350", L4, "bf16", False, False, "--batch-size 4 --grad-accum 8"),
    ("medium350", A100, "bf16", True, True, "--batch-size 4 --grad-accum 8"),
]


def estimate(
    preset: str,
    precision: str = "fp16",
    batch_size: int = 8,
    context: int = 1024,
    grad_checkpoint: bool = False,
    **kwargs,
) -> hardware.StepMemory:
    return hardware.step_memory(
        model_config.PRESETS[preset], VOCAB, batch_size, context, precision, MUON, grad_checkpoint, **kwargs
    )


@pytest.mark.parametrize(
    "preset, device, precision, fits, fitted_before, offered",
    MEMORY_TABLE,
    ids=[f"{row[0]}-{row[1].name}" for row in MEMORY_TABLE],
)
def test_memory_on_every_card(preset, device, precision, fits, fitted_before, offered):
    usable = hardware.usable_memory_bytes(device)
    assert (estimate(preset, precision).total <= usable) == fits
    assert (estimate(preset, precision, chunk_tokens=8 * 1024).total <= usable) == fitted_before
    split = hardware.fitting_split(model_config.PRESETS[preset], VOCAB, 8, 4, 1024, precision, MUON, False, device)
    assert split.options() == offered and split.memory.total <= usable
    assert split.batch_size * split.grad_accum == 8 * 4  # the same global batch


def test_the_chunked_loss_takes_the_full_logits_out_of_the_estimate():
    before, after = estimate("medium350", chunk_tokens=8 * 1024), estimate("medium350")
    assert hardware.logits_chunk_tokens(VOCAB, "cuda") == 1014
    assert before.logits - after.logits == (8 * 1024 - 1014) * VOCAB * 12  # bf16 + fp32 logits, softmax, gradient
    assert 21 * GIB < before.total < 24 * GIB and after.total < 21 * GIB  # the issue estimated ~21.5 GiB before
    assert before.activations == after.activations and before.weights == after.weights


def test_memory_model_parts():
    fp16, fp32 = estimate("think72"), estimate("think72", "fp32")
    parameters = 72_000_000
    assert fp32.weights == 4 * parameters and fp16.weights == 6 * parameters  # + the autocast copies
    assert fp16.gradients == fp32.gradients == 4 * parameters
    adamw = hardware.step_memory(
        model_config.PRESETS["think72"], VOCAB, 8, 1024, "fp16", hardware.OptimizerState(hidden=8, rest=8), False
    )
    assert adamw.optimizer == 8 * parameters and parameters * 4 < fp16.optimizer < adamw.optimizer
    assert fp16.activations < fp32.activations
    assert estimate("think72", batch_size=4).activations * 2 == fp16.activations
    assert estimate("think72", grad_checkpoint=True).activations < fp16.activations / 5


@pytest.mark.parametrize(
    "preset, batch_size, grad_accum, context, grad_checkpoint, device, offered",
    [
        ("medium350", 8, 4, 2048, False, T4, "--batch-size 2 --grad-accum 16"),
        ("medium350", 6, 4, 1024, False, L4, "--batch-size 3 --grad-accum 8"),  # divisors, not only halves
        ("medium350", 1, 8, 1024, False, T4, "--batch-size 1 --grad-accum 8 --grad-checkpoint"),
        ("medium350", 1, 32, 8192, False, T4, "--batch-size 1 --grad-accum 32 --grad-checkpoint"),
        ("medium350", 1, 8, 1024, True, T4, None),  # nothing smaller is left
    ],
)
def test_fitting_split(preset, batch_size, grad_accum, context, grad_checkpoint, device, offered):
    split = hardware.fitting_split(
        model_config.PRESETS[preset], VOCAB, batch_size, grad_accum, context, "fp16", MUON, grad_checkpoint, device
    )
    assert (split and split.options()) == offered


def test_out_of_memory_advice():
    medium = model_config.PRESETS["medium350"]
    text = hardware.out_of_memory_advice("medium350", medium, VOCAB, 8, 4, 1024, "fp16", MUON, False, T4)
    assert text.startswith(
        "CUDA out of memory on Tesla T4 (sm_75) (15.0 GiB): medium350 at micro-batch 8 x 1024 "
        "tokens (--batch-size 8 --grad-accum 4, fp16) needs about 20.5 GiB"
    )
    assert text.endswith(MEDIUM_T4_ADVICE + " (the same samples every step) and needs about 12.8 GiB")
    assert "should fit" not in text
    roomy = hardware.out_of_memory_advice("medium350", medium, VOCAB, 8, 4, 1024, "bf16", MUON, False, A100)
    assert "should fit: is another process using the card" in roomy and MEDIUM_T4_ADVICE in roomy
    small_card = hardware.Device("cuda", "Tiny GPU", (7, 5), 2 * GIB)
    stuck = hardware.out_of_memory_advice("medium350", medium, VOCAB, 1, 32, 1024, "fp16", MUON, True, small_card)
    assert "no split of this batch fits 1.8 GiB" in stuck and "smaller --preset or --context" in stuck


def test_the_attention_paths_own_memory_is_counted():
    """The masked path's masks (the issue measured 14 x 16 MiB at 8 x 1024 in half on CPU), the varlen
    kernels' logsumexp, and the efficient kernel's repeated K/V heads; the out-of-memory advice adds them."""
    think72 = model_config.PRESETS["think72"]
    masked = estimate("think72", attention="masked cpu flash")
    flash = estimate("think72", attention="flash varlen")
    efficient = estimate("think72", attention="efficient varlen")
    plain = estimate("think72", attention="flash")
    mib = 2**20
    assert masked.attention == 8 * mib + think72.layers * 16 * mib  # the bool mask once, a half mask per layer
    assert flash.attention == think72.layers * 8 * 1024 * 4 * think72.heads  # fp32 logsumexp
    assert efficient.attention > flash.attention and plain.attention == 0
    assert masked.total - plain.total == masked.attention
    assert estimate("think72", batch_size=16, context=2048, attention="masked cpu flash").attention > 1.75 * 2**30
    checkpointed = estimate("think72", grad_checkpoint=True, attention="masked cpu flash")
    assert checkpointed.attention == 8 * mib + 16 * mib  # one layer at a time
    math = estimate("think72", precision="bf16", attention="masked math")
    assert math.attention > 10 * masked.attention  # the scores themselves
    medium = model_config.PRESETS["medium350"]
    text = hardware.out_of_memory_advice(
        "medium350", medium, VOCAB, 8, 4, 1024, "bf16", MUON, False, L4, attention="masked math"
    )
    assert "needs about" in text and "no split" not in text


@pytest.mark.parametrize(
    "requested, device, compiled",
    [
        (None, T4, True),
        (None, H200, True),
        (None, CPU, False),  # the default: on CUDA only
        (False, T4, False),
        (True, CPU, True),
        (True, A100, True),  # --no-compile / --compile win
    ],
)
def test_compile_is_on_by_default_on_cuda(requested, device, compiled):
    assert hardware.use_compile(requested, device) is compiled


STAT = """cpu  5795333 1112131 1170320 2122143 27373 0 11819 22060 0 0
cpu0 2521875 558049 521719 1509305 4839 0 1635 10920 0 0
cpu1 3273457 554081 648601 612837 22534 0 10184 11140 0 0
intr 38278957 0 0
"""


@pytest.mark.parametrize(
    "stat, busy, cores",
    [
        (STAT, (5795333 + 1112131 + 1170320 + 0 + 11819 + 22060) / 100, 2),  # idle and iowait left out
        ("cpu  1 2 3 4 5 6 7 8\ncpu0 1 2 3 4 5 6 7 8\n", (1 + 2 + 3 + 6 + 7 + 8) / 100, 1),  # no guest columns
        ("cpu  1 2 3\n", None, None),  # too few columns
        ("intr 1 2 3 4 5 6 7 8 9\n", None, None),  # not /proc/stat
        ("cpu  1 2 x 4 5 6 7 8\n", None, None),
        ("", None, None),
    ],
)
def test_the_machines_cpu_times_are_read_from_proc_stat(stat, busy, cores):
    times = hardware.cpu_times(stat, 100)
    assert (times.busy, times.cores) == (pytest.approx(busy), cores) if busy is not None else times is None


@pytest.mark.parametrize(
    "device_type, system, libc, options",
    [
        ("cpu", "Linux", "glibc", ((-3, 32 * 1024**2), (-1, 2**31 - 1))),  # the heap keeps blocks up to 32 MiB
        ("cuda", "Linux", "glibc", ()),  # the card's memory is the card's allocator's
        ("mps", "Darwin", "", ()),
        ("cpu", "Darwin", "", ()),  # macOS' allocator: not glibc's, not measured
        ("cpu", "Linux", "", ()),  # musl (Alpine)
    ],
)
def test_a_cpu_run_under_glibc_keeps_the_memory_it_frees(device_type, system, libc, options):
    assert hardware.malloc_options(device_type, system, libc) == options


def test_the_allocator_settings_take_on_this_machine_in_a_process_of_their_own():
    """The ctypes glue: mallopt accepts both settings here (glibc), and an accelerator's run sets nothing."""
    code = "from tinyllm.model import hardware as h; print(h.keep_freed_memory('cpu'), h.keep_freed_memory('cuda'))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    glibc = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
    assert done.stdout.split() == [str(glibc), "False"]


@pytest.mark.parametrize(
    "vocab, device_type, hidden, tokens",
    [
        (8192, "cpu", 128, 256),  # nano: 8 MiB of fp32 logits
        (8192, "cpu", 256, 512),  # micro: twice its hidden size (the head's reads and gradient a chunk)
        (33_069, "cpu", 512, 1024),  # think72: twice its hidden size, where 8 MiB would be 63 tokens
        (512, "cpu", 64, 4096),  # the demo's vocabulary: 8 MiB
        (8192, "cuda", 128, 4096),  # a card: 128 MiB of fp32 logits, whatever the hidden size
        (33_069, "cuda", 512, 1014),
        (2**26, "cuda", 64, 1),
    ],
)
def test_the_losss_chunk_fits_a_cards_memory_and_a_cpus_cache(vocab, device_type, hidden, tokens):
    assert hardware.logits_chunk_tokens(vocab, device_type, hidden) == tokens
