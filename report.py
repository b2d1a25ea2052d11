"""What a person sees of a run: progress, the loss curve, samples, task accuracy, the HF export.

train.py calls these on rank 0 (Progress and MetricsLog take `enabled=info.is_main`):

    progress = Progress(total_steps, initial_step=step, every=args.log_every, enabled=is_main)
    progress.update(step, loss, tokens_per_second, mfu)   # every optimizer step; progress.write(msg) for logs
    metrics = MetricsLog(RUN / "metrics.jsonl", is_main, trackers.open_trackers(["wandb"], RUN, run_id, config))
    metrics.write("train", step=step, loss=loss)          # metrics.jsonl and each --log-to tracker
    plot_loss_curve(RUN / "metrics.jsonl", RUN / "loss_curve.png")                 # after each eval, at the end
    generate_samples(model, tokenizer, RUN / "sample_generations.json", step=step)   # never raises
    accuracy = task_accuracy(model, tokenizer, CORPUS / "eval", device)
    model_files = export_hf_model(model, tokenizer, RUN / "model", card_info)      # {file: sha256}

Nothing runs at import time. The script form redraws a run's pictures or evaluates an
exported model after the fact:

    python report.py plot runs/demo                      # runs/demo/loss_curve.png from metrics.jsonl
    python report.py evaluate runs/demo --tasks corpus/demo/eval arc_easy --limit 200   # evaluation.py
    python report.py samples runs/demo/model --prompt "What is 12 plus 7?"
    python report.py publish runs/demo hf://USER/REPO       # or a folder, s3://, gs://: verified
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import io
import json
import math
import os
import re
import shutil
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import attention
import checkpoint_cloud
import checkpoint_store as store
import evaluation
from common import (
    PROGRESS_WRITERS,
    ArgumentParser,
    UserError,
    append_jsonl,
    atomic_folder,
    atomic_open,
    atomic_write_bytes,
    atomic_write_json,
    human_count,
    json_safe,
    jsonl_records,
    read_json,
    read_json_or,
    run_main,
    say,
    sha256_file,
    utc_now,
)

IM_START, IM_END, EOS, THINK_CLOSE = "<|im_start|>", "<|im_end|>", "<eos>", "</think>"  # as data.py's specials

# Shaped like the demo corpus's problems (data.py --demo), plus one it never saw.
DEFAULT_PROMPTS = [
    "What is 12 plus 7?",
    "What is 48 + 35?",
    "What is 75 minus 28?",
    "If a box has 3 rows of 4 apples, how many apples are there?",
    "Say hello in one short sentence.",
]

# ----------------------------------------------------------------------------------------------
# Progress: a tqdm bar on a terminal, a plain line every `every` steps in a log.


def stderr_is_terminal() -> bool:
    return hasattr(sys.stderr, "isatty") and sys.stderr.isatty()


class Progress:
    """Progress over optimizer steps, shown by rank 0 only.

    On a terminal: a tqdm bar (on stderr) with loss, tokens/s, MFU and tqdm's ETA. Otherwise
    (Kaggle log, pytest, `> log.txt`): a plain stdout line at the first update, every `every`
    steps and at the last step. `enabled=False` (other ranks) makes every method a no-op.
    `bar=None` picks the bar when stderr is a terminal; True/False forces it. `first_note` (e.g. the
    start-up compile time) goes with the first update.
    """

    def __init__(self, total_steps: int, initial_step: int = 0, every: int = 10, enabled: bool = True,
                 bar: bool | None = None, first_note: str | None = None):
        self.total_steps = total_steps
        self.first_note = first_note
        self.initial_step = initial_step
        self.every = max(1, every)
        self.enabled = enabled
        self._first_update: tuple[int, float] | None = None  # (step, time): the pace is measured from here
        self._printed_any = False
        self._bar = None
        if enabled and (stderr_is_terminal() if bar is None else bar):
            from tqdm import tqdm

            # A fixed size: tqdm hides the bar on pseudo-terminals that report 0 rows (dynamic_ncols reads them).
            size = shutil.get_terminal_size((100, 24))
            self._bar = tqdm(total=total_steps, initial=initial_step, unit="step", desc="train", file=sys.stderr,
                             ncols=size.columns, nrows=size.lines)
            PROGRESS_WRITERS.append(self._write_above_bar)

    def update(self, step: int, loss: float, tokens_per_second: float | None = None,
               mfu: float | None = None) -> None:
        """Report that optimizer step `step` (1-based count of steps done) finished. `mfu` is a fraction."""
        if not self.enabled:
            return
        if self._first_update is None:
            self._first_update = step, time.monotonic()
        stats = format_stats(loss, tokens_per_second, mfu)
        if self.first_note:
            stats, self.first_note = f"{stats} | {self.first_note}", None
        if self._bar is not None:
            self._bar.set_postfix_str(stats, refresh=False)
            self._bar.update(step - self._bar.n)
            return
        due = step % self.every == 0 or step >= self.total_steps or not self._printed_any
        if due:
            self._printed_any = True
            width = len(str(self.total_steps))
            percent = 100.0 * step / max(1, self.total_steps)
            line = f"step {step:>{width}}/{self.total_steps} ({percent:5.1f}%) | {stats} | ETA {self.eta(step)}"
            print(line, flush=True)

    def eta(self, step: int) -> str:
        """Time left at the average pace since the first update (tqdm's own format); "?" until a second one.

        Why from the first update: the first step carries one-off costs (torch.compile, memory, caches)
        that would otherwise make the early estimates far too long."""
        from tqdm import tqdm

        if self._first_update is None or step <= self._first_update[0]:
            return "?"
        first_step, first_time = self._first_update
        seconds = (time.monotonic() - first_time) / (step - first_step) * max(0, self.total_steps - step)
        return tqdm.format_interval(seconds)

    def write(self, message: str) -> None:
        """Print a message (an eval result, a checkpoint) without breaking the bar (common.say)."""
        say(message, main=self.enabled)

    def _write_above_bar(self, text: str, warning: bool) -> None:
        self._bar.write(text, file=sys.stderr)

    def close(self) -> None:
        if self._bar is not None:
            PROGRESS_WRITERS.remove(self._write_above_bar)
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def format_stats(loss: float, tokens_per_second: float | None, mfu: float | None) -> str:
    parts = [f"loss {loss:.4f}"]
    if tokens_per_second is not None:
        parts.append(f"{human_count(tokens_per_second)} tok/s")
    if mfu is not None:
        parts.append(f"MFU {100 * mfu:.1f}%")
    return " | ".join(parts)


# ----------------------------------------------------------------------------------------------
# metrics.jsonl -> loss_curve.png and TensorBoard.


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """The records of metrics.jsonl, sorted by step; a missing file gives [].

    A killed run leaves a truncated last line, and a resumed run appends to it: such a line
    yields the complete record at its end, if any, and is otherwise skipped. A resumed run also
    repeats the steps after its last checkpoint; for each (kind, step) the later record wins.
    """
    latest: dict[tuple[str, int], dict] = {}
    try:
        handle = open(path, encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return []
    with handle:
        for line in handle:
            record = _parse_record(line)
            if isinstance(record, dict) and isinstance(record.get("step"), int):
                latest[(str(record.get("kind")), record["step"])] = record
    return sorted(latest.values(), key=lambda record: record["step"])


def _parse_record(line: str):
    """The JSON object on `line`, or the one a truncated record was glued to; None if neither."""
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        pass
    start = line.find("{", 1)
    while start != -1:
        try:
            return json.loads(line[start:])
        except json.JSONDecodeError:
            start = line.find("{", start + 1)
    return None


def _series(records: list[dict], kind: str, key: str) -> tuple[list[float], list[float]]:
    """(tokens, values) of the records of `kind` that have a finite `key`."""
    xs, ys = [], []
    for record in records:
        value = record.get(key)
        if record.get("kind") == kind and isinstance(value, (int, float)) and math.isfinite(value):
            xs.append(record.get("tokens", record["step"]))
            ys.append(value)
    return xs, ys


SMOOTH_FROM_POINTS = 50  # fewer train points: one plain line (a moving average over so few would only lag)


def smooth(values: list[float], window: int | None = None) -> list[float]:
    """Centred moving average (no lag on a steep early curve), the window shrinking at both ends.

    The default window spans about 1/25 of the points (odd, at least 3).
    """
    if window is None:
        window = max(3, len(values) // 25)
    half = window // 2
    sums = np.concatenate([[0.0], np.cumsum(values, dtype=float)])
    smoothed = []
    for index in range(len(values)):
        width = min(half, index, len(values) - 1 - index)
        smoothed.append(float(sums[index + width + 1] - sums[index - width]) / (2 * width + 1))
    return smoothed


# metrics.jsonl's learning rates (train records) and their legend labels
LR_SERIES = {"muon_lr": "Muon lr (hidden matrices)", "adamw_lr": "AdamW lr (embeddings, norms; all under adamw)"}


def plot_loss_curve(metrics_path: str | os.PathLike, out_png: str | os.PathLike, title: str = "tinyllm") -> bool:
    """Draw train and validation loss against tokens seen, the learning rate on a second axis; below
    them, a panel with the --eval-tasks accuracies when the run scores any.

    Uses matplotlib's Agg canvas directly (no display, no pyplot state) and replaces `out_png`
    atomically. Returns False, writing nothing, when there is no loss to draw yet.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    records = read_metrics(metrics_path)
    train_x, train_loss = _series(records, "train", "loss")
    val_x, val_loss = _series(records, "eval", "val_loss")
    test_x, test_loss = _series(records, "test", "test_loss")
    learning_rates = {label: _series(records, "train", key) for key, label in LR_SERIES.items()}
    learning_rates = {label: series for label, series in learning_rates.items() if series[1]}
    if not train_loss and not val_loss:
        return False

    tasks = [record for record in records if record.get("kind") == "tasks"]
    figure = Figure(figsize=(9, 7.5 if tasks else 5), dpi=110, layout="constrained")
    FigureCanvasAgg(figure)
    axes, task_axes = figure.subplots(2, 1, sharex=True, height_ratios=(2, 1)) if tasks else (figure.add_subplot(),
                                                                                            None)
    _plot_losses(axes, (train_x, train_loss), (val_x, val_loss), (test_x, test_loss))
    handles, labels = axes.get_legend_handles_labels()
    if learning_rates:
        extra_handles, extra_labels = _plot_learning_rates(axes, learning_rates)
        handles, labels = handles + extra_handles, labels + extra_labels
    if task_axes is not None:
        _plot_task_scores(task_axes, tasks)
        axes.set_xlabel("")
    figure.legend(handles, labels, loc="outside lower center", ncols=len(labels) if len(labels) <= 4 else 3,
                  fontsize="small", frameon=False)
    last = records[-1]
    figure.suptitle(f"{title}: step {last['step']:,}, {human_count(last.get('tokens', 0))} tokens")

    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    atomic_write_bytes(out_png, buffer.getvalue())
    return True

def _plot_losses(axes, train: tuple, validation: tuple, test: tuple) -> None:
    """Train on top (zorder), validation as open markers on a thin line, the test star below: where they
    agree, all stay visible. A log scale when the losses span more than 4x (the late, small changes matter most)."""
    from matplotlib.ticker import FuncFormatter

    (train_x, train_loss), (val_x, val_loss), (test_x, test_loss) = train, validation, test
    if len(train_loss) >= SMOOTH_FROM_POINTS:
        axes.plot(train_x, train_loss, color="tab:blue", alpha=0.3, linewidth=1, zorder=3, label="train loss")
        axes.plot(train_x, smooth(train_loss), color="tab:blue", linewidth=2, zorder=4, label="train loss (smoothed)")
    elif train_loss:
        axes.plot(train_x, train_loss, color="tab:blue", linewidth=2, zorder=4, label="train loss")
    if val_loss:
        axes.plot(val_x, val_loss, "o-", color="tab:orange", linewidth=1, markersize=7, markerfacecolor="none",
                  markeredgewidth=1.8, zorder=2, label="validation loss")
    if test_loss:
        axes.plot(test_x, test_loss, "*", color="tab:red", markersize=12, zorder=1.5,
                  label=f"test loss {test_loss[-1]:.3f}")
    losses = train_loss + val_loss + test_loss
    if min(losses) > 0 and max(losses) / min(losses) > 4:
        axes.set_yscale("log")
        axes.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
        axes.yaxis.set_minor_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    axes.set_xlabel("tokens seen")
    axes.set_ylabel("loss (nats per token)")
    axes.xaxis.set_major_formatter(FuncFormatter(lambda value, _: human_count(value)))
    axes.grid(alpha=0.3)


def _plot_task_scores(axes, records: list[dict]) -> None:
    """Each --eval-tasks task's acc (solid) and acc_norm (dotted) against tokens seen, its chance dashed."""
    from matplotlib.ticker import FuncFormatter

    names = list(dict.fromkeys(name for record in records for name in task_scores(record)))
    for index, name in enumerate(names):
        color = f"C{index % 10}"  # matplotlib's default cycle of ten colours
        for metric, style in (("acc", "o-"), ("acc_norm", "s:")):
            xs, ys = _series(records, "tasks", f"{name}/{metric}")
            axes.plot(xs, ys, style, color=color, markersize=4, linewidth=1.5, label=f"{name} {metric}")
        chance = _series(records, "tasks", f"{name}/chance")[1]
        if chance:
            axes.axhline(chance[-1], color=color, linestyle="--", linewidth=0.8, alpha=0.6)
    axes.set_ylabel("accuracy (dashed: chance)")
    axes.set_xlabel("tokens seen")
    axes.xaxis.set_major_formatter(FuncFormatter(lambda value, _: human_count(value)))
    axes.set_ylim(0, 1)
    axes.grid(alpha=0.3)
    axes.legend(fontsize="x-small", ncols=min(4, 2 * len(names)), loc="lower right")


def _plot_learning_rates(axes, learning_rates: dict) -> tuple[list, list]:
    """Each optimizer's learning rate (AdamW's, Muon's) on a second axis; its legend handles and labels."""
    lr_axes = axes.twinx()
    for (label, (lr_x, lr)), style in zip(learning_rates.items(), ("--", ":")):
        lr_axes.plot(lr_x, lr, style, color="tab:gray", linewidth=1, label=label)
    lr_axes.set_ylabel("learning rate")
    lr_axes.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    lr_axes.set_ylim(bottom=0)
    return lr_axes.get_legend_handles_labels()



def bits_per_byte_text(result: dict) -> str:
    """", 1.2345 bits/byte" for an evaluation that has them (older records and status files may not)."""
    value = result.get("bits_per_byte")
    return "" if value is None else f", {value:.4f} bits/byte"



class MetricsLog:
    """metrics.jsonl on rank 0: one JSON object per line with a "kind" and a "time".

    `sinks` (open_trackers: TensorBoard, W&B, trackio) get every record too, and on a resume
    (truncate_after) the records kept, so the trackers show what metrics.jsonl holds.
    """

    def __init__(self, path: Path, enabled: bool, sinks: Sequence = ()):
        self.path, self.enabled, self.sinks = path, enabled, list(sinks)

    def write(self, kind: str, **fields) -> None:
        if self.enabled:
            record = {"kind": kind, **fields, "time": utc_now()}
            append_jsonl(self.path, record)
            for sink in self.sinks:
                sink.log(record)

    def write_samples(self, samples_path: Path) -> None:
        """sample_generations.json's samples as a "samples" record (a table in the trackers)."""
        written = read_json_or(samples_path, {})
        rows = [{"prompt": str(sample.get("prompt")), "completion": sample.get("completion")}
                for sample in written.get("samples") or []]
        if rows:
            self.write("samples", step=written.get("step"), samples=rows)

    def restore(self, records: Sequence[dict], kind: str) -> None:
        """Write back the `kind` records (a checkpoint's history) that metrics.jsonl lost, e.g. a run whose
        files were not restored with its checkpoint, so its curves go on from where they were."""
        if not self.enabled:
            return
        present = {record["step"] for record in read_metrics(self.path) if record.get("kind") == kind}
        for record in records:
            if record["step"] not in present:
                self.write(kind, **record)

    def truncate_after(self, step: int) -> None:
        """Drop lines logged after `step` (a resumed run logs those steps again); the sinks rewind to the rest."""
        if not self.enabled:
            return
        kept_lines, kept = [], []
        lines = self.path.read_text(encoding="utf-8").splitlines() if self.path.exists() else []
        for line in lines:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by a kill
            if (record.get("step") or 0) <= step:
                kept_lines.append(line + "\n")
                kept.append(record)
        if self.path.exists():
            with atomic_open(self.path, "w") as handle:
                handle.writelines(kept_lines)
        for sink in self.sinks:
            sink.rewind(kept)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


class RunMetrics:
    """Numbers that must survive a restart: best validation loss, the latest evaluation, time trained,
    and every --eval-tasks record (metrics.jsonl's "tasks" records: a resumed run's curve goes on)."""

    def __init__(self):
        self.best_val_loss = math.inf
        self.best_step = 0
        self.last_eval: dict | None = None
        self.train_seconds = 0.0
        self.task_history: list[dict] = []

    def state_dict(self) -> dict:
        return {"best_val_loss": self.best_val_loss, "best_step": self.best_step, "last_eval": self.last_eval,
                "train_seconds": self.train_seconds, "task_history": self.task_history}

    def load_state_dict(self, state: dict) -> None:
        self.best_val_loss = float(state["best_val_loss"])
        self.best_step = int(state["best_step"])
        self.last_eval = state["last_eval"]
        self.train_seconds = float(state["train_seconds"])
        self.task_history = list(state["task_history"])


TASK_METRICS = ("acc", "acc_norm", "acc_bytes", "n", "chance")  # a "tasks" record's fields: NAME/acc, ...


def task_fields(scores: dict[str, dict]) -> dict[str, float]:
    """evaluation.loop_scores as "tasks" record fields: `NAME/acc`, `NAME/acc_norm`, ... (trackers: tasks/NAME/acc)."""
    return {f"{name}/{metric}": values[metric] for name, values in scores.items() for metric in TASK_METRICS}


def task_scores(record: dict) -> dict[str, dict]:
    """A "tasks" record's fields back as {NAME: {acc, acc_norm, acc_bytes, n, chance}}."""
    scores: dict[str, dict] = {}
    for key, value in record.items():
        name, _, metric = key.rpartition("/")
        if name and metric in TASK_METRICS:
            scores.setdefault(name, {})[metric] = value
    return scores


def last_train_loss(out: Path) -> float | None:
    """The loss of the last train record in metrics.jsonl (for the final line of a run without held-out data)."""
    losses = [record["loss"] for record in read_metrics(out / "metrics.jsonl")
              if record.get("kind") == "train" and isinstance(record.get("loss"), float)]
    return losses[-1] if losses else None



def draw_loss_curve(out: Path, progress: Progress) -> None:
    try:
        plot_loss_curve(out / "metrics.jsonl", out / "loss_curve.png", title=out.name)
    except Exception as error:
        progress.write(f"warning: loss_curve.png not drawn ({type(error).__name__}: {error})")



def accuracy_line(accuracy: dict) -> str:
    tasks = ", ".join(f"{name} {100 * task['accuracy']:.1f}% ({task['correct']}/{task['total']})"
                      for name, task in accuracy["by_task"].items())
    return (f"held-out task accuracy: {100 * accuracy['accuracy']:.1f}% ({accuracy['correct']}/{accuracy['total']})"
            f" | {tasks}")



def card_info(name: str, status: str, preset: str, step: int, total_steps: int, tokens: int, settings: dict,
              validation: dict | None, test: dict | None, accuracy: dict | None,
              usage_example: dict | None = None) -> dict:
    """What export_hf_model writes into the model card and training_provenance.json. `usage_example`:
    {"kind": "chat" or "text", "prompt": ...} from the corpus (usage_example_from), the card's example."""
    training = settings["training"]
    return {"model_name": name, "status": status, "preset": preset, "steps": step, "total_steps": total_steps,
            "tokens": tokens, "corpus_sha256": training["corpus_manifest_sha256"],
            "tokenizer_sha256": training["tokenizer_sha256"],
            "validation_loss": validation["loss"] if validation else None,
            "validation_perplexity": validation["perplexity"] if validation else None,
            "test_loss": test["loss"] if test else None, "test_perplexity": test["perplexity"] if test else None,
            "test_bits_per_byte": (test or {}).get("bits_per_byte"),
            "demo_accuracy": accuracy, "init_from": settings.get("init_from"), "settings": settings,
            "usage_example": usage_example}


def usage_example_from(corpus: Path, tokenizer) -> dict:
    """The model card's usage example from the corpus it was trained on: a held-out chat's first
    question, or the opening of a held-out text (held_out_prompts); a greeting when none reads."""
    try:
        kind, prompts = held_out_prompts(corpus, tokenizer, count=1)
    except (UserError, OSError, ValueError, KeyError):
        kind, prompts = "chat", []
    return {"kind": kind, "prompt": prompts[0] if prompts else "Hello!"}



def final_line(out: Path, status: str, record: dict) -> str:
    """The last line a person sees: where the run stands and what to do next."""
    line = f"{status}: step {record['step']}/{record['total_steps']}"
    if record.get("backup_complete") is not None:
        line += " | newest checkpoint " + ("backed up" if record["backup_complete"] else "NOT yet backed up")
    if status == store.NEEDS_RESUME:
        why = f" | {record['reason']}" if record.get("reason") else ""  # e.g. stopped by --max-hours budget
        return line + f"{why} | continue with: {record['resume_command']}"
    if record.get("test_loss") is not None:
        line += f" | test loss {record['test_loss']:.4f}{bits_per_byte_text(record.get('test') or {})}"
    elif (record.get("validation") or {}).get("loss") is not None:
        line += f" | validation loss {record['validation']['loss']:.4f} (no test split)"
    elif record.get("train_loss") is not None:
        line += f" | train loss {record['train_loss']:.4f} (no held-out split)"
    for name, scores in (record.get("tasks") or {}).items():
        at = f" at step {record['tasks_step']}" if record.get("tasks_step") not in (None, record["step"]) else ""
        line += f" | {name} acc {scores['acc']:.3f}{at} (chance {scores['chance']:.3f})"
    if record.get("task_accuracy"):
        line += f" | held-out accuracy {100 * record['task_accuracy']['accuracy']:.1f}%"
    if record.get("model_files"):
        line += f" | model: {out / 'model'} (sha256 in {out / 'run_status.json'})"
    missing = [name for name, state in (record.get("outputs") or {}).items() if state in ("pending", "failed")]
    if missing and record.get("report_command"):
        made = "model/ not made" if "model" in missing else "report incomplete"
        failed = ", ".join(record.get("report_errors") or {}) or "not made yet"
        line += (f" | {made} ({failed}: report_errors in {out / 'run_status.json'}) | make it again with: "
                 f"{record['report_command']}")
    return line


# ----------------------------------------------------------------------------------------------
# Greedy chat generation, samples and task accuracy.


def unwrap_model(model):
    """The plain Hugging Face model inside DDP / DataParallel and torch.compile wrappers."""
    while True:
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif hasattr(model, "module") and hasattr(model.module, "generate"):
            model = model.module
        else:
            return model


def stop_token_ids(tokenizer) -> list[int]:
    """[id of <|im_end|>, id of <eos>]: where a chat reply ends."""
    ids = [tokenizer.convert_tokens_to_ids(token) for token in (IM_END, EOS)]
    if any(token_id is None or token_id == tokenizer.unk_token_id for token_id in ids):
        raise UserError(f"tokenizer lacks {IM_END} or {EOS}; build the corpus with data.py")
    return ids


def as_messages(prompt: str | Sequence[dict]) -> list[dict]:
    """A user prompt string, or an already-built message list."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return list(prompt)


def cut_at_stop(token_ids: list[int], stop_ids: Iterable[int]) -> tuple[list[int], bool]:
    """The tokens before the first stop token, and whether there was one."""
    stops = set(stop_ids)
    for position, token_id in enumerate(token_ids):
        if token_id in stops:
            return token_ids[:position], True
    return token_ids, False


@dataclass(frozen=True)
class Sampling:
    """How replies are decoded: temperature 0 is greedy; above 0, sampled with top-p / top-k (0: off),
    reproducibly: the same seed, prompts and batch size give the same replies."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0

    def __post_init__(self):
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise UserError(f"--temperature must be 0 (greedy) or positive, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise UserError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise UserError(f"--top-k must not be negative (0: off), got {self.top_k}")

    def generation_options(self) -> dict:
        """GenerationConfig options: do_sample and, when sampling, temperature / top_p / top_k."""
        if self.temperature == 0:
            return {"do_sample": False}
        return {"do_sample": True, "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k or None}

    def describe(self) -> dict:
        """What sample_generations.json records as its decoding."""
        if self.temperature == 0:
            return {"decoding": "greedy"}
        return {"decoding": "sampled", **dataclasses.asdict(self)}


GREEDY = Sampling()


@contextlib.contextmanager
def seeded_sampling(sampling: Sampling, batch: int, device):
    """Torch's RNG seeded from (seed, batch) inside the block, the caller's RNG state restored after."""
    import torch

    devices = [device] if getattr(device, "type", None) == "cuda" else []
    with torch.random.fork_rng(devices=devices, enabled=sampling.temperature > 0):
        if sampling.temperature > 0:
            torch.manual_seed(sampling.seed * 1_000_003 + batch)
        yield


def generate_chat_details(model, tokenizer, prompts: Sequence[str | Sequence[dict]], max_new_tokens: int = 64,
                          device=None, batch_size: int = 16, sampling: Sampling = GREEDY) -> list[dict]:
    """Replies to `prompts` through the chat template (greedy unless `sampling` says otherwise), as dicts.

    Each dict: completion (text before <|im_end|> / <eos>, special tokens such as <think> kept),
    stopped (a stop token was produced), new_tokens. Prompts are batched by length with left
    padding; the result equals one-at-a-time decoding. New tokens are capped so prompt plus reply
    fit the model's context.
    """
    import torch
    from transformers import GenerationConfig

    model = unwrap_model(model)
    device = torch.device(device) if device is not None else next(model.parameters()).device
    stops = stop_token_ids(tokenizer)
    context = getattr(model.config, "max_position_embeddings", None)
    encoded = []
    for prompt in prompts:
        text = tokenizer.apply_chat_template(as_messages(prompt), add_generation_prompt=True, tokenize=False)
        encoded.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    order = sorted(range(len(encoded)), key=lambda index: len(encoded[index]))
    results: list[dict] = [{}] * len(encoded)

    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(order), batch_size):
            chunk = order[start:start + batch_size]
            batch = tokenizer.pad({"input_ids": [encoded[index] for index in chunk]}, padding=True,
                                  padding_side="left", return_tensors="pt").to(device)
            prompt_length = batch["input_ids"].shape[1]
            new_tokens = max_new_tokens if context is None else min(max_new_tokens, context - prompt_length)
            if new_tokens < 1:
                raise UserError(f"a prompt of {prompt_length} tokens leaves no room in the model's context {context}")
            config = GenerationConfig(max_new_tokens=new_tokens, num_beams=1, eos_token_id=stops,
                                      pad_token_id=tokenizer.pad_token_id, use_cache=True,
                                      **sampling.generation_options())
            # the stock "sdpa" attention: the training kernels take no padding mask (attention.exportable)
            with torch.no_grad(), seeded_sampling(sampling, start, device), attention.exportable(model):
                output = model.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                        generation_config=config)
            for index, row in zip(chunk, output[:, prompt_length:].tolist()):
                reply, stopped = cut_at_stop(row, stops)
                text = tokenizer.decode(reply, skip_special_tokens=False, clean_up_tokenization_spaces=False)
                results[index] = {"completion": text, "stopped": stopped, "new_tokens": len(reply)}
    finally:
        model.train(was_training)
    return results


def generate_chat(model, tokenizer, prompts: Sequence[str | Sequence[dict]], max_new_tokens: int = 64,
                  device=None, batch_size: int = 16, sampling: Sampling = GREEDY) -> list[str]:
    """Replies (text before <|im_end|> / <eos>) to user prompts, through the chat template; greedy by default."""
    details = generate_chat_details(model, tokenizer, prompts, max_new_tokens, device, batch_size, sampling)
    return [detail["completion"] for detail in details]


def generate_text_details(model, tokenizer, prompts: Sequence[str], max_new_tokens: int = 64,
                          device=None, sampling: Sampling = GREEDY) -> list[dict]:
    """Plain-text continuations of `prompts` (no chat template; greedy unless `sampling` says otherwise),
    one prompt at a time: dicts {completion, stopped (at <eos>), new_tokens}, like generate_chat_details."""
    import torch
    from transformers import GenerationConfig

    model = unwrap_model(model)
    device = torch.device(device) if device is not None else next(model.parameters()).device
    eos = tokenizer.convert_tokens_to_ids(EOS)
    context = getattr(model.config, "max_position_embeddings", None)
    results = []
    was_training = model.training
    model.eval()
    try:
        for number, prompt in enumerate(prompts):
            ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            if context is not None:
                ids = ids[-(context - 1):]
            new_tokens = max_new_tokens if context is None else min(max_new_tokens, context - len(ids))
            config = GenerationConfig(max_new_tokens=new_tokens, num_beams=1, eos_token_id=[eos],
                                      pad_token_id=tokenizer.pad_token_id, use_cache=True,
                                      **sampling.generation_options())
            with torch.no_grad(), seeded_sampling(sampling, number, device), attention.exportable(model):
                output = model.generate(input_ids=torch.tensor([ids], device=device),
                                        attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=device),
                                        generation_config=config)
            reply, stopped = cut_at_stop(output[0, len(ids):].tolist(), [eos])
            text = tokenizer.decode(reply, skip_special_tokens=False, clean_up_tokenization_spaces=False)
            results.append({"completion": text, "stopped": stopped, "new_tokens": len(reply)})
    finally:
        model.train(was_training)
    return results


