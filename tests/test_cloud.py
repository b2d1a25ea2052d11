"""checkpoint_cloud.py against a local folder and a real S3 endpoint (moto's server on 127.0.0.1)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch
from stores import ACCESS_KEY, SECRET_KEY
from tiny_runs import assert_same_state, final_state, options, run_cli, train_losses, write_tiny_corpus

from tinyllm.common import UserError, append_jsonl, atomic_write_json, sha256_file, temporary_target
from tinyllm.data import build as data
from tinyllm.data import corpus_format
from tinyllm.store import checkpoint_cloud as cc
from tinyllm.store import checkpoint_store as store
from tinyllm.store import remote_store as rs
from tinyllm.training import train_data

ROOT = Path(__file__).resolve().parent.parent


# ----------------------------------------------------------------------------------------------
# Fixtures and helpers.


class Log(list):
    """A log function that remembers its lines."""

    def __call__(self, line: str) -> None:
        self.append(line)

    def text(self) -> str:
        return "\n".join(self)


def fake_checkpoint(folder: Path, step: int) -> Path:
    """A small checkpoint as train.py writes it (a few hundred KB, loads with weights_only=True)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"step-{step:08d}.pt"
    generator = torch.Generator().manual_seed(step)
    torch.save(
        {
            "format_version": 1,
            "step": step,
            "model": {"w": torch.randn(60_000, generator=generator)},
            "optimizer": {},
            "settings": {},
        },
        path,
    )
    return path


def save_and_point_latest(folder: Path, step: int, run_id: str = "run-test") -> Path:
    """A checkpoint with its records as train.py writes them: step-N.pt.json, then latest.json."""
    path = fake_checkpoint(folder, step)
    record = store.Record(
        path=path.name,
        step=step,
        sha256=sha256_file(path),
        bytes=path.stat().st_size,
        run_id=run_id,
        created=f"2026-01-01T00:00:{step % 60:02d}Z",
    )
    store.write_record(folder, record)
    store.write_record(folder, record, store.LATEST)
    return path


def remote_state(url: str) -> dict:
    """The remote listing as a few plain facts to compare: verified steps -> names, unverified names,
    partial uploads, and latest.json (its JSON) or None."""
    listing = cc.remote_listing(*rs.open_remote(url))
    return {
        "verified": {record.step: name for name, record in listing.records.items() if isinstance(record, store.Record)},
        "unverified": [name for name in listing.files if name not in listing.records],
        "partials": listing.temporaries,
        "latest": listing.latest.to_json() if listing.latest else None,
    }


