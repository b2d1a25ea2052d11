"""Pretrain a Qwen3 model on a tinyllm corpus, with bit-exact resume after any interruption.

    python train.py                                                   # the demo: corpus, training, export
    python train.py --data corpus/demo --out runs/demo                # one device
    torchrun --nproc_per_node=2 train.py --data CORPUS --out RUN       # DDP: NCCL on CUDA, gloo on CPU
    python train.py --data CORPUS --out RUN --resume auto             # continue where it stopped
    python train.py --export-only --resume PATH --out RUN             # RUN/model/ from any checkpoint

The contracts (data order, run folder, checkpoint contents) are in DESIGN.md. The file reads
top-down: options (each declared once), Training (one step counter), the run (main, the loop), its
lifecycle, and the glue to checkpoint_cloud.py (checkpoint_store.py holds the checkpoint rules and
writer). The optimization (the recipe and its options, the optimizers, clipping, the fp16 scaler) is
optimization.py's.
Its siblings hold the rest: the corpus reader and data order (train_data.py), the model (model_config.py),
attention's kernels and their plan (attention.py), per-device rules and measurements (hardware.py), the ranks
(distributed.py), what observes the run (callbacks.py: the train log, the validation, the --eval-tasks;
artifacts.py: the end-of-run outputs; each a callback whose hooks the loop calls), metrics.jsonl
(metrics_log.py), the progress and the final line (report.py).
Every piece of state that must survive a restart is a small object with state_dict()/load_state_dict():
the data order, the optimizers, the loss scaler, the RNG of every rank and each observer's; the
store.Checkpointer writes them on a background thread.
At the end, the artifacts (artifacts.py) draw the loss curve, sample the model, measure its held-out task
accuracy and export RUN/model/ as a Hugging Face folder (export_hf.py); checkpoint_cloud.py mirrors the
checkpoints to remote storage (--backup-to) and restores them on a fresh machine.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import math
import os
import re
import signal
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

try:
    import torch
except ModuleNotFoundError as missing:  # no torch at all: one line with this machine's install command
    if missing.name != "torch":
        raise
    from tinyllm.model import hardware

    sys.exit(f"error: {hardware.torch_install_problem(None, hardware.read_driver_cuda())}")
import torch.distributed as dist

from tinyllm.common import (
    ArgumentParser,
    UserError,
    add_options,
    at_least,
    atomic_write_json,
    atomic_write_text,
    check_options,
    config_argv,
    finite,
    given_options,
    not_negative,
    option,
    option_fields,
    option_flag,
    option_flags,
    os_error_text,
    positive,
    remove_temporaries,
    run_main,
    say,
    say_error,
    seed_everything,
    stop_on_sigterm,
    utc_now,
    with_option_values,
    without_options,
)
from tinyllm.data import corpus_format
from tinyllm.model import attention, generation, hardware, losses
from tinyllm.model import config as model_config
from tinyllm.outputs import artifacts, callbacks, evaluation, metrics_log, report, trackers
from tinyllm.store import checkpoint_cloud, remote_store
from tinyllm.store import checkpoint_store as store
from tinyllm.training import budget, distributed, optimization, train_data

SCRIPT = Path(__file__).resolve().parents[2] / "train.py"  # the script a clone runs (resume commands name it)
DEFAULT_DATA = "corpus/demo"  # relative to the current folder
DEFAULT_OUT = "runs/demo"
# Without --data, `python train.py` is the demo: DEFAULT_DATA is built if missing and these replace the
# defaults of the options not given (measured: >= 90% held-out addition in ~5 min on one CPU thread).
DEMO_DEFAULTS = {
    "preset": "tiny",
    "batch_size": 32,
    "grad_accum": 1,
    "target_tokens": 1400 * 32 * 128,
    "eval_tokens": 8 * 32 * 128,
    "save_every": 500,
    "log_every": 50,
    "threads": 1,
}

EVAL_TOKENS = 1 << 19  # held-out tokens scored at each validation and at the test: the whole splits of a corpus
# of data.py's under ~100 MB (2-5% each), a forward's cost: about a third of as many training tokens'
MAX_TOKENS = 1e15  # 1,000x the largest open pretraining runs: a larger count is a typo (1e30)
MAX_MICRO_BATCH_TOKENS = 1 << 24  # a micro-batch no device holds (its logits alone: 16M x the vocabulary)
MAX_STEP_TOKENS = 1 << 30  # 300x the largest batches of open pretraining runs (~3-4M tokens a step)


# ----------------------------------------------------------------------------------------------
# Options. Each one is declared once, as a field of one of three frozen dataclasses (its default,
# help, help group and checks together: common.option); build_parser makes the command line from
# them, parse_args builds the settings once and checks them (check_options, then check_settings for
# the rules between options). tests/test_settings.py checks every option lands in exactly one group.

LOSS_ON = ("all", "assistant")
TEXT_LOSS = ("full", "none")

PATHS, MODEL, BUDGET = "data and run folder", "model (a preset, with any field overridden)", "batch, length and seed"
LOSS = "which tokens the loss counts (the corpus' mask, see data.py)"
SAVING, STOPPING, SPEED = "checkpoints and evaluation", "stopping", "hardware and speed"
OUTPUT, BACKUP = "what a run shows and leaves behind", "checkpoint backup (checkpoint_cloud.py)"
OPTION_GROUPS = (PATHS, MODEL, BUDGET, optimization.OPTIONS, LOSS, SAVING, STOPPING, SPEED, OUTPUT, BACKUP)


DATA_HELP = (
    f"corpus folder built by data.py, or a corpus URL ({remote_store.schemes_text()}, pulled once into "
    f"{train_data.PULLED_CORPORA}/ and verified); or a mixture of sources NAME=CORPUS[#LABEL]:WEIGHT ... (one "
    f"tokenizer; docs/training.md#mixtures); None: the demo in {DEFAULT_DATA}"
)


def shape_option(name: str, what: str = "") -> Any:
    """A model field's override (None: the preset's; model_config.resolve_preset checks the shape)."""
    tiny, think72 = (getattr(model_config.PRESETS[preset], name) for preset in ("tiny", "think72"))
    shown = [("yes" if value else "no") if isinstance(value, bool) else f"{value:g}" for value in (tiny, think72)]
    return option(None, f"{what}None: the preset's (tiny {shown[0]}, think72 {shown[1]})", MODEL)


def token_count(text: str) -> int:
    """An argparse type for token counts: a whole number, also written as 3e8 or 1.5e9."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value) or value != int(value):
        raise argparse.ArgumentTypeError(f"not a whole number of tokens: {text!r}")
    if value > MAX_TOKENS:
        raise argparse.ArgumentTypeError(f"{text} tokens is more than any run can train (at most {MAX_TOKENS:.0e})")
    return int(value)


@dataclass(frozen=True, kw_only=True)
class RunSettings(optimization.RecipeOptions):
    """What makes the run this run, the recipe's options (optimization.RecipeOptions) included: a resume must
    give the same (Training.load compares them with the checkpoint's), except the length (target_tokens,
    epochs), which may change under extension()'s rule.

    None: the preset's shape, the recipe rule's value; what they resolve to is recorded beside these
    as model.* and recipe.* (and text_loss as resolved for the corpus)."""

    preset: str = option("tiny", "model shape", MODEL, choices=list(model_config.PRESETS))
    context: int | None = option(None, "tokens per block (None: the preset's)", MODEL, checks=(at_least(2),))
    layers: int | None = shape_option("layers")
    hidden: int | None = shape_option("hidden")
    intermediate: int | None = shape_option("intermediate")
    heads: int | None = shape_option("heads")
    kv_heads: int | None = shape_option("kv_heads")
    head_dim: int | None = shape_option("head_dim")
    rope_theta: float | None = shape_option("rope_theta")
    rms_norm_eps: float | None = shape_option("rms_norm_eps")
    tie_embeddings: bool | None = shape_option(
        "tie_embeddings",
        "the LM head shares the input embedding (no: its own matrix, trained at --head-lr under muon). ",
    )
    target_tokens: int | None = option(
        None,
        "train this many tokens, e.g. 300000000 or 3e8 (None, and no --epochs: 1 epoch)",
        BUDGET,
        type=token_count,
        checks=(positive,),
        exclusive="length",
    )
    epochs: float | None = option(
        None,
        "train this many passes over the train split",
        BUDGET,
        checks=(lambda value: None if math.isfinite(value) and value > 0 else "be a positive finite number",),
        exclusive="length",
    )
    budget: str | None = option(
        None,
        "plan the run for this much training time, e.g. 11.5h, 30m, or 30h over several --max-hours sessions: "
        "the preset, --target-tokens and the batch with the lowest predicted loss, measured on these devices "
        "before step 1, its tokens checked against the run's own steps, kept by every resume (an explicit "
        "--preset or --target-tokens wins; docs/budget.md)",
        BUDGET,
        checks=(budget.budget_problem,),
    )
    seed: int = option(1337, "model init and data order", BUDGET)
    packing: str = option(
        next(iter(train_data.PACKINGS)), train_data.PACKING_HELP, BUDGET, choices=tuple(train_data.PACKINGS)
    )
    loss_on: str = option(
        "all",
        "all: every token; assistant: only the assistants' answers (reasoning included) "
        "of chat documents, and plain-text documents as --text-loss says",
        LOSS,
        choices=LOSS_ON,
    )
    text_loss: str | None = option(
        None,
        "with --loss-on assistant, plain-text documents count fully or not at all (needed when the corpus has any)",
        LOSS,
        choices=TEXT_LOSS,
    )
    eval_tokens: int = option(  # which held-out blocks every score (best_val_loss too) is measured on
        EVAL_TOKENS,
        "validation and test over this many tokens of blocks of each split, in a fixed order (the whole split "
        "when it is smaller): the same blocks whatever the batch, the split between ranks and --seed, so runs on "
        "one corpus compare",
        SAVING,
        checks=(positive,),
    )
    mixture_schedule: str | None = option(
        None,
        "later phases of a --data mixture, 'START:NAME=WEIGHT,...;...' with START a step or 'decay' (wsd's "
        "decay), e.g. 'decay:web=0.3,chat=0.7'; the --data weights hold from step 0",
        BUDGET,
        metavar="PHASES",
    )