def held_out_prompts(corpus: str | os.PathLike, tokenizer, count: int = 5, opening_tokens: int = 24,
                     documents_read: int = 200) -> tuple[str, list[str]]:
    """("chat" or "text", prompts) that fit a corpus: the first user turns of its held-out chats, or
    the openings of its held-out texts (its first `opening_tokens` tokens) to be continued. The test
    split is read first, then validation, then train (a corpus without held-out documents)."""
    corpus = Path(corpus)
    manifest = read_json(corpus / "corpus_manifest.json", what="corpus manifest")
    eos, im_start = (tokenizer.convert_tokens_to_ids(token) for token in (EOS, IM_START))
    dtype = np.dtype(manifest["dtype"]).newbyteorder("<")
    documents: list[list[int]] = []
    for split in ("test", "validation", "train"):
        current: list[int] = []
        for entry in manifest["splits"].get(split, {}).get("files", []):
            for token in np.fromfile(corpus / entry["name"], dtype=dtype).tolist():
                if token != eos:
                    current.append(token)
                    continue
                documents.append(current)
                current = []
                if len(documents) >= documents_read:
                    break
            if len(documents) >= documents_read:
                break
        if documents:
            break
    chats = [doc for doc in documents if doc[:1] == [im_start]]
    if len(chats) * 2 > len(documents):
        user_turn = re.compile(re.escape(IM_START) + r"user\n(.*?)" + re.escape(IM_END), re.S)
        found = (user_turn.search(tokenizer.decode(doc, skip_special_tokens=False)) for doc in chats)
        prompts = [match.group(1).strip() for match in found if match and match.group(1).strip()]
        return "chat", list(dict.fromkeys(prompts))[:count] or list(DEFAULT_PROMPTS)
    openings = [tokenizer.decode(doc[:opening_tokens]) for doc in documents if doc and doc[:1] != [im_start]]
    return "text", list(dict.fromkeys(opening for opening in openings if opening.strip()))[:count]


