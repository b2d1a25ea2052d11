import dataclasses

import pytest

from tinyllm.common import UserError
from tinyllm.model import config as model_config


def test_think72_has_exactly_72m_parameters():
    preset = model_config.PRESETS["think72"]
    assert model_config.parameter_count(preset, 33_069) == 72_000_000
    model = model_config.build_model(preset, 33_069)
    assert sum(p.numel() for p in model.parameters()) == 72_000_000


@pytest.mark.parametrize("name", ["tiny", "nano", "micro"])
@pytest.mark.parametrize("tied", [True, False])
def test_parameter_count_matches_the_built_model(name, tied):
    preset = dataclasses.replace(model_config.PRESETS[name], tie_embeddings=tied)
    model = model_config.build_model(preset, 777)
    assert sum(p.numel() for p in model.parameters()) == model_config.parameter_count(preset, 777)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    other = dataclasses.replace(preset, tie_embeddings=not tied)  # the head's matmul costs the same either way
    assert model_config.flops_per_token(preset, 777) == model_config.flops_per_token(other, 777)


def test_a_recorded_shape_without_a_later_field_reads_it_at_its_default():
    recorded = {
        f"model.{name}": getattr(model_config.PRESETS["tiny"], name)
        for name in model_config.OVERRIDABLE_FIELDS
        if name != "tie_embeddings"
    }
    assert model_config.recorded_preset(recorded).tie_embeddings is True  # what every run meant before the field
    assert model_config.with_recorded_defaults(recorded)["model.tie_embeddings"] is True
    assert (
        model_config.with_recorded_defaults({**recorded, "model.tie_embeddings": False})["model.tie_embeddings"]
        is False
    )


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


def _tiny_pair():
    import torch

    torch.manual_seed(0)
    stock = model_config.build_model(model_config.PRESETS["tiny"], 300)
    fast = model_config.build_model(model_config.PRESETS["tiny"], 300)
    fast.load_state_dict(stock.state_dict())
    model_config.autocast_elementwise(fast)
    return stock, fast


def test_autocast_elementwise_keeps_the_stock_model_without_autocast():
    """fp32 (and every CPU run without --precision) runs the stock forwards: bit for bit the same logits;
    the modules, parameters and state_dict are the stock ones (the export and the GGUF see no change)."""
    import torch

    stock, fast = _tiny_pair()
    norms = [module for module in fast.modules() if type(module).__name__.endswith("RMSNorm")]
    assert len(norms) == 2 * 2 + 2 * 2 + 1 and all(type(module).__name__.startswith("Autocast") for module in norms)
    assert all(isinstance(module, type(stock.model.norm)) for module in norms)
    assert fast.state_dict().keys() == stock.state_dict().keys()
    inputs = torch.randint(0, 300, (2, 16))
    assert torch.equal(fast(input_ids=inputs).logits, stock(input_ids=inputs).logits)
    model_config.autocast_elementwise(fast)  # twice: nothing more
    assert type(fast.model.norm).__mro__[1] is type(stock.model.norm)


def test_under_autocast_norms_and_rope_run_in_the_half_type_as_accurately_as_the_stock_ones():
    """Under bf16 autocast the norms and the RoPE tables come out in bf16 (not fp32), and the loss and
    gradients stay as close to the fp32 ones as the stock model's bf16 ones are (this CPU's own error)."""
    import torch

    stock, fast = _tiny_pair()
    outputs = {}
    fast.model.layers[0].self_attn.q_norm.register_forward_hook(lambda m, i, o: outputs.setdefault("q_norm", o))
    fast.model.layers[0].input_layernorm.register_forward_hook(lambda m, i, o: outputs.setdefault("norm", o))
    fast.model.rotary_emb.register_forward_hook(lambda m, i, o: outputs.setdefault("rope", o))
    inputs = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(1))

    def loss_and_gradients(model, dtype):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = model(input_ids=inputs, labels=inputs).loss
        loss.backward()
        return loss.item(), {name: p.grad.clone() for name, p in model.named_parameters()}

    exact_loss, exact = loss_and_gradients(stock, None)
    stock_loss, stock_half = loss_and_gradients(stock, torch.bfloat16)
    fast_loss, fast_half = loss_and_gradients(fast, torch.bfloat16)
    assert outputs["q_norm"].dtype == outputs["norm"].dtype == torch.bfloat16
    assert outputs["rope"][0].dtype == outputs["rope"][1].dtype == torch.bfloat16
    assert abs(fast_loss - exact_loss) <= 2 * abs(stock_loss - exact_loss) + 1e-3 * abs(exact_loss)
    for name, gradient in exact.items():
        scale = gradient.abs().max().item()
        stock_error = (stock_half[name] - gradient).abs().max().item()
        assert (fast_half[name] - gradient).abs().max().item() <= 2 * stock_error + 1e-2 * scale, name


def test_the_presets_table_gives_each_presets_shape_and_parameters(capsys):
    """`python model_config.py`: a line per preset, its parameters at the vocabulary asked for."""
    lines = model_config.presets_table(33_069).splitlines()
    assert lines[0].startswith("The presets at a vocabulary of 33,069 tokens") and len(lines) == 2 + len(
        model_config.PRESETS
    )
    rows = {line.split()[0]: line.split() for line in lines[2:]}
    assert set(rows) == set(model_config.PRESETS)
    assert rows["think72"][1:3] == ["14", "512"] and rows["think72"][-2:] == ["72,000,000", "72,000,000"]
    tiny = model_config.PRESETS["tiny"]
    assert rows["tiny"][-3:] == [
        "own",
        f"{model_config.parameter_count(tiny, 33_069):,}",
        f"{model_config.matmul_parameters(tiny, 33_069):,}",
    ]
    assert model_config.main(["--vocab-size", "512"]) == 0
    assert "vocabulary of 512 tokens" in capsys.readouterr().out
    with pytest.raises(UserError, match="--vocab-size 0: give a positive number"):
        model_config.main(["--vocab-size", "0"])
