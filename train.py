"""Pretrain a Qwen3 model on a tinyllm corpus, with bit-exact resume after any interruption.

    python train.py                                                   # the demo: corpus, training, export
    python train.py --data corpus/demo --out runs/demo                # one device
    torchrun --nproc_per_node=2 train.py --data CORPUS --out RUN       # DDP: NCCL on CUDA, gloo on CPU
    python train.py --data CORPUS --out RUN --resume auto             # continue where it stopped
    python train.py --export-only --resume PATH --out RUN             # RUN/model/ from any checkpoint

The contracts (data order, run folder, checkpoint contents) are in DESIGN.md. The file reads
top-down: options (each declared once), the recipe, Training (one step counter), the run (main,
the loop), its lifecycle, and the glue to checkpoint_cloud.py (checkpoint_store.py holds the checkpoint
rules and writer).
Its siblings hold the rest: the corpus reader and data order (data.py), the model (model_config.py),
attention's kernels and their plan (attention.py), per-device rules and measurements (hardware.py), the ranks
(distributed.py), metrics and the final line (report.py). Every piece of state that must survive a
restart is a small object with state_dict()/load_state_dict(): the data order, the optimizers, the
loss scaler, the RNG of every rank and the run metrics; the store.Checkpointer writes them on a
background thread.
At the end, report.py draws the loss curve, samples the model, measures its held-out task
accuracy and exports RUN/model/ as a Hugging Face folder; checkpoint_cloud.py mirrors the
checkpoints to remote storage (--backup-to) and restores them on a fresh machine.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import math
import os
import re
import signal
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

try:
    import torch
except ModuleNotFoundError as missing:  # no torch at all: one line with this machine's install command
    if missing.name != "torch":
        raise
    import hardware

    sys.exit(f"error: {hardware.torch_install_problem(None, hardware.read_driver_cuda())}")
import torch.distributed as dist

import attention
import checkpoint_cloud
import checkpoint_store as store
import data
import distributed
import evaluation
import hardware
import losses
import model_config
import report
import trackers
from common import (
    ArgumentParser,
    UserError,
    add_options,
    at_least,
    atomic_write_json,
    atomic_write_text,
    below_one,
    check_options,
    config_argv,
    finite,
    fraction,
    not_negative,
    option,
    option_fields,
    option_flag,
    os_error_text,
    positive,
    remove_temporaries,
    run_main,
    say,
    script_command,
    seed_everything,
    sha256_file,
    utc_now,
)

DEFAULT_DATA = "corpus/demo"  # relative to the current folder
DEFAULT_OUT = "runs/demo"
# Without --data, `python train.py` is the demo: DEFAULT_DATA is built if missing and these replace the
# defaults of the options not given (measured: >= 90% held-out addition in ~5 min on one CPU thread).
DEMO_DEFAULTS = {"preset": "tiny", "batch_size": 32, "grad_accum": 1, "target_tokens": 1400 * 32 * 128,
                 "eval_batches": 8, "save_every": 500, "log_every": 50, "threads": 1}

MAX_TOKENS = 1e15  # 1,000x the largest open pretraining runs: a larger count is a typo (1e30)


# ----------------------------------------------------------------------------------------------
# Options. Each one is declared once, as a field of one of three frozen dataclasses (its default,
# help, help group and checks together: common.option); build_parser makes the command line from
# them, parse_args builds the settings once and checks them (check_options, then check_settings for
# the rules between options). tests/test_settings.py checks every option lands in exactly one group.

LOSS_ON = ("all", "assistant")
TEXT_LOSS = ("full", "none")
OPTIMIZERS = ("muon", "adamw")
SCHEDULES = ("wsd", "cosine")
DEFAULT_OPTIMIZER = "muon"
DEFAULT_SCHEDULE = "wsd"
DEFAULT_DECAY_FRACTION = 0.4
DEFAULT_FINAL_LR_FRACTION = 0.1
DEFAULT_BETA2 = 0.95
MUON_COEFFICIENTS = ("torch", "polar-express")  # muon.Muon's Newton-Schulz coefficients
WEIGHT_DECAY_SCHEDULES = ("constant", "linear")
MOMENTUM_FLOOR = 0.85  # Muon's momentum at the start of a momentum warmup and the end of a cooldown (modded-nanogpt)

PATHS, MODEL, BUDGET = "data and run folder", "model (a preset, with any field overridden)", "batch, length and seed"
RECIPE = "optimizer and schedule (None: the recipe rule for this model and run, printed at start; see docs/recipe.md)"
LOSS = "which tokens the loss counts (the corpus' mask, see data.py)"
SAVING, STOPPING, SPEED = "checkpoints and evaluation", "stopping", "hardware and speed"
OUTPUT, BACKUP = "what a run shows and leaves behind", "checkpoint backup (checkpoint_cloud.py)"
OPTION_GROUPS = (PATHS, MODEL, BUDGET, RECIPE, LOSS, SAVING, STOPPING, SPEED, OUTPUT, BACKUP)


DATA_HELP = (f"corpus folder built by data.py, or a corpus URL (s3:// gs:// hf://, pulled once into "
             f"{data.PULLED_CORPORA}/ and verified); or a mixture of sources NAME=CORPUS[#LABEL]:WEIGHT ... (one "
             f"tokenizer; docs/training.md#mixtures); None: the demo in {DEFAULT_DATA}")


def shape_option(name: str) -> Any:
    """A model field's override (None: the preset's; model_config.resolve_preset checks the shape)."""
    tiny, think72 = model_config.PRESETS["tiny"], model_config.PRESETS["think72"]
    return option(None, f"None: the preset's (tiny {getattr(tiny, name):g}, think72 {getattr(think72, name):g})",
                  MODEL)


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
class RunSettings:
    """What makes the run this run: a resume must give the same (Training.load compares them with the
    checkpoint's), except the length (target_tokens, epochs), which may change under extension()'s rule.

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
    target_tokens: int | None = option(
        None, "train this many tokens, e.g. 300000000 or 3e8 (None, and no --epochs: 1 epoch)", BUDGET,
        type=token_count, checks=(positive,), exclusive="length")
    epochs: float | None = option(None, "train this many passes over the train split", BUDGET,
                                  checks=(lambda value: None if math.isfinite(value) and value > 0
                                          else "be a positive finite number",), exclusive="length")
    seed: int = option(1337, "model init and data order", BUDGET)
    packing: str = option(data.PACKINGS[0], "masked: blocks of the token stream, attention and RoPE positions kept "
                                            "inside each document; bestfit: rows that start at a document, filled "
                                            "by best fit, no mask; stream: blocks of the stream, attention across "
                                            "documents (docs/training.md)", BUDGET, choices=data.PACKINGS)
    optimizer: str | None = option(
        None, f"muon: torch.optim.Muon for the hidden matrices, AdamW for embeddings and norms; adamw: AdamW "
              f"for everything (None: {DEFAULT_OPTIMIZER})", RECIPE, choices=OPTIMIZERS)
    lr: float | None = option(None, "AdamW's peak learning rate (under muon: of the embeddings and norms)",
                              RECIPE, checks=(finite, positive))
    muon_lr: float | None = option(None, "Muon's peak learning rate (hidden matrices)", RECIPE,
                                   checks=(finite, positive))
    schedule: str | None = option(
        None, "cosine: warmup, then cosine decay; wsd: warmup, constant, then a linear decay over the last "
              f"--decay-fraction of the run (None: {DEFAULT_SCHEDULE})", RECIPE, choices=SCHEDULES)
    warmup_steps: int | None = option(None, "linear warmup steps (None: a fraction of the run, see docs/recipe.md)",
                                      RECIPE, checks=(not_negative,))
    decay_fraction: float | None = option(None, f"wsd: share of the run spent decaying (None: "
                                                f"{DEFAULT_DECAY_FRACTION})", RECIPE, checks=(finite, fraction))
    final_lr_fraction: float | None = option(
        None, f"learning rate at the end, as a fraction of the peak (None: {DEFAULT_FINAL_LR_FRACTION})", RECIPE,
        checks=(finite, fraction))
    weight_decay: float = option(0.1, "decoupled weight decay of the matrices (AdamW's and Muon's; not "
                                      "embeddings or norms)", RECIPE, checks=(finite, not_negative))
    beta1: float = option(0.9, "AdamW beta1", RECIPE, checks=(finite, below_one))
    beta2: float | None = option(None, f"AdamW beta2 (None: {DEFAULT_BETA2})", RECIPE, checks=(finite, below_one))
    muon_momentum: float = option(0.95, "Muon's (Nesterov) momentum", RECIPE, checks=(finite, below_one))
    momentum_warmup_steps: int = option(0, f"Muon's momentum rises from {MOMENTUM_FLOOR} over this many first steps",
                                        RECIPE, checks=(not_negative,))
    momentum_cooldown_steps: int = option(0, f"Muon's momentum falls back to {MOMENTUM_FLOOR} over this many last "
                                             "steps", RECIPE, checks=(not_negative,))
    muon_coefficients: str = option("torch", "Muon's Newton-Schulz coefficients: torch's, or Polar Express's",
                                    RECIPE, choices=MUON_COEFFICIENTS)
    normuon_beta2: float = option(0.0, "NorMuon: normalize each neuron's Muon update by its running RMS with "
                                       "this beta2, e.g. 0.95 (0: off, torch's Muon update)", RECIPE,
                                  checks=(finite, below_one, not_negative))
    cautious_weight_decay: bool = option(False, "decay only the weights the update also shrinks", RECIPE)
    weight_decay_schedule: str = option("constant", "linear: the weight decay falls to 0 over the run (besides "
                                                    "following the lr)", RECIPE, choices=WEIGHT_DECAY_SCHEDULES)
    z_loss: float = option(0.0, "add this x logsumexp(logits)^2 per token to the training loss (PaLM's z-loss; "
                                "0: off)", RECIPE, checks=(finite, not_negative))
    zero_init_output: bool = option(False, "start the attention and MLP output projections at zero", MODEL)
    grad_clip: float = option(1.0, "clip the global gradient norm (0: off)", RECIPE, checks=(finite, not_negative))
    adam8bit: bool = option(False, "bitsandbytes AdamW8bit (CUDA)", SPEED, flag="--8bit-adam")
    loss_on: str = option("all", "all: every token; assistant: only the assistants' answers (reasoning included) "
                                 "of chat documents, and plain-text documents as --text-loss says", LOSS,
                          choices=LOSS_ON)
    text_loss: str | None = option(None, "with --loss-on assistant, plain-text documents count fully or not at "
                                         "all (needed when the corpus has any)", LOSS, choices=TEXT_LOSS)
    eval_batches: int = option(  # which validation blocks best_val_loss is measured on
        4, "validation over this many global batches of blocks (the same blocks whatever the split between "
           "ranks, --batch-size and --grad-accum)", SAVING, checks=(positive,))
    mixture_schedule: str | None = option(
        None, "later phases of a --data mixture, 'START:NAME=WEIGHT,...;...' with START a step or 'decay' (wsd's "
              "decay), e.g. 'decay:web=0.3,chat=0.7'; the --data weights hold from step 0", PATHS, metavar="PHASES")


@dataclass(frozen=True, kw_only=True)
class SessionSettings:
    """What may change from one session of a run to the next (recorded as "runtime", never compared).

    batch_size and grad_accum only split the global batch, which must match (global_batch_blocks);
    data may move: the corpus itself is identified by its manifest's sha256."""

    data: str | tuple[str, ...] = option(None, DATA_HELP, PATHS, type=str, nargs="+", metavar="CORPUS")
    # one corpus folder or URL; a mixture: its NAME=CORPUS:WEIGHT values (its weights: recorded_settings)
    out: str = option(None, f"run folder: checkpoints, metrics, status (needed with --data; the demo: "
                            f"{DEFAULT_OUT})", PATHS)
    batch_size: int = option(8, "blocks per micro-step per rank", BUDGET, checks=(positive,))
    grad_accum: int = option(4, "micro-steps per optimizer step", BUDGET, checks=(positive,))
    save_every: int = option(250, "save every N steps (0: never by count)", SAVING, checks=(not_negative,))
    save_seconds: float = option(600, "also save when this many seconds have passed since the last save (0: never "
                                      "by time)", SAVING, checks=(finite, not_negative))
    keep_last: int = option(2, "retention: keep the newest N step checkpoints", SAVING, checks=(at_least(1),))
    keep_every: int = option(0, "retention: also keep forever every checkpoint whose step is a multiple of N "
                                "(0: off)", SAVING, checks=(not_negative,))
    eval_every: int | None = option(None, "validation every N steps (0: only at the end; None: a fifth of the run, "
                                          "at most 250 steps, so a short run shows a validation curve too)", SAVING,
                                    checks=(not_negative,))
    eval_tasks: tuple[str, ...] | None = option(
        None, "also score these multiple-choice tasks during training (also comma-separated): {context, choices, "
              "answer} JSONL files or folders, lm-eval task YAML files or lm-eval task names "
              "(docs/evaluation.md#in-the-loop)", SAVING, type=str, nargs="+", metavar="TASK")
    eval_tasks_every: int | None = option(None, "score --eval-tasks every N steps (0: only at the end; None: with "
                                                "each validation, or every k-th one, or only at the end, whichever "
                                                "keeps the scoring near 5%% of the training: said at the start)",
                                          SAVING, checks=(not_negative,))
    eval_tasks_limit: int = option(evaluation.DEFAULT_LOOP_LIMIT, "items per --eval-tasks task (a seeded, fixed "
                                                                 "subsample; 0: all)", SAVING,
                                   checks=(not_negative,))
    log_every: int = option(10, "progress line and metrics every N steps", SAVING, checks=(positive,))
    max_hours: float = option(0, "stop (saved, resumable) early enough to save before this budget (0: no limit)",
                              STOPPING, checks=(finite, not_negative))
    stop_after_steps: int = option(0, "stop (saved, resumable) once the run reaches step N (0: off)", STOPPING,
                                   checks=(not_negative,))
    max_overflow_steps: int = option(32, "fp16: fail after this many optimizer steps in a row skipped for "
                                         "overflow", STOPPING, checks=(positive,))
    device: str = option("auto", "auto: CUDA when torch sees a GPU, else CPU", SPEED, choices=["auto", "cpu", "cuda"])
    threads: int = option(0, "torch CPU threads per rank (0: torch's default)", SPEED, checks=(not_negative,))
    precision: str = option(  # as asked; what it resolves to on this device is recorded as runtime.precision
        "auto", "auto: bf16 on sm_80+ GPUs (A100, A10, L4, H100), fp16 with loss scaling below (T4, V100, P100), "
                "fp32 on CPU. May change on resume (a run can move between cards)", SPEED,
        choices=["auto", "fp32", "fp16", "bf16"])
    compile: bool | None = option(None, "torch.compile the model and its loss (default: on CUDA, off on CPU); "
                                        "compiled at start, where a failure falls back to eager with a warning",
                                  SPEED)
    grad_checkpoint: bool = option(False, "recompute activations in backward", SPEED)
    deterministic: bool = option(
        False, "CUDA: deterministic kernels only (torch.use_deterministic_algorithms, cuBLAS workspace config, no "
               "cuDNN attention), so a resumed run is bit for bit the uninterrupted one (slower; CPU runs are "
               "deterministic without it). May change on resume", SPEED)
    require_gpus: int = option(0, "refuse to start with fewer visible GPUs", SPEED, checks=(not_negative,))
    require_gpu_name: str | None = option(None, "refuse to start unless every GPU name has this", SPEED)
    peak_tflops: float = option(0, "peak FLOP/s per device for MFU (0: GPU table, or an fp32/bf16 matmul measured "
                                   "on CPU)", SPEED, checks=(finite, not_negative))
    report: bool = option(True, "loss_curve.png, sample_generations.json, held-out task accuracy and the Hugging "
                                "Face export RUN/model at the end (--no-report: checkpoints and metrics only)", OUTPUT)
    log_to: str = option("", "also send the metrics to these experiment trackers, comma-separated, any mix of "
                             "tensorboard (a file in RUN), wandb, trackio (docs/training.md#trackers)", OUTPUT,
                         metavar="TRACKERS")
    sample_temperature: float = option(0.0, "sample_generations.json: 0 greedy; above 0 sampled", OUTPUT,
                                       checks=(finite, not_negative))
    sample_top_p: float = option(1.0, "sample_generations.json: nucleus sampling, keep this much probability mass "
                                      "(1: all)", OUTPUT)
    sample_top_k: int = option(0, "sample_generations.json: keep the k likeliest tokens (0: all)", OUTPUT,
                               checks=(not_negative,))
    sample_seed: int = option(0, "sample_generations.json: seed of the sampling (reproducible replies)", OUTPUT)
    backup_to: str | None = option(  # a URL may carry credentials: never recorded nor printed
        None, "mirror checkpoints to this folder / s3:// / gs:// / hf:// URL in the background (alias: "
              "THINK72_CLOUD_RESUME=1 with THINK72_BACKUP_URL)", BACKUP, metavar="URL")
    remote_keep_recent: int = option(3, "newest remote checkpoints kept", BACKUP)
    remote_keep_every: int = option(10, "also keep every Nth save on the remote forever: every multiple of N x "
                                        "--save-every steps (none without --save-every); 0 = off", BACKUP)
    backup_wait_seconds: float = option(600.0, "on stop, wait this long for pending uploads", BACKUP,
                                        checks=(not_negative,))
    backup_max_unbacked: int = option(3, "local checkpoints without a remote copy kept beyond local retention; "
                                         "older ones are deleted with a warning", BACKUP)


@dataclass(frozen=True, kw_only=True)
class Invocation:
    """What this command does, once: not part of the run (an --init-from source is recorded as its lineage)."""

    init_from: str | None = option(
        None, "start a new run from these weights: a checkpoint file, a run folder (its newest verified "
              "checkpoint) or a Hugging Face Qwen3 folder (e.g. RUN/model); fresh optimizer, schedule and data "
              "order; the tokenizer must be the corpus'", PATHS, metavar="SOURCE")
    resume: str = option("auto", "'auto' (also --resume alone): the newest checkpoint in OUT whose sha256 verifies "
                                 "(a fresh start when there is none); 'none': start fresh (refused if OUT has "
                                 "checkpoints); or a PATH", PATHS, nargs="?")
    export_only: bool = option(False, "no training: export the --resume checkpoint (auto: OUT's newest) to "
                                      "OUT/model", OUTPUT)
    config: str | None = option(None, "read options from this TOML or YAML file (long names as keys; options "
                                      "given on the command line win); a run writes RUN/config.toml", PATHS,
                                metavar="FILE")
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
               f"take the demo defaults instead of those shown above: {demo}.")
    add_options(parser, OPTION_GROUPS, *SETTINGS_GROUPS)
    return parser


