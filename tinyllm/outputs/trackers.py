"""Experiment trackers (--log-to): sinks that metrics_log.MetricsLog.write feeds with every metrics.jsonl record.

    sinks = trackers.open_trackers(("tensorboard", "wandb"), RUN, run_id, settings)
    metrics = metrics_log.MetricsLog(RUN / "metrics.jsonl", enabled=True, sinks=sinks)

TensorBoard writes one events file per run (RUN/events.out.tfevents.tinyllm, rewritten from the
records metrics.jsonl keeps on a resume); W&B and trackio resume their own run (RUN/trackers.json:
each one's id and the last step it was given) and never get a step twice. Offline modes work
without network (WANDB_MODE=offline; trackio is local by default).
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Sequence
from pathlib import Path

from tinyllm.common import UserError, atomic_open, atomic_write_json, json_safe, read_json_or
from tinyllm.store.checkpoint_store import TENSORBOARD_EVENTS, TRACKERS_FILE  # run files: the store backs them up

TRACKER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio"}
SKIPPED_KEYS = {"kind", "step", "time"}


def tracker_names(text: str) -> tuple[str, ...]:
    """--log-to's value: "wandb, tensorboard" -> ("wandb", "tensorboard") (check_trackers checks them)."""
    return tuple(dict.fromkeys(name.strip().lower() for name in (text or "").split(",") if name.strip()))


def check_trackers(names: Sequence[str]) -> None:
    """One error line naming the pip command for a --log-to tracker whose package is missing."""
    import importlib.util

    for name in names:
        if name not in TRACKER_PACKAGES:
            raise UserError(f"--log-to: unknown tracker {name!r}; choose from {', '.join(TRACKER_PACKAGES)}")
        if importlib.util.find_spec(TRACKER_PACKAGES[name]) is None:
            raise UserError(
                f"--log-to {name} needs the {TRACKER_PACKAGES[name]} package: pip install {TRACKER_PACKAGES[name]}"
            )


def scalars(record: dict) -> dict[str, float]:
    """A record's numbers as `kind/key` (e.g. train/loss); booleans, strings and lists are not scalars."""
    kind = record.get("kind", "metrics")
    return {
        f"{kind}/{key}": value
        for key, value in record.items()
        if key not in SKIPPED_KEYS and isinstance(value, int | float) and not isinstance(value, bool)
    }


def table_rows(record: dict) -> dict[str, list[dict]]:
    """A record's lists of dicts (the samples record's "samples") as `kind/key` -> rows of a table."""
    kind = record.get("kind", "metrics")
    return {
        f"{kind}/{key}": value
        for key, value in record.items()
        if isinstance(value, list) and value and all(isinstance(row, dict) for row in value)
    }


def tracker_skips(step: int | None, logged_through: int) -> bool:
    """Whether a tracker that was given every step up to `logged_through` in earlier sessions skips a
    record of `step`: a resumed run (after a rewind) logs those steps again, a tracker never does."""
    return step is not None and step <= logged_through


def wandb_run_id(run_id: str) -> str:
    """The W&B run id of a tinyllm run (W&B refuses / \\ # ? % : and more than 64 characters)."""
    return re.sub(r"[^A-Za-z0-9_-]", "-", f"tinyllm-{run_id}")[:64]


class TrackerState:
    """RUN/trackers.json: {tracker: {"id": ..., "logged_through": step}}; a run file the backup carries,
    so a session restored on an empty folder appends to the same tracker run and never repeats a step."""

    def __init__(self, path: Path):
        self.path = path
        self.state = read_json_or(path, {})

    def get(self, tracker: str) -> dict:
        value = self.state.get(tracker)
        return value if isinstance(value, dict) else {}

    def update(self, tracker: str, **fields) -> None:
        self.state[tracker] = {**self.get(tracker), **fields}
        atomic_write_json(self.path, self.state)


class TensorBoardLogger:
    """RUN/events.out.tfevents.tinyllm: each record's numbers as scalars `kind/key`.

    One file per run, so the backup carries it as a run file: `rewind` rewrites it from the records
    metrics.jsonl kept (a resumed run, a restore), then records are appended as they come. A curve
    that was stopped, rewound and resumed reads as one, without TensorBoard's purge rules.
    """

    def __init__(self, out: Path):
        try:
            from tensorboard.compat.proto import event_pb2, summary_pb2
            from tensorboard.summary.writer.record_writer import RecordWriter
        except ImportError as error:
            raise UserError(
                f"--log-to tensorboard needs the tensorboard package (pip install tensorboard): {error}"
            ) from None
        self.path = out / TENSORBOARD_EVENTS
        self._event, self._summary, self._record_writer = event_pb2.Event, summary_pb2.Summary, RecordWriter
        self.handle = None

    def _events(self, record: dict):
        wall_time = _epoch_seconds(record.get("time"))
        values = [self._summary.Value(tag=tag, simple_value=float(value)) for tag, value in scalars(record).items()]
        if values:
            yield self._event(wall_time=wall_time, step=record.get("step") or 0, summary=self._summary(value=values))

    def rewind(self, records: Sequence[dict]) -> None:
        self.close()
        with atomic_open(self.path, "wb") as handle:
            writer = self._record_writer(handle)
            writer.write(self._event(wall_time=time.time(), file_version="brain.Event:2").SerializeToString())
            for record in records:
                for event in self._events(record):
                    writer.write(event.SerializeToString())
        self.handle = open(self.path, "ab")  # noqa: SIM115 - held open until close()

    def log(self, record: dict) -> None:
        if self.handle is None:
            self.rewind([])
        writer = self._record_writer(self.handle)
        for event in self._events(record):
            writer.write(event.SerializeToString())
        self.handle.flush()

    def close(self) -> None:
        if self.handle is not None:
            self.handle.close()
            self.handle = None


