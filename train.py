"""Pretrain a Qwen3 model on a tinyllm corpus, with bit-exact resume after any interruption.

    python train.py                                                   # the demo: corpus, training, export
    python train.py --data corpus/demo --out runs/demo                # one device
    torchrun --nproc_per_node=2 train.py --data CORPUS --out RUN       # DDP: NCCL on CUDA, gloo on CPU
    python train.py --data CORPUS --out RUN --resume auto             # continue where it stopped
    python train.py --export-only --resume PATH --out RUN             # RUN/model/ from any checkpoint

The contracts (data order, run folder, checkpoint contents) are in DESIGN.md. The file reads
top-down: options, data order, the recipe, Training (one step counter), the run (main, the loop),
its lifecycle, the glue to checkpoint_store.py (which holds the checkpoint rules), and last the
distributed set-up and kernel workarounds. Every piece of state that must survive a restart is a
small object with state_dict()/load_state_dict(): the data order, the optimizers, the loss scaler,
the RNG of every rank and the run metrics; the Checkpointer writes them on a background thread.
At the end, report.py draws the loss curve, samples the model, measures its held-out task
accuracy and exports RUN/model/ as a Hugging Face folder; checkpoint_cloud.py mirrors the
checkpoints to remote storage (--backup-to) and restores them on a fresh machine.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import hashlib
import inspect
import math
import os
import random
import re
import shlex
import shutil
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import checkpoint_cloud
import checkpoint_store as store
import data
import hardware
import model_config
import report
from common import (
    ArgumentParser,
    UserError,
    atomic_open,
    atomic_write_json,
    os_error_cause,
    os_error_text,
    read_json,
    read_json_or,
    remove_temporaries,
    run_main,
    seed_everything,
    sha256_file,
    sha256_tree,
    utc_now,
)

# 4: precision is a session setting (settings["runtime"]["precision"], as resolved on the device that saved):
# a run may move between cards with and without bf16
FORMAT_VERSION = 4
DEFAULT_DATA = "corpus/demo"  # relative to the current folder
DEFAULT_OUT = "runs/demo"
# Without --data, `python train.py` is the demo: DEFAULT_DATA is built if missing and these replace the
# defaults of the options not given (measured: >= 90% held-out addition in ~5 min on one CPU thread).
DEMO_DEFAULTS = {"preset": "tiny", "batch_size": 32, "grad_accum": 1, "target_tokens": 1400 * 32 * 128,
                 "eval_every": 250, "eval_batches": 8, "save_every": 500, "log_every": 50, "threads": 1}
RUN_FOLDER_MARKERS = ("training_settings.json", "run_status.json", "checkpoints", ".lock")  # what --out may hold

MAX_TOKENS = 1e15  # 1,000x the largest open pretraining runs: a larger count is a typo (1e30)


# ----------------------------------------------------------------------------------------------
# Options. Every option lands in exactly one of three frozen dataclasses (tests/test_settings.py
# checks it), built once from the command line by parse_args and checked there (check_settings).


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


def build_parser() -> argparse.ArgumentParser:
    demo = " ".join(f"--{key.replace('_', '-')} {value}" for key, value in DEMO_DEFAULTS.items())
    parser = ArgumentParser(
        description="Pretrain a Qwen3 model on a corpus built by data.py (run under torchrun for DDP). "
                    "Without --data it runs the demo end to end.",
        epilog=f"The demo (no --data): builds {DEFAULT_DATA} with `data.py --demo` if it is not there, trains, "
               f"evaluates the held-out arithmetic problems and exports {DEFAULT_OUT}/model; options not given "
               f"take the demo defaults instead of those shown above: {demo}.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    paths = parser.add_argument_group("data and run folder")
    paths.add_argument("--data", default=None,
                       help=f"corpus folder built by data.py, or a corpus URL (s3:// gs:// hf://, pulled once into "
                            f"{data.PULLED_CORPORA}/ and verified); None: the demo in {DEFAULT_DATA}")
    paths.add_argument("--out", default=None,
                       help=f"run folder: checkpoints, metrics, status (needed with --data; the demo: {DEFAULT_OUT})")
    paths.add_argument("--init-from", default=None, metavar="SOURCE",
                       help="start a new run from these weights: a checkpoint file, a run folder (its newest "
                            "verified checkpoint) or a Hugging Face Qwen3 folder (e.g. RUN/model); "
                            "fresh optimizer, schedule and data order; the tokenizer must be the corpus'")
    paths.add_argument("--resume", default="auto",
                       help="'auto': the newest checkpoint in OUT whose sha256 verifies (a fresh start when "
                            "there is none); 'none': start fresh (refused if OUT has checkpoints); or a PATH")

    shape = parser.add_argument_group("model (a preset, with any field overridden)")
    shape.add_argument("--preset", default="tiny", choices=list(model_config.PRESETS), help="model shape")
    shape.add_argument("--context", type=int, default=None, help="tokens per block (None: the preset's)")
    tiny, think72 = model_config.PRESETS["tiny"], model_config.PRESETS["think72"]
    for name in model_config.OVERRIDABLE_FIELDS:
        if name != "context":
            shape.add_argument(f"--{name.replace('_', '-')}", type=type(getattr(tiny, name)), default=None,
                               help=f"None: the preset's (tiny {getattr(tiny, name):g}, "
                                    f"think72 {getattr(think72, name):g})")

    budget = parser.add_argument_group("batch, length and seed")
    budget.add_argument("--batch-size", type=int, default=8, help="blocks per micro-step per rank")
    budget.add_argument("--grad-accum", type=int, default=4, help="micro-steps per optimizer step")
    length = budget.add_mutually_exclusive_group()
    length.add_argument("--target-tokens", type=token_count, default=None,
                        help="train this many tokens, e.g. 300000000 or 3e8 (None, and no --epochs: 1 epoch)")
    length.add_argument("--epochs", type=float, default=None, help="train this many passes over the train split")
    budget.add_argument("--seed", type=int, default=1337, help="model init and data order")
    budget.add_argument("--packing", default=data.PACKINGS[0], choices=data.PACKINGS,
                        help="masked: blocks of the token stream, attention and RoPE positions kept inside each "
                             "document; bestfit: rows that start at a document, filled by best fit, no mask; "
                             "stream: blocks of the stream, attention across documents (docs/training.md)")

    recipe = parser.add_argument_group(
        "optimizer and schedule (None: the recipe rule for this model and run, printed at start; see docs/recipe.md)")
    recipe.add_argument("--optimizer", default=None, choices=OPTIMIZERS,
                        help=f"muon: torch.optim.Muon for the hidden matrices, AdamW for embeddings and norms; "
                             f"adamw: AdamW for everything (None: {DEFAULT_OPTIMIZER})")
    recipe.add_argument("--lr", type=float, default=None,
                        help="AdamW's peak learning rate (under muon: of the embeddings and norms)")
    recipe.add_argument("--muon-lr", type=float, default=None, help="Muon's peak learning rate (hidden matrices)")
    recipe.add_argument("--schedule", default=None, choices=SCHEDULES,
                        help="cosine: warmup, then cosine decay; wsd: warmup, constant, then a linear decay "
                             f"over the last --decay-fraction of the run (None: {DEFAULT_SCHEDULE})")
    recipe.add_argument("--warmup-steps", type=int, default=None,
                        help="linear warmup steps (None: a fraction of the run, see docs/recipe.md)")
    recipe.add_argument("--decay-fraction", type=float, default=None,
                        help=f"wsd: share of the run spent decaying (None: {DEFAULT_DECAY_FRACTION})")
    recipe.add_argument("--final-lr-fraction", type=float, default=None,
                        help=f"learning rate at the end, as a fraction of the peak (None: {DEFAULT_FINAL_LR_FRACTION})")
    recipe.add_argument("--weight-decay", type=float, default=0.1,
                        help="decoupled weight decay of the matrices (AdamW's and Muon's; not embeddings or norms)")
    recipe.add_argument("--beta1", type=float, default=0.9, help="AdamW beta1")
    recipe.add_argument("--beta2", type=float, default=None, help=f"AdamW beta2 (None: {DEFAULT_BETA2})")
    recipe.add_argument("--muon-momentum", type=float, default=0.95, help="Muon's (Nesterov) momentum")
    recipe.add_argument("--grad-clip", type=float, default=1.0, help="clip the global gradient norm (0: off)")

    loss = parser.add_argument_group("which tokens the loss counts (the corpus' mask, see data.py)")
    loss.add_argument("--loss-on", default="all", choices=LOSS_ON,
                      help="all: every token; assistant: only the assistants' answers (reasoning included) of "
                           "chat documents, and plain-text documents as --text-loss says")
    loss.add_argument("--text-loss", default=None, choices=TEXT_LOSS,
                      help="with --loss-on assistant, plain-text documents count fully or not at all (needed "
                           "when the corpus has any)")

    saving = parser.add_argument_group("checkpoints and evaluation")
    saving.add_argument("--save-every", type=int, default=250, help="save every N steps (0: never by count)")
    saving.add_argument("--save-seconds", type=float, default=600,
                        help="also save when this many seconds have passed since the last save (0: never by time)")
    saving.add_argument("--keep-last", type=int, default=2, help="retention: keep the newest N step checkpoints")
    saving.add_argument("--keep-every", type=int, default=0,
                        help="retention: also keep forever every checkpoint whose step is a multiple of N (0: off)")
    saving.add_argument("--eval-every", type=int, default=250, help="validation every N steps (0: only at the end)")
    saving.add_argument("--eval-batches", type=int, default=4,
                        help="validation over this many global batches of blocks (the same blocks whatever the "
                             "split between ranks, --batch-size and --grad-accum)")
    saving.add_argument("--log-every", type=int, default=10, help="progress line and metrics every N steps")

    stopping = parser.add_argument_group("stopping")
    stopping.add_argument("--max-hours", type=float, default=0,
                          help="stop (saved, resumable) early enough to save before this budget (0: no limit)")
    stopping.add_argument("--stop-after-steps", type=int, default=0,
                          help="stop (saved, resumable) once the run reaches step N (0: off)")
    stopping.add_argument("--max-overflow-steps", type=int, default=32,
                          help="fp16: fail after this many optimizer steps in a row skipped for overflow")

    hardware = parser.add_argument_group("hardware and speed")
    hardware.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                          help="auto: CUDA when torch sees a GPU, else CPU")
    hardware.add_argument("--threads", type=int, default=0, help="torch CPU threads per rank (0: torch's default)")
    hardware.add_argument("--precision", default="auto", choices=["auto", "fp32", "fp16", "bf16"],
                          help="auto: bf16 on sm_80+ GPUs (A100, A10, L4, H100), fp16 with loss scaling below "
                               "(T4, V100, P100), fp32 on CPU. May change on resume (a run can move between cards)")
    hardware.add_argument("--compile", action="store_true", help="torch.compile the model")
    hardware.add_argument("--grad-checkpoint", action="store_true", help="recompute activations in backward")
    hardware.add_argument("--deterministic", action="store_true",
                          help="CUDA: deterministic kernels only (torch.use_deterministic_algorithms, cuBLAS "
                               "workspace config, no cuDNN attention), so a resumed run is bit for bit the "
                               "uninterrupted one (slower; CPU runs are deterministic without it). May change "
                               "on resume")
    hardware.add_argument("--8bit-adam", dest="adam8bit", action="store_true", help="bitsandbytes AdamW8bit (CUDA)")
    hardware.add_argument("--require-gpus", type=int, default=0, help="refuse to start with fewer visible GPUs")
    hardware.add_argument("--require-gpu-name", default=None, help="refuse to start unless every GPU name has this")
    hardware.add_argument("--peak-tflops", type=float, default=0,
                          help="peak FLOP/s per device for MFU (0: GPU table, or an fp32/bf16 matmul measured on CPU)")

    output = parser.add_argument_group("what a run shows and leaves behind")
    output.add_argument("--report", action=argparse.BooleanOptionalAction, default=True,
                        help="loss_curve.png, sample_generations.json, held-out task accuracy and the Hugging Face "
                             "export RUN/model at the end (--no-report: checkpoints and metrics only)")
    output.add_argument("--tensorboard", action="store_true", help="also write the metrics to RUN/tensorboard")
    output.add_argument("--export-only", action="store_true",
                        help="no training: export the --resume checkpoint (auto: OUT's newest) to OUT/model")
    checkpoint_cloud.add_backup_args(parser)
    return parser


@dataclass(frozen=True)
class RunSettings:
    """What makes the run this run: a resume must give the same (Training.load compares them with the
    checkpoint's), except the length (target_tokens, epochs), which may change under extend_to's rule.

    None: the preset's shape, the recipe rule's value; what they resolve to is recorded beside these
    as model.* and recipe.* (and text_loss as resolved for the corpus)."""

    preset: str
    layers: int | None
    hidden: int | None
    intermediate: int | None
    heads: int | None
    kv_heads: int | None
    head_dim: int | None
    context: int | None
    rope_theta: float | None
    rms_norm_eps: float | None
    seed: int
    target_tokens: int | None
    epochs: float | None
    optimizer: str | None
    lr: float | None
    muon_lr: float | None
    schedule: str | None
    warmup_steps: int | None
    decay_fraction: float | None
    final_lr_fraction: float | None
    weight_decay: float
    beta1: float
    beta2: float | None
    muon_momentum: float
    grad_clip: float
    adam8bit: bool
    loss_on: str
    text_loss: str | None
    packing: str  # how documents become rows (data.TokenSplit)
    eval_batches: int  # which validation blocks best_val_loss is measured on


@dataclass(frozen=True)
class SessionSettings:
    """What may change from one session of a run to the next (recorded as "runtime", never compared).

    batch_size and grad_accum only split the global batch, which must match (global_batch_blocks);
    data may move: the corpus itself is identified by its manifest's sha256."""

    data: str
    out: str
    batch_size: int
    grad_accum: int
    device: str
    threads: int
    precision: str  # as asked (auto); what it resolves to on this device is recorded as runtime.precision
    compile: bool
    grad_checkpoint: bool
    deterministic: bool
    require_gpus: int
    require_gpu_name: str | None
    peak_tflops: float
    save_every: int
    save_seconds: float
    keep_last: int
    keep_every: int
    eval_every: int
    log_every: int
    max_hours: float
    stop_after_steps: int
    max_overflow_steps: int
    report: bool
    tensorboard: bool
    backup_to: str | None  # a URL may carry credentials: never recorded nor printed
    remote_keep_recent: int
    remote_keep_every: int
    backup_wait_seconds: float
    backup_max_unbacked: int


@dataclass(frozen=True)
class Invocation:
    """What this command does, once: not part of the run (an --init-from source is recorded as its lineage)."""

    resume: str
    init_from: str | None
    export_only: bool
    demo: bool  # derived: no --data, so the demo and its defaults
    argv: tuple[str, ...]  # derived: the command line, for the resume command


@dataclass(frozen=True)
class Settings:
    """One command line's settings: parse_args builds them once; nothing changes them afterwards."""

    run: RunSettings
    session: SessionSettings
    invocation: Invocation


def option_values(settings: Settings) -> dict:
    """Every setting by its option's name (argparse dest), the three groups together."""
    return {**dataclasses.asdict(settings.run), **dataclasses.asdict(settings.session),
            **dataclasses.asdict(settings.invocation)}


def parse_args(argv: list[str] | None = None) -> Settings:
    """The settings of this command line (UserError when one is wrong); without --data, the demo
    defaults replace those of the options not given."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    demo = args.data is None
    if demo:
        parser.set_defaults(data=DEFAULT_DATA, out=DEFAULT_OUT, **DEMO_DEFAULTS)
        epochs_given = args.epochs is not None  # --epochs replaces the demo's --target-tokens
        args = parser.parse_args(argv)
        if epochs_given:
            args.target_tokens = None
    if args.out is None:
        raise UserError("--data needs --out RUN: the run folder for its checkpoints, metrics and status")
    values = {**vars(args), "demo": demo, "argv": tuple(argv)}

    def group(kind):
        return kind(**{field.name: values[field.name] for field in dataclasses.fields(kind)})

    settings = Settings(run=group(RunSettings), session=group(SessionSettings), invocation=group(Invocation))
    check_settings(settings)
    return settings


def check_settings(settings: Settings) -> None:
    """Every rule on the options' values, each broken one a UserError naming its option."""
    values, run, invocation = option_values(settings), settings.run, settings.invocation
    positive = ["batch_size", "grad_accum", "eval_batches", "log_every", "max_overflow_steps"]
    not_negative = ["warmup_steps", "save_every", "save_seconds", "keep_every", "eval_every", "max_hours",
                    "stop_after_steps", "threads", "require_gpus", "peak_tflops", "weight_decay", "grad_clip",
                    "backup_wait_seconds"]
    for name in positive:
        if values[name] <= 0:
            raise UserError(f"--{name.replace('_', '-')} must be positive, got {values[name]}")
    for name in not_negative:
        if values[name] is not None and values[name] < 0:
            raise UserError(f"--{name.replace('_', '-')} must not be negative, got {values[name]}")
    checkpoint_cloud.refuse_placeholder(settings.session.backup_to)
    if settings.session.keep_last < 1:
        raise UserError(f"--keep-last must be at least 1, got {settings.session.keep_last}")
    for name in ("lr", "muon_lr", "weight_decay", "max_hours", "save_seconds", "peak_tflops", "grad_clip",
                 "beta1", "beta2", "muon_momentum", "decay_fraction", "final_lr_fraction"):
        if values[name] is not None and not math.isfinite(values[name]):
            raise UserError(f"--{name.replace('_', '-')} must be a finite number, got {values[name]}")
    for name in ("lr", "muon_lr"):
        if values[name] is not None and values[name] <= 0:
            raise UserError(f"--{name.replace('_', '-')} must be positive, got {values[name]}")
    for name in ("beta1", "beta2", "muon_momentum"):
        if values[name] is not None and not 0 <= values[name] < 1:
            raise UserError(f"--{name.replace('_', '-')} must be in [0, 1), got {values[name]}")
    for name in ("decay_fraction", "final_lr_fraction"):
        if values[name] is not None and not 0 <= values[name] <= 1:
            raise UserError(f"--{name.replace('_', '-')} must be in [0, 1], got {values[name]}")
    if run.muon_lr is not None and run.optimizer == "adamw":
        raise UserError("--muon-lr needs --optimizer muon (with adamw, --lr sets every learning rate)")
    if run.decay_fraction is not None and run.schedule == "cosine":
        raise UserError("--decay-fraction belongs to --schedule wsd (the cosine decays over the whole run)")
    if run.adam8bit and (run.optimizer or DEFAULT_OPTIMIZER) == "muon":
        raise UserError("--8bit-adam needs --optimizer adamw: under muon, AdamW only trains the embeddings and "
                        "norms, and Muon keeps one buffer per matrix (half of AdamW's state) already")
    if run.target_tokens is not None and run.target_tokens <= 0:
        raise UserError(f"--target-tokens must be positive, got {run.target_tokens}")
    if run.epochs is not None and not (math.isfinite(run.epochs) and run.epochs > 0):
        raise UserError(f"--epochs must be a positive finite number, got {run.epochs}")
    if run.context is not None and run.context < 2:
        raise UserError(f"--context must be at least 2, got {run.context}")
    resolve_model_preset(run)  # the shape's own rules (positive fields, heads a multiple of kv_heads)
    if run.text_loss is not None and run.loss_on != "assistant":
        raise UserError("--text-loss needs --loss-on assistant (with --loss-on all every token counts)")
    if invocation.init_from is not None and invocation.resume not in ("auto", "none"):
        raise UserError("--init-from starts a new run and --resume PATH continues one: give one of them")
    if invocation.resume not in ("auto", "none") and re.fullmatch(r"[A-Za-z]+", invocation.resume) \
            and not Path(invocation.resume).exists():
        raise UserError(f"--resume {invocation.resume}: not a choice and no such file; use auto (the newest "
                        "verified checkpoint in --out), none (start fresh) or the PATH of a checkpoint")


def resolve_model_preset(run: RunSettings) -> model_config.Preset:
    overrides = {name: getattr(run, name) for name in model_config.OVERRIDABLE_FIELDS}
    return model_config.resolve_preset(run.preset, **overrides)


# ----------------------------------------------------------------------------------------------
# Corpus: token streams cut into shards (DESIGN.md, "Corpus folder").


LOSS_ON = ("all", "assistant")


TEXT_LOSS = ("full", "none")


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
# Data order (DESIGN.md): global sample g is block perm(seed, epoch = g // blocks)(g % blocks).


# ----------------------------------------------------------------------------------------------
# The recipe: optimizer, learning rates and schedule, chosen from the model's width and the run's


# ----------------------------------------------------------------------------------------------
# length by the rules below (measured in bench/bench_recipe.py; the evidence is in docs/recipe.md).


OPTIMIZERS = ("muon", "adamw")


SCHEDULES = ("wsd", "cosine")


DEFAULT_OPTIMIZER = "muon"


DEFAULT_SCHEDULE = "wsd"


DEFAULT_DECAY_FRACTION = 0.4


DEFAULT_FINAL_LR_FRACTION = 0.0


DEFAULT_BETA2 = 0.95


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
                f"weight decay {self.weight_decay:g}, grad clip {self.grad_clip:g}")


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
                    muon_momentum=run.muon_momentum if optimizer == "muon" else None, grad_clip=run.grad_clip)
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
    """

    def __init__(self, parts: dict[str, torch.optim.Optimizer]):
        self.parts = parts

    def set_lr_multiplier(self, multiplier: float) -> None:
        for optimizer in self.parts.values():
            for group in optimizer.param_groups:
                group["lr"] = group["peak_lr"] * multiplier

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
                             momentum=recipe.muon_momentum, nesterov=True)
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


class LossScaler:
    """torch.amp.GradScaler (enabled for fp16 only) over the run's optimizers, counting steps skipped for overflow."""

    def __init__(self, device: torch.device, enabled: bool):
        self.scaler = torch.amp.GradScaler(device.type, enabled=enabled)
        self.enabled = enabled
        self.skipped_total = 0
        self.skipped_in_a_row = 0

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss)

    def unscale_(self, optimizers: list[torch.optim.Optimizer]) -> None:
        for optimizer in optimizers:
            self.scaler.unscale_(optimizer)

    def step(self, optimizers: list[torch.optim.Optimizer], finite: bool = True) -> bool:
        """Step every optimizer; False when fp16 gradients overflowed (`finite` False) and none stepped.

        GradScaler decides per optimizer; an overflow in one optimizer's gradients (say the embeddings')
        must skip the others' step too, or the retried step would apply their update twice.
        """
        if not self.enabled:
            for optimizer in optimizers:
                optimizer.step()
            return True
        if finite:
            for optimizer in optimizers:
                self.scaler.step(optimizer)
        self.scaler.update()  # lowers the scale after an overflow, raises it after a run of good steps
        if not finite:
            self.skipped_total += 1
            self.skipped_in_a_row += 1
            return False
        self.skipped_in_a_row = 0
        return True

    def state_dict(self) -> dict:
        return {"scaler": self.scaler.state_dict(), "skipped_total": self.skipped_total,
                "skipped_in_a_row": self.skipped_in_a_row}

    def load_state_dict(self, state: dict) -> None:
        if state["scaler"]:
            self.scaler.load_state_dict(state["scaler"])
        self.skipped_total = int(state["skipped_total"])
        self.skipped_in_a_row = int(state["skipped_in_a_row"])


