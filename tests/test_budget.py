"""--budget: the budget strings, the planner (table tests), the plan kept on resume, bitwise resume."""

from __future__ import annotations

import dataclasses
import importlib
import json
from pathlib import Path

import pytest
import torch
from tiny_runs import write_tiny_corpus

from tinyllm.common import UserError, given_options
from tinyllm.model import config as model_config
from tinyllm.outputs import export_hf
from tinyllm.store import checkpoint_store as store
from tinyllm.training import budget, train

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
        (5e6, 256, 16_384),  # 5e6 / 300 = 16,667 -> the power of two below
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


def request(text: str, **fields) -> budget.Request:
    return budget.Request(budget=text, seconds=budget.budget_seconds(text), **fields)


@pytest.mark.parametrize(
    "text, fields, preset, tokens",
    [
        ("2m", {}, "tiny", 2_158_592),  # 108 s of training: tiny's tokens beat nano's parameters
        ("30m", {}, "nano", 12_943_360),  # long enough for nano's parameters to beat tiny's extra tokens
        ("10h", {}, "nano", 259_129_344),
        ("100h", {}, "micro", 647_888_896),
        ("10h", {"max_tokens": 5_000_000}, "micro", 4_997_120),  # a small corpus: 4 passes, then the largest model
        ("30m", {"target_tokens": 1_000_000}, "micro", 1_000_000),  # explicit tokens: the largest that fits them
        ("30m", {"target_tokens": 20_000_000}, "tiny", 20_000_000),  # only tiny trains 20M tokens in 27 minutes
        ("2m", {"spent_seconds": 30.0}, "tiny", 1_556_480),  # the probe's time comes out of the budget
    ],
)
def test_the_planner_picks_the_lowest_predicted_loss_that_fits(text, fields, preset, tokens):
    plan = budget.choose(request(text, **fields), CANDIDATES, MODEL)
    assert (plan.preset, plan.target_tokens) == (preset, tokens)
    assert plan.hours <= budget.budget_seconds(text) * (1 - budget.RESERVE) / 3600
    assert plan.predicted_bpb == min(
        c["bpb"] for c in plan.candidates if c["hours"] <= plan.hours + 1e-9 or c["preset"] == preset
    )
    assert plan.tokens_per_step * plan.steps == plan.target_tokens or "target_tokens" in fields
    assert plan.target_tokens <= fields.get("max_tokens", plan.target_tokens)
    assert plan.global_batch_blocks * model_config.PRESETS[preset].context == plan.tokens_per_step


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


