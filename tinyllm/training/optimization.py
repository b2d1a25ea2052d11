"""The optimization of a run in one place: its options, the optimizer table, the recipe (learning rates,
schedule, knobs), building the optimizers, gradient clipping and the fp16 loss scaler.

- `OPTIMIZERS`: one entry per `--optimizer`: its AdamW lr rule by width, Muon's lr (or none), its default
  warmup, its optimizer state per parameter (hardware.step_memory) and its builder, which says which
  parameters each of its torch optimizers takes and names their param groups. Adding an optimizer is
  one entry and its builder.
- `RecipeOptions`: the recipe's command-line options (train.RunSettings has them as its own fields).
- `Recipe`: everything that shapes the optimization, resolved by `choose_recipe` from the options and
  the rules (measured in bench/bench_recipe.py; the evidence is in docs/recipe.md), recorded with the
  run. A knob (a field with a default: the behaviour before the knob existed) is given by its option of
  the same name and read by the builders; a checkpoint recorded before it reads it at that default
  (`with_recorded_defaults`), so an added knob never refuses an older checkpoint.
- `Optimizers`: the run's torch optimizers as one piece of checkpoint state; `apply_schedule` sets every
  param group's lr for a step and returns them by group name (metrics.jsonl's NAME_lr).
- `clip_gradients`, `LossScaler` (fp16's GradScaler over the optimizers).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from tinyllm.common import (
    UserError,
    below_one,
    finite,
    fraction,
    not_negative,
    option,
    option_fields,
    option_flags,
    positive,
)
from tinyllm.model import hardware

DEFAULT_OPTIMIZER = "muon"
SCHEDULES = ("wsd", "cosine")
DEFAULT_SCHEDULE = "wsd"
DEFAULT_DECAY_FRACTION = 0.4
DEFAULT_FINAL_LR_FRACTION = 0.1  # the WSD floor (issue 30's round 2: docs/recipe.md)
DEFAULT_BETA2 = 0.95
MUON_COEFFICIENTS = ("torch", "polar-express")  # muon.Muon's Newton-Schulz coefficients
WEIGHT_DECAY_SCHEDULES = ("constant", "linear")
MOMENTUM_FLOOR = 0.85  # Muon's momentum at the start of a momentum warmup and the end of a cooldown (modded-nanogpt)
MAX_WARMUP_STEPS = 1000
OPTIONS = "optimizer and schedule (None: the recipe rule for this model and run, printed at start; see docs/recipe.md)"


# ----------------------------------------------------------------------------------------------
# The optimizer table: one entry per --optimizer, each with its builder.


@dataclass(frozen=True)
class WidthRule:
    """A peak lr by the model's width: LR x (WIDTH / hidden) ** EXPONENT, at most CAP."""

    lr: float
    width: int
    exponent: float
    cap: float

    def at(self, hidden: int) -> float:
        return min(self.cap, self.lr * (self.width / hidden) ** self.exponent)

    def explain(self, hidden: int) -> str:
        return f"{self.lr:g} x ({self.width} / hidden {hidden})^{self.exponent:g}, at most {self.cap:g}"


class Parameters(NamedTuple):
    """The model's trainable parameters as the optimizers split them (hidden_matrices)."""

    hidden: list[torch.nn.Parameter]  # the 2-D weights inside the decoder layers: attention and MLP projections
    rest: list[torch.nn.Parameter]  # the embedding (a tied LM head too) and norms
    head: list[torch.nn.Parameter]  # an untied LM head (none when tied)


# A builder: (recipe, parameters, device, rank, world, precision) -> {part name: torch optimizer}, each param
# group named by its "name" (the part's name when it has none); the part names are the checkpoint's keys.
Builder = Callable[["Recipe", Parameters, torch.device, int, int, str], dict[str, torch.optim.Optimizer]]


