"""torch.optim.Muon, orthogonalizing in the card's dtype and splitting that work across DDP ranks.

torch's Muon runs its Newton-Schulz iteration in bf16 everywhere: emulated (slow) below sm_80, and on
CPU its rounding makes a world-size-2 run drift ~1e-3 from the world-size-1 run of the same batch.
`Muon` here keeps torch's update rule (its `_init_group`, momentum and Nesterov, decoupled weight decay,
`_adjust_lr`, and torch's own `_zeropower_via_newtonschulz` for bf16) and changes two things only:

- the dtype of the iteration (hardware.newton_schulz_dtype): fp32 on CPU, fp16 below sm_80 (normalized
  in fp32, iterated in fp16), bf16 from sm_80, where it is bitwise torch.optim.Muon;
- under DDP each rank orthogonalizes its share of the matrices (`newton_schulz_owners`) and broadcasts
  the results. Every rank still updates every momentum buffer from the all-reduced gradients, so the
  optimizer state, and so a checkpoint's `state_dict()`, is whole and torch's on every rank.

A module of its own, imported inside optimization.build_muon: train.py needs no torch.optim.Muon at import,
so on a torch older than 2.9 hardware.check_torch still says so in one line.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz
from torch.optim.optimizer import _to_scalar

import hardware

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "fp64": torch.float64}  # fp64: benches


def newton_schulz(grad: torch.Tensor, dtype: torch.dtype, coefficients: tuple[float, float, float], steps: int,
                  eps: float) -> torch.Tensor:
    """torch.optim.Muon's orthogonalization of `grad` with the iteration in `dtype`.

    bf16 is torch's own function. Any other dtype repeats its iteration line for line, but scales the
    matrix to unit Frobenius norm in fp32 first (fp16's narrow range would lose the small entries of a
    matrix normalized in fp16; fp64 serves as the reference in bench/bench_muon.py)."""
    if dtype == torch.bfloat16:
        return _zeropower_via_newtonschulz(grad, coefficients, steps, eps)
    a, b, c = coefficients
    ortho = grad.to(torch.promote_types(dtype, torch.float32))
    if grad.size(0) > grad.size(1):
        ortho = ortho.T
    ortho = (ortho / ortho.norm().clamp(min=eps)).to(dtype)
    for _ in range(steps):
        gram = ortho @ ortho.T
        gram_update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        ortho = torch.addmm(ortho, gram_update, ortho, beta=a)
    if grad.size(0) > grad.size(1):
        ortho = ortho.T
    return ortho


def newton_schulz_owners(shapes: list[tuple[int, int]], world: int) -> list[int]:
    """The rank that orthogonalizes each matrix: the costliest first, each onto the rank with the least
    work so far (ties: the lower rank; equal matrices in their order). A pure function of the shapes, so
    every rank computes the same assignment."""
    owners = [0] * len(shapes)
    load = [0] * world
    for index in sorted(range(len(shapes)), key=lambda i: -hardware.newton_schulz_flops(*shapes[i])):
        rank = min(range(world), key=lambda r: load[r])
        owners[index] = rank
        load[rank] += hardware.newton_schulz_flops(*shapes[index])
    return owners


class Muon(torch.optim.Muon):
    """torch.optim.Muon with the Newton-Schulz iteration in `ns_dtype` ("fp32", "fp16", "bf16"), split
    across `world` ranks (this one is `rank`; world 1: no collectives). The state and its `state_dict()`
    are torch's."""

    def __init__(self, params, ns_dtype: str = "bf16", rank: int = 0, world: int = 1, **options):
        super().__init__(params, **options)
        self.ns_dtype, self.rank, self.world = ns_dtype, rank, world

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, buffers = [], [], []
            self._init_group(group, params, grads, buffers)
            momentum = group["momentum"]
            updates = []
            for grad, buffer in zip(grads, buffers):  # torch's _single_tensor_muon, on every rank
                buffer.lerp_(grad, 1 - momentum)
                updates.append(grad.lerp(buffer, momentum) if group["nesterov"] else buffer)
            lr, weight_decay = _to_scalar(group["lr"]), group["weight_decay"]
            for param, update in zip(params, self.orthogonalize(updates, group)):
                param.mul_(1 - lr * weight_decay)
                param.add_(update, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], param.shape))
        return loss

    def newton_schulz(self, update: torch.Tensor, group: dict) -> torch.Tensor:
        return newton_schulz(update, DTYPES[self.ns_dtype], group["ns_coefficients"], group["ns_steps"],
                             group["eps"])

    def orthogonalize(self, updates: list[torch.Tensor], group: dict) -> list[torch.Tensor]:
        """Every update orthogonalized. Under DDP each rank first computes its own share, then each owner
        broadcasts its share as one flat tensor (in the iteration's dtype: nothing is rounded on the way)."""
        if self.world == 1:
            return [self.newton_schulz(update, group) for update in updates]
        owners = newton_schulz_owners([tuple(update.shape) for update in updates], self.world)
        mine = [i for i, owner in enumerate(owners) if owner == self.rank]
        own = torch.cat([self.newton_schulz(updates[i], group).flatten() for i in mine]) if mine else None
        results: list[torch.Tensor | None] = [None] * len(updates)
        for rank in range(self.world):
            indices = [i for i, owner in enumerate(owners) if owner == rank]
            if not indices:
                continue
            sizes = [updates[i].numel() for i in indices]
            flat = own if rank == self.rank else torch.empty(sum(sizes), dtype=DTYPES[self.ns_dtype],
                                                             device=updates[0].device)
            dist.broadcast(flat, src=rank)
            for i, piece in zip(indices, flat.split(sizes)):
                results[i] = piece.view(updates[i].shape)
        return results
