"""Qwen3 model presets, built with transformers' Qwen3Config / Qwen3ForCausalLM.

The vocabulary always comes from the corpus tokenizer (`len(tokenizer)`); a preset fixes
the shape of everything else. `think72` has exactly 72,000,000 parameters at vocab 33,069.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass

from common import UserError


@dataclass(frozen=True)
class Preset:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    context: int
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6


PRESETS: dict[str, Preset] = {
    # For tests and the CPU demo: well under 1M parameters at a demo-sized vocabulary.
    "tiny": Preset(layers=2, hidden=64, intermediate=192, heads=4, kv_heads=2, head_dim=16, context=128),
    "nano": Preset(layers=4, hidden=128, intermediate=384, heads=4, kv_heads=2, head_dim=32, context=256),
    "micro": Preset(layers=6, hidden=256, intermediate=768, heads=8, kv_heads=4, head_dim=32, context=512),
    "think72": Preset(layers=14, hidden=512, intermediate=1536, heads=8, kv_heads=4, head_dim=128, context=1024),
    "small125": Preset(layers=12, hidden=768, intermediate=3072, heads=12, kv_heads=4, head_dim=64, context=1024),
    "medium350": Preset(
        layers=24, hidden=1024, intermediate=3072, heads=16, kv_heads=8, head_dim=64, context=1024
    ),
}

# Command-line names of the fields a user may override (--layers 8 --hidden 384 ...).
OVERRIDABLE_FIELDS = [field.name for field in dataclasses.fields(Preset)]


def nonpositive_field(preset: Preset) -> tuple[str, float] | None:
    """(name, value) of the first field that is not a positive finite number (no model has such a shape)."""
    for field in dataclasses.fields(Preset):
        value = getattr(preset, field.name)
        if not (math.isfinite(value) and value > 0):
            return field.name, value
    return None


def resolve_preset(name: str, **overrides) -> Preset:
    """The named preset with any non-None overrides applied."""
    if name not in PRESETS:
        raise UserError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    changes = {key: value for key, value in overrides.items() if value is not None}
    unknown = set(changes) - set(OVERRIDABLE_FIELDS)
    if unknown:
        raise UserError(f"unknown preset field(s): {', '.join(sorted(unknown))}")
    preset = dataclasses.replace(PRESETS[name], **changes)
    bad = nonpositive_field(preset)
    if bad:
        raise UserError(f"{bad[0]} (--{bad[0].replace('_', '-')}) must be positive, got {bad[1]}")
    if preset.context < 2:
        raise UserError(f"context must be at least 2, got {preset.context}")
    if preset.heads % preset.kv_heads:
        raise UserError(f"heads ({preset.heads}) must be a multiple of kv_heads ({preset.kv_heads})")
    return preset


def qwen3_config(preset: Preset, vocab_size: int, pad_token_id: int = 0, bos_token_id: int = 1,
                 eos_token_id: int = 2):
    """A transformers Qwen3Config for `preset` (tied embeddings, SDPA attention)."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=preset.hidden,
        intermediate_size=preset.intermediate,
        num_hidden_layers=preset.layers,
        num_attention_heads=preset.heads,
        num_key_value_heads=preset.kv_heads,
        head_dim=preset.head_dim,
        max_position_embeddings=preset.context,
        rope_theta=preset.rope_theta,
        rms_norm_eps=preset.rms_norm_eps,
        tie_word_embeddings=True,
        attention_bias=False,
        use_cache=True,
        pad_token_id=pad_token_id,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        attn_implementation="sdpa",
    )


def build_model(preset: Preset, vocab_size: int, special_tokens: dict | None = None, **config_kwargs):
    """A freshly initialized Qwen3ForCausalLM (uses the caller's torch RNG state). `special_tokens`:
    a corpus manifest's name -> id map, for the config's pad/bos/eos ids."""
    from transformers import Qwen3ForCausalLM

    if special_tokens is not None:
        config_kwargs = {"pad_token_id": special_tokens.get("<pad>", 0), "bos_token_id": special_tokens.get("<bos>", 1),
                         "eos_token_id": special_tokens.get("<eos>", 2), **config_kwargs}
    config = qwen3_config(preset, vocab_size, **config_kwargs)
    return Qwen3ForCausalLM(config)


