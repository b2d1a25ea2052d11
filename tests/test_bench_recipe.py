"""bench/bench_recipe.py's pure parts: the time-to-target rule and Muon's FLOP accounting."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import bench_recipe  # noqa: E402

import model_config  # noqa: E402

CURVE = [{"seconds": 0.0, "bpb": 3.0}, {"seconds": 10.0, "bpb": 2.0}, {"seconds": 20.0, "bpb": 1.5},
         {"seconds": 30.0, "bpb": 1.4}]


@pytest.mark.parametrize("target, seconds", [
    (3.0, 0.0),  # reached at the start
    (2.5, 5.0),  # half way between the first two evaluations
    (2.0, 10.0),
    (1.75, 15.0),
    (1.4, 30.0),
    (1.39, None),  # never
])
def test_time_to_reach_interpolates_between_evaluations(target, seconds):
    assert bench_recipe.time_to_reach(CURVE, target) == (None if seconds is None else pytest.approx(seconds))


@pytest.mark.parametrize("shape", [(64, 64), (192, 64), (64, 192), (128, 384)])
def test_newton_schulz_flops_match_what_torch_muon_computes(shape):
    """The formula against FlopCounterMode over torch.optim.Muon's own orthogonalization."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    with FlopCounterMode(display=False) as counter:
        _zeropower_via_newtonschulz(torch.randn(*shape), (3.4445, -4.775, 2.0315), 5, 1e-7)
    assert bench_recipe.newton_schulz_flops(*shape) == counter.get_total_flops()


def test_muon_share_on_gpus_is_a_ranks_share_of_the_matrices_work_over_a_gpus_step():
    preset = model_config.PRESETS["nano"]
    matrices = [(128, 128), (64, 128), (64, 128), (128, 128), (384, 128), (384, 128), (128, 384)]
    extra = 4 * sum(bench_recipe.newton_schulz_flops(*shape) for shape in matrices)
    step = model_config.flops_per_token(preset, 4096) * 8192 / 2
    assert bench_recipe.muon_share_on_gpus(preset, 4096, 8192, 2) == pytest.approx(extra / 2 / step)  # split in 2
