"""Observers of a training run (OLMo-core's callbacks): what a run logs, evaluates and makes at its end.

train.py's loop calls the hooks through `Callbacks`; each observer overrides only the hooks it needs and
owns what must survive a restart (`state_dict()` / `load_state_dict()`, under its own `key` in the
checkpoint's "callbacks"), so a resumed run logs and evaluates exactly what the uninterrupted run does.

    callbacks = Callbacks([TrainLog(...), Validation(...), TaskScores(...), *artifacts.end_of_run(...)])
    callbacks.load_state_dict(checkpoint["callbacks"])       # a resumed run
    callbacks.on_start(step)
    for each step taken: callbacks.on_step_end(result, speed); measured = callbacks.on_eval(step)
    callbacks.on_loop_end(); found = callbacks.on_end(end)  # on_end: rank 0; found goes into run_status.json
    callbacks.close()                                         # however the session ends

The hooks, in the order a session calls them (every rank calls each one unless it says otherwise):
- on_start(step): the session starts at `step` (0, or the resumed checkpoint's), the states loaded
- on_step_end(result, speed): after each optimizer step taken (an fp16 step skipped for overflow is not)
- on_eval(step): an evaluator measures when its cadence (`due`) says so and returns what it did (Measured)
- on_evaluated(step, measured): after a step at which something was measured
- on_loop_end(): the loop ended (the run completed, or the session stops resumably)
- on_end(end): rank 0, the last checkpoint on disk: the end-of-run outputs (artifacts.py: the loss curve,
  samples, held-out accuracy, RUN/model/); returns run_status.json fields, what failed in `report_errors`
- close(): always, however the session ends
`summary()` is what run_status.json says of what an observer measured (best validation loss, last scores).

The trackers (--log-to, trackers.py) are sinks of the one metrics log every observer writes to
(metrics_log.MetricsLog): TrainLog cuts metrics.jsonl back at the start, which rewinds them, and closes them.
Their own state (each one's run id and last step given) is RUN/trackers.json, never a checkpoint: a resume
from an older checkpoint must not give a tracker a step it was given before.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tinyllm.outputs import metrics_log

if TYPE_CHECKING:
    from tinyllm.store import checkpoint_store
# `progress` below is a report.Progress (its update and write), never imported: report.py's command line
# reaches the artifacts, which are callbacks.


@dataclass
class StepResult:
    """What one optimizer step hands the observers (train.Training.train_step)."""

    step: int
    loss: float
    lrs: dict[str, float]  # each param group's lr this step by its name (Optimizers.apply_schedule)
    grad_norm: float
    seconds: float
    applied: bool  # False when fp16 skipped the step for overflow (the step is then retried)
    cpu_seconds: float = 0.0  # this process' CPU time over the step, all its threads (--budget's probe)


@dataclass(frozen=True)
class Speed:
    """A step's throughput: tokens per second over all ranks, and the model FLOPs utilization (None: no peak)."""

    tokens_per_second: float
    mfu: float | None


@dataclass(frozen=True)
class Measured:
    """An evaluation that ran at a step: its observer's key, and a validation loss lower than any before
    (the save then records it as the best checkpoint's)."""

    name: str
    new_best: float | None = None


@dataclass(frozen=True)
class RunEnd:
    """Where a session leaves its run (on_end's argument): what the artifacts, the model card and
    run_status.json say of it."""

    status: str  # checkpoint_store.COMPLETE or NEEDS_RESUME
    step: int
    total_steps: int
    tokens: int
    validation: dict | None  # the latest validation ({"step", "loss", ...}: Validation.summary)
    test: dict | None  # the test evaluation of a complete run


def new_best(measured: Sequence[Measured]) -> float | None:
    """The new best validation loss among a step's evaluations; None when none set one."""
    return next((item.new_best for item in measured if item.new_best is not None), None)


LAST_GAP = 0.25  # of the cadence: a multiple this near the last step is left to the last step's evaluation