# ----------------------------------------------------------------------------------------------
# State that survives a restart besides the model and optimizers: the RNG of every rank (plain


# ----------------------------------------------------------------------------------------------
# containers and tensors, loadable with weights_only=True) and the run's metrics.


def rng_state(device: torch.device) -> dict:
    version, mt_state, gauss = random.getstate()
    numpy_state = np.random.get_state()
    state = {
        "python": [version, list(mt_state), gauss],
        "numpy": {"key": torch.from_numpy(numpy_state[1].astype(np.int64)), "pos": int(numpy_state[2]),
                  "has_gauss": int(numpy_state[3]), "cached_gaussian": float(numpy_state[4])},
        "torch": torch.get_rng_state(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    version, mt_state, gauss = state["python"]
    random.setstate((version, tuple(mt_state), gauss))
    numpy_state = state["numpy"]
    np.random.set_state(("MT19937", numpy_state["key"].numpy().astype(np.uint32), numpy_state["pos"],
                         numpy_state["has_gauss"], numpy_state["cached_gaussian"]))
    torch.set_rng_state(state["torch"].cpu())
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)


class RankRNG:
    """The RNG state of every rank, gathered to rank 0 for the checkpoint (a collective call)."""

    def __init__(self, info: DistInfo):
        self.info = info

    def state_dict(self) -> list[dict] | None:
        local = rng_state(self.info.device)
        if self.info.world == 1:
            return [local]
        gathered = [None] * self.info.world if self.info.is_main else None
        dist.gather_object(local, gathered, dst=0)
        return gathered

    def load_state_dict(self, states: list[dict]) -> None:
        """Each rank takes its own state; ranks new since the checkpoint keep their seeded state."""
        if self.info.rank < len(states):
            set_rng_state(states[self.info.rank], self.info.device)


class RunMetrics:
    """Numbers that must survive a restart: best validation loss, the latest evaluation, time trained."""

    def __init__(self):
        self.best_val_loss = math.inf
        self.best_step = 0
        self.last_eval: dict | None = None
        self.train_seconds = 0.0

    def state_dict(self) -> dict:
        return {"best_val_loss": self.best_val_loss, "best_step": self.best_step,
                "last_eval": self.last_eval, "train_seconds": self.train_seconds}

    def load_state_dict(self, state: dict) -> None:
        self.best_val_loss = float(state["best_val_loss"])
        self.best_step = int(state["best_step"])
        self.last_eval = state["last_eval"]
        self.train_seconds = float(state["train_seconds"])


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


def language_model_loss(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
                        reduction: str = "mean", chunk_tokens: int | None = None,
                        segments: torch.Tensor | None = None) -> torch.Tensor:
    """Next-token cross-entropy of `model` on a batch of blocks, never holding the batch's full logits;
    with `segments` (data.Batch), attention and positions stay inside each document (document_attention).

    The decoder gives the hidden states; the LM head and the cross-entropy run `chunk_tokens` tokens at a
    time (hardware.logits_chunk_tokens: 128 MiB of fp32 logits), each chunk's logits made in the autocast
    dtype and taken to fp32, as F.cross_entropy(logits.float()) on the whole batch would. Targets equal
    to data.IGNORE_INDEX are not counted ("mean" divides by the counted ones)."""
    if segments is None:
        hidden = model.model(input_ids=inputs).last_hidden_state
    else:
        positions, mask = model_config.document_attention(segments)
        hidden = model.model(input_ids=inputs, position_ids=positions, attention_mask=mask).last_hidden_state
    hidden, targets = hidden.reshape(-1, hidden.size(-1)), targets.reshape(-1)
    weight = model.lm_head.weight
    chunk_tokens = chunk_tokens or hardware.logits_chunk_tokens(weight.size(0))
    device_type = hidden.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else weight.dtype
    with torch.autocast(device_type, enabled=False):  # the chunks cast for themselves
        if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
            total = ChunkedLinearCrossEntropy.apply(hidden, weight, targets, chunk_tokens, dtype)
        else:
            total = linear_cross_entropy_sum(hidden, weight, targets, chunk_tokens, dtype)
    if reduction == "sum":
        return total
    return total / (targets != data.IGNORE_INDEX).sum()


def cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """F.cross_entropy(logits, targets, reduction="sum") over the counted targets, and each row's logsumexp."""
    counted = targets != data.IGNORE_INDEX
    logsumexp = torch.logsumexp(logits, dim=-1)
    target_logits = logits.gather(1, torch.where(counted, targets, 0)[:, None]).squeeze(1)
    return torch.where(counted, logsumexp - target_logits, 0.0).sum(), logsumexp


def cross_entropy_gradient_(logits: torch.Tensor, targets: torch.Tensor, logsumexp: torch.Tensor) -> torch.Tensor:
    """d cross_entropy_sum / d logits, written over `logits`: softmax minus the one-hot target; 0 where not counted."""
    counted = targets != data.IGNORE_INDEX
    gradient = logits.sub_(logsumexp[:, None]).exp_()
    gradient.scatter_add_(1, torch.where(counted, targets, 0)[:, None], torch.full_like(logsumexp[:, None], -1.0))
    return gradient.mul_(counted[:, None])


def linear_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_tokens: int,
                             dtype: torch.dtype) -> torch.Tensor:
    """cross_entropy_sum(hidden @ weight.T, targets), chunk by chunk (evaluation: no gradients)."""
    weight = weight.to(dtype)
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for start in range(0, hidden.size(0), chunk_tokens):
        rows = slice(start, start + chunk_tokens)
        total += cross_entropy_sum((hidden[rows].to(dtype) @ weight.t()).float(), targets[rows])[0]
    return total


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """linear_cross_entropy_sum with its gradients. They are computed in the forward, chunk by chunk, as
    Liger-Kernel's fused linear cross-entropy does: neither pass ever holds more than one chunk's logits,
    and no chunk is computed twice. What is kept for the backward is two fp32 gradients the size of the
    hidden states and of the LM head; the backward only scales them by the loss's gradient (1/count under
    "mean", times the loss scale under fp16). Each chunk's gradient goes to the matmuls in the autocast
    dtype unscaled (|softmax - one-hot| <= 1, well inside fp16), and is summed over the chunks in fp32."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_tokens, dtype):
        weight_cast = weight.to(dtype)
        grad_hidden = torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.size(0), chunk_tokens):
            rows = slice(start, start + chunk_tokens)
            chunk, chunk_targets = hidden[rows].to(dtype), targets[rows]
            logits = (chunk @ weight_cast.t()).float()
            loss, logsumexp = cross_entropy_sum(logits, chunk_targets)
            total += loss
            grad_logits = cross_entropy_gradient_(logits, chunk_targets, logsumexp).to(dtype)
            grad_hidden[rows] = grad_logits @ weight_cast
            grad_weight += grad_logits.t() @ chunk
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.dtypes = hidden.dtype, weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_total):
        grad_hidden, grad_weight = ctx.saved_tensors
        hidden_dtype, weight_dtype = ctx.dtypes
        return ((grad_hidden * grad_total).to(hidden_dtype), (grad_weight * grad_total).to(weight_dtype),
                None, None, None)


class LanguageModelLoss(torch.nn.Module):
    """The model and its loss as one module: --compile compiles the chunked cross-entropy with the model,
    and DDP wraps both."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor, reduction: str = "mean",
                segments: torch.Tensor | None = None) -> torch.Tensor:
        return language_model_loss(self.model, inputs, targets, reduction, segments=segments)


