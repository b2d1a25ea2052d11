"""Qwen3 model presets, built with transformers' Qwen3Config / Qwen3ForCausalLM.

The vocabulary always comes from the corpus tokenizer (`len(tokenizer)`); a preset fixes
the shape of everything else. `think72` has exactly 72,000,000 parameters at vocab 33,069.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from tinyllm.common import ArgumentParser, UserError, run_main
from tinyllm.data.build import DEFAULT_VOCAB_SIZE


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
    tie_embeddings: bool = True  # the LM head is the input embedding (False: its own matrix, its own lr)


PRESETS: dict[str, Preset] = {
    # For tests and the CPU demo: well under 1M parameters at a demo-sized vocabulary.
    # tiny too: its own LM head and RoPE base 10,000 measured 4% lower bits per byte (docs/recipe.md)
    "tiny": Preset(
        layers=2,
        hidden=64,
        intermediate=192,
        heads=4,
        kv_heads=2,
        head_dim=16,
        context=128,
        rope_theta=10_000.0,
        tie_embeddings=False,
    ),
    # nano: issue 30's round 2 on real text (docs/recipe.md): an LM head of its own, RoPE base 10,000 for its
    # 256-token context, full multi-head attention at about the same matrix parameters; an MLP of 344 (a multiple
    # of 8, as tensor cores want) rather than 8/3 x 128 = 341: its matmuls and SwiGLU ran 19% faster on CPU;
    # 2 heads of 64 rather than 4 of 32: lower bits per byte on both texts and a 6-10% faster step on CPU
    "nano": Preset(
        layers=4,
        hidden=128,
        intermediate=344,
        heads=2,
        kv_heads=2,
        head_dim=64,
        context=256,
        rope_theta=10_000.0,
        tie_embeddings=False,
    ),
    # micro keeps its tied head: an own one led by 1-2.7% up to 0.8M tokens, by less with more, and trailed
    # by 0.7% at 1.9M (docs/recipe.md)
    "micro": Preset(layers=6, hidden=256, intermediate=768, heads=8, kv_heads=4, head_dim=32, context=512),
    "think72": Preset(layers=14, hidden=512, intermediate=1536, heads=8, kv_heads=4, head_dim=128, context=1024),
    "small125": Preset(layers=12, hidden=768, intermediate=3072, heads=12, kv_heads=4, head_dim=64, context=1024),
    "medium350": Preset(layers=24, hidden=1024, intermediate=3072, heads=16, kv_heads=8, head_dim=64, context=1024),
}

# Command-line names of the fields a user may override (--layers 8 --hidden 384 ...).
OVERRIDABLE_FIELDS = [field.name for field in dataclasses.fields(Preset)]
RECORDED_PREFIX = "model."  # a shape field's name in training_settings.json: model.hidden, model.heads, ...


def recorded_shape(preset: Preset) -> dict:
    """A shape as training_settings.json records it: {"model.hidden": 128, ...}."""
    return {RECORDED_PREFIX + name: getattr(preset, name) for name in OVERRIDABLE_FIELDS}


def nonpositive_field(preset: Preset) -> tuple[str, float] | None:
    """(name, value) of the first size that is not a positive finite number (no model has such a shape)."""
    for field in dataclasses.fields(Preset):
        value = getattr(preset, field.name)
        if isinstance(value, bool):
            continue
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


def recorded_preset(training: dict) -> Preset:
    """The shape a run's recorded training settings hold (model.NAME); a field recorded before it existed
    reads at its default (the shape it meant then)."""
    defaults = {
        field.name: field.default for field in dataclasses.fields(Preset) if field.default is not dataclasses.MISSING
    }
    return Preset(**{name: training.get(RECORDED_PREFIX + name, defaults.get(name)) for name in OVERRIDABLE_FIELDS})


def with_recorded_defaults(training: dict) -> dict:
    """A run's recorded training settings with each shape field it lacks at its default (see recorded_preset)."""
    return {**recorded_shape(recorded_preset(training)), **training}


