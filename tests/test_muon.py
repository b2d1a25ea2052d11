"""muon.py: torch.optim.Muon's rule with the Newton-Schulz iteration in the device's dtype, split across ranks."""

from __future__ import annotations

import io
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from ports import free_port

from tinyllm import common
from tinyllm.model import hardware
from tinyllm.store import checkpoint_store as store
from tinyllm.training import muon

SHAPES = [(48, 32), (32, 48), (40, 40), (64, 16), (16, 16)]  # wide, tall, square: both branches of the transpose
COEFFICIENTS, STEPS, EPS = (3.4445, -4.7750, 2.0315), 5, 1e-7


def parameters(seed: int = 0) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in SHAPES]


def take_steps(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], steps: int = 3) -> None:
    """`steps` optimizer steps on gradients drawn from a fixed seed (the same on every rank)."""
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for param in params:
            param.grad = torch.randn(param.shape, generator=generator)
        optimizer.step()


def reference_newton_schulz(grad: torch.Tensor) -> torch.Tensor:
    """The quintic iteration X <- aX + (bA + cA^2)X, A = X X^T, in float64, written out independently."""
    a, b, c = COEFFICIENTS
    x = grad.double()
    tall = x.size(0) > x.size(1)
    x = x.T if tall else x
    x = x / x.norm()
    for _ in range(STEPS):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


@pytest.mark.parametrize(
    "options",
    [{}, {"nesterov": False}, {"adjust_lr_fn": "match_rms_adamw", "momentum": 0.9}],
    ids=["default", "no-nesterov", "rms-adjusted"],
)
def test_bf16_is_bitwise_torch_muon(options):
    """With the iteration in bf16 the update is torch's, bit for bit: momentum, Nesterov, weight decay, lr
    adjustment. The fp32 iteration on the same steps is not (so the comparison can tell them apart)."""
    stock, ours, fp32 = parameters(), parameters(), parameters()
    settings = {"lr": 0.02, "weight_decay": 0.1, **options}
    take_steps(torch.optim.Muon(stock, **settings), stock)
    optimizer = muon.Muon(ours, ns_dtype="bf16", **settings)
    take_steps(optimizer, ours)
    take_steps(muon.Muon(fp32, ns_dtype="fp32", **settings), fp32)
    assert all(torch.equal(a, b) for a, b in zip(stock, ours))
    assert not all(torch.equal(a, b) for a, b in zip(stock, fp32))

    reference = torch.optim.Muon(parameters(), **settings)
    take_steps(reference, reference.param_groups[0]["params"])
    assert store.tensor_differences(optimizer.state_dict(), reference.state_dict(), "muon") == []


@pytest.mark.parametrize("dtype, bound", [(torch.float32, 1e-5), (torch.float16, 5e-3), (torch.bfloat16, 5e-2)])
def test_newton_schulz_against_a_float64_reference(dtype, bound):
    """Each dtype's iteration lands near the float64 one (fp32 to its rounding, fp16 with 3 more mantissa bits
    than bf16 closer than bf16), in the input's shape and dtype, even from a gradient of small entries (fp16
    is normalized in fp32 first). The result is near orthogonal: its singular values mostly in torch's
    documented band 0.5 to 1.5 (the iteration leaves a random square matrix's smallest ones below it)."""
    generator = torch.Generator().manual_seed(2)
    for shape in SHAPES:
        grad = torch.randn(shape, generator=generator) * 1e-3
        expected = reference_newton_schulz(grad)
        got = muon.newton_schulz(grad, dtype, COEFFICIENTS, STEPS, EPS)
        assert got.shape == grad.shape and got.dtype == dtype
        error = ((got.double() - expected).norm() / expected.norm()).item()
        assert error < bound, (shape, error)
        singular = torch.linalg.svdvals(got.double())
        assert singular.max() < 1.5 and ((singular > 0.5).double().mean() > 0.9)


def tiny_muon(rank: int = 0, world: int = 1, precision: str = "fp32") -> torch.optim.Optimizer:
    from tinyllm.model import config as model_config
    from tinyllm.training import optimization

    model = model_config.build_model(model_config.PRESETS["tiny"], vocab_size=300)
    recipe = optimization.Recipe(
        optimizer="muon",
        lr=1e-3,
        muon_lr=0.02,
        schedule="wsd",
        warmup_steps=1,
        decay_steps=1,
        final_lr_fraction=0.0,
        total_steps=10,
        weight_decay=0.1,
        betas=(0.9, 0.95),
        muon_momentum=0.95,
        grad_clip=1.0,
        head_lr=1e-3,
    )
    return optimization.build_optimizers(model, recipe, torch.device("cpu"), rank, world, precision).parts["muon"]


def test_the_optimizer_iterates_in_the_devices_dtype():
    optimizer = tiny_muon(rank=1, world=2)
    assert isinstance(optimizer, torch.optim.Muon)
    assert (optimizer.ns_dtype, optimizer.rank, optimizer.world) == ("fp32", 1, 2)
    assert optimizer.defaults["nesterov"] and optimizer.defaults["momentum"] == 0.95
    assert hardware.machine_record(torch.device("cpu"), 1, "fp32", "cpu flash")["newton_schulz_dtype"] == "fp32"


