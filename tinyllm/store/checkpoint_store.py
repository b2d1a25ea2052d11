"""The checkpoint store: names, records, listing and the resume plan, for a run's checkpoints/
folder and its copy on a backup remote alike, the run's status names, and reading a checkpoint
back (the only part that imports torch, where it is used: the rules and the backup never open one).

    checkpoints/step-00001000.pt        the checkpoint (train.py writes it; torch.save)
    checkpoints/step-00001000.pt.json   its record: {"path", "step", "sha256", "bytes", "run_id",
                                        "created", "val_loss"}; written before the checkpoint is
                                        renamed into place, so every checkpoint can be verified
    checkpoints/latest.json             the record of the newest checkpoint of the timeline
    checkpoints/.NAME.<hex>.tmp         a write or download in flight (common.temporary_name)
    checkpoints/step-N.pt.corrupt       a damaged checkpoint set aside (its record too)
    checkpoints/abandoned-STEP/         checkpoints of a timeline left by `--resume PATH`

The best checkpoint is not a copy: it is the step whose record has the lowest `val_loss` (written
only when a save set a new best), and retention keeps it.

Resume is a plan: `plan_resume` (which checkpoint to load, what to delete and set aside) and
`plan_timeline` (what a rewind abandons) are pure functions of a `Listing`; `apply_plan` does it.
A resume compares settings as data (`settings_changes`, `resume_verdict`); strings are built only
for the message that refuses one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import math
import os
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tinyllm.common import (
    UserError,
    atomic_open,
    atomic_write_json,
    os_error_cause,
    os_error_text,
    read_json,
    read_json_or,
    say,
    sha256_file,
    sha256_tree,
    temporary_target,
    utc_now,
)
from tinyllm.data import corpus_format
from tinyllm.data.corpus_format import CORPUS_MANIFEST
from tinyllm.model.config import RECORDED_PREFIX

CHECKPOINT = re.compile(r"step-(\d{8})\.pt")
RECORD_SUFFIX = ".json"
LATEST = "latest.json"
CORRUPT_SUFFIX = ".corrupt"
ABANDONED = "abandoned-{step:08d}"
CHECKPOINT_DIR = "checkpoints"  # a RUN folder's checkpoints, locally and on a backup remote
TRACKERS_FILE = "trackers.json"  # trackers.py: per tracker, its run id and the last step it was given
TENSORBOARD_EVENTS = "events.out.tfevents.tinyllm"  # trackers.py: one file per run, rebuilt on resume
# The small files of a RUN folder that carry its history; backed up beside checkpoints/ and
# restored when missing (train.py truncates metrics.jsonl after the step it resumes from).
RUN_FILES = (
    "metrics.jsonl",
    "training_settings.json",
    "config.toml",
    "hardware.json",
    "run_status.json",
    TRACKERS_FILE,
    TENSORBOARD_EVENTS,
)


# run_status.json's status: running, stopped with a checkpoint to continue from, complete, failed
RUNNING, NEEDS_RESUME, COMPLETE, FAILED = "RUNNING", "CHECKPOINTED_NEEDS_RESUME", "COMPLETE", "FAILED"


# 4: precision is a session setting (settings["runtime"]["precision"], as resolved on the device that saved):
# a run may move between cards with and without bf16; 5: metrics.task_history (--eval-tasks records);
# 6: "callbacks" holds each observer's state under its key (callbacks.py: train, validation, tasks), not "metrics"
FORMAT_VERSION = 6


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}.pt"


def step_of(name: str) -> int | None:
    """The step of a checkpoint's file name; None for any other name."""
    match = CHECKPOINT.fullmatch(name)
    return int(match.group(1)) if match else None


def record_name(name: str) -> str:
    """step-00001000.pt -> step-00001000.pt.json (the same beside a local file and on a remote)."""
    return f"{name}{RECORD_SUFFIX}"


def size_text(size: int) -> str:
    return f"{size / 1e6:,.1f} MB" if size >= 100_000 else f"{size:,} bytes"


@dataclass(frozen=True)
class Record:
    """What a checkpoint file must be (size and sha256), who wrote it and when."""

    path: str
    step: int
    sha256: str
    bytes: int
    run_id: str
    created: str
    val_loss: float | None = None  # set when this save was the run's best validation loss so far

    @classmethod
    def from_json(cls, obj) -> Record:
        """A Record from its JSON form; ValueError saying what is wrong."""
        if not isinstance(obj, dict):
            raise ValueError("not a record")
        fields = {item.name: item for item in dataclasses.fields(cls)}
        missing = [name for name, item in fields.items() if name not in obj and item.default is dataclasses.MISSING]
        if missing:
            raise ValueError(f"lacks {', '.join(missing)}")
        record = cls(**{name: obj[name] for name in fields if name in obj})
        if (
            step_of(str(record.path)) != record.step
            or not isinstance(record.bytes, int)
            or not isinstance(record.sha256, str)
            or not isinstance(record.run_id, str)
        ):
            raise ValueError("has fields of the wrong kind")
        return record

    def to_json(self) -> dict:
        return {key: value for key, value in dataclasses.asdict(self).items() if value is not None}


def read_record(path: Path) -> Record:
    """The record at `path`; UserError naming the file when it is missing, broken or not a record."""
    try:
        return Record.from_json(read_json(path, "checkpoint record"))
    except ValueError as error:
        raise UserError(f"checkpoint record {path} {error}") from None


def write_record(folder: Path, record: Record, name: str | None = None) -> None:
    """Write `record` as NAME.pt.json (or as `name`, e.g. latest.json) in `folder`, atomically."""
    atomic_write_json(folder / (name or record_name(record.path)), record.to_json())


# ----------------------------------------------------------------------------------------------
# What a store holds, and the plan.


