"""World size 1 against world size 2 with the same global batch: how far apart the weights end, and where
the two first part (docs/training.md "Changing the number of GPUs").

    python bench/bench_world_sizes.py --work /tmp/ws                       # fp32 and bf16, 10 steps
    python bench/bench_world_sizes.py --work /tmp/ws --precisions fp32 --steps 20

Two parts, on the demo corpus (`--preset tiny --context 64`, 8 blocks per step, one thread per process):
- end to end: train.py at world size 1 and under torchrun at world size 2 (gloo), the same global batch in
  two layouts (the same micro-batch size on both; and world size 2 with half the micro-batch), the relative
  weight difference ||w1 - w2|| / ||w1|| after `--steps` steps;
- where they part: in one process, world size 2's arithmetic replayed beside world size 1's from the same
  weights and batches: each rank's micro-batch gradients summed as that rank does, halved as DDP does
  before its all-reduce, and the two ranks' sums added (gloo's sum of two: a + b). Each stage of step 1
  (the micro-batch losses, the summed gradient, the clipped gradient, the optimizer's update) is compared
  bit for bit, and the replayed world size 2 run is checked against the real one (bitwise equal weights:
  the replay is DDP's arithmetic, not a model of it).
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tinyllm.training import (  # noqa: E402
    distributed,
    optimization,
    train,
)

GLOBAL_BLOCKS = 8
LAYOUTS = {  # name: (world size 1's batch and accumulation, world size 2's)
    "same micro-batch": ((2, 4), (2, 2)),
    "half micro-batch": ((2, 2), (1, 2)),
}


def options(corpus: Path, out: Path, precision: str, steps: int, batch: int, accum: int) -> list[str]:
    return [
        "--data",
        str(corpus),
        "--out",
        str(out),
        "--preset",
        "tiny",
        "--context",
        "64",
        "--batch-size",
        str(batch),
        "--grad-accum",
        str(accum),
        "--target-tokens",
        str(steps * GLOBAL_BLOCKS * 64),
        "--precision",
        precision,
        "--threads",
        "1",
        "--eval-every",
        "0",
        "--save-every",
        "0",
        "--log-every",
        "1",
        "--no-report",
        "--seed",
        "1337",
    ]


def run(args: list[str], world: int) -> None:
    launcher = (
        [sys.executable, "train.py"]
        if world == 1
        else [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}", "train.py"]
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    subprocess.run(launcher + args, cwd=ROOT, env=env, check=True, capture_output=True, text=True)


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    path = max((out / "checkpoints").glob("step-*.pt"))
    return torch.load(path, map_location="cpu", weights_only=True)["model"]


def relative_difference(a: dict, b: dict) -> float:
    difference = sum((a[name].double() - b[name].double()).square().sum() for name in a)
    return math.sqrt(difference / sum(a[name].double().square().sum() for name in a))


def end_to_end(corpus: Path, work: Path, precision: str, steps: int) -> dict[str, float]:
    """Each layout's relative weight difference after `steps` steps."""
    found = {}
    for name, ((batch1, accum1), (batch2, accum2)) in LAYOUTS.items():
        tag = name.replace(" ", "-")
        one, two = work / f"{precision}-{tag}-ws1", work / f"{precision}-{tag}-ws2"
        run(options(corpus, one, precision, steps, batch1, accum1), world=1)
        run(options(corpus, two, precision, steps, batch2, accum2), world=2)
        found[name] = relative_difference(final_weights(one), final_weights(two))
    return found


# ----------------------------------------------------------------------------------------------
# World size 2's arithmetic replayed in one process


def build(corpus: Path, work: Path, precision: str, steps: int) -> train.Training:
    batch, accum = LAYOUTS["same micro-batch"][0]
    settings = train.parse_args(options(corpus, work / f"replay-{precision}", precision, steps, batch, accum))
    info = distributed.DistInfo(rank=0, local_rank=0, world=1, device=torch.device("cpu"))
    return train.build_training(settings, info, corpus=corpus)


def gradients(training: train.Training, batches, share: int) -> list[torch.Tensor]:
    """The gradients of `batches`, each micro-batch's loss divided by `share`, summed as autograd does."""
    training.optimizer.zero_grad(set_to_none=True)
    for batch in batches:
        (training.loss_of(batch) / share).backward()
    return [p.grad.detach().clone() for p in training.model.parameters()]