def _epoch_seconds(stamp) -> float:
    import datetime

    with contextlib.suppress(TypeError, ValueError):
        return datetime.datetime.fromisoformat(str(stamp).replace("Z", "+00:00")).timestamp()
    return time.time()


class StepTracker:
    """A tracker run (W&B, trackio) that resumes with the run: its id and the last step it was given
    are in TrackerState; steps up to that one are never logged again (tracker_skips)."""

    name = "tracker"

    def __init__(self, state: TrackerState):
        self.state = state
        self.logged_through = self.state.get(self.name).get("logged_through", -1)  # fixed for the session
        self.newest = self.logged_through

    def rewind(self, records: Sequence[dict]) -> None:
        """A tracker added to a run mid-way is given what metrics.jsonl kept beyond its last step."""
        for record in records:
            self.log(record)

    def log(self, record: dict) -> None:
        step = record.get("step")
        if tracker_skips(step, self.logged_through):
            return
        data = {**scalars(record), **{key: self.table(rows) for key, rows in table_rows(record).items()}}
        if data:
            self.send(data, step)
        if step is not None and step > self.newest:
            self.newest = step
            self.state.update(self.name, logged_through=step)

    def table(self, rows: list[dict]):
        columns = list(dict.fromkeys(key for row in rows for key in row))
        return self.module.Table(
            columns=columns, data=[[json_safe(row.get(column)) for column in columns] for row in rows]
        )

    def send(self, data: dict, step: int | None) -> None:
        self.run.log(data, step=step)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


class WandbLogger(StepTracker):
    """A Weights & Biases run, resumed (`resume="allow"`) under the id stored in trackers.json.
    WANDB_MODE=offline writes local run files (`wandb sync` uploads them), WANDB_PROJECT names the project."""

    name = "wandb"

    def __init__(self, state: TrackerState, out: Path, run_id: str, config: dict):
        super().__init__(state)
        import wandb

        self.module = wandb
        run_id = self.state.get("wandb").get("id") or wandb_run_id(run_id)
        try:
            self.run = wandb.init(
                project=os.environ.get("WANDB_PROJECT", "tinyllm"),
                name=out.name,
                id=run_id,
                resume="allow",
                config=json_safe(config),
            )
        except Exception as error:  # no API key, no network in online mode, a bad WANDB_* setting
            raise UserError(
                f"--log-to wandb: {type(error).__name__}: {error} (WANDB_MODE=offline logs "
                "without an account; `wandb sync` uploads later)"
            ) from None
        self.state.update("wandb", id=run_id)


class TrackioLogger(StepTracker):
    """A trackio run (local-first: TRACKIO_DIR, default ~/.cache/huggingface/trackio), resumed by name."""

    name = "trackio"

    def __init__(self, state: TrackerState, out: Path, run_id: str, config: dict):
        super().__init__(state)
        import trackio

        self.module = trackio
        name = self.state.get("trackio").get("id") or f"{out.name}-{run_id[:8]}"
        try:
            self.run = trackio.init(
                project=os.environ.get("TRACKIO_PROJECT", "tinyllm"),
                name=name,
                config=json_safe(config),
                resume="allow",
                embed=False,
                auto_log_cpu=False,
                auto_log_gpu=False,
            )
        except Exception as error:
            raise UserError(f"--log-to trackio: {type(error).__name__}: {error}") from None
        self.state.update("trackio", id=name)

    def close(self) -> None:
        if self.run is not None:
            self.module.finish()  # trackio's own: it forgets the run, which its exit hook would finish (and
            self.run = None  # announce) again after the run's last line


def open_trackers(names: Sequence[str], out: Path, run_id: str, config: dict) -> list:
    """The --log-to sinks for MetricsLog, in the order given."""
    check_trackers(names)
    state = TrackerState(out / TRACKERS_FILE)
    kinds = {
        "tensorboard": lambda: TensorBoardLogger(out),
        "wandb": lambda: WandbLogger(state, out, run_id, config),
        "trackio": lambda: TrackioLogger(state, out, run_id, config),
    }
    sinks = []
    try:
        for name in names:
            sinks.append(kinds[name]())
    except BaseException:
        for sink in sinks:
            sink.close()
        raise
    return sinks