@dataclass
class Listing:
    """What a checkpoints folder holds: the facts the plans decide on.

    `sha256` hashes a checkpoint on demand (the one expensive question; a test passes a dict's get).
    """

    files: dict[str, int]  # step-N.pt -> its size
    records: dict[str, Record | str]  # step-N.pt -> its record, or why that does not read
    temporaries: list[str] = field(default_factory=list)
    corrupt: list[str] = field(default_factory=list)  # checkpoints set aside earlier (step-N.pt.corrupt)
    folders: set[str] = field(default_factory=set)
    sha256: Callable[[str], str] = lambda name: ""
    latest: Record | None = None  # what latest.json names (None: none, or it does not read)
    latest_error: str | None = None  # why latest.json does not read

    def steps(self, names: Iterable[str]) -> list[str]:
        """`names` ordered by step: their text order, as a step name has eight digits (step-%08d.pt)."""
        return sorted(names)

    def run_id(self, name: str) -> str | None:
        record = self.records.get(name)
        return record.run_id if isinstance(record, Record) else None

    def mismatch(self, name: str) -> str | None:
        """Why checkpoint `name` does not match its record; None when it does."""
        record = self.records.get(name)
        if record is None:
            return f"{name} has no sha256 record (not written by a train.py save)"
        if isinstance(record, str):
            return f"{name}: {record}"
        if self.files[name] != record.bytes:
            return f"{name}: it is {self.files[name]} bytes, its record says {record.bytes} (truncated?)"
        if self.sha256(name) != record.sha256:
            return f"{name}: it does not match the sha256 in its record (corrupt)"
        return None

    def best(self, run_id: str | None = None) -> Record | None:
        """The record with the lowest val_loss (of run `run_id` only, when given)."""
        scored = [
            record
            for record in self.records.values()
            if isinstance(record, Record)
            and record.val_loss is not None
            and math.isfinite(record.val_loss)
            and record.path in self.files
            and run_id in (None, record.run_id)
        ]
        return min(scored, key=lambda record: (record.val_loss, record.step), default=None)


@dataclass(frozen=True)
class Names:
    """A checkpoints folder's names sorted by what they are (the same rule for a local folder and a remote)."""

    checkpoints: list[str]  # step-N.pt
    recorded: list[str]  # the checkpoints whose record step-N.pt.json is there
    orphaned: list[str]  # checkpoints whose record is there but not the file (a killed save or retention)
    temporaries: list[str]  # .NAME.<hex>.tmp: writes, uploads or downloads in flight or killed
    corrupt: list[str]  # checkpoints set aside as step-N.pt.corrupt


def sort_names(names: Iterable[str]) -> Names:
    names = set(names)
    checkpoints = sorted(name for name in names if step_of(name) is not None)
    with_records = {name.removesuffix(RECORD_SUFFIX) for name in names if name.endswith(RECORD_SUFFIX)}
    return Names(
        checkpoints=checkpoints,
        recorded=[name for name in checkpoints if name in with_records],
        orphaned=sorted(name for name in with_records if step_of(name) is not None and name not in names),
        temporaries=sorted(name for name in names if temporary_target(name)),
        corrupt=sorted(
            name.removesuffix(CORRUPT_SUFFIX)
            for name in names
            if name.endswith(CORRUPT_SUFFIX) and step_of(name.removesuffix(CORRUPT_SUFFIX)) is not None
        ),
    )


def list_folder(folder: Path) -> Listing:
    """The Listing of a local checkpoints folder (an absent folder is empty)."""
    paths = {path.name: path for path in folder.iterdir()} if folder.is_dir() else {}
    names = sort_names(paths)
    records: dict[str, Record | str] = {name: "its checkpoint is gone" for name in names.orphaned}
    for name in names.recorded:
        try:
            records[name] = read_record(paths[record_name(name)])
        except UserError as error:
            records[name] = str(error)
    latest, latest_error = None, None
    if LATEST in paths:
        try:
            latest = read_record(paths[LATEST])
        except UserError as error:
            latest_error = str(error)
    return Listing(
        files={name: paths[name].stat().st_size for name in names.checkpoints},
        records=records,
        temporaries=names.temporaries,
        corrupt=names.corrupt,
        folders={name for name, path in paths.items() if path.is_dir()},
        sha256=lambda name: sha256_file(folder / name),
        latest=latest,
        latest_error=latest_error,
    )


@dataclass
class ResumePlan:
    load: str | None = None  # the checkpoint to resume from (auto); None: the caller's --resume PATH, or fresh
    delete: list[str] = field(default_factory=list)  # what killed saves left: temporaries, records of nothing
    set_aside: list[str] = field(default_factory=list)  # damaged checkpoints: renamed NAME.corrupt
    warnings: list[str] = field(default_factory=list)
    error: str | None = None


def plan_resume(listing: Listing, resume: str) -> ResumePlan:
    """Which checkpoint `--resume auto|none|PATH` starts from, and what to tidy first.

    - Temporaries are writes that never finished, and a record whose checkpoint is gone vouches for
      nothing: both are deleted.
    - `none` refuses a folder that has checkpoints. A PATH is the caller's to load (load=None).
    - `auto` takes the newest checkpoint that matches its record; each newer one that does not is set
      aside (kept for inspection, out of resume and retention), one without a record is skipped.
    """
    plan = ResumePlan(
        delete=[
            *listing.temporaries,
            *(record_name(name) for name in listing.steps(listing.records) if name not in listing.files),
        ]
    )
    if resume == "none":
        if listing.files:
            plan.error = (
                f"already has checkpoints ({listing.steps(listing.files)[-1]}); pass --resume auto to "
                "continue, or choose a new --out"
            )
        return plan
    if resume != "auto" or not (listing.files or listing.corrupt):
        return plan
    for name in reversed(listing.steps(listing.files)):
        problem = listing.mismatch(name)
        if problem is None:
            plan.load = name
            break
        if name in listing.records:
            plan.set_aside.append(name)
            plan.warnings.append(
                f"{problem}: set aside as {name}{CORRUPT_SUFFIX} ({size_text(listing.files[name])}; "
                "delete it once inspected)"
            )
        else:
            plan.warnings.append(f"{problem}: skipped")
    if plan.load is None:
        damaged = [*plan.set_aside, *listing.corrupt]
        plan.error = (
            "has checkpoints but none verifies against its sha256"
            + (f" (damaged, set aside: {', '.join(damaged)})" if damaged else "")
            + "; pass --resume PATH to force one, or choose a new --out"
        )
    elif plan.warnings:
        plan.warnings.append(f"falling back to {plan.load}")
    return plan


@dataclass
class TimelinePlan:
    abandon: list[str] = field(default_factory=list)  # moved (with their records) into `folder`
    folder: str | None = None
    latest: Record | None = None  # what latest.json names from now on (None: nothing yet)
    rewound: bool = False  # checkpoints after the one resumed from were left behind
    warnings: list[str] = field(default_factory=list)