def wait_until(predicate, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def mirror(url: str, log=None, retry_seconds: float = 60, **policy) -> cc.Mirror:
    """The backup loop's worker in this process (the child runs the same), with a Log and a policy
    that keeps every local checkpoint unless told otherwise."""
    return cc.Mirror(
        url,
        store.MirrorPolicy(**{"keep_last": 100, **policy}),
        retry_seconds=retry_seconds,
        max_retry_seconds=retry_seconds,
        log=log if log is not None else Log(),
    )


def reconcile(worker: cc.Mirror, folder: Path) -> store.MirrorPlan | None:
    """Step `worker` until its plan is empty, as the child does after a wake-up; None when a step failed."""
    for _ in range(50):
        plan = worker.step(folder)
        if plan is None or plan.empty():
            return plan
    raise AssertionError("the plan never emptied")


def refuse_uploads(worker: cc.Mirror, message: str = "denied"):
    """Make every upload of `worker` fail with PermissionError(message); returns the function that undoes it."""
    working = worker.fs.put_file

    def refuse(*args, **kwargs):
        raise PermissionError(message)

    worker.fs.put_file = refuse
    return lambda: setattr(worker.fs, "put_file", working)


def assert_no_secrets(text: str, url: str) -> None:
    bucket = url.split("://", 1)[1].split("/", 1)[0]
    for secret in (SECRET_KEY, ACCESS_KEY, url, bucket, "127.0.0.1:"):
        assert secret not in text


# ----------------------------------------------------------------------------------------------
# URLs, backends, settings.


def test_backup_url_from_arg_or_the_original_env_alias(monkeypatch):
    monkeypatch.delenv("THINK72_CLOUD_RESUME", raising=False)
    monkeypatch.setenv("THINK72_BACKUP_URL", "s3://env/run")
    assert cc.backup_url_from_env_or_arg(None) is None
    monkeypatch.setenv("THINK72_CLOUD_RESUME", "1")
    assert cc.backup_url_from_env_or_arg(None) == "s3://env/run"
    assert cc.backup_url_from_env_or_arg("gs://arg/run") == "gs://arg/run"
    monkeypatch.delenv("THINK72_BACKUP_URL")
    with pytest.raises(UserError, match="THINK72_BACKUP_URL"):
        cc.backup_url_from_env_or_arg(None)


def test_train_py_options_build_the_backup(tmp_path, monkeypatch):
    from tinyllm.training import train

    def session(*argv: str):  # train.py's options, declared there once (SessionSettings)
        return train.parse_args(["--data", str(tmp_path), "--out", str(tmp_path / "run"), *argv]).session

    monkeypatch.delenv("THINK72_CLOUD_RESUME", raising=False)
    assert cc.backup_from_args(session()) is None
    args = session(
        "--backup-to",
        str(tmp_path / "remote"),
        "--remote-keep-recent",
        "2",
        "--remote-keep-every",
        "3",
        "--backup-max-unbacked",
        "5",
        "--keep-every",
        "1000",
    )
    backup = cc.backup_from_args(args, save_every=100, log=Log())
    assert isinstance(backup, cc.BackupProcess)  # train.py's backup runs in its own process
    # every 3rd save of --save-every 100: every multiple of 300 steps, the local rule's form
    assert backup.policy == store.MirrorPolicy(
        keep_last=2, keep_every=1000, remote_keep_last=2, remote_keep_every=300, max_unbacked=5
    )
    assert backup.wait(1)  # nothing submitted: nothing to wait for
    backup.close()
    assert cc.backup_from_args(args, save_every=None, log=Log()).policy.remote_keep_every == 0  # no save grid
    monkeypatch.setenv("THINK72_CLOUD_RESUME", "1")
    monkeypatch.setenv("THINK72_BACKUP_URL", str(tmp_path / "env-remote"))
    backup = cc.backup_from_args(session(), log=Log())
    assert backup.url == str(tmp_path / "env-remote")
    backup.close()


# ----------------------------------------------------------------------------------------------
# Backup to a local folder (a mounted drive): protocol, retention, restore.


def test_local_folder_backup_retention_and_restore(tmp_path):
    remote = tmp_path / "drive" / "run"
    other_run = save_and_point_latest(tmp_path / "other", 5, "other-run")
    fs, root = rs.open_remote(str(remote))
    cc.upload_checkpoint(fs, root, other_run)  # a file this run did not upload: never deleted
    local = tmp_path / "run" / "checkpoints"
    log = Log()
    worker = mirror(str(remote), log, remote_keep_last=2, remote_keep_every=30)
    worker.look()
    paths = []
    for step in [*range(10, 100, 10), 95, 100, 110]:  # 95: off the save grid (a SIGTERM save)
        paths.append(save_and_point_latest(local, step))
        assert reconcile(worker, local).caught_up
    state = remote_state(str(remote))
    # the newest two, every multiple of 30 steps (30, 60, 90), and the other run's 5
    assert sorted(state["verified"]) == [5, 30, 60, 90, 100, 110]
    assert state["unverified"] == [] and state["partials"] == []
    assert state["latest"]["path"] == "step-00000110.pt"
    assert state["latest"]["sha256"] == sha256_file(paths[-1])
    assert "the remote already holds 1 verified checkpoint(s), latest step 5" in log[0]

    fresh = tmp_path / "fresh" / "checkpoints"
    restored = cc.restore_latest(f"file://{remote}", fresh, log=log)
    assert restored == fresh / "step-00000110.pt"
    assert restored.read_bytes() == paths[-1].read_bytes()
    assert json.loads((fresh / "latest.json").read_text())["path"] == "step-00000110.pt"
    assert torch.load(restored, weights_only=True)["step"] == 110
    assert sorted(p.name for p in fresh.iterdir()) == ["latest.json", "step-00000110.pt", "step-00000110.pt.json"]


@pytest.mark.parametrize("store", ["folder", "s3"])
def test_remote_retention_spans_sessions_of_the_same_run(store, tmp_path, request):
    """Session 1 saves 10..30, the disk is lost, session 2 (same run_id) goes on to 53: retention
    applies to both sessions' uploads, never to another run's files on the same remote."""
    url = str(tmp_path / "remote") if store == "folder" else request.getfixturevalue("s3_url")
    fs, root = rs.open_remote(url)
    for step in (5, 25):  # another run's checkpoints on the same remote
        cc.upload_checkpoint(fs, root, save_and_point_latest(tmp_path / "other" / "checkpoints", step, "other-run"))

    def session(local: Path, steps: list[int]) -> Log:
        log = Log()
        worker = mirror(url, log, remote_keep_last=3, remote_keep_every=100)
        for step in steps:
            save_and_point_latest(local, step, "run-a")
            assert reconcile(worker, local).caught_up
        return log

    session(tmp_path / "machine-1" / "run" / "checkpoints", [10, 20, 30])
    assert sorted(remote_state(url)["verified"]) == [5, 10, 20, 25, 30]
    log = session(tmp_path / "machine-2" / "run" / "checkpoints", [40, 50, 53])
    state = remote_state(url)
    assert sorted(state["verified"]) == [5, 25, 40, 50, 53]
    assert state["latest"]["step"] == 53 and state["latest"]["run_id"] == "run-a"
    removed = [line.rsplit(" ", 1)[-1] for line in log if "remote retention removed" in line]
    assert removed == ["step-00000010.pt", "step-00000020.pt", "step-00000030.pt"]  # one per upload
    record = fs.cat_file(f"{cc.checkpoint_folder(root)}/step-00000053.pt.json")
    assert json.loads(record)["run_id"] == "run-a"


@pytest.mark.parametrize(
    "remote_status, says",
    [
        (
            {"status": store.COMPLETE, "step": 103},
            "the backed-up run finished at step 103; `train.py --resume auto` makes its end again from that step",
        ),
        (
            {"status": store.COMPLETE, "step": 110},  # the backup's newest checkpoint is older than its status
            "the run resumes from step 103, the newest verified checkpoint in the backup (its run_status.json said "
            "COMPLETE at step 110)",
        ),
        (
            {},
            "the run resumes from step 103, the newest verified checkpoint in the backup (its run_status.json said "
            "? at step ?)",
        ),
    ],
)
def test_a_restore_says_what_the_run_does_from_the_step_restored(remote_status, says):
    assert cc.restore_note(103, remote_status).startswith(f"checkpoint restore: {says}")


OLD_STORE, NEW_STORE = "s3://old-bucket/run", "s3://new-bucket/run"


@pytest.mark.parametrize(
    "command, url, expected",
    [
        (
            "python train.py --data c --out runs/a --resume auto",
            NEW_STORE,
            "python train.py --data c --out /new/b --resume auto",
        ),
        ("tinyllm-train --out=runs/a --resume auto", NEW_STORE, "tinyllm-train --out=/new/b --resume auto"),
        (
            "python train.py --data 'my corpus' --resume auto",
            NEW_STORE,
            "python train.py --data 'my corpus' --resume auto",
        ),
        (  # the store was copied: the command backs up to the one pulled from, not to the old one
            f"python train.py --out runs/a --backup-to {OLD_STORE} --resume auto",
            NEW_STORE,
            f"python train.py --out /new/b --backup-to {NEW_STORE} --resume auto",
        ),
        (
            f"tinyllm-train --backup-to={OLD_STORE} --out runs/a --resume auto",
            "/mnt/drive/run",
            "tinyllm-train --backup-to=/mnt/drive/run --out /new/b --resume auto",
        ),
        (  # the same store: the same command
            f"python train.py --out /new/b --backup-to {NEW_STORE} --resume auto",
            NEW_STORE,
            f"python train.py --out /new/b --backup-to {NEW_STORE} --resume auto",
        ),
        (  # credentials in the URL pulled from: the placeholder, which train.py refuses
            f"python train.py --out runs/a --backup-to {OLD_STORE} --resume auto",
            "s3://KEY:SECRET@new-bucket/run",
            "python train.py --out /new/b --backup-to URL --resume auto",
        ),
        (  # the run's URL had credentials (the placeholder): the one pulled from, which has none
            "python train.py --out runs/a --backup-to URL --resume auto",
            NEW_STORE,
            f"python train.py --out /new/b --backup-to {NEW_STORE} --resume auto",
        ),
        (  # no backup (pushed by hand, or THINK72_BACKUP_URL): a restore adds no place to write to
            "python train.py --out runs/a --resume auto",
            NEW_STORE,
            "python train.py --out /new/b --resume auto",
        ),
    ],
)
def test_a_restored_command_continues_the_folder_and_backs_up_to_the_store_pulled_from(command, url, expected):
    assert cc.command_after_restore(command, Path("/new/b"), url) == expected


@pytest.mark.parametrize(
    "before, after, says",
    [
        (NEW_STORE, NEW_STORE, None),
        (None, None, None),
        (OLD_STORE, NEW_STORE, f"now backs up to {NEW_STORE}, the store restored from, not to {OLD_STORE}"),
        (OLD_STORE, "URL", "URL stands for the URL pulled from, which carries credentials: type it in"),
    ],
)
def test_a_restore_says_when_its_command_backs_up_elsewhere(before, after, says):
    note = cc.backup_change_note(before, after)
    assert note is None if says is None else says in note


def backed_up_run(tmp_path: Path, status: str, total_steps: int, backup_to: str = "") -> str:
    """tmp_path/run backed up to tmp_path/remote at step 10, its run_status.json `status` with a resume command
    naming tmp_path/run (and `backup_to`'s --backup-to, when given); returns the remote."""
    run, remote = tmp_path / "run", str(tmp_path / "remote")
    worker = mirror(remote)
    atomic_write_json(run / "training_settings.json", {"run_id": "run-a"})
    backup = f" --backup-to {backup_to}" if backup_to else ""
    command = f"python train.py --data corpus --out {run}{backup} --resume auto"
    store.write_status(run, status, step=10, total_steps=total_steps, resume_command=command)
    save_and_point_latest(run / "checkpoints", 10, "run-a")
    assert reconcile(worker, run / "checkpoints").caught_up
    return remote


def test_a_finished_run_pulled_into_another_folder_gets_one_status_to_resume_there(tmp_path):
    remote = backed_up_run(tmp_path, store.COMPLETE, total_steps=10)
    fresh = tmp_path / "pulled"
    fresh.mkdir()
    cc.restore_latest(remote, fresh / "checkpoints", log=Log(), read_only=True)
    status = json.loads((fresh / "run_status.json").read_text())
    assert status["status"] == store.NEEDS_RESUME and "COMPLETE at step 10" in status["reason"]
    assert status["resume_command"] == f"python train.py --data corpus --out {fresh} --resume auto"
    assert [path.name for path in fresh.iterdir() if temporary_target(path.name)] == []


def test_a_pull_into_another_folder_resumes_that_folder_and_says_what_it_did_not_download(tmp_path):
    remote = backed_up_run(tmp_path, store.NEEDS_RESUME, total_steps=20)
    fresh, log = tmp_path / "pulled", Log()
    fresh.mkdir()
    cc.restore_latest(remote, fresh / "checkpoints", log=log, read_only=True)
    status = json.loads((fresh / "run_status.json").read_text())
    assert status["resume_command"] == f"python train.py --data corpus --out {fresh} --resume auto"
    assert "restored from the remote and verified" in log.text()
    again = Log()  # the same pull again: the checkpoint is here already, the remote copy not read
    cc.restore_latest(remote, fresh / "checkpoints", log=again, read_only=True)
    assert "step-00000010.pt (step 10) already here, matching the backup's record (not downloaded" in again.text()


def test_a_run_pulled_from_a_copy_of_its_backup_backs_up_to_the_copy(tmp_path, capsys):
    """The store was moved (A copied to B): `pull B RUN` prints, and RUN/run_status.json keeps, a command that
    backs up to B, saying so; a run_status.json that was in RUN before the pull is kept, with a warning."""
    old = tmp_path / "remote"
    backed_up_run(tmp_path, store.NEEDS_RESUME, total_steps=20, backup_to=str(old))
    moved = tmp_path / "moved"
    old.rename(moved)
    fresh = tmp_path / "pulled"
    assert cc.main(["pull", str(moved), str(fresh)]) == 0
    expected = f"python train.py --data corpus --out {fresh} --backup-to {moved} --resume auto"
    assert json.loads((fresh / "run_status.json").read_text())["resume_command"] == expected
    out = capsys.readouterr().out
    assert f"now backs up to {moved}, the store restored from, not to {old}" in out
    assert out.splitlines()[-1] == f"continue with: {expected}" and "WARNING" not in out

    kept = tmp_path / "run"  # the original folder, its run_status.json naming the old store, its checkpoint lost
    (kept / "checkpoints" / "step-00000010.pt").unlink()
    assert cc.main(["pull", str(moved), str(kept)]) == 0
    out = capsys.readouterr().out
    assert f"backs up to {old}, not to the store pulled from" in out.splitlines()[-2]
    assert (
        out.splitlines()[-1]
        == f"continue with: python train.py --data corpus --out {kept} --backup-to {old} --resume auto"
    )


def test_a_run_is_never_pulled_into_a_corpus_or_a_folder_of_other_files(tmp_path):
    """`pull RUN_URL corpus/mine` (the arguments of a corpus pull, or a typo): refused before anything is read,
    as train.py refuses such an --out, so a run's checkpoints and files never land in your data."""
    remote = backed_up_run(tmp_path, store.NEEDS_RESUME, total_steps=20)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "corpus_manifest.json").write_text("{}")
    data = tmp_path / "texts"
    data.mkdir()
    (data / "a.txt").write_text("a text")
    for target, problem in (
        (corpus, "is a corpus folder (corpus_manifest.json), not a run folder"),
        (data, "holds files but is not a tinyllm run folder"),
        (data / "a.txt", "is a file, not a run folder"),
    ):
        before = sorted(path.name for path in target.parent.iterdir())
        with pytest.raises(UserError, match=f"^pull: {re.escape(str(target))} {re.escape(problem)}"):
            cc.main(["pull", str(remote), str(target)])
        assert sorted(path.name for path in target.parent.iterdir()) == before
    assert sorted(path.name for path in corpus.iterdir()) == ["corpus_manifest.json"]
    assert sorted(path.name for path in data.iterdir()) == ["a.txt"]
    assert cc.main(["pull", str(remote), str(tmp_path / "pulled")]) == 0  # a new folder: pulled