class NonFiniteLoss(Exception):
    pass


@dataclass
class StepResult:
    step: int
    loss: float
    lr: float
    grad_norm: float
    seconds: float
    applied: bool  # False when fp16 skipped the step for overflow (the step is then retried)


class Training:
    """Model, optimizer, data, schedule and scaler of one run on one rank.

        settings = train.parse_args(["--data", CORPUS, "--out", RUN, "--preset", "micro", "--threads", "2"])
        info = train.init_distributed(settings.session.device)
        training = train.build_training(settings, info)
        result = training.train_step()          # one optimizer step (all micro-steps)
    """

    def __init__(self, settings: Settings, info: DistInfo, manifest: dict, corpus: Path):
        run, session = settings.run, settings.session
        self.run, self.session, self.invocation = run, session, settings.invocation
        self.info, self.device, self.corpus = info, info.device, corpus
        self.preset = resolve_model_preset(run)
        self.context = self.preset.context
        self.manifest = manifest
        self.manifest_sha256 = sha256_file(corpus / "corpus_manifest.json")
        self.vocab_size = int(manifest["vocab_size"])
        self.hardware = hardware.describe(self.device)
        self.precision_choice = resolve_precision(session.precision, self.hardware)
        self.text_loss = check_loss_on(run, manifest, corpus)
        self.counted = data.counted_classes(run.loss_on, self.text_loss)
        self.splits = {name: data.TokenSplit(corpus, manifest, name, self.context, self.counted, run.packing)
                       for name in ("train", "validation", "test")}
        tokenizer_file = corpus / "tokenizer" / "tokenizer.json"
        self.token_bytes = data.token_byte_lengths(tokenizer_file, self.vocab_size).to(self.device)
        self.sampler = data.BlockSampler(self.splits["train"].blocks, run.seed, session.batch_size,
                                         session.grad_accum, info.world)
        self.step = 0  # optimizer steps taken: the only counter (data order, lr and checkpoint follow it)
        self.tokens_per_step = self.sampler.global_batch * self.context
        self.total_steps = self._total_steps()
        self.recipe, self.recipe_reasons = choose_recipe(run, self.preset.hidden, self.total_steps)

        seed_everything(run.seed)
        specials = manifest.get("special_tokens", {})
        self.model = model_config.build_model(self.preset, self.vocab_size, pad_token_id=specials.get("<pad>", 0),
                                              bos_token_id=specials.get("<bos>", 1),
                                              eos_token_id=specials.get("<eos>", 2)).to(self.device)
        self.model.config.use_cache = False
        if session.grad_checkpoint:
            if hasattr(self.model, "activation_checkpointing_enable"):  # the name since transformers 5.x
                self.model.activation_checkpointing_enable({"use_reentrant": False})
            else:
                self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.model.train()
        self.optimizer = build_optimizers(self.model, self.recipe, self.device, run.adam8bit, info.rank, info.world)
        self.scaler = LossScaler(self.device, enabled=self.precision == "fp16")
        self.rng = RankRNG(info)
        self.metrics = RunMetrics()
        self.staging = StagingBuffers()
        self.run_id = uuid.uuid4().hex
        self.lineage: dict | None = None  # where --init-from took the first weights from
        self.extensions: list[dict] = []  # each resume that changed the run's length (extend_to)
        self.autocast_dtype = AUTOCAST_DTYPES.get(self.precision)
        self.sdpa_context, self.sdpa = self._fused_sdpa_context()
        self.forward_model = self._wrap_model()
        self.flops_per_token = model_config.flops_per_token(self.preset, self.vocab_size, self.context)

    def _total_steps(self) -> int:
        run = self.run
        if run.target_tokens is not None:
            return max(1, math.ceil(run.target_tokens / self.tokens_per_step))
        epochs = 1.0 if run.epochs is None else run.epochs
        return max(1, math.ceil(epochs * self.sampler.blocks / self.sampler.global_batch))

    def _wrap_model(self) -> torch.nn.Module:
        """The loss module wrapped in DDP and torch.compile, in hardware.wrap_order's order."""
        model = LanguageModelLoss(self.model)
        for wrapper in hardware.wrap_order(self.session.compile, self.info.world)[1:]:
            model = torch.compile(model) if wrapper == "compile" else self._ddp(model)
        return model

    def _ddp(self, model: torch.nn.Module) -> torch.nn.Module:
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [self.info.local_rank] if self.device.type == "cuda" else None
        # The model's only buffers (RoPE frequencies) are the same on every rank: no sync per forward.
        # torch 2.13 renamed the option (and warns on the old name from every rank).
        no_buffer_sync = {"forward_sync_buffers": False} \
            if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters \
            else {"broadcast_buffers": False}
        return DistributedDataParallel(model, device_ids=device_ids, gradient_as_bucket_view=True, **no_buffer_sync)

    def _fused_sdpa_context(self):
        """The attention hardware.choose_attention plans for this card and dtype, made so.

        Every plan goes through one of train.py's attention functions, so that under torch.compile the
        causal mask stays SDPA's is_causal (model_config.causal_sdpa_mask) instead of a dense mask tensor. On CUDA a
        fused plan trains inside sdpa_kernel(fused backends only): a forward and backward probe checks
        that the kernel takes this model, and the math fallback is taken only, with a warning, if not.
        """
        plan = hardware.choose_attention(self.hardware, self.precision, self.preset.head_dim,
                                         self.session.deterministic)
        model_config.use_attention(self.model, plan.implementation)
        if not plan.fused_only:
            if self.hardware.is_cuda:
                warn(f"{plan.reason}; attention uses the slower math kernel")
            return contextlib.nullcontext, plan.reason
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backends = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                    "cudnn": SDPBackend.CUDNN_ATTENTION}
        fused = [backends[name] for name in plan.backends]
        probe = torch.zeros(1, self.context, dtype=torch.long, device=self.device)
        try:
            with sdpa_kernel(fused), self.autocast():
                self.model(input_ids=probe).logits.float().sum().backward()
        except RuntimeError as error:
            warn(f"the planned {plan.reason} does not take this model ({str(error).splitlines()[0][:200]}); "
                 "attention uses the slower math kernel")
            model_config.use_attention(self.model, model_config.SDPA_CAUSAL)
            return contextlib.nullcontext, f"math fallback (planned: {plan.reason})"
        finally:
            self.model.zero_grad(set_to_none=True)
        return (lambda: sdpa_kernel(fused)), plan.reason

    @property
    def precision(self) -> str:
        return self.precision_choice.value  # "fp32", "fp16" or "bf16", as resolved on this device

    def autocast(self):
        return torch.autocast(self.device.type, dtype=self.autocast_dtype or torch.float32,
                              enabled=self.autocast_dtype is not None)

    def loss_of(self, batch: data.Batch, model: torch.nn.Module | None = None,
                reduction: str = "mean") -> torch.Tensor:
        """The training loss through forward_model (compiled, DDP), or through `model` as it is (evaluation)."""
        inputs, targets, segments = batch
        with self.autocast(), self.sdpa_context():
            if model is None:
                return self.forward_model(inputs, targets, reduction, segments)
            return language_model_loss(model, inputs, targets, reduction, segments=segments)

    def train_step(self) -> StepResult:
        """One optimizer step over all micro-steps; all ranks take part. Raises NonFiniteLoss."""
        started = time.perf_counter()
        step = self.step
        lr_multiplier = self.recipe.lr_multiplier(step)
        self.optimizer.set_lr_multiplier(lr_multiplier)
        micro_batches = self.sampler.micro_batches(step, self.info.rank)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        batches = [self.splits["train"].batch(indices, self.device) for indices in micro_batches]
        if self.counted is not None:
            # the mean over the step's counted targets on all ranks (DDP averages the ranks' gradients)
            counted = sum((batch.targets != data.IGNORE_INDEX).sum() for batch in batches).double()
            per_rank = all_reduce_sum(counted, self.info).clamp(min=1) / self.info.world
        for micro, batch in enumerate(batches):
            last = micro == len(micro_batches) - 1
            sync = contextlib.nullcontext() if last or self.info.world == 1 else self.forward_model.no_sync()
            with sync:
                if self.counted is None:
                    loss = self.loss_of(batch) / len(micro_batches)
                else:
                    loss = self.loss_of(batch, reduction="sum") / per_rank.to(torch.float32)
                self.scaler.scale(loss).backward()
            loss_sum += loss.detach().double()
        optimizers = list(self.optimizer.parts.values())
        self.scaler.unscale_(optimizers)
        # --grad-clip 0 is off: an infinite bound never clips (a bound of 0 would zero every gradient)
        grad_norm = clip_gradients(self.model.parameters(), self.recipe.grad_clip or math.inf).item()
        mean_loss = all_reduce_sum(loss_sum, self.info).item() / self.info.world
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
        lr = self.recipe.lr * lr_multiplier if self.recipe.muon_lr is None else self.recipe.muon_lr * lr_multiplier
        return StepResult(step=self.step, loss=mean_loss, lr=lr, grad_norm=grad_norm, seconds=seconds,
                          applied=applied)

    @torch.no_grad()
    def evaluate(self, split: str) -> dict | None:
        """Mean loss and perplexity over the first eval blocks of `split` (a fixed order), over all ranks.

        The blocks are --eval-batches global batches' worth: a resume with another split between ranks,
        batch size and accumulation (the same global batch) evaluates the same blocks, so its losses
        and the best checkpoint stay comparable with those before."""
        data_split = self.splits[split]
        if data_split.blocks == 0:
            return None
        count = min(data_split.blocks, self.run.eval_batches * self.sampler.global_batch)
        order = data.BlockPermutation(data_split.blocks, self.run.seed, data.EVAL_EPOCH)
        mine = [order(i) for i in range(self.info.rank, count, self.info.world)]
        totals = torch.zeros(3, dtype=torch.float64, device=self.device)  # nats, counted targets, their bytes
        self.model.eval()
        for start in range(0, len(mine), self.session.batch_size):
            batch = data_split.batch(mine[start: start + self.session.batch_size], self.device)
            targets = batch.targets
            counted = targets != data.IGNORE_INDEX
            totals[0] += self.loss_of(batch, model=self.model, reduction="sum").double()
            totals[1] += counted.sum()
            totals[2] += self.token_bytes[targets[counted]].sum()
        self.model.train()
        all_reduce_sum(totals, self.info)
        if totals[1] == 0:
            return None  # --loss-on assistant and no counted token in the evaluation blocks
        nats, tokens, text_bytes = totals.tolist()
        loss = nats / tokens
        bits_per_byte = nats / math.log(2) / text_bytes if text_bytes else None  # None: only special tokens
        return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": int(tokens),
                "bits_per_byte": bits_per_byte, "bytes": int(text_bytes)}

    # -- settings and state ----------------------------------------------------------------

    def settings(self) -> dict:
        """What a resumed run must share with the checkpoint ("training": the RunSettings, precision and
        text_loss as resolved, and what they make of this corpus) and what may change ("runtime")."""
        training = {
            **dataclasses.asdict(self.run),
            "text_loss": self.text_loss,  # None with --loss-on all
            "corpus_manifest_sha256": self.manifest_sha256,
            "tokenizer_sha256": self.manifest.get("tokenizer_sha256"),
            "vocab_size": self.vocab_size,
            **{f"model.{name}": getattr(self.preset, name) for name in model_config.OVERRIDABLE_FIELDS},
            "global_batch_blocks": self.sampler.global_batch,
            "tokens_per_step": self.tokens_per_step,
            "total_steps": self.total_steps,
            **{f"recipe.{key}": value for key, value in dataclasses.asdict(self.recipe).items()},
            "recipe.betas": list(self.recipe.betas),  # as JSON and the checkpoint store it
        }
        runtime = {**dataclasses.asdict(self.session), "data": str(self.corpus), "world_size": self.info.world,
                   "precision": self.precision, "device": self.hardware.label()}  # as resolved here
        del runtime["backup_to"]  # a URL may carry credentials
        return {"training": training, "runtime": runtime, "init_from": self.lineage, "extended": self.extensions,
                "vocabulary_sha256": self.manifest.get("vocabulary_sha256")}

    def snapshot(self) -> dict | None:
        """The full state copied to CPU, on rank 0 (None elsewhere). Collective: every rank calls it.

        The copy lives in reused staging buffers: write it out (Checkpointer.save) and wait for
        that write (Checkpointer.wait) before the next snapshot.
        """
        rng = self.rng.state_dict()
        if not self.info.is_main:
            return None
        return self.staging.copy({
            "format_version": FORMAT_VERSION,
            "step": self.step,
            "run_id": self.run_id,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "sampler": self.sampler.state_dict(),
            "metrics": self.metrics.state_dict(),
            "rng": rng,
            "settings": self.settings(),
            "created": utc_now(),
        })

    def load(self, checkpoint: dict, path: Path) -> None:
        """Restore every piece of state from `checkpoint`, then prove model and optimizer equal the file.

        Only the run's length may differ (an extension, see extend_to)."""
        old = checkpoint["settings"]["training"]
        warmup = old.get("recipe.warmup_steps")
        if self.run.warmup_steps is None and warmup is not None and warmup != self.recipe.warmup_steps:
            # the rule chose it for the run's first length: an extended run keeps it (extension_problem)
            kept = dataclasses.replace(self.run, warmup_steps=int(warmup))
            self.recipe, self.recipe_reasons = choose_recipe(kept, self.preset.hidden, self.total_steps)
            self.recipe_reasons.append(f"{warmup} warmup steps: the run's, chosen for its first length")
        self.extensions = list(checkpoint["settings"].get("extended") or [])
        runtime = checkpoint["settings"].get("runtime") or {}
        moved = hardware.precision_change(runtime.get("precision", self.precision), self.precision, self.hardware)
        if moved and self.info.is_main:
            print(f"note: {moved}", flush=True)
        verdict = store.resume_verdict(old, self.settings()["training"])
        if verdict.others:
            raise UserError(f"settings differ from checkpoint {path}: " + store.describe_changes(verdict.others)
                            + ". A resume keeps every training setting; only the length (--target-tokens or "
                            "--epochs) may change, under --schedule wsd from a checkpoint before its decay"
                            + (" (here the length changed along with other settings)" if verdict.extend else "")
                            + f"; for a new run from these weights use a new --out with --init-from {path}")
        if verdict.extend:
            self.extend_to(old, int(checkpoint["step"]), path)
        self.model.load_state_dict(checkpoint["model"])
        self.optimizer.load_state_dict(checkpoint["optimizer"])
        self.scaler.load_state_dict(checkpoint["scaler"])
        self.sampler.load_state_dict(checkpoint["sampler"])
        self.step = int(checkpoint["step"])  # the one counter: the data order and the lr are functions of it
        self.metrics.load_state_dict(checkpoint["metrics"])
        self.run_id = checkpoint["run_id"]
        self.lineage = checkpoint["settings"].get("init_from")
        differences = (tensors_equal(self.model.state_dict(), checkpoint["model"], "model")
                       + tensors_equal(self.optimizer.state_dict(), checkpoint["optimizer"], "optimizer"))
        if differences:
            raise UserError(f"checkpoint {path}: state after loading differs from the file at "
                            + ", ".join(differences[:5]))
        self.rng.load_state_dict(checkpoint["rng"])

    def extend_to(self, old: dict, step: int, path: Path) -> None:
        """Continue the run recorded in `old` (its training settings) at `step` with this run's length.

        The recipe is this run's: the warmup the checkpoint's (unless --warmup-steps asks otherwise, see
        load), the decay derived for the new length. Refused (one line saying why) unless every step
        taken keeps its rate."""
        recorded = {key[len("recipe."):]: value for key, value in old.items() if key.startswith("recipe.")}
        try:
            before = Recipe(**{**recorded, "betas": tuple(recorded["betas"])})
        except (TypeError, KeyError):
            raise UserError(f"checkpoint {path} does not record its recipe; it cannot be extended") from None
        problem = extension_problem(before, self.recipe, step)
        if problem:
            length = f"--target-tokens {old['target_tokens']}" if old.get("target_tokens") else \
                f"--epochs {old.get('epochs') or 1}"
            raise UserError(f"checkpoint {path} is a run of {old['total_steps']} steps and this one asks for "
                            f"{self.total_steps}: it cannot be extended: {problem}. Resume it with its length "
                            f"({length}), or start a new run from its weights with --init-from {path}")
        self.extensions.append({"at_step": step, "from_total_steps": int(old["total_steps"]),
                                "to_total_steps": self.total_steps})

    def init_from(self, source: InitSource) -> None:
        """This new run's weights from `source` (before the first step); the rest stays fresh."""
        problem = init_mismatch(source, self.model, self.settings())
        if problem:
            raise UserError(problem)
        with torch.no_grad():
            self.model.load_state_dict(source.state)
        self.lineage = source.lineage