def plan_timeline(listing: Listing, resumed: str | None, step: int, run_id: str) -> TimelinePlan:
    """What a session that continues at `step` (from checkpoint `resumed` of this folder, or from a
    file elsewhere when None) of run `run_id` leaves behind.

    Recorded checkpoints after `step` belong to a timeline abandoned by `--resume PATH`, and a
    checkpoint of another run is no ancestor of this one: both move to abandoned-STEP/ (moved, never
    deleted: they may be the only copy of that progress), so that neither `--resume auto`,
    retention nor the best checkpoint mixes timelines.
    """
    plan = TimelinePlan()
    record = listing.records.get(resumed)  # None when resumed from a file elsewhere (resumed=None)
    plan.latest = record if isinstance(record, Record) else None
    newer = [name for name in listing.files if step_of(name) > step]
    plan.rewound = any(name in listing.records for name in newer)
    other_runs = [
        name for name in listing.files if step_of(name) <= step and listing.run_id(name) not in (None, run_id)
    ]
    if not (plan.rewound or other_runs):
        return plan
    plan.abandon = listing.steps([*newer, *other_runs])
    plan.folder = ABANDONED.format(step=step)
    copy = 1
    while plan.folder in listing.folders:
        copy += 1
        plan.folder = f"{ABANDONED.format(step=step)}-{copy}"
    size = sum(listing.files[name] for name in plan.abandon)
    plan.warnings.append(
        f"resuming from step {step} abandons {', '.join(plan.abandon)} ({size_text(size)}; newer "
        f"checkpoints, or another run's): moved to {plan.folder}; delete that folder once you no "
        "longer need them"
    )
    return plan


def newest_verified(listing: Listing) -> str | None:
    """The newest checkpoint that matches its record (nothing is changed, nothing is warned)."""
    return next((name for name in reversed(listing.steps(listing.files)) if listing.mismatch(name) is None), None)


def file_mismatch(path: Path) -> str | None:
    """Why a checkpoint file named by hand does not match the record beside it; None when it does or
    has none (a file copied by hand may come without one)."""
    listing = list_folder(path.parent)
    return listing.mismatch(path.name) if path.name in listing.records else None


def retention_deletions(listing: Listing, run_id: str, keep_last: int, keep_every: int) -> list[str]:
    """The checkpoints retention deletes: this run's, except its newest `keep_last`, every multiple of
    `keep_every` and its best. Another run's (or one without a record) are never counted or deleted."""
    ours = listing.steps(name for name in listing.files if listing.run_id(name) == run_id)
    best = listing.best(run_id)
    keep = set(ours[-keep_last:]) | ({best.path} if best else set())
    return [name for name in ours if name not in keep and not (keep_every and step_of(name) % keep_every == 0)]


def beyond_unbacked_bound(waiting: Iterable, step: Callable[[object], int], max_unbacked: int) -> list:
    """The rule of --backup-max-unbacked: of the checkpoints local retention wants to delete that have no
    remote copy (`waiting`), the oldest beyond the newest `max_unbacked`, which may be deleted after all
    (so a long outage cannot fill the disk). `step` gives an item's step; the result is oldest first."""
    waiting = sorted(waiting, key=step)
    return waiting[: max(0, len(waiting) - max_unbacked)]


@dataclass(frozen=True)
class MirrorPolicy:
    """The retention of each side, by the one rule of retention_deletions (the newest N, every multiple
    of a step, the best), and how many unbacked checkpoints local retention may hold back."""

    keep_last: int = 2
    keep_every: int = 0  # a step: every multiple of it is kept
    remote_keep_last: int = 3
    remote_keep_every: int = 0
    max_unbacked: int = 3

    def __post_init__(self):
        if self.remote_keep_last < 1 or self.keep_last < 1:
            raise UserError(
                f"--remote-keep-recent and --keep-last must be >= 1, got {self.remote_keep_last} and {self.keep_last}"
            )
        if min(self.remote_keep_every, self.keep_every, self.max_unbacked) < 0:
            raise UserError("--remote-keep-every, --keep-every and --backup-max-unbacked must be >= 0")


@dataclass
class MirrorPlan:
    upload: list[str] = field(default_factory=list)  # local checkpoints the remote lacks, newest first
    delete_remote: list[str] = field(default_factory=list)
    latest: Record | None = None  # what the remote latest.json is to name; None: it does already, or nothing
    delete_local: list[str] = field(default_factory=list)
    unbacked: list[str] = field(default_factory=list)  # of delete_local, those with no remote copy
    caught_up: bool = False  # the local latest.json's checkpoint is on the remote and its latest.json names it

    def empty(self) -> bool:
        return not (self.upload or self.delete_remote or self.latest or self.delete_local)


def backed_up(local: Listing, remote: Listing, name: str) -> bool:
    """The remote holds local checkpoint `name` in full, under a record with the same sha256."""
    mine, theirs = local.records.get(name), remote.records.get(name)
    return (
        isinstance(mine, Record)
        and isinstance(theirs, Record)
        and theirs.sha256 == mine.sha256
        and remote.files.get(name) == theirs.bytes == mine.bytes
    )


def plan_mirror(local: Listing, remote: Listing, policy: MirrorPolicy) -> MirrorPlan:
    """What the backup does next so that the remote mirrors the local timeline (pure: the loop applies it).

    The timeline is the run of the local latest.json up to its step; a remote checkpoint after it
    belongs to a timeline the run left (a rewind) and one whose sha256 differs from the local file of
    that name is stale: neither counts, neither is deleted (an upload overwrites it). The remote keeps
    by retention_deletions with the remote's numbers, counting only what is verified there, so nothing
    goes before its successor arrived; what retention of the remote would not keep is never uploaded.
    A local checkpoint retention wants gone may go once the remote holds it, or once it is not wanted
    there and a newer one is; beyond `max_unbacked` waiting, the oldest go anyway (`unbacked`)."""
    plan, head = MirrorPlan(), local.latest
    if head is None or head.path not in local.files:
        return plan

    def on_timeline(listing: Listing, name: str) -> bool:
        return step_of(name) <= head.step and listing.run_id(name) == head.run_id

    ours = [name for name in local.files if on_timeline(local, name)]
    verified = [
        name
        for name in remote.files
        if on_timeline(remote, name)
        and remote.files[name] == remote.records[name].bytes
        and (name not in local.records or backed_up(local, remote, name))
    ]
    records = {**{name: remote.records[name] for name in verified}, **{name: local.records[name] for name in ours}}

    def kept(names: Iterable[str]) -> set[str]:
        names = set(names)
        union = Listing(files=dict.fromkeys(names, 0), records={name: records[name] for name in names})
        return names - set(retention_deletions(union, head.run_id, policy.remote_keep_last, policy.remote_keep_every))

    wanted = kept([*verified, *ours])
    plan.upload = sorted((name for name in ours if name in wanted and name not in verified), reverse=True)
    newest = max(verified, default=None)
    if newest is not None and (remote.latest is None or remote.latest != remote.records[newest]):
        plan.latest = remote.records[newest]
    protected = {newest, remote.latest.path if remote.latest else None}
    plan.delete_remote = sorted(set(verified) - kept(verified) - protected)
    waiting = []
    for name in retention_deletions(local, head.run_id, policy.keep_last, policy.keep_every):
        if name in verified or (name not in wanted and newest is not None and name < newest):
            plan.delete_local.append(name)
        else:
            waiting.append(name)
    plan.unbacked = beyond_unbacked_bound(waiting, step_of, policy.max_unbacked)
    plan.delete_local += plan.unbacked
    plan.upload = [name for name in plan.upload if name not in plan.unbacked]
    plan.caught_up = newest == head.path and plan.latest is None
    return plan