def test_run_files_are_backed_up_and_restored_when_missing(tmp_path):
    """metrics.jsonl and the other small RUN files travel with the checkpoints, so a restored run keeps its history."""
    run = tmp_path / "machine-1" / "run"
    remote = str(tmp_path / "remote")
    worker = mirror(remote)
    run.mkdir(parents=True)
    for step in (10, 20):
        for line in range(step - 9, step + 1):
            append_jsonl(run / "metrics.jsonl", {"kind": "train", "step": line, "loss": 1.0 / line})
        atomic_write_json(run / "training_settings.json", {"run_id": "run-a", "preset": "tiny"})
        atomic_write_json(run / "hardware.json", {"device": "cpu"})
        save_and_point_latest(run / "checkpoints", step, "run-a")
        assert reconcile(worker, run / "checkpoints").caught_up
    sent = (run / "metrics.jsonl").read_bytes()
    append_jsonl(run / "metrics.jsonl", {"kind": "train", "step": 21})  # after the last checkpoint
    fs, root = rs.open_remote(remote)
    assert fs.cat_file(f"{root}/metrics.jsonl") == sent
    assert not [name for name in fs.ls(root, detail=False) if temporary_target(name.rsplit("/", 1)[-1])]

    fresh = tmp_path / "machine-2" / "run"
    (fresh / "hardware.json").parent.mkdir(parents=True)
    (fresh / "hardware.json").write_text('{"device": "cuda"}\n')  # present locally: kept as is
    log = Log()
    assert cc.restore_latest(remote, fresh / "checkpoints", log=log) == fresh / "checkpoints" / "step-00000020.pt"
    assert (fresh / "metrics.jsonl").read_bytes() == sent
    assert json.loads((fresh / "training_settings.json").read_text())["run_id"] == "run-a"
    assert json.loads((fresh / "hardware.json").read_text()) == {"device": "cuda"}
    assert "metrics.jsonl, training_settings.json restored" in log.text()
    assert not [path for path in fresh.rglob(".*") if temporary_target(path.name)]
    # the record beside the restored checkpoint is the one written with it: local retention treats it as this run's
    restored = fresh / "checkpoints" / "step-00000020.pt"
    assert (
        json.loads((fresh / "checkpoints" / "step-00000020.pt.json").read_text())
        == json.loads((fresh / "checkpoints" / "latest.json").read_text())
        == json.loads((run / "checkpoints" / "step-00000020.pt.json").read_text())
    )
    assert store.newest_verified(store.list_folder(fresh / "checkpoints")) == restored.name
    save_and_point_latest(fresh / "checkpoints", 30, "run-a")
    store.Checkpointer(fresh / "checkpoints", "run-a", keep_last=1, keep_every=0).apply_retention()
    assert sorted(p.name for p in (fresh / "checkpoints").glob("step-*")) == [
        "step-00000030.pt",
        "step-00000030.pt.json",
    ]

    # run files of another run on the same remote are not mixed into this one
    atomic_write_json(tmp_path / "settings.json", {"run_id": "run-b"})
    rs.upload_verified(fs, tmp_path / "settings.json", f"{root}/training_settings.json")
    other = tmp_path / "machine-3" / "run"
    log = Log()
    cc.restore_latest(remote, other / "checkpoints", log=log)
    assert not (other / "metrics.jsonl").exists() and "belong to another run" in log.text()


def test_restore_from_an_empty_remote_returns_none(tmp_path):
    log = Log()
    assert cc.restore_latest(str(tmp_path / "empty"), tmp_path / "run" / "checkpoints", log=log) is None
    assert log == []  # the backup's start-up line says it once: "reachable and holds no checkpoint yet"