def option_values(settings: Settings) -> dict:
    """Every setting by its option's name (argparse dest), the three groups together."""
    return {**dataclasses.asdict(settings.run), **dataclasses.asdict(settings.session),
            **dataclasses.asdict(settings.invocation)}


def parse_args(argv: list[str] | None = None) -> Settings:
    """The settings of this command line (UserError when one is wrong): a --config file's options first,
    then the command line's; without --data, the demo defaults replace those of the options not given."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(config_argv(parser, argv) + argv)
    demo = args.data is None
    if not demo:  # one plain corpus stays a string; a mixture is its values
        args.data = args.data[0] if len(args.data) == 1 and not data.is_mixture_spec(args.data[0]) \
            else tuple(args.data)
    if demo:
        parser.set_defaults(data=DEFAULT_DATA, out=DEFAULT_OUT, **DEMO_DEFAULTS)
        epochs_given = args.epochs is not None  # --epochs replaces the demo's --target-tokens
        args = parser.parse_args(config_argv(parser, argv) + argv)
        if epochs_given:
            args.target_tokens = None
    if args.out is None:
        raise UserError("--data needs --out RUN: the run folder for its checkpoints, metrics and status")
    values = {**vars(args), "demo": demo, "argv": tuple(argv),
              "eval_tasks": tuple(args.eval_tasks) if args.eval_tasks else None}

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

    values = {option_flag(field)[2:]: getattr(part, field.name)
              for part in (settings.run, settings.session, settings.invocation)
              for field in option_fields(type(part)) if field.name not in NOT_IN_CONFIG}
    return ("# written by train.py: `python train.py --config THIS_FILE --out NEW_RUN` starts this run again\n"
            + tomli_w.dumps({key: value for key, value in values.items() if value is not None}))


def check_settings(settings: Settings) -> None:
    """The rules between options (each option's own checks are in its declaration), each broken one a
    UserError naming its option."""
    run, invocation = settings.run, settings.invocation
    checkpoint_cloud.refuse_placeholder(settings.session.backup_to)
    report.sampling_from(option_values(settings), "sample_")  # a UserError naming the sampling option that is wrong
    trackers.check_trackers(trackers.tracker_names(settings.session.log_to))
    if run.muon_lr is not None and run.optimizer == "adamw":
        raise UserError("--muon-lr needs --optimizer muon (with adamw, --lr sets every learning rate)")
    if run.decay_fraction is not None and run.schedule == "cosine":
        raise UserError("--decay-fraction belongs to --schedule wsd (the cosine decays over the whole run)")
    if run.adam8bit and (run.optimizer or DEFAULT_OPTIMIZER) == "muon":
        raise UserError("--8bit-adam needs --optimizer adamw: under muon, AdamW only trains the embeddings and "
                        "norms, and Muon keeps one buffer per matrix (half of AdamW's state) already")
    resolve_model_preset(run)  # the shape's own rules (heads a multiple of kv_heads)
    mixture_of(settings)  # the --data mixture's and --mixture-schedule's own rules
    if run.text_loss is not None and run.loss_on != "assistant":
        raise UserError("--text-loss needs --loss-on assistant (with --loss-on all every token counts)")
    if invocation.init_from is not None and invocation.resume not in ("auto", "none"):
        raise UserError("--init-from starts a new run and --resume PATH continues one: give one of them")
    if invocation.resume not in ("auto", "none") and re.fullmatch(r"[A-Za-z]+", invocation.resume) \
            and not Path(invocation.resume).exists():
        raise UserError(f"--resume {invocation.resume}: not a choice and no such file; use auto (the newest "
                        "verified checkpoint in --out), none (start fresh) or the PATH of a checkpoint")


def mixture_of(settings: Settings) -> data.Mixture | None:
    """The --data mixture (None: one plain corpus, as a whole)."""
    specs = settings.session.data
    return data.parse_mixture([specs] if isinstance(specs, str) else list(specs), settings.run.mixture_schedule)


def resolve_model_preset(run: RunSettings) -> model_config.Preset:
    overrides = {name: getattr(run, name) for name in model_config.OVERRIDABLE_FIELDS}
    return model_config.resolve_preset(run.preset, **overrides)


# ----------------------------------------------------------------------------------------------
# The corpus' loss mask (data.py reads the corpus: data.TokenSplit, data.BlockSampler).


def check_loss_on(run: RunSettings, manifest: dict, corpus: Path) -> str | None:
    """The --text-loss this run records (None with --loss-on all); UserError when the corpus cannot serve it."""
    if run.loss_on == "all":
        return None
    counts = manifest["splits"]["train"].get("mask_tokens", {})
    if not counts.get("assistant"):
        raise UserError(f"--loss-on assistant: the train split of {corpus} has no assistant tokens (no chat "
                        "documents with an assistant turn); use --loss-on all")
    if counts.get("text") and run.text_loss is None:
        raise UserError(f"--loss-on assistant: {corpus} also has {counts['text']:,} tokens of plain-text "
                        "documents; say whether they count with --text-loss full or --text-loss none")
    return run.text_loss or "none"


# ----------------------------------------------------------------------------------------------
# The recipe: optimizer, learning rates and schedule, chosen from the model's width and the run's
# length by the rules below (measured in bench/bench_recipe.py; the evidence is in docs/recipe.md).


MUON_LR = 0.02  # Muon's update is orthogonalized (unit spectral norm), so one lr fits every width


# AdamW's peak lr = LR x (WIDTH / hidden) ** EXPONENT, at most CAP: for every parameter under adamw (~1/width, as
# muP and the GPT-3 table suggest), for the embeddings and norms only under muon (~1/sqrt(width), as nanochat).
ADAMW_LR_RULE = {"adamw": (1e-3, 256, 1.0, 1e-2), "muon": (0.05, 128, 0.5, 0.1)}  # LR, WIDTH, EXPONENT, CAP


WARMUP_FRACTION = {"adamw": 0.05, "muon": 0.02}


MAX_WARMUP_STEPS = 1000


def adamw_lr_for_width(hidden: int, optimizer: str) -> float:
    """AdamW's peak lr for a model `hidden` wide (under muon AdamW trains only the embeddings and norms)."""
    lr, width, exponent, cap = ADAMW_LR_RULE[optimizer]
    return min(cap, lr * (width / hidden) ** exponent)


def default_warmup_steps(optimizer: str, total_steps: int) -> int:
    """A fixed fraction of the run, at least one step and at most MAX_WARMUP_STEPS."""
    return min(MAX_WARMUP_STEPS, max(1, round(WARMUP_FRACTION[optimizer] * total_steps)))


@dataclass(frozen=True)
class Recipe:
    """Everything that shapes the optimization, resolved: recorded in training_settings.json and checked on resume."""

    optimizer: str
    lr: float  # AdamW's peak lr (under muon: embeddings and norms)
    muon_lr: float | None  # Muon's peak lr for the hidden matrices; None under adamw
    schedule: str
    warmup_steps: int
    decay_steps: int  # the steps of the final decay (cosine: all steps after warmup)
    final_lr_fraction: float
    total_steps: int
    weight_decay: float
    betas: tuple[float, float]
    muon_momentum: float | None
    grad_clip: float
    momentum_warmup_steps: int = 0
    momentum_cooldown_steps: int = 0
    muon_coefficients: str = "torch"
    normuon_beta2: float = 0.0
    cautious_weight_decay: bool = False
    weight_decay_schedule: str = "constant"

    def momentum_at(self, step: int) -> float | None:
        """Muon's momentum at optimizer step `step`: MOMENTUM_FLOOR rising to muon_momentum over the warmup
        steps, falling back over the cooldown steps (None under adamw)."""
        if self.muon_momentum is None:
            return None
        share = min(1.0, (step + 1) / self.momentum_warmup_steps) if self.momentum_warmup_steps else 1.0
        if self.momentum_cooldown_steps:
            share = min(share, (self.total_steps - step - 1) / self.momentum_cooldown_steps)
        return MOMENTUM_FLOOR + (self.muon_momentum - MOMENTUM_FLOOR) * max(0.0, share)

    def weight_decay_multiplier(self, step: int) -> float:
        """The weight decay at step `step` as a fraction of weight_decay (it is also multiplied by the lr)."""
        return 1.0 - step / self.total_steps if self.weight_decay_schedule == "linear" else 1.0

    def lr_multiplier(self, step: int) -> float:
        """The learning rate of optimizer step `step` (0-based) as a fraction of the peak."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        decay_start = self.total_steps - self.decay_steps
        if step < decay_start:
            return 1.0
        progress = min(1.0, (step - decay_start) / max(1, self.decay_steps))
        shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if self.schedule == "cosine" else 1.0 - progress
        return self.final_lr_fraction + (1.0 - self.final_lr_fraction) * shape

    def describe(self) -> str:
        rates = f"AdamW lr {self.lr:.3g}" if self.muon_lr is None else \
            f"Muon lr {self.muon_lr:.3g} (hidden matrices), AdamW lr {self.lr:.3g} (embeddings, norms)"
        decay = f"cosine over {self.decay_steps} steps" if self.schedule == "cosine" else \
            f"constant, then linear decay over the last {self.decay_steps} steps"
        return (f"recipe: {self.optimizer}: {rates}; {self.warmup_steps} warmup steps, {decay} to "
                f"{self.final_lr_fraction:g}x of {self.total_steps}; betas {self.betas[0]:g}/{self.betas[1]:g}, "
                f"weight decay {self.weight_decay:g}, grad clip {self.grad_clip:g}"
                + "".join(f"; {extra}" for extra in self.round_2_options()))

    def round_2_options(self) -> list[str]:
        """The options of issue 30 that are on, in words (describe's tail)."""
        return [text for on, text in [
            (self.muon_coefficients != "torch", f"Newton-Schulz coefficients {self.muon_coefficients}"),
            (self.normuon_beta2 > 0, f"NorMuon beta2 {self.normuon_beta2:g}"),
            (self.cautious_weight_decay, "cautious weight decay"),
            (self.weight_decay_schedule != "constant", f"weight decay {self.weight_decay_schedule} to 0"),
            (self.momentum_warmup_steps or self.momentum_cooldown_steps,
             f"Muon momentum from {MOMENTUM_FLOOR} over {self.momentum_warmup_steps} steps, back over the last "
             f"{self.momentum_cooldown_steps}")] if on]


def choose_recipe(run: RunSettings, hidden: int, total_steps: int) -> tuple[Recipe, list[str]]:
    """The recipe for a model of width `hidden` and a run of `total_steps`: the options given, the rules for
    the rest. Also returns why each chosen value was chosen (printed at start)."""
    optimizer = run.optimizer or DEFAULT_OPTIMIZER
    schedule = run.schedule or DEFAULT_SCHEDULE
    why = []
    lr = run.lr
    if lr is None:
        lr = adamw_lr_for_width(hidden, optimizer)
        base, width, exponent, cap = ADAMW_LR_RULE[optimizer]
        why.append(f"AdamW lr {lr:.3g} = {base:g} x ({width} / hidden {hidden})^{exponent:g}, at most {cap:g}")
    muon_lr = None
    if optimizer == "muon":
        muon_lr = MUON_LR if run.muon_lr is None else run.muon_lr
        if run.muon_lr is None:
            why.append(f"Muon lr {MUON_LR:g} at every width")
    warmup = run.warmup_steps
    if warmup is None:
        warmup = default_warmup_steps(optimizer, total_steps)
        why.append(f"{warmup} warmup steps = {WARMUP_FRACTION[optimizer]:g} of {total_steps} steps "
                   f"(at least 1, at most {MAX_WARMUP_STEPS})")
    if schedule == "cosine":
        decay = max(0, total_steps - warmup)
    else:
        fraction = DEFAULT_DECAY_FRACTION if run.decay_fraction is None else run.decay_fraction
        decay = min(max(0, total_steps - warmup), round(fraction * total_steps))
    final = DEFAULT_FINAL_LR_FRACTION if run.final_lr_fraction is None else run.final_lr_fraction
    beta2 = DEFAULT_BETA2 if run.beta2 is None else run.beta2
    recipe = Recipe(optimizer=optimizer, lr=lr, muon_lr=muon_lr, schedule=schedule, warmup_steps=warmup,
                    decay_steps=decay, final_lr_fraction=final, total_steps=total_steps,
                    weight_decay=run.weight_decay, betas=(run.beta1, beta2),
                    muon_momentum=run.muon_momentum if optimizer == "muon" else None, grad_clip=run.grad_clip,
                    momentum_warmup_steps=run.momentum_warmup_steps,
                    momentum_cooldown_steps=run.momentum_cooldown_steps,
                    muon_coefficients=run.muon_coefficients, normuon_beta2=run.normuon_beta2,
                    cautious_weight_decay=run.cautious_weight_decay, weight_decay_schedule=run.weight_decay_schedule)
    return recipe, why


def extension_problem(old: Recipe, new: Recipe, step: int) -> str | None:
    """Why a run at `step` (steps taken) under recipe `old` cannot go on under `new`, a recipe of another
    length (None: it can). A pure function of the two recipes and the step."""
    if old.schedule == "cosine":
        return ("its schedule is cosine, whose decay spans the whole run: the learning rate of every step "
                "taken depends on the length, so a longer run is not the same run (start runs you may extend "
                "with --schedule wsd)")
    if old.warmup_steps != new.warmup_steps:
        return f"the warmup would change from {old.warmup_steps} to {new.warmup_steps} steps"
    old_start, new_start = old.total_steps - old.decay_steps, new.total_steps - new.decay_steps
    if step > old_start:
        return (f"its decay began at step {old_start} and it is at step {step}: only a checkpoint of the stable "
                f"phase (step <= {old_start}) can be extended")
    if step > new_start:
        return (f"the new length's decay would start at step {new_start}, before the checkpoint's step {step} "
                "(ask for more tokens)")
    return None


def recipe_warnings(recipe: Recipe) -> list[str]:
    """Schedules that cannot train well: warmup that is most of the run, a run of a handful of steps."""
    warnings = []
    if recipe.warmup_steps >= recipe.total_steps:
        warnings.append(f"--warmup-steps {recipe.warmup_steps} >= the run's {recipe.total_steps} steps: the learning "
                        "rate never reaches its peak nor decays; pass fewer --warmup-steps")
    elif recipe.warmup_steps > recipe.total_steps // 2:
        warnings.append(f"{recipe.warmup_steps} of the run's {recipe.total_steps} steps are warmup: most of the run "
                        "trains below the peak learning rate; pass fewer --warmup-steps or train longer")
    if recipe.total_steps < 20:
        warnings.append(f"the run is only {recipe.total_steps} optimizer steps: too few to learn much; train more "
                        "tokens (--target-tokens, --epochs) or use a smaller --batch-size / --grad-accum")
    return warnings


def hidden_matrices(model: torch.nn.Module) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """(the 2-D weights inside the decoder layers: attention and MLP projections, the rest: embeddings, norms)."""
    hidden, rest = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (hidden if param.ndim == 2 and ".layers." in name else rest).append(param)
    return hidden, rest


class Optimizers:
    """The run's optimizers as one: AdamW alone, or Muon for the hidden matrices beside AdamW for the rest.

    Every param group keeps its peak lr in "peak_lr"; set_lr_multiplier(m) sets lr = peak_lr * m.
    follow(recipe, step) sets the lr, the weight decay (from each group's at the start) and Muon's momentum
    of optimizer step `step`.
    """

    def __init__(self, parts: dict[str, torch.optim.Optimizer]):
        self.parts = parts
        self.weight_decays = {name: [group["weight_decay"] for group in optimizer.param_groups]
                              for name, optimizer in parts.items()}

    def set_lr_multiplier(self, multiplier: float) -> None:
        for optimizer in self.parts.values():
            for group in optimizer.param_groups:
                group["lr"] = group["peak_lr"] * multiplier

    def follow(self, recipe: Recipe, step: int) -> None:
        self.set_lr_multiplier(recipe.lr_multiplier(step))
        for name, optimizer in self.parts.items():
            for group, weight_decay in zip(optimizer.param_groups, self.weight_decays[name]):
                group["weight_decay"] = weight_decay * recipe.weight_decay_multiplier(step)
                if name == "muon":
                    group["momentum"] = recipe.momentum_at(step)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """set_to_none=False zeroes in place: under DDP the gradients are views of its all-reduce buckets
        (gradient_as_bucket_view), and None would make the next backward allocate a second copy. The
        same result either way, since every parameter gets a gradient in every step (tested)."""
        for optimizer in self.parts.values():
            optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {name: optimizer.state_dict() for name, optimizer in self.parts.items()}

    def load_state_dict(self, state: dict) -> None:
        if set(state) != set(self.parts):
            raise UserError(f"the checkpoint's optimizer holds {', '.join(sorted(state))}, this run uses "
                            f"{', '.join(sorted(self.parts))}")
        for name, optimizer in self.parts.items():
            optimizer.load_state_dict(state[name])


def build_optimizers(model: torch.nn.Module, recipe: Recipe, device: torch.device, eight_bit: bool = False,
                     rank: int = 0, world: int = 1) -> Optimizers:
    """AdamW (fused on CUDA and CPU; bitsandbytes' 8-bit on request) with decay on matrices only, and under
    muon torch.optim.Muon's rule for the hidden matrices (muon.Muon: Newton-Schulz in the device's dtype,
    split across the `world` ranks). Embeddings and norms are never decayed."""
    hidden, rest = hidden_matrices(model)
    parts = {}
    if recipe.optimizer == "muon":
        from muon import Muon  # here, not at import: a torch without Muon gets check_torch's message

        parts["muon"] = Muon(hidden, ns_dtype=hardware.newton_schulz_dtype(hardware.describe(device)), rank=rank,
                             world=world, lr=recipe.muon_lr, weight_decay=recipe.weight_decay,
                             momentum=recipe.muon_momentum, nesterov=True, coefficients=recipe.muon_coefficients,
                             normuon_beta2=recipe.normuon_beta2, cautious_weight_decay=recipe.cautious_weight_decay)
        adamw_groups = [{"params": rest, "weight_decay": 0.0}]
    else:
        adamw_groups = [{"params": hidden, "weight_decay": recipe.weight_decay},
                        {"params": rest, "weight_decay": 0.0}]
    if eight_bit:
        if device.type != "cuda":
            raise UserError("--8bit-adam needs a CUDA device (bitsandbytes); drop it on CPU")
        try:
            import bitsandbytes
        except ImportError:
            raise UserError("--8bit-adam needs bitsandbytes: pip install bitsandbytes") from None
        parts["adamw"] = bitsandbytes.optim.AdamW8bit(adamw_groups, lr=recipe.lr, betas=recipe.betas, eps=1e-8)
    else:
        parts["adamw"] = torch.optim.AdamW(adamw_groups, lr=recipe.lr, betas=recipe.betas, eps=1e-8,
                                           fused=device.type in ("cuda", "cpu"))
    for optimizer in parts.values():
        for group in optimizer.param_groups:
            group["peak_lr"] = group["lr"]
    return Optimizers(parts)


# ----------------------------------------------------------------------------------------------
# Precision: autocast, and gradient scaling for fp16.


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


def clip_gradients(parameters, max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_, minus its multiply by 1.0 when the norm is already below max_norm.

    The result is bitwise the same (x * 1.0 == x); the multiply it skips reads and writes every
    gradient (~1.5% of a `micro` step on CPU). The step reads the norm right after anyway (to stop
    on a non-finite one), so the comparison adds no device sync.
    """
    parameters = [parameter for parameter in parameters if parameter.grad is not None]
    total_norm = torch.nn.utils.get_total_norm([parameter.grad for parameter in parameters])
    clip_coefficient = max_norm / (total_norm + 1e-6)  # torch's own arithmetic, so the decision matches it
    if not bool(clip_coefficient >= 1.0):  # NaN clips too (to NaN), as torch does
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total_norm)
    return total_norm


class NonFiniteLoss(Exception):
    pass


@dataclass
class StepResult:
    step: int
    loss: float
    adamw_lr: float  # AdamW's lr this step (embeddings and norms under Muon; everything under adamw)
    muon_lr: float | None  # Muon's lr this step (the hidden matrices); None under adamw
    grad_norm: float
    seconds: float
    applied: bool  # False when fp16 skipped the step for overflow (the step is then retried)


class Training:
    """Model, optimizer, data, schedule and scaler of one run on one rank.

        settings = train.parse_args(["--data", CORPUS, "--out", RUN, "--preset", "micro", "--threads", "2"])
        info = distributed.init_distributed(settings.session.device)
        training = train.build_training(settings, info)
        result = training.train_step()          # one optimizer step (all micro-steps)
    """

    def __init__(self, settings: Settings, info: distributed.DistInfo, manifest: dict, corpus: Path):
        run, session = settings.run, settings.session
        self.run, self.session, self.invocation = run, session, settings.invocation
        self.info, self.corpus, self.manifest = info, corpus, manifest
        self.preset = resolve_model_preset(run)
        self.manifest_sha256 = sha256_file(corpus / "corpus_manifest.json")
        self.hardware = hardware.describe(self.device)
        self.precision_choice = resolve_precision(session.precision, self.hardware)
        self.mixture = mixture_of(settings)
        self.text_loss = check_loss_on(run, manifest, corpus)
        self.counted = data.counted_classes(run.loss_on, self.text_loss)
        self.splits = {name: data.TokenSplit(corpus, manifest, name, self.context, self.counted, run.packing)
                       for name in ("train", "validation", "test")}
        self.source_splits, self.source_manifests = read_mixture(self, manifest)  # ({}, []) without a mixture
        self.splits.update({name: data.MixtureSplit(parts) for name, parts in self.source_splits.items()})
        self.token_bytes = data.token_byte_lengths(corpus / data.TOKENIZER_DIR / "tokenizer.json",
                                                   self.vocab_size).to(self.device)
        self.sampler = data.BlockSampler(self.splits["train"].blocks, run.seed, session.batch_size,
                                         session.grad_accum, info.world)
        self.step = 0  # optimizer steps taken: the only counter (data order, lr and checkpoint follow it)
        self.saved_step: int | None = None  # the step of this session's last checkpoint (save_checkpoint)
        self.total_steps = total_steps(run, self.sampler.blocks, self.sampler.global_batch, self.tokens_per_step)
        self.recipe, self.recipe_reasons = choose_recipe(run, self.preset.hidden, self.total_steps)
        self.sampler = mixture_sampler(self)  # after the recipe: a mixture's phase may start at its decay

        seed_everything(run.seed)
        self.model = model_config.build_training_model(self.preset, self.vocab_size, manifest.get("special_tokens"),
                                                       self.device, session.grad_checkpoint)
        if run.zero_init_output:
            model_config.zero_output_projections(self.model)
        self.optimizer = build_optimizers(self.model, self.recipe, self.device, run.adam8bit, info.rank, info.world)
        self.scaler = hardware.LossScaler(self.device, enabled=self.precision == "fp16")
        self.rng = distributed.RankRNG(info)
        self.metrics = report.RunMetrics()
        self.staging = store.StagingBuffers()
        self.run_id = uuid.uuid4().hex
        self.lineage: dict | None = None  # where --init-from took the first weights from
        self.extensions: list[dict] = []  # each resume that changed the run's length (extension)
        self.autocast_dtype = AUTOCAST_DTYPES.get(self.precision)
        self.attention_plan, self.sdpa_context, self.sdpa = choose_attention(self)
        self.compile = hardware.use_compile(session.compile, self.hardware)
        self.forward_model = distributed.wrap_for_training(losses.LanguageModelLoss(self.model, run.z_loss), info,
                                                           hardware.wrap_order(self.compile, info.world))
        self.compile_seconds = compile_at_start(self) if self.compile else None
        self.flops_per_token = model_config.flops_per_token(self.preset, self.vocab_size, self.context)
        self.task_scorer: evaluation.LoopScorer | None = None  # --eval-tasks, read by start_training

    @property
    def device(self) -> torch.device:
        return self.info.device

    @property
    def context(self) -> int:
        return self.preset.context

    @property
    def vocab_size(self) -> int:
        return int(self.manifest["vocab_size"])

    @property
    def tokens_per_step(self) -> int:
        return self.sampler.global_batch * self.context

    def state_parts(self) -> dict:
        """The pieces of state a checkpoint holds by name, each with state_dict()/load_state_dict()
        (besides these: the step, the run id, the RNG of every rank, the settings)."""
        return {"model": self.model, "optimizer": self.optimizer, "scaler": self.scaler, "sampler": self.sampler,
                "metrics": self.metrics}

    @property
    def precision(self) -> str:
        return self.precision_choice.value  # "fp32", "fp16" or "bf16", as resolved on this device

    def autocast(self):
        return torch.autocast(self.device.type, dtype=self.autocast_dtype or torch.float32,
                              enabled=self.autocast_dtype is not None)

    def loss_of(self, batch: data.Batch, model: torch.nn.Module | None = None,
                reduction: str = "mean") -> torch.Tensor:
        """The training loss through forward_model (compiled, DDP), or through `model` as it is (evaluation)."""
        with self.autocast(), self.sdpa_context():
            if model is None:
                return self.forward_model(batch.inputs, batch.targets, reduction, batch.documents)
            return losses.language_model_loss(model, batch.inputs, batch.targets, reduction,
                                              documents=batch.documents)

    def train_step(self) -> StepResult:
        """One optimizer step over all micro-steps; all ranks take part. Raises NonFiniteLoss."""
        started = time.perf_counter()
        step = self.step
        lr_multiplier = self.recipe.lr_multiplier(step)
        self.optimizer.follow(self.recipe, step)
        batches = [self.splits["train"].batch(indices, self.device)
                   for indices in self.sampler.micro_batches(step, self.info.rank)]
        loss_sum = backward_micro_steps(self, batches)
        optimizers = list(self.optimizer.parts.values())
        self.scaler.unscale_(optimizers)
        # --grad-clip 0 is off: an infinite bound never clips (a bound of 0 would zero every gradient)
        grad_norm = clip_gradients(self.model.parameters(), self.recipe.grad_clip or math.inf).item()
        mean_loss = distributed.all_reduce_sum(loss_sum, self.info).item() / self.info.world
        if not self.scaler.enabled and not (math.isfinite(mean_loss) and math.isfinite(grad_norm)):
            raise NonFiniteLoss(f"non-finite loss ({mean_loss}) or gradient norm ({grad_norm}) at step {step + 1}")
        applied = self.scaler.step(optimizers, finite=math.isfinite(grad_norm))
        self.optimizer.zero_grad(set_to_none=self.info.world == 1)
        if applied:
            self.step += 1
        elif self.scaler.skipped_in_a_row >= self.session.max_overflow_steps:
            raise NonFiniteLoss(f"fp16: {self.scaler.skipped_in_a_row} optimizer steps in a row overflowed "
                                f"at step {step + 1} (try --precision bf16 or fp32, or a lower --lr)")
        seconds = time.perf_counter() - started
        self.metrics.train_seconds += seconds
        muon_lr = None if self.recipe.muon_lr is None else self.recipe.muon_lr * lr_multiplier
        return StepResult(step=self.step, loss=mean_loss, adamw_lr=self.recipe.lr * lr_multiplier, muon_lr=muon_lr,
                          grad_norm=grad_norm, seconds=seconds, applied=applied)

    def snapshot(self) -> dict | None:
        """The full state copied to CPU, on rank 0 (None elsewhere). Collective: every rank calls it.

        The copy lives in reused staging buffers: write it out (store.Checkpointer.save) and wait for
        that write (store.Checkpointer.wait) before the next snapshot.
        """
        rng = self.rng.state_dict()
        if not self.info.is_main:
            return None
        return self.staging.copy({
            "format_version": store.FORMAT_VERSION, "step": self.step, "run_id": self.run_id,
            **{name: part.state_dict() for name, part in self.state_parts().items()},
            "rng": rng, "settings": recorded_settings(self), "created": utc_now()})

    def load(self, checkpoint: dict, path: Path) -> None:
        """Restore every piece of state from `checkpoint` (check_resume first: only the run's length may
        differ), then prove model and optimizer equal the file."""
        check_resume(self, checkpoint, path)
        for name, part in self.state_parts().items():
            part.load_state_dict(checkpoint[name])
        self.step = int(checkpoint["step"])  # the one counter: the data order and the lr are functions of it
        self.run_id = checkpoint["run_id"]
        self.lineage = checkpoint["settings"].get("init_from")
        differences = (store.tensor_differences(self.model.state_dict(), checkpoint["model"], "model")
                       + store.tensor_differences(self.optimizer.state_dict(), checkpoint["optimizer"], "optimizer"))
        if differences:
            raise UserError(f"checkpoint {path}: state after loading differs from the file at "
                            + ", ".join(differences[:5]))
        self.rng.load_state_dict(checkpoint["rng"])


def choose_attention(training: Training):
    """attention.choose_attention's plan for this card and dtype, applied (attention.apply_attention_plan),
    probed on the real paths: a micro-batch with a document boundary and one without."""
    plan = attention.choose_attention(training.hardware, training.precision, training.preset.head_dim)
    problem = attention.check_plan(plan, training.context)
    if problem:
        raise UserError(problem)
    with_boundary = probe_batch(training, rows=2, documents=True)

    def probe_step(kernels):
        for batch in (with_boundary, with_boundary._replace(documents=None)):
            with kernels(), training.autocast():
                hidden = training.model.model(input_ids=batch.inputs, **attention.decoder_inputs(training.model,
                                                                                                 batch.documents))
                hidden.last_hidden_state.float().sum().backward()

    context, label, warning = attention.apply_attention_plan(training.model, plan, probe_step)
    if warning or (plan.masked and training.hardware.is_cuda):
        warn(warning or f"{plan.reason}; attention uses the slower math kernel")
    return plan, context, label


def probe_batch(training: Training, rows: int, documents: bool) -> data.Batch:
    """A start-up probe's micro-batch of `rows` x context zeros on the run's device, every row split into
    two documents when `documents` (the path a --packing masked batch with a boundary takes)."""
    zeros = torch.zeros(rows, training.context, dtype=torch.long, device=training.device)
    layout = attention.probe_documents(rows, training.context).to(training.device) if documents else None
    return data.Batch(zeros, zeros, layout)


def compile_at_start(training: Training) -> float | None:
    """Compile the loss module now, on a probe micro-batch of the run's shape (with a document boundary
    under --packing masked): the seconds it took, or None after a failure, when the run goes on eagerly
    with one warning line (Triton has failed on sm_75 cards before, nanoGPT #525). All ranks run it."""
    started = time.perf_counter()
    probe = probe_batch(training, training.session.batch_size, documents=training.run.packing == "masked")
    try:
        training.loss_of(probe).backward()
    except Exception as error:  # Dynamo's and Inductor's errors have no common base but Exception
        if isinstance(error, torch.OutOfMemoryError):
            raise
        training.compile = False
        training.forward_model = distributed.wrap_for_training(
            losses.LanguageModelLoss(training.model, training.run.z_loss), training.info,
            hardware.wrap_order(False, training.info.world))
        first = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
        warn(f"torch.compile failed on {training.hardware.label()} ({type(error).__name__}: {first}); the run "
             "goes on eagerly (slower); --no-compile skips the attempt")
        return None
    finally:
        training.model.zero_grad(set_to_none=True)
    return time.perf_counter() - started


def read_mixture(training: Training, manifest: dict) -> tuple[dict[str, list[data.TokenSplit]], list[str]]:
    """Each mixture source's splits (its corpus, or its label inside it), per split in --data order, and
    each source's corpus_manifest.json sha256; every corpus must have the run's tokenizer."""
    mixture, source_splits, manifests = training.mixture, {}, []
    for source in (mixture.sources if mixture else ()):
        folder = local_corpus_folder(source.corpus)
        theirs = data.load_manifest(folder)
        if theirs.get("tokenizer_sha256") != manifest.get("tokenizer_sha256"):
            raise UserError(f"--data {source.name}={source.corpus}: its tokenizer (sha256 "
                            f"{str(theirs.get('tokenizer_sha256'))[:12]}) is not that of the first source "
                            f"{mixture.sources[0].name} ({str(manifest.get('tokenizer_sha256'))[:12]}): a mixture "
                            "needs one tokenizer; build the corpora with data.py --tokenizer FIRST_CORPUS")
        labels = theirs["splits"]["train"].get("sources", {})
        if source.label is not None and source.label not in labels:
            raise UserError(f"--data {source.name}={source.corpus}#{source.label}: the corpus has no source "
                            f"labelled {source.label} (it has: {', '.join(labels) or 'no labels'}; data.py "
                            "--source-label)")
        if check_loss_on(training.run, theirs, folder) != training.text_loss:
            raise UserError(f"--data {source.name}: --loss-on resolves another --text-loss for {folder}")
        manifests.append(sha256_file(folder / data.CORPUS_MANIFEST))
        for name in ("train", "validation", "test"):
            source_splits.setdefault(name, []).append(
                data.TokenSplit(folder, theirs, name, training.context, training.counted, training.run.packing,
                                source.label))
    return source_splits, manifests


def mixture_sampler(training: Training) -> data.BlockSampler:
    """The mixture's data cursor, its phases starting at steps (decay: the recipe's decay start); without a
    mixture, the plain one as it is."""
    if training.mixture is None:
        return training.sampler
    recipe, session = training.recipe, training.session
    decay_start = recipe.total_steps - recipe.decay_steps if recipe.schedule == "wsd" else None
    return data.MixtureSampler(training.mixture.names, [part.blocks for part in training.source_splits["train"]],
                               [phase.weights for phase in training.mixture.phases],
                               data.phase_steps(training.mixture, decay_start), training.run.seed,
                               session.batch_size, session.grad_accum, training.info.world)


def source_progress(training: Training, step: int) -> dict[str, float]:
    """Tokens and epochs each mixture source has given by `step` (empty without a mixture)."""
    if training.mixture is None:
        return {}
    return training.sampler.progress(step, training.context)


@torch.no_grad()
def evaluate(training: Training, split: str) -> dict | None:
    """Mean loss and perplexity over the first eval blocks of `split` (a fixed order), over all ranks.

    The blocks are --eval-batches global batches' worth: a resume with another split between ranks,
    batch size and accumulation (the same global batch) evaluates the same blocks, so its losses
    and the best checkpoint stay comparable with those before. A mixture evaluates that many blocks
    of each source: "sources" holds each one's result, the rest is over all of them together."""
    if training.mixture is None:
        return eval_result(eval_totals(training, training.splits[split]))
    totals = {name: eval_totals(training, part)
              for name, part in zip(training.mixture.names, training.source_splits[split])}
    result = eval_result(sum(totals.values()))
    if result is not None:
        result["sources"] = {name: eval_result(part) for name, part in totals.items()}
    return result


def eval_totals(training: Training, data_split: data.TokenSplit) -> torch.Tensor:
    """(nats, counted targets, their bytes) over `data_split`'s evaluation blocks, summed over the ranks."""
    totals = torch.zeros(3, dtype=torch.float64, device=training.device)
    if data_split.blocks == 0:
        return totals
    count = min(data_split.blocks, training.run.eval_batches * training.sampler.global_batch)
    order = data.BlockPermutation(data_split.blocks, training.run.seed, data.EVAL_EPOCH)
    mine = [order(i) for i in range(training.info.rank, count, training.info.world)]
    training.model.eval()
    for start in range(0, len(mine), training.session.batch_size):
        batch = data_split.batch(mine[start: start + training.session.batch_size], training.device)
        targets = batch.targets
        counted = targets != data.IGNORE_INDEX
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
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": int(tokens),
            "bits_per_byte": bits_per_byte, "bytes": int(text_bytes)}


def eval_task_scorer(training: Training) -> evaluation.LoopScorer | None:
    """--eval-tasks, read once (rank 0 reads them and keeps lm-eval's items in RUN/eval_tasks), with this
    rank's share of the items encoded; None without them."""
    session, info = training.session, training.info
    if not session.eval_tasks:
        return None
    kept = Path(session.out) / evaluation.LOOP_TASKS_DIR
    tasks = distributed.main_decides(lambda: evaluation.load_loop_tasks(session.eval_tasks, session.eval_tasks_limit,
                                                                       kept), info)
    return evaluation.LoopScorer(tasks, data.load_tokenizer(training.corpus), info.rank, info.world, training.context)


def score_eval_tasks(training: Training) -> dict[str, dict]:
    """Every --eval-tasks task scored on the model as it is now, each rank its share, summed over the
    ranks. Reads no data and no random numbers: the training goes on exactly as without it."""
    training.model.eval()
    with training.autocast(), training.sdpa_context():
        counts = training.task_scorer.counts(training.model, training.device,
                                            training.session.batch_size * training.context)
    training.model.train()
    totals = distributed.all_reduce_sum(torch.tensor(counts, dtype=torch.float64, device=training.device),
                                        training.info)
    return evaluation.loop_scores(training.task_scorer.tasks, totals.tolist())


def recorded_settings(training: Training) -> dict:
    """What a resumed run must share with the checkpoint ("training": the RunSettings, precision and
    text_loss as resolved, and what they make of this corpus) and what may change ("runtime")."""
    compared = {
        **dataclasses.asdict(training.run),
        "text_loss": training.text_loss,  # None with --loss-on all
        "corpus_manifest_sha256": training.manifest_sha256,
        "tokenizer_sha256": training.manifest.get("tokenizer_sha256"),
        "vocab_size": training.vocab_size,
        **{f"model.{name}": getattr(training.preset, name) for name in model_config.OVERRIDABLE_FIELDS},
        "global_batch_blocks": training.sampler.global_batch,
        "tokens_per_step": training.tokens_per_step,
        "total_steps": training.total_steps,
        **{f"recipe.{key}": value for key, value in dataclasses.asdict(training.recipe).items()},
        "recipe.betas": list(training.recipe.betas),  # as JSON and the checkpoint store it
    }
    if training.mixture is not None:  # its sources (each corpus by its manifest) and weights per phase
        compared["mixture"] = training.mixture.recorded()
        for source, sha256, part in zip(compared["mixture"]["sources"], training.source_manifests,
                                        training.source_splits["train"]):
            source.update(corpus_manifest_sha256=sha256, train_blocks=part.blocks)
    runtime = {**dataclasses.asdict(training.session), "data": str(training.corpus), "world_size": training.info.world,
               "precision": training.precision, "device": training.hardware.label()}  # as resolved here
    del runtime["backup_to"]  # a URL may carry credentials
    if training.mixture is not None:  # where its phases start in this session's length (an extension moves decay)
        runtime.update(data=list(training.session.data), mixture_phase_steps=list(training.sampler.starts))
    return {"training": compared, "runtime": runtime, "init_from": training.lineage, "extended": training.extensions,
            "vocabulary_sha256": training.manifest.get("vocabulary_sha256")}


def backward_micro_steps(training: Training, batches: list[data.Batch]) -> torch.Tensor:
    """Forward and backward of this rank's micro-batches of one step (DDP syncs the gradients in the last);
    returns the sum of their losses, each a share of the step's loss (fp64)."""
    info = training.info
    loss_sum = torch.zeros((), dtype=torch.float64, device=training.device)
    if training.counted is not None:
        # the mean over the step's counted targets on all ranks (DDP averages the ranks' gradients)
        counted = sum((batch.targets != data.IGNORE_INDEX).sum() for batch in batches).double()
        per_rank = distributed.all_reduce_sum(counted, info).clamp(min=1) / info.world
    for micro, batch in enumerate(batches):
        last = micro == len(batches) - 1
        sync = contextlib.nullcontext() if last or info.world == 1 else training.forward_model.no_sync()
        with sync:
            if training.counted is None:
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


def check_resume(training: Training, checkpoint: dict, path: Path) -> None:
    """What a resume from `checkpoint` may change, decided before any state is restored: the warmup the rule
    chose for the run's first length is kept, a precision change is noted, any setting but the length
    refuses the resume (store.resume_verdict), and a new length must be a sound extension."""
    old = checkpoint["settings"]["training"]
    warmup = old.get("recipe.warmup_steps")
    if training.run.warmup_steps is None and warmup is not None and warmup != training.recipe.warmup_steps:
        # the rule chose it for the run's first length: an extended run keeps it (extension_problem)
        kept = dataclasses.replace(training.run, warmup_steps=int(warmup))
        recipe, reasons = choose_recipe(kept, training.preset.hidden, training.total_steps)
        training.recipe = recipe
        training.recipe_reasons = [*reasons, f"{warmup} warmup steps: the run's, chosen for its first length"]
    runtime = checkpoint["settings"].get("runtime") or {}
    moved = hardware.precision_change(runtime.get("precision", training.precision), training.precision,
                                      training.hardware)
    if moved:
        say(f"note: {moved}", main=training.info.is_main)
    verdict = store.resume_verdict(old, recorded_settings(training)["training"])
    if verdict.others:
        raise UserError(f"settings differ from checkpoint {path}: " + store.describe_changes(verdict.others)
                        + ". A resume keeps every training setting; only the length (--target-tokens or "
                        "--epochs) may change, under --schedule wsd from a checkpoint before its decay"
                        + (" (here the length changed along with other settings)" if verdict.extend else "")
                        + f"; for a new run from these weights use a new --out with --init-from {path}")
    extensions = list(checkpoint["settings"].get("extended") or [])
    if verdict.extend:
        extensions.append(extension(old, training.recipe, training.total_steps, int(checkpoint["step"]), path))
    training.extensions = extensions


def extension(old: dict, recipe: Recipe, total_steps: int, step: int, path: Path) -> dict:
    """The record of continuing the run recorded in `old` (its training settings) at `step` as a run of
    `total_steps` under `recipe` (the warmup the checkpoint's unless --warmup-steps asks otherwise, the
    decay derived for the new length). Refused (one line saying why) unless every step taken keeps its rate."""
    recorded = {key[len("recipe."):]: value for key, value in old.items() if key.startswith("recipe.")}
    try:
        before = Recipe(**{**recorded, "betas": tuple(recorded["betas"])})
    except (TypeError, KeyError):
        raise UserError(f"checkpoint {path} does not record its recipe; it cannot be extended") from None
    problem = extension_problem(before, recipe, step)
    if problem:
        length = f"--target-tokens {old['target_tokens']}" if old.get("target_tokens") else \
            f"--epochs {old.get('epochs') or 1}"
        raise UserError(f"checkpoint {path} is a run of {old['total_steps']} steps and this one asks for "
                        f"{total_steps}: it cannot be extended: {problem}. Resume it with its length "
                        f"({length}), or start a new run from its weights with --init-from {path}")
    return {"at_step": step, "from_total_steps": int(old["total_steps"]), "to_total_steps": total_steps}


def build_training(settings: Settings, info: distributed.DistInfo, vocab_size: int | None = None,
                   corpus: Path | None = None) -> Training:
    """A ready-to-step Training from parsed options (no files written, no corpus check).

    `corpus`: the local corpus folder (prepare_corpus'; None: --data as given). `vocab_size` (benchmarks
    only) builds the model with a larger vocabulary than the corpus tokenizer's, e.g. think72's 33,069
    over the small demo corpus, whose ids all stay valid."""
    if corpus is None:  # a mixture's first source gives the tokenizer
        mixture = mixture_of(settings)
        corpus = Path(settings.session.data) if mixture is None else local_corpus_folder(mixture.sources[0].corpus)
    manifest = data.load_manifest(corpus)
    if vocab_size is not None:
        if vocab_size < manifest["vocab_size"]:
            raise UserError(f"vocab_size {vocab_size} is below the corpus' {manifest['vocab_size']}")
        manifest = dict(manifest, vocab_size=vocab_size)
    if settings.session.threads:
        torch.set_num_threads(settings.session.threads)
    distributed.use_deterministic_kernels(settings.session.deterministic)  # main() did it; for Python callers
    try:
        return Training(settings, info, manifest, corpus)
    except torch.OutOfMemoryError:  # the weights, or the attention probe's one block, do not fit
        raise UserError(start_out_of_memory(settings.run, int(manifest["vocab_size"]), info.device)) from None


def start_out_of_memory(run: RunSettings, vocab_size: int, device: torch.device) -> str:
    """The error of a card that cannot hold the model and one block's forward and backward at start-up."""
    preset = resolve_model_preset(run)
    card = hardware.describe(device)
    return (f"CUDA out of memory on {card.label()} ({hardware.memory_text(card.memory_bytes)}) while building "
            f"--preset {run.preset} ({model_config.parameter_count(preset, vocab_size):,} parameters) and probing "
            f"attention on one block of {preset.context} tokens: no batch size fits; use a smaller --preset or "
            "--context, or a larger card (is another process using it? nvidia-smi shows)")


# ----------------------------------------------------------------------------------------------
# The run: main() reads top-down; the loop; stopping on signals and the time budget.


def main(argv: list[str] | None = None) -> int:
    hardware.check_torch()
    settings = parse_args(argv)
    session, invocation = settings.session, settings.invocation
    distributed.use_deterministic_kernels(session.deterministic)  # before CUDA starts (the cuBLAS workspace)
    info = distributed.init_distributed(session.device)
    try:
        if invocation.export_only:
            return export_only(settings, info)
        corpus = distributed.main_decides(lambda: prepare_corpus(settings), info)
        with claim_run_folder(Path(session.out), info):
            backup_url = checkpoint_cloud.backup_url_from_env_or_arg(session.backup_to)
            if backup_url:
                distributed.main_decides(lambda: checkpoint_cloud.check_backup_target(backup_url), info)
            if backup_url and invocation.resume == "auto":
                distributed.main_decides(lambda: restore_from_backup(backup_url, Path(session.out)), info)
            backup = start_backup(session, info)
            try:
                last_line = train(settings, info, corpus, backup=backup, backup_wait_s=session.backup_wait_seconds)
            finally:
                if backup is not None:
                    backup.close()  # the one close: its last messages come before the run's last line
            log(info, last_line)
            return 0
    finally:
        distributed.shutdown_distributed()


def train(settings: Settings, info: distributed.DistInfo, corpus: Path, backup=None, backup_wait_s: float = 600) -> str:
    """The training run on the local `corpus` folder; returns its last line (report.final_line; rank 0).
    `backup` (rank 0; checkpoint_cloud.BackupProcess) gets every checkpoint. Every way it ends goes
    through one place: finish_run, or end_failed_run."""
    process_started = time.monotonic()
    session = settings.session
    out = Path(session.out)
    hardware.check_required_gpus(session.require_gpus, session.require_gpu_name, info.device.type)
    mixture = mixture_of(settings)
    for folder in [corpus] if mixture is None else [local_corpus_folder(s.corpus) for s in mixture.sources]:
        data.load_manifest(folder)  # a clear message when the corpus is missing, on every rank
        problems = distributed.main_decides(lambda: data.verify_corpus(folder), info)  # noqa: B023 (called at once)
        if problems:
            raise UserError(f"corpus {folder} does not match its manifest: " + "; ".join(problems))

    status = store.RunStatus(out, enabled=info.is_main,  # read before this session writes anything
                             resume_command=resume_command(info, settings.invocation.argv))
    training, resume_path = start_training(settings, info, corpus)
    note = store.previous_session_note(status.previous, training.step)
    if note:
        log(info, note)
    sinks = trackers.open_trackers(trackers.tracker_names(session.log_to), out, training.run_id,
                                   recorded_settings(training)) if info.is_main else []
    metrics = report.MetricsLog(out / "metrics.jsonl", enabled=info.is_main, sinks=sinks)
    checkpointer = store.Checkpointer(out / "checkpoints", training.run_id, session.keep_last, session.keep_every,
                                backup=backup, backup_wait_s=backup_wait_s) if info.is_main else None
    peak = write_run_files(training, settings, checkpointer, metrics, resume_path)
    describe_run(training)

    compiled = None if training.compile_seconds is None else f"compiled in {training.compile_seconds:.0f} s"
    progress = report.Progress(training.total_steps, training.step, session.log_every, enabled=info.is_main,
                               first_note=compiled)
    stop = StopRequest()
    stop.install()  # until the final status is written: a second Ctrl-C then still records store.FAILED
    try:
        status.running(training.step, training.total_steps)  # from here on a signal ends with a checkpoint
        try:
            state, reason = train_loop(training, checkpointer, metrics, status, stop, peak, process_started,
                                       progress)
        finally:
            progress.close()
        stop.loop_ended = True
        return finish_run(training, status, checkpointer, metrics, state, reason, stop)
    except BaseException as error:
        failure = end_failed_run(training, status, checkpointer, stop, error)
        if failure.message is None:
            raise
        raise UserError(failure.message) from None
    finally:
        metrics.close()
        stop.restore()


def start_training(settings: Settings, info: distributed.DistInfo, corpus: Path) -> tuple[Training, Path | None]:
    """The Training, resumed from the checkpoint --resume names or initialized from --init-from."""
    invocation, out = settings.invocation, Path(settings.session.out)
    training = build_training(settings, info, corpus=corpus)
    training.task_scorer = eval_task_scorer(training)
    resume_path = distributed.main_decides(lambda: store.tidy_and_find_resume_checkpoint(out, invocation.resume), info)
    if resume_path is not None:
        training.load(store.load_checkpoint_file(resume_path), resume_path)
        log(info, f"resumed from {resume_path} at step {training.step}/{training.total_steps} (state verified)"
                  + (f"; its weights first came from {training.lineage['source']}" if training.lineage else ""))
        init_from = invocation.init_from
        if init_from is not None and (training.lineage or {}).get("source") != init_from:
            say(f"--init-from {init_from} is not used: {out} already holds a run, resumed from {resume_path} "
                f"(use a new --out to start a run from {init_from})", warning=True, main=info.is_main)
    elif invocation.init_from is not None:
        start_from(training, store.read_init_source(invocation.init_from))  # every rank reads the same file
        lineage = training.lineage
        log(info, f"initialized from {lineage['source']} ({lineage['kind']}, step {lineage['step']}, sha256 "
                  f"{lineage['sha256'][:12]}); optimizer, schedule and data order start fresh")
    return training, resume_path


def write_run_files(training: Training, settings: Settings, checkpointer: store.Checkpointer | None,
                    metrics: report.MetricsLog, resume_path: Path | None) -> float | None:
    """Rank 0: the checkpoint timeline, metrics.jsonl cut at the resumed step, config.toml,
    training_settings.json and hardware.json; returns the peak FLOP/s the MFU divides by (None on
    the other ranks)."""
    info, session = training.info, training.session
    if not info.is_main:
        return None
    out = Path(session.out)
    if resume_path is not None:
        checkpointer.start_timeline(resume_path, training.step)
    metrics.truncate_after(training.step)
    metrics.restore(training.metrics.task_history, "tasks")
    atomic_write_text(out / "config.toml", config_text(settings))
    atomic_write_json(out / "training_settings.json", {**recorded_settings(training), "run_id": training.run_id,
                                                       "parameters": model_config.parameter_count(
                                                           training.preset, training.vocab_size),
                                                       "flops_per_token": training.flops_per_token})
    peak, source = hardware.peak_flops(info.device, training.precision, session.peak_tflops)
    atomic_write_json(out / "hardware.json", {**hardware.machine_record(info.device, info.world,
                                                                        training.precision, training.sdpa),
                                              "peak_flops": peak, "peak_flops_source": source})
    return peak


def describe_run(training: Training) -> None:
    """The run's shape, precision and recipe, and warnings about its corpus (rank 0 prints)."""
    info = training.info
    log(info, f"{model_config.parameter_count(training.preset, training.vocab_size):,} parameters, "
              f"{training.tokens_per_step:,} tokens/step, {training.total_steps} steps, {training.precision}, "
              f"world size {info.world} on {training.hardware.label()}")
    log(info, f"  {training.precision_choice.reason}; attention: {training.sdpa}; Muon's Newton-Schulz in "
              f"{hardware.newton_schulz_dtype(training.hardware)}")
    if training.compile_seconds is not None:
        log(info, f"  torch.compile: the model and its loss compiled in {training.compile_seconds:.1f} s at start "
                  "(--no-compile: eager)")
    empty = [name for name in ("validation", "test") if training.splits[name].blocks == 0]
    if empty:
        say(f"the corpus has no {' or '.join(empty)} blocks of {training.context} tokens: no "
            f"{' and no '.join(f'{name} loss' for name in empty)} will be measured (rebuild the corpus with "
            "more documents or a larger --val-fraction / --test-fraction)", warning=True, main=info.is_main)
    if training.sampler.global_batch > training.sampler.blocks:
        say(f"one step reads {training.sampler.global_batch} blocks but the train split has only "
            f"{training.sampler.blocks} of {training.context} tokens: every step covers more than an epoch "
            "(use a smaller --batch-size or --grad-accum, or a larger corpus)", warning=True, main=info.is_main)
    log(info, training.recipe.describe())
    for line in mixture_summary(training):
        log(info, line)
    if training.recipe_reasons:
        log(info, "  chosen by the rules (docs/recipe.md): " + "; ".join(training.recipe_reasons))
    if info.is_main:
        for warning in recipe_warnings(training.recipe):
            say(warning, warning=True)

def default_eval_every(total_steps: int) -> int:
    """--eval-every's default: five validations in a run (the last at its end), at most 250 steps apart."""
    return max(1, min(250, total_steps // 5))


TASKS_COST_SHARE = 0.05  # --eval-tasks-every's default keeps the scoring to about this share of the training


def default_tasks_every(validation_every: int, total_steps: int, task_tokens: int, step_tokens: int) -> int:
    """--eval-tasks-every's default: the validation's cadence, or the smallest multiple of it at which
    scoring the tasks costs at most TASKS_COST_SHARE of the training in between, counting a scored
    token (a forward) as a third of a trained one (forward and backward); 0, only at the end, when no
    multiple within the run fits. `task_tokens` and `step_tokens` are one rank's."""
    if validation_every == 0:
        return 0
    needed = task_tokens / (3 * TASKS_COST_SHARE * step_tokens)
    every = validation_every * max(1, math.ceil(needed / validation_every))
    return every if every < total_steps else 0


def tasks_cadence_note(validation_every: int, tasks_every: int, task_tokens: int, step_tokens: int) -> str | None:
    """What the run says at its start when default_tasks_every scores the --eval-tasks later than the validation
    (every k-th one, or only at the end), and why; None when they go together."""
    if tasks_every == validation_every or validation_every == 0:
        return None
    cost = task_tokens / (3 * validation_every * step_tokens)  # a scored token a third of a trained one
    when = (f"every {tasks_every} steps (with one validation in {tasks_every // validation_every})" if tasks_every
            else "only at the end")
    return (f"note: --eval-tasks are scored {when}, not with each validation (every {validation_every} steps): one "
            f"scoring reads {task_tokens:,} tokens, about {100 * cost:.0f}% of the training between two validations, "
            f"and the default keeps it near {100 * TASKS_COST_SHARE:.0f}%; --eval-tasks-every N chooses")


def evaluation_cadence(training: Training) -> tuple[int, int | None]:
    """(validate every N steps, score the --eval-tasks every N steps; None without tasks), 0: at the end only."""
    session = training.session
    validation_every = default_eval_every(training.total_steps) if session.eval_every is None else session.eval_every
    if training.task_scorer is None:
        return validation_every, None
    if session.eval_tasks_every is not None:
        return validation_every, session.eval_tasks_every
    step_tokens = training.tokens_per_step // training.info.world
    tasks_every = default_tasks_every(validation_every, training.total_steps, training.task_scorer.tokens, step_tokens)
    note = tasks_cadence_note(validation_every, tasks_every, training.task_scorer.tokens, step_tokens)
    if note:
        log(training.info, note)
    return validation_every, tasks_every


def evaluations_due(step: int, total_steps: int, validation_every: int, tasks_every: int | None) -> tuple[bool, bool]:
    """(validate, score the --eval-tasks) after `step`: each every N steps (0: only at the end), both at the
    last step; tasks_every None: there are none."""
    validate, score = ((every is not None and ((every > 0 and step % every == 0) or step == total_steps))
                       for every in (validation_every, tasks_every))
    return validate, score


def train_loop(training: Training, checkpointer: store.Checkpointer | None, metrics: report.MetricsLog,
               status: store.RunStatus, stop: StopRequest, peak: float | None, process_started: float,
               progress: report.Progress) -> tuple[str, str | None]:
    """Step until done or asked to stop; returns the final (status, reason). Each step: train, log,
    validate when due, then plan_step_end says whether to save and whether to stop."""
    session = training.session
    no_step = no_step_to_take(training, progress)
    if no_step is not None:
        return no_step
    clocks = SessionClocks(process_started)
    cadence = evaluation_cadence(training)
    flags = StepFlags(training.total_steps, session.save_every, session.save_seconds, session.max_hours,
                      session.stop_after_steps)
    while training.step < training.total_steps:
        if checkpointer is not None:
            checkpointer.check()
        result = training.train_step()
        if not result.applied:
            progress.write(f"fp16 overflow: step {result.step + 1} skipped (scale lowered), retrying")
            continue
        clocks.stepped(result.seconds)
        peak, tokens_per_second, mfu = step_throughput(training, result, peak)
        progress.update(result.step, result.loss, tokens_per_second, mfu)
        logged = result.step % session.log_every == 0 or result.step in (1, training.total_steps)
        if logged:
            log_train_step(training, metrics, status, result, tokens_per_second, mfu)
        best = evaluate_if_due(training, metrics, progress, clocks, cadence)
        clock = agree_clock(clocks.read(stop, checkpointer), training.info)
        end = plan_step_end(result.step, clock, dataclasses.replace(flags, new_best=best is not None))
        if end.save:
            save_checkpoint(training, checkpointer, best)
            clocks.saved()
        if end.stop:
            if not logged:  # metrics.jsonl ends with the step the run stopped at
                log_train_step(training, metrics, status, result, tokens_per_second, mfu)
            return store.NEEDS_RESUME, end.why
    return store.COMPLETE, None


def no_step_to_take(training: Training, progress: report.Progress) -> tuple[str, str] | None:
    """(status, reason) of a session that stops before its first step (already at --stop-after-steps);
    a run already complete says so and goes on to its test evaluation and report."""
    session = training.session
    if session.stop_after_steps and session.stop_after_steps <= training.step < training.total_steps:
        reason = (f"the run was already at step {training.step}, at or past --stop-after-steps "
                  f"{session.stop_after_steps}: no step taken")
        progress.write(reason)
        return store.NEEDS_RESUME, reason
    if training.step >= training.total_steps:  # e.g. the same command again after the run completed
        progress.write(f"the run was already complete at step {training.step}/{training.total_steps}: no step "
                       "taken; the test evaluation and the report are made again (a longer run: a larger "
                       "--target-tokens or --epochs, docs/stages.md)")
    return None


def step_throughput(training: Training, result: StepResult, peak: float | None) -> tuple[float | None, float,
                                                                                          float | None]:
    """(peak, tokens/s, MFU) of a step; an MFU above 100% measures the peak again (hardware.plausible_mfu)."""
    tokens_per_second = training.tokens_per_step / result.seconds
    mfu = training.flops_per_token * tokens_per_second / (peak * training.info.world) if peak else None
    if mfu is not None and mfu > 1:
        record = Path(training.session.out) / "hardware.json" if training.info.is_main else None
        peak, mfu = hardware.plausible_mfu(peak, mfu, training.device, training.precision,
                                           training.session.peak_tflops, record)
    return peak, tokens_per_second, mfu


def evaluate_if_due(training: Training, metrics: report.MetricsLog, progress: report.Progress,
                    clocks: SessionClocks, cadence: tuple[int, int | None]) -> float | None:
    """Validation and the --eval-tasks when due (evaluations_due at evaluation_cadence); returns the
    validation loss when it is a new best."""
    session = training.session
    validate, score = evaluations_due(training.step, training.total_steps, *cadence)
    if not (validate or score):
        return None
    started = time.monotonic()
    best = run_validation(training, metrics, progress) if validate else None
    if score:
        run_eval_tasks(training, metrics, progress)
    if training.info.is_main and session.report:
        report.draw_loss_curve(Path(session.out), progress)
    clocks.evaluated(time.monotonic() - started)
    return best


def log_train_step(training: Training, metrics: report.MetricsLog, status: store.RunStatus, result: StepResult,
                   tokens_per_second: float, mfu: float | None) -> None:
    """A train record in metrics.jsonl and the store.RUNNING status (the progress bar shows the step)."""
    tokens = result.step * training.tokens_per_step
    metrics.write("train", step=result.step, tokens=tokens, loss=result.loss,
                  adamw_lr=result.adamw_lr, **({} if result.muon_lr is None else {"muon_lr": result.muon_lr}),
                  grad_norm=result.grad_norm, step_seconds=result.seconds,
                  tokens_per_second=tokens_per_second, mfu=mfu,
                  peak_memory_bytes=hardware.peak_memory_bytes(training.device),
                  **source_progress(training, result.step))
    status.running(result.step, training.total_steps, tokens=tokens, loss=result.loss)


def run_validation(training: Training, metrics: report.MetricsLog, progress: report.Progress) -> float | None:
    """Validation loss now; returns it when it is the best so far (the save then records it)."""
    result = evaluate(training, "validation")
    if result is None:
        return None
    step = training.step
    training.metrics.last_eval = {"step": step, **result}
    metrics.write("eval", step=step, tokens=step * training.tokens_per_step, val_loss=result["loss"],
                  val_perplexity=result["perplexity"], val_tokens=result["tokens"],
                  val_bits_per_byte=result["bits_per_byte"], val_bytes=result["bytes"],
                  **source_results("val", result))
    progress.write(f"step {step}: validation loss {result['loss']:.4f}, perplexity {result['perplexity']:.2f}"
                   f"{report.bits_per_byte_text(result)}"
                   + "".join(f"; {name} {part['loss']:.4f}" for name, part in result.get("sources", {}).items()
                             if part))
    if result["loss"] < training.metrics.best_val_loss:
        training.metrics.best_val_loss, training.metrics.best_step = result["loss"], step
        return result["loss"]
    return None


def run_eval_tasks(training: Training, metrics: report.MetricsLog, progress: report.Progress) -> None:
    """The --eval-tasks scores now: a "tasks" record in metrics.jsonl (and the checkpoints' history), one line."""
    started = time.monotonic()
    scores = score_eval_tasks(training)
    record = {"step": training.step, "tokens": training.step * training.tokens_per_step,
              **report.task_fields(scores), "seconds": time.monotonic() - started}
    training.metrics.task_history.append(record)
    metrics.write("tasks", **record)
    progress.write(f"step {training.step}: " + "; ".join(
        f"{name} acc {value['acc']:.3f}, acc_norm {value['acc_norm']:.3f} (n {value['n']}, chance "
        f"{value['chance']:.3f})" for name, value in scores.items()))


def source_results(prefix: str, result: dict) -> dict:
    """A mixture's loss and bits per byte of each source, as metrics.jsonl fields (`val_loss/web`)."""
    fields = {}
    for name, part in (result.get("sources") or {}).items():
        if part is not None:
            fields[f"{prefix}_loss/{name}"] = part["loss"]
            fields[f"{prefix}_bits_per_byte/{name}"] = part["bits_per_byte"]
    return fields


def mixture_summary(training: Training) -> list[str]:
    """The start-up lines of a mixture: each source's size, each phase's weights, tokens and epochs planned."""
    if training.mixture is None:
        return []
    sampler, context = training.sampler, training.context
    lines = ["mixture: " + ", ".join(f"{name} {blocks:,} train blocks ({blocks * context:,} tokens)"
                                     for name, blocks in zip(sampler.names, sampler.source_blocks))]
    for phase, start in zip(training.mixture.phases, sampler.starts):
        weights = ", ".join(f"{name} {weight:g}" for name, weight in zip(sampler.names, phase.weights))
        lines.append(f"  from step {start}" + (" (decay)" if phase.start == "decay" else "") + f": {weights}")
    planned = source_progress(training, training.total_steps)
    lines.append("  over the run: " + ", ".join(
        f"{name} {planned[f'tokens/{name}']:,} tokens ({planned[f'epochs/{name}']:.2f} epochs)"
        for name in sampler.names))
    return lines


def save_checkpoint(training: Training, checkpointer: store.Checkpointer | None, best_val_loss: float | None) -> None:
    """Snapshot on every rank (RNG is gathered), write on rank 0 in the background. A step already saved
    is not saved again unless it set a new best; every rank decides alike (saved_step is on every rank),
    since the snapshot is a collective call."""
    if training.saved_step == training.step and best_val_loss is None:
        return
    if checkpointer is not None:
        checkpointer.wait()  # the staging buffers still feed the previous write until it is done
    snapshot = training.snapshot()
    if checkpointer is not None:
        checkpointer.save(snapshot, training.step, best_val_loss)
    training.saved_step = training.step


class StopRequest:
    """SIGTERM/SIGINT set a flag; the loop finishes its step, saves and stops. A second SIGINT aborts."""

    def __init__(self):
        self.requested = False
        self.loop_ended = False  # set once no step is left to take: a signal then only ends the report sooner
        self.signum = 0  # the first signal's number (0: none yet)
        self.signalled_at: float | None = None  # time.monotonic() of the first signal
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        for signum in (signal.SIGTERM, signal.SIGINT):
            self._previous[signum] = signal.signal(signum, self._handle)

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True
        if self.signalled_at is None:
            self.signum, self.signalled_at = int(signum), time.monotonic()
        what = ("training has already ended; finishing the run's status and report, then exiting" if self.loop_ended
                else "finishing this step, saving, then stopping")
        print(f"{signal.Signals(signum).name}: {what}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------
# The end of a step: save? stop? why? (a pure plan of the clocks and the settings)


@dataclasses.dataclass(frozen=True)
class StepClock:
    """What the end of a step reads of the clocks, in seconds; agree_clock makes it the same on every rank."""
    elapsed: float = 0.0  # since this session started
    since_save: float = 0.0  # since the last save (or the loop's start)
    slowest_step: float = 0.0
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


@dataclasses.dataclass(frozen=True)
class StepEnd:
    save: bool
    stop: bool
    why: str | None = None  # the stop's reason, for run_status.json and the last line


LAST_SAVE_SECONDS = 10  # besides twice the slowest step, evaluation and write: the save and exit under --max-hours


def plan_step_end(step: int, clock: StepClock, flags: StepFlags) -> StepEnd:
    """Whether step `step` ends with a save and whether the session stops there, and why. The last
    step saves and completes, whatever asked to stop. --max-hours stops when another step, evaluation
    and save (twice the slowest of each, and LAST_SAVE_SECONDS) might not fit the budget."""
    needed = 2 * (clock.slowest_step + clock.slowest_eval + clock.last_write) + LAST_SAVE_SECONDS
    why = None
    if step >= flags.total_steps:
        pass
    elif clock.signal:
        why = f"stopped by {signal.Signals(clock.signal).name}"
    elif flags.max_hours and clock.elapsed + needed >= flags.max_hours * 3600:
        why = "stopped by --max-hours budget"
    elif flags.stop_after_steps and step >= flags.stop_after_steps:
        why = f"stopped by --stop-after-steps {flags.stop_after_steps}"
    save = (why is not None or step >= flags.total_steps or flags.new_best
            or bool(flags.save_every and step % flags.save_every == 0)
            or bool(flags.save_seconds and clock.since_save >= flags.save_seconds))
    return StepEnd(save=save, stop=why is not None, why=why)


class SessionClocks:
    """The loop's clocks: since the session started and the last save, the slowest step and evaluation."""

    def __init__(self, started: float):
        self.started, self.last_save = started, time.monotonic()
        self.slowest_step = self.slowest_eval = 0.0

    def stepped(self, seconds: float) -> None:
        self.slowest_step = max(self.slowest_step, seconds)

    def evaluated(self, seconds: float) -> None:
        self.slowest_eval = max(self.slowest_eval, seconds)

    def saved(self) -> None:
        self.last_save = time.monotonic()

    def read(self, stop: StopRequest, checkpointer: store.Checkpointer | None) -> StepClock:
        now = time.monotonic()
        return StepClock(elapsed=now - self.started, since_save=now - self.last_save,
                         slowest_step=self.slowest_step, slowest_eval=self.slowest_eval,
                         last_write=checkpointer.last_write_seconds if checkpointer else 0.0, signal=stop.signum)


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


def stop_wait_seconds(backup_wait_seconds: float, signalled: bool, under_torchrun: bool, elapsed: float,
                      grace: float = TORCHRUN_GRACE_SECONDS) -> float:
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
    wait = stop_wait_seconds(checkpointer.backup_wait_s, since is not None, "TORCHELASTIC_RUN_ID" in os.environ,
                             elapsed, torchrun_grace_seconds(os.environ))
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
    urgent: bool = False  # torchrun tears the job down: the upload wait fits its grace period


def failure_reason(error: BaseException, last_checkpoint: str | None, context: FailureContext) -> Failure:
    """How a session that raised `error` ends, `last_checkpoint` (a name, or None) being the newest
    good one: table-tested in tests/test_core.py; end_failed_run records and says it."""
    kept = (f"the last good checkpoint, {last_checkpoint}, is intact" if last_checkpoint
            else "no checkpoint had been written yet")
    tail = f"; {kept} (status {context.recorded or store.FAILED} in {context.status_file})"
    if isinstance(error, KeyboardInterrupt):  # a second Ctrl-C
        where = (f"the last checkpoint is {context.checkpoints / last_checkpoint}" if last_checkpoint
                 else "no checkpoint was saved yet")
        reason = (f"aborted by the user (second interrupt) at step {context.step}; {where}; continue with: "
                  f"{context.resume_command}")
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
        return Failure(store.NEEDS_RESUME if last_checkpoint else store.FAILED, reason,
                       f"{reason}; resume with: {context.resume_command}", urgent=True)
    if context.deterministic and "does not have a deterministic implementation" in str(error):
        op = str(error).splitlines()[0].split(", but you set")[0]
        return Failure(store.FAILED, described, f"--deterministic: {op}; this run cannot be deterministic on this "
                       "device: resume without --deterministic (a session setting)")
    return Failure(store.FAILED, described, None)


def end_failed_run(training: Training, status: store.RunStatus, checkpointer: store.Checkpointer | None,
                   stop: StopRequest, error: BaseException) -> Failure:
    """Rank 0 finishes a checkpoint write in flight (it holds good state), records failure_reason's
    status at once (before torchrun's SIGKILL, after a lost rank), then waits for the backup."""
    info, session = training.info, training.session
    out = Path(session.out)
    if checkpointer is not None:
        with contextlib.suppress(Exception):
            checkpointer.wait()
    last = store.latest_checkpoint_name(out)
    command = resume_command(info, training.invocation.argv)
    advice = out_of_memory_advice(training) if isinstance(error, torch.OutOfMemoryError) else ""
    context = FailureContext(training.step, out / "checkpoints", out / store.STATUS_FILE, command, info.rank,
                             info.world, session.deterministic, advice, status.final)
    failure = failure_reason(error, last, context)
    if status.failed(failure.status, reason=failure.reason, step=training.step, total_steps=training.total_steps,
                     last_checkpoint=last, backup_complete=None):
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


def prepare_corpus(settings: Settings) -> Path:
    """The local corpus folder: the demo's, built if missing; a --data URL pulled once; else --data as is.
    A mixture: every source's corpus so, and the first one's folder (its tokenizer is the run's)."""
    mixture = mixture_of(settings)
    if mixture is not None:
        return [prepare_one_corpus(source.corpus, demo=False) for source in mixture.sources][0]
    return prepare_one_corpus(settings.session.data, settings.invocation.demo)


def local_corpus_folder(data_option: str) -> Path:
    """Where the corpus of a --data value is read: a URL's pulled copy, else the folder itself."""
    if "://" in data_option and not data_option.startswith("file://"):
        url = data_option.rstrip("/")
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", url.rsplit("/", 1)[-1]) or "corpus"
        return Path(data.PULLED_CORPORA) / f"{name}-{hashlib.sha256(url.encode()).hexdigest()[:8]}"
    return Path(data_option.removeprefix("file://"))


def prepare_one_corpus(data_option: str, demo: bool) -> Path:
    corpus = local_corpus_folder(data_option)
    if demo:
        if not (corpus / data.CORPUS_MANIFEST).is_file():
            say(f"demo: building the demo corpus in {corpus} ({script_command('data')} --demo --out {corpus})")
            data.build_demo_corpus(corpus)
        return corpus
    if "://" in data_option and not data_option.startswith("file://"):
        return checkpoint_cloud.local_corpus(data_option, corpus)
    data.check_corpus_folder(corpus)
    return corpus


def out_of_memory_advice(training: Training) -> str:
    """hardware.out_of_memory_advice for this run: its model, micro-batch, precision and card."""
    run, session = training.run, training.session
    return hardware.out_of_memory_advice(run.preset, training.preset, training.vocab_size, session.batch_size,
                                         session.grad_accum, training.context, training.precision,
                                         training.recipe.optimizer, session.grad_checkpoint, training.hardware,
                                         training.attention_plan.documents if run.packing == "masked"
                                         else training.attention_plan.causal)


def finish_run(training: Training, status: store.RunStatus, checkpointer: store.Checkpointer | None,
               metrics: report.MetricsLog, state: str, reason: str | None, stop: StopRequest) -> str:
    """The end of a run that stopped resumably or completed: the test evaluation when complete, then
    (rank 0) the status, the backup, the report; returns the last line ("" on the other ranks, which
    wait for rank 0)."""
    info = training.info
    test = evaluate(training, "test") if state == store.COMPLETE else None
    if test is not None:
        metrics.write("test", step=training.step, tokens=training.step * training.tokens_per_step,
                      test_loss=test["loss"], test_perplexity=test["perplexity"],
                      test_bits_per_byte=test["bits_per_byte"], test_bytes=test["bytes"],
                      **source_results("test", test))
        log(info, f"test loss {test['loss']:.4f}, perplexity {test['perplexity']:.2f}{report.bits_per_byte_text(test)}")
    if not info.is_main:
        dist.barrier()  # rank 0 writes the status and the report; then all ranks tear down together
        return ""
    try:
        line = finish_on_main(training, status, checkpointer, state, reason, test, stop)
        metrics.write_samples(Path(training.session.out) / "sample_generations.json")
        return line
    finally:
        if info.world > 1:
            dist.barrier()


def finish_on_main(training: Training, status: store.RunStatus, checkpointer: store.Checkpointer, state: str,
                   reason: str | None, test: dict | None, stop: StopRequest) -> str:
    """finish_run's part on rank 0: the status as soon as the last checkpoint is on disk (its report
    and model/ `pending`, with the command that makes them), then the backup, the report (the status
    again each time); returns the last line.

    After a signal under torchrun, SIGKILL follows within its grace period: the status naming the
    checkpoint is written first, and the wait for the upload fits what is left (stop_wait_seconds)."""
    info, session = training.info, training.session
    out = Path(session.out)
    checkpointer.wait()
    command = resume_command(info, training.invocation.argv)
    record = final_record(training, out, reason, test)
    status.finished(state, **record, outputs=report_outputs(session.report, None),
                    report_command=command if session.report else None)
    status.update(backup_complete=wait_for_backup(checkpointer, stop.signalled_at))
    if session.report:
        found = report.report_run(training, out, state, test, recorded_settings(training))
        outputs = report_outputs(True, found)
        status.update(**found, outputs=outputs, report_command=command if "failed" in outputs.values() else None)
    if checkpointer.backup is not None:
        checkpointer.backup.push_run_files(out)  # the final run_status.json too, not the one of the last save
    return report.final_line(out, state, status.record)


def final_record(training: Training, out: Path, reason: str | None, test: dict | None) -> dict:
    """What a finished session's status says of the run: where it stands, its losses, its last checkpoint."""
    best = training.metrics.best_val_loss
    return {
        "step": training.step,
        "total_steps": training.total_steps,
        "tokens": training.step * training.tokens_per_step,
        "reason": reason,
        "last_checkpoint": store.latest_checkpoint_name(out),
        "best_val_loss": best if math.isfinite(best) else None,
        "validation": training.metrics.last_eval,
        "test": test,
        "test_loss": test["loss"] if test else None,
        "train_loss": report.last_train_loss(out),
        "tasks": report.task_scores(training.metrics.task_history[-1]) if training.metrics.task_history else None,
        "tasks_step": training.metrics.task_history[-1]["step"] if training.metrics.task_history else None,
        "backup_complete": None,  # null until the upload wait ends (or with no backup)
    }


def report_outputs(asked: bool, found: dict | None) -> dict[str, str]:
    """run_status.json's `outputs`: the report and model/ "off" (--no-report), "pending" (not made
    yet: `found` None), "done" or "failed" (report_run's `report_errors` say why)."""
    if not asked:
        return {"report": "off", "model": "off"}
    if found is None:
        return {"report": "pending", "model": "pending"}
    return {"report": "failed" if found.get("report_errors") else "done",
            "model": "done" if found.get("model_files") else "failed"}


def export_only(settings: Settings, info: distributed.DistInfo) -> int:
    """--export-only: OUT/model/ from the --resume checkpoint, without training (rank 0 only), holding
    the run folder's lock: a training run that owns the folder writes its model/ itself."""
    if not info.is_main:
        return 0
    out = Path(settings.session.out)
    new = not out.exists()
    lock = store.lock_run_folder(out)
    try:
        return export_checkpoint(settings, info)
    finally:
        store.release_run_folder(out, lock, new)  # refused: leave no folder behind


def export_checkpoint(settings: Settings, info: distributed.DistInfo) -> int:
    """export_only's work, under the lock."""
    out = Path(settings.session.out)
    path = store.find_resume_checkpoint(out, settings.invocation.resume)
    if path is None:
        raise UserError(f"--export-only needs a checkpoint: --resume PATH, or an --out whose checkpoints/ has one "
                        f"(none in {out / 'checkpoints'})")
    checkpoint = store.load_checkpoint_file(path)
    corpus = Path(checkpoint["settings"]["runtime"]["data"]) if settings.invocation.demo else prepare_corpus(settings)
    report.export_checkpoint(checkpoint, path, out, corpus, info.device)
    return 0


def resume_command(info: distributed.DistInfo, argv: list[str] | None = None) -> str:
    """This run's command line with `--resume auto` and without `--stop-after-steps`; a --backup-to URL
    is shown as it is, unless it carries credentials: then as URL (which parse_args refuses)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    kept, skip, backup_url_next = [], False, False
    for item in argv:
        if skip:
            skip = False
            if not item.startswith("-"):  # the dropped option's value (--resume alone has none)
                continue
        if backup_url_next:
            kept.append(shown_backup_url(item))
            backup_url_next = False
            continue
        if item == "--backup-to":
            backup_url_next = True
        elif item.startswith("--backup-to="):
            item = "--backup-to=" + shown_backup_url(item.split("=", 1)[1])
        if item in ("--resume", "--stop-after-steps"):
            skip = True
            continue
        if not item.startswith(("--resume=", "--stop-after-steps=")):
            kept.append(item)
    return distributed.launch_command(info, Path(__file__), [*kept, "--resume", "auto"])


def shown_backup_url(url: str) -> str:
    printable = checkpoint_cloud.printable_backup_url(url)
    return checkpoint_cloud.BACKUP_URL_PLACEHOLDER if printable is None else printable


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


def command() -> None:
    """The `tinyllm-train` console script (pyproject.toml): `python train.py` from anywhere."""
    run_main(main, script=True)


if __name__ == "__main__":
    run_main(main)