def build_training(settings: Settings, info: DistInfo, vocab_size: int | None = None,
                   corpus: Path | None = None) -> Training:
    """A ready-to-step Training from parsed options (no files written, no corpus check).

    `corpus`: the local corpus folder (prepare_corpus'; None: --data as given). `vocab_size` (benchmarks
    only) builds the model with a larger vocabulary than the corpus tokenizer's, e.g. think72's 33,069
    over the small demo corpus, whose ids all stay valid."""
    corpus = Path(settings.session.data) if corpus is None else corpus
    manifest = data.load_manifest(corpus)
    if vocab_size is not None:
        if vocab_size < manifest["vocab_size"]:
            raise UserError(f"vocab_size {vocab_size} is below the corpus' {manifest['vocab_size']}")
        manifest = dict(manifest, vocab_size=vocab_size)
    if settings.session.threads:
        torch.set_num_threads(settings.session.threads)
    use_deterministic_kernels(settings.session.deterministic)  # main() did it already; this is for Python callers
    return Training(settings, info, manifest, corpus)


# ----------------------------------------------------------------------------------------------
# The run: main() reads top-down; the loop; stopping on signals and the time budget.


def main(argv: list[str] | None = None) -> int:
    hardware.check_torch()
    settings = parse_args(argv)
    session, invocation = settings.session, settings.invocation
    use_deterministic_kernels(session.deterministic)  # before CUDA starts (the cuBLAS workspace)
    info = init_distributed(session.device)
    try:
        if invocation.export_only:
            return export_only(settings, info)
        corpus = main_decides(lambda: prepare_corpus(settings), info)
        with claim_run_folder(Path(session.out), info):
            backup_url = checkpoint_cloud.backup_url_from_env_or_arg(session.backup_to)
            if backup_url:
                main_decides(lambda: checkpoint_cloud.check_backup_target(backup_url), info)
            if backup_url and invocation.resume == "auto":
                main_decides(lambda: restore_from_backup(backup_url, Path(session.out)), info)
            backup = start_backup(session, info)
            try:
                return train(settings, info, corpus, backup=backup, backup_wait_s=session.backup_wait_seconds)
            finally:
                if backup is not None:
                    backup.close()
    finally:
        shutdown_distributed()


