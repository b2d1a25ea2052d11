"""torch.optim.Muon, orthogonalizing in the card's dtype and splitting that work across DDP ranks.

torch's Muon runs its Newton-Schulz iteration in bf16 everywhere: emulated (slow) below sm_80, and on
CPU its rounding makes a world-size-2 run drift ~1e-3 from the world-size-1 run of the same batch.
`Muon` here keeps torch's update rule (its `_init_group`, momentum and Nesterov, decoupled weight decay,
`_adjust_lr`, and torch's own `_zeropower_via_newtonschulz` for bf16) and changes two things only:

- the dtype of the iteration (hardware.newton_schulz_dtype): fp16 below sm_80 (normalized in fp32, iterated
  in fp16), bf16 from sm_80, where it is bitwise torch.optim.Muon; on CPU fp32, or bf16 in a bf16 run where
  the CPU's bf16 is native;
- under DDP each rank orthogonalizes its share of the matrices (`newton_schulz_owners`) and broadcasts
  each result as soon as it has it (`exchange_order`). Every rank still updates every momentum buffer from
  the all-reduced gradients, so the optimizer state, and so a checkpoint's `state_dict()`, is whole and
  torch's on every rank.

Three options of issue 30 (docs/recipe.md has what each did on real text) change the update itself:
Polar Express's per-iteration coefficients, NorMuon's per-neuron normalization of the orthogonalized
update (its second moments are one more entry per matrix in the state, on every rank), and cautious
weight decay. With all three off the update is torch's.

A module of its own, imported inside optimization.build_muon: train.py needs no torch.optim.Muon at import,
so on a torch older than hardware.MIN_TORCH hardware.check_torch still says so in one line.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz
from torch.optim.optimizer import _to_scalar

from tinyllm.model import hardware

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "fp64": torch.float64}  # fp64: benches

# Polar Express (Amsel et al. 2025, arXiv:2505.16932) as modded-nanogpt and nanochat use it: one (a, b, c) per
# iteration, tuned for a matrix scaled to Frobenius norm 1 / POLAR_EXPRESS_SAFETY.
POLAR_EXPRESS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
POLAR_EXPRESS_SAFETY = 1.02


def newton_schulz(grad: torch.Tensor, dtype: torch.dtype, coefficients: tuple, steps: int, eps: float) -> torch.Tensor:
    """torch.optim.Muon's orthogonalization of `grad` with the iteration in `dtype`; `coefficients` is torch's
    one (a, b, c), or POLAR_EXPRESS (one per iteration, the matrix scaled by POLAR_EXPRESS_SAFETY more).

    bf16 with torch's coefficients is torch's own function. Otherwise the iteration is torch's line for line,
    the matrix scaled to unit Frobenius norm in fp32 first (fp16's narrow range would lose the small entries
    of a matrix normalized in fp16; fp64 serves as the reference in bench/bench_muon.py)."""
    per_step = coefficients == POLAR_EXPRESS
    if dtype == torch.bfloat16 and not per_step:
        return _zeropower_via_newtonschulz(grad, coefficients, steps, eps)
    ortho = grad.to(torch.promote_types(dtype, torch.float32))
    if grad.size(0) > grad.size(1):
        ortho = ortho.T
    scale = POLAR_EXPRESS_SAFETY if per_step else 1.0
    ortho = (ortho / (ortho.norm() * scale).clamp(min=eps)).to(dtype)
    for step in range(steps):
        a, b, c = coefficients[min(step, len(coefficients) - 1)] if per_step else coefficients
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


def normalize_neurons(update: torch.Tensor, second_moment: torch.Tensor, beta2: float) -> torch.Tensor:
    """NorMuon (arXiv:2510.05491, as nanochat writes it): each row of an orthogonalized update (each column
    of a wide matrix) divided by the root of its running mean square, `second_moment` (updated in place),
    then the whole rescaled back to the update's Frobenius norm, so the lr keeps its meaning."""
    dim = -1 if update.size(0) >= update.size(1) else 0
    mean_square = update.float().square().mean(dim=dim, keepdim=True)
    second_moment.lerp_(mean_square, 1 - beta2)
    step_size = second_moment.clamp_min(1e-10).rsqrt()
    new_norm = (mean_square * update.size(dim) * step_size.square()).sum().sqrt()
    return update * (step_size * (update.float().norm() / new_norm.clamp_min(1e-10))).to(update.dtype)