@dataclass(frozen=True)
class OptimizerRule:
    """One --optimizer: its rules (the defaults choose_recipe gives), its memory and its builder."""

    help: str  # what --optimizer NAME trains with
    adamw_lr: WidthRule  # --lr's default: AdamW's peak lr for the parameters AdamW takes
    head_lr: WidthRule | None  # --head-lr's default: an untied LM head's own lr (None: it trains at --lr)
    muon_lr: float | None  # --muon-lr's default (the hidden matrices under Muon); None: no Muon
    muon_momentum: float | None  # --muon-momentum's default; None: no Muon
    beta1: float  # --beta1's default: AdamW's
    warmup_fraction: float  # --warmup-steps' default, a fraction of the run
    state: hardware.OptimizerState  # optimizer state per parameter, for hardware.step_memory
    build: Builder
    own_options: dict[str, str]  # the options only this optimizer reads -> why another one refuses them

    def warmup_steps(self, total_steps: int) -> int:
        """A fixed fraction of the run, at least one step and at most MAX_WARMUP_STEPS."""
        return min(MAX_WARMUP_STEPS, max(1, round(self.warmup_fraction * total_steps)))


def adamw(recipe: Recipe, groups: list[dict], device: torch.device) -> torch.optim.Optimizer:
    """AdamW at the recipe's lr and betas: fused on CUDA and CPU, bitsandbytes' 8-bit with --8bit-adam."""
    if not recipe.adam8bit:
        return torch.optim.AdamW(
            groups, lr=recipe.lr, betas=recipe.betas, eps=1e-8, fused=device.type in ("cuda", "cpu")
        )
    if device.type != "cuda":
        raise UserError("--8bit-adam needs a CUDA device (bitsandbytes); drop it on CPU")
    try:
        import bitsandbytes
    except ImportError:
        raise UserError("--8bit-adam needs bitsandbytes: pip install bitsandbytes") from None
    return bitsandbytes.optim.AdamW8bit(groups, lr=recipe.lr, betas=recipe.betas, eps=1e-8)


def build_muon(
    recipe: Recipe, parameters: Parameters, device: torch.device, rank: int, world: int, precision: str
) -> dict[str, torch.optim.Optimizer]:
    """torch.optim.Muon's rule for the hidden matrices (muon.Muon: Newton-Schulz in the dtype of the device and
    the run's `precision`, split across the `world` ranks), AdamW for the embeddings and norms, never decayed."""
    # here, not at import: a torch without Muon gets hardware.check_torch's message
    from tinyllm.training.muon import Muon

    adamw_groups = [{"params": parameters.rest, "weight_decay": 0.0}]
    if parameters.head and recipe.head_lr is None:
        raise ValueError("the model has an untied LM head but the recipe no head_lr: choose it with tied=False")
    if parameters.head:
        adamw_groups.append({"params": parameters.head, "weight_decay": 0.0, "lr": recipe.head_lr, "name": "head"})
    muon = Muon(
        parameters.hidden,
        ns_dtype=hardware.newton_schulz_dtype(hardware.describe(device), precision),
        rank=rank,
        world=world,
        lr=recipe.muon_lr,
        weight_decay=recipe.weight_decay,
        momentum=recipe.muon_momentum,
        nesterov=True,
        coefficients=recipe.muon_coefficients,
        normuon_beta2=recipe.normuon_beta2,
        cautious_weight_decay=recipe.cautious_weight_decay,
    )
    return {"muon": muon, "adamw": adamw(recipe, adamw_groups, device)}


def build_adamw(
    recipe: Recipe, parameters: Parameters, device: torch.device, rank: int, world: int, precision: str
) -> dict[str, torch.optim.Optimizer]:
    """AdamW for everything, decaying the hidden matrices only."""
    groups = [
        {"params": parameters.hidden, "weight_decay": recipe.weight_decay},
        {"params": parameters.rest + parameters.head, "weight_decay": 0.0},
    ]
    return {"adamw": adamw(recipe, groups, device)}