def train(settings: Settings, info: DistInfo, corpus: Path, backup=None, backup_wait_s: float = 600) -> int:
    """The training run on the local `corpus` folder. `backup` (rank 0; checkpoint_cloud.BackupProcess) gets
    every checkpoint."""
    process_started = time.monotonic()
    session, invocation = settings.session, settings.invocation
    out = Path(session.out)
    hardware.check_required_gpus(session.require_gpus, session.require_gpu_name, info.device.type)
    data.load_manifest(corpus)  # a clear message when the corpus is missing, on every rank
    problems = main_decides(lambda: data.verify_corpus(corpus), info)
    if problems:
        raise UserError(f"corpus {corpus} does not match its manifest: " + "; ".join(problems))

    training = build_training(settings, info, corpus=corpus)
    resume_path = main_decides(lambda: find_resume_checkpoint(out, invocation.resume, tidy=True), info)
    if resume_path is not None:
        training.load(load_checkpoint_file(resume_path), resume_path)
        log(info, f"resumed from {resume_path} at step {training.step}/{training.total_steps} (state verified)"
                  + (f"; its weights first came from {training.lineage['source']}" if training.lineage else ""))
        init_from = invocation.init_from
        if init_from is not None and (training.lineage or {}).get("source") != init_from and info.is_main:
            print(f"warning: --init-from {init_from} is not used: {out} already holds a run, resumed from "
                  f"{resume_path} (use a new --out to start a run from {init_from})", file=sys.stderr, flush=True)
    elif invocation.init_from is not None:
        training.init_from(read_init_source(invocation.init_from))  # every rank reads the same file
        lineage = training.lineage
        log(info, f"initialized from {lineage['source']} ({lineage['kind']}, step {lineage['step']}, sha256 "
                  f"{lineage['sha256'][:12]}); optimizer, schedule and data order start fresh")
    settings = training.settings()
    tensorboard = report.TensorBoardLogger(out / "tensorboard", enabled=session.tensorboard and info.is_main)
    metrics = report.MetricsLog(out / "metrics.jsonl", enabled=info.is_main, tensorboard=tensorboard)
    checkpointer = Checkpointer(out / "checkpoints", training.run_id, session.keep_last, session.keep_every,
                                backup=backup, backup_wait_s=backup_wait_s) if info.is_main else None
    if info.is_main:
        if resume_path is not None:
            checkpointer.start_timeline(resume_path, training.step)
        metrics.truncate_after(training.step)
        atomic_write_json(out / "training_settings.json", {**settings, "run_id": training.run_id,
                                                           "parameters": model_config.parameter_count(
                                                               training.preset, training.vocab_size),
                                                           "flops_per_token": training.flops_per_token})
    peak = None
    if info.is_main:
        peak, source = hardware.peak_flops(info.device, training.precision, session.peak_tflops)
        atomic_write_json(out / "hardware.json", {**hardware.machine_record(info.device, info.world,
                                                                            training.precision, training.sdpa),
                                                  "peak_flops": peak, "peak_flops_source": source})
    log(info, f"{model_config.parameter_count(training.preset, training.vocab_size):,} parameters, "
              f"{training.tokens_per_step:,} tokens/step, {training.total_steps} steps, {training.precision}, "
              f"world size {info.world} on {training.hardware.label()}")
    log(info, f"  {training.precision_choice.reason}; attention: {training.sdpa}; Muon's Newton-Schulz in "
              f"{hardware.newton_schulz_dtype(training.hardware)}")
    empty = [name for name in ("validation", "test") if training.splits[name].blocks == 0]
    if empty and info.is_main:
        print(f"warning: the corpus has no {' or '.join(empty)} blocks of {training.context} tokens: no "
              f"{' and no '.join(f'{name} loss' for name in empty)} will be measured (rebuild the corpus with "
              "more documents or a larger --val-fraction / --test-fraction)", file=sys.stderr, flush=True)
    if training.sampler.global_batch > training.sampler.blocks and info.is_main:
        print(f"warning: one step reads {training.sampler.global_batch} blocks but the train split has only "
              f"{training.sampler.blocks} of {training.context} tokens: every step covers more than an epoch "
              "(use a smaller --batch-size or --grad-accum, or a larger corpus)", file=sys.stderr, flush=True)
    log(info, training.recipe.describe())
    if training.recipe_reasons:
        log(info, "  chosen by the rules (docs/recipe.md): " + "; ".join(training.recipe_reasons))
    if info.is_main:
        for warning in recipe_warnings(training.recipe):
            print(f"warning: {warning}", file=sys.stderr, flush=True)

    progress = report.Progress(training.total_steps, training.step, session.log_every, enabled=info.is_main)
    stop = StopRequest()
    stop.install()  # until the final status is written: a second Ctrl-C then still records store.FAILED
    if info.is_main:  # only now: from here on a SIGTERM or Ctrl-C ends the run with a checkpoint
        store.write_status(out, store.RUNNING, step=training.step, total_steps=training.total_steps)
    try:
        try:
            status, reason = train_loop(training, checkpointer, metrics, stop, peak, process_started, progress)
        finally:
            progress.close()
            tensorboard.close()
        stop.loop_ended = True
        finish_run(training, out, checkpointer, metrics, status, reason, stop)
    except (NonFiniteLoss, CheckpointWriteFailed, OSError) as error:
        if isinstance(error, OSError) and not error.errno:
            fail_run(info, out, checkpointer, training, f"{type(error).__name__}: {error}")
            raise
        error = os_error_text(error) if isinstance(error, OSError) else error
        fail_run(info, out, checkpointer, training, str(error))
        last = store.latest_checkpoint_name(out)
        kept = f"the last good checkpoint, {last}, is intact" if last else "no checkpoint had been written yet"
        raise UserError(f"training failed: {error}; {kept} "
                        f"(status {store.FAILED} in {out / 'run_status.json'})") from None
    except torch.OutOfMemoryError:  # torch.cuda.OutOfMemoryError too
        advice = out_of_memory_advice(training)
        fail_run(info, out, checkpointer, training, advice)
        last = store.latest_checkpoint_name(out)
        kept = f"the last good checkpoint, {last}, is intact" if last else "no checkpoint had been written yet"
        raise UserError(f"{advice}; {kept} (status {store.FAILED} in {out / 'run_status.json'})") from None
    except KeyboardInterrupt:  # a second Ctrl-C
        command = resume_command(info, invocation.argv)
        reason = fail_run(info, out, checkpointer, training,
                          lambda: interrupted_reason(out, training.step, command))
        if reason:
            print(reason, file=sys.stderr, flush=True)
        elif info.is_main:  # the stop was already recorded as resumable (or complete): it stays true
            recorded = read_json(out / "run_status.json").get("status")
            print(f"interrupted again after the run recorded {recorded}; continue with: {command}",
                  file=sys.stderr, flush=True)
        raise
    except RuntimeError as error:
        cause = lost_rank_cause(error, info.world)
        if cause is not None:
            raise stop_for_lost_rank(training, out, checkpointer, cause, stop) from None
        fail_run(info, out, checkpointer, training, f"{type(error).__name__}: {error}")
        if session.deterministic and "does not have a deterministic implementation" in str(error):
            raise UserError(f"--deterministic: {str(error).splitlines()[0].split(', but you set')[0]}; this "
                            "run cannot be deterministic on this device: resume without --deterministic "
                            "(a session setting)") from None
        raise
    except BaseException as error:
        fail_run(info, out, checkpointer, training, f"{type(error).__name__}: {error}")
        raise
    finally:
        stop.restore()
    return 0


def train_loop(training: Training, checkpointer: Checkpointer | None, metrics: report.MetricsLog, stop: StopRequest,
               peak: float | None, process_started: float, progress: report.Progress) -> tuple[str, str | None]:
    """Step until done or asked to stop; returns the final (status, reason)."""
    session, info = training.session, training.info
    out = Path(session.out)
    last_save = time.monotonic()
    slowest_step = slowest_eval = 0.0
    if session.stop_after_steps and session.stop_after_steps <= training.step < training.total_steps:
        reason = (f"the run was already at step {training.step}, at or past --stop-after-steps "
                  f"{session.stop_after_steps}: no step taken")
        progress.write(reason)
        return store.NEEDS_RESUME, reason
    if training.step >= training.total_steps:  # e.g. the same command again after the run completed
        progress.write(f"the run was already complete at step {training.step}/{training.total_steps}: no step "
                       "taken; the test evaluation and the report are made again (a longer run: a larger "
                       "--target-tokens or --epochs, docs/stages.md)")
    while training.step < training.total_steps:
        if checkpointer is not None:
            checkpointer.check()
        result = training.train_step()
        if not result.applied:
            progress.write(f"fp16 overflow: step {result.step + 1} skipped (scale lowered), retrying")
            continue
        step = result.step
        slowest_step = max(slowest_step, result.seconds)
        tokens_per_second = training.tokens_per_step / result.seconds
        mfu = training.flops_per_token * tokens_per_second / (peak * info.world) if peak else None
        if mfu is not None and mfu > 1:
            peak, mfu = plausible_mfu(training, peak, mfu)
        progress.update(step, result.loss, tokens_per_second, mfu)
        logged = step % session.log_every == 0 or step == 1 or step == training.total_steps
        if logged:
            log_train_step(training, metrics, result, tokens_per_second, mfu)

        best = None
        if (session.eval_every and step % session.eval_every == 0) or step == training.total_steps:
            eval_started = time.monotonic()
            best = run_validation(training, metrics, progress)
            if info.is_main and session.report:
                report.draw_loss_curve(out, progress)
            slowest_eval = max(slowest_eval, time.monotonic() - eval_started)

        elapsed = time.monotonic() - process_started
        margin = 2 * slowest_step + 2 * slowest_eval + 2 * (checkpointer.last_write_seconds if checkpointer else 0)
        out_of_time = bool(session.max_hours) and elapsed + margin + 10 >= session.max_hours * 3600
        stop_now, save_by_time = agree([stop.requested or out_of_time, bool(session.save_seconds) and
                                        time.monotonic() - last_save >= session.save_seconds], info)
        stop_now = (stop_now or bool(session.stop_after_steps and step >= session.stop_after_steps)) \
            and step < training.total_steps  # at the last step the run is complete anyway
        due = (session.save_every and step % session.save_every == 0) or step == training.total_steps
        if stop_now or due or save_by_time or best is not None:
            save_checkpoint(training, checkpointer, best)
            last_save = time.monotonic()
        if stop_now:
            if not logged:  # metrics.jsonl ends with the step the run stopped at
                log_train_step(training, metrics, result, tokens_per_second, mfu)
            why = stop.signal_name or ("--max-hours budget" if out_of_time else
                                       f"--stop-after-steps {session.stop_after_steps}")
            return store.NEEDS_RESUME, f"stopped by {why}"
    return store.COMPLETE, None


def log_train_step(training: Training, metrics: report.MetricsLog, result: StepResult, tokens_per_second: float,
                   mfu: float | None) -> None:
    """A train record in metrics.jsonl and the store.RUNNING status (the progress bar shows the step)."""
    metrics.write("train", step=result.step, tokens=result.step * training.tokens_per_step, loss=result.loss,
                  lr=result.lr, grad_norm=result.grad_norm, step_seconds=result.seconds,
                  tokens_per_second=tokens_per_second, mfu=mfu,
                  peak_memory_bytes=hardware.peak_memory_bytes(training.device))
    if training.info.is_main:
        store.write_status(Path(training.session.out), store.RUNNING, step=result.step,
                           total_steps=training.total_steps, tokens=result.step * training.tokens_per_step,
                           loss=result.loss)


def run_validation(training: Training, metrics: report.MetricsLog, progress: report.Progress) -> float | None:
    """Validation loss now; returns it when it is the best so far (the save then records it)."""
    result = training.evaluate("validation")
    if result is None:
        return None
    step = training.step
    training.metrics.last_eval = {"step": step, **result}
    metrics.write("eval", step=step, tokens=step * training.tokens_per_step, val_loss=result["loss"],
                  val_perplexity=result["perplexity"], val_tokens=result["tokens"],
                  val_bits_per_byte=result["bits_per_byte"], val_bytes=result["bytes"])
    progress.write(f"step {step}: validation loss {result['loss']:.4f}, perplexity {result['perplexity']:.2f}"
                   f"{report.bits_per_byte_text(result)}")
    if result["loss"] < training.metrics.best_val_loss:
        training.metrics.best_val_loss, training.metrics.best_step = result["loss"], step
        return result["loss"]
    return None


def save_checkpoint(training: Training, checkpointer: Checkpointer | None, best_val_loss: float | None) -> None:
    """Snapshot on every rank (RNG is gathered), write on rank 0 in the background."""
    if checkpointer is not None and checkpointer.last_saved_step == training.step and best_val_loss is None:
        return
    if checkpointer is not None:
        checkpointer.wait()  # the staging buffers still feed the previous write until it is done
    snapshot = training.snapshot()
    if checkpointer is not None:
        checkpointer.save(snapshot, training.step, best_val_loss)