def due(step: int, total_steps: int, every: int | None) -> bool:
    """Whether an evaluation every `every` steps runs after `step`: at each multiple (0: none) and at the
    last step; None: this evaluation is off. A multiple less than LAST_GAP of the cadence before the last
    step is left to the last step's: the default five validations of 356 steps (every 71) ran at 355 and
    356, one step apart, 4 s of a 90 s budget."""
    if every is None:
        return False
    if step == total_steps:
        return True
    return every > 0 and step % every == 0 and total_steps - step >= LAST_GAP * every


VALIDATION_COST_SHARE = 0.05  # --eval-every's default keeps validating to about this share of the training


def default_eval_every(total_steps: int, validation_tokens: int = 0, step_tokens: int = 1) -> int:
    """--eval-every's default: five validations in a run (the last at its end), at most 250 steps apart, and
    no more often than validating `validation_tokens` costs VALIDATION_COST_SHARE of the training in between,
    counting a scored token (a forward) as a third of a trained one, as the tasks' default does
    (evaluation.default_tasks_every); 0, only at the end, when no cadence within the run is that cheap. A
    minute's CPU run on a 2.5 MB corpus validated 28,160 tokens (1.7 s) every 25 steps of 4,096 (0.57 s each): 11% of
    its time."""
    every = max(1, min(250, total_steps // 5))
    needed = math.ceil(validation_tokens / (3 * VALIDATION_COST_SHARE * step_tokens))
    if needed <= every:
        return every
    return needed if needed < total_steps else 0


class Callback:
    """An observer of the run: every hook does nothing until a subclass overrides it."""

    key: str | None = None  # its name in the checkpoint's "callbacks"; None: nothing to keep across a restart

    def on_start(self, step: int) -> None:
        pass

    def on_step_end(self, result: StepResult, speed: Speed) -> None:
        pass

    def on_eval(self, step: int) -> Measured | None:
        return None

    def on_evaluated(self, step: int, measured: list[Measured]) -> None:
        pass

    def on_loop_end(self) -> None:
        pass

    def on_end(self, end: RunEnd) -> dict:
        return {}

    def summary(self) -> dict:
        return {}

    def close(self) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class Callbacks:
    """The run's observers, called in the order given (the metrics log's cut before a restore into it)."""

    def __init__(self, callbacks: Sequence[Callback]):
        keys = [callback.key for callback in callbacks if callback.key]
        if len(set(keys)) != len(keys):
            raise ValueError(f"two callbacks keep their state under one key: {keys}")
        self.callbacks = list(callbacks)

    def state_dict(self) -> dict:
        return {callback.key: callback.state_dict() for callback in self.callbacks if callback.key}

    def load_state_dict(self, states: dict) -> None:
        for callback in self.callbacks:
            if callback.key:
                callback.load_state_dict(states[callback.key])

    def on_start(self, step: int) -> None:
        for callback in self.callbacks:
            callback.on_start(step)

    def on_step_end(self, result: StepResult, speed: Speed) -> None:
        for callback in self.callbacks:
            callback.on_step_end(result, speed)

    def on_eval(self, step: int) -> list[Measured]:
        """Every evaluation due after `step`, then on_evaluated when any ran; what they measured."""
        measured = [item for item in (callback.on_eval(step) for callback in self.callbacks) if item is not None]
        if measured:
            for callback in self.callbacks:
                callback.on_evaluated(step, measured)
        return measured

    def on_loop_end(self) -> None:
        for callback in self.callbacks:
            callback.on_loop_end()

    def on_end(self, end: RunEnd) -> dict:
        """The end-of-run outputs (rank 0); the run_status.json fields they return, merged, and their
        `report_errors` ({what: why} of what failed) gathered into one."""
        found: dict = {}
        errors: dict | None = None
        for callback in self.callbacks:
            made = dict(callback.on_end(end))
            if "report_errors" in made:
                errors = {**(errors or {}), **(made.pop("report_errors") or {})}
            found.update(made)
        return found if errors is None else {**found, "report_errors": errors or None}

    def summary(self) -> dict:
        return {key: value for callback in self.callbacks for key, value in callback.summary().items()}

    def close(self) -> None:
        for callback in self.callbacks:
            callback.close()


class TrainLog(Callback):
    """metrics.jsonl's train records (every log_every steps, the first, the last and the one a session stops
    at), the progress bar, and run_status.json's RUNNING record with each; at the start metrics.jsonl is cut
    back to the resumed step (its trackers rewind with it), and its trackers are closed at the end.
    `fields(step)`: the record's fields besides the step's own (peak memory, a mixture's progress)."""

    key = "train"

    def __init__(
        self,
        fields: Callable[[int], dict],
        every: int,
        total_steps: int,
        tokens_per_step: int,
        metrics: metrics_log.MetricsLog,
        progress,
        status: checkpoint_store.RunStatus,
    ):
        self.fields, self.every, self.total_steps, self.tokens_per_step = fields, every, total_steps, tokens_per_step
        self.metrics, self.progress, self.status = metrics, progress, status
        self.train_seconds = 0.0  # the steps' time, summed over the sessions
        self.unlogged: tuple[StepResult, Speed] | None = None  # the newest step, when its record is not written

    def on_start(self, step: int) -> None:
        self.metrics.truncate_after(step)

    def on_step_end(self, result: StepResult, speed: Speed) -> None:
        self.train_seconds += result.seconds
        self.progress.update(result.step, result.loss, speed.tokens_per_second, speed.mfu)
        self.unlogged = result, speed
        if result.step % self.every == 0 or result.step in (1, self.total_steps):
            self.write(result, speed)

    def on_loop_end(self) -> None:
        if self.unlogged is not None:  # metrics.jsonl ends with the step the session stopped at
            self.write(*self.unlogged)

    def write(self, result: StepResult, speed: Speed) -> None:
        tokens = result.step * self.tokens_per_step
        self.metrics.write(
            "train",
            step=result.step,
            tokens=tokens,
            loss=result.loss,
            **metrics_log.lr_fields(result.lrs),
            grad_norm=result.grad_norm,
            step_seconds=result.seconds,
            tokens_per_second=speed.tokens_per_second,
            mfu=speed.mfu,
            **self.fields(result.step),
        )
        self.status.running(result.step, self.total_steps, tokens=tokens, loss=result.loss)
        self.unlogged = None

    def close(self) -> None:
        self.metrics.close()

    def state_dict(self) -> dict:
        return {"train_seconds": self.train_seconds}

    def load_state_dict(self, state: dict) -> None:
        self.train_seconds = float(state["train_seconds"])


class Validation(Callback):
    """The held-out loss every `every` steps (0: only at the end; default_eval_every) and at the last step:
    an "eval" record and a line; keeps the latest result and the best loss, whose step saves as the best
    checkpoint. `measure()`: the validation split's loss over all ranks (None: nothing counted)."""

    key = "validation"

    def __init__(
        self,
        measure: Callable[[], dict | None],
        every: int,
        total_steps: int,
        tokens_per_step: int,
        metrics: metrics_log.MetricsLog,
        progress,
    ):
        self.measure, self.every, self.total_steps, self.tokens_per_step = measure, every, total_steps, tokens_per_step
        self.metrics, self.progress = metrics, progress
        self.best_loss, self.best_step = math.inf, 0
        self.last: dict | None = None  # {"step": ..., **the result}

    def on_eval(self, step: int) -> Measured | None:
        if not due(step, self.total_steps, self.every):
            return None
        result = self.measure()
        if result is None:
            return Measured(self.key)
        self.last = {"step": step, **result}
        self.metrics.write(
            "eval",
            step=step,
            tokens=step * self.tokens_per_step,
            val_loss=result["loss"],
            val_perplexity=result["perplexity"],
            val_tokens=result["tokens"],
            val_bits_per_byte=result["bits_per_byte"],
            val_bytes=result["bytes"],
            **source_results("val", result),
        )
        self.progress.write(
            f"step {step}: validation loss {result['loss']:.4f}, perplexity {result['perplexity']:.2f}"
            f"{metrics_log.bits_per_byte_text(result)}"
            + "".join(f"; {name} {part['loss']:.4f}" for name, part in result.get("sources", {}).items() if part)
        )
        if result["loss"] >= self.best_loss:
            return Measured(self.key)
        self.best_loss, self.best_step = result["loss"], step
        return Measured(self.key, new_best=result["loss"])

    def summary(self) -> dict:
        return {"best_val_loss": self.best_loss if math.isfinite(self.best_loss) else None, "validation": self.last}

    @classmethod
    def saved(cls, states: dict) -> dict | None:
        """The latest validation a checkpoint's observers' states hold (--export-only's RunEnd)."""
        return states[cls.key]["last"]

    def state_dict(self) -> dict:
        return {"best_val_loss": self.best_loss, "best_step": self.best_step, "last": self.last}

    def load_state_dict(self, state: dict) -> None:
        self.best_loss, self.best_step = float(state["best_val_loss"]), int(state["best_step"])
        self.last = state["last"]


def source_results(prefix: str, result: dict) -> dict:
    """A mixture's loss and bits per byte of each source, as metrics.jsonl fields (`val_loss/web`)."""
    fields = {}
    for name, part in (result.get("sources") or {}).items():
        if part is not None:
            fields[f"{prefix}_loss/{name}"] = part["loss"]
            fields[f"{prefix}_bits_per_byte/{name}"] = part["bits_per_byte"]
    return fields


class TaskScores(Callback):
    """The --eval-tasks scores every `every` steps (evaluation.default_tasks_every; None: no tasks this session) and
    at the last step: a "tasks" record and a line. Keeps every record: a resume writes back those
    metrics.jsonl lost, and the last scores stay in run_status.json in a session without tasks.
    `score()`: evaluation.loop_scores of the model as it is, over all ranks."""

    key = "tasks"

    def __init__(
        self,
        score: Callable[[], dict[str, dict]],
        every: int | None,
        total_steps: int,
        tokens_per_step: int,
        metrics: metrics_log.MetricsLog,
        progress,
    ):
        self.score, self.every, self.total_steps, self.tokens_per_step = score, every, total_steps, tokens_per_step
        self.metrics, self.progress = metrics, progress
        self.history: list[dict] = []  # every "tasks" record of the run

    def on_start(self, step: int) -> None:
        self.metrics.restore(self.history, "tasks")

    def on_eval(self, step: int) -> Measured | None:
        if not due(step, self.total_steps, self.every):
            return None
        started = time.monotonic()
        scores = self.score()
        record = {
            "step": step,
            "tokens": step * self.tokens_per_step,
            **metrics_log.task_fields(scores),
            "seconds": time.monotonic() - started,
        }
        self.history.append(record)
        self.metrics.write("tasks", **record)
        self.progress.write(
            f"step {step}: "
            + "; ".join(
                f"{name} acc {value['acc']:.3f}, acc_norm {value['acc_norm']:.3f} (n {value['n']}, chance "
                f"{value['chance']:.3f})"
                for name, value in scores.items()
            )
        )
        return Measured(self.key)

    def summary(self) -> dict:
        last = self.history[-1] if self.history else None
        return {"tasks": metrics_log.task_scores(last) if last else None, "tasks_step": last["step"] if last else None}

    def state_dict(self) -> dict:
        return {"history": list(self.history)}  # a copy: the background write must not see later records

    def load_state_dict(self, state: dict) -> None:
        self.history = list(state["history"])
