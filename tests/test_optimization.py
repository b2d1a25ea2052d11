"""optimization.py: the optimizer table, the recipe and its schedule, the recorded recipe on resume, building
the optimizers, their group lrs, clipping's neighbour the loss scaler (clip_gradients: tests/test_core.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tinyllm.common import UserError
from tinyllm.model import config as model_config
from tinyllm.model import hardware
from tinyllm.store import checkpoint_store as store
from tinyllm.training import optimization


def recipe(**fields) -> optimization.Recipe:
    base = dict(
        optimizer="muon",
        lr=1.0,
        muon_lr=0.02,
        schedule="wsd",
        warmup_steps=4,
        decay_steps=8,
        final_lr_fraction=0.0,
        total_steps=20,
        weight_decay=0.1,
        betas=(0.9, 0.95),
        muon_momentum=0.95,
        grad_clip=1.0,
    )
    return optimization.Recipe(**{**base, **fields})


def tiny_model(tied: bool = False) -> torch.nn.Module:
    """`tiny` (its own LM head), or with the head tied to the embedding table (`micro` and larger are)."""
    return model_config.build_model(dataclasses.replace(model_config.PRESETS["tiny"], tie_embeddings=tied), 300)


# ----------------------------------------------------------------------------------------------
# The schedule and the rules that choose the recipe


@pytest.mark.parametrize(
    "schedule, final, expected",
    [
        # warmup 4 steps (0-based step s trains at (s+1)/4), then wsd: flat until step 12, linear to `final` at 20
        ("wsd", 0.0, {0: 0.25, 3: 1.0, 4: 1.0, 11: 1.0, 12: 1.0, 14: 0.75, 16: 0.5, 19: 0.125, 20: 0.0, 99: 0.0}),
        ("wsd", 0.1, {0: 0.25, 11: 1.0, 16: 0.55, 20: 0.1}),
        # cosine over all 16 steps after warmup: half way (step 12) at the mean of 1 and the final fraction
        ("cosine", 0.1, {0: 0.25, 3: 1.0, 4: 1.0, 12: 0.55, 20: 0.1, 99: 0.1}),
    ],
)
def test_schedule_table(schedule, final, expected):
    chosen = recipe(schedule=schedule, decay_steps=16 if schedule == "cosine" else 8, final_lr_fraction=final)
    assert {step: pytest.approx(chosen.lr_multiplier(step)) for step in expected} == expected
    assert all(chosen.lr_multiplier(s) >= chosen.lr_multiplier(s + 1) for s in range(4, 25))


@pytest.mark.parametrize(
    "name, hidden, lr",
    [
        # adamw, every parameter: 1e-3 at width 256, ~1/width, at most 1e-2
        ("adamw", 64, 4e-3),
        ("adamw", 128, 2e-3),
        ("adamw", 256, 1e-3),
        ("adamw", 512, 5e-4),
        ("adamw", 768, 1e-3 / 3),
        ("adamw", 1024, 2.5e-4),
        ("adamw", 384, 1e-3 * 256 / 384),
        ("adamw", 16, 1e-2),
        # muon's AdamW, embeddings and norms: 0.05 at width 128, ~1/sqrt(width), at most 0.1
        ("muon", 128, 0.05),
        ("muon", 512, 0.025),
        ("muon", 64, 0.05 * 2**0.5),
        ("muon", 32, 0.1),
        ("muon", 8, 0.1),
    ],
)
def test_adamw_lr_rule_by_width(name, hidden, lr):
    assert optimization.OPTIMIZERS[name].adamw_lr.at(hidden) == pytest.approx(lr)


@pytest.mark.parametrize(
    "given, hidden, steps, expected",
    [
        # nothing given: Muon at 0.02, AdamW by width, warmup 2% (muon) / 5% (adamw) of the run, wsd decaying 40%
        ({}, 128, 1500, dict(optimizer="muon", muon_lr=0.02, lr=0.05, warmup_steps=30, decay_steps=600)),
        ({"optimizer": "adamw"}, 512, 1500, dict(optimizer="adamw", muon_lr=None, lr=5e-4, warmup_steps=75)),
        ({}, 64, 10, dict(warmup_steps=1, decay_steps=4)),  # at least one warmup step
        ({}, 768, 1_000_000, dict(warmup_steps=1000)),  # at most 1,000
        ({"schedule": "cosine"}, 128, 100, dict(schedule="cosine", warmup_steps=2, decay_steps=98)),
        (
            dict(lr=1e-3, muon_lr=0.05, warmup_steps=7, decay_fraction=0.5, final_lr_fraction=0.1, beta2=0.99),
            128,
            100,
            dict(lr=1e-3, muon_lr=0.05, warmup_steps=7, decay_steps=50, final_lr_fraction=0.1),
        ),
    ],
)
def test_recipe_rule_table(given, hidden, steps, expected):
    chosen, reasons = optimization.choose_recipe(optimization.RecipeOptions(**given), hidden, steps)
    assert {key: getattr(chosen, key) for key in expected} == pytest.approx(expected)
    assert chosen.total_steps == steps and not chosen.adam8bit
    beta1 = 0.9 if chosen.optimizer == "adamw" else 0.6  # AdamW for everything / beside Muon (docs/recipe.md)
    assert chosen.betas == ((beta1, 0.99) if "beta2" in given else (beta1, optimization.DEFAULT_BETA2))
    assert chosen.muon_momentum == (None if chosen.optimizer == "adamw" else 0.9)
    assert len(reasons) == sum(option not in given for option in ("lr", "muon_lr", "warmup_steps")) - (
        chosen.optimizer == "adamw"
    )  # a reason for each value the rules chose


def test_a_knob_is_its_option_and_shows_in_the_description_when_set():
    chosen, _ = optimization.choose_recipe(optimization.RecipeOptions(optimizer="adamw", adam8bit=True), 128, 100)
    assert chosen.adam8bit and chosen.describe().endswith("grad clip 1, adam8bit True")
    assert recipe().describe().endswith("grad clip 1")  # a knob at its default is not mentioned
    untied, _ = optimization.choose_recipe(optimization.RecipeOptions(normuon_beta2=0.95), 128, 100, tied=False)
    described = untied.describe()  # the head's lr is named once, with the rates, not again as a knob
    assert "0.01 the untied LM head" in described and described.endswith("grad clip 1, normuon_beta2 0.95")


def test_a_warmup_of_zero_steps_starts_at_the_peak():
    assert recipe(warmup_steps=0).lr_multiplier(0) == 1.0


def test_recipe_warnings():
    assert optimization.recipe_warnings(recipe(warmup_steps=12, total_steps=20)) == [
        "12 of the run's 20 steps are warmup: most of the run trains below the peak learning rate; pass fewer "
        "--warmup-steps or train longer"
    ]
    assert optimization.recipe_warnings(recipe(warmup_steps=10, total_steps=20)) == []


@pytest.mark.parametrize(
    "given, message",
    [
        ({"optimizer": "adamw", "muon_lr": 0.02}, "--muon-lr needs --optimizer muon: it is Muon's"),
        ({"optimizer": "adamw", "muon_momentum": 0.95}, "--muon-momentum needs --optimizer muon: it is Muon's"),
        ({"adam8bit": True}, "--8bit-adam needs --optimizer adamw: under muon, AdamW only trains the embeddings"),
        ({"optimizer": "muon", "adam8bit": True}, "--8bit-adam needs --optimizer adamw"),
        ({"schedule": "cosine", "decay_fraction": 0.2}, "--decay-fraction belongs to --schedule wsd"),
        ({"optimizer": "adamw", "adam8bit": True}, None),
        ({"muon_lr": 0.01}, None),
    ],
)
def test_an_option_of_another_optimizer_is_one_error(given, message):
    options = optimization.RecipeOptions(**given)
    if message is None:
        optimization.check_recipe_options(options)
        return
    with pytest.raises(UserError, match=f"^{message}"):
        optimization.check_recipe_options(options)


# ----------------------------------------------------------------------------------------------
# The recorded recipe on resume: an added knob reads at its default, a changed value still refuses


def recorded(options: optimization.RecipeOptions) -> dict:
    """A run's recorded training settings as far as the recipe goes: its options and its resolved recipe."""
    chosen, _ = optimization.choose_recipe(options, 128, 100)
    return {**dataclasses.asdict(options), **chosen.recorded()}


