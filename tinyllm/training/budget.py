"""--budget: the run that minimises the predicted final loss within a time budget (docs/budget.md).

    python train.py --data CORPUS --out RUN --budget 11.5h                 # one session
    python train.py --data CORPUS --out RUN --budget 30h --max-hours 11.5  # three sessions of one run

Before step 1 every candidate preset's training speed is measured on the run's devices and world size
(`probe`: a few real train.py steps each; the larger ones, where that costs too much, predicted from
the largest one measured, and said so), then `choose` (pure, table-tested) picks the preset, the token
count and the batch whose predicted final loss (`LossModel`, fitted by bench/bench_budget.py on real
text) is lowest within the budget; the learning rates follow train.py's recipe rule for that model.
The plan is made once: it is recorded in training_settings.json and a resume reads it back
(`recorded_plan`), so a faster or slower later session changes how many sessions the run takes, never
the run. An explicit --preset (or any shape option) or --target-tokens wins over the plan for that choice.
Without --max-hours the budget is also each session's time limit (`session_limit`): a machine slower than
its probe stops saved, never past the budget.
"""

from __future__ import annotations

import dataclasses
import math
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from tinyllm.common import UserError, read_json_or, say
from tinyllm.data import build as data
from tinyllm.data import corpus_format
from tinyllm.model import config as model_config
from tinyllm.model import hardware
from tinyllm.outputs import callbacks
from tinyllm.store import checkpoint_store
from tinyllm.training import distributed, optimization, train_data

# ----------------------------------------------------------------------------------------------
# Budget strings: "11.5h", "30m", "90s", "2d", "1h30m".

UNIT_SECONDS = {"d": 86400, "h": 3600, "m": 60, "min": 60, "s": 1}
DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(min|d|h|m|s)")


def budget_seconds(text: str) -> float:
    """The seconds of a budget string such as 11.5h, 30m, 90s, 2d or 1h30m; ValueError when it is none."""
    compact = str(text).strip().lower().replace(" ", "")
    parts = DURATION_PART.findall(compact)
    if not compact or "".join(number + unit for number, unit in parts) != compact:
        raise ValueError(f"not a duration: {text!r} (write e.g. 11.5h, 30m, 90s or 1h30m)")
    seconds = sum(float(number) * UNIT_SECONDS[unit] for number, unit in parts)
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"not a positive duration: {text!r}")
    return seconds


def budget_problem(text: str) -> str | None:
    """--budget's check (common.option): None when `text` is a duration."""
    try:
        budget_seconds(text)
    except ValueError:
        return "be a duration such as 11.5h, 30m, 90s or 1h30m"
    return None


def duration_text(seconds: float) -> str:
    """A duration as --budget takes it, rounded up: 25s, 7.5m, 11.6h."""
    if seconds < 120:
        return f"{math.ceil(seconds)}s"
    if seconds < 7200:
        return f"{math.ceil(seconds / 6) / 10:g}m"
    return f"{math.ceil(seconds / 360) / 10:g}h"


# ----------------------------------------------------------------------------------------------
# The loss model: held-out bits per byte after D training tokens of a model with N non-embedding
# parameters, under train.py's recipe and this module's batch rule. Fitted by bench/bench_budget.py
# (the data, the fit and the command: docs/budget.md).


@dataclass(frozen=True)
class LossModel:
    """L(N, D) = E + ((N_c / N)^(alpha_N / alpha_D) + D_c / D)^alpha_D, in bits per byte: Kaplan et al.'s
    (2020) joint form with an irreducible E. Unlike Chinchilla's additive E + A / N^alpha + B / D^beta,
    the data term saturates at a floor set by N, so a larger model gains more from more tokens: the
    project's sweeps show it (tiny and nano 0.08 bits/byte apart at 0.6M tokens, 0.14 at 7M)."""

    e: float
    n_c: float
    alpha_n: float
    d_c: float
    alpha_d: float
    error: float = 0.0  # the fit's rms error over its runs, bits/byte: how far apart two predictions must be to rank

    def loss(self, parameters: float, tokens: float) -> float:
        return self.e + ((self.n_c / parameters) ** (self.alpha_n / self.alpha_d) + self.d_c / tokens) ** self.alpha_d

    def __str__(self) -> str:
        return (
            f"LossModel(e={self.e:.4f}, n_c={self.n_c:.4g}, alpha_n={self.alpha_n:.3f}, d_c={self.d_c:.4g}, "
            f"alpha_d={self.alpha_d:.3f}, error={self.error:.4f})"
        )


# bench/bench_budget.py, 2026-12-03 (the recipe after round 2's fourth pass): the 12 runs of at least 100 steps,
# rms error 0.0135 bits/byte (docs/budget.md)
LOSS_MODEL = LossModel(e=1.0487, n_c=7366, alpha_n=0.428, d_c=1.529e05, alpha_d=0.415, error=0.0135)
# Two predictions closer than this many of the fit's errors (0.081 bits/byte) are a tie, and the larger model
# takes it: the fit's ranking of tiny and nano on a text it was not fitted on is off by up to 0.1 (English man
# pages: predicted tiny 0.047-0.072 ahead, nano 0.04-0.085 better; of 10 plans of tiny at margins 0.047-0.072 on
# three texts, 8 ended 2.4-4.4% behind the fixed nano). The widest margin measured nano's is 0.072, the narrowest
# tiny's clearly, the budget sweep's 2.5 minutes, 0.133 (tiny by 0.099); its 5 minutes (0.047, tiny by 0.041) is
# now a tie that costs 2.7% (docs/budget.md "Ties").
TIE_ERRORS = 6.0


# ----------------------------------------------------------------------------------------------
# The plan (pure).

UNCOUNTED_SHARE = 0.02  # of the budget, kept for what the plan does not count: checkpoint writes, the report, a
# compile, --eval-tasks in the loop (the steps, validations, test, start-up and probe are counted: run_seconds). A flat
# 10% until 2026-12-07 planned the first length 8-16% short of what the check found fitted (docs/budget.md "The
# first plan counted")
STEPS_PER_RUN = 250  # the batch rule aims at this many optimizer steps or more (up to twice), up to STEPS_KNEE_BATCH.
# At equal tokens 250 steps of 8,192 matched 500 (2.05M tokens), 300 matched 600 (2.46M) and 115 matched 230 (0.5M),
# while 160 lost 0.3-1.2% to 320 (1.31M, 2.62M) and 200 lost 0.2-0.8% to 400 (3.28M), 12 of 12: more than the larger
# step saves in optimizer time (a CPU's nano: 4.5% at 8,192 tokens a step, 1.3% at 16,384). bench/RESULTS.md "The
# batch rule at 250 steps"; 300 until 2026-12-06, 150 until 2026-12-07
STEPS_KNEE_BATCH = 8192  # above this batch (tokens a step) a batch needs STEPS_PER_RUN x batch / STEPS_KNEE_BATCH
# steps, so the batch grows as the root of the tokens: 250 steps of 16,384 lost 0.3% to 500 of 8,192 at 4.1M tokens
# (12 MB changelogs), 250 of 32,768 lost 1.2-3.3% to 500 of 16,384 at 8.2M (4 of 4: the changelogs and 21 MB of
# Linux's documentation), where 500 of 16,384 matched 1,000 of 8,192 (0.9998x, 0.9992x); 500 of 32,768 lost 0.66% to
# 1,000 of 16,384 at 16.4M (one seed). bench/RESULTS.md "The batch grows as the root of the tokens"
MIN_BATCH_TOKENS = 4096  # at equal tokens over every held-out block (one thread, two seeds), 2,048 tokens a step
# against 4,096: KJV 0.990-0.997x (nano), 0.996-0.998x (tiny), changelogs 1.004-1.006x, man pages 1.002-1.009x (nano):
# 1.0001x on the mean, one optimizer step more per 4,096 tokens; 1,024 worse than 2,048 by 1.0-2.7% in 6 of 6. (2,048
# from 2026-12-06 05:30 to 12:00, read off a quarter of the test blocks: bench/RESULTS.md "Held-out scores over the
# same blocks")
MAX_BATCH_TOKENS = 131_072
MIN_TOKENS = 327_680  # the smallest sensible run (80 steps of 4,096). Between the measured sides: the 4 plans whose
# nano candidate fell at 335,872-403,456 tokens (a burst's) became tiny under 409,600 and ended 0.5-5% behind the fixed
# nano, nano at 409,600 was 0.9705x; at 1.5 MB tiny beat nano's 151,552-196,608 tokens by 1.1-8.2% (bench/RESULTS.md
# "The smallest sensible run")
MIN_STEPS = MIN_TOKENS // MIN_BATCH_TOKENS
MAX_EPOCHS = 4  # at most this many passes over the train split: repeated tokens are worth less (Muennighoff
# et al. 2023: up to ~4 epochs nearly as good as new data), which the loss model does not know ...
SMALL_CORPUS_EPOCHS = 2  # ... and on a train split of few tokens per vocabulary entry, this many: more overfit
TOKENS_PER_VOCAB_ENTRY = 100  # the line between them (measured on both sides: docs/budget.md "Repeated tokens")


