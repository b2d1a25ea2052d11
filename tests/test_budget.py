"""--budget: the budget strings, the planner (table tests), the plan kept on resume, bitwise resume."""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import time
import types
from pathlib import Path

import pytest
import torch
from tiny_runs import assert_same_state, write_tiny_corpus

from tinyllm.common import UserError, given_options
from tinyllm.data import corpus_format
from tinyllm.model import config as model_config
from tinyllm.outputs import callbacks, export_hf
from tinyllm.store import checkpoint_store as store
from tinyllm.training import budget, distributed, train

# A loss model of the fit's form, fixed here so that the tables do not move with budget.LOSS_MODEL.
MODEL = budget.LossModel(e=1.0, n_c=1e5, alpha_n=0.5, d_c=1e7, alpha_d=0.4)
TINY = budget.Candidate("tiny", 100_000, 128, 20_000.0, True)
NANO = budget.Candidate("nano", 800_000, 256, 8_000.0, True)
MICRO = budget.Candidate("micro", 4_700_000, 512, 2_000.0, False)
CANDIDATES = [TINY, NANO, MICRO]


@pytest.mark.parametrize(
    "text, seconds",
    [
        ("11.5h", 41_400),
        ("30m", 1_800),
        ("90s", 90),
        ("1h30m", 5_400),
        ("2d", 172_800),
        ("10min", 600),
        (" 0.5H ", 1_800),
        (".5m", 30),
    ],
)
def test_budget_strings(text, seconds):
    assert budget.budget_seconds(text) == seconds
    assert budget.budget_problem(text) is None


@pytest.mark.parametrize("text", ["", "10", "h", "-1h", "0h", "1x", "1h30", "h1", "1e3s", "1 hour", "nan h"])
def test_malformed_budget_strings(text):
    with pytest.raises(ValueError):
        budget.budget_seconds(text)
    assert budget.budget_problem(text) == "be a duration such as 11.5h, 30m, 90s or 1h30m"


@pytest.mark.parametrize(
    "seconds, text", [(24.2, "25s"), (119, "119s"), (450, "7.5m"), (7_201, "2.1h"), (41_400, "11.5h")]
)
def test_duration_text_rounds_up(seconds, text):
    assert budget.duration_text(seconds) == text
    assert budget.budget_seconds(text) >= seconds


@pytest.mark.parametrize(
    "tokens, context, expected",
    [
        (1e5, 128, 4096),  # the floor
        (471_040, 256, 4096),  # 3,140 -> the floor: nano's 100 s run at one thread, 115 steps
        (1.2e6, 256, 4096),  # 4,800 -> 4,096
        (2.0e6, 256, 4096),  # 8,000 -> 4,096: 500 steps of 4,096 matched 250 of 8,192
        (2.35e6, 256, 8192),  # 9,400 -> 8,192: nano's 2,457,600-token default, less a budget's probe
        (2.62e6, 256, 8192),  # 10,486 -> 8,192: 320 steps of 8,192 beat 160 of 16,384 (0.3-1.2%)
        (3.3e6, 256, 8192),  # 13,200 -> 8,192: 400 steps of 8,192 beat 200 of 16,384 (0.2-0.8%)
        (4.1e6, 256, 8192),  # the root of 4.1e6 x 8,192 / 250 = 11,591: 500 steps of 8,192 beat 250 of 16,384
        (5e6, 256, 8192),  # 12,800 (the old rule's 5e6 / 250 = 20,000 gave 16,384: 305 steps)
        (8.192e6, 256, 16_384),  # exactly 16,384: 500 steps of 16,384 matched 1,000 of 8,192
        (3.3e7, 1024, 32_768),  # 32,885: 1,007 steps (the old rule's ceiling from 32.8M)
        (5.2e8, 1024, 65_536),  # 130,538: under the ceiling
        (524_288_000, 1024, 131_072),  # the ceiling's first run: 4,000 steps
        (1e12, 1024, 131_072),  # the ceiling
        (1e5, 8192, 8192),  # at least one block
    ],
)
def test_batch_rule(tokens, context, expected):
    assert budget.batch_tokens(tokens, context) == expected


@pytest.mark.parametrize(
    "blocks, world, micro, expected",
    [(32, 1, 8, (8, 4)), (32, 2, 8, (8, 2)), (6, 2, 8, (3, 1)), (12, 1, 8, (6, 2)), (4, 1, 8, (4, 1))],
)
def test_split_batch(blocks, world, micro, expected):
    assert budget.split_batch(blocks, world, micro) == expected
    assert budget.global_blocks(1e5, 128, 3) % 3 == 0


@pytest.mark.parametrize(
    "tokens, world, rounding, expected",
    [
        (1_000_000, 1, math.floor, (244, 16)),  # 4,096-token steps (1e6 / 250 = 4,000 -> the floor): 244.1
        (1_000_000, 1, math.ceil, (245, 16)),
        (1_000_000, 1, round, (244, 16)),
        (997_000, 1, round, (243, 16)),  # 243.4
        (40_000_000, 1, math.floor, (1220, 128)),  # 32,768-token steps (the root of 40e6 x 8,192 / 250): 1,220.7
        (40_000_000, 3, math.floor, (1211, 129)),  # a multiple of the world size
        (1000, 1, math.floor, (1, 16)),  # at least one step
    ],
)
def test_whole_steps(tokens, world, rounding, expected):
    assert budget.whole_steps(tokens, 256, world, rounding) == expected


def request(text: str, **fields) -> budget.Request:
    return budget.Request(budget=text, seconds=budget.budget_seconds(text), **fields)


@pytest.mark.parametrize(
    "text, fields, preset, tokens",
    [
        ("2m", {}, "tiny", 2_351_104),  # 117.6 s of training: tiny's tokens beat nano's parameters
        ("30m", {}, "nano", 14_106_624),  # long enough for nano's parameters to beat tiny's extra tokens
        ("10h", {}, "nano", 282_198_016),
        ("100h", {}, "micro", 705_560_576),
        ("10h", {"train_tokens": 1_250_000}, "micro", 4_997_120),  # a small corpus: 4 passes, then the largest model
        ("10h", {"train_tokens": 1_250_000, "max_passes": 2}, "micro", 2_498_560),  # one of few tokens an entry: 2
        ("30m", {"target_tokens": 1_000_000}, "micro", 1_000_000),  # explicit tokens: the largest that fits them
        ("30m", {"target_tokens": 20_000_000}, "tiny", 20_000_000),  # only tiny trains 20M tokens in 29.4 minutes
        ("2m", {"spent_seconds": 30.0}, "tiny", 1_748_992),  # the probe's time comes out of the budget
    ],
)
def test_the_planner_picks_the_lowest_predicted_loss_that_fits(text, fields, preset, tokens):
    plan = budget.choose(request(text, **fields), CANDIDATES, MODEL)
    assert (plan.preset, plan.target_tokens) == (preset, tokens)
    assert plan.hours <= budget.training_seconds(request(text, **fields)) / 3600
    assert plan.predicted_bpb == min(
        c["bpb"] for c in plan.candidates if c["hours"] <= plan.hours + 1e-9 or c["preset"] == preset
    )
    assert plan.tokens_per_step * plan.steps == plan.target_tokens or "target_tokens" in fields
    assert plan.target_tokens <= fields.get("max_passes", budget.MAX_EPOCHS) * fields.get("train_tokens", math.inf)
    assert plan.global_batch_blocks * model_config.PRESETS[preset].context == plan.tokens_per_step


@pytest.mark.parametrize("text", ["2m", "5m"])
def test_a_tie_within_the_loss_model_s_error_goes_to_the_larger_model(text):
    """tiny's lowest predicted loss wins by its margin over nano; within TIE_ERRORS of the model's error of it,
    nano, the larger, is chosen (and says why); micro, further off, stays out."""
    alone = budget.choose(request(text), CANDIDATES, MODEL)
    predicted = {c["preset"]: c["bpb"] for c in alone.candidates}
    margin = predicted["nano"] - predicted["tiny"]
    assert alone.preset == "tiny" and margin > 0
    error = margin / budget.TIE_ERRORS
    below = budget.choose(request(text), CANDIDATES, dataclasses.replace(MODEL, error=error * 0.99))
    assert below.preset == "tiny" and below.why.startswith("lowest predicted loss")
    tied = budget.choose(request(text), CANDIDATES, dataclasses.replace(MODEL, error=error * 1.01))
    assert tied.preset == "nano" and tied.predicted_bpb == predicted["nano"]
    assert f"of the lowest predicted loss, tiny's {predicted['tiny']:.3f}" in tied.why and "next" not in tied.why


@pytest.mark.parametrize("micro_measured", [False, True])
def test_a_predicted_preset_wins_outright_or_not_at_all(micro_measured):
    """bench_budget_wall's changelogs at seed 1338, 226 s (bench/RESULTS.md "The issue's own length"): micro,
    predicted at 6,287 tokens/s with the pair's gain of 2.2, came within the tie of nano and was planned; it ran
    at 0.47x that and stopped at the budget without its test score. Measured, it would take the tie."""
    presets = {name: model_config.PRESETS[name] for name in ("tiny", "nano", "micro")}
    parameters = {name: budget.non_embedding_parameters(preset) for name, preset in presets.items()}
    speeds = {
        "tiny": (16_691.0, True, None),
        "nano": (11_427.0, True, 2.196),
        "micro": (6_287.0, micro_measured, 2.196),
    }
    candidates = [budget.Candidate(name, parameters[name], presets[name].context, *speeds[name]) for name in presets]
    asked = budget.Request(budget="226s", seconds=226, train_tokens=976_469, max_passes=4, spent_seconds=2.7)
    plan = budget.choose(asked, candidates)
    predicted = {c["preset"]: c["bpb"] for c in plan.candidates}
    assert 0 < predicted["micro"] - predicted["nano"] <= budget.TIE_ERRORS * budget.LOSS_MODEL.error
    assert plan.preset == ("micro" if micro_measured else "nano")
    assert ("micro within 0.081 bits/byte of it but its speed predicted" in plan.why) is not micro_measured
    # a predicted preset whose predicted loss is the lowest outright is still planned
    faster = dataclasses.replace(candidates[2], tokens_per_second=20_000.0, probed=False)
    assert budget.choose(asked, [*candidates[:2], faster]).preset == "micro"


@pytest.mark.parametrize(
    "tokens_per_step, optimizer, seconds",
    [
        (1000, 0.0, 0.05),  # 20,000 tokens/s
        (1000, 0.01, 0.06),  # an optimizer step of 10 ms ...
        (4000, 0.01, 0.21),  # ... once per step, whatever its micro-batches
    ],
)
def test_a_step_takes_its_micro_batches_and_one_optimizer_step(tokens_per_step, optimizer, seconds):
    candidate = dataclasses.replace(TINY, optimizer_seconds=optimizer)
    assert budget.step_seconds(candidate, tokens_per_step) == pytest.approx(seconds)