# AdamW's lr: for every parameter under adamw ~1/width (as muP and the GPT-3 table suggest), for the embeddings
# and norms only under muon ~1/sqrt(width) (as nanochat). Muon's update is orthogonalized (unit spectral norm),
# so one lr fits every width.
OPTIMIZERS = {
    "muon": OptimizerRule(
        help="torch.optim.Muon for the hidden matrices, AdamW for embeddings and norms",
        adamw_lr=WidthRule(0.05, 128, 0.5, 0.1),
        head_lr=WidthRule(0.01, 128, 0.5, 0.1),
        muon_lr=0.02,
        muon_momentum=0.9,
        beta1=0.6,
        warmup_fraction=0.02,
        state=hardware.OptimizerState(hidden=4, rest=8),
        build=build_muon,
        own_options={
            "muon_lr": "it is Muon's, for the hidden matrices (without Muon, --lr sets every learning rate)",
            "muon_momentum": "it is Muon's, for the hidden matrices (AdamW's momentum is --beta1)",
            "head_lr": "without Muon, --lr sets every learning rate (an untied head's too)",
        },
    ),
    "adamw": OptimizerRule(
        help="AdamW for everything",
        adamw_lr=WidthRule(1e-3, 256, 1.0, 1e-2),
        head_lr=None,
        muon_lr=None,
        muon_momentum=None,
        beta1=0.9,
        warmup_fraction=0.05,
        state=hardware.OptimizerState(hidden=8, rest=8),
        build=build_adamw,
        own_options={
            "adam8bit": "under muon, AdamW only trains the embeddings and norms, and Muon keeps one "
            "buffer per matrix (half of AdamW's state) already"
        },
    ),
}


# ----------------------------------------------------------------------------------------------
# The options, and the recipe they resolve to.


