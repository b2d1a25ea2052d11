"""distributed.py's start-up all-reduce: the rule that words its error, and the check itself on gloo at
world size 2 (passing, hanging, and returning a wrong sum)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from ports import free_port

from tinyllm.common import UserError
from tinyllm.training import distributed

ROOT = Path(__file__).resolve().parent.parent

# backend, environment, failure (None: hung), what the line says, what it must not say
ERRORS = [
    (
        "nccl",
        {},
        None,
        [
            "2 GPUs did not finish in 90 s (NCCL)",
            "Kaggle's 2x T4",
            "NCCL_P2P_DISABLE=1 torchrun --nproc_per_node=2 train.py",
        ],
        ["NCCL_DEBUG"],
    ),
    ("nccl", {"NCCL_P2P_DISABLE": "0"}, None, ["run again with NCCL_P2P_DISABLE=1"], ["already set"]),
    ("nccl", {"NCCL_P2P_DISABLE": " "}, None, ["run again with NCCL_P2P_DISABLE=1"], ["already set"]),
    (
        "nccl",
        {},
        "DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1, unhandled system error",
        [
            "failed (DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1, unhandled system error) (NCCL)",
            "NCCL_P2P_DISABLE=1",
        ],
        ["did not finish"],
    ),
    (
        "nccl",
        {"NCCL_P2P_DISABLE": "1"},
        None,
        ["did not finish in 90 s (NCCL), with NCCL_P2P_DISABLE=1 already set", "NCCL_DEBUG=INFO", "NCCL_SHM_DISABLE=1"],
        ["run again with NCCL_P2P_DISABLE=1"],
    ),
    ("gloo", {}, None, ["2 ranks did not finish in 90 s (gloo)", "GLOO_SOCKET_IFNAME"], ["NCCL"]),
]


@pytest.mark.parametrize("backend, environ, failure, says, never", ERRORS)
def test_the_first_collective_s_error_names_the_likely_fix(backend, environ, failure, says, never):
    text = distributed.first_collective_error(backend, 2, 90, failure, environ)
    assert "\n" not in text and not text.startswith("error:")  # one line; the printer adds the prefix
    for words in says:
        assert words in text, (words, text)
    for words in never:
        assert words not in text, (words, text)


# Each rank of a 2-rank gloo group (the ranks started by hand, as torchrun would).
RANK_SCRIPT = """
import os, sys, time
import torch
from tinyllm.training import distributed
mode, rank = sys.argv[1], int(sys.argv[2])
if mode == "ok":
    info = distributed.init_distributed("cpu")  # init_process_group, then check_first_collective
    print("ready", flush=True)
    distributed.shutdown_distributed()  # then run_main leaves without the teardown (the gloo threads outlive the group)
else:
    import torch.distributed as dist
    from datetime import timedelta
    dist.init_process_group("gloo", timeout=timedelta(minutes=5))
    info = distributed.DistInfo(rank, rank, 2, torch.device("cpu"))
    if mode == "hang" and rank == 1:
        time.sleep(60)  # never joins the all-reduce
    wrong = (lambda tensor: (dist.all_reduce(tensor), tensor.add_(1))) if mode == "wrong" and rank == 0 else None
    distributed.check_first_collective(info, limit_seconds=3, elements=1000, all_reduce=wrong)
    print("ready", flush=True)
"""


def start_ranks(mode: str) -> list[subprocess.Popen]:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(ROOT),
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    code = (
        "from tinyllm.common import run_main\n"
        "def main():\n" + "".join(f"    {line}\n" for line in RANK_SCRIPT.strip().splitlines()) + "run_main(main)\n"
    )
    return [
        subprocess.Popen(
            [sys.executable, "-c", code, mode, str(rank)],
            cwd=ROOT,
            text=True,
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for rank in (0, 1)
    ]


def finish(process: subprocess.Popen, timeout: float) -> tuple[int, str, str]:
    try:
        out, err = process.communicate(timeout=timeout)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    return process.returncode, out, err


def test_the_first_collective_passes_on_two_gloo_ranks():
    ranks = start_ranks("ok")
    for process in ranks:
        code, out, err = finish(process, 120)
        assert code == 0 and out.strip() == "ready", err[-2000:]


GLOO_LINE = "[Gloo] Rank {} is connected to {} peer ranks. Expected number of connected peer ranks is : {}"


def test_gloo_s_all_connected_line_is_dropped_and_what_else_the_connect_prints_is_kept(capfd):
    """torch 2.10's gloo writes its line from C++ (file descriptor 1), as NCCL_DEBUG would: both written there."""
    print("before", flush=True)
    with distributed.gloo_connected_lines_dropped():
        print("from python")
        os.write(1, (GLOO_LINE.format(0, 1, 1) + "\n").encode())
        os.write(1, (GLOO_LINE.format(1, 0, 1) + "\nfrom C++\n").encode())
    print("after")
    assert capfd.readouterr().out == f"before\nfrom python\n{GLOO_LINE.format(1, 0, 1)}\nfrom C++\nafter\n"
    assert distributed.is_gloo_all_connected(GLOO_LINE.format(3, 7, 7) + "\n")
    assert not distributed.is_gloo_all_connected(GLOO_LINE.format(3, 6, 7))
    assert not distributed.is_gloo_all_connected("ready")


