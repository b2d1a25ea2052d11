"""The training loss: next-token cross-entropy that never holds a batch's full logits.

The LM head and the cross-entropy run a chunk of tokens at a time (hardware.logits_chunk_tokens), in a
custom autograd Function that computes each chunk's gradient in its forward (as Liger's fused linear
cross-entropy does), so the backward needs no logits either. Targets equal to corpus_format.IGNORE_INDEX (a
token the corpus' mask does not count) are skipped. Training, evaluation, the compiled and the DDP
model all go through `language_model_loss`.
"""

from __future__ import annotations

import torch

from tinyllm.data.corpus_format import IGNORE_INDEX
from tinyllm.model import attention, hardware


def language_model_loss(
    model: torch.nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    reduction: str = "mean",
    chunk_tokens: int | None = None,
    documents: attention.Documents | None = None,
    z_loss: float = 0.0,
) -> torch.Tensor:
    """Next-token cross-entropy of `model` on a batch of blocks, never holding the batch's full logits;
    with `documents` (train_data.Batch's), attention and positions stay inside each document (attention.py).

    The decoder gives the hidden states; the LM head and the cross-entropy run `chunk_tokens` tokens at a
    time (hardware.logits_chunk_tokens: 128 MiB of fp32 logits on a card, 8 MiB or more on a CPU), each chunk's
    logits made in the autocast dtype and taken to fp32, as F.cross_entropy(logits.float()) on the whole batch
    would. Targets equal to IGNORE_INDEX are not counted ("mean" divides by the counted ones). With gradients, `z_loss`
    adds z_loss x logsumexp^2 per counted token (PaLM's z-loss: it keeps the logits' normalizer near 1);
    evaluation never adds it."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction {reduction!r}: 'mean' or 'sum'")
    hidden = model.model(input_ids=inputs, **attention.decoder_inputs(model, documents)).last_hidden_state
    hidden, targets = hidden.reshape(-1, hidden.size(-1)), targets.reshape(-1)
    weight = model.lm_head.weight
    device_type = hidden.device.type
    chunk_tokens = chunk_tokens or hardware.logits_chunk_tokens(weight.size(0), device_type, weight.size(1))
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else weight.dtype
    with torch.autocast(device_type, enabled=False):  # the chunks cast for themselves
        if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
            total = ChunkedLinearCrossEntropy.apply(hidden, weight, targets, chunk_tokens, dtype, z_loss)
        else:
            total = linear_cross_entropy_sum(hidden, weight, targets, chunk_tokens, dtype)
    if reduction == "sum":
        return total
    return total / (targets != IGNORE_INDEX).sum()


def cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The summed cross-entropy of the counted targets (evaluation's; training's is cross_entropy_and_gradient_)."""
    return torch.nn.functional.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")