def build_training_model(preset: Preset, vocab_size: int, special_tokens: dict | None, device,
                         activation_checkpointing: bool):
    """build_model on `device`, in training mode: no KV cache (training never generates), and each
    layer's activations recomputed in the backward with `activation_checkpointing` (--grad-checkpoint)."""
    model = build_model(preset, vocab_size, special_tokens or {}).to(device)
    model.config.use_cache = False
    if activation_checkpointing:
        enable_activation_checkpointing(model)
    return model.train()


def enable_activation_checkpointing(model) -> None:
    """--grad-checkpoint: recompute each layer's activations in the backward (non-reentrant)."""
    if hasattr(model, "activation_checkpointing_enable"):  # the name since transformers 5.x
        model.activation_checkpointing_enable({"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def parameter_count(preset: Preset, vocab_size: int) -> int:
    """Parameters of the model (tied embedding counted once), computed from the shape alone."""
    attention = preset.hidden * preset.head_dim * (2 * preset.heads + 2 * preset.kv_heads)
    mlp = 3 * preset.hidden * preset.intermediate
    norms = 2 * preset.hidden + 2 * preset.head_dim
    return preset.layers * (attention + mlp + norms) + vocab_size * preset.hidden + preset.hidden


def flops_per_token(preset: Preset, vocab_size: int, context: int | None = None) -> int:
    """Training FLOPs per token: 6N plus the attention term (nanoGPT's estimate_mfu).

    The attention term is 12 * layers * heads * head_dim * context (scores and weighted sum,
    forward and backward); N excludes the embedding lookup but includes the tied LM head matmul.
    """
    context = context or preset.context
    matmul_params = parameter_count(preset, vocab_size)
    attention = 12 * preset.layers * preset.heads * preset.head_dim * context
    return 6 * matmul_params + attention


# ----------------------------------------------------------------------------------------------
# Attention: train.py's own implementations (names registered with transformers' AttentionInterface),
# for shapes and devices where the stock ones fail or are slow; hardware.choose_attention picks one.
# An exported model is switched back to the standard "sdpa", which computes the same thing.


SDPA_CAUSAL = "sdpa_causal"  # transformers' own SDPA attention under train.py's causal mask function
REPEATED_KV = "sdpa_repeated_kv"  # K/V heads repeated to the query heads (no enable_gqa)
CONTIGUOUS = "sdpa_contiguous"  # heads laid out contiguously first (CPU flash kernel)


def sdpa_with_repeated_kv(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                          **kwargs):
    """SDPA with the K/V heads repeated up to the query heads (no enable_gqa), as transformers' "sdpa"
    computes it otherwise; registered with transformers' AttentionInterface."""
    import torch.nn.functional as F
    from transformers.integrations.sdpa_attention import repeat_kv

    groups = getattr(module, "num_key_value_groups", 1)
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    causal = bool(query.shape[2] > 1 and attention_mask is None and causal)
    output = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                            scale=scaling, is_causal=causal)
    return output.transpose(1, 2).contiguous(), None



def sdpa_with_contiguous_heads(module, query, key, value, *args, **kwargs):
    """transformers' "sdpa" with query, key and value laid out (batch, heads, tokens, dim) in memory first.

    Why: the projections give head-transposed views, and PyTorch's CPU flash-attention kernel runs
    slower on those (forward + backward of one `micro` layer: ~20 ms on views, ~17 ms contiguous).
    Eagerly it costs a small copy of V (Q and K come out of RoPE contiguous already); under
    torch.compile the layout is fused into the kernels before it. The result is the same attention.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query.contiguous(), key.contiguous(), value.contiguous(), *args, **kwargs)



def sdpa_as_transformers(module, query, key, value, *args, **kwargs):
    """transformers' own "sdpa" attention, registered under train.py's name so that it gets causal_sdpa_mask."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, *args, **kwargs)



OWN_ATTENTIONS = {REPEATED_KV: sdpa_with_repeated_kv, CONTIGUOUS: sdpa_with_contiguous_heads,
                  SDPA_CAUSAL: sdpa_as_transformers}



def causal_sdpa_mask(**kwargs):
    """transformers' sdpa_mask, except that under torch.compile a causal mask without padding or cache
    offset is left to SDPA's is_causal, as it is eagerly.

    Why: while tracing, transformers cannot tell whether the position ids restart (packed sequences)
    and builds the full mask; SDPA then repeats the K/V heads and its flash kernel computes the whole
    masked upper triangle (compiled `micro` attention: ~120 ms per step against ~95 ms eagerly).
    train.py's compiled model only ever sees whole blocks: no padding, no position ids of its own.
    """
    import torch
    from transformers.masking_utils import sdpa_mask

    plain_causal = (torch.compiler.is_compiling() and kwargs.get("attention_mask") is None
                    and kwargs.get("local_size") is None and not kwargs.get("q_offset")
                    and not kwargs.get("kv_offset") and kwargs["q_length"] == kwargs["kv_length"])
    return None if plain_causal else sdpa_mask(**kwargs)



def document_attention(segments):
    """(position_ids, attention mask) that keep each token inside its document: RoPE positions restart
    at 0 where a document starts, and a boolean (B, 1, C, C) mask lets a token see only the earlier tokens
    of its own document (block-diagonal and causal). `segments` (B, C): each token's document, increasing
    along a row. transformers passes a 4-D mask to the attention as it is, eagerly and under torch.compile;
    SDPA's CPU flash and CUDA memory-efficient kernels take it (flash attention on CUDA does not)."""
    import torch

    index = torch.arange(segments.size(1), device=segments.device).expand_as(segments)
    starts = torch.ones_like(segments, dtype=torch.bool)
    starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
    positions = index - torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    same = segments[:, :, None] == segments[:, None, :]
    causal = torch.ones(segments.size(1), segments.size(1), dtype=torch.bool, device=segments.device).tril()
    return positions, (same & causal)[:, None]


def use_attention(model, name: str) -> None:
    """Switch `model` to one of OWN_ATTENTIONS, with the masks "sdpa" gets (without a registered mask
    function, transformers passes custom attentions no padding mask at all)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, OWN_ATTENTIONS[name])
    AttentionMaskInterface.register(name, causal_sdpa_mask)
    model.set_attn_implementation(name)


def apply_attention_plan(model, plan, probe_step) -> tuple:
    """Make `plan` (hardware.choose_attention's) so on `model`: (a context manager factory every forward
    runs in, what the run uses, a warning or None).

    Every plan goes through one of OWN_ATTENTIONS, so that under torch.compile the causal mask stays
    SDPA's is_causal (causal_sdpa_mask) instead of a dense mask tensor. A fused plan runs inside
    sdpa_kernel(its backends only): `probe_step(context)` (a forward and backward) checks that the
    kernel takes this model, and the math fallback is taken, with the warning, only if not."""
    import contextlib

    from torch.nn.attention import SDPBackend, sdpa_kernel

    use_attention(model, plan.implementation)
    if not plan.fused_only:
        return contextlib.nullcontext, plan.reason, None
    backends = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                "cudnn": SDPBackend.CUDNN_ATTENTION}
    fused = [backends[name] for name in plan.backends]
    try:
        probe_step(lambda: sdpa_kernel(fused))
    except RuntimeError as error:
        use_attention(model, SDPA_CAUSAL)
        return (contextlib.nullcontext, f"math fallback (planned: {plan.reason})",
                f"the planned {plan.reason} does not take this model ({str(error).splitlines()[0][:200]}); "
                "attention uses the slower math kernel")
    finally:
        model.zero_grad(set_to_none=True)
    return (lambda: sdpa_kernel(fused)), plan.reason, None


@contextlib.contextmanager
def exportable(model):
    """The model as transformers loads it anywhere, for the length of an export: KV cache on, the
    standard "sdpa" attention (which computes what OWN_ATTENTIONS do); as it was again afterwards."""
    config = model.config
    use_cache, attention = config.use_cache, config._attn_implementation
    config.use_cache = True
    if attention in OWN_ATTENTIONS:
        model.set_attn_implementation("sdpa")
    try:
        yield model
    finally:
        config.use_cache = use_cache
        if attention in OWN_ATTENTIONS:
            model.set_attn_implementation(attention)