def test_a_hung_first_collective_ends_the_rank_in_its_limit_with_one_line():
    ranks = start_ranks("hang")
    started = time.monotonic()
    code, out, err = finish(ranks[0], 120)
    waited = time.monotonic() - started
    ranks[1].kill()  # it sleeps
    ranks[1].communicate()
    assert code == 2 and "ready" not in out
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert errors == [f"error: {distributed.first_collective_error('gloo', 2, 3, None, {})}"], err[-2000:]
    assert waited < 60  # its 3 s limit (and the start-up), not the process group's 5 minutes


def test_a_wrong_sum_is_one_error_line():
    ranks = start_ranks("wrong")
    code, out, err = finish(ranks[0], 120)
    finish(ranks[1], 120)
    assert code == 2 and "ready" not in out
    assert (
        err.strip().splitlines()[-1] == "error: the first all-reduce between the 2 ranks failed (the sum of 1,000 "
        "values came back between 4 and 4, not 3) (gloo): check that the ranks reach each other (MASTER_ADDR / "
        "MASTER_PORT, and GLOO_SOCKET_IFNAME naming an interface every rank shares)"
    ), err[-2000:]


def test_the_buckets_are_the_ones_ddp_reduces(monkeypatch):
    """distributed.bucket_bytes against the buckets DDP itself rebuilds after the first backward, in the order the
    gradients came (a real Reducer, gloo at world size 1, at data_parallel's bucket_mib): think72's shape at 2
    layers (its 67.7 MB tied embedding) in train.py's wrapping, the embedding in the last bucket."""
    import dataclasses

    import torch
    import torch.distributed as dist

    from tinyllm.model import config as model_config
    from tinyllm.model import losses

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = model_config.build_model(dataclasses.replace(model_config.PRESETS["think72"], layers=2), 33_069)
        model.config.use_cache = False
        info = distributed.DistInfo(0, 0, 1, torch.device("cpu"))
        ddp = distributed.data_parallel(losses.LanguageModelLoss(model), info)
        tokens = torch.randint(0, 33_069, (1, 16))
        for _ in range(3):  # the first backward records the order, the second forward rebuilds, the log follows
            ddp(tokens, tokens).backward()
        logged = ddp._get_ddp_logging_data()
    finally:
        dist.destroy_process_group()
    parameters = list(ddp.module.parameters())
    real = [
        [int(index) for index in bucket.split()] for bucket in logged["rebuilt_per_bucket_param_indices"].split(", ")
    ]
    assert logged["has_rebuilt_buckets"] == 1 and 0 in real[-1]  # the embedding, registered first, in the last
    assert logged["bucket_cap_bytes"] == distributed.bucket_mib(model) * 2**20
    real_bytes = [sum(parameters[index].numel() * 4 for index in bucket) for bucket in real]
    counted = distributed.bucket_bytes(model)
    # the rule takes each layer's parameters in reverse registration; the backward readies a few norms otherwise
    # (measured at DDP's default size: a cut moved by a q_norm and an input_layernorm, 2.5 KB): within one of
    # the layer's matrices
    largest = max(parameter.numel() * 4 for parameter in model.model.layers[0].parameters())
    assert len(counted) == len(real_bytes)
    assert all(abs(a - b) <= largest for a, b in zip(counted, real_bytes)), (counted, real_bytes)


@pytest.mark.parametrize(
    "preset, mib, buckets, last",
    [
        ("think72", 34, 7, 33_069 * 512 * 4),  # the embedding alone in the last bucket (DDP's default: 92.9 MB)
        ("nano", 40, 1, None),  # smaller than a bucket: one
    ],
)
def test_the_bucket_size_leaves_the_embedding_the_least_company(preset, mib, buckets, last):
    import torch

    from tinyllm.model import config as model_config

    with torch.device("meta"):
        model = model_config.build_model(model_config.PRESETS[preset], 33_069)
    sizes = distributed.bucket_bytes(model)
    assert distributed.bucket_mib(model) == mib and len(sizes) == buckets
    assert sum(sizes) == 4 * model_config.parameter_count(model_config.PRESETS[preset], 33_069)
    if last is not None:
        assert sizes[-1] == last
        assert all(distributed.bucket_bytes(model, other)[-1] >= last for other in distributed.BUCKET_MIB)


def test_training_on_a_cuda_device_torch_does_not_see_is_a_user_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError, match="^--device cuda, but torch sees no CUDA device$"):
        distributed.init_distributed("cuda")
