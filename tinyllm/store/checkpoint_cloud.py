"""Back checkpoints up to remote storage without slowing training, and restore them anywhere.

    python checkpoint_cloud.py list s3://bucket/runs/tiny
    python checkpoint_cloud.py push runs/tiny s3://bucket/runs/tiny
    python checkpoint_cloud.py pull s3://bucket/runs/tiny runs/tiny
    python checkpoint_cloud.py verify s3://bucket/runs/tiny

A URL is a folder (`/content/drive/MyDrive/runs/tiny`, `file://...`) or a store remote_store.py opens
(remote_store.BACKENDS; `--help` lists them). It stands for a RUN folder and mirrors its checkpoints/ folder
with the names and records of checkpoint_store.py (docs/checkpoints.md): each step-N.pt is uploaded under a
temporary name, confirmed there (size and sha256: remote_store.upload_verified), promoted, and only then is
its record step-N.pt.json (the local one, unchanged) written: a remote file without a record is never
trusted. latest.json moves last. A checkpoint a restore finds corrupt has its record renamed
*.json.corrupt, so nothing counts it as a backup again. The run's history (metrics.jsonl,
training_settings.json, hardware.json, run_status.json) is uploaded the same way after each
checkpoint, and restored beside checkpoints/ when missing; a restored run_status.json's commands continue
the folder restored into and back up to the store restored from (settled_status, command_after_restore).
A restore writes a checkpoint's record before the checkpoint (download_checkpoint), as train.py does.

A URL may instead hold a corpus folder (DESIGN.md, "Corpus folder"), recognised by its
corpus_manifest.json; `push`, `pull`, `list` and `verify` then handle the corpus (remote_store.pull_corpus,
push_corpus).

The read-back that confirms an upload happens in the backup's own process, never in the training loop. The
sha256 it must match is the one train.py recorded in step-N.pt.json as it wrote the checkpoint: the upload is
then the only read of the local file, and a checkpoint changed on disk since is never published.

train.py's backup is a BackupProcess: a reconcile loop (Mirror: list both sides, plan with
checkpoint_store.plan_mirror, apply a step) in a child process, so that none of the upload work
shares the training process's GIL.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import multiprocessing
import multiprocessing.connection
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from pathlib import Path

from tinyllm.common import (
    ArgumentParser,
    UserError,
    atomic_path,
    check_writable_folder,
    option_value,
    read_json_or,
    run_main,
    stop_on_sigterm,
    utc_now,
    with_option_values,
)
from tinyllm.data import corpus_format
from tinyllm.data.corpus_format import CORPUS_MANIFEST
from tinyllm.store import checkpoint_store as store
from tinyllm.store import remote_store
from tinyllm.store.checkpoint_store import CHECKPOINT_DIR, NEEDS_RESUME, RUN_FILES
from tinyllm.store.remote_store import LocalFileChanged, LogFn, VerificationError, log_line, remote_errors

# ----------------------------------------------------------------------------------------------
# The backup URL.


def backup_url_from_env_or_arg(arg: str | None) -> str | None:
    """`--backup-to` wins; else the original trainer's THINK72_CLOUD_RESUME=1 + THINK72_BACKUP_URL."""
    refuse_placeholder(arg)
    if arg:
        return arg
    if os.environ.get("THINK72_CLOUD_RESUME") != "1":
        return None
    url = os.environ.get("THINK72_BACKUP_URL", "").strip()
    if not url:
        raise UserError("THINK72_CLOUD_RESUME=1 needs THINK72_BACKUP_URL (or pass --backup-to URL)")
    return url


# What a printed command shows in place of a --backup-to URL that carries credentials (train.resume_command).
BACKUP_URL_PLACEHOLDER = "URL"


def refuse_placeholder(arg: str | None) -> None:
    """A pasted command's `--backup-to URL` must not back up into a local folder named URL."""
    if arg == BACKUP_URL_PLACEHOLDER:
        raise UserError(
            f"--backup-to {BACKUP_URL_PLACEHOLDER} is a placeholder: give the real URL, or leave "
            "--backup-to out and set THINK72_CLOUD_RESUME=1 and THINK72_BACKUP_URL"
        )


def shown_backup_url(url: str) -> str:
    """`url` as a printed command shows it: as it is, or BACKUP_URL_PLACEHOLDER when it carries credentials."""
    printable = remote_store.printable_url(url)
    return BACKUP_URL_PLACEHOLDER if printable is None else printable


def command_after_restore(command: str, out: Path, url: str) -> str:
    """`command` (a train.py command line of a restored run_status.json) for the folder `out` it was restored
    into from the store at `url`: its --out names `out` and its --backup-to names `url` (shown_backup_url).

    A run pulled from a copy of its backup (the store moved, a bucket copied) then backs up to the store the
    user named, never silently to the one it was copied from. A command without --backup-to gets none: a
    restore never adds a place to write to (the THINK72_BACKUP_URL alias, where set, still applies).
    """
    shown_url = shown_backup_url(url)
    change = {"--out": lambda _: str(out), "--backup-to": lambda _: shown_url}
    return shlex.join(with_option_values(shlex.split(command), change))


def backup_target(command: str) -> str | None:
    """The --backup-to value of a train.py command line (None: it has none)."""
    return option_value(shlex.split(command), "--backup-to")


def backup_change_note(before: str | None, after: str | None) -> str | None:
    """The line a restore prints when its resume_command's --backup-to changed (command_after_restore)."""
    if before == after:
        return None
    typed = (
        f" ({BACKUP_URL_PLACEHOLDER} stands for the URL pulled from, which carries credentials: type it in)"
        if after == BACKUP_URL_PLACEHOLDER
        else ""
    )
    return (
        f"checkpoint restore: the resume_command now backs up to {after}, the store restored from{typed}, "
        f"not to {before}, where the run was backed up"
    )