@dataclass(frozen=True, kw_only=True)
class RecipeOptions:
    """The recipe's options (common.option declarations; None: the rule's value). train.RunSettings
    inherits them: they are compared on resume, and config.toml holds them."""

    optimizer: str | None = option(
        None,
        "; ".join(f"{name}: {rule.help}" for name, rule in OPTIMIZERS.items()) + f" (None: {DEFAULT_OPTIMIZER})",
        OPTIONS,
        choices=list(OPTIMIZERS),
    )
    lr: float | None = option(
        None, "AdamW's peak learning rate (under muon: of the embeddings and norms)", OPTIONS, checks=(finite, positive)
    )
    muon_lr: float | None = option(
        None, "Muon's peak learning rate (hidden matrices)", OPTIONS, checks=(finite, positive)
    )
    head_lr: float | None = option(
        None,
        "AdamW's peak learning rate of an untied LM head (--no-tie-embeddings) under muon",
        OPTIONS,
        checks=(finite, positive),
    )
    schedule: str | None = option(
        None,
        "cosine: warmup, then cosine decay; wsd: warmup, constant, then a linear decay over the last "
        f"--decay-fraction of the run (None: {DEFAULT_SCHEDULE})",
        OPTIONS,
        choices=SCHEDULES,
    )
    warmup_steps: int | None = option(
        None, "linear warmup steps (None: a fraction of the run, see docs/recipe.md)", OPTIONS, checks=(not_negative,)
    )
    decay_fraction: float | None = option(
        None,
        f"wsd: share of the run spent decaying (None: {DEFAULT_DECAY_FRACTION})",
        OPTIONS,
        checks=(finite, fraction),
    )
    final_lr_fraction: float | None = option(
        None,
        f"learning rate at the end, as a fraction of the peak (None: {DEFAULT_FINAL_LR_FRACTION})",
        OPTIONS,
        checks=(finite, fraction),
    )
    weight_decay: float = option(
        0.1,
        "decoupled weight decay of the matrices (AdamW's and Muon's; not embeddings or norms)",
        OPTIONS,
        checks=(finite, not_negative),
    )
    beta1: float | None = option(
        None,
        "AdamW beta1 (None: " + ", ".join(f"{rule.beta1:g} under {name}" for name, rule in OPTIMIZERS.items()) + ")",
        OPTIONS,
        checks=(finite, below_one),
    )
    beta2: float | None = option(None, f"AdamW beta2 (None: {DEFAULT_BETA2})", OPTIONS, checks=(finite, below_one))
    muon_momentum: float | None = option(
        None,
        f"Muon's (Nesterov) momentum (None: {OPTIMIZERS['muon'].muon_momentum:g})",
        OPTIONS,
        checks=(finite, below_one),
    )
    grad_clip: float = option(1.0, "clip the global gradient norm (0: off)", OPTIONS, checks=(finite, not_negative))
    adam8bit: bool = option(False, "bitsandbytes AdamW8bit (CUDA)", OPTIONS, flag="--8bit-adam")
    # issue 30's round 2 (docs/recipe.md has what each did on real text); each off by default
    momentum_warmup_steps: int = option(
        0, f"Muon's momentum rises from {MOMENTUM_FLOOR} over this many first steps", OPTIONS, checks=(not_negative,)
    )
    momentum_cooldown_steps: int = option(
        0, f"Muon's momentum falls back to {MOMENTUM_FLOOR} over this many last steps", OPTIONS, checks=(not_negative,)
    )
    muon_coefficients: str = option(
        "torch", "Muon's Newton-Schulz coefficients: torch's, or Polar Express's", OPTIONS, choices=MUON_COEFFICIENTS
    )
    normuon_beta2: float = option(
        0.0,
        "NorMuon: normalize each neuron's Muon update by its running RMS with "
        "this beta2, e.g. 0.95 (0: off, torch's Muon update)",
        OPTIONS,
        checks=(finite, below_one, not_negative),
    )
    cautious_weight_decay: bool = option(False, "Muon decays only the weights its update also shrinks", OPTIONS)
    weight_decay_schedule: str = option(
        "constant",
        "linear: the weight decay falls to 0 over the run (besides following the lr)",
        OPTIONS,
        choices=WEIGHT_DECAY_SCHEDULES,
    )
    z_loss: float = option(
        0.0,
        "add this x logsumexp(logits)^2 per token to the training loss (PaLM's z-loss; 0: off)",
        OPTIONS,
        checks=(finite, not_negative),
    )
    zero_init_output: bool = option(False, "start the attention and MLP output projections at zero", OPTIONS)


def check_recipe_options(options: RecipeOptions) -> None:
    """The rules between the recipe's options, each broken one a UserError naming its option."""
    chosen = OPTIMIZERS[options.optimizer or DEFAULT_OPTIMIZER]
    flags = option_flags(RecipeOptions)
    for name, rule in OPTIMIZERS.items():
        for option_name, why in rule.own_options.items():
            if option_name not in chosen.own_options and getattr(options, option_name) not in (None, False):
                raise UserError(f"{flags[option_name]} needs --optimizer {name}: {why}")
    if options.decay_fraction is not None and options.schedule == "cosine":
        raise UserError("--decay-fraction belongs to --schedule wsd (the cosine decays over the whole run)")