def max_passes(train_tokens: float, vocab: int) -> int:
    """How many passes over a train split of `train_tokens` a plan may train, for a corpus of `vocab` tokens:
    MAX_EPOCHS, or SMALL_CORPUS_EPOCHS where the split holds fewer than TOKENS_PER_VOCAB_ENTRY tokens a
    vocabulary entry. Measured (nano, 4 passes against 2): at 38-48 tokens an entry (1.5 MB texts at 8,192)
    3-7% worse, at 65-75 (2.5 MB) 0.6-3.5% worse; at 107-112 (4 MB) about even (-1.2% to +1.4%); at 443-595
    (0.6 MB at 512) 4-6% better, and the budget sweep's corpus (478) gained up to 4 passes. The embedding and
    the head are what memorise: few tokens a row, and a repeated pass fits the train split's rare tokens
    instead of the text."""
    return MAX_EPOCHS if train_tokens >= TOKENS_PER_VOCAB_ENTRY * vocab else SMALL_CORPUS_EPOCHS


def vocabulary_note(preset: str, vocab: int, asked: int) -> str | None:
    """One line for a plan whose model `preset` measured better on a larger vocabulary than the corpus' `vocab`
    (data.model_vocab_size); None where the corpus' is what it measured best at, where the comparison was not
    made, or where data.py was `asked` for as many (the text supports no more). The corpus, built before the
    plan, cannot change under it."""
    better = data.model_vocab_size(vocab, preset)
    if max(vocab, asked) >= better:
        return None
    return (
        f"  vocabulary: this corpus has {vocab:,} tokens; micro (4.7M non-embedding parameters) measured 0.1-2.5% "
        f"better at {better:,} or more than at 8,192 in the same time (tiny and nano: best at 8,192), so a corpus "
        f"built for it (`data.py --preset {preset}`, or `--vocab-size {better}`) may train this model better "
        "(docs/data.md#the-vocabulary)"
    )


@dataclass(frozen=True)
class Candidate:
    """One preset as this machine trains it: its non-embedding parameters and the global tokens per
    second of its steps, measured (`probed`) or predicted from a measured one."""

    preset: str
    parameters: int
    context: int
    tokens_per_second: float  # of its micro-batches' forwards and backwards, the optimizer's step apart
    probed: bool
    # measured after a smaller measured preset: its speed over the one predicted from that preset's FLOP/s
    # (the pair's gain; None: not a measured pair); predicted: the gain its prediction carries (None: none)
    pair_ratio: float | None = None
    optimizer_seconds: float = 0.0  # one optimizer step's (once per step, whatever the batch)


@dataclass(frozen=True)
class ProbeSpeed:
    """A probe's measure of one preset: the global tokens/s of its micro-batches (forward and backward) and
    the seconds of one optimizer step, which a step of many micro-batches takes once."""

    tokens_per_second: float
    optimizer_seconds: float = 0.0


@dataclass(frozen=True)
class Request:
    """What the plan must honour: the budget, the session length, the world size and the explicit options."""

    budget: str
    seconds: float
    session_hours: float = 0.0  # --max-hours (0: one session)
    world: int = 1
    target_tokens: int | None = None  # explicit --target-tokens
    spent_seconds: float = 0.0  # this session's before its plan (start-up and the probe), out of the budget
    start_seconds: float = 0.0  # a session's start-up before its probe, which each later session takes again
    validation_tokens: int = 0  # the tokens one validation scores ...
    test_tokens: int = 0  # ... and the test evaluation at the end
    eval_every: int | None = None  # --eval-every (None: its default, callbacks.default_eval_every)
    train_tokens: float = math.inf  # the train split's tokens (a mixture: inf, not capped) ...
    max_passes: int = MAX_EPOCHS  # ... over which the plan trains at most this many passes (max_passes)

    @property
    def max_tokens(self) -> float:
        return self.max_passes * self.train_tokens


@dataclass(frozen=True)
class Plan:
    """The run --budget chose; recorded (as_record) and read back on resume (from_record)."""

    budget: str
    preset: str
    parameters: int
    target_tokens: int
    global_batch_blocks: int
    tokens_per_step: int
    steps: int
    hours: float  # predicted hours of training and evaluation; start-up, probe and UNCOUNTED_SHARE on top
    sessions: int
    predicted_bpb: float
    why: str
    candidates: tuple[dict, ...]
    lr: float | None = None  # the recipe rule's, filled in by settle
    muon_lr: float | None = None
    length_given: bool = False  # --target-tokens was given: the length is the user's, never re-planned
    check: dict | None = None  # the check against the run's own steps (check_plan), once made: kept
    late_check: dict | None = None  # the check again at the last step before the decay (check_due): kept

    def summary(self) -> str:
        rates = (
            ""
            if self.lr is None
            else f", AdamW lr {self.lr:.3g}" + ("" if self.muon_lr is None else f", Muon lr {self.muon_lr:.3g}")
        )
        sessions = f" in {self.sessions} sessions" if self.sessions > 1 else ""
        return (
            f"--budget {self.budget}: {self.preset} ({self.parameters:,} non-embedding parameters), "
            f"{self.target_tokens:,} tokens, {self.steps} steps of {self.tokens_per_step:,} tokens{rates}; "
            f"predicted {self.hours:.2f} h of training{sessions}, held-out {self.predicted_bpb:.3f} bits/byte "
            f"(on the fit's text)"
            + (f"; {check_text(self.check)}" if self.check else "")
            + (f"; {check_text(self.late_check, again=True)}" if self.late_check else "")
        )

    def as_record(self) -> dict:
        """training_settings.json's "budget" (and the model card's): the fields, and the summary line."""
        return {**dataclasses.asdict(self), "candidates": list(self.candidates), "summary": self.summary()}

    @classmethod
    def from_record(cls, record: dict) -> Plan:
        fields = {field.name for field in dataclasses.fields(cls)}
        return cls(
            **{
                **{key: value for key, value in record.items() if key in fields},
                "candidates": tuple(record["candidates"]),
            }
        )