# ----------------------------------------------------------------------------------------------
# Checkpoints on the remote.


def checkpoint_folder(root: str) -> str:
    return f"{root}/{CHECKPOINT_DIR}" if root != "/" else f"/{CHECKPOINT_DIR}"


def local_record(path: Path) -> store.Record | None:
    """train.py's record of a local checkpoint (NAME.pt.json beside it); None when it has none that reads."""
    try:
        return store.read_record(path.parent / store.record_name(path.name))
    except UserError:
        return None


def upload_checkpoint(fs, root: str, local_path: str | os.PathLike) -> store.Record:
    """Upload one checkpoint by the verified protocol, then its record; latest.json is not moved.

    The sha256 and size train.py recorded as it wrote the checkpoint are what the remote copy must
    match, so the file is read once (by the upload), and one that changed since it was written (or
    never had a record) raises LocalFileChanged. The remote record is the local one, unchanged: its
    run_id is what lets a later session of the same run apply retention to these files.
    """
    local = Path(local_path)
    record = local_record(local)
    if record is None or record.path != local.name:
        raise LocalFileChanged(
            f"{local.name} has no record of train.py's ({store.record_name(local.name)}): it cannot be verified"
        )
    remote_store.upload_verified(
        fs, local, f"{checkpoint_folder(root)}/{local.name}", sha256=record.sha256, size=record.bytes
    )
    remote_store.put_json(fs, f"{checkpoint_folder(root)}/{store.record_name(local.name)}", record.to_json())
    return record


def run_file_path(root: str, name: str) -> str:
    return f"{root.rstrip('/')}/{name}"


def upload_run_files(fs, root: str, run_dir: Path) -> list[str]:
    """Upload the RUN_FILES that exist in `run_dir`, each verified and promoted like a checkpoint.

    Each is copied to a local snapshot first: training keeps appending to metrics.jsonl, and the
    remote copy is checked against the bytes that were sent. Returns the names uploaded.
    """
    uploaded = []
    with tempfile.TemporaryDirectory(prefix="run-files-") as scratch:
        for name in RUN_FILES:
            snapshot = Path(scratch) / name
            try:
                shutil.copyfile(run_dir / name, snapshot)
            except FileNotFoundError:
                continue
            remote_store.upload_verified(fs, snapshot, run_file_path(root, name))
            uploaded.append(name)
    return uploaded


def restore_run_files(
    fs, root: str, run_dir: Path, run_id: str | None, url: str, log: LogFn = log_line, step: int | None = None
) -> list[str]:
    """Download the remote RUN_FILES that `run_dir` lacks (through a temporary name), so a restored run
    keeps its history. Skipped when the remote's training_settings.json names another run_id.

    `step`: the step of the checkpoint restored; `url`: the store restored from. run_status.json is settled
    (settled_status) before it is renamed into place, so a restore killed at any moment leaves either
    none or the settled one."""
    remote_settings = remote_store.get_json(fs, run_file_path(root, "training_settings.json")) or {}
    remote_run = remote_settings.get("run_id") if isinstance(remote_settings, dict) else None
    if run_id and remote_run and remote_run != run_id:
        log(
            "checkpoint restore: WARNING the remote run files belong to another run (run_id "
            f"{remote_run}, checkpoint {run_id}); not restored"
        )
        return []
    restored = []
    for name in RUN_FILES:
        target = run_dir / name
        if target.exists():
            continue
        try:
            with atomic_path(target) as temp:
                fs.get_file(run_file_path(root, name), str(temp))
                if name == store.STATUS_FILE:
                    settle_restored_status(temp, run_dir, step, url, log)
            restored.append(name)
        except FileNotFoundError:
            continue
    return restored


def settle_restored_status(path: Path, run_dir: Path, step: int | None, url: str, log: LogFn) -> None:
    """Rewrite the downloaded run_status.json at `path` (a temporary name) as settled_status says, saying why."""
    remote_status = read_json_or(path, {})
    settled = settled_status(remote_status, run_dir, step, url)
    if settled == remote_status:
        return
    path.write_text(json.dumps({**settled, "updated": utc_now()}, indent=2, ensure_ascii=False) + "\n")
    if settled.get("status") != remote_status.get("status") or settled.get("step") != remote_status.get("step"):
        log(restore_note(step, remote_status))
    commands = [status.get("resume_command") for status in (remote_status, settled)]
    if all(isinstance(command, str) for command in commands):
        note = backup_change_note(*map(backup_target, commands))
        if note:
            log(note)


RESTORED_COMMANDS = ("resume_command", "report_command")


def settled_status(remote_status: dict, run_dir: Path, step: int | None, url: str) -> dict:
    """The run_status.json a restore into `run_dir` from `url` leaves, from the backup's `remote_status`
    (which describes the run as it last uploaded: COMPLETE at a later step, say, with a model/ that is not
    backed up): its commands for `run_dir` and `url` (command_after_restore), and the run to be resumed at
    `step` (the checkpoint restored) unless it says so already."""
    commands = {
        key: command_after_restore(command, run_dir, url)
        for key in RESTORED_COMMANDS
        if isinstance(command := remote_status.get(key), str)
    }
    if step is None or (remote_status.get("status"), remote_status.get("step")) == (NEEDS_RESUME, step):
        return {**remote_status, **commands}
    was = f"{remote_status.get('status', '?')} at step {remote_status.get('step', '?')}"
    return {
        "status": NEEDS_RESUME,
        "step": step,
        "total_steps": remote_status.get("total_steps"),
        "reason": f"restored from the backup at step {step} (the backup's run_status.json said {was}); "
        "continue with its resume_command",
        **{key: command for key, command in commands.items() if key == "resume_command"},
    }