@pytest.mark.parametrize(
    "cpu, precision, newton_schulz",
    [(hardware.CPU_BF16, "bf16", "bf16"), (hardware.CPU_BF16, "fp32", "fp32"), (hardware.CPU, "bf16", "fp32")],
)
def test_the_runs_precision_reaches_muons_iteration(monkeypatch, cpu, precision, newton_schulz):
    # a bf16 run on a CPU with bf16 instructions iterates in bf16; an fp32 run, or bf16 emulated, in fp32
    monkeypatch.setattr(hardware, "describe", lambda device: cpu)
    assert tiny_muon(precision=precision).ns_dtype == newton_schulz
    record = hardware.machine_record(torch.device("cpu"), 1, precision, "cpu flash")
    assert record["newton_schulz_dtype"] == newton_schulz


TINY_LAYER = [(64, 64), (32, 64), (32, 64), (64, 64), (192, 64), (192, 64), (64, 192)]  # q k v o gate up down


@pytest.mark.parametrize(
    "shapes, world, owners",
    [
        ([(64, 64)] * 3, 1, [0, 0, 0]),
        ([(64, 64)] * 4, 2, [0, 1, 0, 1]),  # equal matrices alternate
        ([(64, 64), (256, 64), (64, 64), (64, 256)], 2, [0, 0, 1, 1]),  # the two big ones first, one per rank
        ([(512, 512), (64, 64), (64, 64), (64, 64)], 2, [0, 1, 1, 1]),  # one big matrix outweighs the rest
        ([(64, 64)] * 2, 3, [0, 1]),  # more ranks than matrices: rank 2 has none
        (TINY_LAYER, 2, [1, 1, 1, 1, 0, 1, 0]),  # gate, down on rank 0; up and the attention on rank 1
        (TINY_LAYER, 3, [0, 2, 2, 1, 0, 1, 2]),
    ],
)
def test_newton_schulz_owners_table(shapes, world, owners):
    assert muon.newton_schulz_owners(shapes, world) == owners


def test_newton_schulz_owners_balance_a_model():
    """Two layers of the tiny preset on 2 ranks: each rank gets half the work, to within the largest matrix."""
    shapes = TINY_LAYER * 2
    owners = muon.newton_schulz_owners(shapes, 2)
    flops = hardware.newton_schulz_flops
    load = [sum(flops(*s) for s, owner in zip(shapes, owners) if owner == rank) for rank in (0, 1)]
    assert abs(load[0] - load[1]) <= max(hardware.newton_schulz_flops(*s) for s in shapes)
    assert load[0] == load[1]  # two identical layers split evenly


SPLIT_DTYPES = ("fp32", "fp16", "bf16")


def record_shapes(optimizer: muon.Muon) -> list[tuple[int, int]]:
    """The shapes of the matrices `optimizer` orthogonalizes from now on, in order (a list it appends to)."""
    shapes, original = [], optimizer.newton_schulz

    def recording(update: torch.Tensor, group: dict) -> torch.Tensor:
        shapes.append(tuple(update.shape))
        return original(update, group)

    optimizer.newton_schulz = recording
    return shapes


def sharded_steps(rank: int, world: int, port: int, folder: str) -> None:
    """One rank of a gloo group: 3 steps on the shared gradients per dtype; saves its parameters, state and the
    shapes it orthogonalized. (A spawned child imports this module: it must not import train, which is slow.)"""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for ns_dtype in SPLIT_DTYPES:
            params = parameters()
            optimizer = muon.Muon(params, ns_dtype=ns_dtype, rank=rank, world=world, lr=0.02, weight_decay=0.1)
            calls = record_shapes(optimizer)
            take_steps(optimizer, params)
            torch.save(
                {"params": [p.detach() for p in params], "state": optimizer.state_dict(), "calls": calls},
                os.path.join(folder, f"{ns_dtype}-rank{rank}.pt"),
            )
    finally:
        dist.destroy_process_group()
    common.leave_without_teardown()  # pytorch #190489: the gloo threads outlive the group