class StopRequest:
    """SIGTERM/SIGINT set a flag; the loop finishes its step, saves and stops. A second SIGINT aborts."""

    def __init__(self):
        self.requested = False
        self.loop_ended = False  # set once no step is left to take: a signal then only ends the report sooner
        self.signal_name = ""
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
        self.signal_name = signal.Signals(signum).name
        if self.signalled_at is None:
            self.signalled_at = time.monotonic()
        what = ("training has already ended; finishing the run's status and report, then exiting" if self.loop_ended
                else "finishing this step, saving, then stopping")
        print(f"{self.signal_name}: {what}", file=sys.stderr, flush=True)


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


# Signs in a collective's error that the other side is gone (gloo says so in a plain RuntimeError).
LOST_RANK_SIGNS = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Timed out waiting")


def lost_rank_cause(error: BaseException, world: int) -> str | None:
    """The short cause when `error` is a collective failing because another rank died or hangs, else None."""
    text = str(error).strip()
    if world == 1 or not (isinstance(error, dist.DistError) or any(sign in text for sign in LOST_RANK_SIGNS)):
        return None
    first = re.sub(r"^\[[^\]]*\] ", "", text.splitlines()[0] if text else type(error).__name__)  # gloo's file:line
    return first.split(". This is typically")[0][:200]


def stop_for_lost_rank(training: Training, out: Path, checkpointer: Checkpointer | None, cause: str,
                       stop: StopRequest) -> UserError:
    """The end of a rank whose peer is gone: rank 0 records where the run stands (resumable from the last
    good checkpoint) at once, before torchrun's SIGKILL; the error to raise says what happened."""
    info = training.info
    failed_at = stop.signalled_at or time.monotonic()
    who = f"rank {1 - info.rank}" if info.world == 2 else "another rank"
    reason = f"{who} stopped ({cause}); this rank exits too"
    command = resume_command(info, training.invocation.argv)
    # a final status already written (the peer went in the last barrier, after the report) stays: it is true
    final = info.is_main and read_json_or(out / "run_status.json", {}).get("status") in (store.COMPLETE,
                                                                                        store.NEEDS_RESUME)
    if info.is_main and not final:
        with contextlib.suppress(Exception):
            checkpointer.wait()  # a write in flight holds good state: finish it
        last = store.latest_checkpoint_name(out)
        record = {"reason": reason, "step": training.step, "total_steps": training.total_steps,
                  "last_checkpoint": last, "resume_command": command, "backup_complete": None}
        status = store.NEEDS_RESUME if last else store.FAILED
        store.write_status(out, status, **record)
        with contextlib.suppress(Exception):
            wait_for_backup(checkpointer, out, status, record, since=failed_at)
    return UserError(f"{reason}; resume with: {command}")


def wait_for_backup(checkpointer: Checkpointer, out: Path, status: str, record: dict,
                    since: float | None) -> None:
    """Wait for the last checkpoint's upload (capped by stop_wait_seconds after a signal `since` then),
    then record in the status whether it reached the remote."""
    if checkpointer.backup is None:
        return
    elapsed = 0.0 if since is None else time.monotonic() - since
    wait = stop_wait_seconds(checkpointer.backup_wait_s, since is not None, "TORCHELASTIC_RUN_ID" in os.environ,
                             elapsed, torchrun_grace_seconds(os.environ))
    record["backup_complete"] = checkpointer.close(wait)
    store.write_status(out, status, **record)


def agree(flags: list[bool], info: DistInfo) -> list[bool]:
    """Each flag true on any rank -> true on all ranks (one all_reduce)."""
    tensor = torch.tensor([float(flag) for flag in flags], device=info.device)
    return [bool(value > 0) for value in all_reduce_sum(tensor, info).tolist()]


# ----------------------------------------------------------------------------------------------
# The run's lifecycle: its folder, status and metrics files, the end of a run, the report and export.


def check_run_folder(out: Path) -> None:
    """Refuse an --out that is a corpus, a file, or a folder of other files (an empty or new folder is fine)."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file, not a run folder; choose a new --out")
    if not out.is_dir():
        return
    if (out / data.CORPUS_MANIFEST).exists():
        raise UserError(f"--out {out} is a corpus folder ({data.CORPUS_MANIFEST}), not a run folder; "
                        "choose a new --out")
    if any(out.iterdir()) and not any((out / name).exists() for name in RUN_FOLDER_MARKERS):
        raise UserError(f"--out {out} holds files but is not a tinyllm run folder (no training_settings.json, "
                        "run_status.json or checkpoints/); choose a new or empty --out")


def lock_run_folder(out: Path):
    """An exclusive lock on RUN/.lock (the open file; the kernel drops it when the process dies)."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        handle = open(out / ".lock", "a+", encoding="utf-8")
    except OSError as error:
        raise UserError(f"--out {out} cannot be written: {os_error_cause(error)}") from None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        pid = handle.read().strip() or "unknown"
        handle.close()
        raise UserError(f"run folder {out} is in use by another train.py (pid {pid})") from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    return handle


@contextlib.contextmanager
def claim_run_folder(out: Path, info: DistInfo):
    """Rank 0 checks --out and holds its lock for the whole run; every rank learns of a refusal."""
    held = {}

    def claim() -> None:
        check_run_folder(out)
        held["new"] = not out.exists()
        held["lock"] = lock_run_folder(out)
        remove_temporaries(out)  # of a restore, a report or an export killed half-way (checkpoints/: the plan's)

    main_decides(claim, info)
    try:
        yield
    finally:
        if "lock" in held:
            held["lock"].close()
            if held["new"] and [path.name for path in out.iterdir()] == [".lock"]:  # refused before it began
                with contextlib.suppress(OSError):
                    (out / ".lock").unlink()
                    out.rmdir()


def prepare_corpus(settings: Settings) -> Path:
    """The local corpus folder: the demo's, built if missing; a --data URL pulled once; else --data as is."""
    data_option = settings.session.data
    if settings.invocation.demo:
        corpus = Path(data_option)
        if not (corpus / data.CORPUS_MANIFEST).is_file():
            print(f"demo: building the demo corpus in {corpus} (python data.py --demo --out {corpus})", flush=True)
            data.build_demo_corpus(corpus)
        return corpus
    if "://" in data_option and not data_option.startswith("file://"):
        url = data_option.rstrip("/")
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", url.rsplit("/", 1)[-1]) or "corpus"
        cache = Path(data.PULLED_CORPORA) / f"{name}-{hashlib.sha256(url.encode()).hexdigest()[:8]}"
        return checkpoint_cloud.local_corpus(data_option, cache)
    corpus = Path(data_option.removeprefix("file://"))
    data.check_corpus_folder(corpus)
    return corpus


def interrupted_reason(out: Path, step: int, command: str) -> str:
    """What run_status.json says after a second Ctrl-C: where the run stands and how to continue."""
    latest = store.latest_checkpoint_name(out)
    where = f"the last checkpoint is {out / 'checkpoints' / latest}" if latest else "no checkpoint was saved yet"
    return f"aborted by the user (second interrupt) at step {step}; {where}; continue with: {command}"


def fail_run(info: DistInfo, out: Path, checkpointer: Checkpointer | None, training: Training,
             reason: str | Callable[[], str]) -> str | None:
    """Record store.FAILED (rank 0); checkpoints already queued are finished first (they hold good state).

    `reason` may be a function, called once they are: it can then name the last checkpoint. A final
    status already written (store.COMPLETE, or resumable, before the report) is kept: it is true.
    """
    if not info.is_main:
        return None
    with contextlib.suppress(Exception):
        checkpointer.close()
    with contextlib.suppress(Exception):
        if read_json(out / "run_status.json").get("status") in (store.COMPLETE, store.NEEDS_RESUME):
            return None
    reason = reason() if callable(reason) else reason
    store.write_status(out, store.FAILED, reason=reason, step=training.step, total_steps=training.total_steps,
                 last_checkpoint=store.latest_checkpoint_name(out))
    return reason


def out_of_memory_advice(training: Training) -> str:
    """hardware.out_of_memory_advice for this run: its model, micro-batch, precision and card."""
    run, session = training.run, training.session
    return hardware.out_of_memory_advice(run.preset, training.preset, training.vocab_size, session.batch_size,
                                         session.grad_accum, training.context, training.precision,
                                         training.recipe.optimizer, session.grad_checkpoint, training.hardware)


def finish_run(training: Training, out: Path, checkpointer: Checkpointer | None, metrics: report.MetricsLog,
               status: str, reason: str | None, stop: StopRequest | None = None) -> dict | None:
    """The end of a run: test evaluation when complete, checkpoints flushed, the final status, then the report.

    The status is written before the report (plots, samples, accuracy, export) and again after it,
    so nothing the report does can lose the run; its failures are recorded in `report_errors`.
    """
    info = training.info
    test = training.evaluate("test") if status == store.COMPLETE else None
    if test is not None:
        metrics.write("test", step=training.step, tokens=training.step * training.tokens_per_step,
                      test_loss=test["loss"], test_perplexity=test["perplexity"],
                      test_bits_per_byte=test["bits_per_byte"], test_bytes=test["bytes"])
        log(info, f"test loss {test['loss']:.4f}, perplexity {test['perplexity']:.2f}{report.bits_per_byte_text(test)}")
    if not info.is_main:
        dist.barrier()  # rank 0 writes the status and the report; then all ranks tear down together
        return None
    try:
        return finish_on_main(training, out, checkpointer, status, reason, test, stop)
    finally:
        if info.world > 1:
            dist.barrier()


def finish_on_main(training: Training, out: Path, checkpointer: Checkpointer, status: str, reason: str | None,
                   test: dict | None, stop: StopRequest | None = None) -> dict:
    """finish_run's part on rank 0: the status as soon as the last checkpoint is on disk, then the backup
    (the status again), the report, the last line.

    After a signal under torchrun, SIGKILL follows within its grace period: the status naming the
    checkpoint is written first, and the wait for the upload fits what is left (stop_wait_seconds)."""
    info, session = training.info, training.session
    checkpointer.wait()
    record = {
        "step": training.step,
        "total_steps": training.total_steps,
        "tokens": training.step * training.tokens_per_step,
        "reason": reason,
        "last_checkpoint": store.latest_checkpoint_name(out),
        "best_val_loss": training.metrics.best_val_loss if math.isfinite(training.metrics.best_val_loss) else None,
        "validation": training.metrics.last_eval,
        "test": test,
        "test_loss": test["loss"] if test else None,
        "train_loss": report.last_train_loss(out),
        "backup_complete": None,  # null until the upload wait below ends (or with no backup)
    }
    if status == store.NEEDS_RESUME:
        record["resume_command"] = resume_command(info, training.invocation.argv)
    store.write_status(out, status, **record)
    wait_for_backup(checkpointer, out, status, record, since=stop.signalled_at if stop else None)
    if session.report:
        record.update(report_run(training, out, status, test))
        store.write_status(out, status, **record)
    if checkpointer.backup is not None:
        checkpointer.backup.push_run_files(out)  # the final run_status.json too, not the one of the last save
        checkpointer.backup.close()
    log(info, report.final_line(out, status, record))
    return record


def report_run(training: Training, out: Path, status: str, test: dict | None) -> dict:
    """Loss curve, samples, held-out accuracy and RUN/model (rank 0). Failures are recorded, never raised.

    Samples and accuracy only for a complete run; a resumable stop exports the current weights
    (the model card says the run is unfinished).
    """
    errors: dict[str, str] = {}
    corpus = training.corpus

    def attempt(name: str, function):
        try:
            return function()
        except Exception as error:  # the checkpoint is safe; a report failure must not lose the run
            errors[name] = f"{type(error).__name__}: {error}"
            print(f"warning: {name} failed ({errors[name]}); the checkpoints are intact", file=sys.stderr,
                  flush=True)
            return None

    found = {}
    tokenizer = attempt("tokenizer", lambda: data.load_tokenizer(corpus / "tokenizer"))
    attempt("loss_curve", lambda: report.plot_loss_curve(out / "metrics.jsonl", out / "loss_curve.png",
                                                         title=out.name))
    accuracy = None
    if status == store.COMPLETE and tokenizer is not None:
        # the demo's arithmetic prompts for the demo; else prompts that fit the corpus: its held-out
        # chats' first questions, or the openings of its held-out texts to continue
        kind, prompts = ("chat", report.DEFAULT_PROMPTS) if (corpus / "eval").is_dir() else \
            attempt("sample_prompts", lambda: report.held_out_prompts(corpus, tokenizer)) or ("chat", [])
        samples = report.generate_samples(training.model, tokenizer, out / "sample_generations.json",
                                          prompts=prompts, step=training.step, text=kind == "text")
        if samples["error"]:
            errors["samples"] = samples["error"]
        if (corpus / "eval").is_dir():
            accuracy = attempt("task_accuracy", lambda: report.task_accuracy(training.model, tokenizer,
                                                                             corpus / "eval", training.device))
        if accuracy is not None:
            found["task_accuracy"] = {key: accuracy[key] for key in ("accuracy", "correct", "total", "by_task")}
            print(report.accuracy_line(accuracy), flush=True)
    if tokenizer is not None:
        info = report.card_info(out.name, status, training.run.preset, training.step, training.total_steps,
                         training.step * training.tokens_per_step, training.settings(),
                         training.metrics.last_eval, test, found.get("task_accuracy"))
        model_files = attempt("export", lambda: export_model(training.model, tokenizer, out / "model", info))
        if model_files is not None:
            found["model_files"] = model_files
            found["model_dir"] = str(out / "model")
    found["report_errors"] = errors or None
    return found