def restore_note(step: int, remote_status: dict) -> str:
    """The line a restore prints when the backup's run_status.json does not say 'resume from the step restored'."""
    status, at = remote_status.get("status", "?"), remote_status.get("step", "?")
    if (status, at) == (store.COMPLETE, step):
        return (
            f"checkpoint restore: the backed-up run finished at step {step}; `train.py --resume auto` makes its "
            "end again from that step (the test, the model folder, the report)"
        )
    return (
        f"checkpoint restore: the run resumes from step {step}, the newest verified checkpoint in the backup (its "
        f"run_status.json said {status} at step {at})"
    )


def write_remote_latest(fs, root: str, record: store.Record) -> None:
    remote_store.put_json(fs, f"{checkpoint_folder(root)}/{store.LATEST}", record.to_json())


def remote_listing(fs, root: str) -> store.Listing:
    """What the remote checkpoints folder holds, as the store.Listing a local folder gives (its
    records read; `sha256` is not known there: a remote file is trusted by its record and size)."""
    folder = checkpoint_folder(root)
    remote_store.refresh(fs, folder)
    try:
        entries = fs.ls(folder, detail=True)
    except FileNotFoundError:
        entries = []
    sizes = {entry["name"].rstrip("/").rsplit("/", 1)[-1]: int(entry.get("size") or 0) for entry in entries}
    names = store.sort_names(sizes)
    records: dict[str, store.Record | str] = {}
    for name in names.recorded:
        try:
            records[name] = store.Record.from_json(remote_store.get_json(fs, f"{folder}/{store.record_name(name)}"))
        except (VerificationError, ValueError, TypeError) as error:
            records[name] = f"its record does not read ({error})"
    latest, latest_error = None, None
    if store.LATEST in sizes:
        try:
            latest = store.Record.from_json(remote_store.get_json(fs, f"{folder}/{store.LATEST}"))
        except (VerificationError, ValueError, TypeError) as error:
            latest_error = str(error)
    return store.Listing(
        files={name: sizes[name] for name in names.checkpoints},
        records=records,
        temporaries=names.temporaries,
        corrupt=names.corrupt,
        latest=latest,
        latest_error=latest_error,
    )


def restore_candidates(fs, root: str, log: LogFn = log_line) -> list[store.Record]:
    """Records to try, best first: latest.json's checkpoint, then older verified ones, newest first
    (steps after latest.json's belong to a timeline the run left: never restored)."""
    listing = remote_listing(fs, root)
    if listing.latest_error:
        log(
            f"checkpoint restore: WARNING the remote {store.LATEST} is unreadable ({listing.latest_error}); "
            "trying the verified checkpoints instead"
        )
    recorded = {
        record.step: record
        for name, record in listing.records.items()
        if isinstance(record, store.Record) and record.path == name
    }
    latest = listing.latest
    return ([latest] if latest else []) + [
        recorded[step] for step in store.restore_order(recorded, latest.step if latest else None)
    ]


def quarantine_record(fs, folder: str, name: str, log: LogFn = log_line) -> None:
    """Rename a corrupt checkpoint's record to NAME.json.corrupt (best effort), so that nothing uses it,
    retention does not count it among the kept ones, and `verify` shows the file as unverified. The
    file itself stays (for inspection); the run re-uploads that step under the same name later."""
    record = f"{folder}/{store.record_name(name)}"
    try:
        fs.mv(record, f"{record}.corrupt")
        remote_store.refresh(fs, folder)
    except Exception as error:
        log(f"checkpoint restore: the record of the corrupt {name} could not be set aside ({type(error).__name__})")
        return
    log(
        f"checkpoint restore: {name} is no longer counted as a verified backup (record renamed to "
        f"{store.record_name(name)}.corrupt)"
    )


def restore_latest(
    url: str, local_checkpoint_dir: str | os.PathLike, log: LogFn = log_line, read_only: bool = False
) -> Path | None:
    """Download the remote's newest verified checkpoint into `local_checkpoint_dir` and point the local
    latest.json at it, so train.py's `--resume auto` picks it up.

    Falls back to the next older verified checkpoint (with a warning) when one does not match its
    sha256. Returns None, without a log line, when the remote has no checkpoint yet (train.py's backup
    says so as it starts; `pull` raises its own error); raises UserError when it cannot be read or
    when no checkpoint on it is intact (starting fresh would then overwrite the backup).

    A corrupt checkpoint's record is set aside on the remote and latest.json pointed at the one
    restored (each said in a log line), so that the run's backup never counts it again; with
    `read_only` (`pull`: the user asked only to download) the remote is left exactly as it is.
    """
    fs, root = remote_store.open_remote(url)
    local_dir = Path(local_checkpoint_dir)
    folder = checkpoint_folder(root)
    with remote_errors("reading the backup remote"):
        candidates = restore_candidates(fs, root, log)
    if not candidates:
        return None
    for record in candidates:
        name = record.path
        try:
            downloaded = download_checkpoint(fs, folder, local_dir, record)
        except VerificationError as error:
            log(f"checkpoint restore: WARNING {error}; trying the next older one")
            if read_only:
                log(
                    f"checkpoint restore: the remote is left as it is (pull only reads); "
                    f"`checkpoint_cloud.py verify` lists {name} as corrupt"
                )
            else:
                quarantine_record(fs, folder, name, log)
            continue
        store.write_record(local_dir, record, store.LATEST)
        log(
            f"checkpoint restore: {name} (step {record.step}) "
            + (
                "already here, matching the backup's record (not downloaded; `checkpoint_cloud.py verify` re-hashes "
                "the remote copy)"
                if not downloaded
                else "restored from the remote and verified"
            )
        )
        if record is not candidates[0] and not read_only:  # the remote latest.json named a corrupt one
            with contextlib.suppress(Exception):
                write_remote_latest(fs, root, record)
                log(f"checkpoint restore: the remote {store.LATEST} now names {name}")
        try:
            with remote_errors("downloading the run files"):
                history = restore_run_files(fs, root, local_dir.parent, record.run_id, url, log, step=record.step)
        except (UserError, VerificationError) as error:
            log(f"checkpoint restore: WARNING the run files (metrics.jsonl, ...) were not restored: {error}")
        else:
            if history:
                log(f"checkpoint restore: {', '.join(history)} restored into {local_dir.parent}")
        return local_dir / name
    raise UserError(
        f"no checkpoint on the remote matches its recorded sha256 ({len(candidates)} tried); "
        "refusing to start over on top of the backup"
    )


