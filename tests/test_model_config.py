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


def test_flops_per_token_is_6n_plus_attention():
    preset = model_config.PRESETS["micro"]
    n = model_config.parameter_count(preset, 1000)
    attention = 12 * preset.layers * preset.heads * preset.head_dim * preset.context
    assert model_config.flops_per_token(preset, 1000) == 6 * n + attention