RECORDED = "recipe."  # the recipe's fields in the recorded training settings: recipe.NAME


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """Everything that shapes the optimization, resolved: recorded in training_settings.json and checked on
    resume. The fields with a default are knobs: each is its option of the same name (choose_recipe), its
    default the behaviour before it existed, read by the builders of OPTIMIZERS."""

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
    adam8bit: bool = False  # AdamW8bit (bitsandbytes) instead of torch's AdamW
    momentum_warmup_steps: int = 0
    momentum_cooldown_steps: int = 0
    muon_coefficients: str = "torch"
    normuon_beta2: float = 0.0
    cautious_weight_decay: bool = False
    weight_decay_schedule: str = "constant"
    # an untied LM head's lr under muon (None: tied, or it trains at lr); describe() names it with the rates
    head_lr: float | None = dataclasses.field(default=None, metadata={"with_rates": True})

    @property
    def rule(self) -> OptimizerRule:
        return OPTIMIZERS[self.optimizer]

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
        """The weight decay at step `step` as a fraction of weight_decay (the optimizers also scale it by the lr)."""
        return 1.0 - step / self.total_steps if self.weight_decay_schedule == "linear" else 1.0

    def describe(self) -> str:
        head = "" if self.head_lr is None else f"; {self.head_lr:.3g} the untied LM head"
        rates = (
            f"AdamW lr {self.lr:.3g}"
            if self.muon_lr is None
            else f"Muon lr {self.muon_lr:.3g} (hidden matrices, momentum {self.muon_momentum:g}), "
            f"AdamW lr {self.lr:.3g} "
            f"(embeddings, norms{head})"
        )
        decay = (
            f"cosine over {self.decay_steps} steps"
            if self.schedule == "cosine"
            else f"constant, then linear decay over the last {self.decay_steps} steps"
        )
        knobs = "".join(
            f", {field.name} {getattr(self, field.name)}"
            for field in knobs_of(type(self))
            if getattr(self, field.name) != field.default and not field.metadata.get("with_rates")
        )
        return (
            f"recipe: {self.optimizer}: {rates}; {self.warmup_steps} warmup steps, {decay} to "
            f"{self.final_lr_fraction:g}x of {self.total_steps}; betas {self.betas[0]:g}/{self.betas[1]:g}, "
            f"weight decay {self.weight_decay:g}, grad clip {self.grad_clip:g}{knobs}"
        )

    def recorded(self) -> dict[str, Any]:
        """The recipe as the run's settings record it: recipe.NAME per field, tuples as lists (as JSON has them)."""
        return {
            RECORDED + key: list(value) if isinstance(value, tuple) else value
            for key, value in dataclasses.asdict(self).items()
        }

    @classmethod
    def from_recorded(cls, training: dict) -> Recipe:
        """The recipe recorded in `training` (a run's training settings); a knob added since reads at its default.
        KeyError or TypeError when a field without a default is missing, or one is unknown."""
        values = {key[len(RECORDED) :]: value for key, value in training.items() if key.startswith(RECORDED)}
        return cls(**{**values, "betas": tuple(values["betas"])})


def knobs_of(recipe_type: type) -> list[dataclasses.Field]:
    """A recipe type's knobs: its fields with a default."""
    return [field for field in dataclasses.fields(recipe_type) if field.default is not dataclasses.MISSING]


def with_recorded_defaults(training: dict) -> dict:
    """A run's recorded training settings with each recipe option and knob it lacks at its default: what a
    run recorded before that option existed did. So an added knob never refuses an older checkpoint, while a
    value that differs from the checkpoint's still does."""
    defaults = {
        **{field.name: field.default for field in option_fields(RecipeOptions)},
        **{RECORDED + field.name: field.default for field in knobs_of(Recipe)},
    }
    return {**defaults, **training}


