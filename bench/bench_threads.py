"""torch's CPU threads on a busy machine: train steps at torch's default thread count, the same with
OMP_WAIT_POLICY=PASSIVE, and at one thread, alone and beside busy one-thread processes
(docs/TROUBLESHOOTING.md: steps that take seconds on a shared CPU).

    python bench/bench_threads.py --work /tmp/threads                      # tiny, 150 steps, beside 2 busy
    python bench/bench_threads.py --work /tmp/threads --preset nano --steps 40 --busy 0

Each configuration is a child process (the wait policy is read when torch loads) that times `--steps`
train steps of `--preset` at micro-batch `--batch-size` on the demo corpus, built by build_training as
train.py and --budget's probe build it; the table gives each one's time against the default's in the
same load, and the step time --budget's probe takes from those steps (CPU time over the threads, its
window rule) against the same configuration's when no busy process runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tinyllm.data import build as data  # noqa: E402
from tinyllm.data import corpus_format  # noqa: E402
from tinyllm.training import budget  # noqa: E402

BUSY = "import torch\ntorch.set_num_threads(1)\na = torch.randn(256, 256)\nwhile True:\n    a @ a\n"


def time_steps(corpus: str, preset: str, threads: int, batch_size: int, steps: int) -> list[list[float]]:
    """[wall seconds, the probe's seconds] of each train step after one untimed (the child's work); the
    probe's is its CPU time over the threads, at most the wall time (budget.unloaded_step_seconds)."""
    import dataclasses

    import torch

    from tinyllm.training import distributed, train

    torch.set_num_threads(threads)
    settings = train.parse_args(
        [
            "--data",
            corpus,
            "--out",
            os.devnull,
            "--preset",
            preset,
            "--threads",
            str(threads),
            "--batch-size",
            str(batch_size),
            "--grad-accum",
            "1",
            "--target-tokens",
            str(10**9),
        ]
    )
    settings = dataclasses.replace(settings, session=dataclasses.replace(settings.session, compile=False))
    info = distributed.DistInfo(rank=0, local_rank=0, world=1, device=torch.device("cpu"))
    training = train.build_training(settings, info)
    results = [training.train_step() for _ in range(steps + 1)][1:]
    return [[r.seconds, budget.unloaded_step_seconds(r.seconds, r.cpu_seconds, threads)] for r in results]


def probe_seconds(unloaded: list[float], threads: int) -> float:
    """What --budget's probe takes for the step's time from these steps at `threads` threads:
    budget.time_until_steady on them one by one over its window, as the probe times them (out of time at the
    last step)."""
    left = unloaded[::-1]
    return budget.time_until_steady(left.pop, lambda: not left, budget.probe_window("cpu", threads))


def run_child(corpus: Path, args, threads: int, passive: bool) -> list[list[float]]:
    env = (
        {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
        if passive
        else {key: value for key, value in os.environ.items() if key != "OMP_WAIT_POLICY"}
    )
    command = [
        sys.executable,
        __file__,
        "--child",
        str(threads),
        "--corpus",
        str(corpus),
        "--preset",
        args.preset,
        "--steps",
        str(args.steps),
        "--batch-size",
        str(args.batch_size),
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/bench-threads"), help="the demo corpus goes here")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--busy", type=int, default=2, help="busy one-thread processes beside the second round")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--corpus", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(time_steps(args.corpus, args.preset, args.child, args.batch_size, args.steps)))
        return 0

    corpus = args.work / "corpus"
    if not (corpus / corpus_format.CORPUS_MANIFEST).exists():
        data.build_demo_corpus(corpus)
    cores = len(os.sched_getaffinity(0))
    configs = [
        (f"{cores} threads (torch's default)", cores, False),
        (f"{cores} threads, OMP_WAIT_POLICY=PASSIVE", cores, True),
        ("1 thread", 1, False),
    ]
    print(f"{args.preset}, {args.steps} steps of {args.batch_size} blocks, {cores} cores")
    print(
        "| load | threads | seconds | vs default | median step | slowest step | steps over 10x the median | "
        "probe's step | probe / quiet probe |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    quiet_probe = {}
    for load in sorted({0, args.busy}):
        hogs = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(load)]
        try:
            base = None
            for name, threads, passive in configs:
                steps = run_child(corpus, args, threads, passive)
                times = [wall for wall, _ in steps]
                total, median = sum(times), statistics.median(times)
                base = base or total
                probe = probe_seconds([unloaded for _, unloaded in steps], threads)
                quiet = quiet_probe.setdefault(name, probe)
                print(
                    f"| {load} busy | {name} | {total:.2f} | {total / base:.2f}x | {median:.4f} | {max(times):.3f} | "
                    f"{sum(t > 10 * median for t in times)} | {probe:.4f} | {probe / quiet:.2f}x |",
                    flush=True,
                )
        finally:
            for hog in hogs:
                hog.kill()
                hog.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