def download_checkpoint(fs, folder: str, local_dir: Path, record: store.Record) -> bool:
    """Download `record`'s checkpoint from the remote `folder` into `local_dir`, verified, in train.py's order:
    its record is written before the file is renamed into place, so a restore killed at any moment leaves a
    temporary or a record without its checkpoint (both removed by the next session, and the next restore
    downloads it again), never a checkpoint without its record. False: a verified copy was here already."""
    with remote_errors(f"downloading {record.path}"):
        return remote_store.download_verified(
            fs,
            f"{folder}/{record.path}",
            local_dir / record.path,
            record.sha256,
            record.bytes,
            on_verified=lambda: store.write_record(local_dir, record),
        )


# ----------------------------------------------------------------------------------------------
# The backup: a reconcile loop (Mirror) in a child process (serve_backup), woken by BackupProcess.


class Mirror:
    """The backup's work, one step at a time: list the local checkpoints folder and the remote, plan
    (store.plan_mirror) and apply: delete the local checkpoints the plan lets go, move the remote
    latest.json (then upload the run files), delete what remote retention drops (the record first),
    upload the newest missing checkpoint. It remembers no checkpoint: a new one plans the same. A
    failed step is retried after retry_seconds, doubling up to max_retry_seconds (short while a stop
    waits), logged at attempts 1, 2, 4, 8, ... only, with the exception type (never the URL or a key)."""

    def __init__(
        self,
        url: str,
        policy: store.MirrorPolicy,
        retry_seconds: float = 5.0,
        max_retry_seconds: float = 300.0,
        log: LogFn = log_line,
    ):
        self.fs, self.root = remote_store.open_remote(url, fail_fast=True)
        self.policy, self.log = policy, log
        self.retry_seconds, self.max_retry_seconds = retry_seconds, max_retry_seconds
        self.failures, self.last_error, self.doing = 0, None, "the newest checkpoint"
        self.retry_after = retry_seconds

    def look(self) -> None:
        """Connect once at start (so credential problems show early) and say what the remote holds."""
        try:
            held = [
                record
                for record in remote_listing(self.fs, self.root).records.values()
                if isinstance(record, store.Record)
            ]
        except Exception as error:
            return self.log(
                f"checkpoint backup: the remote is not reachable yet ({type(error).__name__}); uploads will be retried"
            )
        self.log(
            f"checkpoint backup: the remote already holds {len(held)} verified checkpoint(s), latest step "
            f"{max(record.step for record in held)}; retention deletes only this run's files"
            if held
            else "checkpoint backup: the remote is reachable and holds no checkpoint yet (nothing to restore); "
            "the first one is uploaded after the first save"
        )

    def step(self, local_dir: Path, urgent: bool = False) -> store.MirrorPlan | None:
        """Plan and apply one step; the plan (empty: nothing was left to do), or None when it failed
        (logged; `retry_after` says when to try again, short when `urgent`: a stop is waiting)."""
        try:
            local = store.list_folder(local_dir)
            try:
                remote = remote_listing(self.fs, self.root)
            except Exception as error:  # nothing known of the remote: only the bound on unbacked ones applies
                blind = store.plan_mirror(local, store.Listing({}, {}), self.policy)
                self.release(local_dir, blind.unbacked, unlisted=type(error).__name__)
                raise
            plan = store.plan_mirror(local, remote, self.policy)
            self.apply(local_dir, plan)
            return plan
        except Exception as error:
            self.failures, self.last_error = self.failures + 1, type(error).__name__
        self.retry_after = min(self.retry_seconds * 2 ** (self.failures - 1), self.max_retry_seconds)
        self.retry_after = min(self.retry_after, self.retry_seconds) if urgent else self.retry_after
        if not self.failures & (self.failures - 1):  # attempts 1, 2, 4, 8, ...: an outage must not flood the log
            attempt = f" (attempt {self.failures})" if self.failures > 1 else ""
            self.log(
                f"checkpoint backup: {self.doing} not backed up yet{attempt}: {self.last_error}; "
                f"retry in {self.retry_after:.0f}s or at the next checkpoint"
            )
        return None

    def release(self, local_dir: Path, unbacked: list[str], unlisted: str | None = None) -> None:
        """Delete local checkpoints beyond the bound that have no confirmed remote copy, each with a WARNING
        (`unlisted`: the error that kept the remote from being listed)."""
        where = "the remote cannot be listed to confirm a copy" if unlisted else "it never reached the remote"
        why = (
            f"uploads are failing ({unlisted or self.last_error}); check the network and the credentials"
            if self.failures or unlisted
            else "checkpoints are saved faster than they upload; save less often "
            "(--save-every) or allow more (--backup-max-unbacked)"
        )
        for name in unbacked:
            self.log(
                f"checkpoint backup: WARNING deleting local {name} (step {store.step_of(name)}) although "
                f"{where}: more than {self.policy.max_unbacked} checkpoints are waiting for upload; {why}"
            )
        store.delete(local_dir, unbacked)

    def apply(self, local_dir: Path, plan: store.MirrorPlan) -> None:
        self.release(local_dir, plan.unbacked)  # first: a failing remote
        store.delete(local_dir, plan.delete_local)  # below must not fill the disk
        if plan.latest is not None:
            write_remote_latest(self.fs, self.root, plan.latest)
            if local_dir.name == CHECKPOINT_DIR:  # train.py's RUN/checkpoints layout: its history beside
                self.push_run_files(local_dir.parent)
        folder = checkpoint_folder(self.root)
        for name in plan.delete_remote:
            self.fs.rm_file(f"{folder}/{store.record_name(name)}")
            self.fs.rm_file(f"{folder}/{name}")
        if plan.delete_remote:
            remote_store.refresh(self.fs, folder)
            self.log(f"checkpoint backup: remote retention removed {', '.join(plan.delete_remote)}")
        if plan.upload:
            self.upload(local_dir / plan.upload[0])

    def upload(self, path: Path) -> None:
        self.doing, started = f"{path.name} (step {store.step_of(path.name)})", time.monotonic()
        try:
            record = upload_checkpoint(self.fs, self.root, path)
        except LocalFileChanged as error:  # uploading it again would not help: out of the plan for good
            store.set_aside(path.parent, path.name)
            self.log(
                f"checkpoint backup: WARNING {error}; not backed up (set aside as {path.name}"
                f"{store.CORRUPT_SUFFIX}, latest.json not moved)"
            )
            return
        self.log(
            f"checkpoint backup: {path.name} (step {record.step}, {record.bytes / 1e6:.1f} MB) uploaded and "
            f"verified in {time.monotonic() - started:.1f}s"
        )
        if self.failures:
            self.log(
                f"checkpoint backup: the remote works again: {self.doing} is backed up after "
                f"{self.failures} failed attempt(s)"
            )
        self.failures, self.doing = 0, "the newest checkpoint"

    def push_run_files(self, run_dir: str | os.PathLike) -> bool:
        """Upload the run's history files (RUN_FILES) now, e.g. the final run_status.json; True if they got there."""
        try:
            upload_run_files(self.fs, self.root, Path(run_dir))
            return True
        except Exception as error:
            self.log(
                f"checkpoint backup: the run files (metrics.jsonl, run_status.json, ...) not backed up "
                f"this time ({type(error).__name__})"
            )
            return False