def decay_(param: torch.Tensor, update: torch.Tensor, factor: float, cautious: bool) -> None:
    """Decoupled weight decay, param *= 1 - factor; cautious (arXiv:2510.12402): only the entries the update
    (subtracted from param) also moves toward zero, where update and param share their sign."""
    if not cautious:
        param.mul_(1 - factor)
    elif factor:
        param.sub_(param * ((update * param) >= 0), alpha=factor)


class Muon(torch.optim.Muon):
    """torch.optim.Muon with the Newton-Schulz iteration in `ns_dtype` ("fp32", "fp16", "bf16"), split
    across `world` ranks (this one is `rank`; world 1: no collectives). Options beyond torch's: Polar
    Express's coefficients, NorMuon's per-neuron normalization (`normuon_beta2` > 0; its second moments
    are state, in `state_dict()`) and cautious weight decay; without them the state is torch's."""

    def __init__(
        self,
        params,
        ns_dtype: str = "bf16",
        rank: int = 0,
        world: int = 1,
        coefficients: str = "torch",
        normuon_beta2: float = 0.0,
        cautious_weight_decay: bool = False,
        **options,
    ):
        if coefficients == "polar-express":
            options["ns_coefficients"], options["ns_steps"] = POLAR_EXPRESS[0], len(POLAR_EXPRESS)
        super().__init__(params, **options)
        self.ns_dtype, self.rank, self.world = ns_dtype, rank, world
        self.polar_express = coefficients == "polar-express"
        self.normuon_beta2, self.cautious = normuon_beta2, cautious_weight_decay

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
                if self.normuon_beta2:
                    update = normalize_neurons(update, self.second_moment(param, update), self.normuon_beta2)
                decay_(param, update, lr * weight_decay, self.cautious)
                param.add_(update, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], param.shape))
        return loss

    def second_moment(self, param: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
        """NorMuon's running mean square of each neuron's update (a row of a tall matrix, a column of a wide one)."""
        state = self.state[param]
        if "second_moment" not in state:
            shape = (param.size(0), 1) if param.size(0) >= param.size(1) else (1, param.size(1))
            state["second_moment"] = torch.zeros(shape, dtype=torch.float32, device=param.device)
        return state["second_moment"]

    def newton_schulz(self, update: torch.Tensor, group: dict) -> torch.Tensor:
        coefficients = POLAR_EXPRESS if self.polar_express else group["ns_coefficients"]
        return newton_schulz(update, DTYPES[self.ns_dtype], coefficients, group["ns_steps"], group["eps"])

    def orthogonalize(self, updates: list[torch.Tensor], group: dict) -> list[torch.Tensor]:
        """Every update orthogonalized. Under DDP each rank computes its own share, and each matrix goes to the
        other ranks as soon as its owner has it (an asynchronous broadcast, in the iteration's dtype: nothing is
        rounded on the way), in exchange_order, the same on every rank: on a card the transfers run while the
        Newton-Schulz iterations of the next matrices go on, so the step waits for the last matrix's only
        (hardware.predict_step)."""
        if self.world == 1:
            return [self.newton_schulz(update, group) for update in updates]
        owners = newton_schulz_owners([tuple(update.shape) for update in updates], self.world)
        results: list[torch.Tensor | None] = [None] * len(updates)
        transfers = []
        for index in exchange_order(owners, self.world):
            update = updates[index]
            if owners[index] == self.rank:
                result = self.newton_schulz(update, group).contiguous()
            else:
                result = torch.empty(update.shape, dtype=DTYPES[self.ns_dtype], device=update.device)
            transfers.append(dist.broadcast(result, src=owners[index], async_op=True))
            results[index] = result
        for transfer in transfers:
            transfer.wait()
        return results


def exchange_order(owners: list[int], world: int) -> list[int]:
    """The order the ranks broadcast their orthogonalized matrices in: the ranks' shares interleaved (each
    rank's first, then each rank's second, ...), so that every rank's iterations and the transfers go on
    together. A pure function of the owners: every rank issues the same collectives in the same order."""
    shares = [[index for index, owner in enumerate(owners) if owner == rank] for rank in range(world)]
    return [share[turn] for turn in range(max(map(len, shares), default=0)) for share in shares if turn < len(share)]
