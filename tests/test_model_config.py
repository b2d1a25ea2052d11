import pytest

import model_config
from common import UserError


def test_think72_has_exactly_72m_parameters():
    preset = model_config.PRESETS["think72"]
    assert model_config.parameter_count(preset, 33_069) == 72_000_000
    model = model_config.build_model(preset, 33_069)
    assert sum(p.numel() for p in model.parameters()) == 72_000_000


@pytest.mark.parametrize("name", ["tiny", "nano", "micro"])
def test_parameter_count_matches_the_built_model(name):
    preset = model_config.PRESETS[name]
    model = model_config.build_model(preset, 777)
    assert sum(p.numel() for p in model.parameters()) == model_config.parameter_count(preset, 777)


def test_tiny_is_well_under_one_million_at_demo_vocab():
    assert model_config.parameter_count(model_config.PRESETS["tiny"], 2_000) < 500_000


def test_overrides_and_bad_presets():
    preset = model_config.resolve_preset("tiny", layers=3, hidden=None)
    assert preset.layers == 3 and preset.hidden == model_config.PRESETS["tiny"].hidden
    with pytest.raises(UserError, match="unknown preset"):
        model_config.resolve_preset("huge")
    with pytest.raises(UserError, match="multiple of kv_heads"):
        model_config.resolve_preset("tiny", kv_heads=3)


@pytest.mark.parametrize("name, context", [("tiny", 64), ("micro", 48)])
def test_flops_per_token_counts_the_models_matmuls(name, context):
    """flops_per_token against FLOPs counted while the model really runs forward and backward (torch's
    FlopCounterMode counts every matmul; eager attention, so that the score and weighted-sum matmuls are
    counted too). The estimate's 6N also counts the norm weights, 6 FLOPs each, which are no matmul."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    preset = model_config.PRESETS[name]
    vocab_size, batch = 500, 2
    torch.manual_seed(0)
    model = model_config.build_model(preset, vocab_size)
    model.config._attn_implementation = "eager"  # CPU SDPA kernels are not counted by FlopCounterMode
    ids = torch.randint(0, vocab_size, (batch, context))
    counter = FlopCounterMode(display=False)
    with counter:
        model(input_ids=ids, labels=ids).loss.backward()
    counted_per_token = counter.get_total_flops() / (batch * context)
    norm_weights = sum(parameter.numel() for parameter in model.parameters() if parameter.ndim == 1)
    assert model_config.flops_per_token(preset, vocab_size, context) == counted_per_token + 6 * norm_weights