def restore_order(recorded_steps, latest_step: int | None) -> list[int]:
    """The remote's recorded checkpoints to restore from after latest.json's own, newest first: only
    those before it (the ones past it belong to a timeline the run left when it was rewound)."""
    return sorted((step for step in recorded_steps if latest_step is None or step < latest_step), reverse=True)


# ----------------------------------------------------------------------------------------------
# Applying a plan to a local folder (the only part here that changes files).


def set_aside(folder: Path, name: str) -> None:
    """Rename a damaged checkpoint and its record to *.corrupt."""
    for item in (name, record_name(name)):
        if (folder / item).exists():
            os.replace(folder / item, folder / f"{item}{CORRUPT_SUFFIX}")


def delete(folder: Path, names: Iterable[str]) -> None:
    """Delete checkpoints with their records: the record first, so a file is never left vouched for."""
    for name in names:
        (folder / record_name(name)).unlink(missing_ok=True)
        (folder / name).unlink(missing_ok=True)


def apply_plan(folder: Path, plan: ResumePlan) -> None:
    for name in plan.delete:
        path = folder / name
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    for name in plan.set_aside:
        set_aside(folder, name)


def apply_timeline(folder: Path, plan: TimelinePlan) -> None:
    if plan.abandon:
        target = folder / plan.folder
        target.mkdir()
        for name in plan.abandon:
            for item in (name, record_name(name)):
                if (folder / item).exists():
                    os.replace(folder / item, target / item)
    if plan.latest is not None:
        write_record(folder, plan.latest, LATEST)
    else:  # resumed from a file elsewhere: the next save writes it
        (folder / LATEST).unlink(missing_ok=True)


def find_resume_checkpoint(out: Path, resume: str) -> Path | None:
    """The checkpoint `--resume` asks for (store.plan_resume), changing nothing: None for a fresh start."""
    return resume_checkpoint(out, resume, tidy=False)


def tidy_and_find_resume_checkpoint(out: Path, resume: str) -> Path | None:
    """find_resume_checkpoint for a training session, which holds the run folder's lock: the plan is
    carried out first (what killed saves left is removed, damaged checkpoints are set aside)."""
    return resume_checkpoint(out, resume, tidy=True)


def continues_checkpoint(out: Path, resume: str) -> bool:
    """Whether `--resume auto|none|PATH` continues a checkpoint rather than starting the run folder `out` afresh:
    a PATH always, auto when plan_resume finds a verified one in `out`, none never. Reads only: nothing is
    tidied, and a PATH is not checked (resume_checkpoint does both)."""
    if resume == "none":
        return False
    return resume != "auto" or plan_resume(list_folder(out / CHECKPOINT_DIR), "auto").load is not None


def resume_checkpoint(out: Path, resume: str, tidy: bool) -> Path | None:
    """--resume's checkpoint in the run folder `out` by plan_resume; with `tidy` the plan is carried out."""
    folder = out / CHECKPOINT_DIR
    if resume not in ("auto", "none") and Path(resume).is_dir():
        raise UserError(
            f"--resume {resume} is a folder: name a checkpoint file (RUN/checkpoints/step-N.pt), or give the run "
            "folder as --out with --resume auto (its newest verified checkpoint)"
        )
    if resume not in ("auto", "none") and not Path(resume).is_file():
        raise UserError(f"--resume {resume}: no such checkpoint file")
    plan = plan_resume(list_folder(folder), resume)
    if tidy:
        if plan.delete:
            say(f"removed what interrupted saves left in {folder}: {', '.join(plan.delete)}")
        apply_plan(folder, plan)
    for message in plan.warnings:
        say(message, warning=True)
    if plan.error:
        raise UserError(f"{folder} {plan.error}")
    if resume not in ("auto", "none"):
        path = Path(resume)
        problem = file_mismatch(path)
        if problem:
            say(
                f"--resume {path}: {problem}; loading it anyway, as asked (the state is checked against this "
                "file, not against the record)",
                warning=True,
            )
        return path
    return folder / plan.load if plan.load else None


# Extending a run (more or fewer tokens on resume): sound only when every step already taken keeps
# its learning rate, so the run is the one it would have been had it been planned this long.
LENGTH_SETTINGS = ("total_steps", "target_tokens", "epochs", "recipe.total_steps", "recipe.decay_steps")


# ----------------------------------------------------------------------------------------------
# RUN/run_status.json: where the run stands (DESIGN.md, "Run folder").

STATUS_FILE = "run_status.json"
FINAL = (NEEDS_RESUME, COMPLETE)  # a session's last word: a failure after it (in the report, say) keeps it


def write_status(out: Path, status: str, **fields) -> None:
    """RUN/run_status.json, atomically: RunStatus during a session; a restore from the backup before one."""
    atomic_write_json(out / STATUS_FILE, {"status": status, **fields, "updated": utc_now()})