def export_model(model: torch.nn.Module, tokenizer, folder: Path, info: dict) -> dict[str, str]:
    """RUN/model/ as transformers loads it anywhere: KV cache on, the standard SDPA attention."""
    config = model.config
    use_cache, attention = config.use_cache, config._attn_implementation
    config.use_cache = True
    if attention in model_config.OWN_ATTENTIONS:
        model.set_attn_implementation("sdpa")
    try:
        return report.export_hf_model(model, tokenizer, folder, info)
    finally:
        config.use_cache = use_cache
        if attention in model_config.OWN_ATTENTIONS:
            model.set_attn_implementation(attention)


def export_only(settings: Settings, info: DistInfo) -> int:
    """--export-only: OUT/model/ from the --resume checkpoint, without training (rank 0 only), holding
    the run folder's lock: a training run that owns the folder writes its model/ itself."""
    if not info.is_main:
        return 0
    out = Path(settings.session.out)
    new = not out.exists()
    lock = lock_run_folder(out)
    try:
        return export_checkpoint(settings, info)
    finally:
        lock.close()
        if new and [path.name for path in out.iterdir()] == [".lock"]:  # refused: leave no folder behind
            with contextlib.suppress(OSError):
                (out / ".lock").unlink()
                out.rmdir()


def export_checkpoint(settings: Settings, info: DistInfo) -> int:
    """export_only's work, under the lock."""
    out = Path(settings.session.out)
    path = find_resume_checkpoint(out, settings.invocation.resume)
    if path is None:
        raise UserError(f"--export-only needs a checkpoint: --resume PATH, or an --out whose checkpoints/ has one "
                        f"(none in {out / 'checkpoints'})")
    checkpoint = load_checkpoint_file(path)
    recorded = checkpoint["settings"]
    training = recorded["training"]
    corpus = Path(recorded["runtime"]["data"]) if settings.invocation.demo else prepare_corpus(settings)
    manifest = data.load_manifest(corpus)
    tokenizer = data.load_tokenizer(corpus / "tokenizer")
    if manifest.get("tokenizer_sha256") != training["tokenizer_sha256"]:
        raise UserError(f"the tokenizer of {corpus} is not the one checkpoint {path} was trained with; "
                        "pass that corpus with --data")
    preset = model_config.Preset(**{name: training[f"model.{name}"] for name in model_config.OVERRIDABLE_FIELDS})
    specials = manifest.get("special_tokens", {})
    model = model_config.build_model(preset, training["vocab_size"], pad_token_id=specials.get("<pad>", 0),
                                     bos_token_id=specials.get("<bos>", 1), eos_token_id=specials.get("<eos>", 2))
    model.load_state_dict(checkpoint["model"])
    model.to(info.device).eval()
    step, total = int(checkpoint["step"]), int(training["total_steps"])
    status = store.COMPLETE if step >= total else store.NEEDS_RESUME
    previous = read_json(out / "run_status.json") if (out / "run_status.json").is_file() else {}
    test = previous.get("test") if previous.get("step") == step else None
    accuracy = None
    if (corpus / "eval").is_dir():
        result = report.task_accuracy(model, tokenizer, corpus / "eval", info.device)
        accuracy = {key: result[key] for key in ("accuracy", "correct", "total", "by_task")}
        print(report.accuracy_line(result), flush=True)
    info_card = report.card_info(out.name, status, training["preset"], step, total,
                          step * int(training["tokens_per_step"]), recorded,
                          checkpoint.get("metrics", {}).get("last_eval"), test, accuracy)
    model_files = export_model(model, tokenizer, out / "model", info_card)
    print(f"exported {path} (step {step}/{total}, {status}) to {out / 'model'}: "
          + ", ".join(f"{name} {sha[:12]}" for name, sha in model_files.items() if name.endswith(".safetensors")),
          flush=True)
    return 0


def python_command() -> str:
    """`python` when that is this interpreter on PATH, else this interpreter's path (a venv's python
    started by its path: the `python` on PATH may have no torch)."""
    on_path = shutil.which("python")
    if on_path and os.path.realpath(on_path) == os.path.realpath(sys.executable):
        return "python"
    return shlex.quote(sys.executable)