def preset_of(run) -> Preset:
    """The shape a run trains: its --preset with any field it overrides (train.RunSettings' OVERRIDABLE_FIELDS)."""
    return resolve_preset(run.preset, **{name: getattr(run, name) for name in OVERRIDABLE_FIELDS})


def qwen3_config(preset: Preset, vocab_size: int, pad_token_id: int = 0, bos_token_id: int = 1, eos_token_id: int = 2):
    """A transformers Qwen3Config for `preset` (SDPA attention)."""
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
        tie_word_embeddings=preset.tie_embeddings,
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
        config_kwargs = {
            "pad_token_id": special_tokens.get("<pad>", 0),
            "bos_token_id": special_tokens.get("<bos>", 1),
            "eos_token_id": special_tokens.get("<eos>", 2),
            **config_kwargs,
        }
    config = qwen3_config(preset, vocab_size, **config_kwargs)
    return Qwen3ForCausalLM(config)


def build_training_model(
    preset: Preset, vocab_size: int, special_tokens: dict | None, device, activation_checkpointing: bool
):
    """build_model on `device`, in training mode: no KV cache (training never generates), norms and RoPE
    in the autocast dtype (autocast_elementwise), and each layer's activations recomputed in the backward
    with `activation_checkpointing` (--grad-checkpoint)."""
    model = build_model(preset, vocab_size, special_tokens or {}).to(device)
    model.config.use_cache = False
    autocast_elementwise(model)
    if activation_checkpointing:
        enable_activation_checkpointing(model)
    return model.train()


def zero_output_projections(model) -> None:
    """Each layer's attention output and MLP down projection set to zero (--zero-init-output, as modded-nanogpt
    starts them): every layer begins as the identity on the residual stream."""
    import torch

    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()