def test_world_size_2_splits_the_work_and_matches_world_size_1_bitwise(tmp_path):
    """Given the same (all-reduced) gradients, 2 ranks each orthogonalize about half the matrices, none twice,
    and end with the parameters and optimizer state of 1 rank, bit for bit, on both ranks, in every dtype."""

    mp.spawn(sharded_steps, args=(2, free_port(), str(tmp_path)), nprocs=2)
    for ns_dtype in SPLIT_DTYPES:
        single = parameters()
        optimizer = muon.Muon(single, ns_dtype=ns_dtype, lr=0.02, weight_decay=0.1)
        take_steps(optimizer, single)
        ranks = [torch.load(tmp_path / f"{ns_dtype}-rank{rank}.pt", weights_only=True) for rank in (0, 1)]
        for saved in ranks:
            assert all(torch.equal(a, b) for a, b in zip(saved["params"], single)), ns_dtype
            assert store.tensor_differences(saved["state"], optimizer.state_dict(), "muon") == [], ns_dtype
        per_step = [len(saved["calls"]) // 3 for saved in ranks]
        assert sum(per_step) == len(SHAPES) and min(per_step) >= 1
        assert sorted(ranks[0]["calls"][: per_step[0]] + ranks[1]["calls"][: per_step[1]]) == sorted(SHAPES)


# ----------------------------------------------------------------------------------------------
# Recipe round 2 (issue 30): Polar Express, NorMuon, cautious weight decay


def singular_values(matrix: torch.Tensor) -> torch.Tensor:
    return torch.linalg.svdvals(matrix.double())


@pytest.mark.parametrize("shape", SHAPES)
def test_polar_express_orthogonalizes_closer_than_torchs_coefficients(shape):
    """Both iterations push the singular values toward 1; Polar Express's per-step coefficients land closer
    (torch's quintic only reaches roughly [0.7, 1.2])."""
    grad = torch.randn(shape, generator=torch.Generator().manual_seed(3))
    express = singular_values(muon.newton_schulz(grad, torch.float32, muon.POLAR_EXPRESS, 5, EPS))
    stock = singular_values(muon.newton_schulz(grad, torch.float32, COEFFICIENTS, 5, EPS))
    assert (express - 1).abs().max() < 0.2
    assert (express - 1).abs().mean() < (stock - 1).abs().mean()


def test_polar_express_in_bf16_is_not_torchs_function():
    """torch's bf16 function takes one (a, b, c): Polar Express runs the module's own loop in bf16."""
    grad = torch.randn(32, 48, generator=torch.Generator().manual_seed(4))
    ortho = muon.newton_schulz(grad, torch.bfloat16, muon.POLAR_EXPRESS, 5, EPS)
    assert ortho.dtype == torch.bfloat16 and (singular_values(ortho) - 1).abs().max() < 0.25


@pytest.mark.parametrize("shape", [(48, 32), (32, 48)])
def test_normalize_neurons_evens_each_neuron_and_keeps_the_norm(shape):
    update = torch.randn(shape, generator=torch.Generator().manual_seed(5)) * torch.linspace(0.1, 3, shape[0])[:, None]
    dim = -1 if shape[0] >= shape[1] else 0
    second_moment = torch.zeros((shape[0], 1) if dim == -1 else (1, shape[1]))
    normalized = muon.normalize_neurons(update, second_moment, beta2=0.95)
    assert normalized.norm() == pytest.approx(update.norm().item(), rel=1e-5)
    rms = normalized.square().mean(dim=dim).sqrt()  # from a zero state every neuron ends at the same RMS
    assert rms.max() / rms.min() == pytest.approx(1.0, rel=1e-4)
    assert torch.equal(second_moment, 0.05 * update.square().mean(dim=dim, keepdim=True))


@pytest.mark.parametrize(
    "cautious, expected",
    [
        (False, [0.5, -0.5, 0.5, -0.5]),  # every weight decays
        (True, [0.5, -1.0, 1.0, -0.5]),  # only where update and weight share a sign (the step shrinks it too)
    ],
)
def test_weight_decay_table(cautious, expected):
    param = torch.tensor([1.0, -1.0, 1.0, -1.0])
    muon.decay_(param, torch.tensor([0.3, 0.3, -0.3, -0.3]), 0.5, cautious)
    assert param.tolist() == expected


def test_normuon_state_is_in_the_state_dict_and_a_reload_continues_bitwise():
    options = dict(
        lr=0.02,
        weight_decay=0.1,
        normuon_beta2=0.95,
        coefficients="polar-express",
        cautious_weight_decay=True,
        ns_dtype="fp32",
    )
    params = parameters()
    optimizer = muon.Muon(params, **options)
    take_steps(optimizer, params, steps=2)
    saved = io.BytesIO()
    torch.save(optimizer.state_dict(), saved)
    copies = [torch.nn.Parameter(param.detach().clone()) for param in params]
    resumed = muon.Muon(copies, **options)
    resumed.load_state_dict(torch.load(io.BytesIO(saved.getvalue())))
    assert all(set(entry) == {"momentum_buffer", "second_moment"} for entry in resumed.state_dict()["state"].values())
    take_steps(optimizer, params, steps=2)
    take_steps(resumed, copies, steps=2)
    assert all(torch.equal(a, b) for a, b in zip(params, copies))


@pytest.mark.parametrize(
    "owners, world, order",
    [
        ([0, 1, 0, 1], 2, [0, 1, 2, 3]),
        ([0, 0, 1, 1, 0], 2, [0, 2, 1, 3, 4]),  # each rank's first, then each rank's second, then what is left
        ([1, 1, 1], 2, [0, 1, 2]),
        ([2, 0, 1, 0], 3, [1, 2, 0, 3]),
        ([], 2, []),
    ],
)
def test_the_exchange_interleaves_the_ranks_shares(owners, world, order):
    assert muon.exchange_order(owners, world) == order
