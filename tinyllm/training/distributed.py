"""The ranks of a run: torchrun's processes, their devices, the decisions they share and their RNGs.

torchrun sets RANK, LOCAL_RANK and WORLD_SIZE; without it a run is one rank. NCCL on CUDA, gloo on
CPU. A start-up all-reduce with a short limit (`check_first_collective`) proves the ranks can talk
before any work: a hung NCCL peer-to-peer path (PCIe cloud pairs such as Kaggle's 2x T4) ends the run
in 90 s with one `error:` line naming NCCL_P2P_DISABLE=1, not after the process group's 30 minutes.
Every rank takes the same decisions (main_decides: rank 0 decides, the others follow) and
keeps its own RNG, gathered into every checkpoint (RankRNG) so a resume continues each rank's stream.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import shlex
import shutil
import sys
import tempfile
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from tinyllm.common import UserError, console_script, file_descriptor_to
from tinyllm.model import hardware


def rng_state(device: torch.device) -> dict:
    version, mt_state, gauss = random.getstate()
    numpy_state = np.random.get_state()
    state = {
        "python": [version, list(mt_state), gauss],
        "numpy": {
            "key": torch.from_numpy(numpy_state[1].astype(np.int64)),
            "pos": int(numpy_state[2]),
            "has_gauss": int(numpy_state[3]),
            "cached_gaussian": float(numpy_state[4]),
        },
        "torch": torch.get_rng_state(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    version, mt_state, gauss = state["python"]
    random.setstate((version, tuple(mt_state), gauss))
    numpy_state = state["numpy"]
    np.random.set_state(
        (
            "MT19937",
            numpy_state["key"].numpy().astype(np.uint32),
            numpy_state["pos"],
            numpy_state["has_gauss"],
            numpy_state["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch"].cpu())
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)


class RankRNG:
    """The RNG state of every rank, gathered to rank 0 for the checkpoint (a collective call)."""

    def __init__(self, info: DistInfo):
        self.info = info

    def state_dict(self) -> list[dict] | None:
        local = rng_state(self.info.device)
        if self.info.world == 1:
            return [local]
        gathered = [None] * self.info.world if self.info.is_main else None
        dist.gather_object(local, gathered, dst=0)
        return gathered

    def load_state_dict(self, states: list[dict]) -> None:
        """Each rank takes its own state; ranks new since the checkpoint keep their seeded state."""
        if self.info.rank < len(states):
            set_rng_state(states[self.info.rank], self.info.device)


def agree_max(values: list[float], info: DistInfo) -> list[float]:
    """Each value's largest over the ranks (one all_reduce, in float64): a clock or a flag that says
    stop on any rank says so on all, and every rank decides alike."""
    if info.world == 1:
        return list(values)
    tensor = torch.tensor(values, dtype=torch.float64, device=info.device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


@dataclass
class DistInfo:
    rank: int
    local_rank: int
    world: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device_choice: str = "auto") -> DistInfo:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    hardware.check_device(device_choice)
    use_cuda = device_choice == "cuda" or (device_choice == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    info = DistInfo(rank=rank, local_rank=local_rank, world=world, device=device)
    if world > 1 and not dist.is_initialized():
        init_process_group(
            "nccl" if use_cuda else "gloo", timeout=timedelta(minutes=30), device_id=device if use_cuda else None
        )
        check_first_collective(info)
    return info


def init_process_group(backend: str, **options) -> None:
    """dist.init_process_group; on gloo without the line its C++ writes to stdout when a rank has connected."""
    with gloo_connected_lines_dropped() if backend == "gloo" else contextlib.nullcontext():
        dist.init_process_group(backend, **options)


# torch 2.10's gloo (std::cout, no setting turns it off; 2.11 and later log it at INFO, which is not shown)
GLOO_CONNECTED = re.compile(
    r"\[Gloo\] Rank \d+ is connected to (\d+) peer ranks\. "
    r"Expected number of connected peer ranks is : (\d+)"
)


def is_gloo_all_connected(line: str) -> bool:
    """gloo's line saying a rank reached every peer: noise beside the run's own lines. One short of its peers is
    kept (it names the rank that could not connect)."""
    match = GLOO_CONNECTED.fullmatch(line.strip())
    return match is not None and match[1] == match[2]


@contextlib.contextmanager
def gloo_connected_lines_dropped():
    """What the C++ below writes to stdout (file descriptor 1) is held in a file and written out after, less gloo's
    all-connected lines. Only around gloo's connect: NCCL_DEBUG's lines must come as they are written."""
    with tempfile.TemporaryFile() as held:
        try:
            with file_descriptor_to(1, held):
                yield
        finally:
            held.seek(0)
            lines = held.read().decode(errors="replace").splitlines(keepends=True)
            sys.stdout.write("".join(line for line in lines if not is_gloo_all_connected(line)))
            sys.stdout.flush()


# ----------------------------------------------------------------------------------------------
# The first collective, with a short limit.

FIRST_COLLECTIVE_SECONDS = 90.0  # NCCL's communicator setup and one 16 MiB all-reduce take seconds
FIRST_COLLECTIVE_ELEMENTS = 1 << 22  # fp32: 16 MiB, so NCCL's ring sends over its real transport, in chunks
LATE_RANK_GRACE_SECONDS = 10.0  # the other ranks' watchdogs wait this much longer: rank 0 says it


def first_collective_error(
    backend: str, world: int, limit_seconds: float, failure: str | None, environ: Mapping[str, str]
) -> str:
    """The `error:` text (without the prefix) of a start-up all-reduce that did not work: `failure` None
    when it hung past `limit_seconds`, else what went wrong (an exception's first line, a wrong sum).

    NCCL: on PCIe cloud machines (Kaggle's 2x T4, many rented pairs) the GPUs' peer-to-peer path is
    offered but does not work, and NCCL's first collective hangs (or returns garbage);
    NCCL_P2P_DISABLE=1 sends the traffic through host memory instead. Already set: NCCL_DEBUG=INFO
    shows the transport NCCL chose and where it stops. gloo: the ranks' network."""
    what = f"did not finish in {limit_seconds:g} s" if failure is None else f"failed ({failure})"
    if backend != "nccl":
        return (
            f"the first all-reduce between the {world} ranks {what} ({backend}): check that the ranks reach "
            "each other (MASTER_ADDR / MASTER_PORT, and GLOO_SOCKET_IFNAME naming an interface every rank "
            "shares)"
        )
    head = f"the first all-reduce between the {world} GPUs {what} (NCCL)"
    if environ.get("NCCL_P2P_DISABLE", "").strip() not in ("", "0"):
        return (
            f"{head}, with NCCL_P2P_DISABLE={environ['NCCL_P2P_DISABLE']} already set: run again with "
            "NCCL_DEBUG=INFO to see the transport NCCL picks and where it stops (NCCL_SHM_DISABLE=1 "
            "is the next thing to try)"
        )
    return (
        f"{head}: the GPUs' peer-to-peer path does not work on this machine, as on PCIe cloud pairs "
        "(Kaggle's 2x T4); run again with NCCL_P2P_DISABLE=1 before the command (e.g. "
        "NCCL_P2P_DISABLE=1 torchrun --nproc_per_node=2 train.py ...), which sends the traffic through "
        "host memory"
    )


def check_first_collective(
    info: DistInfo,
    limit_seconds: float = FIRST_COLLECTIVE_SECONDS,
    elements: int = FIRST_COLLECTIVE_ELEMENTS,
    environ: Mapping[str, str] | None = None,
    all_reduce=None,
) -> None:
    """One all-reduce of `elements` values (rank r sends r + 1) that must give every rank the sum
    within `limit_seconds`. A watchdog thread ends the process (exit 2, rank 0 printing the one
    `error:` line of first_collective_error) when it hangs: the process group's own timeout is 30
    minutes, and a rank stuck in a CUDA wait runs no Python. An error or a wrong sum is a UserError
    with the same line. `all_reduce`: dist.all_reduce (the tests stand in a hanging one)."""
    environ = os.environ if environ is None else environ
    backend = dist.get_backend()
    finished = threading.Event()

    def watchdog() -> None:
        grace = 0.0 if info.is_main else LATE_RANK_GRACE_SECONDS
        if finished.wait(limit_seconds + grace):
            return
        print(
            f"error: {first_collective_error(backend, info.world, limit_seconds, None, environ)}",
            file=sys.stderr,
            flush=True,
        )
        os._exit(2)  # the main thread is blocked in the collective: nothing else can end it

    threading.Thread(target=watchdog, name="first-collective-watchdog", daemon=True).start()
    expected = info.world * (info.world + 1) / 2
    try:
        tensor = torch.full((elements,), float(info.rank + 1), device=info.device)
        (all_reduce or dist.all_reduce)(tensor)
        low, high = tensor.min().item(), tensor.max().item()  # a CUDA sync: a hang shows here
    except RuntimeError as error:  # torch.distributed.DistError is one
        lines = str(error).strip().splitlines()
        failure = f"{type(error).__name__}: {lines[0][:200] if lines else ''}"
        shutdown_distributed()
        raise UserError(first_collective_error(backend, info.world, limit_seconds, failure, environ)) from None
    finally:
        finished.set()
    if low != expected or high != expected:
        failure = f"the sum of {elements:,} values came back between {low:g} and {high:g}, not {expected:g}"
        shutdown_distributed()  # now, not in the interpreter's teardown: gloo aborts there once the peers are gone
        raise UserError(first_collective_error(backend, info.world, limit_seconds, failure, environ))


def use_deterministic_kernels(on: bool) -> None:
    """--deterministic: torch's deterministic algorithms, with an op that has none an error (warn_only
    would leave flash and memory-efficient attention their nondeterministic backwards), cuBLAS's fixed
    workspace (read when CUDA makes its first cuBLAS handle) and cuDNN without autotuning. Off: torch's
    defaults again, so one process may train both ways (the tests)."""
    if on:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(on)
    torch.backends.cudnn.deterministic = on
    torch.backends.cudnn.benchmark = False


def shutdown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def broadcast_from_main(obj: Any, info: DistInfo) -> Any:
    """Rank 0's `obj` on every rank (so all ranks take the same decision)."""
    if info.world == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def main_decides(function, info: DistInfo) -> Any:
    """Run `function` on rank 0 and give its result to every rank; a UserError there is raised everywhere."""
    outcome = None
    if info.is_main:
        try:
            outcome = ("ok", function())
        except UserError as error:
            outcome = ("error", str(error))
    kind, value = broadcast_from_main(outcome, info)
    if kind == "error":
        raise UserError(value)
    return value


def all_reduce_sum(tensor: torch.Tensor, info: DistInfo) -> torch.Tensor:
    if info.world > 1:
        dist.all_reduce(tensor)
    return tensor


def wrap_for_training(module: torch.nn.Module, info: DistInfo, order: list[str]) -> torch.nn.Module:
    """`module` wrapped in DDP and torch.compile in hardware.wrap_order's `order` (its first entry is
    the module itself)."""
    for wrapper in order[1:]:
        module = compiled(module) if wrapper == "compile" else data_parallel(module, info)
    return module


def compiled(module: torch.nn.Module) -> torch.nn.Module:
    """torch.compile of `module` with the training step's Inductor options (hardware.INDUCTOR_OPTIONS)."""
    return torch.compile(module, options=dict(hardware.INDUCTOR_OPTIONS))


def data_parallel(module: torch.nn.Module, info: DistInfo) -> torch.nn.Module:
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    device_ids = [info.local_rank] if info.device.type == "cuda" else None
    # The model's only buffers (RoPE frequencies) are the same on every rank: no sync per forward.
    # torch 2.13 renamed the option (and warns on the old name from every rank).
    no_buffer_sync = (
        {"forward_sync_buffers": False}
        if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
        else {"broadcast_buffers": False}
    )
    return DistributedDataParallel(
        module,
        device_ids=device_ids,
        gradient_as_bucket_view=True,
        bucket_cap_mb=bucket_mib(module),
        **no_buffer_sync,
    )


BUCKET_MIB = range(25, 41)  # DDP's bucket sizes bucket_mib chooses from: its default 25 MiB and up (no more splits)


def bucket_mib(module: torch.nn.Module) -> int:
    """DDP's bucket size for `module`, in MiB: of BUCKET_MIB, the one whose last bucket is the smallest (the larger
    of equals: fewer buckets). Why: the step waits for the last bucket's all-reduce, the tied embedding's
    gradient (complete only when the backward ends) with whatever came just before it up to the size; at DDP's
    default (a 1 MiB first bucket, then 25 MiB) think72's holds 25 MB of its first layers beside the embedding's
    67.7 MB, at 34 MiB the embedding alone; and compiled, DDPOptimizer splits the graph at every bucket (each
    split costs bytes: bench/RESULTS.md, "The step waits for less"), 7 buckets at 34 MiB, 9 at DDP's default."""
    sizes = {mib: bucket_bytes(module, mib) for mib in BUCKET_MIB}
    return min(BUCKET_MIB, key=lambda mib: (sizes[mib][-1], -mib))


def bucket_bytes(module: torch.nn.Module, mib: int | None = None) -> list[int]:
    """Bytes of the gradients in each of DDP's buckets for `module` (its parameters may be on "meta") at `mib`
    MiB a bucket (default: bucket_mib's), in the order they are reduced: the last is all-reduced only when the
    backward has ended. DDP rebuilds its buckets after the first step in the order the gradients became ready,
    each of the size given (DDP keeps its 1 MiB first bucket for its default size only); taken here as the
    parameters' reverse order of registration, the tied embedding last (its gradient is complete only with the
    lookup's, the backward's last op), which the backward follows but for a few norms inside a layer
    (tests/test_distributed.py: within one of a layer's matrices). The buckets as torch's own assignment (the
    Reducer's) makes them."""
    mib = bucket_mib(module) if mib is None else mib
    ready = [parameter for parameter in reversed(list(module.parameters())) if parameter.requires_grad]
    buckets, _ = dist._compute_bucket_assignment_by_size(ready, [mib * 1024 * 1024], [False] * len(ready))
    buckets = sorted(buckets, key=min)
    return [sum(ready[index].numel() * ready[index].element_size() for index in bucket) for bucket in buckets]


def python_command() -> str:
    """`python` when that is this interpreter on PATH, else this interpreter's path (a venv's python
    started by its path: the `python` on PATH may have no torch)."""
    on_path = shutil.which("python")
    if on_path and os.path.realpath(on_path) == os.path.realpath(sys.executable):
        return "python"
    return shlex.quote(sys.executable)


def launch_command(info: DistInfo, script: Path, args: list[str]) -> str:
    """The command that starts `script` with `args` on this layout again, in the form the user ran it:
    its console script (`tinyllm-train`) when started so, python, or torchrun with the nodes and
    processes per node of this run; the script as run from the current folder."""
    script_path = script.resolve()
    relative = os.path.relpath(script_path)
    shown = shlex.quote(str(script_path) if relative.startswith("..") else relative)
    console = console_script(script.stem, sys.argv[0] if sys.argv else "")
    if info.world == 1 and console:
        launcher = console
    elif info.world == 1:
        launcher = f"{python_command()} {shown}"
    else:
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", info.world))
        nodes = info.world // per_node
        launcher = (
            "torchrun "
            + (f"--nnodes={nodes} (with your rendezvous options) " if nodes > 1 else "")
            + f"--nproc_per_node={per_node} {shown}"
        )
    return " ".join([launcher, *map(shlex.quote, args)])