class RunStatus:
    """The one owner of run_status.json during a session: RUNNING, then stopped resumably
    (NEEDS_RESUME), COMPLETE or FAILED, and which outputs of a finished run are done
    (`outputs`: the report and model/ "pending" until made). Only rank 0 (`enabled`) reads and writes.

    Every record it writes, RUNNING included, carries `resume_command` (the command that continues
    the run, train.resume_command), so a session killed at any moment leaves it on disk."""

    def __init__(self, out: Path, enabled: bool = True, resume_command: str | None = None):
        self.out, self.enabled, self.resume_command = out, enabled, resume_command
        self.previous = read_json_or(out / STATUS_FILE, {}) if enabled else {}  # what the last session left
        self.record: dict = {}

    @property
    def final(self) -> str | None:
        """The final status this session recorded (stopped or complete), which a later failure keeps."""
        status = self.record.get("status")
        return status if status in FINAL else None

    def running(self, step: int, total_steps: int, **progress) -> None:
        self._write({"status": RUNNING, "step": step, "total_steps": total_steps, **progress})

    def finished(self, status: str, **record) -> None:
        """NEEDS_RESUME or COMPLETE, as soon as the last checkpoint is on disk (update adds the rest)."""
        self._write({"status": status, **record})

    def failed(self, status: str, **record) -> bool:
        """FAILED (or NEEDS_RESUME: a lost rank after a checkpoint); False, and nothing written,
        when this session already recorded its final status: that stays, it is true."""
        if self.final:
            return False
        self._write({"status": status, **record})
        return True

    def update(self, **fields) -> None:
        """The recorded status with `fields` added or changed (the backup caught up, the report made)."""
        if self.record:
            self._write({**self.record, **fields})

    def amend(self, **fields) -> None:
        """The status the last session left with `fields` changed, outside a session (`report.py evaluate`
        keeps model/README.md's sha256 true); nothing when there is none."""
        if self.previous.get("status"):
            self._write({**{key: value for key, value in self.previous.items() if key != "updated"}, **fields})

    def _write(self, record: dict) -> None:
        if self.resume_command is not None:
            record = {**record, "resume_command": self.resume_command}
        self.record = record
        if self.enabled:
            write_status(self.out, record["status"], **{k: v for k, v in record.items() if k != "status"})


def previous_session_note(previous: dict, resumed_step: int) -> str | None:
    """The `note:` a session starts with when the last one left run_status.json unfinished: RUNNING
    (it died without a word: killed, out of host memory, its machine gone) or a final status whose
    report is still pending. `resumed_step`: the step this session continues from (0: a fresh start)."""
    status, step = previous.get("status"), previous.get("step")
    if status == RUNNING and isinstance(step, int):
        died = max(step, resumed_step)  # the status is written at logged steps: the session got at least this far
        where = f"resuming from step {resumed_step}" if resumed_step else "no checkpoint is left: starting at step 0"
        return (
            f"note: the previous session died without a word after step {died} ({STATUS_FILE} still said "
            f"{RUNNING}: killed, out of memory, or its machine went away); {where}; steps done again: "
            f"{died - resumed_step} or more"
        )
    if status in FINAL and (previous.get("outputs") or {}).get("report") == "pending":
        return (
            f"note: the previous session ended before its report was made ({STATUS_FILE}: {status}, report "
            "pending); this session makes it at its end"
        )
    return None


class HashingWriter:
    """A write-only file wrapper that hashes what passes through (no second read for the sha256)."""

    def __init__(self, handle):
        self.handle, self.digest = handle, hashlib.sha256()
        self.os_error: OSError | None = None  # torch.save reports a failed write as a RuntimeError: keep the cause

    def write(self, data) -> int:
        self.digest.update(data)
        try:
            return self.handle.write(data)
        except OSError as error:
            self.os_error = error
            raise

    def flush(self) -> None:
        self.handle.flush()

    def sha256(self) -> str:
        return self.digest.hexdigest()


UNSET = "(unset)"


def settings_changes(old: dict, new: dict) -> dict[str, tuple[Any, Any]]:
    """{name: (old value, new value)} for every setting that differs (UNSET where one side lacks it)."""
    return {
        key: (old.get(key, UNSET), new.get(key, UNSET))
        for key in sorted(set(old) | set(new))
        if old.get(key) != new.get(key)
    }


RESOLVED_PREFIXES = (RECORDED_PREFIX, "recipe.")  # an option's resolved value: model.heads, recipe.lr
DERIVED_SETTINGS = {"tokens_per_step": ("global_batch_blocks", RECORDED_PREFIX + "context")}  # and what makes it


def merged_changes(changes: dict[str, tuple[Any, Any]]) -> dict[str, tuple[Any, Any]]:
    """The changes as one change each: an option that changed with its resolved value (lr and recipe.lr,
    heads and model.heads) under the option's name with the resolved values; a derived setting
    (tokens_per_step) not beside what it derives from."""
    resolved = {key: prefix + key for key in changes for prefix in RESOLVED_PREFIXES if prefix + key in changes}
    merged = {}
    for key, change in changes.items():
        if key in resolved.values() or any(source in changes for source in DERIVED_SETTINGS.get(key, ())):
            continue
        merged[key] = changes[resolved[key]] if key in resolved else change
    return merged


def describe_changes(changes: dict[str, tuple[Any, Any]]) -> str:
    """'lr: 0.001 -> 0.002; mixture.phases[0].weights.web: 0.8 -> 0.7': each changed leaf of a nested
    setting (a mixture's sources and weights) on its own, never a whole dict; an option and its resolved
    value once (merged_changes)."""
    leaves = [
        leaf for key, (before, after) in merged_changes(changes).items() for leaf in leaf_changes(key, before, after)
    ]
    return "; ".join(f"{name}: {shown_setting(before)} -> {shown_setting(after)}" for name, before, after in leaves)


def leaf_changes(name: str, before: Any, after: Any) -> list[tuple[str, Any, Any]]:
    """(path, before, after) of each differing leaf of two values: dicts by key, lists of one length by index."""
    if isinstance(before, dict) and isinstance(after, dict):
        return [
            change
            for key in sorted(set(before) | set(after), key=str)
            if before.get(key, UNSET) != after.get(key, UNSET)
            for change in leaf_changes(f"{name}.{key}", before.get(key, UNSET), after.get(key, UNSET))
        ]
    if isinstance(before, list) and isinstance(after, list) and len(before) == len(after):
        return [
            change
            for index, (old, new) in enumerate(zip(before, after))
            if old != new
            for change in leaf_changes(f"{name}[{index}]", old, new)
        ]
    return [(name, before, after)]


def shown_setting(value: Any, limit: int = 80) -> str:
    """A setting's value as a person reads it: a number or text as it is, anything else as compact JSON, cut."""
    text = value if isinstance(value, str) else json.dumps(value, separators=(", ", ": "), default=str)
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass(frozen=True)
class ResumeVerdict:
    extend: bool  # the run's length (total_steps) changed: train.extension decides whether it may
    others: dict  # the changes other than the length: any refuses the resume