def generate_samples(model, tokenizer, out_path: str | os.PathLike, prompts: Sequence[str] = tuple(DEFAULT_PROMPTS),
                     max_new_tokens: int = 96, device=None, step: int | None = None, text: bool = False,
                     sampling: Sampling = GREEDY) -> dict:
    """Write sample_generations.json (replies to `prompts`, or with `text` their plain-text
    continuations; greedy unless `sampling` says otherwise) atomically; never raises.

    Returns what it wrote: {"format_version", "time", "step", "settings", "samples": [{prompt,
    completion, stopped, new_tokens}], "error"}; a failure (generation or writing) is in "error".
    """
    record: dict[str, Any] = {
        "format_version": 1,
        "time": utc_now(),
        "step": step,
        "settings": {**sampling.describe(), "chat_template": not text, "max_new_tokens": max_new_tokens,
                     "stop_tokens": [EOS] if text else [IM_END, EOS]},
        "samples": [],
        "error": None,
    }
    try:
        generate = generate_text_details if text else generate_chat_details
        details = generate(model, tokenizer, list(prompts), max_new_tokens, device, sampling=sampling)
        record["samples"] = [{"prompt": prompt, **detail} for prompt, detail in zip(prompts, details)]
    except Exception as error:  # samples are a courtesy: a failure must never lose the run
        record["error"] = f"generation failed: {type(error).__name__}: {error}"
    try:
        atomic_write_json(out_path, record)
    except Exception as error:
        record["error"] = (record["error"] + "; " if record["error"] else "") + (
            f"writing {out_path} failed: {type(error).__name__}: {error}"
        )
    return record


