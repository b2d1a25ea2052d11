"""What a person sees of a run: progress, metrics.jsonl, the loss curve, the final line, the model card
and the HF export; and the command line over a run's outputs. Generation (samples) is generation.py's,
scores are evaluation.py's, uploads publishing.py's; this module calls them, never the other way round.

train.py calls these on rank 0 (Progress and MetricsLog take `enabled=info.is_main`):

    progress = Progress(total_steps, initial_step=step, every=args.log_every, enabled=is_main)
    progress.update(step, loss, tokens_per_second, mfu)   # every optimizer step; progress.write(msg) for logs
    metrics = MetricsLog(RUN / "metrics.jsonl", is_main, trackers.open_trackers(["wandb"], RUN, run_id, config))
    metrics.write("train", step=step, loss=loss)          # metrics.jsonl and each --log-to tracker
    plot_loss_curve(RUN / "metrics.jsonl", RUN / "loss_curve.png")                 # after each eval, at the end
    found = report_run(training, RUN, status, test, settings)   # at the end: the curve, sample_generations.json,
                                                                # the held-out accuracy, RUN/model; never raises

Nothing runs at import time. The script form redraws a run's pictures or evaluates an
exported model after the fact:

    python report.py plot runs/demo                      # runs/demo/loss_curve.png from metrics.jsonl
    python report.py evaluate runs/demo --tasks corpus/demo/eval arc_easy --limit 200   # evaluation.py
    python report.py samples runs/demo/model --prompt "What is 12 plus 7?"              # generation.py
    python report.py publish runs/demo hf://USER/REPO       # or a folder or store URL: verified (publishing.py)
"""

from __future__ import annotations

import argparse
import io
import itertools
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import attention
import checkpoint_store as store
import corpus_format
import evaluation
import generation
import publishing
from common import (
    PROGRESS_WRITERS,
    ArgumentParser,
    UserError,
    append_jsonl,
    atomic_folder,
    atomic_open,
    atomic_write_bytes,
    human_count,
    json_safe,
    read_json,
    read_json_or,
    run_main,
    say,
    sha256_file,
    utc_now,
)

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


LR_SUFFIX = "_lr"  # a train record's NAME_lr: the lr of the param groups named NAME (optimization.Optimizers)


def lr_fields(lrs: dict[str, float]) -> dict[str, float]:
    """A train record's learning rates: {"muon": 0.02, "adamw": 0.05} -> {"muon_lr": 0.02, "adamw_lr": 0.05}."""
    return {name + LR_SUFFIX: lr for name, lr in lrs.items()}