def without(settings: dict, *keys: str) -> dict:
    return {key: value for key, value in settings.items() if key not in keys}


BEFORE_THE_KNOB = ("adam8bit", "recipe.adam8bit")  # what a run recorded before --8bit-adam was a recipe knob
ADAMW = optimization.RecipeOptions(optimizer="adamw")


@pytest.mark.parametrize(
    "old, new, refused",
    [
        (without(recorded(ADAMW), *BEFORE_THE_KNOB), ADAMW, []),  # an added knob at its default: the same run
        (recorded(ADAMW), ADAMW, []),
        (
            without(recorded(ADAMW), *BEFORE_THE_KNOB),
            dataclasses.replace(ADAMW, adam8bit=True),
            ["adam8bit", "recipe.adam8bit"],
        ),  # the knob set where the checkpoint ran without it
        (recorded(dataclasses.replace(ADAMW, adam8bit=True)), ADAMW, ["adam8bit", "recipe.adam8bit"]),
        (recorded(ADAMW), dataclasses.replace(ADAMW, lr=3e-3), ["lr", "recipe.lr"]),  # the rule gave 2e-3
        (without(recorded(ADAMW), "recipe.lr"), ADAMW, ["recipe.lr"]),  # not a knob: missing is a difference
    ],
)
def test_recorded_recipe_table(old, new, refused):
    filled = optimization.with_recorded_defaults(old)
    assert sorted(store.resume_verdict(filled, recorded(new)).others) == refused
    if "recipe.lr" in old:
        assert optimization.Recipe.from_recorded(old) == optimization.Recipe.from_recorded(filled)