def cross_entropy_and_gradient_(
    logits: torch.Tensor, targets: torch.Tensor, z_loss: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cross_entropy_sum(logits, targets) (plus z_loss x logsumexp^2 per counted row) and its gradient with
    respect to the logits, written over `logits`: softmax minus the one-hot target (with z_loss, plus
    2 z_loss logsumexp softmax), 0 where not counted. One exp over the logits serves both the loss and the
    gradient: on the card, this elementwise work over the chunk's logits is a large share of the step."""
    counted = targets != IGNORE_INDEX
    rows = torch.where(counted, targets, 0)[:, None]
    target_logits = logits.gather(1, rows).squeeze(1)
    maxes = logits.amax(dim=-1)
    exps = logits.sub_(maxes[:, None]).exp_()
    sums = exps.sum(dim=-1)
    logsumexp = maxes + sums.log()
    per_row = logsumexp - target_logits
    scale = counted / sums
    if z_loss:
        per_row = per_row + z_loss * logsumexp.square()
        scale = scale * (1 + 2 * z_loss * logsumexp)
    gradient = exps.mul_(scale[:, None])
    return torch.where(counted, per_row, 0.0).sum(), subtract_one_hot_(gradient, rows, counted)


def subtract_one_hot_(gradient: torch.Tensor, rows: torch.Tensor, counted: torch.Tensor) -> torch.Tensor:
    """`gradient` less 1 at each counted row's target column (rows: (N, 1) targets), returned. Eagerly a
    scatter in place that touches only those N elements; compiled an element-wise select over the row, which
    Inductor fuses into the kernel that makes the gradient (and its cast for the matmuls): a scatter is a
    kernel of its own, and the gradient would then be written in fp32, read back and cast in two more passes
    over the vocabulary (bench/RESULTS.md, "The honest count"). The same arithmetic either way: x + (-1) and
    x - 1 round alike."""
    ones = counted[:, None].to(gradient.dtype)
    if torch.compiler.is_compiling():
        columns = torch.arange(gradient.size(1), device=gradient.device)
        return torch.where(columns == rows, gradient - ones, gradient)
    return gradient.scatter_add_(1, rows, -ones)


def linear_cross_entropy_sum(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_tokens: int, dtype: torch.dtype
) -> torch.Tensor:
    """cross_entropy_sum(hidden @ weight.T, targets), chunk by chunk (evaluation: no gradients)."""
    weight = weight.to(dtype)
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for start in range(0, hidden.size(0), chunk_tokens):
        rows = slice(start, start + chunk_tokens)
        total += cross_entropy_sum((hidden[rows].to(dtype) @ weight.t()).float(), targets[rows])
    return total


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """linear_cross_entropy_sum with its gradients. They are computed in the forward, chunk by chunk, as
    Liger-Kernel's fused linear cross-entropy does: neither pass ever holds more than one chunk's logits,
    and no chunk is computed twice. What is kept for the backward is two gradients the size of the
    hidden states (in their dtype when it is the autocast one, else fp32) and of the LM head (fp32);
    the backward only scales them by the loss's gradient (1/count under "mean", times the loss scale
    under fp16). Each chunk's gradient goes to the matmuls in the autocast dtype unscaled
    (|softmax - one-hot| <= 1, well inside fp16), and is summed over the chunks in fp32."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_tokens, dtype, z_loss=0.0):
        weight_cast = weight.to(dtype)
        # each chunk's hidden gradient is a matmul output in `dtype` already: kept in it when the hidden
        # states come in it (the final norm's output under autocast_elementwise), else in fp32
        grad_hidden = torch.empty(
            hidden.shape, dtype=hidden.dtype if hidden.dtype == dtype else torch.float32, device=hidden.device
        )
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.size(0), chunk_tokens):
            rows = slice(start, start + chunk_tokens)
            chunk, chunk_targets = hidden[rows].to(dtype), targets[rows]
            logits = (chunk @ weight_cast.t()).float()
            loss, grad_logits = cross_entropy_and_gradient_(logits, chunk_targets, z_loss)
            total = total + loss  # not +=: torch 2.11's compile then zeroes every gradient through the loss
            grad_logits = grad_logits.to(dtype)
            grad_hidden[rows] = grad_logits @ weight_cast
            grad_weight += grad_logits.t() @ chunk
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.dtypes = hidden.dtype, weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_total):
        grad_hidden, grad_weight = ctx.saved_tensors
        hidden_dtype, weight_dtype = ctx.dtypes
        return (
            (grad_hidden * grad_total).to(hidden_dtype),
            (grad_weight * grad_total).to(weight_dtype),
            None,
            None,
            None,
            None,
        )


class LanguageModelLoss(torch.nn.Module):
    """The model and its loss as one module: --compile compiles the chunked cross-entropy with the model,
    and DDP wraps both. `chunk_tokens`: the loss's chunk (None: the device's, hardware.logits_chunk_tokens;
    bench/bench_roofline.py counts a card's step on CPU with the card's)."""

    def __init__(self, model: torch.nn.Module, z_loss: float = 0.0, chunk_tokens: int | None = None):
        super().__init__()
        self.model, self.z_loss, self.chunk_tokens = model, z_loss, chunk_tokens

    def forward(
        self,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        reduction: str = "mean",
        documents: attention.Documents | None = None,
    ) -> torch.Tensor:
        return language_model_loss(
            self.model, inputs, targets, reduction, self.chunk_tokens, documents=documents, z_loss=self.z_loss
        )


@torch.no_grad()
def continuation_log_likelihoods(
    model: torch.nn.Module, rows: list[tuple[list[int], int]], device: torch.device, token_budget: int
) -> list[float]:
    """Each row's summed log-probability of its last `n` tokens given the tokens before them, for rows
    (tokens, n) as evaluation.choice_rows makes them: the longest first, in batches of at most
    `token_budget` tokens, padded on the right (causal attention: no real position sees the padding).
    The LM head runs in the autocast dtype and the log-softmax in fp32, as language_model_loss does."""
    order = sorted(range(len(rows)), key=lambda index: -len(rows[index][0]))
    weight = model.lm_head.weight
    dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else weight.dtype
    head = weight.to(dtype).t()  # cast once, not per batch
    sums = [0.0] * len(rows)
    start = 0
    while start < len(order):
        width = max(1, len(rows[order[start]][0]) - 1)
        batch = order[start : start + max(1, token_budget // width)]
        start += len(batch)
        inputs = torch.zeros(len(batch), width, dtype=torch.long)
        picked, targets, owners = [], [], []
        for row, index in enumerate(batch):
            tokens, count = rows[index]
            length = len(tokens) - 1
            count = min(count, length)
            inputs[row, :length] = torch.tensor(tokens[:-1])
            picked.extend(row * width + position for position in range(length - count, length))
            targets.extend(tokens[-count:])
            owners.extend([row] * count)
        hidden = model.model(input_ids=inputs.to(device)).last_hidden_state
        hidden = hidden.reshape(-1, hidden.size(-1))[torch.tensor(picked, device=device)]
        with torch.autocast(device.type, enabled=False):
            logits = (hidden.to(dtype) @ head).float()
        chosen = logits.log_softmax(-1).gather(1, torch.tensor(targets, device=device)[:, None]).squeeze(1)
        totals = torch.zeros(len(batch), dtype=torch.float64, device=device)
        totals.index_add_(0, torch.tensor(owners, device=device), chosen.double())
        for index, total in zip(batch, totals.tolist()):  # one copy to the host per batch, not one per row
            sums[index] = total
    return sums