@dataclass(frozen=True, kw_only=True)
class SessionSettings:
    """What may change from one session of a run to the next (recorded as "runtime", never compared).

    batch_size and grad_accum only split the global batch, which must match (global_batch_blocks);
    data may move: the corpus itself is identified by its manifest's sha256."""

    data: str | tuple[str, ...] = option(None, DATA_HELP, PATHS, type=str, nargs="+", metavar="CORPUS")
    # one corpus folder or URL; a mixture: its NAME=CORPUS:WEIGHT values (its weights: recorded_settings)
    out: str = option(
        None, f"run folder: checkpoints, metrics, status (needed with --data; the demo: {DEFAULT_OUT})", PATHS
    )
    batch_size: int = option(8, "blocks per micro-step per rank", BUDGET, checks=(positive,))
    grad_accum: int = option(4, "micro-steps per optimizer step", BUDGET, checks=(positive,))
    save_every: int = option(250, "save every N steps (0: never by count)", SAVING, checks=(not_negative,))
    save_seconds: float = option(
        600,
        "also save when this many seconds have passed since the last save (0: never by time)",
        SAVING,
        checks=(finite, not_negative),
    )
    keep_last: int = option(2, "retention: keep the newest N step checkpoints", SAVING, checks=(at_least(1),))
    keep_every: int = option(
        0,
        "retention: also keep forever every checkpoint whose step is a multiple of N (0: off)",
        SAVING,
        checks=(not_negative,),
    )
    eval_every: int | None = option(
        None,
        "validation every N steps (0: only at the end; None: a fifth of the run, at most 250 steps, so a short "
        "run shows a validation curve too, and no more often than costs a twentieth of the training)",
        SAVING,
        checks=(not_negative,),
    )
    eval_tasks: tuple[str, ...] | None = option(
        None,
        "also score these multiple-choice tasks during training (also comma-separated): {context, choices, "
        "answer} JSONL files or folders, lm-eval task YAML files or lm-eval task names "
        "(docs/evaluation.md#in-the-loop)",
        SAVING,
        type=str,
        nargs="+",
        metavar="TASK",
    )
    eval_tasks_every: int | None = option(
        None,
        "score --eval-tasks every N steps (0: only at the end; None: with "
        "each validation, or every k-th one, or only at the end, whichever "
        "keeps the scoring near 5%% of the training: said at the start)",
        SAVING,
        checks=(not_negative,),
    )
    eval_tasks_limit: int = option(
        evaluation.DEFAULT_LOOP_LIMIT,
        "items per --eval-tasks task (a seeded, fixed subsample; 0: all)",
        SAVING,
        checks=(not_negative,),
    )
    log_every: int = option(10, "progress line and metrics every N steps", SAVING, checks=(positive,))
    max_hours: float = option(
        0,
        "stop (saved, resumable) early enough to save before this many hours (0: no limit, or a --budget run's budget)",
        STOPPING,
        checks=(finite, not_negative),
    )
    stop_after_steps: int = option(
        0, "stop (saved, resumable) once the run reaches step N (0: off)", STOPPING, checks=(not_negative,)
    )
    max_overflow_steps: int = option(
        32, "fp16: fail after this many optimizer steps in a row skipped for overflow", STOPPING, checks=(positive,)
    )
    device: str = option("auto", "auto: CUDA when torch sees a GPU, else CPU", SPEED, choices=["auto", "cpu", "cuda"])
    threads: int = option(0, "torch CPU threads per rank (0: torch's default)", SPEED, checks=(not_negative,))
    precision: str = option(  # as asked; what it resolves to on this device is recorded as runtime.precision
        "auto",
        "auto: bf16 on sm_80+ GPUs (A100, A10, L4, H100), fp16 with loss scaling below (T4, V100, P100), "
        "on CPU bf16 where it has avx512_bf16 or AMX, else fp32. May change on resume (a run can move between "
        "cards)",
        SPEED,
        choices=["auto", "fp32", "fp16", "bf16"],
    )
    compile: bool | None = option(
        None,
        "torch.compile the model and its loss (default: on CUDA, off on CPU); "
        "compiled at start, where a failure falls back to eager with a warning",
        SPEED,
    )
    grad_checkpoint: bool = option(False, "recompute activations in backward", SPEED)
    deterministic: bool = option(
        False,
        "CUDA: deterministic kernels only (torch.use_deterministic_algorithms, cuBLAS workspace config, no "
        "cuDNN attention), so a resumed run is bit for bit the uninterrupted one (slower; CPU runs are "
        "deterministic without it). May change on resume",
        SPEED,
    )
    require_gpus: int = option(0, "refuse to start with fewer visible GPUs", SPEED, checks=(not_negative,))
    require_gpu_name: str | None = option(None, "refuse to start unless every GPU name has this", SPEED)
    peak_tflops: float = option(
        0,
        "peak FLOP/s per device for MFU (0: GPU table, or an fp32/bf16 matmul measured on CPU)",
        SPEED,
        checks=(finite, not_negative),
    )
    report: bool = option(
        True,
        "loss_curve.png, sample_generations.json, held-out task accuracy and the Hugging "
        "Face export RUN/model at the end (--no-report: checkpoints and metrics only)",
        OUTPUT,
    )
    log_to: str = option(
        "",
        "also send the metrics to these experiment trackers, comma-separated, any mix of "
        "tensorboard (a file in RUN), wandb, trackio (docs/training.md#trackers)",
        OUTPUT,
        metavar="TRACKERS",
    )
    sample_temperature: float = option(
        0.0, "sample_generations.json: 0 greedy; above 0 sampled", OUTPUT, checks=(finite, not_negative)
    )
    sample_top_p: float = option(
        1.0, "sample_generations.json: nucleus sampling, keep this much probability mass (1: all)", OUTPUT
    )
    sample_top_k: int = option(
        0, "sample_generations.json: keep the k likeliest tokens (0: all)", OUTPUT, checks=(not_negative,)
    )
    sample_seed: int = option(0, "sample_generations.json: seed of the sampling (reproducible replies)", OUTPUT)
    backup_to: str | None = option(  # a URL may carry credentials: never recorded nor printed
        None,
        f"mirror checkpoints to this folder / {remote_store.schemes_text(' / ')} URL in the background (alias: "
        "THINK72_CLOUD_RESUME=1 with THINK72_BACKUP_URL)",
        BACKUP,
        metavar="URL",
    )
    remote_keep_recent: int = option(3, "newest remote checkpoints kept", BACKUP)
    remote_keep_every: int = option(
        10,
        "also keep every Nth save on the remote forever: every multiple of N x "
        "--save-every steps (none without --save-every); 0 = off",
        BACKUP,
    )
    backup_wait_seconds: float = option(
        600.0, "on stop, wait this long for pending uploads", BACKUP, checks=(not_negative,)
    )
    backup_max_unbacked: int = option(
        3,
        "local checkpoints without a remote copy kept beyond local retention; older ones are deleted with a warning",
        BACKUP,
    )


@dataclass(frozen=True, kw_only=True)
class Invocation:
    """What this command does, once: not part of the run (an --init-from source is recorded as its lineage)."""

    init_from: str | None = option(
        None,
        "start a new run from these weights: a checkpoint file, a run folder (its newest verified "
        "checkpoint) or a Hugging Face Qwen3 folder (e.g. RUN/model); fresh optimizer, schedule and data "
        "order; the tokenizer must be the corpus'",
        PATHS,
        metavar="SOURCE",
    )
    resume: str = option(
        "auto",
        "'auto' (also --resume alone): the newest checkpoint in OUT whose sha256 verifies "
        "(a fresh start when there is none); 'none': start fresh (refused if OUT has "
        "checkpoints); or a PATH",
        PATHS,
        nargs="?",
    )
    export_only: bool = option(
        False, "no training: export the --resume checkpoint (auto: OUT's newest) to OUT/model", OUTPUT
    )
    config: str | None = option(
        None,
        "read options from this TOML or YAML file (long names as keys; options "
        "given on the command line win); a run writes RUN/config.toml",
        PATHS,
        metavar="FILE",
    )
    demo: bool  # derived: no --data, so the demo and its defaults
    argv: tuple[str, ...]  # derived: the command line, for the resume command


@dataclass(frozen=True)
class Settings:
    """One command line's settings: parse_args builds them once; nothing changes them afterwards."""

    run: RunSettings
    session: SessionSettings
    invocation: Invocation


SETTINGS_GROUPS = (RunSettings, SessionSettings, Invocation)


def build_parser() -> argparse.ArgumentParser:
    demo = " ".join(f"--{key.replace('_', '-')} {value}" for key, value in DEMO_DEFAULTS.items())
    parser = ArgumentParser(
        description="Pretrain a Qwen3 model on a corpus built by data.py (run under torchrun for DDP). "
        "Without --data it runs the demo end to end.",
        epilog=f"The demo (no --data): builds {DEFAULT_DATA} with `data.py --demo` if it is not there, trains, "
        f"evaluates the held-out arithmetic problems and exports {DEFAULT_OUT}/model; options not given "
        f"take the demo defaults instead of those shown above: {demo}.",
    )
    add_options(parser, OPTION_GROUPS, *SETTINGS_GROUPS)
    return parser


def option_values(settings: Settings) -> dict:
    """Every setting by its option's name (argparse dest), the three groups together."""
    return {
        **dataclasses.asdict(settings.run),
        **dataclasses.asdict(settings.session),
        **dataclasses.asdict(settings.invocation),
    }