def test_a_recorded_recipe_reads_back_and_a_missing_field_is_refused():
    chosen, _ = optimization.choose_recipe(ADAMW, 128, 100)
    assert optimization.Recipe.from_recorded(chosen.recorded()) == chosen
    assert optimization.Recipe.from_recorded(without(chosen.recorded(), "recipe.adam8bit")) == chosen
    assert chosen.recorded()["recipe.betas"] == [0.9, optimization.DEFAULT_BETA2]  # as JSON has it
    with pytest.raises(TypeError):
        optimization.Recipe.from_recorded(without(chosen.recorded(), "recipe.lr"))


@pytest.mark.parametrize(
    "old, new, step, problem",
    [
        # recipe(): 20 steps, warmup 4, decay over the last 8 (from step 12)
        (recipe(), recipe(total_steps=40, decay_steps=16), 12, None),  # at the decay's start: nothing decayed yet
        (recipe(), recipe(total_steps=40, decay_steps=16), 0, None),
        (recipe(), recipe(total_steps=16, decay_steps=4), 12, None),  # shorter, the decay still ahead
        (recipe(), recipe(total_steps=40, decay_steps=16), 13, "its decay began at step 12 and it is at step 13"),
        (recipe(), recipe(total_steps=14, decay_steps=6), 10, "the new length's decay would start at step 8, before"),
        (recipe(), recipe(total_steps=40, decay_steps=16, warmup_steps=8), 10, "the warmup would change from 4 to 8"),
        (
            recipe(schedule="cosine", decay_steps=16),
            recipe(schedule="cosine", total_steps=40, decay_steps=36),
            2,
            "its schedule is cosine, whose decay spans the whole run",
        ),
    ],
)
def test_extension_rule_table(old, new, step, problem):
    got = optimization.extension_problem(old, new, step)
    assert got == problem if problem is None else got.startswith(problem)
    if problem is None:  # sound: every step taken keeps its rate
        assert [old.lr_multiplier(s) for s in range(step)] == [new.lr_multiplier(s) for s in range(step)]


