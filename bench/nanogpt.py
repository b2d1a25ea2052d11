"""The baseline a user would pick instead of tinyllm: nanoGPT's GPT-2 trained with torch.optim.Muon.

The model is nanoGPT's `model.py` written compactly (learned positions, pre-LayerNorm blocks, GELU MLP 4x
wide, tied embeddings, N(0, 0.02) init with the residual projections scaled by 1/sqrt(2 x layers), no
biases, no dropout), with q, k and v as three matrices so that Muon orthogonalizes each (as
modded-nanogpt does). The optimizer split is modded-nanogpt's: stock `torch.optim.Muon` (Nesterov,
momentum 0.95, its own shape lr adjustment) on the blocks' matrices, AdamW (betas 0.9/0.95) on the
embeddings (weight decay, as nanoGPT decays every matrix) and the LayerNorm gains (none).

`swap_into(training)` puts it in the place of a train.Training's Qwen3 model and optimizers: the data
order, the schedule (optimization.Recipe's lr multiplier, applied to every group's "peak_lr"), the gradient
clipping and the loss (losses.language_model_loss, which reads `model.model(...)` and `model.lm_head`)
stay train.py's, so the two models see the same tokens in the same order. Document attention is kept:
the blocks take train_data.Batch's positions and block-diagonal mask as the Qwen3 model does.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tinyllm.model import losses  # noqa: E402
from tinyllm.training import (
    optimization,  # noqa: E402
    train,  # noqa: E402
)


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(hidden, bias=False), nn.LayerNorm(hidden, bias=False)
        self.q, self.k, self.v, self.proj = (nn.Linear(hidden, hidden, bias=False) for _ in range(4))
        self.fc, self.fc_proj = nn.Linear(hidden, 4 * hidden, bias=False), nn.Linear(4 * hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        rows, length, hidden = x.shape
        h = self.ln_1(x)
        q, k, v = (part(h).view(rows, length, self.heads, -1).transpose(1, 2) for part in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        x = x + self.proj(y.transpose(1, 2).reshape(rows, length, hidden))
        return x + self.fc_proj(F.gelu(self.fc(self.ln_2(x))))


class Decoder(nn.Module):
    """Token and learned position embeddings, the blocks, the final LayerNorm; called as Qwen3's `.model`."""

    def __init__(self, vocab: int, context: int, hidden: int, layers: int, heads: int):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, hidden), nn.Embedding(context, hidden)
        self.layers = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> SimpleNamespace:
        if position_ids is None:
            position_ids = torch.arange(input_ids.size(1), device=input_ids.device)
        x = self.wte(input_ids) + self.wpe(position_ids)
        for block in self.layers:
            x = block(x, attention_mask)
        return SimpleNamespace(last_hidden_state=self.ln_f(x))


class GPT(nn.Module):
    """nanoGPT's GPT with the attributes losses.language_model_loss reads: `.model`, `.lm_head`, `.config`."""

    def __init__(self, vocab: int, context: int, hidden: int, layers: int, heads: int):
        super().__init__()
        self.config = SimpleNamespace(_attn_implementation="sdpa")  # attention.decoder_inputs: positions + mask
        self.model = Decoder(vocab, context, hidden, layers, heads)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.lm_head.weight = self.model.wte.weight
        for name, param in self.named_parameters():
            if param.ndim == 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(param, 0.0, std)


def build_optimizers(model: GPT, recipe: optimization.Recipe) -> optimization.Optimizers:
    """Stock torch.optim.Muon on the blocks' matrices, AdamW on the rest (recipe: lrs, betas, decay)."""
    blocks = [param for name, param in model.named_parameters() if ".layers." in name and param.ndim == 2]
    embeddings = [model.model.wte.weight, model.model.wpe.weight]
    norms = [param for name, param in model.named_parameters() if param.ndim == 1]
    parts = {
        "muon": torch.optim.Muon(
            blocks, lr=recipe.muon_lr, weight_decay=recipe.weight_decay, momentum=recipe.muon_momentum, nesterov=True
        ),
        "adamw": torch.optim.AdamW(
            [{"params": embeddings, "weight_decay": recipe.weight_decay}, {"params": norms, "weight_decay": 0.0}],
            lr=recipe.lr,
            betas=recipe.betas,
            eps=1e-8,
        ),
    }
    for optimizer in parts.values():
        for group in optimizer.param_groups:
            group["peak_lr"] = group["lr"]
    return optimization.Optimizers(parts)


def swap_into(training: train.Training) -> GPT:
    """Replace `training`'s model and optimizers by nanoGPT's GPT of the same width, depth, heads and context
    (built from the run's seed), trained with build_optimizers under the run's recipe (which must be muon)."""
    if training.recipe.optimizer != "muon":
        raise ValueError("the nanoGPT baseline trains with Muon: give it a muon recipe")
    preset = training.preset
    torch.manual_seed(training.run.seed)
    model = GPT(training.vocab_size, preset.context, preset.hidden, preset.layers, preset.heads).to(training.device)
    training.model = model.train()
    training.forward_model = losses.LanguageModelLoss(model)
    training.recipe = dataclasses.replace(training.recipe, head_lr=None)  # GPT-2 ties its head
    training.optimizer = build_optimizers(model, training.recipe)
    return model