def lr_series(records: list[dict]) -> dict[str, tuple[list, list]]:
    """Each param group's lr against tokens seen, labelled by the group names the train records hold."""
    keys = dict.fromkeys(key for record in records if record.get("kind") == "train" for key in record
                         if key.endswith(LR_SUFFIX))
    return {f"{key[:-len(LR_SUFFIX)]} lr": _series(records, "train", key) for key in keys}


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
    learning_rates = {label: series for label, series in lr_series(records).items() if series[1]}
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
    """Each param group's learning rate on a second axis; its legend handles and labels."""
    lr_axes = axes.twinx()
    for (label, (lr_x, lr)), style in zip(learning_rates.items(), itertools.cycle(("--", ":", "-."))):
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
    question, or the opening of a held-out text (generation.held_out_prompts); a greeting when none reads."""
    try:
        kind, prompts = generation.held_out_prompts(corpus, tokenizer, count=1)
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
# The Hugging Face export: RUN/model/, built beside and swapped in.



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
    """A demo-accuracy sentence from an evaluation.exact_match_accuracy() dict or a bare fraction."""
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
    model = generation.unwrap_model(model)
    with atomic_folder(out_dir) as temp:  # safetensors writes owner-only files: atomic_folder makes them plain
        architecture = architecture_of(model)
        with generation.quiet_transformers_progress():
            model.save_pretrained(temp, max_shard_size="100GB")  # transformers 5 always writes safetensors
        tokenizer.save_pretrained(temp)
        context = getattr(model.config, "max_position_embeddings", None)
        generation.generation_config_for(tokenizer, context).save_pretrained(temp)
        write_model_card(temp, architecture, card_info)
        write_provenance(temp, architecture, card_info)
        hashes = {path.relative_to(temp).as_posix(): sha256_file(path)
                  for path in sorted(p for p in temp.rglob("*") if p.is_file())}
    return hashes


def export_checkpoint(checkpoint: dict, path: Path, out: Path, corpus: Path, device) -> None:
    """`train.py --export-only`: OUT/model/ from `checkpoint` (read from `path`), trained on `corpus`; the card
    takes the test loss run_status.json has for the same step, and the held-out accuracy is measured."""
    import model_config

    recorded = checkpoint["settings"]
    training = recorded["training"]
    manifest = corpus_format.load_manifest(corpus)
    tokenizer = corpus_format.load_tokenizer(corpus)
    if manifest.tokenizer_sha256 != training["tokenizer_sha256"]:
        raise UserError(f"the tokenizer of {corpus} is not the one checkpoint {path} was trained with; "
                        "pass that corpus with --data")
    preset = model_config.recorded_preset(training)
    model = model_config.build_model(preset, training["vocab_size"], manifest.special_tokens)
    model.load_state_dict(checkpoint["model"])
    model.to(device).eval()
    step, total = int(checkpoint["step"]), int(training["total_steps"])
    status = store.COMPLETE if step >= total else store.NEEDS_RESUME
    previous = read_json(out / "run_status.json") if (out / "run_status.json").is_file() else {}
    test = previous.get("test") if previous.get("step") == step else None
    accuracy = None
    if (corpus / "eval").is_dir():
        result = evaluation.exact_match_accuracy(model, tokenizer, corpus / "eval", device)
        accuracy = {key: result[key] for key in ("accuracy", "correct", "total", "by_task")}
        say(accuracy_line(result))
    info_card = card_info(out.name, status, training["preset"], step, total,
                          step * int(training["tokens_per_step"]), recorded,
                          checkpoint["callbacks"]["validation"]["last"], test, accuracy,
                          usage_example_from(corpus, tokenizer))
    with attention.exportable(model):
        model_files = export_hf_model(model, tokenizer, out / "model", info_card)
    print(f"exported {path} (step {step}/{total}, {status}) to {out / 'model'}: "
          + ", ".join(f"{name} {sha[:12]}" for name, sha in model_files.items() if name.endswith(".safetensors")),
          flush=True)



# ----------------------------------------------------------------------------------------------
# Command line: redraw a run's curve, evaluate or sample an exported model.


@dataclass(frozen=True)
class RunFacts:
    """What report_run needs of a run besides its model, fixed for a session (train.py builds it)."""
    out: Path
    corpus: Path
    preset: str  # the preset's name (--preset)
    settings: dict  # the recorded settings (training_settings.json's)
    sampling: generation.Sampling  # --sample-* for the samples
    device: Any


@dataclass(frozen=True)
class RunEnd:
    """Where a session leaves its run: what the report, the model card and run_status.json say of it."""
    status: str  # store.COMPLETE or store.NEEDS_RESUME
    step: int
    total_steps: int
    tokens: int
    validation: dict | None  # the latest validation ({"step", "loss", ...})
    test: dict | None  # the test evaluation of a complete run


def report_run(model, facts: RunFacts, end: RunEnd) -> dict:
    """Loss curve, samples, held-out accuracy and RUN/model (rank 0). Failures are recorded, never raised.

    Samples and accuracy only for a complete run; a resumable stop exports the current weights
    (the model card says the run is unfinished).
    """
    errors: dict[str, str] = {}
    out, corpus = facts.out, facts.corpus

    def attempt(name: str, function):
        try:
            return function()
        except Exception as error:  # the checkpoint is safe; a report failure must not lose the run
            errors[name] = f"{type(error).__name__}: {error}"
            say(f"{name} failed ({errors[name]}); the checkpoints are intact", warning=True)
            return None

    found = {}
    tokenizer = attempt("tokenizer", lambda: corpus_format.load_tokenizer(corpus))
    attempt("loss_curve", lambda: plot_loss_curve(out / "metrics.jsonl", out / "loss_curve.png", title=out.name))
    accuracy = None
    if end.status == store.COMPLETE and tokenizer is not None:
        # the demo's arithmetic prompts for the demo; else prompts that fit the corpus: its held-out
        # chats' first questions, or the openings of its held-out texts to continue
        kind, prompts = ("chat", generation.DEFAULT_PROMPTS) if (corpus / "eval").is_dir() else \
            attempt("sample_prompts", lambda: generation.held_out_prompts(corpus, tokenizer)) or ("chat", [])
        samples = generation.generate_samples(model, tokenizer, out / "sample_generations.json", prompts=prompts,
                                              step=end.step, text=kind == "text", sampling=facts.sampling)
        if samples["error"]:
            errors["samples"] = samples["error"]
        if (corpus / "eval").is_dir():
            accuracy = attempt("task_accuracy", lambda: evaluation.exact_match_accuracy(
                model, tokenizer, corpus / "eval", facts.device))
        if accuracy is not None:
            found["task_accuracy"] = {key: accuracy[key] for key in ("accuracy", "correct", "total", "by_task")}
            say(accuracy_line(accuracy))
    if tokenizer is not None:
        info = card_info(out.name, end.status, facts.preset, end.step, end.total_steps, end.tokens, facts.settings,
                         end.validation, end.test, found.get("task_accuracy"), usage_example_from(corpus, tokenizer))
        with attention.exportable(model):
            model_files = attempt("export", lambda: export_hf_model(model, tokenizer, out / "model", info))
        if model_files is not None:
            found["model_files"] = model_files
            found["model_dir"] = str(out / "model")
    found["report_errors"] = errors or None
    return found



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
    generation.add_sampling_args(samples)
    samples.add_argument("--device", default="cpu")
    publish = commands.add_parser("publish", help="upload RUN's model, GGUF files, card, settings and loss "
                                  f"curve to hf://USER/REPO or {publishing.STORES_TEXT}, verified",
                                  formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    publish.add_argument("run", help="run folder holding model/ (and any GGUF files export_gguf.py wrote)")
    publish.add_argument("url", help="hf://USER/REPO (a model repository, created private), or "
                                     f"{publishing.STORES_TEXT}")
    publish.add_argument("--public", action="store_true", help="hf://: create the repository public")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command == "plot":
        if not Path(args.run).is_dir():
            raise UserError(f"run {args.run}: no such folder")
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
        where = publishing.publish(args.run, args.url, args.public)
        print(f"published {len(publishing.publish_layout(Path(args.run)))} files of {args.run} to {where} (verified)")
    else:
        print_samples(args)
    return 0


def print_samples(args: argparse.Namespace) -> None:
    """`report.py samples`: each prompt and the exported model's reply (with --text, its continuation)."""
    if args.text and not args.prompt:
        raise UserError("samples --text continues the text you give: pass --prompt TEXT (repeatable)")
    sampling = generation.sampling_from(vars(args))
    model, tokenizer = generation.load_exported(args.model, args.device)
    prompts = args.prompt or generation.DEFAULT_PROMPTS
    if args.text:
        details = generation.generate_text_details(model, tokenizer, prompts, args.max_new_tokens, args.device,
                                                   sampling)
        for prompt, detail in zip(prompts, details):
            print(f"> {prompt}{detail['completion']}\n")
        return
    replies = generation.generate_chat(model, tokenizer, prompts, args.max_new_tokens, args.device, sampling=sampling)
    for prompt, reply in zip(prompts, replies):
        print(f"> {prompt}\n{reply}\n")


def command() -> None:
    """The `tinyllm-report` console script (pyproject.toml): `python report.py` from anywhere."""
    run_main(main, script=True)


if __name__ == "__main__":
    run_main(main)