def serve_backup(fd: int) -> None:
    """The child: a Mirror stepped on a wake-up (a save), on its retry timer and while a stop waits, until
    the plan is empty; it exits when its pipe closes (a killed trainer), after the step it is on. Its
    trainer can die at any moment (kill -9, torchrun tearing the job down): the child then exits saying
    nothing, whichever message it was reading or sending, so the run's log holds no traceback of it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the trainer decides when the backup stops
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with contextlib.suppress(OSError):
        os.nice(10)
    connection = multiprocessing.connection.Connection(fd)
    with contextlib.suppress(EOFError, OSError):  # the pipe closed: the trainer is gone
        mirror = start_mirror(connection)
        if mirror is not None:
            mirror.look()
            serve_requests(connection, mirror)


def start_mirror(connection) -> Mirror | None:
    """The child's Mirror from the settings its trainer sends; it answers "ready", or "failed" and None."""
    url, options = connection.recv()
    try:
        mirror = Mirror(url, **options, log=child_log)
    except Exception as error:
        connection.send(("failed", type(error).__name__, str(error) if isinstance(error, UserError) else ""))
        return None
    connection.send(("ready",))
    return mirror


def child_log(line: str) -> None:
    """The child's log line, in one write (it shares train.py's stdout, even unbuffered: python -u). A
    stdout whose reader is gone (the trainer's terminal or notebook) ends the logging, never the child:
    its later lines, and the interpreter's last flush, go to /dev/null."""
    try:
        print(f"{line}\n", end="", flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def serve_requests(connection, mirror: Mirror) -> None:
    """The child's loop: messages from BackupProcess, and Mirror steps while there is work and it is due."""
    local_dir, due, waiting, deadline = None, None, None, 0.0
    while True:
        moments = [moment for moment in (due, deadline if waiting is not None else None) if moment is not None]
        if connection.poll(max(0.0, min(moments) - time.monotonic()) if moments else None):
            kind, request_id, *args = connection.recv()
            if kind == "wake":
                local_dir, due = Path(args[0]), time.monotonic()
            elif kind == "wait":
                waiting, deadline, due = request_id, time.monotonic() + args[0], time.monotonic()
            elif kind == "push_run_files":
                connection.send(("reply", request_id, mirror.push_run_files(args[0])))
            elif kind == "close":
                connection.send(("reply", request_id, None))
                return
        if waiting is not None and (local_dir is None or time.monotonic() >= deadline):
            connection.send(("reply", waiting, local_dir is None))
            waiting = None
        if local_dir is None or due is None or time.monotonic() < due:
            continue
        plan = mirror.step(local_dir, urgent=waiting is not None)
        due = time.monotonic() + mirror.retry_after if plan is None else (None if plan.empty() else time.monotonic())
        if waiting is not None and plan is not None and plan.empty():
            connection.send(("reply", waiting, plan.caught_up))
            waiting = None


PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the folder that holds tinyllm/
CHILD_MAIN = (
    "import sys; sys.path.insert(0, sys.argv[2]); from tinyllm.store import checkpoint_cloud; "
    "checkpoint_cloud.serve_backup(int(sys.argv[1]))"
)


class BackupProcess:
    """train.py's backup: a Mirror in a child process (serve_backup), woken after each save. Not a thread:
    it would share the training process's GIL (bench/bench_cloud_train.py: 0.93x training tokens/s as a
    thread, 1.00x as a process). The child runs at a lower priority, ignores SIGINT/SIGTERM (train.py
    decides when to stop, then waits with wait()), prints its own log lines and exits when its pipe
    closes. If it dies, the next call starts a new one, which plans again from both listings."""

    def __init__(
        self,
        url: str,
        policy: store.MirrorPolicy = store.MirrorPolicy(),
        retry_seconds: float = 5.0,
        max_retry_seconds: float = 300.0,
        log: LogFn = log_line,
        start_timeout_s: float = 120.0,
    ):
        self.url, self.policy, self.log, self.start_timeout_s = url, policy, log, start_timeout_s
        self.options = {"policy": policy, "retry_seconds": retry_seconds, "max_retry_seconds": max_retry_seconds}
        self._folder: str | None = None  # the local checkpoints folder, once a save named it
        self._closing = False
        self._process: subprocess.Popen | None = None
        self._connection = None
        self._request_ids = itertools.count()
        self._lock = threading.RLock()  # the checkpoint writer's thread submits, the training thread waits
        self._start()

    def submit(self, local_path: str | os.PathLike, step: int | None = None) -> None:
        """A checkpoint was saved in its folder (or a rewind moved the local latest.json): wake the loop."""
        self._folder = str(Path(local_path).resolve().parent)
        if self._ensure_running():
            self._send("wake", None, self._folder)

    def deletable(self, candidates: Iterable[str | os.PathLike]) -> list[Path]:
        """Local retention's question: none while the child runs (the loop deletes what the remote holds);
        without one, what store.plan_mirror releases knowing no remote (the unbacked bound), with a warning."""
        candidates = [Path(path).resolve() for path in candidates]
        if not candidates or self._ensure_running():
            return []
        folder = candidates[0].parent
        plan = store.plan_mirror(store.list_folder(folder), store.Listing({}, {}), self.policy)
        released = [folder / name for name in plan.unbacked if folder / name in candidates]
        for path in released:
            self.log(
                f"checkpoint backup: WARNING deleting local {path.name} although it never reached the "
                "remote: the backup process is not running"
            )
        return released

    def wait(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for the newest saved checkpoint to reach the remote; say which."""
        if self._folder is None:
            self.log("checkpoint backup: nothing was submitted, nothing to wait for")
            return True
        head = read_json_or(Path(self._folder) / store.LATEST, {}).get("path", "?")
        ok = bool(self._ensure_running() and self._request("wait", timeout_s, timeout_s=timeout_s + 2))
        self.log(
            f"checkpoint backup: the newest checkpoint {head} is on the remote and verified"
            if ok
            else f"checkpoint backup: WARNING the newest checkpoint {head} did NOT reach the remote within "
            f"{timeout_s:g}s; it stays on the local disk"
        )
        return ok

    def push_run_files(self, run_dir: str | os.PathLike, timeout_s: float = 60.0) -> bool:
        """Upload the run's history files (RUN_FILES) now, waiting up to `timeout_s`."""
        return bool(
            self._ensure_running()
            and self._request("push_run_files", str(Path(run_dir).resolve()), timeout_s=timeout_s)
        )

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the child after the step it is on (up to `timeout_s`). Call wait() first to flush."""
        with self._lock:
            if self._process is None or self._closing:
                return
            self._closing = True
            self._request("close", timeout_s=timeout_s)
            try:
                self._process.wait(timeout=timeout_s + 5)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
            self._connection.close()

    @property
    def child_pid(self) -> int | None:
        """The process id of the child doing the uploads (None while there is none)."""
        process = self._process
        return process.pid if process is not None and process.poll() is None else None

    def _start(self) -> None:
        """Start a child and hand it the settings; a bad setting raises its UserError here."""
        parent_end, child_end = multiprocessing.Pipe()
        try:
            process = subprocess.Popen(
                [sys.executable, "-c", CHILD_MAIN, str(child_end.fileno()), str(PACKAGE_ROOT)],
                pass_fds=(child_end.fileno(),),
                stdin=subprocess.DEVNULL,
            )
        finally:
            child_end.close()
        parent_end.send((self.url, self.options))
        with self._lock:
            self._process, self._connection = process, parent_end
            outcome = self._reply("start", self.start_timeout_s)
        if outcome == ("ready",):
            return
        with contextlib.suppress(OSError):
            process.kill()
        process.wait()
        kind, message = outcome[1:] if outcome else ("no answer", "")
        raise (
            UserError(message)
            if kind == "UserError"
            else RuntimeError(f"the checkpoint backup process could not start ({kind})")
        )

    def _ensure_running(self) -> bool:
        """True when a child is there to talk to; starts a new one (and wakes it) if the last one died."""
        with self._lock:
            if self._closing or (self._process is not None and self._process.poll() is None):
                return not self._closing
            self.log(f"checkpoint backup: WARNING the backup process exited (code {self._process.returncode})")
            try:
                self._start()
            except Exception as error:
                self.log(f"checkpoint backup: WARNING a new backup process could not start ({type(error).__name__})")
                return False
            self.log("checkpoint backup: a new backup process started; it plans again from both listings")
            if self._folder is not None:
                self._send("wake", None, self._folder)
            return True

    def _send(self, kind: str, request_id, *args) -> bool:
        with self._lock, contextlib.suppress(OSError, ValueError):
            self._connection.send((kind, request_id, *args))
            return True
        return False

    def _reply(self, request_id, timeout_s: float):
        """The child's answer to `request_id` ("start": its first message); None: none in time, or it is gone."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while True:
                try:
                    if not self._connection.poll(max(0.0, deadline - time.monotonic())):
                        return None
                    message = self._connection.recv()
                except (EOFError, OSError):
                    return None
                if request_id == "start" or message[:2] == ("reply", request_id):
                    return message if request_id == "start" else message[2]

    def _request(self, kind: str, *args, timeout_s: float):
        request_id = next(self._request_ids)
        return self._reply(request_id, timeout_s) if self._send(kind, request_id, *args) else None


def check_backup_target(url: str) -> None:
    """train.py's --backup-to before anything is restored or trained: a missing bucket or parent
    folder (a typo) is one error, not a new bucket and a run silently restarted from step 0; a
    remote that cannot be written, read back or deleted from is one error, not hours of failed uploads."""
    fs, root = remote_store.open_remote(url)
    remote_store.require_remote(fs, root, url, writing=True)
    probe_writable(fs, root, url)


# The start-up probe's name under the backup root: no checkpoint, record or temporary name looks like
# it, and nothing lists the root (only checkpoints/ is listed), so a stale one left by a killed run is inert.
PROBE_PREFIX = ".tinyllm-probe-"


def probe_writable(fs, root: str, url: str) -> None:
    """Write a small object under `root`, read it back, compare, delete it: each step an upload needs."""
    path = run_file_path(root, PROBE_PREFIX + secrets.token_hex(8))
    payload = f"tinyllm write probe {secrets.token_hex(8)}\n".encode()
    step = "written"
    try:
        if remote_store.is_local(fs):
            fs.makedirs(root, exist_ok=True)
        fs.pipe_file(path, payload)
        step = "read back"
        remote_store.refresh(fs, path)
        same = fs.cat_file(path) == payload
        step = "deleted from"
        fs.rm_file(path)
    except Exception as error:
        remote_store.remove_quietly(fs, path)
        raise UserError(
            f"--backup-to: the remote cannot be {step} ({remote_store.probe_error_text(error, url)}); "
            "no checkpoint would reach it"
        ) from None
    if not same:
        raise UserError(
            "--backup-to: the remote returned other bytes than were written to it; "
            "no checkpoint could be verified there"
        )


def backup_from_args(
    args: argparse.Namespace, save_every: int | None = None, log: LogFn = log_line
) -> BackupProcess | None:
    """A BackupProcess for train.py's backup options (SessionSettings: BACKUP, --keep-last, --keep-every), or None
    when no backup URL is set. --remote-keep-every N keeps every Nth save: every multiple of N x
    save_every steps, the local rule's form (without --save-every, none)."""
    url = backup_url_from_env_or_arg(args.backup_to)
    if url is None:
        return None
    policy = store.MirrorPolicy(
        keep_last=args.keep_last,
        keep_every=args.keep_every,
        remote_keep_last=args.remote_keep_recent,
        remote_keep_every=args.remote_keep_every * (save_every or 0),
        max_unbacked=args.backup_max_unbacked,
    )
    return BackupProcess(url, policy, log=log)


# ----------------------------------------------------------------------------------------------
# The command line.


def command_list(url: str) -> int:
    fs, root = remote_store.open_remote(url)
    remote_store.require_remote(fs, root, url)
    with remote_errors("listing the remote"):
        if remote_store.remote_is_corpus(fs, root):
            manifest = remote_store.remote_manifest(fs, root)
            for name, (sha, size) in sorted(manifest.files().items()):
                print(f"{name:40s} {size if size is not None else '-':>14} {sha[:12]}")
            return 0
        listing = remote_listing(fs, root)
        latest = listing.latest.path if listing.latest else None
        if not listing.files:
            print("no checkpoints on the remote")
        for name in listing.steps(listing.files):
            record = listing.records.get(name)
            mark = "  <- latest" if latest == name else ""
            if isinstance(record, store.Record):
                print(f"{name:24s} step {record.step:>9} {record.bytes:>14} bytes  sha256 {record.sha256[:12]}{mark}")
            elif record is not None:
                print(f"{name:24s} step {store.step_of(name):>9} {'?':>14} bytes  sha256 ? (record unreadable){mark}")
            else:
                print(f"{name:24s} UNVERIFIED (no record; never used by restore)")
        for name in listing.temporaries:
            print(f"{name:24s} partial upload (in flight, or left by an interrupted one)")
    return 0


def command_push(run_dir: str, url: str) -> int:
    source = Path(run_dir)
    if not source.is_dir():
        raise UserError(f"no such folder: {run_dir}")
    fs, root = remote_store.open_remote(url)
    remote_store.require_remote(fs, root, url, writing=True)
    with remote_errors("pushing"):
        if (source / CORPUS_MANIFEST).is_file():
            remote_store.push_corpus(source, fs, root)
            return 0
        if not (source / CHECKPOINT_DIR).is_dir():
            raise UserError(
                f"{run_dir} is neither a run folder (no {CHECKPOINT_DIR}/) nor a corpus ({CORPUS_MANIFEST}): "
                "push a train.py --out folder or a data.py corpus"
            )
        local = store.list_folder(source / CHECKPOINT_DIR)
        if not local.files:
            raise UserError(f"{source / CHECKPOINT_DIR} holds no step-*.pt checkpoints")
        listing = remote_listing(fs, root)
        newest = None
        for name in local.steps(local.files):
            problem = local.mismatch(name)
            if problem:
                print(f"WARNING {problem}; not pushed")
                continue
            if store.backed_up(local, listing, name):
                print(f"{name}: already on the remote")
                newest = listing.records[name]
                continue
            try:
                newest = upload_checkpoint(fs, root, source / CHECKPOINT_DIR / name)
            except VerificationError as error:
                raise UserError(f"pushing {name}: {error}; nothing of it was published") from None
            print(f"{name}: uploaded and verified")
        if newest is None:
            raise UserError(f"no checkpoint in {source / CHECKPOINT_DIR} matches its local record; nothing pushed")
        write_remote_latest(fs, root, newest)
        print(f"remote latest.json -> {newest.path} (step {newest.step})")
        history = upload_run_files(fs, root, source)
        if history:
            print(f"run files uploaded and verified: {', '.join(history)}")
    return 0


def command_pull(url: str, run_dir: str) -> int:
    fs, root = remote_store.open_remote(url)
    remote_store.require_remote(fs, root, url)
    target = Path(run_dir).resolve()
    for folder in (target, target.parent) if target.is_dir() else (target.parent,):
        check_writable_folder(folder, "the local folder")  # before the download, not a network error after it
    with remote_errors("reading the remote"):
        corpus = remote_store.remote_is_corpus(fs, root)
    if corpus:
        remote_store.pull_corpus(url, run_dir)
        return 0
    problem = store.run_folder_problem(Path(run_dir))  # a swapped argument never writes a run into your data
    if problem:
        raise UserError(f"pull: {run_dir} {problem}; pull a run into a new or empty folder, or into its run folder")
    path = restore_latest(url, Path(run_dir) / CHECKPOINT_DIR, read_only=True)
    if path is None:
        raise UserError("the remote holds no checkpoint to pull")
    say_how_to_continue(Path(run_dir), url)
    return 0


def say_how_to_continue(run_dir: Path, url: str) -> None:
    """pull's last line: the command in `run_dir`'s run_status.json that continues the run; first a warning when
    it backs up elsewhere than `url`, the store pulled from (a run_status.json that was here before the pull
    is kept as it is: settled_status rewrites only the one restored)."""
    command = read_json_or(run_dir / store.STATUS_FILE, {}).get("resume_command")
    if not isinstance(command, str):
        return
    target = backup_target(command)
    if target not in (None, shown_backup_url(url)):
        print(
            f"WARNING {run_dir / store.STATUS_FILE} was here before the pull and is kept: its resume_command "
            f"backs up to {target}, not to the store pulled from; give --backup-to the URL to back up to"
        )
    print(f"continue with: {command}")


def command_verify(url: str) -> int:
    fs, root = remote_store.open_remote(url)
    remote_store.require_remote(fs, root, url)
    problems = []
    with remote_errors("verifying the remote"):
        if remote_store.remote_is_corpus(fs, root):
            manifest = remote_store.remote_manifest(fs, root)
            expected = manifest.files()
            for name, (sha, size) in sorted(expected.items()):
                try:
                    got_size, got_sha = remote_store.remote_digest(fs, f"{root}/{name}")
                except FileNotFoundError:
                    problems.append(f"{name}: missing")
                    continue
                if got_sha != sha or (size is not None and got_size != size):
                    problems.append(f"{name}: does not match {CORPUS_MANIFEST}")
            checked = len(expected)
            if manifest.tokenizer_sha256:
                checked += 1
                tokenizer = remote_store.remote_tree_sha256(fs, f"{root}/{corpus_format.TOKENIZER_DIR}")
                if tokenizer != manifest.tokenizer_sha256:
                    problems.append(f"tokenizer/: does not match {CORPUS_MANIFEST}")
        else:
            listing = remote_listing(fs, root)
            if not (listing.files or listing.latest or listing.latest_error):
                print("verify: no checkpoints on the remote, nothing to check")
                return 0
            folder = checkpoint_folder(root)
            recorded = [name for name in listing.steps(listing.files) if name in listing.records]
            for name in recorded:
                record = listing.records[name]
                got_size, got_sha = remote_store.remote_digest(fs, f"{folder}/{name}")
                if not isinstance(record, store.Record) or (got_sha, got_size) != (record.sha256, record.bytes):
                    problems.append(f"{name}: does not match its recorded sha256 (corrupted)")
                else:
                    print(f"{name}: ok")
            problems += [
                f"{name}: has no record (unverified upload)" for name in listing.files if name not in listing.records
            ]
            if listing.latest_error:
                problems.append(f"{store.LATEST}: {listing.latest_error}")
            elif listing.latest is None:
                problems.append(f"{store.LATEST}: missing")
            elif listing.latest.path not in recorded:
                problems.append(f"{store.LATEST}: points at {listing.latest.path}, which is not a verified checkpoint")
            checked = len(recorded)
            if listing.temporaries:
                print(f"note: {len(listing.temporaries)} partial upload(s) present (ignored)")
    for problem in problems:
        print(f"PROBLEM {problem}")
    print(f"verify: {checked} file(s) checked, {len(problems)} problem(s)")
    return 1 if problems else 0


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown, and the epilog's lines (one per store) kept as they are."""


def parse_args(argv=None) -> argparse.Namespace:
    formatter = argparse.ArgumentDefaultsHelpFormatter
    parser = ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=HelpFormatter,
        epilog="A URL is a folder (a path, file://, local://) or one of these stores:\n" + remote_store.backends_text(),
    )
    commands = parser.add_subparsers(dest="command", required=True)
    listing = commands.add_parser(
        "list", help="show the remote's checkpoints (or corpus files)", formatter_class=formatter
    )
    listing.add_argument("url", help="remote run (or corpus) URL")
    push = commands.add_parser(
        "push", help="upload a run's checkpoints (or a corpus folder), verified", formatter_class=formatter
    )
    push.add_argument("run", help="local RUN folder (its checkpoints/) or CORPUS folder")
    push.add_argument("url", help="remote URL")
    pull = commands.add_parser(
        "pull",
        help="download the newest intact checkpoint into RUN/checkpoints (or the corpus into the folder)",
        formatter_class=formatter,
    )
    pull.add_argument("url", help="remote URL")
    pull.add_argument("run", help="local RUN (or CORPUS) folder")
    verify = commands.add_parser(
        "verify", help="re-hash every remote file against its record; exit 1 on a problem", formatter_class=formatter
    )
    verify.add_argument("url", help="remote URL")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.command == "list":
        return command_list(args.url)
    if args.command == "push":
        return command_push(args.run, args.url)
    if args.command == "pull":
        return command_pull(args.url, args.run)
    return command_verify(args.url)


def command() -> None:
    """The `tinyllm-cloud` console script (pyproject.toml): `python checkpoint_cloud.py` from anywhere."""
    stop_on_sigterm()  # one `error: terminated` line; a push or pull in flight removes its temporary first
    run_main(main, script=True)


if __name__ == "__main__":
    command()