def test_the_plan_record_reads_back_and_shows_on_the_card():
    plan = budget.choose(request("30m"), CANDIDATES, MODEL)
    record = json.loads(json.dumps(plan.as_record()))
    assert budget.Plan.from_record(record) == plan
    card = export_hf.model_card(
        {
            "parameters": 1000,
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
# train.py --budget: the plan applied, recorded and kept; a resumed run bit for bit the uninterrupted one


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_tiny_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture
def small_runs(monkeypatch):
    """A planner for test-sized runs, with a probe that returns fixed speeds (the probe itself: below)."""
    monkeypatch.setattr(budget, "MIN_BATCH_TOKENS", 128)
    monkeypatch.setattr(budget, "MIN_TOKENS", 512)
    speeds = {"tiny": 30.0, "nano": 1.0}

    def probe(settings, info, presets, micro_batch, seconds, vocab):
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
        "1m",
        "--eval-every",
        "4",
        "--eval-batches",
        "1",
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


def test_a_resumed_budget_run_keeps_its_plan_and_is_the_uninterrupted_one(
    corpus, tmp_path, small_runs, monkeypatch, capsys
):
    reference = tmp_path / "reference"
    assert train.main(options(corpus, reference)) == 0
    recorded = json.loads((reference / "training_settings.json").read_text())
    plan = recorded["budget"]  # 54 s at 30 tokens/s: 1,620 tokens, 12 steps of 4 blocks of 32
    assert (plan["preset"], plan["target_tokens"], plan["steps"], plan["global_batch_blocks"]) == ("tiny", 1536, 12, 4)
    assert recorded["training"]["target_tokens"] == 1536 and recorded["training"]["budget"] == "1m"
    assert recorded["runtime"]["batch_size"] * recorded["runtime"]["grad_accum"] == 4
    assert "--budget 1m: tiny" in capsys.readouterr().out

    out = tmp_path / "run"
    assert train.main(options(corpus, out, "--stop-after-steps", "5")) == 0
    small_runs["tiny"] = 300.0  # a faster machine now: a new plan would differ, the run must not
    monkeypatch.setattr(budget, "probe", lambda *args: pytest.fail("a resume must not probe or re-plan"))
    assert train.main(options(corpus, out)) == 0
    assert "(the run's plan, made at its start: kept)" in capsys.readouterr().out
    ours, theirs = (
        torch.load(folder / "checkpoints" / store.checkpoint_name(12), weights_only=True) for folder in (out, reference)
    )
    assert store.tensor_differences(ours["model"], theirs["model"], "model") == []
    assert store.tensor_differences(ours["optimizer"], theirs["optimizer"], "optimizer") == []
    assert ours["settings"]["budget"] == theirs["settings"]["budget"] == plan

    moved = tmp_path / "moved"  # --resume PATH into another folder: the plan comes with the checkpoint
    assert train.main(options(corpus, moved, "--resume", str(out / "checkpoints" / store.checkpoint_name(4)))) == 0
    assert "(the run's plan, made at its start: kept)" in capsys.readouterr().out
    final = torch.load(moved / "checkpoints" / store.checkpoint_name(12), weights_only=True)
    assert store.tensor_differences(final["model"], theirs["model"], "model") == []
    assert final["settings"]["budget"] == plan


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


def test_a_budget_run_slower_than_its_probe_stops_saved_at_the_budget(
    corpus, tmp_path, small_runs, monkeypatch, capsys
):
    """Each step here seems to take 5 s of a 1 m budget planned for 12 steps: the session stops saved once
    another step and save might not fit (step 10), and the same command finishes the run."""
    out, read = tmp_path / "run", train.SessionClocks.read
    steps = iter(range(1, 100))

    def slow(self, *args):
        return dataclasses.replace(read(self, *args), elapsed=5.0 * next(steps))

    monkeypatch.setattr(train.SessionClocks, "read", slow)
    assert train.main(options(corpus, out)) == 0
    record = json.loads((out / "run_status.json").read_text())
    assert (record["status"], record["step"], record["total_steps"]) == (store.NEEDS_RESUME, 10, 12)
    assert record["reason"] == "stopped by --budget 1m (this machine ran slower than its probe)"
    monkeypatch.setattr(train.SessionClocks, "read", read)
    assert train.main(options(corpus, out)) == 0
    assert json.loads((out / "run_status.json").read_text())["status"] == store.COMPLETE


def test_an_explicit_preset_wins_and_bad_budgets_are_one_line(corpus, tmp_path, small_runs):
    out = tmp_path / "run"
    assert train.main(options(corpus, out, "--preset", "tiny", "--stop-after-steps", "1")) == 0
    assert json.loads((out / "training_settings.json").read_text())["budget"]["preset"] == "tiny"
    assert small_runs["probed"] == ["tiny"]
    with pytest.raises(UserError, match="--budget must be a duration such as 11.5h, 30m, 90s or 1h30m, got 3 hours"):
        train.parse_args(options(corpus, out, "--budget", "3 hours"))
    with pytest.raises(UserError, match=r"^--budget 1s is too small: .* give --budget \d+s or more$"):
        train.main(options(corpus, tmp_path / "small", "--budget", "1s"))
    with pytest.raises(UserError, match="instead of --epochs"):
        train.main(options(corpus, tmp_path / "epochs", "--epochs", "1"))


def test_the_probe_times_real_steps_and_predicts_what_it_cannot_afford(corpus, tmp_path):
    from tinyllm.training import distributed

    settings = train.parse_args(options(corpus, tmp_path / "unused"))
    info = distributed.DistInfo(rank=0, local_rank=0, world=1, device=torch.device("cpu"))
    shapes = {name: model_config.resolve_preset(name, context=32) for name in ("tiny", "nano")}
    measured = budget.probe(train.measure_speed(settings, info), info, shapes, micro_batch=2, seconds=1e9, vocab=300)
    assert [(c.preset, c.probed) for c in measured] == [("tiny", True), ("nano", True)]
    assert all(c.tokens_per_second > 0 for c in measured)
    predicted = budget.probe(train.measure_speed(settings, info), info, shapes, micro_batch=2, seconds=0.0, vocab=300)
    assert [(c.preset, c.probed) for c in predicted] == [("tiny", True), ("nano", False)]
    ratio = model_config.flops_per_token(shapes["tiny"], 300) / model_config.flops_per_token(shapes["nano"], 300)
    assert predicted[1].tokens_per_second == pytest.approx(predicted[0].tokens_per_second * ratio)


def test_only_a_plan_for_the_same_budget_is_read_back(tmp_path):
    plan = budget.choose(request("30m"), CANDIDATES, MODEL)
    assert budget.recorded_plan(tmp_path, "30m") is None  # no run folder yet
    (tmp_path / "training_settings.json").write_text(json.dumps({"budget": plan.as_record()}))
    assert budget.Plan.from_record(budget.recorded_plan(tmp_path, "30m")) == plan
    assert budget.recorded_plan(tmp_path, "1h") is None  # another budget plans anew (and the resume refuses it)


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