# ----------------------------------------------------------------------------------------------
# Building the optimizers: which parameters each takes, its state per parameter, its group lrs


def test_muon_trains_the_hidden_matrices_and_adamw_the_rest_undecayed():
    model = tiny_model(tied=True)
    names = {id(param): name for name, param in model.named_parameters()}
    hidden, rest, head = optimization.hidden_matrices(model)
    assert head == []  # tied: the LM head is the embedding
    projections = [
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
    ]
    assert sorted(names[id(p)] for p in hidden) == sorted(
        f"model.layers.{layer}.{projection}.weight" for layer in range(2) for projection in projections
    )
    assert sorted(names[id(p)] for p in rest) == sorted(  # the tied embedding is the LM head too
        ["model.embed_tokens.weight", "model.norm.weight"]
        + [
            f"model.layers.{layer}.{norm}.weight"
            for layer in range(2)
            for norm in ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm")
        ]
    )
    muon = optimization.build_optimizers(model, recipe(lr=0.004, muon_lr=0.03), torch.device("cpu"))
    assert isinstance(muon.parts["muon"], torch.optim.Muon) and set(muon.parts) == {"muon", "adamw"}
    assert [(g["lr"], g["weight_decay"], len(g["params"])) for g in muon.parts["muon"].param_groups] == [
        (0.03, 0.1, 14)
    ]
    assert [(g["lr"], g["weight_decay"], len(g["params"])) for g in muon.parts["adamw"].param_groups] == [
        (0.004, 0.0, 10)
    ]
    assert muon.apply_schedule(recipe(lr=0.004, muon_lr=0.03), 1) == {"muon": 0.015, "adamw": 0.002}  # warmup 2/4
    assert [g["lr"] for part in muon.parts.values() for g in part.param_groups] == [0.015, 0.002]
    adamw = optimization.build_optimizers(model, recipe(optimizer="adamw", lr=0.004, muon_lr=None), torch.device("cpu"))
    assert list(adamw.parts) == ["adamw"] and [
        (g["weight_decay"], len(g["params"])) for g in adamw.parts["adamw"].param_groups
    ] == [(0.1, 14), (0.0, 10)]
    assert adamw.apply_schedule(recipe(optimizer="adamw", lr=0.004, muon_lr=None), 3) == {"adamw": 0.004}
    with pytest.raises(UserError, match="the checkpoint's optimizer holds adamw, this run uses adamw, muon"):
        muon.load_state_dict(adamw.state_dict())


def test_an_untied_head_is_its_own_adamw_group_at_the_head_lr():
    model = tiny_model()
    hidden, rest, head = optimization.hidden_matrices(model)
    assert head == [model.lm_head.weight] and head[0] is not model.model.embed_tokens.weight
    assert len(hidden) == 14 and len(rest) == 10
    muon = optimization.build_optimizers(model, recipe(lr=0.004, head_lr=0.001), torch.device("cpu"))
    assert [(g["lr"], g["weight_decay"], len(g["params"])) for g in muon.parts["adamw"].param_groups] == [
        (0.004, 0.0, 10),
        (0.001, 0.0, 1),
    ]
    assert muon.apply_schedule(recipe(lr=0.004, head_lr=0.001), 1) == {"muon": 0.01, "adamw": 0.002, "head": 0.0005}
    adamw = optimization.build_optimizers(model, recipe(optimizer="adamw", lr=0.004, muon_lr=None), torch.device("cpu"))
    assert [(g["lr"], len(g["params"])) for g in adamw.parts["adamw"].param_groups] == [(0.004, 14), (0.004, 11)]


def test_an_untied_head_without_its_lr_is_refused():
    """A recipe chosen for a tied model (no head lr) on a model with its own head: a clear error, not a None lr."""
    with pytest.raises(ValueError, match="untied LM head"):
        optimization.build_optimizers(tiny_model(), recipe(lr=0.004), torch.device("cpu"))