def choose_recipe(options: RecipeOptions, hidden: int, total_steps: int, tied: bool = True) -> tuple[Recipe, list[str]]:
    """The recipe for a model of width `hidden` (`tied`: its LM head is its input embedding) and a run of
    `total_steps`: the options given, the rules of the optimizer's table entry for the rest. Also returns why
    each chosen value was chosen (printed at start)."""
    optimizer = options.optimizer or DEFAULT_OPTIMIZER
    rule, schedule, why = OPTIMIZERS[optimizer], options.schedule or DEFAULT_SCHEDULE, []
    lr = options.lr
    if lr is None:
        lr = rule.adamw_lr.at(hidden)
        why.append(f"AdamW lr {lr:.3g} = {rule.adamw_lr.explain(hidden)}")
    muon_lr = None
    if rule.muon_lr is not None:
        muon_lr = rule.muon_lr if options.muon_lr is None else options.muon_lr
        if options.muon_lr is None:
            why.append(f"Muon lr {rule.muon_lr:g} at every width")
    warmup = options.warmup_steps
    if warmup is None:
        warmup = rule.warmup_steps(total_steps)
        why.append(
            f"{warmup} warmup steps = {rule.warmup_fraction:g} of {total_steps} steps "
            f"(at least 1, at most {MAX_WARMUP_STEPS})"
        )
    if schedule == "cosine":
        decay = max(0, total_steps - warmup)
    else:
        decay_fraction = DEFAULT_DECAY_FRACTION if options.decay_fraction is None else options.decay_fraction
        decay = min(max(0, total_steps - warmup), round(decay_fraction * total_steps))
    final = DEFAULT_FINAL_LR_FRACTION if options.final_lr_fraction is None else options.final_lr_fraction
    beta1 = rule.beta1 if options.beta1 is None else options.beta1
    beta2 = DEFAULT_BETA2 if options.beta2 is None else options.beta2
    momentum = rule.muon_momentum if options.muon_momentum is None else options.muon_momentum
    knobs = {field.name: getattr(options, field.name) for field in knobs_of(Recipe)}
    if tied and options.head_lr is not None:
        raise UserError("--head-lr is the lr of an untied LM head: add --no-tie-embeddings, or drop it")
    if not tied and rule.head_lr is not None and options.head_lr is None:
        knobs["head_lr"] = rule.head_lr.at(hidden)
        why.append(f"untied LM head lr {knobs['head_lr']:.3g} = {rule.head_lr.explain(hidden)}")
    recipe = Recipe(
        optimizer=optimizer,
        lr=lr,
        muon_lr=muon_lr,
        schedule=schedule,
        warmup_steps=warmup,
        decay_steps=decay,
        final_lr_fraction=final,
        total_steps=total_steps,
        weight_decay=options.weight_decay,
        betas=(beta1, beta2),
        muon_momentum=momentum if muon_lr is not None else None,
        grad_clip=options.grad_clip,
        **knobs,
    )
    return recipe, why


def extension_problem(old: Recipe, new: Recipe, step: int) -> str | None:
    """Why a run at `step` (steps taken) under recipe `old` cannot go on under `new`, a recipe of another
    length (None: it can). A pure function of the two recipes and the step."""
    if old.schedule == "cosine":
        return (
            "its schedule is cosine, whose decay spans the whole run: the learning rate of every step "
            "taken depends on the length, so a longer run is not the same run (start runs you may extend "
            "with --schedule wsd)"
        )
    if old.warmup_steps != new.warmup_steps:
        return f"the warmup would change from {old.warmup_steps} to {new.warmup_steps} steps"
    old_start, new_start = old.total_steps - old.decay_steps, new.total_steps - new.decay_steps
    if step > old_start:
        return (
            f"its decay began at step {old_start} and it is at step {step}: only a checkpoint of the stable "
            f"phase (step <= {old_start}) can be extended"
        )
    if step > new_start:
        return (
            f"the new length's decay would start at step {new_start}, before the checkpoint's step {step} "
            "(ask for more tokens)"
        )
    return None


def recipe_warnings(recipe: Recipe) -> list[str]:
    """Schedules that cannot train well: warmup that is most of the run, a run of a handful of steps."""
    warnings = []
    if recipe.warmup_steps >= recipe.total_steps:
        warnings.append(
            f"--warmup-steps {recipe.warmup_steps} >= the run's {recipe.total_steps} steps: the learning "
            "rate never reaches its peak nor decays; pass fewer --warmup-steps"
        )
    elif recipe.warmup_steps > recipe.total_steps // 2:
        warnings.append(
            f"{recipe.warmup_steps} of the run's {recipe.total_steps} steps are warmup: most of the run "
            "trains below the peak learning rate; pass fewer --warmup-steps or train longer"
        )
    if recipe.total_steps < 20:
        warnings.append(
            f"the run is only {recipe.total_steps} optimizer steps: too few to learn much; train more "
            "tokens (--target-tokens, --epochs) or use a smaller --batch-size / --grad-accum"
        )
    return warnings


