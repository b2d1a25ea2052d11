"""The run's observers (callbacks.py) on their own: cadence, records, what they keep across a restart.

The whole loop with them (a resumed run logs and evaluates what the uninterrupted one does) is in
tests/test_train.py; these feed the hooks by hand, with no model.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tinyllm.outputs import callbacks, metrics_log, report

pytestmark = pytest.mark.timeout(20)


def records(path: Path, kind: str) -> list[dict]:
    return [record for record in metrics_log.read_metrics(path) if record["kind"] == kind]


class Status:
    def __init__(self):
        self.steps = []

    def running(self, step, total_steps, **fields):
        self.steps.append(step)


def step_result(step: int, loss: float = 2.0):
    return callbacks.StepResult(step=step, loss=loss, lrs={"adamw": 1e-3}, grad_norm=1.0, seconds=0.5, applied=True)


def outputs(tmp_path: Path) -> tuple[metrics_log.MetricsLog, report.Progress]:
    return metrics_log.MetricsLog(tmp_path / "metrics.jsonl", True), report.Progress(12, enabled=False)


def validation(tmp_path: Path, losses: list[float | None], every: int = 4) -> callbacks.Validation:
    results = iter(losses)

    def measure():
        loss = next(results)
        return (
            None
            if loss is None
            else {"loss": loss, "perplexity": math.exp(loss), "tokens": 10, "bits_per_byte": 1.0, "bytes": 40}
        )

    return callbacks.Validation(measure, every, 12, 100, *outputs(tmp_path))


def test_validation_runs_at_its_cadence_and_keeps_the_best(tmp_path):
    observer = validation(tmp_path, [3.0, 2.0, 2.5])
    measured = {step: observer.on_eval(step) for step in range(1, 13)}
    assert {step for step, item in measured.items() if item is not None} == {4, 8, 12}
    assert [callbacks.new_best([measured[step]]) for step in (4, 8, 12)] == [3.0, 2.0, None]
    assert [(r["step"], r["val_loss"], r["tokens"]) for r in records(tmp_path / "metrics.jsonl", "eval")] == [
        (4, 3.0, 400),
        (8, 2.0, 800),
        (12, 2.5, 1200),
    ]
    assert observer.summary() == {
        "best_val_loss": 2.0,
        "validation": {
            "step": 12,
            "loss": 2.5,
            "perplexity": math.exp(2.5),
            "tokens": 10,
            "bits_per_byte": 1.0,
            "bytes": 40,
        },
    }


def test_a_resumed_validation_compares_with_the_best_before_the_restart(tmp_path):
    first = validation(tmp_path, [2.0])
    first.on_eval(4)
    state = json.loads(json.dumps(first.state_dict()))  # plain values, as the checkpoint holds them
    resumed = validation(tmp_path, [2.5, 1.5])
    resumed.load_state_dict(state)
    assert resumed.on_eval(8).new_best is None and resumed.on_eval(12).new_best == 1.5
    assert validation(tmp_path, []).summary() == {"best_val_loss": None, "validation": None}  # none measured yet


def test_a_validation_without_counted_tokens_still_counts_as_an_evaluation(tmp_path):
    observer = validation(tmp_path, [None])
    assert observer.on_eval(4) == callbacks.Measured("validation") and observer.summary()["validation"] is None
    assert records(tmp_path / "metrics.jsonl", "eval") == []


def test_task_scores_restore_the_records_metrics_jsonl_lost(tmp_path):
    metrics, progress = outputs(tmp_path)
    scores = {"sums": {"acc": 0.5, "acc_norm": 0.25, "acc_bytes": 0.25, "n": 4, "chance": 0.25}}
    observer = callbacks.TaskScores(lambda: scores, 4, 12, 100, metrics, progress)
    assert [observer.on_eval(step) is not None for step in (3, 4, 12)] == [False, True, True]
    (tmp_path / "metrics.jsonl").write_text("")  # lost with the run files
    resumed = callbacks.TaskScores(lambda: scores, None, 12, 100, metrics, progress)  # a session without tasks
    resumed.load_state_dict(observer.state_dict())
    resumed.on_start(12)
    assert [r["step"] for r in records(tmp_path / "metrics.jsonl", "tasks")] == [4, 12]
    assert resumed.on_eval(12) is None  # no tasks this session: never due
    assert resumed.summary() == {"tasks": scores, "tasks_step": 12}  # the last scores taken


def test_the_train_log_writes_its_cadence_and_the_step_a_session_stops_at(tmp_path):
    metrics, progress = outputs(tmp_path)
    status = Status()
    observer = callbacks.TrainLog(lambda step: {"peak_memory_bytes": 0}, 5, 12, 100, metrics, progress, status)
    for step in range(1, 8):
        observer.on_step_end(step_result(step), callbacks.Speed(1000.0, None))
    observer.on_loop_end()  # stopped at step 7
    observer.on_loop_end()  # written once
    assert [r["step"] for r in records(tmp_path / "metrics.jsonl", "train")] == [1, 5, 7] == status.steps
    assert observer.state_dict() == {"train_seconds": 3.5}


def test_the_callbacks_keep_each_state_under_its_key_and_call_in_order(tmp_path):
    calls = []

    class Probe(callbacks.Callback):
        def __init__(self, key, measures):
            self.key, self.measures, self.state = key, measures, {}

        def on_eval(self, step):
            calls.append((self.key, "eval", step))
            return callbacks.Measured(self.key) if self.measures else None

        def on_evaluated(self, step, measured):
            calls.append((self.key, "evaluated", [item.name for item in measured]))

        def state_dict(self):
            return {"of": self.key}

        def load_state_dict(self, state):
            self.state = state

    observers = callbacks.Callbacks([Probe("a", False), Probe("b", True), callbacks.Callback()])
    assert observers.state_dict() == {"a": {"of": "a"}, "b": {"of": "b"}}
    observers.load_state_dict({"a": {"x": 1}, "b": {"x": 2}})
    assert [probe.state for probe in observers.callbacks[:2]] == [{"x": 1}, {"x": 2}]
    assert observers.on_eval(3) == [callbacks.Measured("b")]
    assert calls == [("a", "eval", 3), ("b", "eval", 3), ("a", "evaluated", ["b"]), ("b", "evaluated", ["b"])]
    with pytest.raises(ValueError, match="one key"):
        callbacks.Callbacks([Probe("a", False), Probe("a", False)])


class Ends(callbacks.Callback):
    def __init__(self, found):
        self.found = found

    def on_end(self, end):
        return self.found


@pytest.mark.parametrize(
    "founds, expected",
    [
        ([{}, {"a": 1}], {"a": 1}),  # no end-of-run outputs: no report_errors
        ([{"a": 1, "report_errors": None}, {"b": 2, "report_errors": None}], {"a": 1, "b": 2, "report_errors": None}),
        (
            [{"report_errors": {"samples": "x"}}, {"b": 2, "report_errors": None}, {"report_errors": {"export": "y"}}],
            {"b": 2, "report_errors": {"samples": "x", "export": "y"}},
        ),
    ],
)
def test_on_end_merges_the_fields_and_gathers_every_report_error(founds, expected):
    end = callbacks.RunEnd("COMPLETE", 4, 4, 400, None, None)
    assert callbacks.Callbacks([Ends(found) for found in founds]).on_end(end) == expected


def test_the_saved_validation_is_the_one_the_observer_kept(tmp_path):
    observer = validation(tmp_path, [3.0, 2.0])
    observer.on_eval(4)
    observer.on_eval(8)
    assert callbacks.Validation.saved({"validation": observer.state_dict()}) == observer.summary()["validation"]


@pytest.mark.parametrize(
    "total, every, steps",
    [
        (356, 71, [71, 142, 213, 284, 356]),  # the default five of 356 steps: not at 355 as well
        (355, 71, [71, 142, 213, 284, 355]),  # the fifth multiple is the last step: once
        (1020, 100, [100, 200, 300, 400, 500, 600, 700, 800, 900, 1020]),  # 20 steps before it: left to it
        (1030, 100, [100, 200, 300, 400, 500, 600, 700, 800, 900, 1000, 1030]),  # 30 steps (a quarter: 25)
        (13, 4, [4, 8, 12, 13]),  # one step of a one-step gap: kept
        (5, 1, [1, 2, 3, 4, 5]),
        (12, 0, [12]),  # 0: at the end only
        (12, None, []),  # off
    ],
)
def test_an_evaluation_is_due_at_each_multiple_and_the_last_step_not_just_before_it(total, every, steps):
    assert [step for step in range(1, total + 1) if callbacks.due(step, total, every)] == steps