def batch_tokens(tokens: float, context: int) -> int:
    """The global batch in tokens for a run of `tokens`: the largest power of two with at least STEPS_PER_RUN
    steps (up to STEPS_KNEE_BATCH tokens a step; above it STEPS_PER_RUN x batch / STEPS_KNEE_BATCH steps, a batch
    of the root of tokens x STEPS_KNEE_BATCH / STEPS_PER_RUN), within [MIN_BATCH_TOKENS, MAX_BATCH_TOKENS], and
    at least one block."""
    wanted = tokens / STEPS_PER_RUN
    if wanted > STEPS_KNEE_BATCH:
        wanted = math.sqrt(tokens * STEPS_KNEE_BATCH / STEPS_PER_RUN)
    wanted = max(MIN_BATCH_TOKENS, min(MAX_BATCH_TOKENS, wanted))
    return max(context, 2 ** int(math.floor(math.log2(wanted))))


def global_blocks(tokens: float, context: int, world: int) -> int:
    """The global batch in blocks, a multiple of the world size."""
    blocks = max(1, batch_tokens(tokens, context) // context)
    return math.ceil(blocks / world) * world


def whole_steps(
    tokens: float, context: int, world: int, rounding: Callable[[float], int] = math.floor
) -> tuple[int, int]:
    """(steps, global batch blocks) of the batch rule for a run of about `tokens`: `rounding` (floor: at most
    `tokens`; ceil: at least; round: nearest) of whole steps, at least one."""
    blocks = global_blocks(tokens, context, world)
    return max(1, int(rounding(tokens / (blocks * context)))), blocks


def split_batch(global_batch_blocks: int, world: int, micro_batch: int) -> tuple[int, int]:
    """(--batch-size, --grad-accum) per rank for a global batch: the micro-batch, or the largest divisor
    of the rank's share below it."""
    per_rank = global_batch_blocks // world
    size = max(divisor for divisor in range(1, min(micro_batch, per_rank) + 1) if per_rank % divisor == 0)
    return size, per_rank // size


def sessions_of(request: Request) -> int:
    """How many sessions of --max-hours the budget takes (1 without)."""
    return max(1, math.ceil(request.seconds / 3600 / request.session_hours)) if request.session_hours else 1


def seconds_before_steps(request: Request) -> float:
    """What the run's sessions spend before their first steps: this one's start-up and probe, and each later
    session's start-up."""
    return request.spent_seconds + (sessions_of(request) - 1) * request.start_seconds


def training_seconds(request: Request) -> float:
    """The seconds the plan's steps and evaluations may take (run_seconds): the budget less UNCOUNTED_SHARE
    and seconds_before_steps."""
    return request.seconds * (1 - UNCOUNTED_SHARE) - seconds_before_steps(request)


def step_seconds(candidate: Candidate, tokens_per_step: int) -> float:
    """A step's seconds: its micro-batches at the candidate's speed, and its one optimizer step."""
    return tokens_per_step / candidate.tokens_per_second + candidate.optimizer_seconds


def validation_count(steps: int, every: int) -> int:
    """The validations of a run of `steps` at a cadence of `every` (0: at the end only), by callbacks.due."""
    points = set(range(every, steps + 1, every)) if every else set()
    return sum(callbacks.due(step, steps, every) for step in points | {steps})


def run_seconds(candidate: Candidate, request: Request, steps: int, tokens_per_step: int) -> float:
    """A run's seconds of training and evaluation: its steps, its validations (--eval-every or the default
    cadence for this length) and the test evaluation, a scored token a third of a trained one (a forward
    against a forward and a backward, as callbacks.default_eval_every counts)."""
    every = request.eval_every
    if every is None:
        every = callbacks.default_eval_every(steps, request.validation_tokens, tokens_per_step)
    scored = validation_count(steps, every) * request.validation_tokens + request.test_tokens
    return steps * step_seconds(candidate, tokens_per_step) + scored / (3 * candidate.tokens_per_second)


def fitting_steps(candidate: Candidate, request: Request, blocks: int) -> int:
    """The most steps of `blocks` whose run (run_seconds) fits training_seconds, within max_tokens (0: none)."""
    tokens_per_step, seconds = blocks * candidate.context, training_seconds(request)
    high = max(0, int(seconds / step_seconds(candidate, tokens_per_step)))  # the steps alone: an upper bound
    if math.isfinite(request.max_tokens):
        high = min(high, int(request.max_tokens // tokens_per_step))
    low = 0
    while low < high:  # the last step count that fits: run_seconds grows with the steps
        middle = (low + high + 1) // 2
        fits = run_seconds(candidate, request, middle, tokens_per_step) <= seconds
        low, high = (middle, high) if fits else (low, middle - 1)
    return low


def fitted_length(candidate: Candidate, request: Request) -> tuple[int, int]:
    """(steps, global batch blocks) of the longest run that fits (at least one step), its batch the batch
    rule's for its tokens: first the batch of the tokens the micro-batches' speed alone fits, then the batch
    of the run that batch gave, until they agree (a round or two; after three, the last batch's run)."""
    tokens = min(request.max_tokens, candidate.tokens_per_second * training_seconds(request))
    blocks = global_blocks(tokens, candidate.context, request.world)
    for _ in range(3):
        steps = max(1, fitting_steps(candidate, request, blocks))
        again = global_blocks(steps * blocks * candidate.context, candidate.context, request.world)
        if again == blocks:
            return steps, blocks
        blocks = again
    return max(1, fitting_steps(candidate, request, blocks)), blocks


def candidate_outcome(candidate: Candidate, request: Request, model: LossModel) -> dict:
    """What `candidate` makes of the budget: its tokens (the explicit count, else what fits), steps,
    hours (of training and evaluation) and predicted loss."""
    if request.target_tokens:
        steps, blocks = whole_steps(request.target_tokens, candidate.context, request.world, math.ceil)
        tokens = request.target_tokens
    else:
        steps, blocks = fitted_length(candidate, request)
        tokens = steps * blocks * candidate.context
    return {
        "preset": candidate.preset,
        "tokens": int(tokens),
        "steps": steps,
        "blocks": blocks,
        "hours": run_seconds(candidate, request, steps, blocks * candidate.context) / 3600,
        "bpb": model.loss(candidate.parameters, tokens),
        "parameters": candidate.parameters,
        "tokens_per_second": candidate.tokens_per_second,
        "probed": candidate.probed,
        "pair_ratio": candidate.pair_ratio,
        "optimizer_seconds": candidate.optimizer_seconds,
    }


def choose(request: Request, candidates: list[Candidate], model: LossModel = LOSS_MODEL) -> Plan:
    """The candidate with the lowest predicted loss among those that fit the budget, the largest of those within
    TIE_ERRORS of the loss model's error of it whose speed was measured (UserError: none fits). A predicted one
    wins only outright: its speed carries the pair's gain, which carried on one CPU in fp32 (docs/budget.md) and
    was 2.1x too fast on another in bf16 (bench/RESULTS.md "The issue's own length"), and the tie is the loss
    model's error alone."""
    if not candidates:
        raise UserError(f"--budget {request.budget}: no model shape to plan for (none fits this device's memory)")
    outcomes = [candidate_outcome(candidate, request, model) for candidate in candidates]
    limit = training_seconds(request) / 3600
    fitting = [outcome for outcome in outcomes if outcome["hours"] <= limit and outcome["tokens"] >= MIN_TOKENS]
    if not fitting:
        raise UserError(too_small(request, candidates))
    lowest = min(fitting, key=lambda outcome: outcome["bpb"])
    tie = TIE_ERRORS * model.error
    within = [o for o in fitting if o["bpb"] <= lowest["bpb"] + tie]
    best = max((o for o in within if o["probed"] or o is lowest), key=lambda o: o["parameters"])
    passed_over = [o["preset"] for o in within if o["parameters"] > best["parameters"]]
    chosen = next(candidate for candidate in candidates if candidate.preset == best["preset"])
    others = sorted((o for o in fitting if o is not best), key=lambda o: o["bpb"])
    why = (
        (
            f"lowest predicted loss of {len(fitting)} shape(s) that fit {limit:.2f} h of training"
            if best is lowest
            else f"the largest of {len(fitting)} shape(s) that fit {limit:.2f} h of training within {tie:.3f} "
            f"bits/byte ({TIE_ERRORS:g}x the loss model's error) of the lowest predicted loss, "
            f"{lowest['preset']}'s {lowest['bpb']:.3f}"
        )
        + (f" (next: {others[0]['preset']} at {others[0]['bpb']:.3f})" if others and best is lowest else "")
        + (
            f"; {', '.join(passed_over)} within {tie:.3f} bits/byte of it but its speed predicted, not measured"
            if passed_over
            else ""
        )
        + (
            f"; tokens capped at {request.max_passes} passes over the train split"
            if best["tokens"] >= request.max_tokens - best["blocks"] * chosen.context
            else ""
        )
    )
    sessions = sessions_of(request)
    return Plan(
        budget=request.budget,
        preset=chosen.preset,
        parameters=chosen.parameters,
        target_tokens=best["tokens"],
        global_batch_blocks=best["blocks"],
        tokens_per_step=best["blocks"] * chosen.context,
        steps=best["steps"],
        hours=best["hours"],
        sessions=sessions,
        predicted_bpb=best["bpb"],
        why=why,
        candidates=tuple(
            {
                key: outcome[key]
                for key in (
                    "preset",
                    "tokens",
                    "hours",
                    "bpb",
                    "tokens_per_second",
                    "probed",
                    "pair_ratio",
                    "optimizer_seconds",
                )
            }
            for outcome in outcomes
        ),
    )


def short_corpus(request: Request) -> str | None:
    """The error line of a corpus no budget is enough for: its passes' tokens under MIN_TOKENS (None: not so)."""
    if request.target_tokens or request.max_tokens >= MIN_TOKENS:
        return None
    return (
        f"--budget {request.budget}: the corpus is too small to plan a run on: {request.max_passes} passes over "
        f"its train split of {request.train_tokens:,.0f} tokens are {request.max_tokens:,.0f}, under the "
        f"smallest sensible run ({MIN_TOKENS:,} tokens: {MIN_STEPS} steps of {MIN_BATCH_TOKENS:,}); train "
        f"it without --budget (e.g. --epochs {request.max_passes}), or build the corpus from more text"
    )


def too_small(request: Request, candidates: list[Candidate]) -> str:
    """The one error line of a budget no candidate fits: what the cheapest sensible run would take."""
    fastest = max(candidates, key=lambda candidate: candidate.tokens_per_second)
    tokens = max(request.target_tokens or 0, MIN_TOKENS)
    if request.target_tokens and request.target_tokens < MIN_TOKENS:
        return (
            f"--target-tokens {request.target_tokens:,} is below the smallest sensible --budget run "
            f"({MIN_TOKENS:,} tokens: {MIN_STEPS} steps of {MIN_BATCH_TOKENS:,})"
        )
    if problem := short_corpus(request):
        return problem
    steps, blocks = whole_steps(tokens, fastest.context, request.world, math.ceil)
    counted = run_seconds(fastest, request, steps, blocks * fastest.context)
    needed = (counted + seconds_before_steps(request)) / (1 - UNCOUNTED_SHARE)
    what = (
        f"--target-tokens {tokens:,}"
        if request.target_tokens
        else (
            f"the smallest sensible run ({fastest.preset}, {MIN_TOKENS:,} tokens: {MIN_STEPS} steps of "
            f"{MIN_BATCH_TOKENS:,})"
        )
    )
    return (
        f"--budget {request.budget} is too small: {what} takes about {duration_text(needed)} here "
        f"({fastest.tokens_per_second:,.0f} tokens/s, world size {request.world}, with its evaluations, the "
        f"start-up and the probe, and {UNCOUNTED_SHARE:.0%} kept for saving); give --budget {duration_text(needed)} "
        "or more"
    )


# ----------------------------------------------------------------------------------------------
# The probe: real train.py steps per candidate on the run's devices (all ranks take part).

PROBE_WARMUP_STEPS = 1  # untimed steps first (allocation, caches, the first kernel launches)
PROBE_STEPS = 5  # timed steps at least: the window whose median is the step's time
CPU_TIME_PROBE_STEPS = 3  # the window of a one-thread CPU probe, timed in CPU time (unloaded_step_seconds): its
# steps' times are their work, which load moves far less than the wall clock (nano's probe step under one busy loop per
# core: 0.98-1.00x a quiet one's; whole probes under an 8 s burst 0.85-1.02x the quiet run's, the machine's own drift
# included), and its steps agree at once, so two more steps buy no steadiness: the probe of a 60 s budget took 2.73 s
# where it took 3.18 (tiny's steps 0.07 s, nano's 0.22 s; bench/RESULTS.md "A shorter probe at one thread")
PROBE_MAX_STEPS = 15  # timed steps at most, while the window's steps disagree
PROBE_AGREEMENT = 0.25  # the window is steady when its slowest step is at most this much over its fastest
# A larger preset runs more FLOP/s than a smaller one (larger matmuls): on this project's AMD EPYC at one thread,
# nano measured 2.6x its prediction from tiny's FLOP/s and micro 2.4x its prediction from nano's. A first pair
# outside this range (the larger less efficient, or far more: a burst of load over one of the two) is measured
# once more; inside it, its ratio (the pair's gain) scales the prediction of the next preset
PAIR_RANGE = (0.8, 4.0)
PROBE_SHARE = 0.02  # of the budget, at most PROBE_MAX_SECONDS, for probing
PAIR_SHARE = 0.05  # of the budget, at most PROBE_MAX_SECONDS: the first pair is measured within this much
PROBE_MAX_SECONDS = 120.0
# (preset, micro-batch, seconds it may take, its window of agreeing steps) -> its speed; None: out of memory
Measure = Callable[[str, int, float, int], "ProbeSpeed | None"]
# the seconds the whole probe may wait for a quiet machine (quiet_wait_seconds) -> its Measure (train.measure_speed)
MeasureFor = Callable[[float], Measure]


def probe_window(device_type: str, threads: int) -> int:
    """How many agreeing timed steps make a probe's step time: CPU_TIME_PROBE_STEPS where a step is timed by
    its CPU time (a CPU at one thread), else PROBE_STEPS (a wall clock, which load moves)."""
    return CPU_TIME_PROBE_STEPS if device_type == "cpu" and threads == 1 else PROBE_STEPS


def steady_step_seconds(times: list[float], window: int, out_of_time: bool = False) -> float | None:
    """A probe's step time from its timed steps so far, or None to time another: the median of the last
    `window` (probe_window) once they agree within PROBE_AGREEMENT (a burst of load that ends inside the probe leaves
    slow steps before fast ones, which disagree); once PROBE_MAX_STEPS are timed or the time is up and they
    still disagree, the fastest of them (timeit's rule: load only ever slows a step). Under a burst at two
    or more threads the steps' CPU time disagrees by 2x: OpenMP's threads spin at each barrier while their
    partner waits for a core, and whether the scheduler runs the pair together changes from step to step
    (tiny at two threads under one busy loop per core: 0.040-0.087 s a step, quiet 0.044; docs/budget.md)."""
    last = times[-window:]
    if not last:
        return None
    if len(last) == window and max(last) <= (1 + PROBE_AGREEMENT) * min(last):
        return statistics.median(last)
    if out_of_time or len(times) >= PROBE_MAX_STEPS:
        return min(last)
    return None


def time_until_steady(
    step: Callable[[], float],
    out_of_time: Callable[[], bool],
    window: int,
    info: distributed.DistInfo | None = None,
) -> float:
    """The probe's step time: `step()` (one timed step's seconds) again until steady_step_seconds has it
    over `window` steps, `out_of_time()` asked after each step. With `info`, every rank steps alike and rank
    0's verdict ends the timing."""
    times: list[float] = []
    step_seconds = None
    while step_seconds is None:
        times.append(step())
        verdict = steady_step_seconds(times, window, out_of_time())
        step_seconds = distributed.broadcast_from_main(verdict, info) if info else verdict
    return step_seconds


def unloaded_step_seconds(wall: float, cpu: float, threads: int) -> float:
    """A CPU probe step's time on a machine that gives the process its cores: the process' CPU seconds over
    its torch threads, at most the wall time. A step on a busy CPU waits for a core, not for more work: one
    busy loop per core (the issue's burst) cut tiny's probe to 0.53x in wall time, to 0.999x in CPU time
    (docs/budget.md). Where the threads wait (an idle thread, a slow read), the CPU time is short of the
    wall's and the step's time is taken too short: the run's check measures the wall clock."""
    return min(wall, cpu / max(1, threads))


QUIET_MARGIN = 0.5  # of a core: other load beyond the cores a CPU run leaves free that its probe waits out
QUIET_WAIT_SHARE = 0.1  # of the budget, at most QUIET_WAIT_MAX_SECONDS: the probe's whole wait for a quiet machine
QUIET_WAIT_MAX_SECONDS = 60.0
QUIET_POLL_SECONDS = 0.5  # how often a waiting probe looks at the machine's load


def others_cores(machine_busy: float, own_cpu: float, wall: float) -> float:
    """The cores other processes kept busy over `wall` seconds: the machine's busy CPU seconds (all cores,
    /proc/stat) less this process' own CPU seconds, over the wall time."""
    return max(0.0, machine_busy - own_cpu) / wall if wall > 0 else 0.0


def busy_beside(others: float, cores: int, threads: int) -> bool:
    """Whether other load took cores a run of `threads` threads needs: more of them busy than the cores
    it leaves free, by QUIET_MARGIN."""
    return others > max(0, cores - threads) + QUIET_MARGIN


def waits_for_quiet(on_cpu: bool, threads: int, world: int) -> bool:
    """Whether the probe waits out other load: a CPU run of one process at two or more threads, whose
    probe steps read slow beside it (OpenMP's threads spin at each barrier while a partner waits for a
    core: under one busy loop per core, nano's probe step read 2.17x a quiet one at 2 threads, 0.98-1.00x
    at 1 thread, where a step's CPU time is its work; bench/RESULTS.md). An accelerator's step is the
    device's; the ranks of a CPU run on one machine are each other's load."""
    return on_cpu and threads >= 2 and world == 1


def quiet_wait_seconds(budget: float) -> float:
    """How long the whole probe may wait for a quiet machine: QUIET_WAIT_SHARE of the budget, at most
    QUIET_WAIT_MAX_SECONDS. The wait costs little: beside the load, a run's steps spin as much as they work
    (a 20 s burst of one busy loop per core cost nano's fixed run 15-16 s at 2 threads)."""
    return min(QUIET_WAIT_MAX_SECONDS, QUIET_WAIT_SHARE * budget)


def predicted_rate(
    measured: Candidate, presets: dict[str, model_config.Preset], name: str, vocab: int, gain: float = 1.0
) -> float:
    """`name`'s tokens/s predicted from another preset's FLOP/s (the LM head over `vocab` included), times
    `gain` (a measured pair's: a larger preset's matmuls run more FLOP/s)."""
    flops = model_config.flops_per_token(presets[measured.preset], vocab)
    return gain * measured.tokens_per_second * flops / model_config.flops_per_token(presets[name], vocab)


def predicted_optimizer_seconds(
    measured: Candidate, presets: dict[str, model_config.Preset], name: str, gain: float = 1.0
) -> float:
    """`name`'s optimizer step predicted from a measured preset's by their Muon matrices' Newton-Schulz FLOPs
    (most of the step: on a CPU's nano 15.5 of 17.3 ms, bench/RESULTS.md "Fewer, larger steps"), over `gain`
    (the measured pair's, as predicted_rate: larger matmuls run more FLOP/s). On this project's CPU micro's
    iteration took 5.7x nano's for 10.9x the FLOPs (bf16, one thread)."""

    def flops(preset: model_config.Preset) -> int:
        return sum(hardware.newton_schulz_flops(*shape) for shape in hardware.muon_matrix_shapes(preset))

    return measured.optimizer_seconds * flops(presets[name]) / flops(presets[measured.preset]) / gain


def pair_disagrees(ratio: float | None) -> bool:
    """Whether a measured pair's ratio to its FLOP/s prediction is outside PAIR_RANGE."""
    return ratio is not None and not (PAIR_RANGE[0] <= ratio <= PAIR_RANGE[1])


def pair_gain(candidates: list[Candidate]) -> float:
    """The gain the next prediction carries: the first measured pair's ratio within PAIR_RANGE and at least
    1 (after a predicted preset: 1, its FLOP/s carried over)."""
    if not candidates or not candidates[-1].probed or candidates[-1].pair_ratio is None:
        return 1.0
    return min(PAIR_RANGE[1], max(1.0, candidates[-1].pair_ratio))


def non_embedding_parameters(preset: model_config.Preset) -> int:
    return model_config.parameter_count(preset, 0)


def candidate_presets(run, explicit_shape: bool) -> dict[str, model_config.Preset]:
    """The shapes the plan may choose, smallest first: the run's own when the shape is explicit, else
    every preset (with any --context given)."""
    if explicit_shape:
        return {run.preset: model_config.preset_of(run)}
    presets = {name: model_config.resolve_preset(name, context=run.context) for name in model_config.PRESETS}
    return dict(sorted(presets.items(), key=lambda item: model_config.flops_per_token(item[1], 0)))


def probe(
    measure: Measure,
    info,
    presets: dict[str, model_config.Preset],
    micro_batch: int,
    seconds: float,
    vocab: int,
    window: int,
    pair_seconds: float | None = None,
) -> list[Candidate]:
    """Each preset's global tokens/s, smallest first, from timed train.py steps of one micro-batch per rank
    (`steady_step_seconds`; eager: compile's speed-up is not counted). The first two (the pair) are
    measured within `pair_seconds` (default `seconds`; fewer steps when it runs short), the rest while
    their probe fits `seconds`; the others are predicted from the last one by their FLOPs per token (the
    LM head's over the corpus' `vocab` included: it is most of a small preset's work), the first after
    the measured pair times the pair's gain (`pair_gain`). The pair checks that prediction
    (`Candidate.pair_ratio`): outside PAIR_RANGE (a burst of load during one of the two), both are
    measured once more and each keeps its faster measurement (as timeit keeps the fastest: the slower
    ones are interference). From the first preset that does not fit the device's memory on, none is a
    candidate."""
    candidates: list[Candidate] = []
    started = time.monotonic()

    def left() -> float:
        allowed = seconds if len(candidates) >= 2 or pair_seconds is None else pair_seconds
        return distributed.broadcast_from_main(max(0.0, allowed - (time.monotonic() - started)), info)

    def measured(name: str) -> ProbeSpeed | None:
        return distributed.broadcast_from_main(measure(name, micro_batch, left(), window), info)

    for name, preset in presets.items():
        if candidates:
            last, gain = candidates[-1], pair_gain(candidates)
            rate = predicted_rate(last, presets, name, vocab, gain)
            cost = (PROBE_WARMUP_STEPS + window) * micro_batch * preset.context * info.world / rate
            pair = len(candidates) == 1  # the pair is measured in whatever time is left (fewer steps when short)
            if not last.probed or (not pair and cost > left()):  # one verdict (left() is rank 0's)
                carried = gain if gain != 1.0 else None
                optimizer = predicted_optimizer_seconds(last, presets, name, gain)
                parameters = non_embedding_parameters(preset)
                candidates.append(Candidate(name, parameters, preset.context, rate, False, carried, optimizer))
                continue
        speed = measured(name)
        if speed is None:
            break
        ratio = None
        if candidates:
            ratio = speed.tokens_per_second / predicted_rate(candidates[-1], presets, name, vocab)
            if pair_disagrees(ratio) and len(candidates) == 1:  # the first pair: measured once more
                candidates[-1] = faster(candidates[-1], measured(candidates[-1].preset))
                speed = faster_speed(speed, measured(name))
                ratio = speed.tokens_per_second / predicted_rate(candidates[-1], presets, name, vocab)
        parameters = non_embedding_parameters(preset)
        candidates.append(
            Candidate(name, parameters, preset.context, speed.tokens_per_second, True, ratio, speed.optimizer_seconds)
        )
    return candidates


def faster_speed(first: ProbeSpeed, again: ProbeSpeed | None) -> ProbeSpeed:
    """Of two measures of one preset, each part's faster (timeit's rule: the slower is interference)."""
    if again is None:
        return first
    return ProbeSpeed(
        max(first.tokens_per_second, again.tokens_per_second), min(first.optimizer_seconds, again.optimizer_seconds)
    )


def faster(candidate: Candidate, again: ProbeSpeed | None) -> Candidate:
    """`candidate` with the faster of its measure and `again` (faster_speed)."""
    speed = faster_speed(ProbeSpeed(candidate.tokens_per_second, candidate.optimizer_seconds), again)
    return dataclasses.replace(
        candidate, tokens_per_second=speed.tokens_per_second, optimizer_seconds=speed.optimizer_seconds
    )


# ----------------------------------------------------------------------------------------------
# The glue train.py calls: settle the run's plan once (train.py applies it: `apply`).


def recorded_plan(out: Path, resume: str = "auto") -> dict | None:
    """The plan the run recorded (None: it has not planned yet): in the checkpoint `resume` names when it names
    a file (a run continued from another folder), else in OUT/training_settings.json."""
    if resume in ("auto", "none") or not Path(resume).is_file():
        return (read_json_or(out / "training_settings.json") or {}).get("budget")
    return checkpoint_store.load_checkpoint_file(Path(resume), "--resume")["settings"].get("budget")


def kept_plan(out: Path, resume: str, budget: str) -> dict | None:
    """The recorded plan this run keeps: the one made for its budget (None: plan anew, e.g. a run that stopped
    before its first checkpoint); a resume under another budget is refused here, before any probe."""
    record = recorded_plan(out, resume)
    if record is None or record.get("budget") == budget:
        return record
    if checkpoint_store.continues_checkpoint(out, resume):
        raise plan_refusal(record["budget"], [f"budget: {record['budget']} -> {budget}"], out)
    return None


def plan_refusal(budget: str, differences: list[str], out: Path) -> UserError:
    """The line of a resume whose command contradicts the --budget plan its run made (plan_differences)."""
    return UserError(
        f"settings differ from the --budget {budget} plan this run made at its start: "
        + "; ".join(differences)
        + ". A resume keeps the plan's budget, preset and length: give the run's --budget and leave out --preset "
        "and --target-tokens (or give the plan's); for a new run from its weights use a new --out with "
        f"--init-from {out}"
    )


PLANNED_OPTIONS = ("preset", "target_tokens")  # the options a plan sets (apply), the rest stay the command's


def plan_differences(plan: Plan, run, given: set[str]) -> list[str]:
    """The options of PLANNED_OPTIONS this command gave (`given`) with another value than the kept plan's, as
    `name: plan's -> given`: a resume applies the plan, so such an option would be dropped without a word."""
    return [
        f"{name}: {getattr(plan, name)} -> {getattr(run, name)}"
        for name in PLANNED_OPTIONS
        if name in given and getattr(run, name) != getattr(plan, name)
    ]


MAX_HOURS_LIMIT = "--max-hours budget"  # a stop's words when --max-hours set the session's time limit


def session_limit(max_hours: float, plan_record: dict | None) -> tuple[float, str]:
    """A session's time limit in hours (0: none) and the words its stop gives: --max-hours when given;
    else a --budget run's own budget, so that no session runs past what the user asked for (a machine
    slower than the probe saw stops saved, and the same command finishes the run)."""
    if max_hours or plan_record is None:
        return max_hours, MAX_HOURS_LIMIT
    text = plan_record["budget"]
    return budget_seconds(text) / 3600, f"--budget {text} (this machine ran slower than its probe)"


FINISH_GRACE = 0.05  # of the budget: a --budget run late near its end finishes when its end fits this far past
# it (the 5%): at 3%, a 67 s budget at two threads whose steps ran 10% slower after its check stopped
# saved at step 165 of 211, 56 s in, its end 3.4% past the budget (bench/RESULTS.md)


def finish_grace(max_hours: float, plan_record: dict | None) -> float:
    """How far past a session's time limit a run may go to finish instead of stopping saved: FINISH_GRACE
    when the limit is a --budget's (the user's wish: a complete run a little late beats an unfinished one on
    time), none under --max-hours (a platform's session ends hard there)."""
    return FINISH_GRACE if session_limit(max_hours, plan_record)[1] != MAX_HOURS_LIMIT else 0.0


def apply(settings, plan: Plan | None, world: int):
    """`settings` with the plan's preset, length and batch split (the micro-batch: `settings`' own);
    unchanged without a plan."""
    if plan is None:
        return settings
    batch_size, grad_accum = split_batch(plan.global_batch_blocks, world, settings.session.batch_size)
    run = dataclasses.replace(settings.run, preset=plan.preset, target_tokens=plan.target_tokens, epochs=None)
    session = dataclasses.replace(settings.session, batch_size=batch_size, grad_accum=grad_accum)
    return dataclasses.replace(settings, run=run, session=session)


def settle(
    settings, info, corpus: Path, given: set[str], measure_for: MeasureFor, started: float | None = None
) -> Plan | None:
    """The plan of this --budget run (None without --budget), for train.py to apply (`apply`) and record
    (`Plan.as_record`). A run that has planned keeps its plan; else every rank probes (`measure_for`: the
    measure of a preset's global tokens/s at a micro-batch, train.measure_speed) and the plan is made.
    `given`: the options the command gave (on its command line or in its --config file: common.given_options);
    `started`: the time.monotonic() the session started at (None: now), whose time before the plan the plan counts."""
    run = settings.run
    if run.budget is None:
        return None
    if run.epochs is not None:
        raise UserError("--budget chooses the run's length: give --target-tokens (or nothing) instead of --epochs")
    out, resume = Path(settings.session.out), settings.invocation.resume
    record = distributed.main_decides(lambda: kept_plan(out, resume, run.budget), info)
    if record is not None:
        plan = Plan.from_record(record)
        say(f"{plan.summary()} ({kept_plan_words(plan)})", main=info.is_main)
        differences = plan_differences(plan, run, given)
        if differences:
            raise plan_refusal(run.budget, differences, out)
        return plan
    manifest = corpus_format.load_manifest(corpus)
    started = time.monotonic() if started is None else started
    plan = make_plan(settings, info, given, settings.session.batch_size, manifest, measure_for, started)
    planned = apply(settings, plan, info.world).run
    shape = model_config.preset_of(planned)
    recipe, _ = optimization.choose_recipe(planned, shape.hidden, plan.steps, shape.tie_embeddings)
    plan = dataclasses.replace(plan, lr=recipe.lr, muon_lr=recipe.muon_lr, length_given="target_tokens" in given)
    note = vocabulary_note(plan.preset, manifest.vocab_size, manifest.asked_vocab_size)
    for line in [*plan_lines(plan), note]:
        if line:
            say(line, main=info.is_main)
    return plan


def kept_plan_words(plan: Plan) -> str:
    """What a resumed run says of the plan it keeps: the one made at its start, or that plan after its checks."""
    replanned = any(check and check.get("replanned") for check in (plan.check, plan.late_check))
    return "the run's plan, made at its start" + (" and re-planned at its checks" if replanned else "") + ": kept"


def make_plan(
    settings,
    info,
    given: set[str],
    micro_batch: int,
    manifest: corpus_format.Manifest,
    measure_for: MeasureFor,
    session_started: float,
) -> Plan:
    """Probe the candidates (timed against the budget, which gives the probe's times and its wait for a quiet
    machine) and choose, for the corpus of `manifest`, counting the session's seconds since `session_started`
    (time.monotonic())."""
    run = settings.run
    seconds = budget_seconds(run.budget)
    explicit_shape = bool(given & ({"preset"} | set(model_config.OVERRIDABLE_FIELDS) - {"context"}))
    started = time.monotonic()
    presets = candidate_presets(run, explicit_shape)
    vocab = manifest.vocab_size
    probe_seconds, pair_seconds = (min(PROBE_MAX_SECONDS, share * seconds) for share in (PROBE_SHARE, PAIR_SHARE))
    train_tokens, passes = split_limits(settings, manifest)
    request = Request(
        budget=run.budget,
        seconds=seconds,
        session_hours=settings.session.max_hours,
        world=info.world,
        train_tokens=train_tokens,
        max_passes=passes,
        target_tokens=run.target_tokens if "target_tokens" in given else None,
        start_seconds=max(0.0, started - session_started),
        validation_tokens=evaluated_tokens(settings, manifest, "validation"),
        test_tokens=evaluated_tokens(settings, manifest, "test"),
        eval_every=settings.session.eval_every,
    )
    if problem := short_corpus(request):  # before the probe: its minutes cannot help
        raise UserError(problem)
    measure = measure_for(quiet_wait_seconds(seconds))
    window = probe_window(info.device.type, torch.get_num_threads())
    candidates = probe(measure, info, presets, micro_batch, probe_seconds, vocab, window, pair_seconds)
    return choose(dataclasses.replace(request, spent_seconds=max(0.0, time.monotonic() - session_started)), candidates)


def evaluated_tokens(settings, manifest: corpus_format.Manifest, split: str) -> int:
    """About the tokens an evaluation of `split` scores (train_data.evaluation_rows): --eval-tokens' worth, or
    the split when smaller; a mixture's each source --eval-tokens' worth."""
    mixture = train_data.parse_mixture(settings.session.data, settings.run.mixture_schedule)
    if mixture:
        return len(mixture.sources) * settings.run.eval_tokens
    return min(settings.run.eval_tokens, manifest.split(split).get("tokens", 0))


def split_limits(settings, manifest: corpus_format.Manifest) -> tuple[float, int]:
    """(the train split's tokens, the most passes a plan may make over it): a mixture's split is inf, never
    capped by passes."""
    mixture = train_data.parse_mixture(settings.session.data, settings.run.mixture_schedule)
    tokens = math.inf if mixture else manifest.split("train")["tokens"]
    return tokens, max_passes(tokens, manifest.vocab_size)


def max_run_tokens(settings, corpus: Path) -> float:
    """The most tokens a plan may train: max_passes over the train split (a mixture: not capped)."""
    tokens, passes = split_limits(settings, corpus_format.load_manifest(corpus))
    return passes * tokens


def plan_lines(plan: Plan) -> list[str]:
    """What the run prints of its plan: the choice, why, and every candidate's prediction."""
    lines = [plan.summary(), f"  why: {plan.why}; loss model fitted by bench/bench_budget.py (docs/budget.md)"]
    for outcome in plan.candidates:
        how = "measured" if outcome["probed"] else "predicted from a smaller one's FLOP/s (not probed)"
        ratio = outcome.get("pair_ratio")
        if ratio is not None:
            how += (
                f", {ratio:.2f}x its prediction from the smaller one's FLOP/s"
                if outcome["probed"]
                else f", x {ratio:.2f}: the measured pair's gain"
            )
        lines.append(
            f"  {outcome['preset']}: {outcome['tokens_per_second']:,.0f} tokens/s ({how}): "
            f"{outcome['tokens']:,} tokens in {outcome['hours']:.2f} h -> {outcome['bpb']:.3f} bits/byte"
        )
    return lines


# ----------------------------------------------------------------------------------------------
# The checks of the plan against the run's own steps, each a re-plan of the token count (pure rules;
# train.py times the steps and applies a re-plan: train.BudgetCheck).

CHECK_SHARE = 0.5  # of the budget: the plan is checked once this much of it has passed since the start, or
# at the last step with room to shorten the run (`room_step`), whichever comes first: as late as the schedule allows
# (a burst of load at the start long behind it, less of the run left to drift), and at half the budget at the latest
# (a machine slower than the plan still has steps to give back before its decay)
MIN_CHECK_STEPS = 4  # and not before this many steps of this session are timed
SHORTEN_ROOM = 0.1  # of the steps: a check comes while the run may still end this much sooner. At the last step
# before the decay a check could shorten a run by a step or two: a 60 s budget whose first check (step 41) saw
# 7.3-7.7K tokens/s and lengthened the run to 92 steps ran at 6.8-6.9K after it; its late check (step 54)
# wanted 81 steps, could not go below 90, and the run stopped saved at step 86 of 90, 4 steps from its end
CHECK_TOLERANCE = 0.005  # of the budget: a projected end this far from the target re-plans
# The target is the budget less the run's end (`Seen.end_seconds`), with no cushion before it: over 41 checked runs
# of bench_budget_wall (44-117 s budgets, one and two threads, quiet and burst) the process ended at 0.958-1.036x
# its check's projection (mean 1.000, sd 0.015), inside FINISH_GRACE's 1.05x; a cushion of 1% and a tolerance of 1%
# ended 8 one-thread runs at 0.967-1.006x the budget (mean 0.982x): 2% of the user's time unused


@dataclass(frozen=True)
class Seen:
    """What the run has seen of itself at the check: the steps taken, this session's seconds since it
    started (the probe, start-up and evaluations included: what the budget counts), the time of a step
    for the rest of the run (`typical_step_seconds`, its share of the validations to come included:
    `rest_step_seconds`) and the time its writes and end take beside its steps (the re-plan's checkpoint,
    the last validation and the test evaluation, each as long as the slowest validation so far, and the
    last checkpoint's write)."""

    step: int
    elapsed: float
    step_seconds: float
    end_seconds: float = 0.0


def rest_step_seconds(step_seconds: float, eval_seconds: float, eval_every: int) -> float:
    """A step's time for the rest of the run: its own and its share of the validations, one every
    `eval_every` steps (0: none before the end) of `eval_seconds` each. Left out, they made the rest of a short
    run late: 2 threads, --budget 78s, 0.5 s a validation every 55 steps of 0.25 s (3.6% of the step time):
    the run stopped saved at step 232 of 277 (bench/RESULTS.md)."""
    return step_seconds + (eval_seconds / eval_every if eval_every else 0.0)


def typical_step_seconds(times: list[float]) -> float:
    """The time of a step for the rest of the run: the median of this session's step times. At the check
    (half the budget, or 60% of the steps) a burst of load at the start, during the probe and the first
    steps, is far less than half of them; and on a machine whose load comes and goes (this shared one's
    step times moved by a third within minutes) the whole session is a better guess at the rest than its
    latest steps, which made the first re-plans here overshoot."""
    return statistics.median(times)


def room_step(plan: Plan, decay_start: Callable[[int], int]) -> int:
    """The last step at which a check may still shorten the run by SHORTEN_ROOM: the step before the decay of
    a run that much shorter (the decay of a length's re-plan must not have begun: `earliest_total`)."""
    return decay_start(max(1, math.floor((1 - SHORTEN_ROOM) * plan.steps))) - 1


def check_due(
    plan: Plan, step: int, elapsed: float, timed_steps: int, decay_start: Callable[[int], int] | None
) -> bool:
    """Whether the plan is checked after `step`, for a plan of one session whose length is the plan's and
    can change (`decay_start`, the first decaying step of a length; None: a cosine schedule). The check
    (`plan.check`), after MIN_CHECK_STEPS timed steps, at `room_step` or once CHECK_SHARE of the budget has
    passed, whichever comes first; and, when that was earlier by MIN_CHECK_STEPS steps or more, the late check
    (`plan.late_check`) at the `room_step` of the length it left. Each is made once (recorded in the plan),
    and neither once the decay has begun."""
    if plan.late_check is not None or plan.length_given or plan.sessions > 1 or decay_start is None:
        return False
    if step >= decay_start(plan.steps):
        return False
    due = step >= room_step(plan, decay_start)
    if plan.check is not None:
        return due and step - plan.check["at_step"] >= MIN_CHECK_STEPS
    if timed_steps < MIN_CHECK_STEPS:
        return False
    return due or elapsed >= CHECK_SHARE * budget_seconds(plan.budget)


def target_end_seconds(plan: Plan, seen: Seen) -> float:
    """When the check wants training to end: the budget less the run's end."""
    return budget_seconds(plan.budget) - seen.end_seconds


def earliest_total(step: int, decay_start: Callable[[int], int]) -> int:
    """The fewest total steps whose schedule (decay_start: a length's first decaying step) keeps every step
    up to `step` in its warmup or stable phase, so that the steps taken keep their learning rates."""
    total = step + 1
    while decay_start(total) < step:
        total += 1
    return total


def replan(
    plan: Plan,
    seen: Seen,
    decay_start: Callable[[int], int] | None,
    max_tokens: float = math.inf,
) -> Plan | None:
    """The plan with its token count made anew from the run's own speed (`seen`), or None when it stands:
    its projected end of training within CHECK_TOLERANCE of the budget of the target (`target_end_seconds`:
    the budget less the run's end; `choose` counted it before any step), or a schedule
    that cannot change its length (`decay_start` None: a cosine decays over the whole run). The new length
    fills the time to the target at the speed seen, at most `max_tokens` (max_run_tokens) and at least
    `earliest_total` (the decay must not have begun). The preset, the batch and the learning rates stay: only
    the length (and so the decay's start) moves."""
    seconds = budget_seconds(plan.budget)
    target = target_end_seconds(plan, seen)
    projected = seen.elapsed + (plan.steps - seen.step) * seen.step_seconds
    if abs(projected - target) <= CHECK_TOLERANCE * seconds or decay_start is None:
        return None
    fitting = seen.step + max(0, int((target - seen.elapsed) // seen.step_seconds))
    steps = fitting if math.isinf(max_tokens) else min(fitting, int(max_tokens // plan.tokens_per_step))
    steps = max(steps, earliest_total(seen.step, decay_start))
    if steps == plan.steps:
        return None
    tokens = steps * plan.tokens_per_step
    return dataclasses.replace(
        plan, target_tokens=tokens, steps=steps, hours=steps * seen.step_seconds / 3600, predicted_bpb=math.nan
    )


def check_plan(
    plan: Plan,
    seen: Seen,
    decay_start: Callable[[int], int] | None,
    max_tokens: float = math.inf,
    loss: LossModel = LOSS_MODEL,
) -> Plan:
    """The plan after its check (`replan`), with the check recorded (`Plan.check`, or `Plan.late_check`
    when the check was made: kept on resume, so that each is made once): the speed seen against the plan's,
    the projected end, and the length before and after."""
    planned_step_seconds = plan.hours * 3600 / plan.steps
    new = replan(plan, seen, decay_start, max_tokens) or plan
    record = {
        "at_step": seen.step,
        "elapsed_seconds": round(seen.elapsed, 3),
        "step_seconds": seen.step_seconds,
        "planned_step_seconds": planned_step_seconds,
        "projected_end_seconds": seen.elapsed + (plan.steps - seen.step) * seen.step_seconds,
        "target_end_seconds": target_end_seconds(plan, seen),
        "end_seconds": seen.end_seconds,
        "replanned": new is not plan,
        "from_tokens": plan.target_tokens,
        "from_steps": plan.steps,
        "to_tokens": new.target_tokens,
        "to_steps": new.steps,
    }
    predicted = plan.predicted_bpb if new is plan else loss.loss(plan.parameters, new.target_tokens)
    which = "check" if plan.check is None else "late_check"
    return dataclasses.replace(new, predicted_bpb=predicted, **{which: record})


def check_text(check: dict, again: bool = False) -> str:
    """A check's one line (printed when it is made, and in the plan's summary after it); `again`: the late one."""
    speed = check["planned_step_seconds"] / check["step_seconds"]
    seen = (
        f"checked {'again ' if again else ''}at step {check['at_step']} ({check['elapsed_seconds']:.0f} s in): "
        f"steps with their validations at {speed:.2f}x the {'plan' if again else 'probe'}'s speed"
    )
    if not check["replanned"]:
        return f"{seen}, training ends within {CHECK_TOLERANCE:.1%} of the budget's time as planned: kept"
    return (
        f"{seen}, training would end at {check['projected_end_seconds']:.0f} s, not at its target "
        f"{check['target_end_seconds']:.0f} s"
        f": re-planned from {check['from_tokens']:,} tokens ({check['from_steps']} steps) to "
        f"{check['to_tokens']:,} ({check['to_steps']} steps)"
    )