def resume_command(info: DistInfo, argv: list[str] | None = None) -> str:
    """This run's command line with `--resume auto` and without `--stop-after-steps`; a --backup-to URL
    is shown as it is, unless it carries credentials: then as URL (which parse_args refuses)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    kept, skip, backup_url_next = [], False, False
    for item in argv:
        if skip:
            skip = False
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
    script_path = Path(__file__).resolve()
    relative = os.path.relpath(script_path)
    script = shlex.quote(str(script_path) if relative.startswith("..") else relative)  # run from the current folder
    if info.world == 1:
        launcher = f"{python_command()} {script}"
    else:
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", info.world))
        nodes = info.world // per_node
        launcher = "torchrun " + (f"--nnodes={nodes} (with your rendezvous options) " if nodes > 1 else "") \
            + f"--nproc_per_node={per_node} {script}"
    return " ".join([launcher, *map(shlex.quote, kept), "--resume", "auto"])


def shown_backup_url(url: str) -> str:
    printable = checkpoint_cloud.printable_backup_url(url)
    return checkpoint_cloud.BACKUP_URL_PLACEHOLDER if printable is None else printable


def log(info: DistInfo, message: str) -> None:
    if info.is_main:
        print(message, flush=True)


def plausible_mfu(training: Training, peak: float, mfu: float) -> tuple[float, float | None]:
    """(peak, mfu) after an MFU above 100%, which only a peak measured too low gives (a CPU matmul timed
    under other load at the start): the peak is measured again and the higher one kept (and recorded
    in hardware.json); an MFU that is still impossible (a wrong --peak-tflops, say) is not shown."""
    session, info = training.session, training.info
    if info.device.type == "cpu" and not session.peak_tflops:
        measured = hardware.measure_cpu_matmul_flops(training.precision)
        if measured > peak:
            mfu, peak = mfu * peak / measured, measured
            if info.is_main:
                path = Path(session.out) / "hardware.json"
                with contextlib.suppress(UserError, OSError):
                    atomic_write_json(path, {**read_json(path), "peak_flops": peak,
                                             "peak_flops_source": "a CPU matmul measured again during the run "
                                                                  "(the first measurement was slowed by other load)"})
    return peak, (mfu if mfu <= 1 else None)


# ----------------------------------------------------------------------------------------------
# Store glue: torch.save on a background thread around checkpoint_store's rules; backups; --init-from.


class StagingBuffers:
    """CPU copies of a state dict, in buffers reused from one snapshot to the next.

    Copying into memory that is already mapped is several times faster than allocating it
    afresh (no page faults), and that copy is all the training loop waits for. Pinned on CUDA,
    so the device-to-host copies run asynchronously. The caller must not refill the buffers
    while a checkpoint made from them is still being written (Checkpointer.wait first).
    """

    def __init__(self):
        self.buffers: dict[str, torch.Tensor] = {}

    def copy(self, obj: Any) -> Any:
        result = self._copy(obj, "", memo={})
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the asynchronous device-to-host copies are complete
        return result

    def _copy(self, obj: Any, where: str, memo: dict) -> Any:
        if isinstance(obj, torch.Tensor):
            key = (obj.data_ptr(), obj.dtype, tuple(obj.shape), obj.stride(), obj.device)
            if key not in memo:  # tensors shared in the model (tied embeddings) stay shared
                buffer = self.buffers.get(where)
                if buffer is None or buffer.shape != obj.shape or buffer.dtype != obj.dtype:
                    buffer = torch.empty(obj.shape, dtype=obj.dtype, pin_memory=obj.is_cuda)
                    self.buffers[where] = buffer
                buffer.copy_(obj.detach(), non_blocking=obj.is_cuda)
                memo[key] = buffer
            return memo[key]
        if isinstance(obj, dict):
            return {key: self._copy(value, f"{where}/{key}", memo) for key, value in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self._copy(value, f"{where}/{index}", memo) for index, value in enumerate(obj))
        return obj


class CheckpointWriteFailed(UserError):
    """A checkpoint could not be written (a full disk, a read-only folder): the run stops at once."""


def warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


class Checkpointer:
    """Writes checkpoints atomically on a background thread, then latest.json, backup and retention.

    One write is in flight at a time: `save` waits for the previous one, hands over the
    snapshot (already copied to CPU) and returns. Errors from the writer surface at the next
    `save` or `wait`. `backup` (optional) has submit(path, step), is_backed_up(path) -> bool
    and wait(timeout_s) -> bool; retention never deletes a file the backup has not confirmed.
    The names, records and rules are checkpoint_store's; this class adds torch.save and threads.
    """

    def __init__(self, folder: Path, run_id: str, keep_last: int, keep_every: int, backup=None,
                 backup_wait_s: float = 600):
        self.folder, self.run_id = folder, run_id
        self.keep_last, self.keep_every = keep_last, keep_every
        self.backup, self.backup_wait_s = backup, backup_wait_s
        self.folder.mkdir(parents=True, exist_ok=True)
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self.last_write_seconds = 0.0
        self.last_saved_step: int | None = None

    def save(self, snapshot: dict, step: int, val_loss: float | None = None) -> None:
        """Queue `snapshot` for writing as step-{step}.pt (`val_loss`: it is the run's best so far)."""
        self.wait()
        self.last_saved_step = step
        self._thread = threading.Thread(target=self._write, args=(snapshot, step, val_loss),
                                        name=f"checkpoint-{step}", daemon=True)
        self._thread.start()

    def check(self) -> None:
        """Re-raise the error of a write that has already ended (returns at once): a failed save is
        noticed at the next step, not one save later."""
        if self._thread is not None and not self._thread.is_alive():
            self.wait()

    def wait(self) -> None:
        """Block until the write in flight (if any) is on disk; re-raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def close(self, backup_wait_s: float | None = None) -> bool | None:
        """Finish the write in flight, then wait for the backup (up to `backup_wait_s`, None: the
        --backup-wait-seconds given); True/False says if it caught up."""
        self.wait()
        if self.backup is None:
            return None
        caught_up = self.backup.wait(self.backup_wait_s if backup_wait_s is None else backup_wait_s)
        self.apply_retention()  # checkpoints kept only while they waited for their upload may go now
        return caught_up

    def _write(self, snapshot: dict, step: int, val_loss: float | None) -> None:
        name, writer = store.checkpoint_name(step), None
        try:
            started = time.perf_counter()
            with atomic_open(self.folder / name, "wb") as handle:
                writer = store.HashingWriter(handle)
                torch.save(snapshot, writer)
                handle.flush()
                record = store.Record(path=name, step=step, sha256=writer.sha256(), bytes=handle.tell(),
                                      run_id=self.run_id, created=utc_now(), val_loss=val_loss)
                # the record goes before the rename: a save killed in between leaves a record without
                # a checkpoint (the next session removes it), never a checkpoint nobody can verify
                store.write_record(self.folder, record)
            store.write_record(self.folder, record, store.LATEST)
            if self.backup is not None:
                self.backup.submit(self.folder / name, step)
            self.apply_retention()
            self.last_write_seconds = time.perf_counter() - started
        except BaseException as error:  # surfaced on the training thread at the next step (check) or save
            cause = writer.os_error if writer is not None and writer.os_error is not None else error
            if isinstance(cause, OSError) and cause.errno:
                where = cause.filename or self.folder / name
                error = CheckpointWriteFailed(f"writing checkpoint {os_error_text(cause, where)}")
            self._error = error

    def start_timeline(self, resumed_from: Path, step: int) -> None:
        """Make the checkpoint this session continues from (at `step`) the newest one of the folder
        (store.plan_timeline: a rewind moves the newer ones, and other runs', to abandoned-STEP/)."""
        here = resumed_from.parent.resolve() == self.folder.resolve()
        plan = store.plan_timeline(store.list_folder(self.folder), resumed_from.name if here else None, step,
                                   self.run_id)
        for message in plan.warnings:
            warn(message)
        store.apply_timeline(self.folder, plan)
        if plan.rewound and plan.latest is not None and self.backup is not None:
            # the remote latest.json still names the abandoned timeline: upload the resumed checkpoint
            # again now, which points it back here (a fresh disk must not restore the timeline left)
            self.backup.submit(resumed_from, step)

    def apply_retention(self) -> None:
        """Delete what store.retention_deletions names, once the backup (if any) lets each go:
        `backup.deletable(paths)` when the backup has it, else `backup.is_backed_up(path)`."""
        listing = store.list_folder(self.folder)
        candidates = [self.folder / name for name in
                      store.retention_deletions(listing, self.run_id, self.keep_last, self.keep_every)]
        if self.backup is not None and candidates:
            if hasattr(self.backup, "deletable"):
                allowed = {Path(path).resolve() for path in self.backup.deletable(candidates)}
                candidates = [path for path in candidates if path.resolve() in allowed]
            else:
                candidates = [path for path in candidates if self.backup.is_backed_up(path)]
        store.delete(self.folder, [path.name for path in candidates])


def find_resume_checkpoint(out: Path, resume: str, tidy: bool = False) -> Path | None:
    """The checkpoint `--resume` asks for (store.plan_resume): None for a fresh start.

    `tidy` (a training session, which holds the run folder's lock) first carries out the plan:
    removes what killed saves left behind and sets aside the damaged checkpoints; without it
    nothing changes.
    """
    folder = out / "checkpoints"
    if resume not in ("auto", "none") and not Path(resume).is_file():
        raise UserError(f"--resume {resume}: no such checkpoint file")
    plan = store.plan_resume(store.list_folder(folder), resume)
    if tidy:
        if plan.delete:
            print(f"removed what interrupted saves left in {folder}: {', '.join(plan.delete)}", file=sys.stderr,
                  flush=True)
        store.apply_plan(folder, plan)
    for message in plan.warnings:
        warn(message)
    if plan.error:
        raise UserError(f"{folder} {plan.error}")
    if resume not in ("auto", "none"):
        path = Path(resume)
        problem = store.file_mismatch(path)
        if problem:
            warn(f"--resume {path}: {problem}; loading it anyway, as asked (the state is checked against this "
                 "file, not against the record)")
        return path
    return folder / plan.load if plan.load else None


def load_checkpoint_file(path: Path) -> dict:
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # truncated zip, wrong format, unsafe pickle ...
        raise UserError(f"checkpoint {path} does not load: {type(error).__name__}: {error}") from None
    for key in ("format_version", "step", "model", "optimizer", "settings"):
        if key not in checkpoint:
            raise UserError(f"checkpoint {path} lacks {key!r}")
    if checkpoint["format_version"] != FORMAT_VERSION:
        raise UserError(f"checkpoint {path} has format_version {checkpoint['format_version']}, "
                        f"this train.py reads {FORMAT_VERSION}")
    return checkpoint


def tensors_equal(live: Any, stored: Any, where: str) -> list[str]:
    """Names of the entries where `live` differs from `stored` (tensors bitwise, the rest by ==)."""
    if isinstance(live, torch.Tensor) or isinstance(stored, torch.Tensor):
        same = (isinstance(live, torch.Tensor) and isinstance(stored, torch.Tensor)
                and live.dtype == stored.dtype and torch.equal(live.detach().cpu(), stored))
        return [] if same else [where]
    if isinstance(live, dict) and isinstance(stored, dict):
        if set(live) != set(stored):
            return [f"{where} keys"]
        return [item for key in live for item in tensors_equal(live[key], stored[key], f"{where}.{key}")]
    if isinstance(live, (list, tuple)) and isinstance(stored, (list, tuple)):
        if len(live) != len(stored):
            return [f"{where} length"]
        return [item for i, (a, b) in enumerate(zip(live, stored)) for item in tensors_equal(a, b, f"{where}[{i}]")]
    return [] if live == stored else [where]


def restore_from_backup(url: str, out: Path) -> Path | None:
    """With no checkpoint in OUT that verifies, download the backup's newest verified one (rank 0)."""
    folder = out / "checkpoints"
    if store.newest_verified(store.list_folder(folder)) is not None:
        return None
    return checkpoint_cloud.restore_latest(url, folder)


def start_backup(session: SessionSettings, info: DistInfo):
    """The background checkpoint backup on rank 0 (None without --backup-to); an error stops every rank."""
    started = {}

    def start() -> None:
        started["backup"] = checkpoint_cloud.backup_from_args(session, session.save_every or None)

    main_decides(start, info)
    return started.get("backup")


@dataclass
class InitSource:
    """Weights to start from and where they came from (`lineage`, recorded with the run)."""

    state: dict
    lineage: dict  # {"source", "kind", "path", "sha256", "step", "corpus_manifest_sha256", "vocabulary_sha256"}
    tokenizer_sha256: str | None = None  # a checkpoint's tokenizer folder hash (older checkpoints: the only clue)
    model_settings: dict | None = None  # a checkpoint's model.* settings, for the message on a shape mismatch


def read_init_source(spec: str) -> InitSource:
    """The weights --init-from names (UserError, naming SOURCE, when it is none of the three kinds)."""
    path = Path(spec)
    if not path.exists():
        raise UserError(f"--init-from {spec}: no such file or folder")
    if path.is_dir() and (path / "config.json").is_file():
        return read_hf_source(spec, path)
    if path.is_dir():
        folder = path / "checkpoints" if (path / "checkpoints").is_dir() else path
        listing = store.list_folder(folder)
        if not listing.files:
            raise UserError(f"--init-from {spec}: not a checkpoint, a run folder with checkpoints/ or a Hugging "
                            "Face model folder (no config.json)")
        newest = store.newest_verified(listing)
        if newest is None:
            raise UserError(f"--init-from {spec}: no checkpoint in {folder} verifies against its sha256 record")
        return read_checkpoint_source(spec, folder / newest, "run")
    problem = store.file_mismatch(path)
    if problem:
        raise UserError(f"--init-from {spec}: {problem}")
    return read_checkpoint_source(spec, path, "checkpoint")


def read_checkpoint_source(spec: str, path: Path, kind: str) -> InitSource:
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # truncated zip, wrong format, unsafe pickle ...
        raise UserError(f"--init-from {spec}: {path} does not load: {type(error).__name__}: {error}") from None
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("model"), dict) \
            or "training" not in checkpoint.get("settings", {}):
        raise UserError(f"--init-from {spec}: {path} is not a train.py checkpoint (no model or settings)")
    training = checkpoint["settings"]["training"]
    lineage = {"source": spec, "kind": kind, "path": str(path), "sha256": sha256_file(path),
               "step": checkpoint.get("step"), "corpus_manifest_sha256": training.get("corpus_manifest_sha256"),
               "vocabulary_sha256": checkpoint["settings"].get("vocabulary_sha256")}
    model_settings = {key: value for key, value in training.items() if key.startswith("model.") or
                      key == "vocab_size"}
    return InitSource(checkpoint["model"], lineage, training.get("tokenizer_sha256"), model_settings)


def read_hf_source(spec: str, folder: Path) -> InitSource:
    """A transformers Qwen3 folder (config.json, safetensors weights and the tokenizer)."""
    import transformers

    try:
        config = transformers.AutoConfig.from_pretrained(folder)
    except Exception as error:
        raise UserError(f"--init-from {spec}: config.json does not load: {type(error).__name__}: {error}") from None
    if config.model_type != "qwen3":
        raise UserError(f"--init-from {spec}: a {config.model_type!r} model; tinyllm trains Qwen3 models only")
    try:
        tokenizer = data.load_tokenizer(folder)
    except UserError as error:
        raise UserError(f"--init-from {spec}: its tokenizer does not load ({error})") from None
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    except Exception as error:
        raise UserError(f"--init-from {spec}: the weights do not load: {type(error).__name__}: {error}") from None
    weights = folder / "model.safetensors"
    provenance = read_json(folder / "training_provenance.json") if (folder / "training_provenance.json").is_file() \
        else {}
    lineage = {"source": spec, "kind": "huggingface", "path": str(folder),
               "sha256": sha256_file(weights) if weights.is_file() else sha256_tree(folder),
               "step": provenance.get("steps"), "corpus_manifest_sha256": provenance.get("corpus_sha256"),
               "vocabulary_sha256": data.vocabulary_sha256(tokenizer)}
    return InitSource(model.state_dict(), lineage)


def init_mismatch(source: InitSource, model: torch.nn.Module, settings: dict) -> str | None:
    """Why `source` cannot initialize `model` (this run's `settings`): the tokenizer, else the shapes."""
    spec, training = source.lineage["source"], settings["training"]
    ours = settings["vocabulary_sha256"]
    same_folder = source.tokenizer_sha256 is not None and source.tokenizer_sha256 == training["tokenizer_sha256"]
    if not same_folder and source.lineage["vocabulary_sha256"] != ours:
        theirs = source.lineage["vocabulary_sha256"]
        return (f"--init-from {spec}: its tokenizer is not the corpus' (vocabulary and special tokens sha256 "
                f"{(theirs or 'not recorded')[:12]}, the corpus' {(ours or 'not recorded')[:12]}): the token ids would "
                "mean other words; build the corpus with data.py --tokenizer on the source's tokenizer")
    live = model.state_dict()
    problems = [f"{key}: {list(source.state[key].shape)} there, {list(tensor.shape)} here"
                for key, tensor in live.items() if key in source.state and source.state[key].shape != tensor.shape]
    problems += [f"{key}: missing there" for key in live if key not in source.state]
    problems += [f"{key}: not in this model" for key in source.state if key not in live]
    if not problems:
        return None
    if source.model_settings:
        changes = store.settings_changes(source.model_settings,
                                   {key: value for key, value in training.items() if key in source.model_settings})
        if changes:
            problems = [f"{key}: {theirs} there, {ours} here" for key, (theirs, ours) in changes.items()]
    return (f"--init-from {spec}: its shapes do not fit this run's model (choose the source's --preset and model "
            "options): " + "; ".join(problems[:6]) + (f" (and {len(problems) - 6} more)" if len(problems) > 6 else ""))


# ----------------------------------------------------------------------------------------------
# Distributed set-up: torchrun sets RANK, LOCAL_RANK and WORLD_SIZE.


@dataclass
class DistInfo:
    rank: int
    local_rank: int
    world: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device_choice: str = "auto") -> DistInfo:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_choice == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda, but torch sees no CUDA device")
    use_cuda = device_choice == "cuda" or (device_choice == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timedelta(minutes=30),
                                device_id=device if use_cuda else None)
    return DistInfo(rank=rank, local_rank=local_rank, world=world, device=device)


def use_deterministic_kernels(on: bool) -> None:
    """--deterministic: torch's deterministic algorithms, with an op that has none an error (warn_only
    would leave flash and memory-efficient attention their nondeterministic backwards), cuBLAS's fixed
    workspace (read when CUDA makes its first cuBLAS handle) and cuDNN without autotuning. Off: torch's
    defaults again, so one process may train both ways (the tests)."""
    if on:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(on)
    torch.backends.cudnn.deterministic = on
    torch.backends.cudnn.benchmark = False


def shutdown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def broadcast_from_main(obj: Any, info: DistInfo) -> Any:
    """Rank 0's `obj` on every rank (so all ranks take the same decision)."""
    if info.world == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def main_decides(function, info: DistInfo) -> Any:
    """Run `function` on rank 0 and give its result to every rank; a UserError there is raised everywhere."""
    outcome = None
    if info.is_main:
        try:
            outcome = ("ok", function())
        except UserError as error:
            outcome = ("error", str(error))
    kind, value = broadcast_from_main(outcome, info)
    if kind == "error":
        raise UserError(value)
    return value


def all_reduce_sum(tensor: torch.Tensor, info: DistInfo) -> torch.Tensor:
    if info.world > 1:
        dist.all_reduce(tensor)
    return tensor


# ----------------------------------------------------------------------------------------------
# Kernel workarounds: attention implementations for shapes and devices where the stock ones fail.


if __name__ == "__main__":
    run_main(main)