def replay_step(training: train.Training, step: int, world: int) -> dict[str, list[torch.Tensor]]:
    """One optimizer step as world size `world` (1 or 2) computes it; each stage's tensors."""
    batches = training.data.micro_batches(step, 0, training.device)  # world size 2's rank r reads batches[r::2]
    stages = {"losses": [training.loss_of(batch).detach() for batch in batches]}
    if world == 1:
        summed = gradients(training, batches, len(batches))
    else:  # each rank's loss is divided by its own micro-steps; DDP halves each rank's sum, then adds them
        ranks = [gradients(training, batches[r::2], len(batches) // 2) for r in range(2)]
        summed = [a / 2 + b / 2 for a, b in zip(*ranks)]
    stages["gradient"] = summed
    for parameter, grad in zip(training.model.parameters(), summed):
        parameter.grad = grad.clone()
    before = [p.detach().clone() for p in training.model.parameters()]
    training.optimizer.apply_schedule(training.recipe, step)
    optimization.clip_gradients(training.model.parameters(), training.recipe.grad_clip or math.inf)
    stages["clipped"] = [p.grad.detach().clone() for p in training.model.parameters()]
    for part in training.optimizer.parts.values():
        part.step()
    stages["update"] = [p.detach() - b for p, b in zip(training.model.parameters(), before)]
    stages["weights"] = [p.detach().clone() for p in training.model.parameters()]
    return stages


def parted(a: list[torch.Tensor], b: list[torch.Tensor]) -> tuple[int, float]:
    """How many of the tensors differ at all, and the largest relative difference of one."""
    differing = [
        (x.double() - y.double()).norm().item() / max(x.double().norm().item(), 1e-30)
        for x, y in zip(a, b)
        if not torch.equal(x, y)
    ]
    return len(differing), max(differing, default=0.0)


def where_they_part(corpus: Path, work: Path, precision: str, steps: int) -> tuple[list[str], dict]:
    """Lines: each stage of step 1 compared, the weights' difference per step; and the replayed
    world size 1 and 2 weights after `steps` steps."""
    one, two = build(corpus, work, precision, steps), build(corpus, work, precision, steps)  # the same seed
    assert all(torch.equal(a, b) for a, b in zip(one.model.parameters(), two.model.parameters()))
    lines, growth = [], []
    for step in range(steps):
        first, second = replay_step(one, step, 1), replay_step(two, step, 2)
        if step == 0:
            for stage in first:
                count, largest = parted(first[stage], second[stage])
                lines.append(
                    f"  step 1 {stage:>8}: {count:>2} of {len(first[stage])} tensors differ, "
                    f"largest relative difference {largest:.2e}"
                )
            flipped = {
                name: int((a.sign() != b.sign()).sum())
                for name, a, b in zip(
                    [name for name, _ in one.model.named_parameters()], first["update"], second["update"]
                )
            }
            lines.append(
                "  step 1 elements whose update changed sign: "
                + ", ".join(f"{name} {count}" for name, count in flipped.items() if count)
                if any(flipped.values())
                else "none"
            )
        growth.append(relative_difference(dict(enumerate(first["weights"])), dict(enumerate(second["weights"]))))
    lines.append("  weights apart after each step: " + " ".join(f"{value:.1e}" for value in growth))
    names = [name for name, _ in one.model.named_parameters()]
    shares = {
        name: (a.double() - b.double()).square().sum().item()
        for name, a, b in zip(names, first["weights"], second["weights"])
    }
    total = sum(shares.values()) or 1.0
    top = sorted(shares, key=shares.get, reverse=True)[:3]
    lines.append(
        "  of the squared difference at the end: " + ", ".join(f"{name} {shares[name] / total:.0%}" for name in top)
    )
    return lines, [{name: p.detach() for name, p in replayed.model.state_dict().items()} for replayed in (one, two)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16"])
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    corpus = args.work / "corpus"
    if not corpus.is_dir():
        subprocess.run(
            [sys.executable, "data.py", "--demo", "--out", str(corpus)], cwd=ROOT, check=True, capture_output=True
        )
    for precision in args.precisions:
        print(f"{precision}, {args.steps} steps, global batch {GLOBAL_BLOCKS} x 64 tokens")
        for name, value in end_to_end(corpus, args.work, precision, args.steps).items():
            print(f"  world size 1 vs 2, {name}: relative weight difference {value:.2e}")
        lines, replays = where_they_part(corpus, args.work, precision, args.steps)
        print("\n".join(lines))
        for world, replayed in zip((1, 2), replays):
            real = final_weights(args.work / f"{precision}-same-micro-batch-ws{world}")
            same = all(torch.equal(real[name], replayed[name]) for name in real)
            print(
                f"  the replay against the real world size {world} run: {'bitwise equal' if same else 'differs'}"
                f" ({relative_difference(real, replayed):.2e})"
            )


if __name__ == "__main__":
    main()