@pytest.mark.parametrize(
    "steps, every, count",
    [
        (100, 20, 5),  # 20, 40, ..., 100: the last is a multiple
        (100, 30, 4),  # 30, 60, 90 and the last
        (100, 0, 1),  # at the end only
        (356, 71, 5),  # 71, ..., 284 and 356: the multiple at 355 is left to the last (callbacks.due's LAST_GAP)
        (3, 4, 1),
    ],
)
def test_the_plan_counts_the_validations_the_run_makes(steps, every, count):
    assert budget.validation_count(steps, every) == count
    assert count == sum(callbacks.due(step, steps, every) for step in range(1, steps + 1))


def test_a_run_counts_its_steps_validations_and_test():
    """10 steps of 1,000 tokens at 20,000 tokens/s and 10 ms (0.6 s), a validation of 3,000 tokens every 5 steps
    (2, 0.05 s each: a scored token a third of a trained one) and the test's 6,000 (0.1 s); the default cadence
    for that length (at most 5% of the training: validating 3,000 tokens every 30 steps or more)."""
    candidate = dataclasses.replace(TINY, optimizer_seconds=0.01)
    asked = request("1m", validation_tokens=3000, test_tokens=6000, eval_every=5)
    assert budget.run_seconds(candidate, asked, 10, 1000) == pytest.approx(0.6 + 0.1 + 0.1)
    default = dataclasses.replace(asked, eval_every=None)
    assert callbacks.default_eval_every(10, 3000, 1000) == 0  # cheaper at the end only
    assert budget.run_seconds(candidate, default, 10, 1000) == pytest.approx(0.6 + 0.05 + 0.1)


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"validation_tokens": 40_000, "test_tokens": 40_000},
        {"validation_tokens": 40_000, "test_tokens": 40_000, "eval_every": 10, "spent_seconds": 7.0},
        {"train_tokens": 300_000},  # capped at 4 passes
    ],
)
def test_the_plan_is_the_longest_run_that_fits(fields):
    """The planned steps' run (steps, validations, test) fits training_seconds and one step more would not
    (or the passes cap it)."""
    candidate = dataclasses.replace(NANO, optimizer_seconds=0.02)
    asked = request("5m", **fields)
    steps, blocks = budget.fitted_length(candidate, asked)
    tokens_per_step = blocks * candidate.context
    assert blocks == budget.global_blocks(steps * tokens_per_step, candidate.context, 1)
    available = budget.training_seconds(asked)
    assert budget.run_seconds(candidate, asked, steps, tokens_per_step) <= available
    capped = (steps + 1) * tokens_per_step > asked.max_tokens
    assert capped or budget.run_seconds(candidate, asked, steps + 1, tokens_per_step) > available


@pytest.mark.parametrize(
    "fields, seconds",
    [
        ({}, 980.0),  # 1,000 s less UNCOUNTED_SHARE
        ({"spent_seconds": 30.0}, 950.0),  # this session's start-up and probe
        ({"spent_seconds": 30.0, "start_seconds": 20.0, "session_hours": 0.1}, 910.0),  # 3 sessions: 2 more starts
    ],
)
def test_the_plan_trains_the_budget_less_what_it_does_not_count(fields, seconds):
    assert budget.training_seconds(request("1000s", **fields)) == pytest.approx(seconds)


def test_a_predicted_preset_s_optimizer_step_scales_with_its_newton_schulz_flops():
    from tinyllm.model import hardware

    measured = budget.Candidate("nano", 1, 32, 100.0, True, optimizer_seconds=0.01)
    flops = {
        name: sum(hardware.newton_schulz_flops(*shape) for shape in hardware.muon_matrix_shapes(PROBE_SHAPES[name]))
        for name in ("nano", "micro")
    }
    predicted = budget.predicted_optimizer_seconds(measured, PROBE_SHAPES, "micro")
    assert predicted == pytest.approx(0.01 * flops["micro"] / flops["nano"]) and predicted > 0.01
    faster = budget.predicted_optimizer_seconds(measured, PROBE_SHAPES, "micro", 2.0)  # the pair's gain
    assert faster == pytest.approx(predicted / 2)


@pytest.mark.parametrize(
    "tiny_tokens, nano_tokens, tie",
    [
        (2_154_496, 917_504, True),  # bench_budget_wall, KJV, 2 min: predicted tiny by 0.043, measured tiny by 0.015
        (1_986_560, 917_504, True),  # the same with a burst: 0.035 / 0.009
        (2_318_336, 974_848, True),  # changelog, 2 min, both planned: predicted tiny by 0.038, measured nano by 0.017
        (1_232_896, 778_240, True),  # bench_vocab KJV 8,192: 0.013 / nano by 0.022
        (3_637_248, 1_118_208, True),  # the budget sweep's 5 minutes: predicted tiny by 0.047, measured tiny by 0.041
        (774_144, 466_944, True),  # man pages, 1 thread, the plan's tiny and the fixed nano: 0.058 / nano by 0.040
        (675_840, 466_944, True),  # the same at seed 1337: 0.033 / nano by 0.066
        (1_818_624, 557_056, False),  # the sweep's 2.5 minutes: 0.133 / 0.099
    ],
)
def test_the_tie_s_width_lies_between_the_measured_pairs(tiny_tokens, nano_tokens, tie):
    """TIE_ERRORS x LOSS_MODEL.error against the pairs of tiny and nano measured at equal time (docs/budget.md
    "Ties"): those measured a tie or nano's are within it, and the sweep's 5 minutes (tiny by 0.041, a tie it
    now loses); the one tiny won clearly (0.099) outside it."""
    tiny, nano = (budget.non_embedding_parameters(model_config.PRESETS[name]) for name in ("tiny", "nano"))
    gap = budget.LOSS_MODEL.loss(nano, nano_tokens) - budget.LOSS_MODEL.loss(tiny, tiny_tokens)
    assert gap > 0 and (gap <= budget.TIE_ERRORS * budget.LOSS_MODEL.error) is tie


@pytest.mark.parametrize(
    "train_tokens, vocab, passes",
    [
        (1_955_835, 4096, 4),  # the budget sweep's corpus (478 tokens an entry): gained up to 3.4-3.7 passes
        (304_814, 512, 4),  # 0.6 MB of changelogs at 512 (595): nano 0.12 bits/byte better at 4 passes than 2
        (880_201, 8192, 4),  # 4 MB of KJV at 8,192 (107): passes 3 and 4 gained tiny 1.2%, nano 0.2-1.2%
        (917_297, 8192, 4),  # 4 MB of changelogs (112): tiny 0.8% better at 4, nano 1.2-1.4% worse: about even
        (610_866, 8192, 2),  # 2.5 MB of changelogs at 8,192 (75): nano 2.9-3.5% worse at 4 passes, tiny 0.7%
        (529_503, 8192, 2),  # 2.5 MB of KJV (65): nano 0.6-0.7% worse at 4, tiny 1.1% better
        (397_093, 8192, 2),  # 1.5 MB of changelogs at 8,192 (48): nothing past 2 passes, nano lost 0.11 at 4
        (312_985, 8192, 2),  # 1.5 MB of KJV (38): nano lost 0.04 at 4
        (819_200, 8192, 4),  # 100 tokens an entry: the line
        (math.inf, 8192, 4),  # a mixture: not capped by passes (4 x inf)
    ],
)
def test_a_corpus_of_few_tokens_a_vocabulary_entry_is_trained_over_two_passes(train_tokens, vocab, passes):
    assert budget.max_passes(train_tokens, vocab) == passes


@pytest.mark.parametrize(
    "preset, vocab, asked, noted",
    [
        ("micro", 8192, 8192, True),  # measured: 16,384 0.1-1.8% better, 27,569 2.4% on the changelogs
        ("micro", 10_000, 10_000, True),  # a user's vocabulary under it
        ("micro", 8489, 16_384, False),  # a 1.5 MB text supports no more than this at 16,384: nothing to rebuild
        ("micro", 16384, 16384, False),  # the vocabulary micro measured best at
        ("micro", 33069, 33069, False),
        ("micro", 512, 512, False),  # a corpus under 1 MB: not measured for micro
        ("think72", 8192, 8192, True),  # larger than micro: the same (not measured)
        ("nano", 8192, 8192, False),  # tiny and nano measured best at 8,192
        ("tiny", 8192, 8192, False),
    ],
)
def test_a_plan_of_micro_or_larger_says_when_the_corpus_vocabulary_is_under_what_micro_measured_best(
    preset, vocab, asked, noted
):
    note = budget.vocabulary_note(preset, vocab, asked)
    assert (note is not None) is noted
    assert note is None or (
        f"this corpus has {vocab:,} tokens" in note and f"data.py --preset {preset}`, or `--vocab-size 16384`" in note
    )


def test_on_1_5_mb_of_changelogs_two_minutes_plan_nano():
    """bench_vocab's 1.5 MB changelog corpus (397,093 train tokens, vocabulary 8,192) at its measured speeds
    (tiny 10,613, nano 5,673 tokens/s): at 4 passes the loss model put tiny's 1.27M tokens ahead (measured
    1.6641 bits/byte, nano's 0.68M 1.5644), by less than the tie since it is 0.081 wide; at the 2 passes
    max_passes allows there, nano by prediction too."""
    speeds = {"tiny": 10_613.0, "nano": 5_673.0}
    candidates = [
        budget.Candidate(name, budget.non_embedding_parameters(model_config.PRESETS[name]), context, speed, True)
        for (name, speed), context in zip(speeds.items(), (128, 256))
    ]
    train_tokens = 397_093
    four = budget.choose(request("2m", train_tokens=train_tokens), candidates)
    assert four.preset == "nano" and "of the lowest predicted loss, tiny's" in four.why  # the tie's
    plan = budget.choose(
        request("2m", train_tokens=train_tokens, max_passes=budget.max_passes(train_tokens, 8192)), candidates
    )
    assert plan.preset == "nano" and plan.target_tokens <= 2 * train_tokens


def test_an_explicit_preset_is_the_only_candidate():
    run = train.RunSettings(preset="nano", context=64)
    assert list(budget.candidate_presets(run, explicit_shape=True)) == ["nano"]
    shapes = budget.candidate_presets(train.RunSettings(context=64), explicit_shape=False)
    assert list(shapes)[:3] == ["tiny", "nano", "micro"] and {shape.context for shape in shapes.values()} == {64}
    plan = budget.choose(request("10h"), [NANO], MODEL)
    assert plan.preset == "nano"


