"""metrics.jsonl, the one log of a run: MetricsLog writes it (and its --log-to trackers), read_metrics reads it
back, the fields of its records, and the loss curve drawn from it (RUN/loss_curve.png, the end-of-run artifact
artifacts.LossCurve makes; `python report.py plot RUN` redraws it).

    metrics = MetricsLog(RUN / "metrics.jsonl", is_main, trackers.open_trackers(["wandb"], RUN, run_id, config))
    metrics.write("train", step=step, loss=loss, **lr_fields(lrs))   # metrics.jsonl and each --log-to tracker
    records = read_metrics(RUN / "metrics.jsonl")                      # sorted by step, the later repeat kept
    plot_loss_curve(RUN / "metrics.jsonl", RUN / "loss_curve.png")     # False, nothing written: no loss yet
"""

from __future__ import annotations

import io
import itertools
import json
import math
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from tinyllm.common import append_jsonl, atomic_open, atomic_write_bytes, human_count, utc_now

# ----------------------------------------------------------------------------------------------
# Writing metrics.jsonl (rank 0) and its records' fields.


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

    def write_samples(self, written: dict) -> None:
        """The samples generation.generate_samples wrote as a "samples" record (a table in the trackers)."""
        rows = [
            {"prompt": str(sample.get("prompt")), "completion": sample.get("completion")}
            for sample in written.get("samples") or []
        ]
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


LR_SUFFIX = "_lr"  # a train record's NAME_lr: the lr of the param groups named NAME (optimization.Optimizers)


def lr_fields(lrs: dict[str, float]) -> dict[str, float]:
    """A train record's learning rates: {"muon": 0.02, "adamw": 0.05} -> {"muon_lr": 0.02, "adamw_lr": 0.05}."""
    return {name + LR_SUFFIX: lr for name, lr in lrs.items()}


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


def bits_per_byte_text(result: dict) -> str:
    """ ", 1.2345 bits/byte" for an evaluation that has them (older records and status files may not)."""
    value = result.get("bits_per_byte")
    return "" if value is None else f", {value:.4f} bits/byte"


# ----------------------------------------------------------------------------------------------
# Reading metrics.jsonl back, and the loss curve drawn from it.


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


def last_train_loss(out: Path) -> float | None:
    """The loss of the last train record in metrics.jsonl (for the final line of a run without held-out data)."""
    losses = [
        record["loss"]
        for record in read_metrics(out / "metrics.jsonl")
        if record.get("kind") == "train" and isinstance(record.get("loss"), float)
    ]
    return losses[-1] if losses else None


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


def lr_series(records: list[dict]) -> dict[str, tuple[list, list]]:
    """Each param group's lr against tokens seen, labelled by the group names the train records hold."""
    keys = dict.fromkeys(
        key for record in records if record.get("kind") == "train" for key in record if key.endswith(LR_SUFFIX)
    )
    return {f"{key[: -len(LR_SUFFIX)]} lr": _series(records, "train", key) for key in keys}


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
    axes, task_axes = (
        figure.subplots(2, 1, sharex=True, height_ratios=(2, 1)) if tasks else (figure.add_subplot(), None)
    )
    _plot_losses(axes, (train_x, train_loss), (val_x, val_loss), (test_x, test_loss))
    handles, labels = axes.get_legend_handles_labels()
    if learning_rates:
        extra_handles, extra_labels = _plot_learning_rates(axes, learning_rates)
        handles, labels = handles + extra_handles, labels + extra_labels
    if task_axes is not None:
        _plot_task_scores(task_axes, tasks)
        axes.set_xlabel("")
    figure.legend(
        handles,
        labels,
        loc="outside lower center",
        ncols=len(labels) if len(labels) <= 4 else 3,
        fontsize="small",
        frameon=False,
    )
    last = next((record for record in reversed(records) if "tokens" in record), records[-1])  # not a samples record
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
        axes.plot(
            val_x,
            val_loss,
            "o-",
            color="tab:orange",
            linewidth=1,
            markersize=7,
            markerfacecolor="none",
            markeredgewidth=1.8,
            zorder=2,
            label="validation loss",
        )
    if test_loss:
        axes.plot(
            test_x, test_loss, "*", color="tab:red", markersize=12, zorder=1.5, label=f"test loss {test_loss[-1]:.3f}"
        )
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
