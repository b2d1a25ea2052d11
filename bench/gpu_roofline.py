"""bench_gpu.py's roofline parts: the rates the roofline assumes, measured (Newton-Schulz per dtype, the
preset's GEMMs, a square matmul, copy and add bandwidth)."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gpu_measure import time_on_device  # noqa: E402
from gpu_plan import THINK72_VOCAB, gemm_shapes  # noqa: E402

from tinyllm.model import hardware  # noqa: E402


class RooflineParts:
    """The parts `newton_schulz`, `roofline:gemm` and `roofline:copy` (of a `BenchContext`)."""

    # -- Newton-Schulz, GEMMs, bandwidth -----------------------------------------------------------

    def newton_schulz(self) -> dict:
        """muon.newton_schulz over every hidden matrix of the preset, per dtype: time and error against fp64."""
        import torch
        from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, DEFAULT_NS_STEPS, EPS

        from tinyllm.training import muon

        coefficients = (DEFAULT_A, DEFAULT_B, DEFAULT_C)
        shapes = hardware.muon_matrix_shapes(self.preset)
        flops = sum(hardware.newton_schulz_flops(*shape) for shape in shapes)
        generator = torch.Generator(device=self.info.device).manual_seed(0)
        grads = [torch.randn(*shape, device=self.info.device, generator=generator) for shape in shapes]
        references = [muon.newton_schulz(grad, torch.float64, coefficients, DEFAULT_NS_STEPS, EPS) for grad in grads]
        result = {
            "preset": self.args.preset,
            "matrices": len(shapes),
            "flops_per_step": flops,
            "train_dtype": hardware.newton_schulz_dtype(
                self.device, hardware.choose_precision("auto", self.device).value
            ),
            "dtypes": {},
        }
        for name in ("fp16", "bf16", "fp32"):
            dtype = self.dtype(name)
            run = lambda dtype=dtype: [  # noqa: E731
                muon.newton_schulz(grad, dtype, coefficients, DEFAULT_NS_STEPS, EPS) for grad in grads
            ]
            seconds = time_on_device(run, self.info.device, self.args.repeats)
            errors = [(out.double() - ref).norm().item() / ref.norm().item() for out, ref in zip(run(), references)]
            result["dtypes"][name] = {
                "ms": 1000 * seconds,
                "tflops": flops / seconds / 1e12,
                "max_relative_error": max(errors),
                "mean_relative_error": statistics.mean(errors),
            }
            self.recorder.partial(result)
        return result

    def gemm(self) -> dict:
        """TFLOP/s of the preset's GEMM shapes at one micro-batch (gemm_shapes, their training layouts) and
        of a square matmul, in the card's auto precision."""
        import torch

        dtype = self.dtype()
        tokens = self.args.gemm_tokens or (8 * self.preset.context if self.device.is_cuda else 64)
        vocab = self.args.vocab or THINK72_VOCAB
        generator = torch.Generator(device=self.info.device).manual_seed(0)
        rand = lambda *shape: torch.randn(*shape, device=self.info.device, generator=generator).to(dtype)  # noqa: E731
        result = {"precision": self.precision, "tokens": tokens, "shapes": []}
        total_flops = total_seconds = 0.0
        for name, m, k, n, count in gemm_shapes(self.preset, vocab, tokens):
            if "forward" in name:  # x @ W^T, W stored (out, in)
                a, b = rand(m, k), rand(n, k).t()
            elif "weight grad" in name:  # grad^T @ x, grad stored (tokens, out)
                a, b = rand(k, m).t(), rand(k, n)
            else:  # grad @ W
                a, b = rand(m, k), rand(k, n)
            seconds = time_on_device(lambda a=a, b=b: torch.mm(a, b), self.info.device, self.args.repeats)
            flops = 2 * m * k * n
            total_flops += flops * count
            total_seconds += seconds * count
            result["shapes"].append(
                {
                    "name": name,
                    "m": m,
                    "k": k,
                    "n": n,
                    "count": count,
                    "ms": 1000 * seconds,
                    "tflops": flops / seconds / 1e12,
                }
            )
            del a, b
        result["weighted_tflops"] = total_flops / total_seconds / 1e12
        result["gemm_ms_per_micro_step"] = 1000 * total_seconds
        size = self.args.matmul_size
        a, b = rand(size, size), rand(size, size)
        result["square_size"] = size
        result["square_tflops"] = (
            2 * size**3 / time_on_device(lambda: torch.mm(a, b), self.info.device, self.args.repeats) / 1e12
        )
        return result

    def copy(self) -> dict:
        """The device's memory bandwidth: a copy (read + write) and an fp16 add (two reads, one write)."""
        import torch

        size = self.args.copy_mib * 2**20
        source = torch.ones(size // 2, dtype=torch.float16, device=self.info.device)
        target = torch.empty_like(source)
        copy_seconds = time_on_device(lambda: target.copy_(source), self.info.device, self.args.repeats)
        other = torch.ones_like(source)
        add_seconds = time_on_device(lambda: torch.add(source, other, out=target), self.info.device, self.args.repeats)
        return {"bytes": size, "copy_gbs": 2 * size / copy_seconds / 1e9, "add_gbs": 3 * size / add_seconds / 1e9}