def read_eval_examples(path: str | os.PathLike, limit: int | None = None) -> list[dict]:
    """Task examples from a .jsonl file, or from every *.jsonl in a folder (sorted by name).

    Each line: {"prompt": str, "answer": str|number, "task": str}; `task` defaults to the file's
    stem. Returns the first `limit` examples (all when None).
    """
    root = Path(path)
    if not root.exists():
        raise UserError(f"eval set not found: {root}")
    files = sorted(root.glob("*.jsonl")) if root.is_dir() else [root]
    if not files:
        raise UserError(f"eval folder {root} holds no *.jsonl files")
    examples = []
    for file in files:
        for number, item in jsonl_records(file):
            if not isinstance(item, dict) or not isinstance(item.get("prompt"), str) or "answer" not in item:
                raise UserError(f'{file}:{number}: expected an object with "prompt" (text) and "answer"')
            examples.append({"prompt": item["prompt"], "answer": str(item["answer"]).strip(),
                             "task": str(item.get("task", file.stem))})
            if limit is not None and len(examples) >= limit:
                return examples
    if not examples:
        raise UserError(f"eval set {root} has no examples")
    return examples


def extract_final_answer(completion: str) -> str:
    """The answer part of a reply: the text after the last </think> when there is one, stripped."""
    if THINK_CLOSE in completion:
        completion = completion.rsplit(THINK_CLOSE, 1)[1]
    return completion.strip()


