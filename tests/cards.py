"""The cards the per-device rules are table-tested on, faked as data (no GPU needed): name, compute
capability and memory as torch.cuda.get_device_properties reports them."""

from __future__ import annotations

from tinyllm.model import hardware

GIB = 1024**3
P100 = hardware.Device("cuda", "Tesla P100-PCIE-16GB", (6, 0), 16 * GIB)
V100 = hardware.Device("cuda", "Tesla V100-SXM2-16GB", (7, 0), 16 * GIB)
T4 = hardware.Device("cuda", "Tesla T4", (7, 5), 15 * GIB, count=2)
A10 = hardware.Device("cuda", "NVIDIA A10G", (8, 6), 22 * GIB)
L4 = hardware.Device("cuda", "NVIDIA L4", (8, 9), 22 * GIB)
A100 = hardware.Device("cuda", "NVIDIA A100-SXM4-80GB", (8, 0), 80 * GIB)
H100 = hardware.Device("cuda", "NVIDIA H100 80GB HBM3", (9, 0), 80 * GIB)
H200 = hardware.Device("cuda", "NVIDIA H200", (9, 0), 140 * GIB)
CPU = hardware.CPU
CPU_BF16 = hardware.CPU_BF16  # avx512_bf16 or AMX
CARDS = [P100, V100, T4, A10, L4, A100, H100, H200]


def this_cpu() -> hardware.Device:
    """The CPU the tests run on, as train.py describes it (with or without bf16 instructions)."""
    import torch

    return hardware.describe(torch.device("cpu"))


def this_cpu_precision() -> str:
    """What --precision auto gives on the CPU the tests run on: bf16 with bf16 instructions, else fp32."""
    return hardware.choose_precision("auto", this_cpu()).value