def resume_verdict(old: dict, new: dict) -> ResumeVerdict:
    """What a resume does with the checkpoint's training settings `old` under this run's `new`.

    The same length said another way (a default of one epoch resumed with --epochs 1) is no change, nor is
    the same shape said another way (a preset's heads resumed with --heads 4 after the preset changed)."""
    changes = settings_changes(old, new)
    others = {
        key: change
        for key, change in changes.items()
        if key not in LENGTH_SETTINGS and not same_shape_said_otherwise(key, old, new)
    }
    return ResumeVerdict(extend=old.get("total_steps") != new.get("total_steps"), others=others)


def same_shape_said_otherwise(key: str, old: dict, new: dict) -> bool:
    """Whether `key` is a shape option one run gives and the other leaves to its preset (None), both with the
    same resulting shape field (model_config.RECORDED_PREFIX + key)."""
    shape = RECORDED_PREFIX + key
    return shape in old and old[shape] == new.get(shape) and None in (old.get(key), new.get(key))


def options_to_keep(
    changes: dict, flags: dict[str, str], unset: set[str], presets: dict[str, dict] | None = None
) -> list[str]:
    """The options that resume a run as its checkpoint has it where this run leaves them to a default or to
    its preset that now resolves otherwise, e.g. ['--beta1 0.9'] after a default changed, ['--heads 4'] after
    a preset's shape did ("model.heads"), ['--preset nano'] when the preset was left out. `flags`: each
    option's name -> its flag; `unset`: the options this run leaves to their default; `presets`: each
    preset's shape ({name: {field: value}}), so that a changed --preset (kept, or given and named in the
    change) does not also list the shape it gives. Settings that are no option and values that are not plain
    are left out."""
    shape = (presets or {}).get(changes["preset"][0], {}) if "preset" in changes else {}
    keep = []
    for key, (before, _) in changes.items():
        name = key.removeprefix(RECORDED_PREFIX)
        if name not in flags or name not in unset or (key != name and shape.get(name, object()) == before):
            continue
        if isinstance(before, bool):  # a tri-state option (None: the preset's): --name / --no-name
            keep.append(flags[name] if before else "--no-" + flags[name].removeprefix("--"))
        elif isinstance(before, (int, float, str)):
            keep.append(f"{flags[name]} {before}")
    return keep


def latest_checkpoint_name(out: Path) -> str | None:
    return read_json_or(out / "checkpoints" / LATEST, {}).get("path")  # named in fault messages: never raises


# ----------------------------------------------------------------------------------------------
# Reading checkpoints (torch imported here only: the rules above and the backup run without it):
# a checkpoint to resume, the weights --init-from names, and the bitwise check after a load.


def load_checkpoint_file(path: Path, what: str = "checkpoint") -> dict:
    """A train.py checkpoint of this format_version (UserError naming `what` and the file otherwise)."""
    checkpoint = load_torch_file(path, what)
    for key in ("format_version", "step", "model", "optimizer", "settings"):
        if key not in checkpoint:
            raise UserError(f"{what} {path} lacks {key!r}")
    if checkpoint["format_version"] != FORMAT_VERSION:
        raise UserError(
            f"{what} {path} has format_version {checkpoint['format_version']}, this train.py reads {FORMAT_VERSION}"
        )
    return checkpoint


def load_torch_file(path: Path, what: str) -> dict:
    """torch.load with weights_only (no code from a file), a failure one UserError naming the file."""
    import torch

    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # truncated zip, wrong format, unsafe pickle ...
        raise UserError(f"{what} {path} does not load: {type(error).__name__}: {error}") from None
    if not isinstance(checkpoint, dict):
        raise UserError(f"{what} {path} is not a train.py checkpoint")
    return checkpoint


def tensor_differences(live: Any, stored: Any, where: str) -> list[str]:
    """Names of the entries where `live` differs from `stored` (tensors bitwise, the rest by ==)."""
    import torch

    if isinstance(live, torch.Tensor) or isinstance(stored, torch.Tensor):
        same = (
            isinstance(live, torch.Tensor)
            and isinstance(stored, torch.Tensor)
            and live.dtype == stored.dtype
            and torch.equal(live.detach().cpu(), stored)
        )
        return [] if same else [where]
    if isinstance(live, dict) and isinstance(stored, dict):
        if set(live) != set(stored):
            return [f"{where} keys"]
        return [item for key in live for item in tensor_differences(live[key], stored[key], f"{where}.{key}")]
    if isinstance(live, (list, tuple)) and isinstance(stored, (list, tuple)):
        if len(live) != len(stored):
            return [f"{where} length"]
        return [
            item for i, (a, b) in enumerate(zip(live, stored)) for item in tensor_differences(a, b, f"{where}[{i}]")
        ]
    return [] if live == stored else [where]


class StagingBuffers:
    """CPU copies of a state dict, in buffers reused from one snapshot to the next.

    Copying into memory that is already mapped is several times faster than allocating it
    afresh (no page faults), and that copy is all the training loop waits for. Pinned on CUDA,
    so the device-to-host copies run asynchronously. The caller must not refill the buffers
    while a checkpoint made from them is still being written (Checkpointer.wait first).
    """

    def __init__(self):
        self.buffers: dict[str, Any] = {}  # where -> torch.Tensor

    def copy(self, obj: Any) -> Any:
        import torch

        result = self._copy(obj, "", memo={})
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the asynchronous device-to-host copies are complete
        return result

    def _copy(self, obj: Any, where: str, memo: dict) -> Any:
        import torch

        if isinstance(obj, torch.Tensor):
            key = (obj.data_ptr(), obj.dtype, tuple(obj.shape), obj.stride(), obj.device)
            if key not in memo:  # tensors shared in the model (tied embeddings) stay shared
                buffer = self.buffers.get(where)
                if buffer is None or buffer.shape != obj.shape or buffer.dtype != obj.dtype:
                    buffer = torch.empty(obj.shape, dtype=obj.dtype, pin_memory=obj.is_cuda)
                    self.buffers[where] = buffer
                buffer.copy_(obj.detach(), non_blocking=obj.is_cuda)
                memo[key] = buffer
            return memo[key]
        if isinstance(obj, dict):
            return {key: self._copy(value, f"{where}/{key}", memo) for key, value in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self._copy(value, f"{where}/{index}", memo) for index, value in enumerate(obj))
        return obj


@dataclass
class InitSource:
    """Weights to start from and where they came from (`lineage`, recorded with the run)."""

    state: dict
    lineage: dict  # {"source", "kind", "path", "sha256", "step", "corpus_manifest_sha256", "vocabulary_sha256"}
    model_settings: dict | None = None  # a checkpoint's model.* settings, for the message on a shape mismatch
    preset: str | None = None  # a checkpoint's --preset, named by that message when this run's differs


