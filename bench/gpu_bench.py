"""What every part of bench_gpu.py needs (`BenchContext`: the options, the rank, the corpus, the device's
description, the budget) and the corpus of the step parts, built in its own process while the first parts run."""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gpu_plan import DTYPES  # noqa: E402
from gpu_record import NotHere, Recorder  # noqa: E402

from tinyllm.common import UserError  # noqa: E402
from tinyllm.model import config as model_config  # noqa: E402
from tinyllm.model import hardware  # noqa: E402
from tinyllm.training import (  # noqa: E402
    distributed,
    train,
)


class Corpus:
    """The corpus folder of the step parts: --corpus, or the demo corpus that rank 0 starts building at
    once in a separate process (CPU work off the GPU's clock), waited for when a part first needs it."""

    def __init__(self, args: argparse.Namespace, info, work: Path):
        self.info, self.folder, self.process, self.ready = info, Path(args.corpus) if args.corpus else None, None, None
        if self.folder is None and info.is_main:
            self.folder = work / "corpus"
            self.log = work / "corpus.log"
            with open(self.log, "w") as log:
                self.process = subprocess.Popen(
                    [sys.executable, str(ROOT / "data.py"), "--demo", "--out", str(self.folder)],
                    cwd=ROOT,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )

    def path(self) -> Path:
        if self.ready is None:
            self.ready = Path(distributed.main_decides(self.wait, self.info))
        return self.ready

    def wait(self) -> str:
        if self.process is not None and self.process.wait() != 0:
            tail = self.log.read_text()[-600:].strip().replace("\n", " | ")
            raise UserError(f"building the demo corpus failed (exit {self.process.returncode}): {tail}")
        return str(self.folder)

    def close(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()


class BenchContext:
    """What every part needs: the options, the rank, the corpus, the device's description, the budget."""

    def __init__(self, args: argparse.Namespace, info, corpus: Corpus, work: Path, recorder: Recorder):
        self.args, self.info, self.corpus, self.work, self.recorder = args, info, corpus, work, recorder
        self.device = hardware.describe(info.device)
        self.vocab = args.vocab or None
        self.preset = model_config.resolve_preset(args.preset, context=args.context)
        self.precision = hardware.choose_precision("auto", self.device).value
        self.deadline = math.inf

    def time_up(self) -> bool:
        """Whether this part's deadline has passed (rank 0 decides for every rank)."""
        return distributed.broadcast_from_main(time.monotonic() > self.deadline, self.info)

    def options(
        self,
        preset: str,
        precision: str,
        compiled: bool = False,
        batch_size: int = 8,
        grad_accum: int = 1,
        out: Path | None = None,
        extra: list[str] | None = None,
    ):

        argv = [
            "--data",
            str(self.corpus.path()),
            "--out",
            str(out or self.work / "unused"),
            "--device",
            self.args.device,
            "--preset",
            preset,
            "--batch-size",
            str(batch_size),
            "--grad-accum",
            str(grad_accum),
            "--precision",
            precision,
            "--epochs",
            "1000",
            "--warmup-steps",
            "10",
            *(extra or []),
        ]
        if self.args.context:
            argv += ["--context", str(self.args.context)]
        if compiled:
            argv.append("--compile")
        elif "--no-compile" in train.build_parser()._option_string_actions:  # should compile become the default
            argv.append("--no-compile")
        return train.parse_args(argv)

    def build(self, options):

        return train.build_training(options, self.info, self.vocab)

    def synchronize(self) -> None:
        import torch

        if self.info.device.type == "cuda":
            torch.cuda.synchronize(self.info.device)

    def peak_flops(self, precision: str) -> float | None:
        if self.args.peak_tflops:
            return self.args.peak_tflops * 1e12
        tflops = hardware.peak_tflops(self.device, precision)
        return tflops * 1e12 if tflops else None

    def dtype(self, name: str | None = None):
        import torch

        return getattr(torch, DTYPES[name or self.precision])

    def needs_cuda(self, what: str) -> None:
        if not self.device.is_cuda:
            raise NotHere(f"{what} needs CUDA")
