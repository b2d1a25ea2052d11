"""--log-to: TensorBoard, W&B (offline) and trackio (local) as sinks of metrics_log.MetricsLog.

Nothing here touches the network: WANDB_MODE=offline writes local run files, trackio writes its
local SQLite database under TRACKIO_DIR, both inside the test's folder. The files are read back.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_runs import ROOT, options, write_tiny_corpus

from tinyllm.common import UserError
from tinyllm.outputs import metrics_log, trackers
from tinyllm.store import checkpoint_cloud


@pytest.mark.parametrize(
    "text, names",
    [
        ("wandb", ("wandb",)),
        ("tensorboard, wandb,trackio", ("tensorboard", "wandb", "trackio")),
        ("wandb,wandb,", ("wandb",)),
        ("", ()),
    ],
)
def test_tracker_names(text, names):
    assert trackers.tracker_names(text) == names


def test_an_unknown_tracker_is_one_error_line():
    with pytest.raises(UserError, match="--log-to: unknown tracker 'mlflow'; choose from tensorboard, wandb, trackio"):
        trackers.check_trackers(trackers.tracker_names("wandb,mlflow"))


@pytest.mark.parametrize(
    "step, logged_through, skipped",
    [
        (5, -1, False),  # a tracker that never logged anything takes every step, step 0 included
        (0, -1, False),
        (5, 6, True),  # after a rewind to 4: steps 5 and 6 were logged by the abandoned timeline
        (6, 6, True),
        (7, 6, False),
        (None, 6, False),  # a record without a step (none today) is not dropped
    ],
)
def test_tracker_skips(step, logged_through, skipped):
    assert trackers.tracker_skips(step, logged_through) is skipped


def test_scalars_and_tables_of_a_record():
    record = {
        "kind": "train",
        "step": 3,
        "time": "t",
        "loss": 2.5,
        "mfu": None,
        "ok": True,
        "note": "x",
        "samples": [{"prompt": "a", "completion": "b"}],
    }
    assert trackers.scalars(record) == {"train/loss": 2.5}
    assert trackers.table_rows(record) == {"train/samples": [{"prompt": "a", "completion": "b"}]}


def test_wandb_run_id_is_accepted_by_wandb():
    assert trackers.wandb_run_id("0123abcd") == "tinyllm-0123abcd"
    assert trackers.wandb_run_id("a/b:c?" + "x" * 80) == ("tinyllm-a-b-c-" + "x" * 80)[:64]


def test_a_missing_tracker_package_is_one_error_line(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(UserError, match=r"--log-to wandb needs the wandb package: pip install wandb"):
        trackers.check_trackers(["tensorboard", "wandb"])


def tensorboard_scalars(run: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run))
    events.Reload()
    return [(event.step, round(event.value, 6)) for event in events.Scalars(tag)]


def test_tensorboard_rewind_rewrites_the_one_events_file(tmp_path):
    metrics = metrics_log.MetricsLog(tmp_path / "metrics.jsonl", True, [trackers.TensorBoardLogger(tmp_path)])
    metrics.truncate_after(0)  # a fresh run
    for step in range(1, 7):
        metrics.write("train", step=step, loss=10.0 - step, mfu=None)
    metrics.write("eval", step=4, val_loss=3.0)
    metrics.close()
    assert tensorboard_scalars(tmp_path, "train/loss")[-1] == (6, 4.0)

    resumed = metrics_log.MetricsLog(tmp_path / "metrics.jsonl", True, [trackers.TensorBoardLogger(tmp_path)])
    resumed.truncate_after(4)  # the checkpoint of step 4: steps 5 and 6 are done again, differently
    for step in range(5, 9):
        resumed.write("train", step=step, loss=20.0 - step)
    resumed.close()
    assert sorted(tmp_path.glob("*tfevents*")) == [tmp_path / trackers.TENSORBOARD_EVENTS]
    assert tensorboard_scalars(tmp_path, "train/loss") == [
        (1, 9.0),
        (2, 8.0),
        (3, 7.0),
        (4, 6.0),
        (5, 15.0),
        (6, 14.0),
        (7, 13.0),
        (8, 12.0),
    ]
    assert tensorboard_scalars(tmp_path, "eval/val_loss") == [(4, 3.0)]


class FakeRun:
    def __init__(self):
        self.logged, self.finished = [], False

    def log(self, data, step=None):
        self.logged.append((step, data))

    def finish(self):
        self.finished = True


def fake_tracker(state: trackers.TrackerState) -> trackers.StepTracker:
    tracker = trackers.StepTracker(state)
    tracker.run, tracker.module = FakeRun(), None
    return tracker


def test_a_step_tracker_never_logs_a_step_twice_across_a_rewind(tmp_path):
    state = trackers.TrackerState(tmp_path / "trackers.json")
    first = fake_tracker(state)
    for step in range(1, 7):
        first.log({"kind": "train", "step": step, "loss": 1.0})
    first.close()
    assert json.loads((tmp_path / "trackers.json").read_text()) == {"tracker": {"logged_through": 6}}

    second = fake_tracker(trackers.TrackerState(tmp_path / "trackers.json"))  # resumed from step 4
    second.rewind([{"kind": "train", "step": step, "loss": 1.0} for step in range(1, 5)])
    for step in range(5, 9):
        second.log({"kind": "train", "step": step, "loss": 2.0})
        second.log({"kind": "eval", "step": step, "val_loss": 3.0})  # the same step twice in one session: kept
    assert [step for step, _ in second.run.logged] == [7, 7, 8, 8]

    late = fake_tracker(trackers.TrackerState(tmp_path / "other.json"))  # added to the run at its resume
    late.rewind([{"kind": "train", "step": step, "loss": 1.0} for step in range(1, 5)])
    assert [step for step, _ in late.run.logged] == [1, 2, 3, 4]


# ----------------------------------------------------------------------------------------------
# End to end: a run stopped and resumed three times (a rewind, then a restore on an empty folder).


def wandb_records(path: Path):
    """The protobuf records of a W&B .wandb file (W&B's LevelDB-log framing: 32 KiB blocks of chunks)."""
    from wandb.proto import wandb_internal_pb2

    raw = path.read_bytes()
    assert raw[:4] == b":W&B"
    position, block, pending = 7, 32768, b""
    while position + 7 <= len(raw):
        if block - position % block < 7:  # a block's tail too short for a header is padding
            position += block - position % block
            continue
        _crc, length, kind = struct.unpack("<IHB", raw[position : position + 7])
        pending += raw[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record
            pending = b""


def wandb_history(wandb_dir: Path) -> tuple[set[str], list[dict]]:
    """(run ids, history rows in the order written) of every offline run under `wandb_dir`."""
    ids, rows = set(), []
    for path in sorted(wandb_dir.glob("wandb/offline-run-*/run-*.wandb")):
        for record in wandb_records(path):
            if record.WhichOneof("record_type") == "run":
                ids.add(record.run.run_id)
            elif record.WhichOneof("record_type") == "history":
                rows.append(
                    {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
                )
    return ids, rows


def train_cli(args: list[str], env: dict) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [sys.executable, "train.py", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, f"train.py failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


@pytest.mark.slow
def test_three_resumes_are_one_curve_in_every_tracker(tmp_path, monkeypatch):
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))  # before trackio is imported: it reads it once
    pytest.importorskip("wandb")
    pytest.importorskip("trackio")
    corpus = write_tiny_corpus(tmp_path / "corpus")
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": "ignore",
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(tmp_path / "wandb"),
        "WANDB_SILENT": "true",
        "WANDB_DISABLE_GIT": "true",
        "TRACKIO_DIR": str(tmp_path / "trackio"),
        "HF_HUB_OFFLINE": "1",
        "GRADIO_ANALYTICS_ENABLED": "False",
    }
    (tmp_path / "wandb").mkdir()
    run, backup = tmp_path / "run", tmp_path / "backup"
    args = options(corpus, run, "--log-to", "tensorboard,wandb,trackio", steps=14)

    train_cli([*args, "--stop-after-steps", "6"], env)  # saves at 4 and 6
    for name in ("step-00000006.pt", "step-00000006.pt.json"):  # lost: the next session rewinds to step 4
        (run / "checkpoints" / name).unlink()
    (run / "checkpoints" / "latest.json").unlink()
    train_cli([*args, "--stop-after-steps", "10", "--backup-to", str(backup)], env)
    assert json.loads((run / "trackers.json").read_text())["wandb"]["logged_through"] == 10
    shutil.rmtree(run)  # an empty folder: only the backup survives
    output = train_cli([*args, "--backup-to", str(backup)], env).stdout
    assert "resumed from" in output
    assert output.strip().splitlines()[-1].startswith("COMPLETE: step 14/14")  # the status last, trackers closed
    restored = next(line for line in output.splitlines() if "restored into" in line)
    assert "trackers.json" in restored and trackers.TENSORBOARD_EVENTS in restored  # the backup carried them

    steps = list(range(1, 15))
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == steps
    assert [step for step, _ in tensorboard_scalars(run, "train/loss")] == steps  # brought back by the restore
    assert {name for name in checkpoint_cloud.RUN_FILES} <= {p.relative_to(run).as_posix() for p in run.rglob("*")}

    ids, rows = wandb_history(tmp_path / "wandb")
    assert ids == {json.loads((run / "trackers.json").read_text())["wandb"]["id"]}  # one W&B run, three sessions
    logged = [row["_step"] for row in rows if "train/loss" in row]
    assert logged == steps  # nothing twice after the rewind, nothing missing after the restore
    expected = {r["step"]: r["loss"] for r in records if r["kind"] == "train"}
    assert {row["_step"]: row["train/loss"] for row in rows if "train/loss" in row} == pytest.approx(expected)
    assert any("eval/val_loss" in row for row in rows) and any("train/mfu" in row for row in rows)

    from trackio.sqlite_storage import SQLiteStorage

    name = json.loads((run / "trackers.json").read_text())["trackio"]["id"]
    trackio_steps = [row["step"] for row in SQLiteStorage.get_logs("tinyllm", name) if "train/loss" in row]
    assert trackio_steps == steps