def enable_activation_checkpointing(model) -> None:
    """--grad-checkpoint: recompute each layer's activations in the backward (non-reentrant)."""
    if hasattr(model, "activation_checkpointing_enable"):  # the name since transformers 5.x
        model.activation_checkpointing_enable({"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def parameter_count(preset: Preset, vocab_size: int) -> int:
    """Parameters of the model (a tied embedding counted once), computed from the shape alone."""
    attention = preset.hidden * preset.head_dim * (2 * preset.heads + 2 * preset.kv_heads)
    mlp = 3 * preset.hidden * preset.intermediate
    norms = 2 * preset.hidden + 2 * preset.head_dim
    embeddings = (1 if preset.tie_embeddings else 2) * vocab_size * preset.hidden
    return preset.layers * (attention + mlp + norms) + embeddings + preset.hidden


def matmul_parameters(preset: Preset, vocab_size: int) -> int:
    """The parameters a token's forward multiplies by: every one but the input embedding (the LM head is the
    embedding's size whether tied or not)."""
    return parameter_count(dataclasses.replace(preset, tie_embeddings=True), vocab_size)


def flops_per_token(preset: Preset, vocab_size: int, context: int | None = None) -> int:
    """Training FLOPs per token: 6N plus the attention term (nanoGPT's estimate_mfu).

    The attention term is 12 * layers * heads * head_dim * context (scores and weighted sum,
    forward and backward); N excludes the embedding lookup but includes the LM head matmul.
    """
    context = context or preset.context
    matmul_params = matmul_parameters(preset, vocab_size)
    attention = 12 * preset.layers * preset.heads * preset.head_dim * context
    return 6 * matmul_params + attention


# ----------------------------------------------------------------------------------------------
# The elementwise work of a training step in the autocast dtype. transformers' Qwen3 computes its RMSNorms
# and RoPE in fp32 whatever the autocast (the norm weights and the RoPE tables are fp32), so under fp16/bf16
# every norm writes fp32 that each of the linears after it casts again, and RoPE runs in fp32: memory
# traffic a card waits on (bench/bench_roofline.py counts it). The weights, the export and the GGUF are
# the same; without autocast (fp32, and the CPU) the stock forwards run unchanged.


def _autocast_dtype(tensor):
    import torch

    device_type = tensor.device.type
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


def _autocast_rms_norm_forward(self, hidden_states):
    """RMSNorm in one fused op (F.rms_norm, fp32 arithmetic inside) whose output is in the autocast dtype:
    an fp32 input (the residual stream) is normalized in fp32 and rounded once, as the linears after it
    would round it; a half input (q/k norm) stays half."""
    import torch
    import torch.nn.functional as F

    dtype = _autocast_dtype(hidden_states)
    if dtype is None:
        return type(self).stock_forward(self, hidden_states)
    with torch.autocast(hidden_states.device.type, enabled=False):  # CUDA autocast runs rms_norm in fp32
        weight = self.weight if hidden_states.dtype == torch.float32 else self.weight.to(hidden_states.dtype)
        return F.rms_norm(hidden_states, (hidden_states.size(-1),), weight, self.variance_epsilon).to(dtype)


def _autocast_rotary_forward(self, x, position_ids):
    """RoPE's cos and sin tables in the autocast dtype (computed in fp32, rounded once), so the rotation of
    the half-precision q and k runs in half precision (as nanochat and modded-nanogpt do)."""
    cos, sin = type(self).stock_forward(self, x, position_ids)
    dtype = _autocast_dtype(x)
    return (cos, sin) if dtype is None else (cos.to(dtype), sin.to(dtype))


_AUTOCAST_CLASSES: dict[type, type] = {}


def autocast_elementwise(model) -> None:
    """Give `model`'s RMSNorms and rotary embedding the forwards above (a subclass of each stock class, so
    the modules, parameters and state_dict stay the stock ones)."""
    forwards = {"RMSNorm": _autocast_rms_norm_forward, "RotaryEmbedding": _autocast_rotary_forward}
    for module in model.modules():
        stock = type(module)
        kind = next((kind for kind in forwards if stock.__name__.endswith(kind)), None)
        if kind is None or hasattr(stock, "stock_forward"):
            continue
        if stock not in _AUTOCAST_CLASSES:
            _AUTOCAST_CLASSES[stock] = type(
                f"Autocast{stock.__name__}", (stock,), {"stock_forward": stock.forward, "forward": forwards[kind]}
            )
        module.__class__ = _AUTOCAST_CLASSES[stock]


# ----------------------------------------------------------------------------------------------
# `python model_config.py`: the presets and their sizes.


def presets_table(vocab_size: int) -> str:
    """One line per preset: its shape, its LM head and its parameters at `vocab_size` (all of them, and the
    ones a token's forward multiplies by: matmul_parameters, what flops_per_token counts)."""
    header = ("preset", "layers", "hidden", "mlp", "heads", "kv", "head_dim", "context", "head", "parameters", "matmul")
    rows = [header] + [
        (
            name,
            *map(str, (p.layers, p.hidden, p.intermediate, p.heads, p.kv_heads, p.head_dim, p.context)),
            "tied" if p.tie_embeddings else "own",
            f"{parameter_count(p, vocab_size):,}",
            f"{matmul_parameters(p, vocab_size):,}",
        )
        for name, p in PRESETS.items()
    ]
    widths = [max(len(row[column]) for row in rows) for column in range(len(header))]
    lines = [
        "  ".join(
            cell.ljust(width) if not column else cell.rjust(width)
            for column, (cell, width) in enumerate(zip(row, widths))
        )
        for row in rows
    ]
    return "\n".join([f"The presets at a vocabulary of {vocab_size:,} tokens (train.py --preset NAME):", *lines])


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(
        description="The model presets (train.py --preset NAME; --layers, --hidden, ... override a field): "
        "their shapes and parameter counts at a vocabulary size."
    )
    parser.add_argument(
        "--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE, help="the corpus' vocabulary (data.py --vocab-size)"
    )
    args = parser.parse_args(argv)
    if args.vocab_size < 1:
        raise UserError(f"--vocab-size {args.vocab_size}: give a positive number of tokens")
    print(presets_table(args.vocab_size))
    return 0


def command() -> None:
    """`python model_config.py` at a clone's root."""
    run_main(main, script=True)