def score_answers(examples: Sequence[dict], completions: Sequence[str], max_wrong_examples: int = 5) -> dict:
    """Exact-match accuracy of `completions` against the examples' answers, overall and per task."""
    by_task: dict[str, dict] = {}
    wrong = []
    correct_total = 0
    for example, completion in zip(examples, completions, strict=True):
        predicted = extract_final_answer(completion)
        correct = predicted == example["answer"]
        correct_total += correct
        task = by_task.setdefault(example["task"], {"correct": 0, "total": 0})
        task["correct"] += correct
        task["total"] += 1
        if not correct and len(wrong) < max_wrong_examples:
            wrong.append({**example, "predicted": predicted, "completion": completion})
    for task in by_task.values():
        task["accuracy"] = task["correct"] / task["total"]
    total = len(examples)
    return {"accuracy": correct_total / total if total else 0.0, "correct": correct_total, "total": total,
            "by_task": dict(sorted(by_task.items())), "wrong_examples": wrong}


def task_accuracy(model, tokenizer, eval_jsonl: str | os.PathLike, device=None, limit: int | None = None,
                  max_new_tokens: int = 96, batch_size: int = 32) -> dict:
    """Held-out task accuracy: greedy replies through the chat template, exact match on the answer.

    Returns {"accuracy", "correct", "total", "by_task": {task: {accuracy, correct, total}},
    "wrong_examples": [...up to 5], "eval_path", "settings"}.
    """
    examples = read_eval_examples(eval_jsonl, limit)
    completions = generate_chat(model, tokenizer, [example["prompt"] for example in examples], max_new_tokens,
                                device, batch_size)
    result = score_answers(examples, completions)
    result["eval_path"] = str(eval_jsonl)
    result["settings"] = {"decoding": "greedy", "max_new_tokens": max_new_tokens, "limit": limit}
    return result


# ----------------------------------------------------------------------------------------------
# The Hugging Face export: RUN/model/, built beside and swapped in.