def read_init_source(spec: str) -> InitSource:
    """The weights --init-from names (UserError, naming SOURCE, when it is none of the three kinds)."""
    path = Path(spec)
    if not path.exists():
        raise UserError(f"--init-from {spec}: no such file or folder")
    if path.is_dir() and (path / "config.json").is_file():
        return read_hf_source(spec, path)
    if path.is_dir():
        folder = path / "checkpoints" if (path / "checkpoints").is_dir() else path
        listing = list_folder(folder)
        if not listing.files and (path / "model" / "config.json").is_file():
            raise UserError(
                f"--init-from {spec}: a run folder without checkpoints; start from its exported model: "
                f"--init-from {path / 'model'}"
            )
        if not listing.files:
            raise UserError(
                f"--init-from {spec}: not a checkpoint, a run folder with checkpoints/ or a Hugging "
                "Face model folder (no config.json)"
            )
        newest = newest_verified(listing)
        if newest is None:
            raise UserError(f"--init-from {spec}: no checkpoint in {folder} verifies against its sha256 record")
        return read_checkpoint_source(spec, folder / newest, "run")
    problem = file_mismatch(path)
    if problem:
        raise UserError(f"--init-from {spec}: {problem}")
    return read_checkpoint_source(spec, path, "checkpoint")


def read_checkpoint_source(spec: str, path: Path, kind: str) -> InitSource:
    checkpoint = load_torch_file(path, f"--init-from {spec}:")
    if not isinstance(checkpoint.get("model"), dict) or "training" not in checkpoint.get("settings", {}):
        raise UserError(f"--init-from {spec}: {path} is not a train.py checkpoint (no model or settings)")
    training = checkpoint["settings"]["training"]
    lineage = {
        "source": spec,
        "kind": kind,
        "path": str(path),
        "sha256": sha256_file(path),
        "step": checkpoint.get("step"),
        "corpus_manifest_sha256": training.get("corpus_manifest_sha256"),
        "vocabulary_sha256": checkpoint["settings"].get("vocabulary_sha256"),
    }
    model_settings = {
        key: value for key, value in training.items() if key.startswith(RECORDED_PREFIX) or key == "vocab_size"
    }
    return InitSource(checkpoint["model"], lineage, model_settings, training.get("preset"))


def read_hf_source(spec: str, folder: Path) -> InitSource:
    """A transformers Qwen3 folder (config.json, safetensors weights and the tokenizer)."""
    import torch
    import transformers

    try:
        config = transformers.AutoConfig.from_pretrained(folder)
    except Exception as error:
        raise UserError(f"--init-from {spec}: config.json does not load: {type(error).__name__}: {error}") from None
    if config.model_type != "qwen3":
        raise UserError(f"--init-from {spec}: a {config.model_type!r} model; tinyllm trains Qwen3 models only")
    try:
        tokenizer = corpus_format.load_tokenizer(folder)
    except UserError as error:
        raise UserError(f"--init-from {spec}: its tokenizer does not load ({error})") from None
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    except Exception as error:
        raise UserError(f"--init-from {spec}: the weights do not load: {type(error).__name__}: {error}") from None
    weights = folder / "model.safetensors"
    provenance = (
        read_json(folder / "training_provenance.json") if (folder / "training_provenance.json").is_file() else {}
    )
    lineage = {
        "source": spec,
        "kind": "huggingface",
        "path": str(folder),
        "sha256": sha256_file(weights) if weights.is_file() else sha256_tree(folder),
        "step": provenance.get("steps"),
        "corpus_manifest_sha256": provenance.get("corpus_sha256"),
        "vocabulary_sha256": corpus_format.vocabulary_sha256(tokenizer),
    }
    return InitSource(model.state_dict(), lineage)


# ----------------------------------------------------------------------------------------------
# The run folder and the checkpoint writer: --out's checks and lock, and torch.save on a background
# thread around the rules above (the record before the rename; then latest.json, backup, retention).


RUN_FOLDER_MARKERS = ("training_settings.json", "run_status.json", "checkpoints", ".lock")  # what --out may hold


def run_folder_problem(out: Path) -> str | None:
    """Why `out` cannot hold a run: a file, a corpus, or a folder of other files; None for a new or empty folder
    or a run folder (train.py's --out and checkpoint_cloud.py pull's RUN)."""
    if out.exists() and not out.is_dir():
        return "is a file, not a run folder"
    if not out.is_dir():
        return None
    if (out / CORPUS_MANIFEST).exists():
        return f"is a corpus folder ({CORPUS_MANIFEST}), not a run folder"
    if any(out.iterdir()) and not any((out / name).exists() for name in RUN_FOLDER_MARKERS):
        return (
            "holds files but is not a tinyllm run folder (no training_settings.json, run_status.json or checkpoints/)"
        )
    return None


def check_run_folder(out: Path) -> None:
    """Refuse an --out that is a corpus, a file, or a folder of other files (an empty or new folder is fine)."""
    problem = run_folder_problem(out)
    if problem:
        choose = "a new or empty" if problem.startswith("holds files") else "a new"
        raise UserError(f"--out {out} {problem}; choose {choose} --out")


def lock_run_folder(out: Path):
    """An exclusive lock on RUN/.lock (the open file; the kernel drops it when the process dies)."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        handle = open(out / ".lock", "a+", encoding="utf-8")
    except OSError as error:
        raise UserError(f"--out {out} cannot be written: {os_error_cause(error)}") from None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        pid = handle.read().strip() or "unknown"
        handle.close()
        raise UserError(f"run folder {out} is in use by another train.py (pid {pid})") from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    return handle


def release_run_folder(out: Path, lock, new: bool) -> None:
    """Close the run folder's lock; a folder this command made that holds only the lock is removed."""
    lock.close()
    if new and [path.name for path in out.iterdir()] == [".lock"]:
        with contextlib.suppress(OSError):
            (out / ".lock").unlink()
            out.rmdir()


class CheckpointWriteFailed(UserError):
    """A checkpoint could not be written (a full disk, a read-only folder): the run stops at once."""