def parse_args(argv: list[str] | None = None) -> Settings:
    """The settings of this command line (UserError when one is wrong): a --config file's options first,
    then the command line's; without --data, the demo defaults replace those of the options not given."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(config_argv(parser, argv) + argv)
    demo = args.data is None
    if not demo:  # one plain corpus stays a string; a mixture is its values
        args.data = (
            args.data[0] if len(args.data) == 1 and not train_data.is_mixture_spec(args.data[0]) else tuple(args.data)
        )
    if demo:
        parser.set_defaults(data=DEFAULT_DATA, out=DEFAULT_OUT, **DEMO_DEFAULTS)
        epochs_given = args.epochs is not None  # --epochs replaces the demo's --target-tokens
        args = parser.parse_args(config_argv(parser, argv) + argv)
        if epochs_given:
            args.target_tokens = None
    if args.out is None:
        raise UserError("--data needs --out RUN: the run folder for its checkpoints, metrics and status")
    values = {
        **vars(args),
        "demo": demo,
        "argv": tuple(argv),
        "eval_tasks": tuple(args.eval_tasks) if args.eval_tasks else None,
    }

    def group(kind):
        return kind(**{field.name: values[field.name] for field in dataclasses.fields(kind)})

    settings = Settings(run=group(RunSettings), session=group(SessionSettings), invocation=group(Invocation))
    for part in (settings.run, settings.session, settings.invocation):
        check_options(part)
    check_settings(settings)
    return settings


NOT_IN_CONFIG = {"resume", "export_only", "config", "backup_to"}  # what this command does; a URL may hold a secret


def config_text(settings: Settings) -> str:
    """RUN/config.toml: every option of this run by its long name (those at None left out), so that
    `train.py --config RUN/config.toml` starts the same run again (--out, --backup-to given anew)."""
    import tomli_w

    values = {
        option_flag(field)[2:]: getattr(part, field.name)
        for part in (settings.run, settings.session, settings.invocation)
        for field in option_fields(type(part))
        if field.name not in NOT_IN_CONFIG
    }
    return (
        "# written by train.py: `python train.py --config THIS_FILE --out NEW_RUN` starts this run again\n"
        + tomli_w.dumps({key: value for key, value in values.items() if value is not None})
    )


def check_settings(settings: Settings) -> None:
    """The rules between options (each option's own checks are in its declaration), each broken one a
    UserError naming its option."""
    run, invocation = settings.run, settings.invocation
    checkpoint_cloud.refuse_placeholder(settings.session.backup_to)
    generation.sampling_from(option_values(settings), "sample_")  # a UserError naming the sampling option that is wrong
    trackers.check_trackers(trackers.tracker_names(settings.session.log_to))
    optimization.check_recipe_options(run)
    model_config.preset_of(run)  # the shape's own rules (heads a multiple of kv_heads)
    train_data.parse_mixture(settings.session.data, run.mixture_schedule)  # the mixture's own rules
    if run.text_loss is not None and run.loss_on != "assistant":
        raise UserError("--text-loss needs --loss-on assistant (with --loss-on all every token counts)")
    if invocation.init_from is not None and invocation.resume not in ("auto", "none"):
        raise UserError("--init-from starts a new run and --resume PATH continues one: give one of them")
    if (
        invocation.resume not in ("auto", "none")
        and re.fullmatch(r"[A-Za-z]+", invocation.resume)
        and not Path(invocation.resume).exists()
    ):
        raise UserError(
            f"--resume {invocation.resume}: not a choice and no such file; use auto (the newest "
            "verified checkpoint in --out), none (start fresh) or the PATH of a checkpoint"
        )


# ----------------------------------------------------------------------------------------------
# Precision: autocast (fp16's gradient scaling: optimization.LossScaler).


def resolve_precision(requested: str, device: hardware.Device) -> hardware.Precision:
    """hardware.choose_precision, its warning printed. CPU autocast takes float16 too: the whole T4 path
    (autocast + GradScaler, overflow skips, the scaler's state in checkpoints) runs anywhere for tests."""
    choice = hardware.choose_precision(requested, device)
    if choice.warning:
        warn(choice.warning)
    return choice


AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


# ----------------------------------------------------------------------------------------------
# Training: everything a step needs, callable from Python (bench/ times train_step directly).


class NonFiniteLoss(Exception):
    pass


class Training:
    """Model, optimizer, data, schedule and scaler of one run on one rank.

    settings = train.parse_args(["--data", CORPUS, "--out", RUN, "--preset", "micro", "--threads", "2"])
    info = distributed.init_distributed(settings.session.device)
    training = train.build_training(settings, info)
    result = training.train_step()          # one optimizer step (all micro-steps)
    """

    def __init__(self, settings: Settings, info: distributed.DistInfo, data: train_data.TrainData, vocab_size: int):
        run, session = settings.run, settings.session
        self.run, self.session, self.invocation = run, session, settings.invocation
        self.info, self.data, self.vocab_size = info, data, vocab_size
        self.preset = model_config.preset_of(run)
        self.hardware = hardware.describe(self.device)
        self.precision_choice = resolve_precision(session.precision, self.hardware)
        self.token_bytes = corpus_format.token_byte_lengths(
            data.corpus / corpus_format.TOKENIZER_DIR / "tokenizer.json", vocab_size
        ).to(self.device)
        self.step = 0  # optimizer steps taken: the only counter (data order, lr and checkpoint follow it)
        self.saved_step: int | None = None  # the step of this session's last checkpoint (save_checkpoint)
        self.total_steps = total_steps(run, data.train_blocks, data.global_batch, self.tokens_per_step)
        self.recipe, self.recipe_reasons = optimization.choose_recipe(
            run, self.preset.hidden, self.total_steps, self.preset.tie_embeddings
        )
        decay_start = self.recipe.total_steps - self.recipe.decay_steps if self.recipe.schedule == "wsd" else None
        data.start_phases(decay_start)  # after the recipe: a mixture's phase may start at its decay
        if unreached := data.unreached_phases(self.total_steps):
            say(unreached, warning=True, main=info.is_main)

        seed_everything(run.seed)
        self.model = model_config.build_training_model(
            self.preset, self.vocab_size, data.manifest.special_tokens, self.device, session.grad_checkpoint
        )
        if run.zero_init_output:
            model_config.zero_output_projections(self.model)
        self.optimizer = optimization.build_optimizers(
            self.model, self.recipe, self.device, info.rank, info.world, self.precision
        )
        self.scaler = optimization.LossScaler(self.device, enabled=self.precision == "fp16")
        self.rng = distributed.RankRNG(info)
        self.staging = store.StagingBuffers()
        self.run_id = uuid.uuid4().hex
        self.lineage: dict | None = None  # where --init-from took the first weights from
        self.extensions: list[dict] = []  # each resume that changed the run's length (extension)
        self.autocast_dtype = AUTOCAST_DTYPES.get(self.precision)
        self.attention_plan, self.sdpa_context, self.sdpa = choose_attention(self)
        self.compile = hardware.use_compile(session.compile, self.hardware)
        self.compile_fallback: str | None = None  # why compile_at_start went eager (its first line)
        self.forward_model = distributed.wrap_for_training(
            losses.LanguageModelLoss(self.model, run.z_loss), info, hardware.wrap_order(self.compile, info.world)
        )
        self.compile_seconds = compile_at_start(self) if self.compile else None
        self.flops_per_token = model_config.flops_per_token(self.preset, self.vocab_size, self.context)
        self.budget_plan: dict | None = None  # --budget's plan (budget.settle), set by train()

    @property
    def device(self) -> torch.device:
        return self.info.device

    @property
    def context(self) -> int:
        return self.preset.context

    @property
    def tokens_per_step(self) -> int:
        return self.data.global_batch * self.context

    def state_parts(self) -> dict:
        """The pieces of the training's state a checkpoint holds by name, each with state_dict()/load_state_dict()
        (besides these: the step, the run id, the RNG of every rank, the settings, and under "callbacks" the
        run's observers' states: callbacks.Callbacks)."""
        return {"model": self.model, "optimizer": self.optimizer, "scaler": self.scaler, "sampler": self.data}

    @property
    def precision(self) -> str:
        return self.precision_choice.value  # "fp32", "fp16" or "bf16", as resolved on this device

    def autocast(self):
        return torch.autocast(
            self.device.type, dtype=self.autocast_dtype or torch.float32, enabled=self.autocast_dtype is not None
        )

    def loss_of(
        self, batch: train_data.Batch, model: torch.nn.Module | None = None, reduction: str = "mean"
    ) -> torch.Tensor:
        """The training loss through forward_model (compiled, DDP), or through `model` as it is (evaluation)."""
        with self.autocast(), self.sdpa_context():
            if model is None:
                return self.forward_model(batch.inputs, batch.targets, reduction, batch.documents)
            return losses.language_model_loss(model, batch.inputs, batch.targets, reduction, documents=batch.documents)

    def train_step(self) -> callbacks.StepResult:
        """One optimizer step over all micro-steps; all ranks take part. Raises NonFiniteLoss."""
        started, cpu_started = time.perf_counter(), time.process_time()
        step = self.step
        lrs = self.optimizer.apply_schedule(self.recipe, step)
        batches = self.data.micro_batches(step, self.info.rank, self.device)
        loss_sum = backward_micro_steps(self, batches)
        optimizers = list(self.optimizer.parts.values())
        self.scaler.unscale_(optimizers)
        # --grad-clip 0 is off: an infinite bound never clips (a bound of 0 would zero every gradient)
        grad_norm = optimization.clip_gradients(self.model.parameters(), self.recipe.grad_clip or math.inf).item()
        mean_loss = distributed.all_reduce_sum(loss_sum, self.info).item() / self.info.world
        if not self.scaler.enabled and not (math.isfinite(mean_loss) and math.isfinite(grad_norm)):
            raise NonFiniteLoss(f"non-finite loss ({mean_loss}) or gradient norm ({grad_norm}) at step {step + 1}")
        applied = self.scaler.step(optimizers, finite=math.isfinite(grad_norm))
        self.optimizer.zero_grad(set_to_none=self.info.world == 1)
        if applied:
            self.step += 1
        elif self.scaler.skipped_in_a_row >= self.session.max_overflow_steps:
            raise NonFiniteLoss(
                f"fp16: {self.scaler.skipped_in_a_row} optimizer steps in a row overflowed "
                f"at step {step + 1} (try --precision bf16 or fp32, or a lower --lr)"
            )
        return callbacks.StepResult(
            step=self.step,
            loss=mean_loss,
            lrs=lrs,
            grad_norm=grad_norm,
            seconds=time.perf_counter() - started,
            applied=applied,
            cpu_seconds=time.process_time() - cpu_started,
        )

    def snapshot(self, callbacks: dict | None = None) -> dict | None:
        """The full state copied to CPU, on rank 0 (None elsewhere), with `callbacks` (the observers' states,
        callbacks.Callbacks.state_dict) under "callbacks". Collective: every rank calls it.

        The copy lives in reused staging buffers: write it out (store.Checkpointer.save) and wait for
        that write (store.Checkpointer.wait) before the next snapshot.
        """
        rng = self.rng.state_dict()
        if not self.info.is_main:
            return None
        return self.staging.copy(
            {
                "format_version": store.FORMAT_VERSION,
                "step": self.step,
                "run_id": self.run_id,
                **{name: part.state_dict() for name, part in self.state_parts().items()},
                "callbacks": callbacks or {},
                "rng": rng,
                "settings": recorded_settings(self),
                "created": utc_now(),
            }
        )

    def load(self, checkpoint: dict, path: Path) -> None:
        """Restore every piece of state from `checkpoint` (check_resume first: only the run's length may
        differ), then prove model and optimizer equal the file."""
        check_resume(self, checkpoint, path)
        for name, part in self.state_parts().items():
            part.load_state_dict(checkpoint[name])
        self.step = int(checkpoint["step"])  # the one counter: the data order and the lr are functions of it
        self.run_id = checkpoint["run_id"]
        self.lineage = checkpoint["settings"].get("init_from")
        differences = store.tensor_differences(
            self.model.state_dict(), checkpoint["model"], "model"
        ) + store.tensor_differences(self.optimizer.state_dict(), checkpoint["optimizer"], "optimizer")
        if differences:
            raise UserError(
                f"checkpoint {path}: state after loading differs from the file at " + ", ".join(differences[:5])
            )
        self.rng.load_state_dict(checkpoint["rng"])


def choose_attention(training: Training):
    """attention.choose_attention's plan for this card and dtype, applied (attention.apply_attention_plan),
    probed on the real paths: a micro-batch with a document boundary and one without."""
    plan, *alternatives = attention.attention_plans(
        training.hardware, training.precision, training.preset.head_dim, attention.torch_kernels()
    )
    problem = attention.check_plan(plan, training.context)
    if problem:
        raise UserError(problem)
    with_boundary = probe_batch(training, rows=2, documents=True)

    def probe_step(kernels):
        for batch in (with_boundary, with_boundary._replace(documents=None)):
            with kernels(), training.autocast():
                hidden = training.model.model(
                    input_ids=batch.inputs, **attention.decoder_inputs(training.model, batch.documents)
                )
                hidden.last_hidden_state.float().sum().backward()

    context, label, warning, in_effect = attention.apply_attention_plan(training.model, plan, probe_step, alternatives)
    if warning or (plan.masked and training.hardware.is_cuda):
        warn(warning or f"{plan.reason}; attention uses the slower math kernel")
    return in_effect, context, label


def probe_batch(training: Training, rows: int, documents: bool) -> train_data.Batch:
    """A start-up probe's micro-batch of `rows` x context zeros on the run's device, every row split into
    two documents when `documents` (the path a --packing masked batch with a boundary takes)."""
    zeros = torch.zeros(rows, training.context, dtype=torch.long, device=training.device)
    layout = attention.probe_documents(rows, training.context).to(training.device) if documents else None
    return train_data.Batch(zeros, zeros, layout)


def probe_step_seconds(training: Training) -> float:
    """One train step, its time for the probe: on a CPU, as if the machine gave the process its cores
    (budget.unloaded_step_seconds: a burst of other load does not make a preset look slower); on an
    accelerator, the wall time (the host's CPU time does not measure the device's)."""
    result = training.train_step()
    return probe_seconds(training.device, result.seconds, result.cpu_seconds)


def probe_seconds(device: torch.device, wall: float, cpu: float) -> float:
    """A probe's timing of some work: on a CPU its CPU seconds over the threads, at most the wall time
    (budget.unloaded_step_seconds); on an accelerator the wall time."""
    if device.type != "cpu":
        return wall
    return budget.unloaded_step_seconds(wall, cpu, torch.get_num_threads())


OPTIMIZER_PROBE_STEPS = 3  # optimizer steps timed alone after a probe's window: the fastest is its time


def optimizer_step_seconds(training: Training) -> float:
    """One optimizer step's time alone, for the probe (budget.ProbeSpeed: a step of many micro-batches takes
    it once): the fastest of OPTIMIZER_PROBE_STEPS steps on the gradients of one untimed micro-batch (the
    probe's model is thrown away), each timed as probe_step_seconds times a step; on a card between two
    synchronizations (its kernels run after the host has moved on)."""
    batch = probe_batch(training, training.session.batch_size, documents=training.data.documents)
    training.loss_of(batch).backward()
    times = []
    for _ in range(OPTIMIZER_PROBE_STEPS):
        synchronize(training.device)
        started, cpu_started = time.perf_counter(), time.process_time()
        for optimizer in training.optimizer.parts.values():
            optimizer.step()
        synchronize(training.device)
        times.append(probe_seconds(training.device, time.perf_counter() - started, time.process_time() - cpu_started))
    training.model.zero_grad(set_to_none=True)
    return min(times)


def synchronize(device: torch.device) -> None:
    """Wait for a card's queued kernels (nothing on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class QuietWait:
    """What is left of the probe's wait for a quiet machine (budget.quiet_wait_seconds), spent as it waits."""

    seconds: float

    def until_quiet(self) -> float | None:
        """Wait while other load takes the run's cores, within what is left: the seconds waited once the
        machine is quiet (budget.busy_beside over QUIET_POLL_SECONDS), None if it never was."""
        allowed = self.seconds
        while self.seconds > 0:
            started = time.monotonic()
            _, busy = beside_load(lambda: time.sleep(min(budget.QUIET_POLL_SECONDS, self.seconds)))
            self.seconds -= time.monotonic() - started
            if not busy:
                return allowed - self.seconds
        return None


def beside_load(work: Callable[[], Any]) -> tuple[Any, bool]:
    """`work()`'s result, and whether other processes' load took cores this run's threads needed meanwhile
    (budget.busy_beside, from /proc/stat; False where there is none)."""
    before, cpu_before, started = hardware.read_cpu_times(), time.process_time(), time.monotonic()
    result = work()
    after = hardware.read_cpu_times()
    if before is None or after is None:
        return result, False
    own, wall = time.process_time() - cpu_before, time.monotonic() - started
    others = budget.others_cores(after.busy - before.busy, own, wall)
    return result, budget.busy_beside(others, after.cores, torch.get_num_threads())


def steady_window(training: Training, seconds: float, window: int, info: distributed.DistInfo) -> float:
    """The probe's step time from timed steps, until budget.steady_step_seconds has it over `window` steps
    (more steps while they disagree, within `seconds`). Every rank steps alike: rank 0's verdict ends the
    timing."""
    started = time.monotonic()
    return budget.time_until_steady(
        lambda: probe_step_seconds(training), lambda: time.monotonic() - started >= seconds, window, info
    )


def measured_again(
    training: Training,
    info: distributed.DistInfo,
    preset: str,
    step_seconds: float,
    took: float,
    wait: QuietWait,
    window: int,
) -> float:
    """A probe window that ran beside other load, measured again once the machine is quiet (given as long
    as the first took) and the faster kept; the first kept if it is not quiet within what is left of
    `wait`. Either way one line says so."""
    budgeted = wait.seconds
    waited = wait.until_quiet()
    if waited is None:
        log(
            info,
            f"--budget: {preset}'s probe ran beside other load, and the machine stayed busy for the "
            f"{budgeted:.0f} s the probe may wait: planned at the speed measured beside it",
        )
        return step_seconds
    again = steady_window(training, took, window, info)
    log(
        info,
        f"--budget: {preset}'s probe ran beside other load; measured again after {waited:.0f} s of "
        f"waiting for a quiet machine: {step_seconds / again:.2f}x the first measure's speed",
    )
    return min(step_seconds, again)


def use_threads(threads: int | None) -> None:
    """--threads: torch's threads in this process (None or 0: torch's default)."""
    if threads:
        torch.set_num_threads(threads)


def measure_speed(settings: Settings, info: distributed.DistInfo, quiet_wait: float) -> budget.Measure:
    """--budget's probe: a preset's speed at a micro-batch per rank, eager (budget.ProbeSpeed: its
    micro-batches' global tokens/s, the optimizer's step apart), from a steady window of timed train steps
    after budget.PROBE_WARMUP_STEPS untimed ones, less an optimizer step timed alone (optimizer_step_seconds,
    at most half the step); None when it does not fit the
    device's memory. Where the probe waits out other load (budget.waits_for_quiet), a window that ran
    beside it is measured again once the machine is quiet, within what is left of the probe's QuietWait
    (`quiet_wait` seconds in all, budget.make_plan's), and the faster of the two is kept (timeit's rule)."""
    waits = budget.waits_for_quiet(info.device.type == "cpu", torch.get_num_threads(), info.world)
    wait = QuietWait(quiet_wait if waits else 0.0)

    def measure(preset: str, micro_batch: int, seconds: float, window: int) -> float | None:
        run = dataclasses.replace(settings.run, preset=preset, target_tokens=10**9, epochs=None)
        session = dataclasses.replace(settings.session, batch_size=micro_batch, grad_accum=1, compile=False)
        try:
            training = build_training(dataclasses.replace(settings, run=run, session=session), info)
            for _ in range(budget.PROBE_WARMUP_STEPS):
                training.train_step()
            started = time.monotonic()
            timed = functools.partial(steady_window, training, seconds, window, info)
            step_seconds, busy = beside_load(timed) if wait.seconds > 0 else (timed(), False)  # no wait: no reads
            took = time.monotonic() - started
            if busy and wait.seconds > 0:
                step_seconds = measured_again(training, info, preset, step_seconds, took, wait, window)
            optimizer_seconds = min(optimizer_step_seconds(training), step_seconds / 2)
        except torch.OutOfMemoryError:
            return None
        except UserError as error:  # build_training's out-of-memory line; any other error is the run's
            if "out of memory" not in str(error):
                raise
            return None
        finally:
            training = None  # noqa: F841 (the model's memory goes before the next probe)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        tokens = micro_batch * model_config.preset_of(run).context * info.world
        return budget.ProbeSpeed(tokens / (step_seconds - optimizer_seconds), optimizer_seconds)

    return measure


def compile_at_start(training: Training) -> float | None:
    """Compile the loss module now, on a probe micro-batch of the run's shape (with a document boundary
    under --packing masked): the seconds it took, or None after a failure, when the run goes on eagerly
    with one warning line (Triton has failed on sm_75 cards before, nanoGPT #525). All ranks run it."""
    started = time.perf_counter()
    probe = probe_batch(training, training.session.batch_size, documents=training.data.documents)
    try:
        training.loss_of(probe).backward()
    except Exception as error:  # Dynamo's and Inductor's errors have no common base but Exception
        if isinstance(error, torch.OutOfMemoryError):
            raise
        training.compile = False
        training.forward_model = distributed.wrap_for_training(
            losses.LanguageModelLoss(training.model, training.run.z_loss),
            training.info,
            hardware.wrap_order(False, training.info.world),
        )
        first = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
        training.compile_fallback = f"{type(error).__name__}: {first}"
        warn(
            f"torch.compile failed on {training.hardware.label()} ({type(error).__name__}: {first}); the run "
            "goes on eagerly (slower); --no-compile skips the attempt"
        )
        return None
    finally:
        training.model.zero_grad(set_to_none=True)
    return time.perf_counter() - started


@torch.no_grad()
def heldout_loss(training: Training, split: str) -> dict | None:
    """Mean loss and perplexity over the first eval blocks of `split` (a fixed order), over all ranks.

    The blocks are --eval-tokens' worth (train_data.evaluation_rows): every run on the corpus, whatever its
    batch, split between ranks and seed, evaluates the same blocks, so its losses, the best checkpoint's and
    other runs' compare. A mixture evaluates that many tokens' blocks
    of each source: "sources" holds each one's result, the rest is over all of them together."""
    totals = {
        name: eval_totals(training, rows)
        for name, rows in training.data.evaluation_rows(split, training.info.rank).items()
    }
    if None in totals:  # one corpus
        return eval_result(totals[None])
    result = eval_result(sum(totals.values()))
    if result is not None:
        result["sources"] = {name: eval_result(part) for name, part in totals.items()}
    return result


def eval_totals(training: Training, rows: train_data.EvaluationRows) -> torch.Tensor:
    """(nats, counted targets, their bytes) over this rank's evaluation `rows`, summed over the ranks."""
    totals = torch.zeros(3, dtype=torch.float64, device=training.device)
    if rows.total == 0:
        return totals
    training.model.eval()
    for batch in rows.batches(training.session.batch_size, training.device):
        targets = batch.targets
        counted = targets != train_data.IGNORE_INDEX
        totals[0] += training.loss_of(batch, model=training.model, reduction="sum").double()
        totals[1] += counted.sum()
        totals[2] += training.token_bytes[targets[counted]].sum()
    training.model.train()
    return distributed.all_reduce_sum(totals, training.info)


def eval_result(totals: torch.Tensor) -> dict | None:
    """Loss, perplexity and bits per byte from summed (nats, counted targets, their bytes); None: none counted."""
    nats, tokens, text_bytes = totals.tolist()
    if tokens == 0:
        return None  # no blocks, or --loss-on assistant and no counted token in the evaluation blocks
    loss = nats / tokens
    bits_per_byte = nats / math.log(2) / text_bytes if text_bytes else None  # None: only special tokens
    return {
        "loss": loss,
        "perplexity": math.exp(min(loss, 50.0)),
        "tokens": int(tokens),
        "bits_per_byte": bits_per_byte,
        "bytes": int(text_bytes),
    }


def eval_task_scorer(training: Training) -> evaluation.LoopScorer | None:
    """--eval-tasks, read once (rank 0 reads them and keeps lm-eval's items in RUN/eval_tasks), with this
    rank's share of the items encoded; None without them."""
    session, info = training.session, training.info
    if not session.eval_tasks:
        return None
    kept = Path(session.out) / evaluation.LOOP_TASKS_DIR
    tasks = distributed.main_decides(
        lambda: evaluation.load_loop_tasks(session.eval_tasks, session.eval_tasks_limit, kept), info
    )
    return evaluation.LoopScorer(
        tasks, corpus_format.load_tokenizer(training.data.corpus), info.rank, info.world, training.context
    )


def score_eval_tasks(training: Training, scorer: evaluation.LoopScorer) -> dict[str, dict]:
    """Every --eval-tasks task scored on the model as it is now, each rank its share, summed over the
    ranks. Reads no data and no random numbers: the training goes on exactly as without it."""
    training.model.eval()
    with training.autocast(), training.sdpa_context():
        counts = scorer.counts(training.model, training.device, training.session.batch_size * training.context)
    training.model.train()
    totals = distributed.all_reduce_sum(
        torch.tensor(counts, dtype=torch.float64, device=training.device), training.info
    )
    return evaluation.loop_scores(scorer.tasks, totals.tolist())


def recorded_settings(training: Training) -> dict:
    """What a resumed run must share with the checkpoint ("training": the RunSettings, precision and
    text_loss as resolved, and what they make of this corpus) and what may change ("runtime")."""
    compared = {
        **dataclasses.asdict(training.run),
        **training.data.recorded(),  # text_loss (None with --loss-on all), the corpus and a mixture's sources
        "vocab_size": training.vocab_size,
        **model_config.recorded_shape(training.preset),
        "global_batch_blocks": training.data.global_batch,
        "tokens_per_step": training.tokens_per_step,
        "total_steps": training.total_steps,
        **training.recipe.recorded(),
    }
    runtime = {
        **dataclasses.asdict(training.session),
        **training.data.runtime(),
        "world_size": training.info.world,
        "precision": training.precision,
        "device": training.hardware.label(),
    }  # as resolved here
    del runtime["backup_to"]  # a URL may carry credentials
    return {
        "training": compared,
        "runtime": runtime,
        "init_from": training.lineage,
        "extended": training.extensions,
        "vocabulary_sha256": training.data.manifest.vocabulary_sha256,
        "budget": training.budget_plan,
    }


def backward_micro_steps(training: Training, batches: list[train_data.Batch]) -> torch.Tensor:
    """Forward and backward of this rank's micro-batches of one step (DDP syncs the gradients in the last);
    returns the sum of their losses, each a share of the step's loss (fp64)."""
    info = training.info
    loss_sum = torch.zeros((), dtype=torch.float64, device=training.device)
    if training.data.counted is not None:
        # the mean over the step's counted targets on all ranks (DDP averages the ranks' gradients)
        counted = sum((batch.targets != train_data.IGNORE_INDEX).sum() for batch in batches).double()
        per_rank = distributed.all_reduce_sum(counted, info).clamp(min=1) / info.world
    for micro, batch in enumerate(batches):
        last = micro == len(batches) - 1
        sync = contextlib.nullcontext() if last or info.world == 1 else training.forward_model.no_sync()
        with sync:
            if training.data.counted is None:
                loss = training.loss_of(batch) / len(batches)
            else:
                loss = training.loss_of(batch, reduction="sum") / per_rank.to(torch.float32)
            training.scaler.scale(loss).backward()
        loss_sum += loss.detach().double()
    return loss_sum


def total_steps(run: RunSettings, blocks: int, global_batch: int, tokens_per_step: int) -> int:
    """Optimizer steps of the run: --target-tokens' worth, else --epochs (default one) over the train blocks."""
    if run.target_tokens is not None:
        return max(1, math.ceil(run.target_tokens / tokens_per_step))
    epochs = 1.0 if run.epochs is None else run.epochs
    return max(1, math.ceil(epochs * blocks / global_batch))


def start_from(training: Training, source: store.InitSource) -> None:
    """A new run's weights from `source` (--init-from, before the first step); the rest stays fresh."""
    problem = store.init_mismatch(source, training.model, recorded_settings(training))
    if problem:
        raise UserError(problem)
    with torch.no_grad():
        training.model.load_state_dict(source.state)
    training.lineage = source.lineage


EVAL_BLOCKS_CHANGE = (
    "this run was validated on --eval-batches global batches of blocks (tinyllm before 2026-12-06); from here on "
    "on --eval-tokens' worth, other blocks: its validation losses before and after do not compare"
)


def check_resume(training: Training, checkpoint: dict, path: Path) -> None:
    """What a resume from `checkpoint` may change, decided before any state is restored: the warmup the rule
    chose for the run's first length is kept, a precision change is noted, any setting but the length
    refuses the resume (store.resume_verdict), and a new length must be a sound extension."""
    old = model_config.with_recorded_defaults(  # a knob or shape field added since: at its default
        optimization.with_recorded_defaults(checkpoint["settings"]["training"])
    )
    if "eval_batches" in old:  # recorded before --eval-tokens: scored from here on as this session asks
        old = {key: value for key, value in old.items() if key != "eval_batches"}
        old["eval_tokens"] = training.run.eval_tokens
        say(f"note: {EVAL_BLOCKS_CHANGE}", main=training.info.is_main)
    warmup = old.get("recipe.warmup_steps")
    if training.run.warmup_steps is None and warmup is not None and warmup != training.recipe.warmup_steps:
        # the rule chose it for the run's first length: an extended run keeps it (extension_problem)
        kept = dataclasses.replace(training.run, warmup_steps=int(warmup))
        recipe, reasons = optimization.choose_recipe(
            kept, training.preset.hidden, training.total_steps, training.preset.tie_embeddings
        )
        training.recipe = recipe
        training.recipe_reasons = [*reasons, f"{warmup} warmup steps: the run's, chosen for its first length"]
    runtime = checkpoint["settings"].get("runtime") or {}
    moved = hardware.precision_change(
        runtime.get("precision", training.precision), training.precision, training.hardware
    )
    if moved:
        say(f"note: {moved}", main=training.info.is_main)
    verdict = store.resume_verdict(old, recorded_settings(training)["training"])
    if verdict.others:
        unset = {
            field.name
            for field in dataclasses.fields(RunSettings)
            if getattr(training.run, field.name) in (None, field.default)
        }
        shapes = {name: dataclasses.asdict(preset) for name, preset in model_config.PRESETS.items()}
        keep = store.options_to_keep(verdict.others, option_flags(RunSettings), unset, shapes)
        raise UserError(
            f"settings differ from checkpoint {path}: "
            + store.describe_changes(verdict.others)
            + ". A resume keeps every training setting; only the length (--target-tokens or "
            "--epochs) may change, under --schedule wsd from a checkpoint before its decay"
            + (" (here its length in steps differs too)" if verdict.extend else "")
            + (f"; to resume with the checkpoint's values, add {' '.join(keep)}" if keep else "")
            + f"; for a new run from these weights use a new --out with --init-from {path}"
        )
    extensions = list(checkpoint["settings"].get("extended") or [])
    if verdict.extend:
        extensions.append(extension(old, training.recipe, training.total_steps, int(checkpoint["step"]), path))
        say(length_change_note(old, training.total_steps), main=training.info.is_main)
    training.extensions = extensions


def extension(old: dict, recipe: optimization.Recipe, total_steps: int, step: int, path: Path) -> dict:
    """The record of continuing the run recorded in `old` (its training settings) at `step` as a run of
    `total_steps` under `recipe` (the warmup the checkpoint's unless --warmup-steps asks otherwise, the
    decay derived for the new length). Refused (one line saying why) unless every step taken keeps its rate."""
    try:
        before = optimization.Recipe.from_recorded(old)
    except (TypeError, KeyError):
        raise UserError(f"checkpoint {path} does not record its recipe; it cannot be extended") from None
    problem = optimization.extension_problem(before, recipe, step)
    if problem:
        raise UserError(
            f"checkpoint {path} is a run of {old['total_steps']} steps and this one asks for "
            f"{total_steps}: its length cannot change: {problem}. Resume it with its length "
            f"({length_option(old)}), or start a new run from its weights with --init-from {path}"
        )
    return {"at_step": step, "from_total_steps": int(old["total_steps"]), "to_total_steps": total_steps}


def length_option(old: dict) -> str:
    """The option that gives the run recorded in `old` (its training settings) its length."""
    if old.get("target_tokens"):
        return f"--target-tokens {old['target_tokens']}"
    return f"--epochs {old.get('epochs') or 1}"


def length_change_note(old: dict, total_steps: int) -> str:
    """What a resume that changes the run's length says: a left-out length option changes it too."""
    return (
        f"note: this resume changes the run's length from {old['total_steps']} to {total_steps} steps; "
        f"to keep it, give {length_option(old)}"
    )


def batch_problem(batch_size: int, grad_accum: int, world: int, context: int) -> str | None:
    """Why a batch is a typo rather than a run (a micro-batch or a step of more tokens than any run takes), or
    None. --batch-size 1000000000 otherwise spent minutes gathering blocks before its first step, deaf to SIGTERM."""
    micro, step = batch_size * context, batch_size * grad_accum * world * context
    if micro > MAX_MICRO_BATCH_TOKENS:
        return (
            f"--batch-size {batch_size:,}: a micro-batch of {micro:,} tokens ({batch_size:,} blocks of {context}) is "
            f"more than any device holds (at most {MAX_MICRO_BATCH_TOKENS:,} tokens)"
        )
    if step > MAX_STEP_TOKENS:
        return (
            f"--batch-size {batch_size:,} x --grad-accum {grad_accum:,} x {world} rank(s): a step of {step:,} tokens "
            f"is more than any run takes (at most {MAX_STEP_TOKENS:,})"
        )
    return None


def build_training(
    settings: Settings, info: distributed.DistInfo, vocab_size: int | None = None, corpus: Path | None = None
) -> Training:
    """A ready-to-step Training from parsed options (no files written, no corpus check).

    `corpus`: the local folder of a plain corpus (train_data.prepare_corpus'; None: --data's). `vocab_size`
    (benchmarks only) builds the model with a larger vocabulary than the corpus tokenizer's, e.g. think72's
    33,069 over the small demo corpus, whose ids all stay valid."""
    session = settings.session
    problem = batch_problem(
        session.batch_size, session.grad_accum, info.world, model_config.preset_of(settings.run).context
    )
    if problem:
        raise UserError(problem)
    use_threads(session.threads)  # train() did it before the probe; for Python callers
    distributed.use_deterministic_kernels(session.deterministic)  # main() did it; for Python callers
    data = train_data.open_train_data(data_options(settings, info.world), corpus)
    if vocab_size is not None and vocab_size < data.manifest.vocab_size:
        raise UserError(f"vocab_size {vocab_size} is below the corpus' {data.manifest.vocab_size}")
    vocab_size = vocab_size or data.manifest.vocab_size
    try:
        return Training(settings, info, data, vocab_size)
    except torch.OutOfMemoryError:  # the weights, or the attention probe's one block, do not fit
        raise UserError(start_out_of_memory(settings.run, vocab_size, info.device)) from None


def data_options(settings: Settings, world: int) -> train_data.DataOptions:
    """What the run's data depends on, from its options."""
    run, session = settings.run, settings.session
    return train_data.DataOptions(
        data=session.data,
        mixture_schedule=run.mixture_schedule,
        packing=run.packing,
        loss_on=run.loss_on,
        text_loss=run.text_loss,
        context=model_config.preset_of(run).context,
        seed=run.seed,
        batch_size=session.batch_size,
        grad_accum=session.grad_accum,
        world=world,
        eval_tokens=run.eval_tokens,
    )


def start_out_of_memory(run: RunSettings, vocab_size: int, device: torch.device) -> str:
    """The error of a card that cannot hold the model and one block's forward and backward at start-up."""
    preset = model_config.preset_of(run)
    card = hardware.describe(device)
    return (
        f"CUDA out of memory on {card.label()} ({hardware.memory_text(card.memory_bytes)}) while building "
        f"--preset {run.preset} ({model_config.parameter_count(preset, vocab_size):,} parameters) and probing "
        f"attention on one block of {preset.context} tokens: no batch size fits; use a smaller --preset or "
        "--context, or a larger card (is another process using it? nvidia-smi shows)"
    )


# ----------------------------------------------------------------------------------------------
# The run: main() reads top-down; the loop; stopping on signals and the time budget.


def main(argv: list[str] | None = None, launched: float | None = None) -> int:
    """`launched`: time.monotonic() at the process's launch (`process_launch`, from the command line), from
    which a session's time limit counts; None (a caller in Python): from the start of training."""
    hardware.check_torch()
    settings = parse_args(argv)
    session, invocation = settings.session, settings.invocation
    distributed.use_deterministic_kernels(session.deterministic)  # before CUDA starts (the cuBLAS workspace)
    info = distributed.init_distributed(session.device)
    try:
        if invocation.export_only:
            return export_only(settings, info)
        # the hardware gate first: a refused start touches no corpus store, run folder or backup
        hardware.check_required_gpus(session.require_gpus, session.require_gpu_name, info.device.type)
        hardware.keep_freed_memory(info.device.type)  # before the probe and the run: both step with it
        corpus = distributed.main_decides(lambda: train_data.prepare_corpus(session.data, invocation.demo), info)
        with claim_run_folder(Path(session.out), info):
            backup_url = checkpoint_cloud.backup_url_from_env_or_arg(session.backup_to)
            if backup_url:
                distributed.main_decides(lambda: checkpoint_cloud.check_backup_target(backup_url), info)
            if backup_url and invocation.resume == "auto":
                distributed.main_decides(lambda: restore_from_backup(backup_url, Path(session.out)), info)
            backup = start_backup(session, info)
            try:
                last_line = train(
                    settings, info, corpus, backup=backup, backup_wait_s=session.backup_wait_seconds, started=launched
                )
            finally:
                if backup is not None:
                    backup.close()  # the one close: its last messages come before the run's last line
            log(info, last_line)
            return 0
    finally:
        distributed.shutdown_distributed()


def train(
    settings: Settings,
    info: distributed.DistInfo,
    corpus: Path,
    backup=None,
    backup_wait_s: float = 600,
    started: float | None = None,
) -> str:
    """The training run on the local `corpus` folder; returns its last line (report.final_line; rank 0).
    `backup` (rank 0; checkpoint_cloud.BackupProcess) gets every checkpoint. Every way it ends goes
    through one place: finish_run, or end_failed_run. `started`: the time.monotonic() the session's time
    limit counts from (None: now)."""
    process_started = time.monotonic() if started is None else started
    session = settings.session
    out = Path(session.out)
    for folder in train_data.corpus_folders(session.data):
        train_data.read_manifest(folder)  # a clear message when the corpus is missing, on every rank
        problems = distributed.main_decides(lambda: corpus_format.verify_corpus(folder), info)  # noqa: B023 (called at once)
        if problems:
            raise UserError(f"corpus {folder} does not match its manifest: " + "; ".join(problems))
    # --budget: the run's plan, made once (None without), applied here; its probe reads the threads
    use_threads(session.threads)
    given = given_options(build_parser(), settings.invocation.argv)
    plan = budget.settle(
        settings, info, corpus, given, functools.partial(measure_speed, settings, info), process_started
    )
    settings = budget.apply(settings, plan, info.world)

    status = store.RunStatus(
        out,
        enabled=info.is_main,  # read before this session writes anything
        resume_command=resume_command(info, settings.invocation.argv),
    )
    training, resume_path, observed = start_training(settings, info, corpus)
    training.budget_plan = plan.as_record() if plan else None
    scorer = eval_task_scorer(training)
    note = store.previous_session_note(status.previous, training.step)
    if note:
        log(info, note)
    recorded = recorded_settings(training)
    sinks = (
        trackers.open_trackers(trackers.tracker_names(session.log_to), out, training.run_id, recorded)
        if info.is_main
        else []
    )
    metrics = metrics_log.MetricsLog(out / "metrics.jsonl", enabled=info.is_main, sinks=sinks)
    checkpointer = (
        store.Checkpointer(
            out / "checkpoints",
            training.run_id,
            session.keep_last,
            session.keep_every,
            backup=backup,
            backup_wait_s=backup_wait_s,
        )
        if info.is_main
        else None
    )
    peak = write_run_files(training, settings, checkpointer, resume_path, recorded)
    describe_run(training)

    compiled = None if training.compile_seconds is None else f"compiled in {training.compile_seconds:.0f} s"
    progress = report.Progress(
        training.total_steps, training.step, session.log_every, enabled=info.is_main, first_note=compiled
    )
    observers = run_callbacks(training, scorer, metrics, progress, status, recorded)
    if observed is not None:
        observers.load_state_dict(observed)
    check = BudgetCheck(training, scorer, observers, progress, recorded) if resume_path is None else None
    observers.on_start(training.step)
    stop = StopRequest(training.info.is_main)
    stop.install()  # until the final status is written: a second Ctrl-C then still records store.FAILED
    try:
        status.running(training.step, training.total_steps)  # from here on a signal ends with a checkpoint
        try:
            state, reason = train_loop(training, checkpointer, observers, stop, peak, process_started, progress, check)
            observers.on_loop_end()
        finally:
            progress.close()
        stop.loop_ended = True
        return finish_run(training, status, checkpointer, observers, metrics, state, reason, stop)
    except BaseException as error:
        failure = end_failed_run(training, status, checkpointer, stop, error)
        if failure.message is None:
            raise
        raise UserError(failure.message, said=failure.urgent) from None
    finally:
        observers.close()
        stop.restore()


def start_training(
    settings: Settings, info: distributed.DistInfo, corpus: Path
) -> tuple[Training, Path | None, dict | None]:
    """The Training, resumed from the checkpoint --resume names or initialized from --init-from; the
    checkpoint it resumed from, and that checkpoint's observers' states (callbacks.Callbacks; None: a new run)."""
    invocation, out = settings.invocation, Path(settings.session.out)
    training = build_training(settings, info, corpus=corpus)
    resume_path = distributed.main_decides(lambda: store.tidy_and_find_resume_checkpoint(out, invocation.resume), info)
    observed = None
    if resume_path is not None:
        checkpoint = store.load_checkpoint_file(resume_path)
        training.load(checkpoint, resume_path)
        observed = checkpoint["callbacks"]
        log(
            info,
            f"resumed from {resume_path} at step {training.step}/{training.total_steps} (state verified)"
            + (f"; its weights first came from {training.lineage['source']}" if training.lineage else ""),
        )
        init_from = invocation.init_from
        if init_from is not None and (training.lineage or {}).get("source") != init_from:
            say(
                f"--init-from {init_from} is not used: {out} already holds a run, resumed from {resume_path} "
                f"(use a new --out to start a run from {init_from})",
                warning=True,
                main=info.is_main,
            )
    elif invocation.init_from is not None:
        start_from(training, store.read_init_source(invocation.init_from))  # every rank reads the same file
        lineage = training.lineage
        log(
            info,
            f"initialized from {lineage['source']} ({lineage['kind']}, step {lineage['step']}, sha256 "
            f"{lineage['sha256'][:12]}); optimizer, schedule and data order start fresh",
        )
    return training, resume_path, observed


def write_run_files(
    training: Training,
    settings: Settings,
    checkpointer: store.Checkpointer | None,
    resume_path: Path | None,
    recorded: dict,
) -> float | None:
    """Rank 0: the checkpoint timeline, config.toml, training_settings.json (`recorded`: recorded_settings)
    and hardware.json; returns the peak FLOP/s the MFU divides by (None on the other ranks)."""
    info, session = training.info, training.session
    if not info.is_main:
        return None
    out = Path(session.out)
    if resume_path is not None:
        checkpointer.start_timeline(resume_path, training.step)
    atomic_write_text(out / "config.toml", config_text(settings))
    write_settings_file(training, recorded)
    peak, source = hardware.peak_flops(info.device, training.precision, session.peak_tflops)
    atomic_write_json(
        out / "hardware.json",
        {
            **hardware.machine_record(info.device, info.world, training.precision, training.sdpa),
            "peak_flops": peak,
            "peak_flops_source": source,
        },
    )
    return peak


def write_settings_file(training: Training, recorded: dict) -> None:
    """Rank 0: RUN/training_settings.json (`recorded`: recorded_settings), at the start and after a --budget
    re-plan (BudgetCheck)."""
    atomic_write_json(
        Path(training.session.out) / "training_settings.json",
        {
            **recorded,
            "run_id": training.run_id,
            "parameters": model_config.parameter_count(training.preset, training.vocab_size),
            "flops_per_token": training.flops_per_token,
        },
    )


def describe_run(training: Training) -> None:
    """The run's shape, precision and recipe, and warnings about its corpus (rank 0 prints)."""
    info = training.info
    log(
        info,
        f"{model_config.parameter_count(training.preset, training.vocab_size):,} parameters, "
        f"{training.tokens_per_step:,} tokens/step, {training.total_steps} steps, {training.precision}, "
        f"world size {info.world} on {training.hardware.label()}",
    )
    log(
        info,
        f"  {training.precision_choice.reason}; attention: {training.sdpa}; Muon's Newton-Schulz in "
        f"{hardware.newton_schulz_dtype(training.hardware, training.precision)}",
    )
    if training.compile_seconds is not None:
        log(
            info,
            f"  torch.compile: the model and its loss compiled in {training.compile_seconds:.1f} s at start "
            "(--no-compile: eager)",
        )
    elif training.compile_fallback is not None:
        log(info, f"  torch.compile: fell back to eager at start ({training.compile_fallback})")
    for warning in training.data.warnings():
        say(warning, warning=True, main=info.is_main)
    log(info, training.recipe.describe())
    for line in training.data.summary(training.total_steps):
        log(info, line)
    if training.recipe_reasons:
        log(info, "  chosen by the rules (docs/recipe.md): " + "; ".join(training.recipe_reasons))
    if info.is_main:
        for warning in optimization.recipe_warnings(training.recipe):
            say(warning, warning=True)


def validation_cadence(training: Training) -> tuple[int, str | None]:
    """--eval-every, or its default for this run's length, step and validation split
    (callbacks.default_eval_every), and the note that says why the default moved from a fifth of the run."""
    if training.session.eval_every is not None:
        return training.session.eval_every, None
    rows = training.data.evaluation_rows("validation", 0).values()
    validation_tokens = sum(part.total for part in rows) * training.preset.context
    every = callbacks.default_eval_every(training.total_steps, validation_tokens, training.tokens_per_step)
    if every == callbacks.default_eval_every(training.total_steps):
        return every, None
    return every, (
        f"note: validation {f'every {every} steps' if every else 'only at the end'}, not every fifth of the run: "
        f"one reads {validation_tokens:,} tokens, and the default keeps validating near "
        f"{100 * callbacks.VALIDATION_COST_SHARE:.0f}% of the training; --eval-every N chooses"
    )


def evaluation_cadence(training: Training, scorer: evaluation.LoopScorer | None) -> tuple[int, int | None, list[str]]:
    """(validate every N steps, score the --eval-tasks every N steps; None without tasks; 0: at the end only),
    and the notes that say why a default moved from its usual cadence (the start-up prints them)."""
    validation_every, note = validation_cadence(training)
    notes = [note] if note else []
    if scorer is None:
        return validation_every, None, notes
    if training.session.eval_tasks_every is not None:
        return validation_every, training.session.eval_tasks_every, notes
    step_tokens = training.tokens_per_step // training.info.world
    tasks_every = evaluation.default_tasks_every(validation_every, training.total_steps, scorer.tokens, step_tokens)
    note = evaluation.tasks_cadence_note(validation_every, tasks_every, scorer.tokens, step_tokens)
    return validation_every, tasks_every, [*notes, *([note] if note else [])]


def run_callbacks(
    training: Training,
    scorer: evaluation.LoopScorer | None,
    metrics: metrics_log.MetricsLog,
    progress: report.Progress,
    status: store.RunStatus,
    recorded: dict,
) -> callbacks.Callbacks:
    """The run's observers (callbacks.py), in the order they are called; `recorded`: recorded_settings."""
    session, out = training.session, Path(training.session.out)
    validation_every, tasks_every, notes = evaluation_cadence(training, scorer)
    for note in notes:
        log(training.info, note)
    steps = training.total_steps, training.tokens_per_step
    observers = [
        callbacks.TrainLog(
            lambda step: step_fields(training, step), session.log_every, *steps, metrics, progress, status
        ),
        callbacks.Validation(lambda: heldout_loss(training, "validation"), validation_every, *steps, metrics, progress),
        callbacks.TaskScores(lambda: score_eval_tasks(training, scorer), tasks_every, *steps, metrics, progress),
    ]
    if training.info.is_main and session.report:
        facts = artifacts.RunFacts(
            out,
            training.data.corpus,
            training.run.preset,
            recorded,
            generation.sampling_from(vars(session), "sample_"),
            training.device,
        )
        observers += artifacts.end_of_run(training.model, facts, metrics, progress)
    return callbacks.Callbacks(observers)


def step_fields(training: Training, step: int) -> dict:
    """A train record's fields besides the step's own: the peak memory, and a mixture's progress per source."""
    return {"peak_memory_bytes": hardware.peak_memory_bytes(training.device), **training.data.progress(step)}


def train_loop(
    training: Training,
    checkpointer: store.Checkpointer | None,
    observers: callbacks.Callbacks,
    stop: StopRequest,
    peak: float | None,
    process_started: float,
    progress: report.Progress,
    check: BudgetCheck | None = None,
) -> tuple[str, str | None]:
    """Step until done or asked to stop; returns the final (status, reason). Each step: train, the
    observers' hooks (log, evaluate when due), --budget's check of its plan (`check`: once, in the session
    that started the run), then plan_step_end says whether to save and whether to stop."""
    session = training.session
    no_step = no_step_to_take(training, progress)
    if no_step is not None:
        return no_step
    clocks = SessionClocks(process_started)
    hours, limit = budget.session_limit(session.max_hours, training.budget_plan)
    flags = StepFlags(
        training.total_steps,
        session.save_every,
        session.save_seconds,
        hours,
        session.stop_after_steps,
        time_limit=limit,
        finish_grace=budget.finish_grace(session.max_hours, training.budget_plan),
    )
    while training.step < training.total_steps:
        if checkpointer is not None:
            checkpointer.check()
        result = training.train_step()
        if not result.applied:
            progress.write(f"fp16 overflow: step {result.step + 1} skipped (scale lowered), retrying")
            continue
        clocks.stepped(result.seconds)
        peak, tokens_per_second, mfu = step_throughput(training, result, peak)
        observers.on_step_end(result, callbacks.Speed(tokens_per_second, mfu))
        best = evaluate_if_due(observers, clocks, result.step)
        clock = agree_clock(clocks.read(stop, checkpointer), training.info)
        replanned = check is not None and check.after_step(clock, clocks.step_times)
        flags = dataclasses.replace(flags, total_steps=training.total_steps)
        end = plan_step_end(
            result.step, clock, dataclasses.replace(flags, new_best=best is not None, save_now=replanned)
        )
        if end.save:
            save_checkpoint(training, checkpointer, best, observers.state_dict())
            clocks.saved()
        if end.stop:
            return store.NEEDS_RESUME, end.why
    return store.COMPLETE, None


class BudgetCheck:
    """--budget's checks of its plan against the run's own steps (budget.check_due, budget.check_plan), in
    the session that started the run: the check, and the late check at the last step before the decay, which
    times the steps since the check. A re-plan changes the run's length as an extension would (the warmup
    kept, the decay moved, nothing taken changed), is recorded where the plan is (training_settings.json, and
    the checkpoint saved at this step), and printed as one line; a resume reads it back and checks no more."""

    def __init__(self, training: Training, scorer, observers: callbacks.Callbacks, progress, recorded: dict):
        self.training, self.scorer, self.observers, self.progress, self.recorded = (
            training,
            scorer,
            observers,
            progress,
            recorded,
        )

    def after_step(self, clock: StepClock, step_times: list[float]) -> bool:
        """Check the plan when due (`clock`: agreed over the ranks); whether the run's length changed."""
        training = self.training
        if training.budget_plan is None:
            return False
        plan, decay_start = budget.Plan.from_record(training.budget_plan), decay_start_rule(training)
        if not budget.check_due(plan, training.step, clock.elapsed, len(step_times), decay_start):
            return False
        every = next((observer.every for observer in self.observers.callbacks if observer.key == "validation"), 0)
        late = plan.check is not None  # the late check times the steps since the check, one time each
        times = step_times[len(step_times) - (training.step - plan.check["at_step"]) :] if late else step_times
        step_seconds = budget.rest_step_seconds(budget.typical_step_seconds(times), clock.slowest_eval, every)
        step_seconds = distributed.agree_max([step_seconds], training.info)[0]
        end_seconds = 2 * clock.slowest_eval + 2 * clock.last_write  # the re-plan's save, last validation, test, save
        seen = budget.Seen(training.step, clock.elapsed, step_seconds, end_seconds)
        max_tokens = budget.max_run_tokens(training, training.data.corpus)
        checked = budget.check_plan(plan, seen, decay_start, max_tokens)
        training.budget_plan = checked.as_record()
        record = checked.late_check if late else checked.check
        self.progress.write(f"--budget {plan.budget}: {budget.check_text(record, again=late)}")
        if record["replanned"]:
            self.apply(checked)
        self.recorded.update(recorded_settings(training))
        if training.info.is_main:
            write_settings_file(training, self.recorded)
        return record["replanned"]

    def apply(self, plan: budget.Plan) -> None:
        """The run's length, schedule, evaluation cadence and progress as the re-plan has them."""
        training = self.training
        training.run = dataclasses.replace(training.run, target_tokens=plan.target_tokens)
        training.total_steps = total_steps(
            training.run, training.data.train_blocks, training.data.global_batch, training.tokens_per_step
        )
        training.recipe, reasons = recipe_of_length(training, training.total_steps)
        training.recipe_reasons = [*reasons, f"{training.recipe.warmup_steps} warmup steps: the run's, kept"]
        decay = training.recipe.total_steps - training.recipe.decay_steps
        training.data.start_phases(decay if training.recipe.schedule == "wsd" else None)
        validation_every, tasks_every, _ = evaluation_cadence(training, self.scorer)  # said at the start
        cadence = {"validation": validation_every, "tasks": tasks_every}
        for observer in self.observers.callbacks:
            if hasattr(observer, "total_steps"):
                observer.total_steps = training.total_steps
            if observer.key in cadence:
                observer.every = cadence[observer.key]
        self.progress.set_total(training.total_steps)


def recipe_of_length(training: Training, steps: int) -> tuple[optimization.Recipe, list[str]]:
    """The run's recipe for a length of `steps`, its warmup kept (as an extension keeps it)."""
    kept = dataclasses.replace(training.run, warmup_steps=training.recipe.warmup_steps)
    return optimization.choose_recipe(kept, training.preset.hidden, steps, training.preset.tie_embeddings)


def decay_start_rule(training: Training):
    """A length's first decaying step under the run's recipe (its warmup kept), for budget.replan; None
    when a length cannot change without changing the steps taken (a cosine decays over the whole run)."""
    if training.recipe.schedule != "wsd":
        return None

    def decay_start(steps: int) -> int:
        recipe, _ = recipe_of_length(training, steps)
        return recipe.total_steps - recipe.decay_steps

    return decay_start


def evaluate_if_due(observers: callbacks.Callbacks, clocks: SessionClocks, step: int) -> float | None:
    """The evaluations due after `step` (each observer's cadence), timed for the end-of-step plan; returns
    the validation loss when it is a new best."""
    started = time.monotonic()
    measured = observers.on_eval(step)
    if measured:
        clocks.evaluated(time.monotonic() - started)
    return callbacks.new_best(measured)


def no_step_to_take(training: Training, progress: report.Progress) -> tuple[str, str] | None:
    """(status, reason) of a session that stops before its first step (already at --stop-after-steps);
    a run already complete says so and goes on to its test evaluation and report."""
    session = training.session
    if session.stop_after_steps and session.stop_after_steps <= training.step < training.total_steps:
        reason = (
            f"the run was already at step {training.step}, at or past --stop-after-steps "
            f"{session.stop_after_steps}: no step taken"
        )
        progress.write(reason)
        return store.NEEDS_RESUME, reason
    if training.step >= training.total_steps:  # e.g. the same command again after the run completed
        progress.write(
            f"the run was already complete at step {training.step}/{training.total_steps}: no step "
            f"taken; the test evaluation and the report are made again "
            f"({longer_run_words(training.recipe, training.run.budget, session.out)}, docs/stages.md)"
        )
    return None


def longer_run_words(recipe: optimization.Recipe, budget_text: str | None, out: str) -> str:
    """How a complete run is made longer (docs/stages.md): its last checkpoint has decayed, so a larger
    --target-tokens resumes a checkpoint of its stable phase (wsd only, and never a --budget run, whose plan
    is kept); else a new run from its weights."""
    new_run = f"a new --out with --init-from {out}"
    if budget_text is not None or recipe.schedule != "wsd":
        return f"a longer run: {new_run}"
    stable = recipe.total_steps - recipe.decay_steps
    return (
        f"a longer run: {new_run}, or --resume PATH of a checkpoint at step {stable} or before (its decay's "
        "start) with a larger --target-tokens or --epochs"
    )


def step_throughput(
    training: Training, result: callbacks.StepResult, peak: float | None
) -> tuple[float | None, float, float | None]:
    """(peak, tokens/s, MFU) of a step; an MFU above 100% measures the peak again (hardware.plausible_mfu)."""
    tokens_per_second = training.tokens_per_step / result.seconds
    mfu = training.flops_per_token * tokens_per_second / (peak * training.info.world) if peak else None
    if mfu is not None and mfu > 1:
        record = Path(training.session.out) / "hardware.json" if training.info.is_main else None
        peak, mfu = hardware.plausible_mfu(
            peak, mfu, training.device, training.precision, training.session.peak_tflops, record
        )
    return peak, tokens_per_second, mfu


def save_checkpoint(
    training: Training, checkpointer: store.Checkpointer | None, best_val_loss: float | None, observed: dict
) -> None:
    """Snapshot on every rank (RNG is gathered), write on rank 0 in the background, with `observed` (the
    observers' states, callbacks.Callbacks.state_dict). A step already saved is not saved again unless it
    set a new best; every rank decides alike (saved_step is on every rank), since the snapshot is a
    collective call."""
    if training.saved_step == training.step and best_val_loss is None:
        return
    if checkpointer is not None:
        checkpointer.wait()  # the staging buffers still feed the previous write until it is done
    snapshot = training.snapshot(observed)
    if checkpointer is not None:
        checkpointer.save(snapshot, training.step, best_val_loss)
    training.saved_step = training.step


class StopRequest:
    """SIGTERM/SIGINT set a flag; the loop finishes its step, saves and stops. A second SIGINT aborts."""

    def __init__(self, is_main: bool = True):
        self.is_main = is_main  # the rank that says what a signal does (under torchrun every rank gets it)
        self.requested = False
        self.loop_ended = False  # set once no step is left to take: a signal then only ends the report sooner
        self.ending_on_error = False  # set once the run ends on an error (end_failed_run): a signal only notes its time
        self.signum = 0  # the first signal's number (0: none yet)
        self.signalled_at: float | None = None  # time.monotonic() of the first signal
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        for signum in (signal.SIGTERM, signal.SIGINT):
            self._previous[signum] = signal.signal(signum, self._handle)

    def restore(self) -> None:
        """The handlers from before; SIGTERM's the default: the run's status is written, so a kill while the
        process exits needs no word (the start-up's `error: terminated` would say nothing was kept)."""
        for signum, handler in self._previous.items():
            signal.signal(signum, signal.SIG_DFL if signum == signal.SIGTERM else handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True
        if self.signalled_at is None:
            self.signum, self.signalled_at = int(signum), time.monotonic()
        if self.ending_on_error or not self.is_main:  # an error line says what happened; one rank speaks
            return
        what = (
            "training has already ended; finishing the run's status and report, then exiting"
            if self.loop_ended
            else "finishing this step, saving, then stopping"
        )
        print(f"{signal.Signals(signum).name}: {what}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------
# The end of a step: save? stop? why? (a pure plan of the clocks and the settings)


@dataclasses.dataclass(frozen=True)
class StepClock:
    """What the end of a step reads of the clocks, in seconds; agree_clock makes it the same on every rank."""

    elapsed: float = 0.0  # since this session started
    since_save: float = 0.0  # since the last save (or the loop's start)
    slowest_step: float = 0.0
    typical_step: float = 0.0  # SessionClocks.typical_step
    slowest_eval: float = 0.0
    last_write: float = 0.0  # the last checkpoint write
    signal: int = 0  # the signal that asked to stop (0: none)


@dataclasses.dataclass(frozen=True)
class StepFlags:
    """The rest the end of a step decides on: the run's length, the save and stop settings, a new best."""

    total_steps: int
    save_every: int = 0
    save_seconds: float = 0.0
    max_hours: float = 0.0
    stop_after_steps: int = 0
    new_best: bool = False  # this step's validation set a new best: its record must say so
    save_now: bool = False  # the run's length changed at this step (a --budget re-plan): saved with it
    time_limit: str = budget.MAX_HOURS_LIMIT  # what set max_hours, for the stop's reason (budget.session_limit)
    finish_grace: float = 0.0  # of max_hours: a run whose remaining steps and end fit this far past it finishes


@dataclasses.dataclass(frozen=True)
class StepEnd:
    save: bool
    stop: bool
    why: str | None = None  # the stop's reason, for run_status.json and the last line


LAST_SAVE_SECONDS = 10  # besides twice the slowest step, evaluation and write: the save and exit under --max-hours


def plan_step_end(step: int, clock: StepClock, flags: StepFlags) -> StepEnd:
    """Whether step `step` ends with a save and whether the session stops there, and why. The last
    step saves and completes, whatever asked to stop. The time limit stops when another step, evaluation
    and save (twice the slowest of each) might not fit it, unless the rest of the run fits.
    - Under a hard limit (--max-hours: a platform ends the session there), LAST_SAVE_SECONDS more for the
      exit, and the rest at the slowest recent step's time, a last validation and the test evaluation, a
      save and LAST_SAVE_SECONDS.
    - Under a budget's (finish_grace: the user's wish, which nothing enforces), the limit is the grace past
      the budget, and the rest at the recent steps' pace (`typical_step`) and its end. A burst of load near
      the end (two slow steps make a pace) thus stops nothing while the run has time to see it pass: at
      the budget less another step, save and LAST_SAVE_SECONDS, two steps of 1.1 s among 0.28 s ones
      stopped an 89 s budget's run saved at 77 s, 42 steps from its end (bench/RESULTS.md)."""
    limit = flags.max_hours * 3600
    hard = not flags.finish_grace
    needed = 2 * (clock.slowest_step + clock.slowest_eval + clock.last_write) + (LAST_SAVE_SECONDS if hard else 0)
    end = 2 * clock.slowest_eval + clock.last_write  # a last validation, the test evaluation, the last save
    steps_left = flags.total_steps - step
    fits_hard = clock.elapsed + steps_left * clock.slowest_step + end + LAST_SAVE_SECONDS < limit
    stop_at = limit * (1 + flags.finish_grace)
    fits_grace = not hard and clock.elapsed + steps_left * clock.typical_step + end < stop_at
    late = flags.max_hours and clock.elapsed + needed >= stop_at and not (fits_hard or fits_grace)
    why = None
    if step >= flags.total_steps:
        pass
    elif clock.signal:
        why = f"stopped by {signal.Signals(clock.signal).name}"
    elif late:
        why = f"stopped by {flags.time_limit}"
    elif flags.stop_after_steps and step >= flags.stop_after_steps:
        why = f"stopped by --stop-after-steps {flags.stop_after_steps}"
    save = (
        why is not None
        or step >= flags.total_steps
        or flags.new_best
        or flags.save_now
        or bool(flags.save_every and step % flags.save_every == 0)
        or bool(flags.save_seconds and clock.since_save >= flags.save_seconds)
    )
    return StepEnd(save=save, stop=why is not None, why=why)


RECENT_STEPS = 16  # the time limit's stop plans with the slowest of this many recent steps


class SessionClocks:
    """The loop's clocks: since the session started and the last save, the slowest step and evaluation."""

    def __init__(self, started: float):
        self.started, self.last_save = started, time.monotonic()
        self.slowest_eval = 0.0
        self.step_times: list[float] = []  # this session's, for --budget's check (BudgetCheck)

    @property
    def slowest_step(self) -> float:
        """The slowest of the last RECENT_STEPS steps: a burst of load long past (at the start, say) does
        not stop a session under a time limit early."""
        return max(self.step_times[-RECENT_STEPS:], default=0.0)

    @property
    def typical_step(self) -> float:
        """The pace a budget's finish is planned at: the median of the recent steps, or of the last 3 when they
        are slower (a machine that has just slowed down stays slow; one slow step is not a pace)."""
        recent = self.step_times[-RECENT_STEPS:]
        return max(statistics.median(recent), statistics.median(recent[-3:])) if recent else 0.0

    def stepped(self, seconds: float) -> None:
        self.step_times.append(seconds)

    def evaluated(self, seconds: float) -> None:
        self.slowest_eval = max(self.slowest_eval, seconds)

    def saved(self) -> None:
        self.last_save = time.monotonic()

    def read(self, stop: StopRequest, checkpointer: store.Checkpointer | None) -> StepClock:
        now = time.monotonic()
        return StepClock(
            elapsed=now - self.started,
            since_save=now - self.last_save,
            slowest_step=self.slowest_step,
            typical_step=self.typical_step,
            slowest_eval=self.slowest_eval,
            last_write=checkpointer.last_write_seconds if checkpointer else 0.0,
            signal=stop.signum,
        )


def agree_clock(clock: StepClock, info: distributed.DistInfo) -> StepClock:
    """The clock every rank plans the end of the step with: each field's largest over the ranks."""
    values = distributed.agree_max(list(dataclasses.astuple(clock)), info)
    fields = dict(zip((field.name for field in dataclasses.fields(StepClock)), values))
    return StepClock(**{**fields, "signal": int(fields["signal"])})


TORCHRUN_GRACE_SECONDS = 30  # torchrun's default --shutdown-timeout: SIGTERM, then SIGKILL this much later
STOP_MARGIN_SECONDS = 5  # of the grace period, kept for the last status write and the exit


def torchrun_grace_seconds(environ) -> float:
    """torchrun's grace period, as far as a worker can see it: TORCH_ELASTIC_SHUTDOWN_TIMEOUT (or
    PET_SHUTDOWN_TIMEOUT) when set in the environment, else torchrun's default. A --shutdown-timeout
    given on torchrun's command line is not passed on to the workers."""
    for name in ("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "PET_SHUTDOWN_TIMEOUT"):
        with contextlib.suppress(KeyError, ValueError):
            return float(environ[name])
    return TORCHRUN_GRACE_SECONDS


def stop_wait_seconds(
    backup_wait_seconds: float,
    signalled: bool,
    under_torchrun: bool,
    elapsed: float,
    grace: float = TORCHRUN_GRACE_SECONDS,
) -> float:
    """How long the end of a run waits for the last checkpoint's upload (the status naming the
    checkpoint is written before the wait). Under torchrun a signal is followed by SIGKILL `grace`
    seconds later: after one, the wait is what is left of the grace period since the signal (`elapsed`
    ago), less a margin, and at most --backup-wait-seconds."""
    if not (signalled and under_torchrun):
        return backup_wait_seconds
    return max(0.0, min(backup_wait_seconds, grace - elapsed - STOP_MARGIN_SECONDS))


def wait_for_backup(checkpointer: store.Checkpointer | None, since: float | None) -> bool | None:
    """Wait for the last checkpoint's upload (capped by stop_wait_seconds after a signal `since` then);
    whether it reached the remote (None: no backup)."""
    if checkpointer is None or checkpointer.backup is None:
        return None
    elapsed = 0.0 if since is None else time.monotonic() - since
    wait = stop_wait_seconds(
        checkpointer.backup_wait_s,
        since is not None,
        "TORCHELASTIC_RUN_ID" in os.environ,
        elapsed,
        torchrun_grace_seconds(os.environ),
    )
    return checkpointer.close(wait)


# ----------------------------------------------------------------------------------------------
# A run that ends on an error: what it records and says (a pure rule of the error), then the I/O.


# Signs in a collective's error that the other side is gone (gloo says so in a plain RuntimeError).
LOST_RANK_SIGNS = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Timed out waiting")


def lost_rank_cause(error: BaseException, world: int) -> str | None:
    """The short cause when `error` is a collective failing because another rank died or hangs, else None."""
    text = str(error).strip()
    if world == 1 or not (isinstance(error, dist.DistError) or any(sign in text for sign in LOST_RANK_SIGNS)):
        return None
    first = re.sub(r"^\[[^\]]*\] ", "", text.splitlines()[0] if text else type(error).__name__)  # gloo's file:line
    return first.split(". This is typically")[0][:200]


@dataclasses.dataclass(frozen=True)
class FailureContext:
    """What a failure's words name besides the error: where the run stands and how to go on."""

    step: int
    checkpoints: Path  # RUN/checkpoints
    status_file: Path
    resume_command: str
    rank: int = 0
    world: int = 1
    deterministic: bool = False
    out_of_memory_advice: str = ""  # out_of_memory_advice(training), for a CUDA out-of-memory error
    recorded: str | None = None  # the final status this session already recorded (RunStatus.final): it stays


@dataclasses.dataclass(frozen=True)
class Failure:
    status: str  # what run_status.json says (unless a final status was recorded): FAILED, or resumable
    reason: str  # its reason
    message: str | None  # the one `error:` line (a UserError); None: the error goes on as it is
    say: str | None = None  # a line for stderr first (a second Ctrl-C: where the run stands)
    urgent: bool = False  # torchrun tears the job down: the line is said at once, the upload wait fits its grace


def failure_reason(error: BaseException, last_checkpoint: str | None, context: FailureContext) -> Failure:
    """How a session that raised `error` ends, `last_checkpoint` (a name, or None) being the newest
    good one: table-tested in tests/test_core.py; end_failed_run records and says it."""
    kept = (
        f"the last good checkpoint, {last_checkpoint}, is intact"
        if last_checkpoint
        else "no checkpoint had been written yet"
    )
    tail = f"; {kept} (status {context.recorded or store.FAILED} in {context.status_file})"
    if isinstance(error, KeyboardInterrupt):  # a second Ctrl-C
        where = (
            f"the last checkpoint is {context.checkpoints / last_checkpoint}"
            if last_checkpoint
            else "no checkpoint was saved yet"
        )
        reason = (
            f"aborted by the user (second interrupt) at step {context.step}; {where}; continue with: "
            f"{context.resume_command}"
        )
        again = f"interrupted again after the run recorded {context.recorded}; continue with: {context.resume_command}"
        return Failure(store.FAILED, reason, None, say=again if context.recorded else reason)
    if isinstance(error, torch.OutOfMemoryError):  # torch.cuda.OutOfMemoryError too
        return Failure(store.FAILED, context.out_of_memory_advice, context.out_of_memory_advice + tail)
    if isinstance(error, (NonFiniteLoss, store.CheckpointWriteFailed)) or (isinstance(error, OSError) and error.errno):
        text = os_error_text(error) if isinstance(error, OSError) else str(error)
        return Failure(store.FAILED, text, f"training failed: {text}{tail}")
    described = f"{type(error).__name__}: {error}"
    cause = lost_rank_cause(error, context.world) if isinstance(error, RuntimeError) else None
    if cause is not None:
        who = f"rank {1 - context.rank}" if context.world == 2 else "another rank"
        reason = f"{who} stopped ({cause}); this rank exits too"
        return Failure(
            store.NEEDS_RESUME if last_checkpoint else store.FAILED,
            reason,
            f"{reason}; resume with: {context.resume_command}",
            urgent=True,
        )
    if context.deterministic and "does not have a deterministic implementation" in str(error):
        op = str(error).splitlines()[0].split(", but you set")[0]
        return Failure(
            store.FAILED,
            described,
            f"--deterministic: {op}; this run cannot be deterministic on this "
            "device: resume without --deterministic (a session setting)",
        )
    return Failure(store.FAILED, described, None)


def end_failed_run(
    training: Training,
    status: store.RunStatus,
    checkpointer: store.Checkpointer | None,
    stop: StopRequest,
    error: BaseException,
) -> Failure:
    """Rank 0 finishes a checkpoint write in flight (it holds good state), records failure_reason's
    status at once (before torchrun's SIGKILL, after a lost rank), then waits for the backup."""
    info, session = training.info, training.session
    out = Path(session.out)
    stop.ending_on_error = True
    if checkpointer is not None:
        with contextlib.suppress(Exception):
            checkpointer.wait()
    last = store.latest_checkpoint_name(out)
    command = resume_command(info, training.invocation.argv)
    advice = out_of_memory_advice(training) if isinstance(error, torch.OutOfMemoryError) else ""
    context = FailureContext(
        training.step,
        out / "checkpoints",
        out / store.STATUS_FILE,
        command,
        info.rank,
        info.world,
        session.deterministic,
        advice,
        status.final,
    )
    failure = failure_reason(error, last, context)
    recorded = status.failed(
        failure.status,
        reason=failure.reason,
        step=training.step,
        total_steps=training.total_steps,
        last_checkpoint=last,
        backup_complete=None,
    )
    if failure.urgent and failure.message:  # now, not at exit: torchrun's SIGTERM may follow at any moment
        say_error(failure.message)
    if recorded:
        since = stop.signalled_at or (time.monotonic() if failure.urgent else None)
        with contextlib.suppress(Exception):
            status.update(backup_complete=wait_for_backup(checkpointer, since))
    if failure.say and info.is_main:
        print(failure.say, file=sys.stderr, flush=True)
    return failure


# ----------------------------------------------------------------------------------------------
# The run's lifecycle: its folder, status and metrics files, the end of a run, the report and export.


@contextlib.contextmanager
def claim_run_folder(out: Path, info: distributed.DistInfo):
    """Rank 0 checks --out and holds its lock for the whole run; every rank learns of a refusal."""
    held = {}

    def claim() -> None:
        store.check_run_folder(out)
        held["new"] = not out.exists()
        held["lock"] = store.lock_run_folder(out)
        remove_temporaries(out)  # of a restore, a report or an export killed half-way (checkpoints/: the plan's)

    distributed.main_decides(claim, info)
    try:
        yield
    finally:
        if "lock" in held:
            store.release_run_folder(out, held["lock"], held["new"])  # a new folder refused before it began goes


def out_of_memory_advice(training: Training) -> str:
    """hardware.out_of_memory_advice for this run: its model, micro-batch, precision and card."""
    run, session = training.run, training.session
    return hardware.out_of_memory_advice(
        run.preset,
        training.preset,
        training.vocab_size,
        session.batch_size,
        session.grad_accum,
        training.context,
        training.precision,
        training.recipe.rule.state,
        session.grad_checkpoint,
        training.hardware,
        training.attention_plan.documents if training.data.documents else training.attention_plan.causal,
    )


def finish_run(
    training: Training,
    status: store.RunStatus,
    checkpointer: store.Checkpointer | None,
    observers: callbacks.Callbacks,
    metrics: metrics_log.MetricsLog,
    state: str,
    reason: str | None,
    stop: StopRequest,
) -> str:
    """The end of a run that stopped resumably or completed: the test evaluation when complete, then
    (rank 0) the status, the backup, the observers' end-of-run outputs; returns the last line ("" on the
    other ranks, which wait for rank 0)."""
    info = training.info
    test = heldout_loss(training, "test") if state == store.COMPLETE else None
    if test is not None:
        metrics.write(
            "test",
            step=training.step,
            tokens=training.step * training.tokens_per_step,
            test_loss=test["loss"],
            test_perplexity=test["perplexity"],
            test_bits_per_byte=test["bits_per_byte"],
            test_bytes=test["bytes"],
            **callbacks.source_results("test", test),
        )
        log(
            info,
            f"test loss {test['loss']:.4f}, perplexity {test['perplexity']:.2f}{metrics_log.bits_per_byte_text(test)}",
        )
    if not info.is_main:
        dist.barrier()  # rank 0 writes the status and the report; then all ranks tear down together
        return ""
    try:
        end = callbacks.RunEnd(
            state,
            training.step,
            training.total_steps,
            training.step * training.tokens_per_step,
            observers.summary()["validation"],
            test,
        )
        return finish_on_main(training, status, checkpointer, observers, end, reason, stop)
    finally:
        if info.world > 1:
            dist.barrier()


def finish_on_main(
    training: Training,
    status: store.RunStatus,
    checkpointer: store.Checkpointer,
    observers: callbacks.Callbacks,
    end: callbacks.RunEnd,
    reason: str | None,
    stop: StopRequest,
) -> str:
    """finish_run's part on rank 0: the status as soon as the last checkpoint is on disk (its report
    and model/ `pending`, with the command that makes them), then the backup, the observers' on_end (the
    report, the status again with what it made); returns the last line.

    After a signal under torchrun, SIGKILL follows within its grace period: the status naming the
    checkpoint is written first, and the wait for the upload fits what is left (stop_wait_seconds)."""
    info, session = training.info, training.session
    out = Path(session.out)
    checkpointer.wait()
    command = resume_command(info, training.invocation.argv)
    status.finished(
        end.status,
        **final_record(out, end, reason, observers.summary()),
        outputs=report_outputs(session.report, None),
        report_command=command if session.report else None,
    )
    status.update(backup_complete=wait_for_backup(checkpointer, stop.signalled_at))
    found = observers.on_end(end)
    if session.report:
        outputs = report_outputs(True, found)
        status.update(**found, outputs=outputs, report_command=command if "failed" in outputs.values() else None)
    if checkpointer.backup is not None:
        checkpointer.backup.push_run_files(out)  # the final run_status.json too, not the one of the last save
    return report.final_line(out, end.status, status.record)


def final_record(out: Path, end: callbacks.RunEnd, reason: str | None, measured: dict) -> dict:
    """What a finished session's status says of the run: where it stands, its losses, its last checkpoint;
    `measured`: the observers' summary (callbacks.Callbacks.summary)."""
    return {
        "step": end.step,
        "total_steps": end.total_steps,
        "tokens": end.tokens,
        "reason": reason,
        "last_checkpoint": store.latest_checkpoint_name(out),
        "best_val_loss": measured["best_val_loss"],
        "validation": measured["validation"],
        "test": end.test,
        "test_loss": end.test["loss"] if end.test else None,
        "train_loss": metrics_log.last_train_loss(out),
        "tasks": measured["tasks"],
        "tasks_step": measured["tasks_step"],
        "backup_complete": None,  # null until the upload wait ends (or with no backup)
    }


def report_outputs(asked: bool, found: dict | None) -> dict[str, str]:
    """run_status.json's `outputs`: the report and model/ "off" (--no-report), "pending" (not made
    yet: `found` None), "done" or "failed" (the artifacts' `report_errors` say why)."""
    if not asked:
        return {"report": "off", "model": "off"}
    if found is None:
        return {"report": "pending", "model": "pending"}
    return {
        "report": "failed" if found.get("report_errors") else "done",
        "model": "done" if found.get("model_files") else "failed",
    }


def export_only(settings: Settings, info: distributed.DistInfo) -> int:
    """--export-only: OUT/model/ from the --resume checkpoint, without training (rank 0 only), holding
    the run folder's lock: a training run that owns the folder writes its model/ itself."""
    if not info.is_main:
        return 0
    out = Path(settings.session.out)
    new = not out.exists()
    lock = store.lock_run_folder(out)
    try:
        return export_under_lock(settings, info)
    finally:
        store.release_run_folder(out, lock, new)  # refused: leave no folder behind


def export_under_lock(settings: Settings, info: distributed.DistInfo) -> int:
    """export_only's work, under the lock: the end-of-run artifacts of the checkpoint (artifacts.py)."""
    out = Path(settings.session.out)
    path = store.find_resume_checkpoint(out, settings.invocation.resume)
    if path is None:
        raise UserError(
            f"--export-only needs a checkpoint: --resume PATH, or an --out whose checkpoints/ has one "
            f"(none in {out / 'checkpoints'})"
        )
    checkpoint = store.load_checkpoint_file(path)
    corpus = (
        Path(checkpoint["settings"]["runtime"]["data"])
        if settings.invocation.demo
        else train_data.prepare_corpus(settings.session.data, demo=False)
    )
    sampling = generation.sampling_from(vars(settings.session), "sample_")  # the samples of a complete checkpoint
    artifacts.make_from_checkpoint(checkpoint, path, out, corpus, sampling, info.device)
    return 0


def resume_command(info: distributed.DistInfo, argv: list[str] | None = None) -> str:
    """This run's command line with `--resume auto` and without `--stop-after-steps`; a --backup-to URL
    is shown as it is, unless it carries credentials: then as URL (which parse_args refuses)."""
    argv = sys.argv[1:] if argv is None else argv
    shown = with_option_values(argv, {"--backup-to": checkpoint_cloud.shown_backup_url})
    kept = without_options(shown, ("--resume", "--stop-after-steps"))
    return distributed.launch_command(info, SCRIPT, [*kept, "--resume", "auto"])


def log(info: distributed.DistInfo, message: str) -> None:
    say(message, main=info.is_main)


# ----------------------------------------------------------------------------------------------
# Glue: warnings, checkpoint_cloud.py's restore and background backup (rank 0), the console script.


def warn(message: str) -> None:
    say(message, warning=True)


def restore_from_backup(url: str, out: Path) -> Path | None:
    """With no checkpoint in OUT that verifies, download the backup's newest verified one (rank 0)."""
    folder = out / "checkpoints"
    if store.newest_verified(store.list_folder(folder)) is not None:
        return None
    return checkpoint_cloud.restore_latest(url, folder)


def start_backup(session: SessionSettings, info: distributed.DistInfo):
    """The background checkpoint backup on rank 0 (None without --backup-to); an error stops every rank."""
    started = {}

    def start() -> None:
        started["backup"] = checkpoint_cloud.backup_from_args(session, session.save_every or None)

    distributed.main_decides(start, info)
    return started.get("backup")


def process_launch() -> float:
    """time.monotonic() at this process's launch (psutil's create time): a session's time limit (--max-hours,
    --budget) counts the interpreter's start and the imports too, seconds of them on a busy CPU (7.5 s at
    load 6 on this project's 2 cores: 3% of a 4-minute --budget)."""
    import psutil

    return time.monotonic() - max(0.0, time.time() - psutil.Process().create_time())


def command() -> None:
    """The `tinyllm-train` console script (pyproject.toml): `python train.py` from anywhere."""
    stop_on_sigterm()  # before the loop (its StopRequest saves): one `error:` line, a restore's download removed
    run_main(functools.partial(main, launched=process_launch()), script=True)


if __name__ == "__main__":
    command()