def test_options_given_on_the_command_line_or_in_the_config(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text("target_tokens = 300000\nseed = 3\n")
    parser = train.build_parser()
    assert given_options(parser, ("--preset", "nano", "--budget=1h")) == {"preset", "budget"}
    assert given_options(parser, ("--config", str(config))) == {"config", "target_tokens", "seed"}


@pytest.mark.parametrize("world, micro, batch_size, grad_accum", [(1, 4, 4, 4), (2, 4, 4, 2), (2, 16, 8, 1)])
def test_train_applies_the_plan_it_is_given(world, micro, batch_size, grad_accum):
    """settle returns a plan; apply sets the run's preset and length and splits its batch over the ranks."""
    settings = train.parse_args(["--batch-size", str(micro), "--epochs", "2", "--budget", "1h"])
    assert budget.apply(settings, None, world) is settings
    plan = budget.choose(request("30m", world=world), CANDIDATES, MODEL)
    plan = dataclasses.replace(plan, global_batch_blocks=16)
    applied = budget.apply(settings, plan, world)
    run = applied.run
    assert (run.preset, run.target_tokens, run.epochs) == (plan.preset, plan.target_tokens, None)
    assert (applied.session.batch_size, applied.session.grad_accum) == (batch_size, grad_accum)
    assert applied.session.batch_size * applied.session.grad_accum * world == 16


def test_multi_session_budget_plans_the_whole_run():
    one = budget.choose(request("30h"), CANDIDATES, MODEL)
    split = budget.choose(request("30h", session_hours=11.5), CANDIDATES, MODEL)
    assert split.sessions == 3 and one.sessions == 1
    assert (split.preset, split.target_tokens) == (one.preset, one.target_tokens)
    assert "in 3 sessions" in split.summary()


def test_a_budget_too_small_is_one_line_saying_what_it_would_take():
    with pytest.raises(UserError) as caught:
        budget.choose(request("10s"), CANDIDATES, MODEL)
    message = str(caught.value)
    assert "\n" not in message and message.startswith("--budget 10s is too small")
    needed = message.rsplit("give --budget ", 1)[1].split()[0]
    assert budget.choose(request(needed), CANDIDATES, MODEL).preset == "tiny"  # what it says is enough
    with pytest.raises(UserError, match="--target-tokens 90,000,000 takes about"):
        budget.choose(request("1h", target_tokens=90_000_000), CANDIDATES, MODEL)
    with pytest.raises(UserError, match="no model shape"):
        budget.choose(request("1h"), [], MODEL)
    short = request("1h", train_tokens=80_000, max_passes=4)  # 320,000 tokens at most: no budget is enough
    with pytest.raises(UserError) as caught:
        budget.choose(short, CANDIDATES, MODEL)
    assert str(caught.value) == (
        "--budget 1h: the corpus is too small to plan a run on: 4 passes over its train split of 80,000 tokens "
        "are 320,000, under the smallest sensible run (327,680 tokens: 80 steps of 4,096); train it without "
        "--budget (e.g. --epochs 4), or build the corpus from more text"
    )


def test_the_plan_record_reads_back_and_shows_on_the_card():
    plan = budget.choose(request("30m"), CANDIDATES, MODEL)
    record = json.loads(json.dumps(plan.as_record()))
    assert budget.Plan.from_record(record) == plan
    card = export_hf.model_card(
        {
            "parameters": 1000,
            "tied_embeddings": False,
            "layers": 2,
            "hidden": 64,
            "intermediate": 192,
            "heads": 4,
            "kv_heads": 2,
            "head_dim": 16,
            "context": 128,
            "vocab_size": 300,
        },
        {"status": "COMPLETE", "settings": {"training": {}, "budget": record}},
    )
    assert f"- Planned by {plan.summary()}; {plan.why}" in card


# ----------------------------------------------------------------------------------------------
# The probe's rules and the check of the plan against the run's own steps (pure; table tests)


@pytest.mark.parametrize(
    "times, out_of_time, expected",
    [
        ([], False, None),
        ([1.0] * 4, False, None),  # fewer than PROBE_STEPS timed
        ([1.0, 1.1, 0.95, 1.0, 1.15], False, 1.0),  # steady (within 25%): the median
        ([4.0, 4.0, 1.0, 1.0, 1.0], False, None),  # a burst that ended inside the probe: time more
        ([4.0, 4.0, 1.0, 1.0, 1.0, 1.0], False, None),
        ([4.0, 4.0, 1.0, 1.0, 1.0, 1.0, 1.0], False, 1.0),  # the burst left behind
        ([1.0, 2.0] * 7 + [1.0], False, 1.0),  # PROBE_MAX_STEPS reached, still disagreeing: the window's fastest
        ([2.0, 1.0] * 7 + [2.0], False, 1.0),
        ([0.04, 0.085] * 7 + [0.087], False, 0.04),  # two threads under a burst: spin doubles some steps
        ([1.0, 1.0, 1.0, 1.0, 1.2], True, 1.0),  # out of time and steady: the median
        ([4.0, 1.0], True, 1.0),  # out of time: the fastest of what there is
    ],
)
def test_the_probe_times_steps_until_they_agree(times, out_of_time, expected):
    assert budget.steady_step_seconds(times, budget.PROBE_STEPS, out_of_time) == expected


@pytest.mark.parametrize(
    "times, expected",
    [
        ([1.0, 1.1], None),  # fewer than CPU_TIME_PROBE_STEPS timed
        ([1.0, 1.1, 0.95], 1.0),  # three that agree: their median
        ([4.0, 1.0, 1.1], None),  # they disagree: time more
        ([4.0, 1.0, 1.1, 1.0], 1.0),
    ],
)
def test_a_one_thread_cpu_probe_needs_three_agreeing_steps(times, expected):
    assert budget.steady_step_seconds(times, budget.CPU_TIME_PROBE_STEPS) == expected


@pytest.mark.parametrize(
    "device_type, threads, expected",
    [
        ("cpu", 1, budget.CPU_TIME_PROBE_STEPS),  # a step's CPU time is its work: load moves it far less
        ("cpu", 2, budget.PROBE_STEPS),  # OpenMP's spinning threads: the CPU time moves with load
        ("cpu", 16, budget.PROBE_STEPS),
        ("cuda", 1, budget.PROBE_STEPS),  # the device's time, on the wall clock
        ("mps", 1, budget.PROBE_STEPS),
    ],
)
def test_the_probe_window_is_shorter_where_a_step_is_timed_by_its_cpu_time(device_type, threads, expected):
    assert budget.probe_window(device_type, threads) == expected


@pytest.mark.parametrize(
    "steps, time_for, expected, taken",
    [
        ([3.0, 1.0, 1.1, 1.0, 1.2, 1.0, 5.0, 1.0], 99, 1.0, 6),  # steps 2-6 agree: no seventh
        ([1.0, 2.0] * 10, 99, 1.0, 15),  # PROBE_MAX_STEPS, still disagreeing: the fastest
        ([4.0, 1.0, 2.0, 1.0], 3, 1.0, 3),  # out of time after the third step: the fastest so far
    ],
)
def test_the_probe_steps_until_its_window_is_steady_or_its_time_is_up(steps, time_for, expected, taken):
    left = steps[::-1]
    assert (
        budget.time_until_steady(left.pop, lambda: len(steps) - len(left) >= time_for, budget.PROBE_STEPS) == expected
    )
    assert len(steps) - len(left) == taken


def test_a_one_thread_cpu_probe_stops_after_three_agreeing_steps():
    steps = [3.0, 1.0, 1.1, 1.0, 9.0]
    left = steps[::-1]
    assert budget.time_until_steady(left.pop, lambda: False, budget.CPU_TIME_PROBE_STEPS) == 1.0
    assert left == [9.0]


PROBE_SHAPES = {name: model_config.resolve_preset(name, context=32) for name in ("tiny", "nano", "micro", "think72")}


def fake_measure(rates: dict[str, list[float]]):
    """A budget.Measure whose successive calls for a preset return `rates[preset]` in turn; records the calls."""
    calls: list[str] = []

    def measure(preset, micro_batch, seconds, window):
        calls.append(preset)
        return budget.ProbeSpeed(rates[preset][sum(call == preset for call in calls) - 1])

    return measure, calls


@pytest.mark.parametrize(
    "tiny, nano_share, calls, tiny_rate, nano_ratio",
    [
        ([100.0], [2.5], ["tiny", "nano"], 100.0, 2.5),  # quiet: nano 2.5x its FLOP/s prediction (as measured)
        ([20.0, 100.0], [2.5, 2.5], ["tiny", "nano", "tiny", "nano"], 100.0, 2.5),  # a burst over tiny's probe
        ([100.0, 90.0], [0.5, 2.5], ["tiny", "nano", "tiny", "nano"], 100.0, 2.5),  # a burst over nano's
        ([100.0, 100.0], [5.0, 5.0], ["tiny", "nano", "tiny", "nano"], 100.0, 5.0),  # really off: said, kept
    ],
)
def test_a_measured_pair_that_disagrees_with_its_prediction_is_measured_again(
    tiny, nano_share, calls, tiny_rate, nano_ratio
):
    """nano's rates are given as shares of its prediction from tiny's quiet 100 tokens/s; each preset keeps
    its fastest measurement; the next preset (micro) is predicted from nano's FLOP/s times the pair's gain
    (within PAIR_RANGE), the one after (think72) from micro's without it (the probe's time after the pair: 0)."""
    from tinyllm.training import distributed

    info = distributed.DistInfo(rank=0, local_rank=0, world=1, device=torch.device("cpu"))
    quiet = budget.Candidate("tiny", 1, 32, 100.0, True)
    nano = [share * budget.predicted_rate(quiet, PROBE_SHAPES, "nano", 300) for share in nano_share]
    measure, made = fake_measure({"tiny": tiny, "nano": nano})
    found = budget.probe(measure, info, PROBE_SHAPES, 2, 0.0, 300, budget.PROBE_STEPS, pair_seconds=1e9)
    assert made == calls
    assert found[0].tokens_per_second == tiny_rate and found[0].pair_ratio is None
    assert found[1].pair_ratio == pytest.approx(nano_ratio)
    assert found[1].tokens_per_second == pytest.approx(max(nano))
    gain = min(budget.PAIR_RANGE[1], nano_ratio)
    assert (found[2].probed, found[2].pair_ratio) == (False, pytest.approx(gain))
    assert found[2].tokens_per_second == pytest.approx(
        budget.predicted_rate(found[1], PROBE_SHAPES, "micro", 300, gain)
    )
    assert (found[3].probed, found[3].pair_ratio) == (False, None)
    assert found[3].tokens_per_second == pytest.approx(budget.predicted_rate(found[2], PROBE_SHAPES, "think72", 300))


def test_the_probe_keeps_each_preset_s_optimizer_step_and_predicts_the_next_one_s():
    from tinyllm.training import distributed

    info = distributed.DistInfo(rank=0, local_rank=0, world=1, device=torch.device("cpu"))
    quiet = budget.Candidate("tiny", 1, 32, 100.0, True)
    nano = 2.5 * budget.predicted_rate(quiet, PROBE_SHAPES, "nano", 300)
    speeds = {"tiny": budget.ProbeSpeed(100.0, 0.001), "nano": budget.ProbeSpeed(nano, 0.004)}
    found = budget.probe(lambda name, *args: speeds[name], info, PROBE_SHAPES, 2, 0.0, 300, 3, pair_seconds=1e9)
    assert [c.optimizer_seconds for c in found[:2]] == [0.001, 0.004]
    assert found[2].optimizer_seconds == budget.predicted_optimizer_seconds(found[1], PROBE_SHAPES, "micro", 2.5)


@pytest.mark.parametrize(
    "first, again, kept",
    [
        ((100.0, 0.02), (120.0, 0.03), (120.0, 0.02)),  # each part's faster: load only ever slows either
        ((100.0, 0.02), None, (100.0, 0.02)),  # out of memory the second time: the first
    ],
)
def test_a_preset_measured_twice_keeps_each_part_s_faster(first, again, kept):
    speed = budget.faster_speed(budget.ProbeSpeed(*first), again and budget.ProbeSpeed(*again))
    assert (speed.tokens_per_second, speed.optimizer_seconds) == kept
    candidate = budget.faster(
        budget.Candidate("tiny", 1, 32, *first[:1], True, optimizer_seconds=first[1]),
        again and budget.ProbeSpeed(*again),
    )
    assert (candidate.tokens_per_second, candidate.optimizer_seconds) == kept


@pytest.mark.parametrize("window, probed", [(budget.CPU_TIME_PROBE_STEPS, True), (budget.PROBE_STEPS, False)])
def test_a_preset_after_the_pair_is_probed_when_its_window_fits_the_time_left(window, probed):
    """micro's probe costs its warmup and `window` steps at its predicted rate; the time left is between the
    cost of the short window and the long one's."""
    from tinyllm.training import distributed

    info = distributed.DistInfo(rank=0, local_rank=0, world=1, device=torch.device("cpu"))
    tiny = budget.Candidate("tiny", 1, 32, 100.0, True)
    nano = budget.Candidate("nano", 1, 32, 2.0 * budget.predicted_rate(tiny, PROBE_SHAPES, "nano", 300), True, 2.0)
    micro_rate = budget.predicted_rate(nano, PROBE_SHAPES, "micro", 300, 2.0)
    tokens = 2 * PROBE_SHAPES["micro"].context  # a probe step's: one micro-batch of 2 blocks
    seconds = (budget.PROBE_WARMUP_STEPS + 4) * tokens / micro_rate  # fits 1 + 3 steps, not 1 + 5
    measure, made = fake_measure({"tiny": [100.0], "nano": [nano.tokens_per_second], "micro": [micro_rate]})
    shapes = {name: PROBE_SHAPES[name] for name in ("tiny", "nano", "micro")}
    found = budget.probe(measure, info, shapes, 2, seconds, 300, window, pair_seconds=1e9)
    assert (made == ["tiny", "nano", "micro"]) == probed
    assert found[2].probed == probed


def planned(steps: int = 100, seconds: str = "1000s", **fields) -> budget.Plan:
    """A plan of `steps` steps of 1,000 tokens filling 90% of `seconds`: 9 s a step at 1000s."""
    hours = budget.budget_seconds(seconds) * 0.9 / 3600
    values = dict(
        budget=seconds,
        preset="tiny",
        parameters=100_000,
        target_tokens=steps * 1000,
        global_batch_blocks=8,
        tokens_per_step=1000,
        steps=steps,
        hours=hours,
        sessions=1,
        predicted_bpb=1.5,
        why="",
        candidates=(),
    )
    return budget.Plan(**{**values, **fields})


def wsd(total: int) -> int:
    """The default WSD's first decaying step: 40% of the run decays."""
    return total - round(0.4 * total)


@pytest.mark.parametrize(
    "plan, step, elapsed, timed, decay_start, due",
    [
        (planned(), 40, 400.0, 40, wsd, False),  # neither half the budget nor the last step before the decay
        (planned(), 40, 500.0, 40, wsd, True),  # half the budget (a machine slower than planned)
        (planned(), 53, 10.0, 53, wsd, True),  # the last step from which the run may end 10% sooner (90 steps)
        (planned(), 52, 10.0, 52, wsd, False),  # (that room is all the check needs)
        (planned(), 59, 10.0, 59, wsd, True),  # the last step before the decay (step 60 of 100)
        (planned(), 59, 10.0, 3, wsd, False),  # too few steps timed in this session
        (planned(), 60, 600.0, 60, wsd, False),  # the decay has begun: too late to change the length
        (planned(), 29, 10.0, 29, lambda total: 30, True),  # an early decay (--decay-fraction 0.7)
        (planned(), 40, 500.0, 40, None, False),  # a cosine schedule: its length is every step's lr
        (planned(check={"at_step": 20}), 40, 500.0, 40, wsd, False),  # checked: only the late check is left
        (planned(check={"at_step": 20}), 53, 600.0, 53, wsd, True),  # the late check, with room to shorten
        (planned(check={"at_step": 20}), 52, 600.0, 52, wsd, False),
        (planned(check={"at_step": 20}), 53, 600.0, 4, wsd, True),  # (timing its own steps since the check)
        (planned(check={"at_step": 50}), 54, 600.0, 54, wsd, True),  # 4 steps after a check at 50
        (planned(check={"at_step": 56}), 59, 600.0, 59, wsd, False),  # the check was too near: no late one
        (planned(check={"at_step": 59}), 59, 600.0, 59, wsd, False),  # the check was the last step before
        (planned(check={"at_step": 20}, late_check={"at_step": 59}), 59, 600.0, 59, wsd, False),  # once each
        (planned(check={"at_step": 20}), 61, 600.0, 61, wsd, False),  # the decay has begun
        (planned(check={"at_step": 20}, sessions=3), 59, 600.0, 59, wsd, False),
        (planned(length_given=True), 40, 500.0, 40, wsd, False),  # the user's --target-tokens
        (planned(sessions=3), 40, 500.0, 40, wsd, False),  # a run over several sessions keeps its plan
    ],
)
def test_the_plan_is_checked_once_and_once_more_before_its_decay(plan, step, elapsed, timed, decay_start, due):
    assert budget.check_due(plan, step, elapsed, timed, decay_start) is due


@pytest.mark.parametrize(
    "seen, decay_start, max_tokens, steps",
    [
        ((25, 225.0, 9.0, 100.0), wsd, math.inf, None),  # as planned: ends at 900 s = 1,000 less its end's 100 s
        ((25, 225.0, 9.05, 100.0), wsd, math.inf, None),  # 3.75 s late: within the 0.5% tolerance
        ((25, 225.0, 9.1, 100.0), wsd, math.inf, 99),  # 7.5 s late: re-planned to 25 + 675 s / 9.1 s
        ((25, 225.0, 9.2, 100.0), wsd, math.inf, 98),  # 2% slower: re-planned to 25 + 675 s / 9.2 s
        ((25, 225.0, 9.0, 0.0), wsd, math.inf, 111),  # an end that takes no time: the whole 1,000 s
        ((25, 112.5, 4.5, 100.0), wsd, math.inf, 200),  # twice as fast: 25 + 787.5 s / 4.5 s
        ((25, 450.0, 18.0, 100.0), wsd, math.inf, 50),  # twice as slow (a busy machine): 25 + 450 s / 18 s
        ((25, 300.0, 9.0, 100.0), wsd, math.inf, 91),  # a slow start (the probe's burst), then the planned speed
        ((25, 112.5, 4.5, 100.0), wsd, 150_000, 150),  # at most max_run_tokens
        ((25, 850.0, 18.0, 100.0), wsd, math.inf, 41),  # very late: enough steps for the decay to start after
        ((25, 112.5, 4.5, 100.0), None, math.inf, None),  # a cosine schedule's length is every step's lr: kept
    ],
)
def test_the_replan_fills_the_budget_at_the_speed_the_run_sees(seen, decay_start, max_tokens, steps):
    plan = planned()
    new = budget.replan(plan, budget.Seen(*seen), decay_start, max_tokens)
    if steps is None:
        assert new is None
        return
    assert (new.steps, new.target_tokens) == (steps, steps * 1000)
    assert (new.preset, new.global_batch_blocks, new.tokens_per_step) == (plan.preset, 8, 1000)
    assert wsd(new.steps) >= seen[0]  # every step taken keeps its learning rate


def test_a_check_is_recorded_with_its_verdict_and_one_line():
    plan = planned()
    kept = budget.check_plan(plan, budget.Seen(25, 225.0, 9.0, 100.0), wsd)
    assert (kept.steps, kept.predicted_bpb, kept.check["replanned"]) == (100, 1.5, False)
    assert budget.check_text(kept.check).endswith("as planned: kept")
    moved = budget.check_plan(plan, budget.Seen(25, 112.5, 4.5, 100.0), wsd, loss=MODEL)
    assert moved.check == {
        "at_step": 25,
        "elapsed_seconds": 112.5,
        "step_seconds": 4.5,
        "planned_step_seconds": pytest.approx(9.0),
        "projected_end_seconds": 450.0,
        "target_end_seconds": 900.0,
        "end_seconds": 100.0,
        "replanned": True,
        "from_tokens": 100_000,
        "from_steps": 100,
        "to_tokens": 200_000,
        "to_steps": 200,
    }
    assert moved.predicted_bpb == MODEL.loss(plan.parameters, 200_000)
    line = budget.check_text(moved.check)
    assert "\n" not in line and "2.00x the probe's speed" in line
    assert line.endswith(
        "training would end at 450 s, not at its target 900 s: "
        "re-planned from 100,000 tokens (100 steps) to 200,000 (200 steps)"
    )
    assert budget.Plan.from_record(json.loads(json.dumps(moved.as_record()))) == moved
    assert line in moved.summary()


def test_the_late_check_is_recorded_beside_the_check_and_moves_the_end_either_way():
    """Checked at step 25 (kept), then at step 53, the last from which the run may end 10% sooner: 477 s in,
    the steps since the check at 7.2 s where the plan had 9 s: re-planned to fill the target (1,000 s less
    the end's 100 s); at 11 s a step, shortened, as far as the decay allows and no further."""
    checked = budget.check_plan(planned(), budget.Seen(25, 225.0, 9.0, 100.0), wsd)
    assert checked.check["at_step"] == 25 and checked.late_check is None
    late = budget.check_plan(checked, budget.Seen(53, 477.0, 7.2, 100.0), wsd, loss=MODEL)
    assert late.check == checked.check
    assert (late.late_check["at_step"], late.late_check["replanned"], late.steps) == (53, True, 53 + 423 // 7.2)
    assert wsd(late.steps) > 53  # the step taken keeps its learning rate
    line = budget.check_text(late.late_check, again=True)
    assert line.startswith("checked again at step 53 (477 s in): steps with their validations at 1.25x the plan's")
    assert line.endswith(f"re-planned from 100,000 tokens (100 steps) to {late.target_tokens:,} ({late.steps} steps)")
    assert budget.check_text(checked.check) in late.summary() and line in late.summary()
    assert budget.Plan.from_record(json.loads(json.dumps(late.as_record()))) == late
    assert budget.kept_plan_words(late).endswith("and re-planned at its checks: kept")
    slower = budget.check_plan(checked, budget.Seen(53, 477.0, 11.0, 100.0), wsd)  # 53 + 423 s / 11 s
    assert (slower.steps, slower.late_check["replanned"]) == (91, True)
    slowest = budget.check_plan(checked, budget.Seen(53, 477.0, 15.0, 100.0), wsd)  # would be 81: no sooner than 88
    assert (slowest.steps, budget.earliest_total(53, wsd)) == (88, 88)
    assert budget.room_step(checked, wsd) == 53 and budget.room_step(slowest, wsd) < 53


@pytest.mark.parametrize(
    "step, validation, every, expected",
    [(0.25, 0.5, 50, 0.26), (0.25, 0.5, 0, 0.25), (2.0, 30.0, 10, 5.0), (1.0, 0.0, 10, 1.0)],
)
def test_the_rest_of_the_run_counts_its_share_of_the_validations(step, validation, every, expected):
    assert budget.rest_step_seconds(step, validation, every) == pytest.approx(expected)


@pytest.mark.parametrize(
    "times, expected",
    [([1.0], 1.0), ([5.0, 5.0, 1.0, 1.0, 1.0], 1.0), ([9.0, 9.0, 9.0, 1.0, 2.0, 3.0], 6.0), ([9.0, 1.0, 2.0], 2.0)],
)
def test_the_time_of_a_step_is_the_sessions_median(times, expected):
    assert budget.typical_step_seconds(times) == expected


# ----------------------------------------------------------------------------------------------
# train.py --budget: the plan applied, recorded and kept; a resumed run bit for bit the uninterrupted one


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_tiny_corpus(tmp_path_factory.mktemp("corpus"))


class FakeMachine:
    """A machine whose train steps take `per_token[preset]` seconds a token (train.Training.train_step's
    seconds, the probe's and the loop's), `burst` times that for the first `burst_steps` steps (a busy
    moment), whose optimizer step takes no time of its own, whose evaluations take a third of that a scored
    token (as the plan counts them), and whose session clock reads the sum of its steps and evaluations
    (train.SessionClocks.read's elapsed): the timing the probe and the check see, without the tests
    depending on this machine's speed. A step spends `per_token` CPU seconds a token on each torch thread,
    burst or not (`cpu_burst`: times that too: other load that costs the process CPU time, not only
    waiting for a core)."""

    def __init__(self, per_token: dict[str, float], burst: float = 1.0, burst_steps: int = 0):
        self.per_token, self.burst, self.burst_steps = per_token, burst, burst_steps
        self.cpu_burst = False
        self.steps = 0
        self.evaluations: list[float] = []  # each evaluation's seconds, in order

    def evaluated(self, training, split: str) -> None:
        """An evaluation after the last step, at that step's pace."""
        slower = self.burst if self.steps <= self.burst_steps else 1.0
        rows = sum(part.total for part in training.data.evaluation_rows(split, 0).values())
        self.evaluations.append(rows * training.context * self.per_token[training.run.preset] * slower / 3)

    def step(self, training) -> dict:
        self.steps += 1
        slower = self.burst if self.steps <= self.burst_steps else 1.0
        quiet = training.tokens_per_step * self.per_token[training.run.preset]
        cpu = quiet * (slower if self.cpu_burst else 1.0) * torch.get_num_threads()
        return {"seconds": quiet * slower, "cpu_seconds": cpu}


@pytest.fixture
def machine(monkeypatch) -> FakeMachine:
    fake = FakeMachine({"tiny": 1 / 3, "nano": 10.0})  # tiny: 3 tokens/s, as small_runs' probe says
    train_step, read, clocks_init, heldout = (
        train.Training.train_step,
        train.SessionClocks.read,
        train.SessionClocks.__init__,
        train.heldout_loss,
    )

    def timed_step(self):
        return dataclasses.replace(train_step(self), **fake.step(self))

    def timed_heldout(training, split):
        fake.evaluated(training, split)
        return heldout(training, split)

    def session_clocks(self, started):
        clocks_init(self, started)
        self.first_evaluation = len(fake.evaluations)  # this session's evaluations: from here on

    def clock(self, *args):
        evaluations = fake.evaluations[self.first_evaluation :]
        elapsed = sum(self.step_times) + sum(evaluations)
        return dataclasses.replace(read(self, *args), elapsed=elapsed, slowest_eval=max(evaluations, default=0.0))

    monkeypatch.setattr(train.Training, "train_step", timed_step)
    monkeypatch.setattr(train, "heldout_loss", timed_heldout)
    monkeypatch.setattr(train, "optimizer_step_seconds", lambda training: 0.0)
    monkeypatch.setattr(train.SessionClocks, "__init__", session_clocks)
    monkeypatch.setattr(train.SessionClocks, "read", clock)
    # ... and the probe's own time neither: a plan's length does not move with this machine's load (the probe's
    # building and real steps took up to a minute of a 600 s budget on a busy CI machine, 3 steps of 21 s)
    monkeypatch.setattr(budget, "time", types.SimpleNamespace(monotonic=lambda: 0.0))
    return fake


@pytest.fixture
def planner(monkeypatch):
    """The planner's floors at test size (a run of a few 128-token steps is sensible here)."""
    monkeypatch.setattr(budget, "MIN_BATCH_TOKENS", 128)
    monkeypatch.setattr(budget, "MIN_TOKENS", 512)


@pytest.fixture
def small_runs(monkeypatch, planner, machine):
    """A planner for test-sized runs, with a probe that returns fixed speeds (the probe itself: below) and a
    machine that runs at them."""
    speeds = {"tiny": 3.0, "nano": 0.1}

    def probe(settings, info, presets, micro_batch, seconds, vocab, window, pair_seconds=None):
        speeds["window"] = window
        speeds["probed"] = list(presets)
        return [
            budget.Candidate(
                name, budget.non_embedding_parameters(presets[name]), presets[name].context, speeds[name], True
            )
            for name in presets
            if name in speeds
        ]

    monkeypatch.setattr(budget, "probe", probe)
    return speeds


def options(corpus: Path, out: Path, *extra: str) -> list[str]:
    return [
        "--data",
        str(corpus),
        "--out",
        str(out),
        "--context",
        "32",
        "--budget",
        "10m",
        "--eval-every",
        "4",
        "--eval-tokens",
        "32",  # one block: a validation a twenty-seventh of a step's time (the fake machine's, the plan's)
        "--save-every",
        "4",
        "--log-every",
        "1",
        "--threads",
        "1",
        "--keep-last",
        "10",
        "--no-report",
        *extra,
    ]


@pytest.mark.parametrize("threads, window", [(1, budget.CPU_TIME_PROBE_STEPS), (2, budget.PROBE_STEPS)])
def test_the_probe_window_follows_the_runs_threads_not_the_process_default(
    corpus, tmp_path, small_runs, threads, window
):
    """--threads is torch's before the probe: a process started at the other count probes with this one's window."""
    before = torch.get_num_threads()
    torch.set_num_threads(3 - threads)
    try:
        assert train.main(options(corpus, tmp_path / "run", "--threads", str(threads))) == 0
    finally:
        torch.set_num_threads(before)
    assert small_runs["window"] == window


def test_a_resumed_budget_run_keeps_its_plan_and_is_the_uninterrupted_one(
    corpus, tmp_path, small_runs, machine, monkeypatch, capsys
):
    reference = tmp_path / "reference"  # the machine at the probe's pace: 42.7 s a step, 3.6 s a validation
    assert train.main(options(corpus, reference)) == 0
    recorded = json.loads((reference / "training_settings.json").read_text())
    plan = recorded["budget"]  # 588 s (10 m less 2%): 13 steps of 4 blocks of 32 and 4 validations and the test
    assert (plan["preset"], plan["target_tokens"], plan["steps"], plan["global_batch_blocks"]) == ("tiny", 1664, 13, 4)
    assert recorded["training"]["target_tokens"] == 1664 and recorded["training"]["budget"] == "10m"
    assert recorded["runtime"]["batch_size"] * recorded["runtime"]["grad_accum"] == 4
    assert plan["check"]["at_step"] == 6 and not plan["check"]["replanned"]  # the last that may end 10% sooner
    printed = capsys.readouterr().out
    assert "--budget 10m: tiny" in printed and "--budget 10m: checked at step 6" in printed

    out = tmp_path / "run"
    assert train.main(options(corpus, out, "--stop-after-steps", "7")) == 0
    small_runs["tiny"] = 30.0  # a faster machine now: a new plan would differ, the run must not
    monkeypatch.setattr(budget, "probe", lambda *args: pytest.fail("a resume must not probe or re-plan"))
    assert train.main(options(corpus, out)) == 0
    assert "(the run's plan, made at its start: kept)" in capsys.readouterr().out
    ours, theirs = (
        torch.load(folder / "checkpoints" / store.checkpoint_name(13), weights_only=True) for folder in (out, reference)
    )
    assert store.tensor_differences(ours["model"], theirs["model"], "model") == []
    assert store.tensor_differences(ours["optimizer"], theirs["optimizer"], "optimizer") == []
    assert theirs["settings"]["budget"] == plan
    assert ours["settings"]["budget"] == json.loads((out / "training_settings.json").read_text())["budget"]
    assert same_decisions(ours["settings"]["budget"], plan)  # (the check's timings are each run's own)

    moved = tmp_path / "moved"  # --resume PATH into another folder: the plan comes with the checkpoint
    assert train.main(options(corpus, moved, "--resume", str(out / "checkpoints" / store.checkpoint_name(8)))) == 0
    assert "(the run's plan, made at its start: kept)" in capsys.readouterr().out
    final = torch.load(moved / "checkpoints" / store.checkpoint_name(13), weights_only=True)
    assert store.tensor_differences(final["model"], theirs["model"], "model") == []
    assert same_decisions(final["settings"]["budget"], plan)


def same_decisions(plan: dict, other: dict) -> bool:
    """Whether two plan records decided alike: the same fields, the check's timings (each run's) aside, and a
    late check that kept the plan (a resumed session checks no more) as none."""
    timings = ("elapsed_seconds", "step_seconds", "projected_end_seconds", "target_end_seconds", "end_seconds")

    def decisions(record: dict) -> dict:
        check = {key: value for key, value in (record["check"] or {}).items() if key not in timings}
        late = record["late_check"] if (record["late_check"] or {}).get("replanned") else None
        return {**record, "check": check, "late_check": late, "summary": None}

    return decisions(plan) == decisions(other)


@pytest.mark.parametrize(
    "max_hours, plan, hours, words",
    [
        (0, None, 0, "--max-hours budget"),  # no limit
        (2.5, None, 2.5, "--max-hours budget"),
        (11.5, {"budget": "30h"}, 11.5, "--max-hours budget"),  # several sessions: each stops at --max-hours
        (0, {"budget": "3m"}, 0.05, "--budget 3m (this machine ran slower than its probe)"),  # one: at the budget
    ],
)
def test_a_session_stops_at_max_hours_or_else_at_its_budget(max_hours, plan, hours, words):
    assert budget.session_limit(max_hours, plan) == (pytest.approx(hours), words)


def test_a_budget_run_slower_than_its_probe_stops_saved_at_the_budget(corpus, tmp_path, small_runs, machine):
    """Planned for 13 steps of 42.7 s in 10 m: the first 6 steps keep the plan's pace, then the machine is 3x
    slower: the check at step 6 (the last from which the run may end 10% sooner) sees the session's steps at the
    plan's pace and keeps the plan, the session stops saved once the rest at the recent steps' pace cannot end
    within the budget's grace (step 7), and the same command finishes the run."""
    out = tmp_path / "run"
    machine.per_token, machine.burst, machine.burst_steps = {"tiny": 1.0}, 1 / 3, 6
    assert train.main(options(corpus, out)) == 0
    plan = json.loads((out / "training_settings.json").read_text())["budget"]
    assert (plan["check"]["at_step"], plan["check"]["replanned"], plan["steps"]) == (6, False, 13)
    record = json.loads((out / "run_status.json").read_text())
    assert (record["status"], record["step"], record["total_steps"]) == (store.NEEDS_RESUME, 7, 13)
    assert record["reason"] == "stopped by --budget 10m (this machine ran slower than its probe)"
    machine.per_token = {"tiny": 1 / 3}
    assert train.main(options(corpus, out)) == 0
    assert json.loads((out / "run_status.json").read_text())["status"] == store.COMPLETE


def test_a_budget_run_faster_than_its_probe_replans_once_and_resumes_bit_for_bit(
    corpus, tmp_path, small_runs, machine, monkeypatch, capsys
):
    """The machine runs twice as fast as its probe said: the check at step 6 (the last from which the run may
    end 10% sooner) re-plans the length to fill the budget (27 steps), records it where the plan is
    (training_settings.json and the checkpoint saved at that step) and prints it; a session stopped after it
    and resumed on another machine keeps the re-plan, checks no more, and ends bit for bit where the
    uninterrupted run does."""
    machine.per_token = {"tiny": 1 / 6}
    reference = tmp_path / "reference"
    assert train.main(options(corpus, reference)) == 0
    printed = capsys.readouterr().out
    line = "re-planned from 1,664 tokens (13 steps) to 3,456 (27 steps)"  # 6 + (596 - 130 s) / 21.8 s
    checked = "--budget 10m: checked at step 6 (130 s in): steps with their validations at 2.02x the probe's speed"
    assert checked in printed
    assert line in printed
    recorded = json.loads((reference / "training_settings.json").read_text())
    plan = recorded["budget"]
    assert (plan["target_tokens"], plan["steps"], plan["check"]["from_steps"]) == (3456, 27, 13)
    assert (recorded["training"]["target_tokens"], recorded["training"]["total_steps"]) == (3456, 27)
    assert recorded["training"]["recipe.warmup_steps"] == 1  # the warmup the rule chose for 13 steps, kept
    assert recorded["training"]["recipe.decay_steps"] == 11  # the decay of 27 steps
    status = json.loads((reference / "run_status.json").read_text())
    assert (status["status"], status["step"], status["total_steps"]) == (store.COMPLETE, 27, 27)
    assert (plan["late_check"]["at_step"], plan["late_check"]["replanned"]) == (13, False)  # room_step(27): kept
    assert "--budget 10m: checked again at step 13" in printed
    at_check = torch.load(reference / "checkpoints" / store.checkpoint_name(6), weights_only=True)  # saved with it
    saved = at_check["settings"]["budget"]
    assert (saved["check"], saved["steps"], saved["late_check"]) == (plan["check"], 27, None)
    assert at_check["settings"]["training"]["total_steps"] == 27

    out = tmp_path / "run"
    assert train.main(options(corpus, out, "--stop-after-steps", "7")) == 0
    machine.per_token = {"tiny": 1 / 30}  # ten times the probe's speed now: a check would re-plan anew
    monkeypatch.setattr(budget, "probe", lambda *args: pytest.fail("a resume must not probe or re-plan"))
    capsys.readouterr()
    assert train.main(options(corpus, out)) == 0
    printed = capsys.readouterr().out
    assert "(the run's plan, made at its start and re-planned at its checks: kept)" in printed and line in printed
    assert "--budget 10m: checked" not in printed
    ours, theirs = (
        torch.load(folder / "checkpoints" / store.checkpoint_name(27), weights_only=True) for folder in (out, reference)
    )
    assert_same_state(ours, theirs)
    assert same_decisions(ours["settings"]["budget"], theirs["settings"]["budget"])
    assert ours["settings"]["extended"] == theirs["settings"]["extended"] == []

    moved = tmp_path / "moved"  # --resume PATH from the check's own checkpoint: the re-plan comes with it
    assert (
        train.main(options(corpus, moved, "--resume", str(reference / "checkpoints" / store.checkpoint_name(6)))) == 0
    )
    assert_same_state(torch.load(moved / "checkpoints" / store.checkpoint_name(27), weights_only=True), theirs)


def test_a_run_that_slows_after_its_check_shortens_at_the_late_check_and_completes(
    corpus, tmp_path, small_runs, machine
):
    """A 54-step plan (10.7 s a step) on a machine that steps in 9.5 s for 20 steps, then in 11.9 s: the check at
    step 28 sees the fast steps' median and lengthens the run to 61 steps; the late check, 4 steps later, times
    the slow ones and shortens it to 54, which it may (the decay of 54 steps starts after step 32), and
    the run completes within the budget. With the checks at the last step before the decay (29, then 35 of 60)
    it could not go below 58 steps, and stopped saved at step 56 of 58."""
    small_runs["tiny"] = 12.0
    machine.per_token, machine.burst, machine.burst_steps = {"tiny": 1 / 10.8}, 0.8, 20
    out = tmp_path / "run"
    assert train.main(options(corpus, out, "--eval-every", "0")) == 0
    plan = json.loads((out / "training_settings.json").read_text())["budget"]
    assert (plan["check"]["at_step"], plan["check"]["from_steps"], plan["check"]["to_steps"]) == (28, 54, 61)
    late = plan["late_check"]
    assert (late["at_step"], late["from_steps"], late["to_steps"], plan["steps"]) == (32, 61, 54, 54)
    status = json.loads((out / "run_status.json").read_text())
    assert (status["status"], status["step"]) == (store.COMPLETE, 54)
    assert 20 * 128 / 10.8 * 0.8 + 34 * 128 / 10.8 <= 600  # its steps' time: within the budget


WHOLE_PROBE = budget.PROBE_WARMUP_STEPS + budget.CPU_TIME_PROBE_STEPS  # its steps at one thread


@pytest.mark.parametrize(
    "burst, burst_steps, cpu_burst, replanned_from",
    [
        (2.0, WHOLE_PROBE, False, 26),  # the whole probe waits for a core: its CPU time is a quiet probe's
        (4.0, 3, True, 26),  # the warm-up and first two timed steps, CPU time too: it times on until they agree
        (2.0, WHOLE_PROBE, True, 13),  # the whole probe, CPU time too: a plan for half the tokens, re-planned
    ],
)
def test_a_burst_of_load_during_the_probe_does_not_shorten_the_run(
    corpus, tmp_path, planner, machine, burst, burst_steps, cpu_burst, replanned_from
):
    """The real probe (train.measure_speed) on a machine of 6 tokens/s, `burst` times slower for its first
    `burst_steps` steps: the plan comes out as a quiet probe's, or the check before its decay corrects its
    length; the run trains what the quiet one does (27 steps of 21.3 s and 7 validations of 1.8 s: 589 s of 600
    less the end's 3.6 s; the first plan 26, UNCOUNTED_SHARE short of it)."""
    machine.per_token = {"tiny": 1 / 6}
    quiet = tmp_path / "quiet"
    assert train.main(options(corpus, quiet, "--preset", "tiny")) == 0
    expected = json.loads((quiet / "training_settings.json").read_text())["budget"]
    assert (expected["check"]["from_steps"], expected["steps"]) == (26, 27)  # the check's end, not the cushion's
    machine.burst, machine.burst_steps, machine.cpu_burst, machine.steps = burst, burst_steps, cpu_burst, 0
    out = tmp_path / "busy"
    assert train.main(options(corpus, out, "--preset", "tiny")) == 0
    plan = json.loads((out / "training_settings.json").read_text())["budget"]
    assert (plan["check"]["from_steps"], plan["steps"]) == (replanned_from, 27)
    slower = burst if replanned_from == 13 else 1.0
    assert plan["candidates"][0]["tokens_per_second"] == pytest.approx(
        expected["candidates"][0]["tokens_per_second"] / slower
    )
    status = json.loads((out / "run_status.json").read_text())
    assert (status["status"], status["step"]) == (store.COMPLETE, 27)


@pytest.mark.parametrize(
    "wall, cpu, threads, seconds",
    [
        (2.0, 2.0, 1, 2.0),  # a quiet core: the wall time
        (2.0, 1.0, 1, 1.0),  # half the time waiting for a core (a busy loop beside it): the CPU time
        (2.0, 3.0, 2, 1.5),  # two threads, a busy machine: the CPU time over the threads
        (2.0, 5.0, 2, 2.0),  # more CPU time than the threads spend in a wall time (other threads): the wall
        (2.0, 0.5, 0, 0.5),  # no thread count: one
    ],
)
def test_a_cpu_probe_step_counts_the_time_the_process_works(wall, cpu, threads, seconds):
    assert budget.unloaded_step_seconds(wall, cpu, threads) == seconds


@pytest.mark.parametrize(
    "busy, own, wall, others",
    [(4.0, 2.0, 1.0, 2.0), (2.0, 2.0, 1.0, 0.0), (1.0, 2.0, 1.0, 0.0), (3.0, 0.0, 2.0, 1.5), (1.0, 0.0, 0.0, 0.0)],
)
def test_the_load_beside_the_run_is_the_machines_busy_time_less_its_own(busy, own, wall, others):
    assert budget.others_cores(busy, own, wall) == others


@pytest.mark.parametrize(
    "others, cores, threads, busy",
    [
        (0.3, 2, 2, False),  # a background daemon: within the margin
        (0.6, 2, 2, True),
        (2.0, 2, 2, True),  # the burst: one busy loop per core
        (2.0, 2, 1, True),
        (1.4, 2, 1, False),  # one core left free by a one-thread run, and most of it taken
        (5.0, 8, 2, False),  # six cores free
        (6.6, 8, 2, True),
    ],
)
def test_the_probe_is_beside_load_when_others_take_the_runs_cores(others, cores, threads, busy):
    assert budget.busy_beside(others, cores, threads) is busy


@pytest.mark.parametrize(
    "on_cpu, threads, world, waits",
    [(True, 2, 1, True), (True, 8, 1, True), (True, 1, 1, False), (False, 2, 1, False), (True, 2, 2, False)],
)
def test_only_a_cpu_probe_at_several_threads_waits_for_quiet(on_cpu, threads, world, waits):
    assert budget.waits_for_quiet(on_cpu, threads, world) is waits


@pytest.mark.parametrize("seconds, wait", [(60.0, 6.0), (300.0, 30.0), (3600.0, 60.0), (0.0, 0.0)])
def test_the_probes_wait_for_quiet_is_a_share_of_the_budget(seconds, wait):
    assert budget.quiet_wait_seconds(seconds) == wait


@pytest.mark.parametrize(
    "loads, threads, rate, said",
    [
        ([True, True, False], 2, 3.0, "measured again after"),  # busy beside the window, then quiet: measured again
        ([True] * 1000, 2, 0.75, "stayed busy for the 0 s"),  # never quiet within the wait: the first measure
        ([False], 2, 0.75, None),  # a slow machine, not a busy one: nothing to wait for
        ([True], 1, 0.75, None),  # one thread: its CPU time is its work; no wait (this fake spins, a real one not)
    ],
)
def test_a_probe_beside_load_waits_for_quiet_and_measures_again(
    corpus, tmp_path, machine, monkeypatch, capsys, loads, threads, rate, said
):
    """The real probe (train.measure_speed) at 3 tokens/s, 4x slower (CPU time too: OpenMP's threads spin)
    for its warm-up and first 5 timed steps (at one thread: its whole first window of 3), with /proc/stat's
    verdicts (`loads`: whether other load took the run's cores, one per look) faked."""
    from tinyllm.training import distributed

    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    monkeypatch.setattr(budget, "QUIET_POLL_SECONDS", 0.001)
    verdicts = iter(loads)
    monkeypatch.setattr(train, "beside_load", lambda work: (work(), next(verdicts)))
    machine.per_token = {"tiny": 1 / 3}
    machine.burst, machine.burst_steps, machine.cpu_burst = 4.0, 6, True
    settings = train.parse_args(options(corpus, tmp_path / "unused", "--budget", "1s"))
    info = distributed.DistInfo(rank=0, local_rank=0, world=1, device=torch.device("cpu"))
    capsys.readouterr()
    measure = train.measure_speed(settings, info, budget.quiet_wait_seconds(1.0))  # --budget 1s's
    assert measure("tiny", 2, 1e9, budget.probe_window("cpu", threads)).tokens_per_second == pytest.approx(rate)
    printed = capsys.readouterr().out
    assert (said in printed) if said else "--budget: tiny's probe" not in printed


@pytest.mark.parametrize("optimizer, kept", [(16 / 3, 16 / 3), (15.0, 32 / 3)])
def test_the_probe_s_micro_batches_are_its_steps_less_the_optimizer_s(
    corpus, tmp_path, machine, monkeypatch, optimizer, kept
):
    """A probe step of 64 tokens at 3 tokens/s (21.3 s) less its optimizer step timed alone (at most half the
    step): the micro-batches' speed."""
    from tinyllm.training import distributed

    monkeypatch.setattr(train, "optimizer_step_seconds", lambda training: optimizer)
    settings = train.parse_args(options(corpus, tmp_path / "unused"))
    info = distributed.DistInfo(rank=0, local_rank=0, world=1, device=torch.device("cpu"))
    speed = train.measure_speed(settings, info, 0.0)("tiny", 2, 1e9, budget.CPU_TIME_PROBE_STEPS)
    assert speed.optimizer_seconds == pytest.approx(kept)
    assert speed.tokens_per_second == pytest.approx(64 / (64 / 3 - kept))


def test_an_optimizer_step_is_timed_alone_on_real_gradients(corpus, tmp_path):
    """train.optimizer_step_seconds on a real tiny run: the optimizers step (the weights move), the time is
    positive, and the gradients it made are gone after."""
    from tinyllm.training import distributed

    settings = train.parse_args([*options(corpus, tmp_path / "unused"), "--preset", "tiny", "--target-tokens", "4096"])
    settings = dataclasses.replace(settings, run=dataclasses.replace(settings.run, budget=None))
    info = distributed.DistInfo(rank=0, local_rank=0, world=1, device=torch.device("cpu"))
    training = train.build_training(settings, info)
    before = [parameter.detach().clone() for parameter in training.model.parameters()]
    seconds = train.optimizer_step_seconds(training)
    assert seconds > 0
    assert any(not torch.equal(old, new) for old, new in zip(before, training.model.parameters()))
    assert all(parameter.grad is None for parameter in training.model.parameters())


def test_a_card_s_optimizer_step_is_timed_between_two_synchronizations(monkeypatch):
    """On a card the optimizer's kernels run after the host has queued them: each timed step is fenced by
    torch.cuda.synchronize on both sides, and its time is the wall clock's (the host's CPU time is not the card's)."""
    from types import SimpleNamespace

    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device: calls.append(("synchronize", str(device))))
    monkeypatch.setattr(train, "probe_batch", lambda training, rows, documents: None)
    weight = torch.ones(2, requires_grad=True)
    optimizer = SimpleNamespace(step=lambda: calls.append("step"))
    training = SimpleNamespace(
        device=torch.device("cuda", 0),
        session=SimpleNamespace(batch_size=2),
        data=SimpleNamespace(documents=False),
        loss_of=lambda batch: (weight * 2).sum(),
        optimizer=SimpleNamespace(parts={"muon": optimizer, "adamw": optimizer}),
        model=SimpleNamespace(zero_grad=lambda set_to_none: calls.append("zero_grad")),
    )
    assert train.optimizer_step_seconds(training) >= 0
    fenced = [("synchronize", "cuda:0"), "step", "step", ("synchronize", "cuda:0")]
    assert calls == fenced * train.OPTIMIZER_PROBE_STEPS + ["zero_grad"]
    assert weight.grad is not None  # one backward, its gradients stepped on


def test_the_plan_counts_the_session_s_seconds_before_it(corpus, tmp_path, small_runs):
    """A session that spent 60 s before its probe (start-up, the corpus' check) plans 60 s less of training
    (budget.time reads 0 here: the session started at -60)."""
    from tinyllm.training import distributed

    argv = options(corpus, tmp_path / "run", "--preset", "tiny", "--eval-every", "0")
    settings = train.parse_args(argv)
    info = distributed.DistInfo(rank=0, local_rank=0, world=1, device=torch.device("cpu"))
    given = given_options(train.build_parser(), argv)
    plans = [budget.settle(settings, info, corpus, given, lambda wait: None, started) for started in (0.0, -60.0)]
    available = 600 * (1 - budget.UNCOUNTED_SHARE)  # the run's steps, validation and test fit this, less 60 s
    assert plans[1].hours * 3600 <= available - 60 < plans[0].hours * 3600 <= available
    assert plans[1].steps < plans[0].steps


def test_a_run_without_a_budget_builds_no_probe(corpus, tmp_path):
    """budget.settle without --budget: no plan, and the probe's measure (of the budget's wait) is never built."""
    from tinyllm.training import distributed

    settings = train.parse_args(["--data", str(corpus), "--out", str(tmp_path / "run")])
    info = distributed.DistInfo(rank=0, local_rank=0, world=1, device=torch.device("cpu"))
    assert budget.settle(settings, info, corpus, set(), lambda quiet_wait: pytest.fail("probed")) is None


def test_a_corpus_too_short_for_any_budget_is_refused_before_the_probe(tmp_path):
    """A train split whose passes hold fewer than MIN_TOKENS: no budget is enough, so the line says so (it said
    "--budget 40s is too small ... give --budget 24s or more") and comes before the probe's seconds."""
    from tinyllm.training import distributed

    corpus = write_tiny_corpus(tmp_path / "corpus")
    train_tokens = corpus_format.load_manifest(corpus).split("train")["tokens"]
    assert train_tokens * budget.MAX_EPOCHS < budget.MIN_TOKENS
    settings = train.parse_args(["--data", str(corpus), "--out", str(tmp_path / "run"), "--budget", "1h"])
    info = distributed.DistInfo(rank=0, local_rank=0, world=1, device=torch.device("cpu"))
    with pytest.raises(UserError, match=rf"^--budget 1h: the corpus is too small .* train split of {train_tokens:,} "):
        budget.settle(settings, info, corpus, {"budget"}, lambda quiet_wait: pytest.fail("probed"))


def test_the_load_beside_work_is_read_around_it(monkeypatch):
    """train.beside_load: /proc/stat before and after the work; its own CPU time is not other load."""
    from tinyllm.model import hardware

    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    for busy_after, beside in ((0.0, False), (1.0, True)):
        reads = iter([hardware.CpuTimes(10.0, 2), hardware.CpuTimes(10.0 + busy_after, 2)])
        monkeypatch.setattr(hardware, "read_cpu_times", reads.__next__)
        assert train.beside_load(lambda: time.sleep(0.05) or "done") == ("done", beside)
    monkeypatch.setattr(hardware, "read_cpu_times", lambda: None)  # no /proc/stat: never beside load
    assert train.beside_load(lambda: 7) == (7, False)


@pytest.mark.parametrize("device, seconds", [("cpu", 1.5), ("cuda", 4.0), ("mps", 4.0)])
def test_the_probe_reads_cpu_time_on_a_cpu_only(monkeypatch, device, seconds):
    """On an accelerator the host's CPU time is not the device's: the probe keeps the wall time."""
    from types import SimpleNamespace

    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    step = SimpleNamespace(seconds=4.0, cpu_seconds=3.0)
    training = SimpleNamespace(device=torch.device(device), train_step=lambda: step)
    assert train.probe_step_seconds(training) == seconds


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_an_explicit_preset_wins_and_bad_budgets_are_one_line(corpus, tmp_path, small_runs):
    out = tmp_path / "run"
    assert train.main(options(corpus, out, "--preset", "tiny", "--stop-after-steps", "1")) == 0
    assert json.loads((out / "training_settings.json").read_text())["budget"]["preset"] == "tiny"
    assert small_runs["probed"] == ["tiny"]
    with pytest.raises(UserError, match="--budget must be a duration such as 11.5h, 30m, 90s or 1h30m, got 3 hours"):
        train.parse_args(options(corpus, out, "--budget", "3 hours"))
    with pytest.raises(UserError, match=r"^--budget 1s is too small: .* give --budget [\d.]+[sm] or more$"):
        train.main(options(corpus, tmp_path / "small", "--budget", "1s"))
    with pytest.raises(UserError, match="instead of --epochs"):
        train.main(options(corpus, tmp_path / "epochs", "--epochs", "1"))


def test_the_probe_times_real_steps_and_predicts_what_it_cannot_afford(corpus, tmp_path):
    """Real train.py steps (no time limit: all measured); with none left after the pair, micro is predicted
    from nano's FLOP/s times the pair's gain."""
    from tinyllm.training import distributed

    settings = train.parse_args(options(corpus, tmp_path / "unused"))
    info = distributed.DistInfo(rank=0, local_rank=0, world=1, device=torch.device("cpu"))
    shapes = {name: model_config.resolve_preset(name, context=32) for name in ("tiny", "nano", "micro")}
    measure = train.measure_speed(settings, info, budget.quiet_wait_seconds(600.0))  # --budget 10m's
    measured = budget.probe(measure, info, shapes, 2, 1e9, 300, budget.PROBE_STEPS)
    assert [(c.preset, c.probed) for c in measured] == [("tiny", True), ("nano", True), ("micro", True)]
    assert all(c.tokens_per_second > 0 for c in measured) and measured[1].pair_ratio > 0
    predicted = budget.probe(measure, info, shapes, 2, 0.0, 300, budget.PROBE_STEPS)
    assert [(c.preset, c.probed) for c in predicted] == [("tiny", True), ("nano", True), ("micro", False)]
    gain = budget.pair_gain(predicted[:2])
    assert predicted[2].tokens_per_second == pytest.approx(
        budget.predicted_rate(predicted[1], shapes, "micro", 300, gain)
    )


@pytest.mark.parametrize(
    "asked, resumes, outcome",
    [
        ("30m", True, "kept"),  # the plan made for this budget
        ("30m", False, "kept"),
        ("1h", False, "anew"),  # no checkpoint to continue (a run stopped before its first save): plans anew
        ("1h", True, "refused"),  # a resume under another budget: one line, before any probe
    ],
)
def test_only_a_plan_for_the_same_budget_is_kept_and_a_resume_under_another_is_refused(
    tmp_path, monkeypatch, asked, resumes, outcome
):
    plan = budget.choose(request("30m"), CANDIDATES, MODEL)
    monkeypatch.setattr(store, "continues_checkpoint", lambda out, resume: resumes)
    assert budget.kept_plan(tmp_path, "auto", asked) is None  # no run folder yet
    (tmp_path / "training_settings.json").write_text(json.dumps({"budget": plan.as_record()}))
    if outcome == "refused":
        with pytest.raises(UserError, match=r"^settings differ from the --budget 30m plan .*: budget: 30m -> 1h\. "):
            budget.kept_plan(tmp_path, "auto", asked)
    else:
        kept = budget.kept_plan(tmp_path, "auto", asked)
        assert (budget.Plan.from_record(kept) if kept else None) == (plan if outcome == "kept" else None)


@pytest.mark.parametrize(
    "argv, differences",
    [
        ([], []),  # the plan applies
        (["--preset", "nano", "--target-tokens", "14106624"], []),  # the plan's own values (RUN/config.toml's)
        (["--preset", "micro"], ["preset: nano -> micro"]),
        (["--target-tokens", "2e6"], ["target_tokens: 14106624 -> 2000000"]),
        (["--preset", "tiny", "--target-tokens", "1"], ["preset: nano -> tiny", "target_tokens: 14106624 -> 1"]),
        (["--layers", "8"], []),  # not the plan's: the checkpoint's comparison names it
    ],
)
def test_a_resume_names_the_planned_options_it_would_drop(argv, differences):
    plan = budget.choose(request("30m"), CANDIDATES, MODEL)  # nano, 14,090,240 tokens
    settings = train.parse_args(["--budget", "30m", *argv])
    assert budget.plan_differences(plan, settings.run, given_options(train.build_parser(), argv)) == differences


def test_a_resumed_budget_run_refuses_another_preset_in_one_line(tmp_path):
    """The kept plan is applied over --preset / --target-tokens: given otherwise, the resume stops naming them
    (it used to continue with the plan's and write the ignored option into resume_command)."""
    plan = budget.choose(request("30m"), CANDIDATES, MODEL)
    (tmp_path / "training_settings.json").write_text(json.dumps({"budget": plan.as_record()}))
    argv = ["--budget", "30m", "--preset", "micro", "--out", str(tmp_path)]
    settings = train.parse_args(argv)
    info = distributed.DistInfo(rank=0, local_rank=0, world=1, device=torch.device("cpu"))
    given = given_options(train.build_parser(), argv)
    with pytest.raises(UserError) as caught:
        budget.settle(settings, info, tmp_path, given, lambda *args: pytest.fail("a resume must not probe"))
    message = str(caught.value)
    assert "\n" not in message and "preset: nano -> micro" in message and "--budget 30m plan" in message


def test_a_resume_under_another_budget_is_refused_before_the_probe(tmp_path, monkeypatch):
    """--budget 1h on a run planned for 30m that has a checkpoint: refused at once, not after minutes of
    probing (the resume's settings check used to refuse it only after a new plan was made)."""
    plan = budget.choose(request("30m"), CANDIDATES, MODEL)
    (tmp_path / "training_settings.json").write_text(json.dumps({"budget": plan.as_record()}))
    monkeypatch.setattr(store, "continues_checkpoint", lambda out, resume: True)
    argv = ["--budget", "1h", "--out", str(tmp_path)]
    info = distributed.DistInfo(rank=0, local_rank=0, world=1, device=torch.device("cpu"))
    given = given_options(train.build_parser(), argv)
    with pytest.raises(UserError, match=r"budget: 30m -> 1h\. A resume keeps the plan's budget"):
        budget.settle(train.parse_args(argv), info, tmp_path, given, lambda *args: pytest.fail("no probe"))


@pytest.fixture
def bench_budget(monkeypatch):
    """bench/bench_budget.py as a module (bench/ on sys.path only while the test that uses it runs)."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "bench"))
    return importlib.import_module("bench_budget")


def test_the_bench_fit_recovers_a_known_loss_model(bench_budget):
    truth = budget.LossModel(e=1.2, n_c=2e5, alpha_n=0.3, d_c=5e5, alpha_d=0.4)
    runs = [{"parameters": n, "tokens": d, "bpb": truth.loss(n, d)} for n in (1e5, 8e5, 5e6) for d in (2e5, 8e5, 3.2e6)]
    model, rms = bench_budget.fit(runs)
    assert rms < 1e-6
    assert dataclasses.astuple(model) == pytest.approx(dataclasses.astuple(truth), rel=1e-3)


def test_the_bench_refuses_a_fit_or_a_default_run_without_a_sweep_in_one_line(bench_budget, tmp_path):
    """bench_budget.py --fit-only on too few runs, or --default-only before the probe: an error line naming
    the results file, nothing trained."""
    runs = [{"preset": "tiny", "fraction": 1.0, "parameters": 98688, "tokens": 1e6, "bpb": 1.5, "steps": 100}] * 5
    (tmp_path / "results.json").write_text(json.dumps({"runs": runs, "candidates": []}))
    with pytest.raises(UserError, match=r"results\.json holds 5 runs of at least 100 steps; the fit of 5 constants"):
        bench_budget.main(["--work", str(tmp_path), "--fit-only"])
    with pytest.raises(UserError, match=r"results\.json has no probe yet"):
        bench_budget.main(["--work", str(tmp_path), "--default-only"])


@pytest.mark.parametrize(
    "grace, step, clock, run, stop",
    [
        # 2 steps of 20 s and the end (2 x 1 s evaluations, a 1 s write): 603 s of 600
        (0.03, 25, (560.0, 20.0, 20.0), (27, 600, 1.0, 1.0), False),
        (0.0, 25, (560.0, 20.0, 20.0), (27, 600, 1.0, 1.0), True),  # --max-hours: no grace; its hard end keeps 10 s
        # 5 steps left: 663 s, past the grace (618 s); another step and save (44 s) still fit before it: steps on
        (0.03, 22, (560.0, 20.0, 20.0), (27, 600, 1.0, 1.0), False),
        (0.03, 22, (580.0, 20.0, 20.0), (27, 600, 1.0, 1.0), True),  # they no longer do: stopped saved
        # bench_budget_wall's 123 s budget (2026-12-05): 49 steps of 0.21 s typical (0.30 the slowest) at 112.6 s:
        # 123.4 s at the steps' median, within the grace (126.7 s); at the slowest and 10 s more it stopped there
        (0.03, 486, (112.6, 0.30, 0.21), (535, 123, 0.2, 0.1), False),
        (0.03, 465, (125.6, 0.30, 0.21), (535, 123, 0.2, 0.1), True),  # 70 steps left: 140.8 s, past the grace
        # its 67 s budget at two threads (2026-12-05 19:10): 46 steps of 0.275 s at 55.6 s and a 1 s end: 69.25 s,
        # 3.4% past: at 3% it steps on while a step and save fit before 69.0 s; at 5% it finishes
        (0.03, 165, (55.6, 0.294, 0.275), (211, 67, 0.45, 0.1), False),
        (0.03, 165, (67.5, 0.294, 0.275), (211, 67, 0.45, 0.1), True),
        (0.05, 165, (55.6, 0.294, 0.275), (211, 67, 0.45, 0.1), False),
        # an 89 s budget (2026-12-06 08:18): two steps of 1.1 s among 0.28 s ones at 77 s, 42 steps left: 123 s at
        # that pace, past the grace (93.5 s); it stopped saved there while the 10 s exit reserve counted, and
        # now steps on to see whether the burst passes (a step and save: 3.1 s)
        (0.05, 188, (77.0, 1.133, 1.1), (230, 89, 0.3, 0.1), False),
        (0.05, 188, (77.0, 1.133, 0.28), (230, 89, 0.3, 0.1), False),  # it passed: 89.6 s, it finishes
        (0.05, 200, (90.5, 1.133, 1.1), (230, 89, 0.3, 0.1), True),  # it did not: stopped saved at 1.02x
    ],
)
def test_a_budget_run_late_near_its_end_finishes_within_its_grace(grace, step, clock, run, stop):
    elapsed, slowest, typical = clock
    total, budget_seconds, evaluation, write = run
    clock = train.StepClock(
        elapsed=elapsed, slowest_step=slowest, typical_step=typical, slowest_eval=evaluation, last_write=write
    )
    flags = train.StepFlags(total_steps=total, max_hours=budget_seconds / 3600, finish_grace=grace)
    end = train.plan_step_end(step, clock, flags)
    assert end.stop is stop and end.save is stop
    assert budget.finish_grace(0, {"budget": "10m"}) == budget.FINISH_GRACE and budget.finish_grace(1.0, None) == 0


@pytest.mark.parametrize(
    "steps, typical",
    [
        ([], 0.0),
        ([0.2] * 20 + [0.3], 0.2),  # one slow step is not a pace
        ([0.2] * 20 + [0.6, 0.6], 0.6),  # two are: the machine has slowed down
        ([0.6] * 10 + [0.2] * 3, 0.6),  # a brief fast moment is not either
        ([9.0] * 20 + [0.2] * 16, 0.2),  # the steps before the last 16 do not count
    ],
)
def test_a_budget_s_finish_is_planned_at_the_recent_pace(steps, typical):
    clocks = train.SessionClocks(started=0.0)
    for seconds in steps:
        clocks.stepped(seconds)
    assert clocks.typical_step == pytest.approx(typical)


def test_a_session_limit_counts_from_the_process_launch():
    """The command line's clock starts at the process's launch (its imports included), before main() runs."""
    import time

    launched = train.process_launch()
    assert launched <= time.monotonic() - 0.1  # this process started (and imported torch) before the test
    assert time.monotonic() - launched < 24 * 3600