class Checkpointer:
    """Writes checkpoints atomically on a background thread, then latest.json, backup and retention.

    One write is in flight at a time: `save` waits for the previous one, hands over the
    snapshot (already copied to CPU) and returns. Errors from the writer surface at the next
    `save` or `wait`. `backup` (optional) has submit(path, step), deletable(paths) -> paths
    and wait(timeout_s) -> bool; retention never deletes a file the backup has not let go.
    The names, records and rules are checkpoint_store's; this class adds torch.save and threads.
    """

    def __init__(
        self, folder: Path, run_id: str, keep_last: int, keep_every: int, backup=None, backup_wait_s: float = 600
    ):
        self.folder, self.run_id = folder, run_id
        self.keep_last, self.keep_every = keep_last, keep_every
        self.backup, self.backup_wait_s = backup, backup_wait_s
        self.folder.mkdir(parents=True, exist_ok=True)
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self.last_write_seconds = 0.0

    def save(self, snapshot: dict, step: int, val_loss: float | None = None) -> None:
        """Queue `snapshot` for writing as step-{step}.pt (`val_loss`: it is the run's best so far)."""
        self.wait()
        self._thread = threading.Thread(
            target=self._write, args=(snapshot, step, val_loss), name=f"checkpoint-{step}", daemon=True
        )
        self._thread.start()

    def check(self) -> None:
        """Re-raise the error of a write that has already ended (returns at once): a failed save is
        noticed at the next step, not one save later."""
        if self._thread is not None and not self._thread.is_alive():
            self.wait()

    def wait(self) -> None:
        """Block until the write in flight (if any) is on disk; re-raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def close(self, backup_wait_s: float | None = None) -> bool | None:
        """Finish the write in flight, then wait for the backup (up to `backup_wait_s`, None: the
        --backup-wait-seconds given); True/False says if it caught up."""
        self.wait()
        if self.backup is None:
            return None
        caught_up = self.backup.wait(self.backup_wait_s if backup_wait_s is None else backup_wait_s)
        self.apply_retention()  # checkpoints kept only while they waited for their upload may go now
        return caught_up

    def _write(self, snapshot: dict, step: int, val_loss: float | None) -> None:
        import torch

        name, writer = checkpoint_name(step), None
        try:
            started = time.perf_counter()
            with atomic_open(self.folder / name, "wb") as handle:
                writer = HashingWriter(handle)
                torch.save(snapshot, writer)
                handle.flush()
                record = Record(
                    path=name,
                    step=step,
                    sha256=writer.sha256(),
                    bytes=handle.tell(),
                    run_id=self.run_id,
                    created=utc_now(),
                    val_loss=val_loss,
                )
                # the record goes before the rename: a save killed in between leaves a record without
                # a checkpoint (the next session removes it), never a checkpoint nobody can verify
                write_record(self.folder, record)
            write_record(self.folder, record, LATEST)
            if self.backup is not None:
                self.backup.submit(self.folder / name, step)
            self.apply_retention()
            self.last_write_seconds = time.perf_counter() - started
        except BaseException as error:  # surfaced on the training thread at the next step (check) or save
            cause = writer.os_error if writer is not None and writer.os_error is not None else error
            if isinstance(cause, OSError) and cause.errno:
                where = cause.filename or self.folder / name
                error = CheckpointWriteFailed(f"writing checkpoint {os_error_text(cause, where)}")
            self._error = error

    def start_timeline(self, resumed_from: Path, step: int) -> None:
        """Make the checkpoint this session continues from (at `step`) the newest one of the folder
        (plan_timeline: a rewind moves the newer ones, and other runs', to abandoned-STEP/)."""
        here = resumed_from.parent.resolve() == self.folder.resolve()
        plan = plan_timeline(list_folder(self.folder), resumed_from.name if here else None, step, self.run_id)
        for message in plan.warnings:
            say(message, warning=True)
        apply_timeline(self.folder, plan)
        if plan.rewound and plan.latest is not None and self.backup is not None:
            # the remote latest.json still names the abandoned timeline: upload the resumed checkpoint
            # again now, which points it back here (a fresh disk must not restore the timeline left)
            self.backup.submit(resumed_from, step)

    def apply_retention(self) -> None:
        """Delete what retention_deletions names, once the backup (if any) lets each go
        (`backup.deletable(paths)`; checkpoint_cloud's loop deletes those the remote holds itself)."""
        listing = list_folder(self.folder)
        candidates = [
            self.folder / name for name in retention_deletions(listing, self.run_id, self.keep_last, self.keep_every)
        ]
        if self.backup is not None and candidates:
            allowed = {Path(path).resolve() for path in self.backup.deletable(candidates)}
            candidates = [path for path in candidates if path.resolve() in allowed]
        delete(self.folder, [path.name for path in candidates])


def init_mismatch(source: InitSource, model, settings: dict) -> str | None:
    """Why `source` cannot initialize `model` (this run's `settings`): the tokenizer, else the shapes."""
    spec, training = source.lineage["source"], settings["training"]
    ours = settings["vocabulary_sha256"]
    if source.lineage["vocabulary_sha256"] != ours:
        theirs = source.lineage["vocabulary_sha256"]
        return (
            f"--init-from {spec}: its tokenizer is not the corpus' (vocabulary and special tokens sha256 "
            f"{(theirs or 'not recorded')[:12]}, the corpus' {(ours or 'not recorded')[:12]}): the token ids would "
            "mean other words; build the corpus with data.py --tokenizer on the source's tokenizer"
        )
    live = model.state_dict()
    problems = [
        f"{key}: {list(source.state[key].shape)} there, {list(tensor.shape)} here"
        for key, tensor in live.items()
        if key in source.state and source.state[key].shape != tensor.shape
    ]
    problems += [f"{key}: missing there" for key in live if key not in source.state]
    problems += [f"{key}: not in this model" for key in source.state if key not in live]
    head, embedding = source.state.get("lm_head.weight"), source.state.get("model.embed_tokens.weight")
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    own_head = head is not None and embedding is not None and head.shape == embedding.shape
    if tied and own_head and not head.equal(embedding):
        # loading both into the one tied matrix would keep the head and silently drop the trained embedding
        problems.append("lm_head.weight: its own matrix there, tied to model.embed_tokens.weight here")
    if not problems:
        return None
    if source.model_settings:
        changes = settings_changes(
            source.model_settings, {key: value for key, value in training.items() if key in source.model_settings}
        )
        if changes:
            problems = [f"{key}: {theirs} there, {ours} here" for key, (theirs, ours) in changes.items()]
    if source.preset and source.preset != training.get("preset"):
        choose = (
            f"the source is --preset {source.preset}, this run {training.get('preset')}: give --preset {source.preset}"
        )
    else:
        choose = "choose the source's --preset and model options"
    return (
        f"--init-from {spec}: its shapes do not fit this run's model ({choose}): "
        + "; ".join(problems[:6])
        + (f" (and {len(problems) - 6} more)" if len(problems) > 6 else "")
    )