def generation_config_for(tokenizer, context: int | None = None):
    """Greedy defaults that stop at <|im_end|> or <eos>, pad 0, bos 1.

    max_new_tokens leaves a quarter of the model's context for the prompt (96 of 128), at most 256.
    """
    from transformers import GenerationConfig

    max_new_tokens = 256 if context is None else max(1, min(256, context - context // 4))
    return GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=stop_token_ids(tokenizer),
                            pad_token_id=tokenizer.pad_token_id, do_sample=False, num_beams=1,
                            max_new_tokens=max_new_tokens)


@contextlib.contextmanager
def quiet_transformers_progress():
    """No "Writing model shards" / "Loading weights" bars from transformers inside the block."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def architecture_of(model) -> dict:
    config = model.config
    return {
        "model_type": config.model_type,
        "layers": config.num_hidden_layers,
        "hidden": config.hidden_size,
        "intermediate": config.intermediate_size,
        "heads": config.num_attention_heads,
        "kv_heads": config.num_key_value_heads,
        "head_dim": getattr(config, "head_dim", config.hidden_size // config.num_attention_heads),
        "context": config.max_position_embeddings,
        "vocab_size": config.vocab_size,
        "tied_embeddings": bool(getattr(config, "tie_word_embeddings", False)),
        "parameters": sum(parameter.numel() for parameter in model.parameters()),
    }


def _number(value, digits: int = 4) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def _accuracy_line(accuracy) -> str | None:
    """A demo-accuracy sentence from a task_accuracy() dict or a bare fraction."""
    if accuracy is None:
        return None
    if isinstance(accuracy, dict):
        tasks = ", ".join(f"{name} {100 * task['accuracy']:.1f}% ({task['correct']}/{task['total']})"
                          for name, task in accuracy.get("by_task", {}).items())
        line = f"{100 * accuracy['accuracy']:.1f}% exact match ({accuracy['correct']}/{accuracy['total']})"
        return line + (f"; by task: {tasks}" if tasks else "")
    return f"{100 * float(accuracy):.1f}% exact match"


def _lineage_lines(lineage: dict | None) -> list[str]:
    """The model card's lines on the weights a run started from (train.py --init-from)."""
    if not lineage:
        return []
    return [f"- Initialized from: `{lineage.get('source')}` ({lineage.get('kind')}, step {lineage.get('step')}, "
            f"sha256 `{lineage.get('sha256')}`), itself trained on corpus manifest sha256 "
            f"`{lineage.get('corpus_manifest_sha256') or 'n/a'}`"]


def _mixture_lines(mixture: dict | None) -> list[str]:
    """The model card's lines on a train.py --data mixture: its sources and each phase's weights."""
    if not mixture:
        return []
    sources = ", ".join(f"`{source['name']}`" + (f" (label `{source['label']}`)" if source.get("label") else "")
                        + f" corpus manifest sha256 `{source['corpus_manifest_sha256'][:16]}`"
                        for source in mixture["sources"])
    starts = {"0": "from the start", "decay": "from the decay"}
    phases = "; ".join(starts.get(phase["start"], f"from step {phase['start']}")
                       + ": " + ", ".join(f"{name} {weight:g}" for name, weight in phase["weights"].items())
                       for phase in mixture["phases"])
    return [f"- Mixture of sources: {sources}", f"- Mixture weights: {phases}"]


def model_card(architecture: dict, card_info: dict) -> str:
    """README.md for RUN/model/: what the model is, how it was made, how to load it, what it cannot do."""
    return "\n".join([*_card_header(architecture, card_info), *_card_provenance(card_info),
                      *_card_evaluation(architecture, card_info), *_card_limitations(architecture, card_info)])


def _card_header(arch: dict, card_info: dict) -> list[str]:
    """The card's front matter, title, status and architecture."""
    name = card_info.get("model_name", "tinyllm")
    status = card_info.get("status", "UNKNOWN")
    steps, total_steps = card_info.get("steps"), card_info.get("total_steps")
    tokens = card_info.get("tokens")
    finished = status == "COMPLETE"
    return [
        "---",
        "library_name: transformers",
        "pipeline_tag: text-generation",
        "license: other",
        "tags: [qwen3, tinyllm, " + ("continued]" if card_info.get("init_from") else "from-scratch]"),
        "---",
        "",
        f"# {name}",
        "",
        f"A {human_count(arch['parameters'])}-parameter Qwen3-architecture causal language model trained "
        + ("with tinyllm, starting from the weights named under Data and provenance (its own byte-level BPE "
           "tokenizer)." if card_info.get("init_from") else
           "from scratch with tinyllm (random initialization, its own byte-level BPE tokenizer; no pretrained "
           "weights were loaded)."),
        "",
        "## Status",
        "",
        f"- Status: **{status}**" + ("" if finished else " (training did not finish; this is an intermediate "
                                     "checkpoint)"),
        f"- Optimizer steps: {_number(steps)}" + (f" of {total_steps:,}" if isinstance(total_steps, int) else ""),
        f"- Tokens trained on: {f'{tokens:,}' if isinstance(tokens, int) else _number(tokens)}",
        f"- Preset: {card_info.get('preset', 'n/a')}",
        f"- Exported: {utc_now()}",
        "",
        "## Architecture",
        "",
        f"- Parameters: {arch['parameters']:,} (tied input/output embedding counted once)",
        f"- {arch['layers']} decoder layers, hidden size {arch['hidden']}, MLP (SwiGLU) size {arch['intermediate']}",
        f"- {arch['heads']} query heads and {arch['kv_heads']} key/value heads of dimension {arch['head_dim']}, "
        "Q/K RMSNorm, RoPE",
        f"- Context: {arch['context']} tokens; vocabulary: {arch['vocab_size']:,} tokens",
        "",
    ]


def _card_provenance(card_info: dict) -> list[str]:
    return [
        "## Data and provenance",
        "",
        f"- Corpus manifest sha256: `{card_info.get('corpus_sha256', 'n/a')}`",
        f"- Tokenizer sha256: `{card_info.get('tokenizer_sha256', 'n/a')}`",
        *_lineage_lines(card_info.get("init_from")),
        *_mixture_lines((card_info.get("settings") or {}).get("training", {}).get("mixture")),
        *_budget_lines((card_info.get("settings") or {}).get("budget")),
        "- `training_provenance.json` in this folder holds these"
        + (" and the training settings." if "settings" in card_info else "."),
        "",
    ]


def _budget_lines(plan: dict | None) -> list[str]:
    """The --budget plan the run was made by (budget.Plan's record), and why."""
    if not plan:
        return []
    return [f"- Planned by {plan['summary']}; {plan['why']}"]


def _card_evaluation(arch: dict, card_info: dict) -> list[str]:
    """The held-out losses (and the demo's accuracy), then how to use the model."""
    accuracy = _accuracy_line(card_info.get("demo_accuracy"))
    lines = [
        "## Evaluation",
        "",
        f"- Validation loss: {_number(card_info.get('validation_loss'))} "
        f"(perplexity {_number(card_info.get('validation_perplexity'), 2)})",
        f"- Test loss: {_number(card_info.get('test_loss'))} "
        f"(perplexity {_number(card_info.get('test_perplexity'), 2)}, "
        f"{_number(card_info.get('test_bits_per_byte'))} bits per byte)",
    ]
    if accuracy:
        lines.append(f"- Held-out demo task accuracy (greedy, chat template): {accuracy}")
    return lines + [
        "",
        "Losses are mean cross-entropy in nats per token on the corpus's held-out splits; bits per byte "
        "divide the summed loss by ln 2 and the UTF-8 bytes of the scored text, comparable across tokenizers. "
        "A low loss is "
        "not task accuracy; inspect `sample_generations.json` in the run folder and evaluate on your own tasks.",
        "",
        "## How to use",
        "",
        *usage_lines(card_info.get("usage_example") or {"kind": "chat", "prompt": "Hello!"}),
        "",
        "The chat template is ChatML (`<|im_start|>role ... <|im_end|>`); optional reasoning appears "
        f"inside `<think> ... </think>` before the answer. Keep prompt plus reply within {arch['context']} tokens.",
        "",
    ]


def _card_limitations(arch: dict, card_info: dict) -> list[str]:
    tokens = card_info.get("tokens")
    lines = [
        "## Limitations",
        "",
        f"- A {human_count(arch['parameters'])}-parameter model trained on "
        f"{human_count(tokens) if isinstance(tokens, (int, float)) else 'an unknown number of'} tokens: expect "
        "factual errors, repetition and unreliable reasoning outside the narrow data it saw.",
        "- It knows only its training corpus; it was not instruction-tuned or aligned beyond the chat "
        "examples in that corpus, and has no safety training.",
        "- The Qwen3 architecture does not bring any Qwen3 model's abilities: the weights are "
        + ("tinyllm's own (see Initialized from)." if card_info.get("init_from") else "from scratch."),
    ]
    if card_info.get("status", "UNKNOWN") != "COMPLETE":
        lines.append("- Training stopped before its planned end; quality is below what the full run would give.")
    return lines + [
        "- The license of these weights follows the terms of the training data; set `license` above "
        "before you publish.",
        "",
    ]


USAGE_PROMPT_CHARACTERS = 300  # a longer corpus prompt is cut in the card's example


def usage_lines(example: dict) -> list[str]:
    """The card's "How to use" code: the chat template for a chat corpus, plain continuation for text."""
    prompt = str(example.get("prompt", ""))[:USAGE_PROMPT_CHARACTERS]
    literal = json.dumps(prompt, ensure_ascii=False)  # a JSON string is a Python string literal
    load = ["```python", "from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline", "",
            'tokenizer = AutoTokenizer.from_pretrained("path/to/model")',
            'model = AutoModelForCausalLM.from_pretrained("path/to/model")']
    if example.get("kind") == "text":
        return [*load, f"inputs = tokenizer({literal}, return_tensors=\"pt\")  # an opening from the corpus",
                "output = model.generate(**inputs, max_new_tokens=64)  # greedy; stops at <eos>",
                "print(tokenizer.decode(output[0], skip_special_tokens=True))", "",
                'generate = pipeline("text-generation", model="path/to/model")',
                f'print(generate({literal}, max_new_tokens=64)[0]["generated_text"])', "```"]
    return [*load, f'messages = [{{"role": "user", "content": {literal}}}]  # a question from the corpus',
            "inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors=\"pt\",",
            "                                       return_dict=True)",
            "output = model.generate(**inputs, max_new_tokens=64)  # greedy; stops at <|im_end|> or <eos>",
            'print(tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))', "",
            'chat = pipeline("text-generation", model="path/to/model")',
            'print(chat(messages, max_new_tokens=64)[0]["generated_text"][-1]["content"])', "```"]


def write_model_card(folder: Path, architecture: dict, card_info: dict) -> None:
    (folder / "README.md").write_text(model_card(architecture, card_info), encoding="utf-8")


def write_provenance(folder: Path, architecture: dict, card_info: dict) -> None:
    """training_provenance.json: card_info (corpus_sha256, tokenizer_sha256, steps, tokens, ...) plus the shape."""
    import torch
    import transformers

    provenance = {"format_version": 1, "exported_utc": utc_now(), **json_safe(card_info),
                  "architecture": architecture, "transformers_version": transformers.__version__,
                  "torch_version": torch.__version__}
    (folder / "training_provenance.json").write_text(json.dumps(provenance, indent=2) + "\n", encoding="utf-8")


def export_hf_model(model, tokenizer, out_dir: str | os.PathLike, card_info: dict) -> dict[str, str]:
    """Write `out_dir` as a Hugging Face model folder and return {relative filename: sha256}.

    Files: config.json, model.safetensors, the tokenizer (chat template included),
    generation_config.json (greedy, eos = [<|im_end|>, <eos>], pad 0, bos 1), README.md (model
    card from `card_info`, see model_card) and training_provenance.json. The folder is built
    beside `out_dir` and swapped in only when complete; a failure leaves the old folder as it was.
    """
    model = unwrap_model(model)
    with atomic_folder(out_dir) as temp:  # safetensors writes owner-only files: atomic_folder makes them plain
        architecture = architecture_of(model)
        with quiet_transformers_progress():
            model.save_pretrained(temp, max_shard_size="100GB")  # transformers 5 always writes safetensors
        tokenizer.save_pretrained(temp)
        generation_config_for(tokenizer, getattr(model.config, "max_position_embeddings", None)).save_pretrained(temp)
        write_model_card(temp, architecture, card_info)
        write_provenance(temp, architecture, card_info)
        hashes = {path.relative_to(temp).as_posix(): sha256_file(path)
                  for path in sorted(p for p in temp.rglob("*") if p.is_file())}
    return hashes


def export_checkpoint(checkpoint: dict, path: Path, out: Path, corpus: Path, device) -> None:
    """`train.py --export-only`: OUT/model/ from `checkpoint` (read from `path`), trained on `corpus`; the card
    takes the test loss run_status.json has for the same step, and the held-out accuracy is measured."""
    import data
    import model_config

    recorded = checkpoint["settings"]
    training = recorded["training"]
    manifest = data.load_manifest(corpus)
    tokenizer = data.load_tokenizer(corpus / "tokenizer")
    if manifest.get("tokenizer_sha256") != training["tokenizer_sha256"]:
        raise UserError(f"the tokenizer of {corpus} is not the one checkpoint {path} was trained with; "
                        "pass that corpus with --data")
    preset = model_config.Preset(**{name: training[f"model.{name}"] for name in model_config.OVERRIDABLE_FIELDS})
    model = model_config.build_model(preset, training["vocab_size"], manifest.get("special_tokens", {}))
    model.load_state_dict(checkpoint["model"])
    model.to(device).eval()
    step, total = int(checkpoint["step"]), int(training["total_steps"])
    status = store.COMPLETE if step >= total else store.NEEDS_RESUME
    previous = read_json(out / "run_status.json") if (out / "run_status.json").is_file() else {}
    test = previous.get("test") if previous.get("step") == step else None
    accuracy = None
    if (corpus / "eval").is_dir():
        result = task_accuracy(model, tokenizer, corpus / "eval", device)
        accuracy = {key: result[key] for key in ("accuracy", "correct", "total", "by_task")}
        say(accuracy_line(result))
    info_card = card_info(out.name, status, training["preset"], step, total,
                          step * int(training["tokens_per_step"]), recorded,
                          checkpoint.get("metrics", {}).get("last_eval"), test, accuracy,
                          usage_example_from(corpus, tokenizer))
    with attention.exportable(model):
        model_files = export_hf_model(model, tokenizer, out / "model", info_card)
    print(f"exported {path} (step {step}/{total}, {status}) to {out / 'model'}: "
          + ", ".join(f"{name} {sha[:12]}" for name, sha in model_files.items() if name.endswith(".safetensors")),
          flush=True)


# ----------------------------------------------------------------------------------------------
# Publishing a finished run: the Hub, or any backup URL, with the same flat layout.

PUBLISHED_RUN_FILES = ("training_settings.json", "loss_curve.png")  # beside the model's files and the GGUFs


def publish_layout(run: Path) -> dict[str, Path]:
    """{name in the repository: local file}: RUN/model/'s files at the root (so from_pretrained("USER/REPO")
    and the Hub's model card work), the GGUF files export_gguf.py wrote beside model/, the run's settings
    and loss curve."""
    model = run / "model"
    if not (model / "config.json").is_file():
        raise UserError(f"{model} has no exported model (config.json): train.py exports it at the end of a run, "
                        f"or `python train.py --data CORPUS --out {run} --export-only`")
    files = {path.relative_to(model).as_posix(): path for path in sorted(model.rglob("*")) if path.is_file()}
    files.update({path.name: path for path in sorted(run.glob("*.gguf"))})
    files.update({name: run / name for name in PUBLISHED_RUN_FILES if (run / name).is_file()})
    return files


def git_blob_sha1(path: Path) -> str:
    """The id git (and so the Hub) gives a file stored without LFS."""
    digest = hashlib.sha1(f"blob {path.stat().st_size}\0".encode())
    with open(path, "rb") as handle:
        while block := handle.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def hub_mismatches(api, repo_id: str, files: dict[str, Path], prefix: str) -> list[str]:
    """The files whose copy on the Hub is not the local one: the LFS sha256 the Hub computed, or the git
    blob id of a file stored without LFS."""
    remote = {info.path: info for info in api.get_paths_info(repo_id, [f"{prefix}{name}" for name in files],
                                                              repo_type="model")}
    wrong = []
    for name, path in files.items():
        info = remote.get(f"{prefix}{name}")
        lfs = getattr(info, "lfs", None)
        if info is None or getattr(info, "size", None) != path.stat().st_size:
            wrong.append(name)
        elif (lfs.sha256 if lfs is not None else info.blob_id) != (sha256_file(path) if lfs is not None
                                                                    else git_blob_sha1(path)):
            wrong.append(name)
    return wrong


def publish_to_hub(files: dict[str, Path], url: str, public: bool, api=None) -> str:
    """hf://USER/REPO[/FOLDER]: a model repository (private unless `public`), all files in one commit, then
    verified. The token comes from HF_TOKEN or `hf auth login` and is never printed."""
    from huggingface_hub import CommitOperationAdd, HfApi

    parts = url.split("://", 1)[1].strip("/").split("/")
    if len(parts) < 2 or not all(parts[:2]):
        raise UserError(f"publish: {url} is not hf://USER/REPO")
    repo_id, prefix = "/".join(parts[:2]), "".join(f"{part}/" for part in parts[2:] if part)
    api = api or HfApi()
    try:
        api.create_repo(repo_id, repo_type="model", private=not public, exist_ok=True)
        operations = [CommitOperationAdd(path_in_repo=f"{prefix}{name}", path_or_fileobj=str(path))
                      for name, path in files.items()]
        api.create_commit(repo_id, operations, commit_message="tinyllm: publish the model", repo_type="model")
        wrong = hub_mismatches(api, repo_id, files, prefix)
    except Exception as error:  # huggingface_hub's errors name the repo and the HTTP status, not the token
        raise UserError(f"publishing to hf://{repo_id} failed: {type(error).__name__}: {error}") from None
    if wrong:
        raise UserError(f"publish: the copy on hf://{repo_id} of {', '.join(wrong)} differs from the local file")
    return f"https://huggingface.co/{repo_id}"


def publish_to_store(files: dict[str, Path], url: str) -> str:
    """A folder, s3:// or gs:// URL: each file uploaded and verified as backups are (checkpoint_cloud)."""
    fs, root = checkpoint_cloud.open_remote(url)
    shown = checkpoint_cloud.printable_backup_url(url) or "the publish URL"
    try:
        for name, path in files.items():
            checkpoint_cloud.upload_verified(fs, path, f"{root.rstrip('/')}/{name}")
    except checkpoint_cloud.VerificationError as error:
        raise UserError(f"publish to {shown}: {error}") from None
    except OSError as error:
        raise UserError(f"publish to {shown} failed: {type(error).__name__}: {error}") from None
    return shown


def publish(run: str | os.PathLike, url: str, public: bool = False, api=None) -> str:
    """Upload a run's model (see publish_layout) to `url`; returns where it went (printable)."""
    run = Path(run)
    files = publish_layout(run)
    status = read_json_or(run / "run_status.json", {}).get("status")
    if status != store.COMPLETE:
        print(f"warning: {run} is {status or 'without a run_status.json'}, not COMPLETE: its model card says so",
              file=sys.stderr, flush=True)
    if url.lower().startswith("hf://"):
        return publish_to_hub(files, url, public, api)
    if public:
        raise UserError("publish --public is for hf:// repositories (a store's access is its own setting)")
    return publish_to_store(files, url)


# ----------------------------------------------------------------------------------------------
# Command line: redraw a run's curve, evaluate or sample an exported model.


def report_run(training, out: Path, status: str, test: dict | None, settings: dict) -> dict:
    """Loss curve, samples, held-out accuracy and RUN/model (rank 0). Failures are recorded, never raised.

    Samples and accuracy only for a complete run; a resumable stop exports the current weights
    (the model card says the run is unfinished). `training`: train.Training; `settings`: its recorded ones.
    """
    import data

    errors: dict[str, str] = {}
    corpus = training.corpus

    def attempt(name: str, function):
        try:
            return function()
        except Exception as error:  # the checkpoint is safe; a report failure must not lose the run
            errors[name] = f"{type(error).__name__}: {error}"
            say(f"{name} failed ({errors[name]}); the checkpoints are intact", warning=True)
            return None

    found = {}
    tokenizer = attempt("tokenizer", lambda: data.load_tokenizer(corpus / "tokenizer"))
    attempt("loss_curve", lambda: plot_loss_curve(out / "metrics.jsonl", out / "loss_curve.png",
                                                         title=out.name))
    accuracy = None
    if status == store.COMPLETE and tokenizer is not None:
        # the demo's arithmetic prompts for the demo; else prompts that fit the corpus: its held-out
        # chats' first questions, or the openings of its held-out texts to continue
        kind, prompts = ("chat", DEFAULT_PROMPTS) if (corpus / "eval").is_dir() else \
            attempt("sample_prompts", lambda: held_out_prompts(corpus, tokenizer)) or ("chat", [])
        samples = generate_samples(training.model, tokenizer, out / "sample_generations.json",
                                          prompts=prompts, step=training.step, text=kind == "text",
                                          sampling=sampling_from(vars(training.session), "sample_"))
        if samples["error"]:
            errors["samples"] = samples["error"]
        if (corpus / "eval").is_dir():
            accuracy = attempt("task_accuracy", lambda: task_accuracy(training.model, tokenizer,
                                                                             corpus / "eval", training.device))
        if accuracy is not None:
            found["task_accuracy"] = {key: accuracy[key] for key in ("accuracy", "correct", "total", "by_task")}
            say(accuracy_line(accuracy))
    if tokenizer is not None:
        info = card_info(out.name, status, training.run.preset, training.step, training.total_steps,
                         training.step * training.tokens_per_step, settings,
                         training.metrics.last_eval, test, found.get("task_accuracy"),
                         usage_example_from(corpus, tokenizer))
        with attention.exportable(training.model):
            model_files = attempt("export", lambda: export_hf_model(training.model, tokenizer, out / "model", info))
        if model_files is not None:
            found["model_files"] = model_files
            found["model_dir"] = str(out / "model")
    found["report_errors"] = errors or None
    return found



def load_exported(model_dir: str, device: str):
    """An exported RUN/model/ folder as (model, tokenizer), with a clear error when it does not load."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    missing = [name for name in ("config.json", "tokenizer.json") if not (Path(model_dir) / name).is_file()]
    if missing:
        raise UserError(f"{model_dir} is not an exported model folder (no {', '.join(missing)}); "
                        "train.py writes one to RUN/model")
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        with quiet_transformers_progress():
            model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).to(device)
    except (OSError, ValueError) as error:
        raise UserError(f"{model_dir} does not load: {type(error).__name__}: {str(error).splitlines()[0]}") from None
    return model, tokenizer


def add_sampling_args(parser, prefix: str = "") -> None:
    """--temperature / --top-p / --top-k / --seed (train.py: --sample-temperature ...), read by sampling_from."""
    parser.add_argument(f"--{prefix}temperature", type=float, default=0.0, help="0: greedy; above 0: sampled")
    parser.add_argument(f"--{prefix}top-p", type=float, default=1.0, help="nucleus sampling: keep this much "
                        "probability mass (1: all)")
    parser.add_argument(f"--{prefix}top-k", type=int, default=0, help="keep the k likeliest tokens (0: all)")
    parser.add_argument(f"--{prefix}seed", type=int, default=0, help="seed of the sampling (reproducible replies)")


def sampling_from(values: dict, prefix: str = "") -> Sampling:
    """The Sampling of add_sampling_args's options in `values` (vars(args) or a settings dict)."""
    try:
        return Sampling(*(values[f"{prefix}{name}"] for name in ("temperature", "top_p", "top_k", "seed")))
    except UserError as error:
        raise UserError(str(error).replace("--", "--" + prefix.replace("_", "-"), 1)) from None


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    plot = commands.add_parser("plot", help="redraw RUN/loss_curve.png from RUN/metrics.jsonl",
                               formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    plot.add_argument("run", help="run folder holding metrics.jsonl")
    plot.add_argument("--out", help="PNG to write (default: RUN/loss_curve.png)")
    evaluate = commands.add_parser("evaluate", help="benchmark scores of an exported model (lm-eval tasks, "
                                   "local multiple-choice and exact-match task files)",
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    evaluate.add_argument("model", help="run folder (RUN, scores go to RUN/eval/ and the model card) or RUN/model")
    evaluate.add_argument("--tasks", nargs="+", required=True,
                          help="lm-eval task names (hellaswag, arc_easy, ...), task .jsonl files or folders of them")
    evaluate.add_argument("--limit", type=int, help="score a seeded subsample of N items per task")
    evaluate.add_argument("--seed", type=int, default=evaluation.DEFAULT_SEED, help="seed of the --limit subsample")
    evaluate.add_argument("--batch-size", type=int, default=32)
    evaluate.add_argument("--max-new-tokens", type=int, default=96, help="reply length of exact-match tasks")
    evaluate.add_argument("--device", default="cpu")
    evaluate.add_argument("--json", help="also write the scores to this JSON file")
    samples = commands.add_parser("samples", help="chat replies (or --text continuations) of an exported model",
                                  formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    samples.add_argument("model", help="exported model folder (RUN/model)")
    samples.add_argument("--prompt", action="append", help="a user prompt (repeatable; default: built-in prompts)")
    samples.add_argument("--text", action="store_true",
                         help="continue each --prompt as plain text (a model trained on plain text, e.g. books)")
    samples.add_argument("--max-new-tokens", type=int, default=96)
    add_sampling_args(samples)
    samples.add_argument("--device", default="cpu")
    publishing = commands.add_parser("publish", help="upload RUN's model, GGUF files, card, settings and loss "
                                     "curve to hf://USER/REPO or a folder, s3:// or gs:// URL, verified",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    publishing.add_argument("run", help="run folder holding model/ (and any GGUF files export_gguf.py wrote)")
    publishing.add_argument("url", help="hf://USER/REPO (a model repository, created private), a folder, s3://, gs://")
    publishing.add_argument("--public", action="store_true", help="hf://: create the repository public")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command == "plot":
        out = args.out or str(Path(args.run) / "loss_curve.png")
        if not plot_loss_curve(Path(args.run) / "metrics.jsonl", out, title=Path(args.run).name):
            raise UserError(f"no loss records in {Path(args.run) / 'metrics.jsonl'}")
        print(f"wrote {out}")
    elif args.command == "evaluate":
        result = evaluation.evaluate(args.model, args.tasks, args.limit, args.batch_size, args.device, args.seed,
                                     args.max_new_tokens)
        written = evaluation.write_outputs(result, args.json)
        print(evaluation.score_table(result))
        print(f"settings: {evaluation.settings_line(result['harness'])}")
        print("wrote " + ", ".join(str(path) for path in written))
    elif args.command == "publish":
        where = publish(args.run, args.url, args.public)
        print(f"published {len(publish_layout(Path(args.run)))} files of {args.run} to {where} (verified)")
    else:
        if args.text and not args.prompt:
            raise UserError("samples --text continues the text you give: pass --prompt TEXT (repeatable)")
        sampling = sampling_from(vars(args))
        model, tokenizer = load_exported(args.model, args.device)
        prompts = args.prompt or DEFAULT_PROMPTS
        if args.text:
            for prompt, detail in zip(prompts, generate_text_details(model, tokenizer, prompts, args.max_new_tokens,
                                                                     args.device, sampling)):
                print(f"> {prompt}{detail['completion']}\n")
        else:
            replies = generate_chat(model, tokenizer, prompts, args.max_new_tokens, args.device, sampling=sampling)
            for prompt, reply in zip(prompts, replies):
                print(f"> {prompt}\n{reply}\n")
    return 0


def command() -> None:
    """The `tinyllm-report` console script (pyproject.toml): `python report.py` from anywhere."""
    run_main(main, script=True)


if __name__ == "__main__":
    run_main(main)