# ----------------------------------------------------------------------------------------------
# The optimizers of a run.


def hidden_matrices(model: torch.nn.Module) -> Parameters:
    """(the 2-D weights inside the decoder layers: attention and MLP projections; the rest: the embedding and
    norms; an untied LM head). A tied head is the embedding: named_parameters lists it once, as the embedding."""
    hidden, rest, head = [], [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            part = head if name == "lm_head.weight" else hidden if param.ndim == 2 and ".layers." in name else rest
            part.append(param)
    return Parameters(hidden, rest, head)


class Optimizers:
    """The run's optimizers as one (a checkpoint's "optimizer": {part name: its state}).

    Every param group keeps its peak lr in "peak_lr"; apply_schedule sets lr = peak_lr x the schedule's
    multiplier, and the weight decay and Muon's momentum of the step. Each group's name and first weight
    decay are kept here, not only in the group: a checkpoint's groups replace them.
    """

    def __init__(self, parts: dict[str, torch.optim.Optimizer]):
        self.parts = parts
        self.group_names = [
            [group.get("name", part) for group in optimizer.param_groups] for part, optimizer in parts.items()
        ]
        self.weight_decays = [
            [group["weight_decay"] for group in optimizer.param_groups] for optimizer in parts.values()
        ]

    def apply_schedule(self, recipe: Recipe, step: int) -> dict[str, float]:
        """Set every param group's lr, weight decay and (Muon's) momentum for optimizer step `step` (0-based):
        pure functions of the step and the recipe, so a resume needs no state for them. Returns each group's
        lr by its name (groups of one name share their lr)."""
        multiplier, decay = recipe.lr_multiplier(step), recipe.weight_decay_multiplier(step)
        for (part, optimizer), weight_decays in zip(self.parts.items(), self.weight_decays):
            for group, weight_decay in zip(optimizer.param_groups, weight_decays):
                group["lr"] = group["peak_lr"] * multiplier
                group["weight_decay"] = weight_decay * decay
                if part == "muon":
                    group["momentum"] = recipe.momentum_at(step)
        return {
            name: group["lr"]
            for names, optimizer in zip(self.group_names, self.parts.values())
            for name, group in zip(names, optimizer.param_groups)
        }

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
            raise UserError(
                f"the checkpoint's optimizer holds {', '.join(sorted(state))}, this run uses "
                f"{', '.join(sorted(self.parts))}"
            )
        for name, optimizer in self.parts.items():
            optimizer.load_state_dict(state[name])


def build_optimizers(
    model: torch.nn.Module, recipe: Recipe, device: torch.device, rank: int = 0, world: int = 1, precision: str = "fp32"
) -> Optimizers:
    """The recipe's optimizers (its OPTIMIZERS entry's builder) over the model's parameters, on `rank` of
    `world`, for a run in `precision`; each param group's peak lr kept as "peak_lr"."""
    parts = recipe.rule.build(recipe, hidden_matrices(model), device, rank, world, precision)
    for optimizer in parts.values():
        for group in optimizer.param_groups:
            group["peak_lr"] = group["lr"]
    return Optimizers(parts)


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


# ----------------------------------------------------------------------------------------------
# fp16: the gradient scaler (hardware.choose_precision's fp16 needs one; bf16 and fp32 run it disabled).


class LossScaler:
    """torch.amp.GradScaler (enabled for fp16 only) over the run's optimizers, counting steps skipped for overflow."""

    def __init__(self, device, enabled: bool):
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
        return {
            "scaler": self.scaler.state_dict(),
            "skipped_total": self.skipped_total,
            "skipped_in_a_row": self.skipped_in_a_row,
        }

    def load_state_dict(self, state: dict) -> None:
        if state["scaler"]:
            self.scaler.load_state_dict(state["scaler"])
        self.skipped_total = int(state["skipped_total"])
        self.skipped_in_a_row = int(state["skipped_in_a_row"])