@pytest.mark.parametrize(
    "given, tied, head_lr, problem",
    [
        ({}, True, None, None),  # tied: no head of its own
        ({}, False, 0.01, None),  # the rule: 0.01 at width 128 (nanochat's unembedding rule lands there too)
        ({"head_lr": 0.003}, False, 0.003, None),
        ({"optimizer": "adamw"}, False, None, None),  # under adamw the head trains at --lr
        ({"head_lr": 0.003}, True, None, "--head-lr is the lr of an untied LM head: add --no-tie-embeddings"),
        ({"head_lr": 0.003, "optimizer": "adamw"}, False, None, "--head-lr needs --optimizer muon"),
    ],
)
def test_head_lr_rule_table(given, tied, head_lr, problem):
    options = optimization.RecipeOptions(**given)
    if problem:
        with pytest.raises(UserError, match=problem):
            optimization.check_recipe_options(options)
            optimization.choose_recipe(options, 128, 100, tied)
        return
    chosen, reasons = optimization.choose_recipe(options, 128, 100, tied)
    assert chosen.head_lr == head_lr
    assert any("untied LM head lr" in reason for reason in reasons) == (
        not tied and "head_lr" not in given and head_lr is not None
    )
    assert ("the untied LM head" in chosen.describe()) == (head_lr is not None)


def state_bytes_per_parameter(optimizers: optimization.Optimizers, parameters: list) -> set[float]:
    """The optimizer state each of `parameters` holds, in bytes per element (its per-element tensors only)."""
    state = {id(param): entry for part in optimizers.parts.values() for param, entry in part.state.items()}
    return {
        sum(
            value.nbytes for value in state[id(param)].values() if torch.is_tensor(value) and value.shape == param.shape
        )
        / param.numel()
        for param in parameters
    }


@pytest.mark.parametrize("name", list(optimization.OPTIMIZERS))
def test_each_optimizers_memory_rule_is_the_state_it_keeps(name):
    """hardware.step_memory's bytes per parameter (the table's `state`) are what one step leaves behind."""
    model = tiny_model()
    chosen, _ = optimization.choose_recipe(optimization.RecipeOptions(optimizer=name), 64, 10, tied=False)
    optimizers = optimization.build_optimizers(model, chosen, torch.device("cpu"))
    for param in model.parameters():
        param.grad = torch.ones_like(param)
    for part in optimizers.parts.values():
        part.step()
    hidden, rest, head = optimization.hidden_matrices(model)
    rule = optimization.OPTIMIZERS[name]
    assert state_bytes_per_parameter(optimizers, hidden) == {rule.state.hidden}
    assert state_bytes_per_parameter(optimizers, rest + head) == {rule.state.rest}  # an untied head: as the rest
    assert isinstance(rule.state, hardware.OptimizerState)


def test_group_names_outlive_a_checkpoints_param_groups():
    """A group's name is the Optimizers', not only its param group's: a checkpoint's groups replace them."""
    weight = torch.nn.Parameter(torch.ones(2))

    def optimizers(group: dict) -> optimization.Optimizers:
        sgd = torch.optim.SGD([{**group, "params": [weight]}], lr=0.1)
        sgd.param_groups[0]["peak_lr"] = 0.1
        return optimization.Optimizers({"sgd": sgd})

    named, unnamed = optimizers({"name": "matrices"}), optimizers({})
    assert unnamed.apply_schedule(recipe(), 4) == {"sgd": 0.1}  # a group without a name: its part's
    named.load_state_dict(unnamed.state_dict())
    assert "name" not in named.parts["sgd"].param_groups[0]
    assert named.apply_schedule(recipe(), 1) == {"matrices": 0.05}