@pytest.mark.parametrize("store", ["folder", "s3"])
def test_an_upload_reads_a_recorded_checkpoint_once(store, tmp_path, request, monkeypatch):
    """train.py's record's sha256 is what the remote copy is checked against: the upload is the only read
    of the local file. A file without a record is never sent (nothing could verify it)."""
    import builtins
    import io

    url = str(tmp_path / "remote") if store == "folder" else request.getfixturevalue("s3_url")
    fs, root = rs.open_remote(url)
    recorded = save_and_point_latest(tmp_path / "run" / "checkpoints", 1, "run-a")
    unrecorded = fake_checkpoint(tmp_path / "old" / "checkpoints", 2)
    local_files = {str(recorded): recorded.name, str(unrecorded): unrecorded.name}
    opened = []
    real_open = builtins.open

    def counting_open(file, mode="r", *args, **kwargs):
        if "r" in mode and str(file) in local_files:
            opened.append(local_files[str(file)])
        return real_open(file, mode, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(builtins, "open", counting_open)
        patch.setattr(io, "open", counting_open)
        first = cc.upload_checkpoint(fs, root, recorded)
        assert opened == [recorded.name]
        with pytest.raises(rs.LocalFileChanged, match="step-00000002.pt has no record"):
            cc.upload_checkpoint(fs, root, unrecorded)
        assert opened == [recorded.name]
    assert first.sha256 == sha256_file(recorded) and first.run_id == "run-a"
    assert sorted(remote_state(url)["verified"]) == [1]


@pytest.mark.parametrize("change", ["flip", "truncate"])
@pytest.mark.parametrize("store", ["folder", "s3"])
def test_a_checkpoint_changed_after_its_record_is_never_published(store, change, tmp_path, request, flip_byte):
    url = str(tmp_path / "remote") if store == "folder" else request.getfixturevalue("s3_url")
    local = tmp_path / "run" / "checkpoints"
    log = Log()
    worker = mirror(url, log, retry_seconds=0.05)
    good = save_and_point_latest(local, 10, "run-a")
    assert reconcile(worker, local).caught_up
    changed = save_and_point_latest(local, 20, "run-a")
    if change == "flip":
        flip_byte(changed, changed.stat().st_size // 2)
    else:
        changed.write_bytes(changed.read_bytes()[:-1])
    assert not reconcile(worker, local).caught_up  # given up at once: reading the same bytes again would not help
    assert not reconcile(worker, local).caught_up  # and out of the plan for good: set aside
    warnings = [line for line in log if changed.name in line and "WARNING" in line]
    assert len(warnings) == 1 and "changed on disk" in warnings[0], log
    assert not any("not backed up yet" in line for line in log)  # not retried
    assert (local / f"{changed.name}.corrupt").is_file() and not changed.exists()
    state = remote_state(url)
    assert sorted(state["verified"]) == [10] and state["latest"]["path"] == good.name
    assert state["unverified"] == [] and state["partials"] == []  # what was sent was removed, never promoted


def test_unbacked_checkpoints_are_kept_up_to_the_bound(tmp_path):
    local = tmp_path / "run" / "checkpoints"
    log = Log()
    worker = mirror(str(tmp_path / "remote"), log, keep_last=1, max_unbacked=2)
    allow_uploads = refuse_uploads(worker, "denied for s3://secret-bucket")
    for step in (1, 2, 3, 4, 5):
        save_and_point_latest(local, step)
    assert reconcile(worker, local) is None
    # local retention would delete all but the newest: the two newest unbacked candidates stay
    assert sorted(store.list_folder(local).files) == [store.checkpoint_name(step) for step in (3, 4, 5)]
    warnings = [line for line in log if "WARNING deleting local" in line]
    assert len(warnings) == 2 and "step-00000001.pt" in warnings[0]
    assert any("not backed up yet: PermissionError" in line for line in log)
    assert "secret-bucket" not in log.text() and str(tmp_path / "remote") not in log.text()

    allow_uploads()
    save_and_point_latest(local, 6)
    assert reconcile(worker, local).caught_up
    # 3, 4, 5 wait behind 6 before the first upload: the oldest beyond two goes; the remote keeps the newest
    # three, and the local ones retention let go are gone once they are there
    warnings = [line for line in log if "WARNING deleting local" in line]
    assert len(warnings) == 3 and "step-00000003.pt" in warnings[2]
    assert sorted(remote_state(str(tmp_path / "remote"))["verified"]) == [4, 5, 6]
    assert sorted(store.list_folder(local).files) == [store.checkpoint_name(6)]


# ----------------------------------------------------------------------------------------------
# BackupProcess: the same backup in a child process, which is what train.py uses.


def process_alive(pid: int) -> bool:
    """True while `pid` runs (a zombie waiting to be reaped counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_backup_process_reports_back_and_replaces_a_dead_child(tmp_path, capfd):
    local, remote = tmp_path / "run" / "checkpoints", str(tmp_path / "remote")
    log = Log()
    backup = cc.BackupProcess(remote, store.MirrorPolicy(keep_last=1, remote_keep_last=2), log=log)
    first_child = backup.child_pid
    assert first_child not in (None, os.getpid())
    paths = []
    for step in (10, 20, 30):
        paths.append(save_and_point_latest(local, step, "run-a"))
        backup.submit(paths[-1], step)
        assert backup.wait(30)
    assert "the newest checkpoint step-00000030.pt is on the remote and verified" in log[-1]
    child_output = capfd.readouterr().out
    assert "the remote is reachable and holds no checkpoint yet (nothing to restore)" in child_output
    assert "remote retention removed step-00000010.pt" in child_output
    assert backup.deletable(paths[:2]) == []  # the child deletes what the remote holds
    assert sorted(store.list_folder(local).files) == [paths[2].name]

    os.kill(first_child, signal.SIGKILL)
    assert wait_until(lambda: backup.child_pid is None)
    assert backup.wait(30)  # a new child plans again: the newest checkpoint is there
    assert any("WARNING the backup process exited" in line for line in log)
    second_child = backup.child_pid
    assert second_child not in (None, first_child)
    backup.submit(save_and_point_latest(local, 40, "run-a"), 40)
    assert backup.wait(30)
    backup.close()
    assert backup.child_pid is None and not process_alive(second_child)
    state = remote_state(remote)
    assert sorted(state["verified"]) == [30, 40] and state["latest"]["step"] == 40

    with pytest.raises(UserError, match="unknown storage protocol"):  # the child's error, raised here
        cc.BackupProcess("nosuch://bucket/x", log=Log())


def test_backup_process_without_a_child_applies_the_unbacked_bound(tmp_path):
    local, log = tmp_path / "run" / "checkpoints", Log()
    backup = cc.BackupProcess(str(tmp_path / "remote"), store.MirrorPolicy(keep_last=1, max_unbacked=2), log=log)
    backup.close()  # from here on there is no child to ask
    paths = [save_and_point_latest(local, step) for step in (1, 2, 3, 4, 5)]
    backup.submit(paths[-1], 5)
    # nothing is known of the remote: of the four candidates the oldest beyond two go, with a warning
    assert backup.deletable(paths[3::-1]) == [paths[0].resolve(), paths[1].resolve()]
    warnings = [line for line in log if "WARNING deleting local" in line]
    assert len(warnings) == 2 and paths[0].name in warnings[0] and "not running" in warnings[0]
    assert backup.deletable(paths[2:4]) == []  # not among what the plan releases


def test_backup_child_ignores_sigterm_and_leaves_when_the_trainer_is_killed(tmp_path):
    pid_file = tmp_path / "child.pid"  # not on stdout: the child prints its own lines there
    script = "\n".join(
        [
            "import pathlib, sys, time",
            f"sys.path.insert(0, {str(ROOT)!r})",
            "from tinyllm.store import checkpoint_cloud",
            f"backup = checkpoint_cloud.BackupProcess({str(tmp_path / 'remote')!r}, log=lambda line: None)",
            f"pathlib.Path({str(pid_file)!r} + '.tmp').write_text(str(backup.child_pid))",
            f"pathlib.Path({str(pid_file)!r} + '.tmp').rename({str(pid_file)!r})",
            "time.sleep(600)",
        ]
    )
    trainer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.DEVNULL)
    try:
        assert wait_until(pid_file.exists, 60)
        child = int(pid_file.read_text())
        os.kill(child, signal.SIGTERM)  # SIGTERM to the whole process group must not cut an upload short
        time.sleep(0.5)
        assert process_alive(child)
    finally:
        trainer.kill()
        trainer.wait()
    assert wait_until(lambda: not process_alive(child), 30)  # its pipe closed: it leaves on its own


# Where the backup child waits, in its own process, for its trainer to be killed (a sitecustomize): each
# phase of its life at which a kill -9 of the trainer can find it.
CHILD_PHASES = {  # phase: (what the trainer does, the child's function that waits before it runs)
    "starting": ("start", "Mirror.__init__"),  # the trainer waits for "ready", which the child has yet to send
    "ready": ("start", "Mirror.look"),  # "ready" sent; it says what the remote holds
    "mid-upload": ("submit", "upload_checkpoint"),
    "closing": ("close", "Connection.send"),  # its answer to "close" not sent yet
}
WAIT_FOR_THE_KILL = """
import os, pathlib, time, multiprocessing.connection
from tinyllm.store import checkpoint_cloud
if os.environ.get("TEST_BACKUP_CHILD") == "1":  # the child (the trainer sets it after its own start)
    owner_name, _, name = {where!r}.rpartition(".")
    owner = {{"": checkpoint_cloud, "Mirror": checkpoint_cloud.Mirror,
              "Connection": multiprocessing.connection.Connection}}[owner_name]
    original, trainer = getattr(owner, name), os.getppid()
    def waits_for_the_kill(*args, **kwargs):
        if name != "send" or args[1][0] == "reply":
            pathlib.Path({marker!r}).touch()
            while os.getppid() == trainer:
                time.sleep(0.02)
        return original(*args, **kwargs)
    setattr(owner, name, waits_for_the_kill)
"""


@pytest.mark.parametrize("phase", [*CHILD_PHASES, "mid-upload, its stdout's reader gone"])
def test_a_killed_trainer_leaves_no_traceback_from_its_backup_child(tmp_path, phase, patch_python_children):
    action, where = CHILD_PHASES[phase.split(",")[0]]
    marker, child_pid, stderr = tmp_path / "in-phase", tmp_path / "child.pid", tmp_path / "stderr.txt"
    patch_python_children(WAIT_FOR_THE_KILL.format(where=where, marker=str(marker)))
    checkpoint = save_and_point_latest(tmp_path / "run" / "checkpoints", 3)
    script = "\n".join(
        [
            "import os, pathlib, threading, time",
            "from tinyllm.store import checkpoint_cloud",
            "os.environ['TEST_BACKUP_CHILD'] = '1'",
            "def note_child():",  # the child's pid, for the test to see it exit; "start" blocks in the constructor
            "    for _ in range(3000):",
            "        time.sleep(0.01)",
            "        pids = pathlib.Path(f'/proc/{os.getpid()}/task/{os.getpid()}/children').read_text().split()",
            "        if pids:",
            f"            return pathlib.Path({str(child_pid)!r}).write_text(pids[0])",
            "threading.Thread(target=note_child, daemon=True).start()",
            f"backup = checkpoint_cloud.BackupProcess({str(tmp_path / 'remote')!r}, log=print)",
            f"backup.submit({str(checkpoint)!r}, 3) if {action == 'submit'} else None",
            f"backup.close(timeout_s=120) if {action == 'close'} else None",
            "time.sleep(600)",
        ]
    )
    with open(stderr, "w") as errors:
        trainer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=errors, text=True)
        try:
            assert wait_until(marker.exists, 120), stderr.read_text()
            child = int(child_pid.read_text())
            trainer.kill()
            trainer.wait()
            if "reader gone" in phase:
                trainer.stdout.close()  # a notebook or terminal that went away with the trainer
            assert wait_until(lambda: not process_alive(child), 60)
            output = "" if trainer.stdout.closed else trainer.stdout.read()
        finally:
            trainer.kill()
    log = output + stderr.read_text()
    assert "Traceback" not in log and "Error" not in log and "Exception" not in log, log
    if phase == "mid-upload":  # the upload it was on finished; the remote holds it, verified
        assert "step-00000003.pt (step 3" in output and "uploaded and verified" in output


# ----------------------------------------------------------------------------------------------
# A real S3 endpoint: faults.


def test_s3_backup_survives_the_server_going_away(s3_url, moto_server, tmp_path, capfd):
    local = tmp_path / "run" / "checkpoints"
    log = Log()
    backup = cc.BackupProcess(
        s3_url, store.MirrorPolicy(remote_keep_last=5), retry_seconds=0.2, max_retry_seconds=1, log=log
    )
    first = save_and_point_latest(local, 100)
    backup.submit(first, 100)
    assert backup.wait(30)

    moto_server.stop()
    try:
        during = []
        for step in (200, 300, 400):
            during.append(save_and_point_latest(local, step))
            backup.submit(during[-1], step)  # returns at once although every upload fails
        assert not backup.wait(1.0)
        assert "did NOT reach the remote" in log[-1] and "step-00000400.pt" in log[-1]
        assert backup.deletable([first, *during[:2]]) == []  # the child decides, from the remote listing
        assert all(path.exists() for path in [first, *during])  # the remote cannot be listed: within the bound
    finally:
        moto_server.start()

    assert backup.wait(30)
    backup.close()
    assert sorted(store.list_folder(local).files) == [path.name for path in during[1:]]  # 100, 200 are there
    state = remote_state(s3_url)
    assert sorted(state["verified"]) == [100, 200, 300, 400]
    assert state["latest"]["step"] == 400  # never moved backwards by the older backlog
    captured = capfd.readouterr()  # the child's own output
    assert "not backed up yet: EndpointConnectionError" in captured.out
    assert_no_secrets(log.text() + captured.out + captured.err, s3_url)


def test_s3_upload_interrupted_halfway_keeps_the_previous_latest(s3_url, tmp_path, capsys):
    local = tmp_path / "run" / "checkpoints"
    log = Log()
    worker = mirror(s3_url, log)
    good = save_and_point_latest(local, 10)
    assert reconcile(worker, local).caught_up

    real_put = worker.fs.put_file

    def half_then_fail(local_path, remote_path, **kwargs):
        data = Path(local_path).read_bytes()
        worker.fs.pipe_file(remote_path, data[: len(data) // 2])
        raise ConnectionResetError(f"connection lost talking to {s3_url} with {SECRET_KEY}")

    worker.fs.put_file = half_then_fail
    interrupted = save_and_point_latest(local, 20)
    assert reconcile(worker, local) is None
    state = remote_state(s3_url)
    assert state["latest"]["path"] == good.name
    assert sorted(state["verified"]) == [10] and state["unverified"] == []
    assert any("not backed up yet: ConnectionResetError" in line for line in log)

    # an upload that completes but arrives different is never promoted either
    def corrupt_copy(local_path, remote_path, **kwargs):
        worker.fs.pipe_file(remote_path, b"x" + Path(local_path).read_bytes()[1:])

    worker.fs.put_file = corrupt_copy
    assert reconcile(worker, local) is None
    assert any("VerificationError" in line for line in log)
    assert remote_state(s3_url)["latest"]["path"] == good.name

    restored = cc.restore_latest(s3_url, tmp_path / "fresh" / "checkpoints", log=log)
    assert restored.read_bytes() == good.read_bytes()

    worker.fs.put_file = real_put
    assert reconcile(worker, local).caught_up
    assert any(
        "the remote works again: step-00000020.pt (step 20) is backed up after 2 failed attempt(s)" in line
        for line in log
    )
    assert remote_state(s3_url)["latest"]["path"] == interrupted.name
    captured = capsys.readouterr()
    assert_no_secrets(log.text() + captured.out + captured.err, s3_url)


def test_s3_corrupted_remote_checkpoint_is_never_used(s3_url, tmp_path):
    local = tmp_path / "run" / "checkpoints"
    worker = mirror(s3_url)
    paths = []
    for step in (1, 2, 3):
        paths.append(save_and_point_latest(local, step))
        assert reconcile(worker, local).caught_up
    fs, root = rs.open_remote(s3_url)
    newest = f"{cc.checkpoint_folder(root)}/{paths[2].name}"
    data = fs.cat_file(newest)
    fs.pipe_file(newest, data[:100] + bytes([data[100] ^ 0xFF]) + data[101:])  # same size, one bit flipped

    log = Log()
    restored = cc.restore_latest(s3_url, tmp_path / "fresh" / "checkpoints", log=log)
    assert restored.name == paths[1].name and restored.read_bytes() == paths[1].read_bytes()
    assert any("WARNING" in line and paths[2].name in line for line in log)
    # the corrupt one is set aside: never counted as a backup again, and latest.json names the good one
    state = remote_state(s3_url)
    assert sorted(state["verified"]) == [1, 2] and state["unverified"] == [paths[2].name]
    assert state["latest"]["path"] == paths[1].name
    assert fs.exists(f"{cc.checkpoint_folder(root)}/{paths[2].name}.json.corrupt")
    latest = json.loads((tmp_path / "fresh" / "checkpoints" / "latest.json").read_text())
    assert latest["step"] == 2 and latest["sha256"] == sha256_file(paths[1])
    assert not [path for path in (tmp_path / "fresh" / "checkpoints").iterdir() if temporary_target(path.name)]
    assert cc.main(["verify", s3_url]) == 1

    for path in paths[:2]:
        fs.pipe_file(f"{cc.checkpoint_folder(root)}/{path.name}", b"garbage")
    with pytest.raises(UserError, match="no checkpoint on the remote matches"):
        cc.restore_latest(s3_url, tmp_path / "fresh2" / "checkpoints", log=log)


def test_s3_unreachable_remote_on_restore_is_one_clear_error(s3_url, moto_server, tmp_path):
    moto_server.stop()
    try:
        with pytest.raises(UserError, match=r"failed \(EndpointConnectionError\)") as error:
            cc.restore_latest(s3_url, tmp_path / "checkpoints", log=Log())
    finally:
        moto_server.start()
    assert_no_secrets(str(error.value), s3_url)


# ----------------------------------------------------------------------------------------------
# The command line and corpora.


def test_cli_push_list_verify_pull_on_s3(s3_url, tmp_path, capsys):
    run = tmp_path / "run"
    paths = [save_and_point_latest(run / "checkpoints", step) for step in (50, 100)]
    assert cc.main(["push", str(run), s3_url]) == 0
    truncated = save_and_point_latest(run / "checkpoints", 150)
    truncated.write_bytes(truncated.read_bytes()[:1000])  # killed mid-copy: never pushed
    assert cc.main(["push", str(run), s3_url]) == 0  # idempotent for the others
    assert cc.main(["list", s3_url]) == 0
    assert cc.main(["verify", s3_url]) == 0
    out = capsys.readouterr().out
    assert "already on the remote" in out and "step-00000100.pt" in out and "<- latest" in out
    assert "WARNING step-00000150.pt" in out and "0 problem(s)" in out
    assert sorted(remote_state(s3_url)["verified"]) == [50, 100]
    assert remote_state(s3_url)["latest"]["step"] == 100
    assert cc.main(["pull", s3_url, str(tmp_path / "elsewhere")]) == 0
    pulled = tmp_path / "elsewhere" / "checkpoints" / paths[1].name
    assert pulled.read_bytes() == paths[1].read_bytes()


def test_cli_errors_are_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cc.run_main(lambda: cc.main(["push", str(tmp_path / "missing"), str(tmp_path / "remote")]))
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().count("\n") == 0
    texts = tmp_path / "texts"  # a folder of data, neither a run nor a corpus
    texts.mkdir()
    (texts / "a.txt").write_text("a text")
    with pytest.raises(UserError, match=f"^{texts} is neither a run folder \\(no checkpoints/\\) nor a corpus"):
        cc.main(["push", str(texts), str(tmp_path / "remote")])
    (texts / "checkpoints").mkdir()
    with pytest.raises(UserError, match=f"^{texts / 'checkpoints'} holds no step-\\*.pt checkpoints$"):
        cc.main(["push", str(texts), str(tmp_path / "remote")])
    (tmp_path / "empty-remote").mkdir()
    with pytest.raises(UserError, match="no checkpoint to pull"):
        cc.main(["pull", str(tmp_path / "empty-remote"), str(tmp_path / "run")])


def test_cli_push_of_a_copy_that_fails_verification_is_one_line(tmp_path, monkeypatch, capsys):
    run, remote = tmp_path / "run", tmp_path / "remote"
    save_and_point_latest(run / "checkpoints", 10)
    real_digest = rs.remote_digest
    monkeypatch.setattr(rs, "remote_digest", lambda fs, path: (real_digest(fs, path)[0], "0" * 64))  # a bad copy
    with pytest.raises(SystemExit) as exit_info:
        cc.run_main(lambda: cc.main(["push", str(run), str(remote)]))
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.strip().count("\n") == 0, err
    assert "step-00000010.pt" in err and "differs from the local file" in err
    assert not list(remote.rglob("step-*.pt*"))  # nothing published, no temporary left


# A checkpoint_cloud.py command run as the script does, SIGTERMed by itself at a chosen moment: as `which`
# (a function of remote_store) is called on a temporary name, i.e. mid-download or mid-upload.
SIGTERM_AT = """
import os, signal, sys, time
sys.path.insert(0, {root!r})
from tinyllm.common import temporary_target
from tinyllm.store import checkpoint_cloud, remote_store
real = getattr(remote_store, {which!r})
def terminated_here(*args):
    if temporary_target(str(args[-1]).rsplit("/", 1)[-1]):  # its bytes are all there, not yet checked
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
    return real(*args)
setattr(remote_store, {which!r}, terminated_here)
sys.argv = ["checkpoint_cloud.py", *{argv!r}]
checkpoint_cloud.command()
"""


def terminated_cli(which: str, *argv: str) -> None:
    """Run `checkpoint_cloud.py ARGV` SIGTERMed as remote_store.`which` checks a temporary: one error line, 143."""
    script = SIGTERM_AT.format(root=str(ROOT), which=which, argv=list(argv))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 143, result.stderr
    assert result.stderr.splitlines() == ["error: terminated (SIGTERM); nothing half-written was kept"]


def test_a_pull_terminated_mid_download_leaves_nothing_and_the_next_pull_restores(tmp_path, capsys):
    run, remote, pulled = tmp_path / "run", tmp_path / "remote", tmp_path / "pulled"
    atomic_write_json(run / "training_settings.json", {"run_id": "run-test"})
    save_and_point_latest(run / "checkpoints", 10)
    assert cc.main(["push", str(run), str(remote)]) == 0
    terminated_cli("sha256_file", "pull", str(remote), str(pulled))
    assert [path.name for path in pulled.rglob("*")] == ["checkpoints"]  # no temporary, no record, no run file
    assert cc.main(["pull", str(remote), str(pulled)]) == 0
    assert "restored from the remote and verified" in capsys.readouterr().out
    assert store.newest_verified(store.list_folder(pulled / "checkpoints")) == "step-00000010.pt"


def test_a_pull_killed_as_it_renames_leaves_a_record_the_next_session_deletes(tmp_path, monkeypatch):
    """The record goes in before the checkpoint (train.py's order): a kill between the two leaves a record
    without its checkpoint, which plan_resume deletes and a second pull writes again, never a checkpoint
    without its record, which `--resume auto` would refuse."""
    from tinyllm.common import Terminated

    run, remote, pulled = tmp_path / "run", tmp_path / "remote", tmp_path / "pulled"
    save_and_point_latest(run / "checkpoints", 10)
    assert cc.main(["push", str(run), str(remote)]) == 0
    real_replace = os.replace

    def killed_at_the_rename(source, target):
        if str(target).endswith(".pt"):
            raise Terminated()
        real_replace(source, target)

    monkeypatch.setattr(os, "replace", killed_at_the_rename)
    with pytest.raises(Terminated):
        cc.main(["pull", str(remote), str(pulled)])
    monkeypatch.setattr(os, "replace", real_replace)
    folder = pulled / "checkpoints"
    assert sorted(path.name for path in folder.iterdir()) == ["step-00000010.pt.json"]
    assert store.plan_resume(store.list_folder(folder), "auto").delete == ["step-00000010.pt.json"]
    assert cc.main(["pull", str(remote), str(pulled)]) == 0
    assert store.newest_verified(store.list_folder(folder)) == "step-00000010.pt"


def test_a_push_terminated_mid_upload_publishes_nothing_and_a_pull_takes_the_last_verified(tmp_path, capsys):
    run, remote = tmp_path / "run", tmp_path / "remote"
    save_and_point_latest(run / "checkpoints", 10)
    assert cc.main(["push", str(run), str(remote)]) == 0
    step_20 = save_and_point_latest(run / "checkpoints", 20)
    terminated_cli("remote_digest", "push", str(run), str(remote))
    state = remote_state(str(remote))
    assert (state["verified"], state["unverified"], state["partials"]) == ({10: "step-00000010.pt"}, [], [])
    assert state["latest"]["step"] == 10

    # what a kill -9 mid-push can leave: a partial upload, and a promoted copy whose record never came
    folder = remote / "checkpoints"
    (folder / Path(rs.temp_name(f"{folder}/{step_20.name}")).name).write_bytes(step_20.read_bytes()[:1000])
    (folder / step_20.name).write_bytes(step_20.read_bytes())
    assert cc.main(["pull", str(remote), str(tmp_path / "pulled")]) == 0
    assert "step-00000010.pt (step 10) restored from the remote and verified" in capsys.readouterr().out
    assert sorted(path.name for path in (tmp_path / "pulled" / "checkpoints").iterdir()) == [
        "latest.json",
        "step-00000010.pt",
        "step-00000010.pt.json",
    ]


@pytest.mark.parametrize("store", ["folder", "s3"])
def test_cli_on_a_remote_that_does_not_exist_is_an_error(store, tmp_path, request, capsys):
    if store == "folder":
        missing, empty = str(tmp_path / "no" / "such" / "path"), tmp_path / "empty"
        empty.mkdir()
        empty = str(empty)
    else:
        empty = request.getfixturevalue("s3_url")  # the bucket exists, nothing under the prefix yet
        missing = f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/runs/tiny"
    for command in (["list", missing], ["verify", missing], ["pull", missing, str(tmp_path / "run")]):
        with pytest.raises(SystemExit) as exit_info:
            cc.run_main(lambda command=command: cc.main(command))
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and err.strip().count("\n") == 0, command
        assert "does not exist" in err or "no such folder" in err, err
        assert "no-such-bucket" not in err
    assert not (tmp_path / "run").exists()
    assert cc.main(["list", empty]) == 0
    assert cc.main(["verify", empty]) == 0
    assert "no checkpoints on the remote" in capsys.readouterr().out


def generated_corpus(folder: Path) -> Path:
    """A small corpus built by data.py: 200 generated documents, a 300-token vocabulary."""
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    records = [{"text": " ".join(words[(i * 7 + j) % len(words)] for j in range(25))} for i in range(200)]
    return data.build_corpus(
        [data.Source("generated", "generated", records=records)],
        folder,
        data.BuildSettings(vocab_size=300, val_fraction=0.1, test_fraction=0.1),
    )


def test_corpus_push_pull_verify_with_the_manifest_check(tmp_path, capsys):
    corpus = generated_corpus(tmp_path / "corpus")
    (tmp_path / "remote").mkdir()  # push creates the last folder only (a typo above it is an error)
    remote = str(tmp_path / "remote" / "corpus")
    assert cc.main(["push", str(corpus), remote]) == 0
    assert cc.main(["verify", remote]) == 0
    assert cc.main(["list", remote]) == 0
    assert "train-00000.bin" in capsys.readouterr().out
    pulled = rs.pull_corpus(remote, tmp_path / "pulled", log=Log())
    for name in (
        "train-00000.bin",
        "validation-00000.bin",
        "tokenizer/tokenizer.json",
        "DATA_CARD.md",
        "corpus_manifest.json",
    ):
        assert (pulled / name).read_bytes() == (corpus / name).read_bytes()

    shard = Path(remote) / "train-00000.bin"
    payload = shard.read_bytes()
    shard.write_bytes(bytes([payload[0] ^ 0xFF]) + payload[1:])
    assert cc.main(["verify", remote]) == 1
    with pytest.raises(UserError, match="train-00000.bin: sha256 does not match"):
        rs.pull_corpus(remote, tmp_path / "pulled-bad", log=Log())
    assert not (tmp_path / "pulled-bad").exists()
    assert not [p for p in tmp_path.iterdir() if temporary_target(p.name)]

    (Path(remote) / "tokenizer" / "tokenizer.json").write_text('{"fake": false}')
    shard.write_bytes(payload)
    assert cc.main(["verify", remote]) == 1
    assert "tokenizer/: does not match" in capsys.readouterr().out


def test_real_corpus_from_data_py_pulled_from_s3(s3_url, tmp_path):
    corpus = generated_corpus(tmp_path / "corpus")
    remote = s3_url.replace("/runs/tiny", "/corpora/small")
    assert cc.main(["push", str(corpus), remote]) == 0
    assert cc.main(["verify", remote]) == 0
    assert cc.main(["pull", remote, str(tmp_path / "pulled")]) == 0
    assert corpus_format.verify_corpus(tmp_path / "pulled") == []
    assert rs.pull_corpus(remote, tmp_path / "pulled", log=Log()) == tmp_path / "pulled"  # already there: kept
    assert train_data.prepare_one_corpus(str(corpus), demo=False) == corpus  # a local folder: as it is

    fs, root = rs.open_remote(remote)
    fs.pipe_file(f"{root}/train-00000.bin", fs.cat_file(f"{root}/train-00000.bin")[:-2])
    with pytest.raises(UserError, match="train-00000.bin"):
        rs.pull_corpus(remote, tmp_path / "pulled-again", log=Log())
    assert not (tmp_path / "pulled-again").exists()


# ----------------------------------------------------------------------------------------------
# End to end with train.py (run as a subprocess, unchanged): back up, lose the disk, resume.


@pytest.mark.slow
def test_fresh_folder_resumes_from_the_remote_bit_for_bit(s3_url, tmp_path):
    corpus = write_tiny_corpus(tmp_path / "corpus")

    def run(out: Path, *extra: str) -> list[str]:
        return options(corpus, out, "--save-every", "3", *extra, steps=8)

    run_cli(run(tmp_path / "reference"))
    first = tmp_path / "first-machine"
    run_cli(run(first, "--stop-after-steps", "5"))  # saves at 3 and 5
    assert reconcile(mirror(s3_url), first / "checkpoints").caught_up

    second = tmp_path / "second-machine"  # a fresh disk: only the remote survives
    restored = cc.restore_latest(s3_url, second / "checkpoints", log=Log())
    assert restored.name == "step-00000005.pt"
    output = run_cli(run(second, "--resume", "auto")).stdout
    assert "resumed from" in output  # it did not quietly start over
    assert list(train_losses(second)) == [1, 2, 3, 4, 5, 6, 7, 8]  # the history came back too
    got, want = final_state(second), final_state(tmp_path / "reference")
    assert got["step"] == want["step"] == 8
    assert_same_state(got, want)


def test_a_long_outage_is_logged_sparingly_and_a_success_is_announced(tmp_path):
    local = tmp_path / "run" / "checkpoints"
    log = Log()
    worker = mirror(str(tmp_path / "remote"), log, retry_seconds=0.01)
    allow_uploads = refuse_uploads(worker)
    save_and_point_latest(local, 1)
    for _ in range(40):  # the loop's retries during an outage
        assert reconcile(worker, local) is None
    failures = [line for line in log if "not backed up yet" in line]
    attempts = [int(line.split("(attempt ")[1].split(")")[0]) if "(attempt " in line else 1 for line in failures]
    assert attempts == [1, 2, 4, 8, 16, 32]  # powers of two only
    allow_uploads()
    assert reconcile(worker, local).caught_up
    assert any(
        line.startswith("checkpoint backup: step-00000001.pt (step 1,") and "uploaded and verified" in line
        for line in log
    )
    assert "the remote works again: step-00000001.pt (step 1) is backed up after 40 failed attempt(s)" in log[-1]


def test_the_unbacked_bound_holds_while_the_remote_cannot_even_be_listed(tmp_path):
    local = tmp_path / "run" / "checkpoints"
    log = Log()
    worker = mirror(str(tmp_path / "remote"), log, keep_last=1, max_unbacked=1)

    def unreachable(*args, **kwargs):
        raise ConnectionError("no route")

    worker.fs.ls = unreachable
    for step in (1, 2, 3):
        save_and_point_latest(local, step)
    assert reconcile(worker, local) is None
    assert sorted(store.list_folder(local).files) == [store.checkpoint_name(step) for step in (2, 3)]
    warning = next(line for line in log if "WARNING deleting local" in line)
    assert "step-00000001.pt" in warning and "the remote cannot be listed to confirm a copy" in warning
    assert "uploads are failing (ConnectionError)" in warning


@pytest.mark.parametrize("store", ["folder", "s3"])
def test_push_and_the_backup_never_create_a_missing_bucket_or_folder(store, tmp_path, request, capsys):
    """Issue 14.1: a typo in the bucket (or the folder above the backup folder) is an error for push and
    for train.py's --backup-to, before anything is restored or trained; nothing is created."""
    run = tmp_path / "run"
    save_and_point_latest(run / "checkpoints", 4, run_id="r1")
    if store == "folder":
        missing = str(tmp_path / "no-such" / "runs" / "tiny")
        fresh = str(tmp_path / "backups")  # its parent exists: the folder itself may be created
    else:
        fresh = request.getfixturevalue("s3_url")
        missing = f"s3://typobucket-{uuid.uuid4().hex[:8]}/runs/x"
    with pytest.raises(SystemExit) as exit_info:
        cc.run_main(lambda: cc.main(["push", str(run), missing]))
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert "does not exist" in err or "no such folder" in err
    with pytest.raises(UserError):
        cc.check_backup_target(missing)
    if store == "folder":
        assert not (tmp_path / "no-such").exists()
    else:
        bucket = missing.split("://", 1)[1].split("/", 1)[0]
        fs, _ = rs.open_remote(missing)
        with pytest.raises(OSError):  # an upload below the missing bucket fails instead of creating it
            cc.upload_checkpoint(fs, missing.split("://", 1)[1], run / "checkpoints" / "step-00000004.pt")
        rs.refresh(fs, bucket)
        assert not fs.exists(bucket)
    cc.check_backup_target(fresh)
    assert cc.main(["push", str(run), fresh]) == 0
    assert sorted(remote_state(fresh)["verified"]) == [4]


def test_train_py_with_a_backup_url_whose_bucket_is_missing_stops_before_training(s3_url, tmp_path):
    """Issue 14.1, through train.py: no bucket made, no 'holds no checkpoint yet', no step 0."""

    from tinyllm.training import train

    corpus = write_tiny_corpus(tmp_path / "corpus", documents=200)
    missing = f"s3://typobucket-{uuid.uuid4().hex[:8]}/runs/x"
    with pytest.raises(UserError, match="bucket does not exist"):
        train.main(options(corpus, tmp_path / "run", "--backup-to", missing))
    assert not (tmp_path / "run" / "checkpoints").exists()
    fs, _ = rs.open_remote(missing)
    bucket = missing.split("://", 1)[1].split("/", 1)[0]
    rs.refresh(fs, bucket)
    assert not fs.exists(bucket)


def test_pull_is_read_only_on_the_remote_and_restores_an_honest_run_status(tmp_path, flip_byte, capsys):
    """Issue 14.8: the remote says COMPLETE at step 30 but its step-30 copy is corrupt: pull restores
    step 20 with a run_status.json saying resume at step 20, and leaves every remote file as it was."""
    run = tmp_path / "run"
    remote = tmp_path / "remote"
    worker = mirror(str(remote))
    atomic_write_json(run / "training_settings.json", {"run_id": "run-a"})
    for step in (10, 20, 30):
        atomic_write_json(run / "run_status.json", {"status": "RUNNING", "step": step, "total_steps": 30})
        if step == 30:
            atomic_write_json(
                run / "run_status.json",
                {
                    "status": "COMPLETE",
                    "step": 30,
                    "total_steps": 30,
                    "resume_command": "python train.py --resume auto",
                },
            )
        save_and_point_latest(run / "checkpoints", step, "run-a")
        assert reconcile(worker, run / "checkpoints").caught_up
    flip_byte(remote / "checkpoints" / "step-00000030.pt", 1000)
    before = {path.relative_to(remote): path.read_bytes() for path in remote.rglob("*") if path.is_file()}

    assert cc.main(["pull", str(remote), str(tmp_path / "pulled")]) == 0
    out = capsys.readouterr().out
    assert "step-00000020.pt (step 20) restored" in out and "left as it is" in out
    after = {path.relative_to(remote): path.read_bytes() for path in remote.rglob("*") if path.is_file()}
    assert after == before  # no record renamed, latest.json not moved
    restored = json.loads((tmp_path / "pulled" / "run_status.json").read_text())
    assert restored["status"] == store.NEEDS_RESUME and restored["step"] == 20
    assert "COMPLETE at step 30" in restored["reason"]
    assert restored["resume_command"] == "python train.py --resume auto"  # still says how to go on

    # train.py's own restore (it writes the remote anyway) sets the corrupt record aside and says so
    log = Log()
    cc.restore_latest(str(remote), tmp_path / "trained" / "checkpoints", log=log)
    assert (remote / "checkpoints" / "step-00000030.pt.json.corrupt").exists()
    assert "record renamed" in log.text() and "now names step-00000020.pt" in log.text()


def test_backup_warnings_say_what_happened_and_announce_the_recovery(tmp_path):
    """Issue 14.10: the overflow warning names the real cause (uploads failing vs saving faster than
    uploads finish), a checkpoint the remote holds goes without one, and the end of an outage is announced."""
    local = tmp_path / "run" / "checkpoints"
    log = Log()
    worker = mirror(str(tmp_path / "remote"), log, keep_last=1, max_unbacked=1)
    allow_uploads = refuse_uploads(worker)
    for step in (1, 2, 3):
        save_and_point_latest(local, step)
        assert reconcile(worker, local) is None
    warning = next(line for line in log if "WARNING deleting local" in line)
    assert "step-00000001.pt" in warning and "never reached the remote" in warning
    assert "uploads are failing (PermissionError)" in warning
    allow_uploads()
    assert reconcile(worker, local).caught_up
    assert any("the remote works again" in line and "failed attempt" in line for line in log)

    # no failure at all: the cause is saving faster than uploads finish, not the credentials
    log, local = Log(), tmp_path / "run-2" / "checkpoints"
    worker = mirror(str(tmp_path / "remote-2"), log, keep_last=1, max_unbacked=1)
    for step in (1, 2, 3):  # three saves before the loop's first step
        save_and_point_latest(local, step)
    assert reconcile(worker, local).caught_up
    warning = next(line for line in log if "WARNING deleting local" in line)
    assert "step-00000001.pt" in warning and "saved faster than they upload" in warning
    assert "credentials" not in warning and not any("the remote works again" in line for line in log)

    # a copy that reached the remote, but latest.json could not be moved: it goes without a warning
    log, local = Log(), tmp_path / "run-3" / "checkpoints"
    worker = mirror(str(tmp_path / "remote-3"), log, keep_last=1, max_unbacked=0)
    original = cc.write_remote_latest

    def refuse_latest(*args):
        raise PermissionError("denied")

    try:
        cc.write_remote_latest = refuse_latest
        path = save_and_point_latest(local, 1)
        assert reconcile(worker, local) is None  # uploaded, then latest.json refused
        save_and_point_latest(local, 2)
        assert reconcile(worker, local) is None
    finally:
        cc.write_remote_latest = original
    assert not path.exists() and not any("WARNING deleting local" in line for line in log)


def test_pull_into_a_read_only_folder_names_it_not_the_network(tmp_path, capsys):
    from faults import read_only_folder

    remote = tmp_path / "remote"
    run = tmp_path / "run"
    save_and_point_latest(run / "checkpoints", 4, run_id="r1")
    assert cc.main(["push", str(run), str(remote)]) == 0
    capsys.readouterr()
    with read_only_folder(tmp_path / "ro") as folder:
        with pytest.raises(SystemExit) as exit_info:
            cc.run_main(lambda: cc.main(["pull", str(remote), str(folder / "run")]))
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1, err
    assert f"{folder} cannot be written" in err and "credentials" not in err and "network" not in err


def test_an_s3_outage_is_reported_after_a_few_connection_attempts(monkeypatch, tmp_path):
    """Issue 14.10: an outage was logged ~40 steps late, after ~25 silent attempts inside s3fs and
    botocore. The backup's client gives up after a few; the backup's own retry loop does the rest."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    connections = []

    def refuse_every_request():  # a store that accepts each connection and closes it at once
        while True:
            try:
                connection, _ = listener.accept()
            except OSError:
                return
            connections.append(1)
            connection.close()

    threading.Thread(target=refuse_every_request, daemon=True).start()
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3", "AWS_MAX_ATTEMPTS", "AWS_RETRY_MODE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{listener.getsockname()[1]}")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    log = Log()
    worker = mirror("s3://some-bucket/runs/x", log)
    try:
        save_and_point_latest(tmp_path / "checkpoints", 1)
        assert worker.step(tmp_path / "checkpoints") is None
        assert any("not backed up yet" in line for line in log)
        # the failed step is a few requests, each given up after FAIL_FAST_ATTEMPTS**2 connections
        # (s3fs's retries x botocore's); with the libraries' defaults, 25 each: no failure logged within a minute
        assert 0 < len(connections) <= 8 * rs.FAIL_FAST_ATTEMPTS**2, len(connections)
    finally:
        listener.close()


# ----------------------------------------------------------------------------------------------
# Issue 20.9: the start-up probe, and which --backup-to URLs a printed command may show.


def remote_files(url: str) -> list[str]:
    fs, root = rs.open_remote(url)
    rs.refresh(fs, root)
    return fs.find(root) if fs.exists(root) else []


@pytest.mark.parametrize("store", ["folder", "s3"])
def test_the_write_probe_leaves_nothing_and_a_stale_one_is_ignored(store, tmp_path, request, capsys):
    url = str(tmp_path / "remote") if store == "folder" else request.getfixturevalue("s3_url")
    cc.check_backup_target(url)
    assert remote_files(url) == []
    fs, root = rs.open_remote(url)
    fs.pipe_file(cc.run_file_path(root, cc.PROBE_PREFIX + "0123abcd"), b"left by a killed run")
    run = tmp_path / "run"
    save_and_point_latest(run / "checkpoints", 4, run_id="r1")
    assert cc.main(["push", str(run), url]) == 0
    listing = remote_state(url)
    assert sorted(listing["verified"]) == [4] and not listing["unverified"] and not listing["partials"]
    capsys.readouterr()
    assert cc.main(["list", url]) == 0 and cc.main(["verify", url]) == 0
    assert "probe" not in capsys.readouterr().out
    restored = cc.restore_latest(url, tmp_path / "fresh" / "checkpoints", log=Log())
    assert restored == tmp_path / "fresh" / "checkpoints" / "step-00000004.pt"
    cc.check_backup_target(url)  # a stale probe does not stop the next start either


def test_an_s3_remote_that_refuses_writes_is_one_error_without_secrets(s3_url, monkeypatch, capsys):
    import s3fs

    async def denied(self, path, data, **kwargs):
        raise PermissionError(f"Access Denied. (key {SECRET_KEY})")

    with monkeypatch.context() as patch, pytest.raises(UserError) as error:
        patch.setattr(s3fs.S3FileSystem, "_pipe_file", denied)
        cc.check_backup_target(s3_url)
    message = str(error.value)
    assert message.startswith("--backup-to: the remote cannot be written (PermissionError: Access Denied.")
    assert SECRET_KEY not in message and "\n" not in message
    assert remote_files(s3_url) == []
    url = "s3://user:pa55word@bucket/x?token=tok3n"  # credentials inside the URL are hidden too
    text = rs.probe_error_text(OSError(f"no route to {url} (token tok3n, password pa55word, {SECRET_KEY})"), url)
    assert text == "OSError: no route to *** (token ***, password ***, ***)"