def test_loss_scaler_counts_and_skips_overflow_steps():
    """The fp16 path's bookkeeping (GradScaler runs on CPU too): an inf gradient skips the step of every
    optimizer, also of one whose own gradients are finite (Muon's beside AdamW's)."""
    first, second = torch.nn.Linear(2, 1), torch.nn.Linear(1, 1)
    optimizers = [torch.optim.AdamW(first.parameters(), lr=0.1), torch.optim.SGD(second.parameters(), lr=0.1)]
    scaler = optimization.LossScaler(torch.device("cpu"), enabled=True)
    before = [first.weight.detach().clone(), second.weight.detach().clone()]

    def backward(inputs: torch.Tensor) -> bool:
        for optimizer in optimizers:
            optimizer.zero_grad()
        scaler.scale(second(torch.ones(1, 1)).sum() + first(inputs).sum()).backward()
        scaler.unscale_(optimizers)
        return all(torch.isfinite(p.grad).all() for p in [*first.parameters(), *second.parameters()])

    finite = backward(torch.tensor([[1.0, float("inf")]]))  # only the first layer's gradients overflow
    assert not finite and scaler.step(optimizers, finite) is False
    assert torch.equal(first.weight, before[0]) and torch.equal(second.weight, before[1])
    assert scaler.skipped_total == scaler.skipped_in_a_row == 1 and scaler.scaler.get_scale() == 2.0**15
    finite = backward(torch.ones(1, 2))
    assert finite and scaler.step(optimizers, finite) is True
    assert not torch.equal(first.weight, before[0]) and not torch.equal(second.weight, before[1])
    assert scaler.skipped_total == 1 and scaler.skipped_in_a_row == 0
    restored = optimization.LossScaler(torch.device("cpu"), enabled=True)
    restored.load_state_dict(scaler.state_dict())
    assert restored.state_dict() == scaler.state_dict()


@pytest.mark.parametrize(
    "warmup, cooldown, expected",
    [
        (0, 0, {0: 0.95, 10: 0.95, 19: 0.95}),  # off: torch's constant momentum
        # 0-based step s of a 4-step warmup trains at 0.85 + 0.1 (s + 1) / 4; a 5-step cooldown ends at 0.85 + 0
        (4, 0, {0: 0.875, 1: 0.9, 3: 0.95, 19: 0.95}),
        (4, 5, {0: 0.875, 3: 0.95, 14: 0.95, 15: 0.93, 17: 0.89, 19: 0.85, 25: 0.85}),
    ],
)
def test_muon_momentum_table(warmup, cooldown, expected):
    chosen = recipe(momentum_warmup_steps=warmup, momentum_cooldown_steps=cooldown)
    assert {step: pytest.approx(chosen.momentum_at(step)) for step in expected} == expected
    assert recipe(optimizer="adamw", muon_momentum=None).momentum_at(0) is None


@pytest.mark.parametrize(
    "schedule, expected", [("constant", {0: 1.0, 19: 1.0}), ("linear", {0: 1.0, 5: 0.75, 19: 0.05})]
)
def test_weight_decay_schedule_table(schedule, expected):
    chosen = recipe(weight_decay_schedule=schedule)
    assert {step: pytest.approx(chosen.weight_decay_multiplier(step)) for step in expected} == expected


def test_the_optimizers_apply_the_schedule_of_each_step():
    model = tiny_model(tied=True)
    chosen = recipe(lr=0.004, muon_lr=0.03, momentum_warmup_steps=4, weight_decay_schedule="linear")
    optimizers = optimization.build_optimizers(model, chosen, torch.device("cpu"))
    optimizers.apply_schedule(chosen, 1)  # warmup: lr 2/4 of the peak, momentum 0.9, decay 19/20 of 0.1
    (group,) = optimizers.parts["muon"].param_groups
    assert (group["lr"], group["momentum"], group["weight_decay"]) == pytest.approx((0.015, 0.9, 0.095))
    assert [g["weight_decay"] for g in optimizers.parts["adamw"].param_groups] == [0.0]
    optimizers.apply_schedule(chosen, 10)  # from the decays the optimizers started with, not compounded
    assert (group["lr"], group["momentum"], group["weight_decay"]) == pytest.approx((0.03, 0.95, 0.05))
