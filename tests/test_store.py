"""checkpoint_store: names, records, the resume plan and retention as table tests (milliseconds, no torch),
plus the few functions that touch a folder and the Checkpointer around them."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from tinyllm.common import UserError, sha256_file
from tinyllm.store import checkpoint_store as store


def record(step: int, run_id: str = "r", size: int = 10, val_loss: float | None = None) -> store.Record:
    return store.Record(
        path=store.checkpoint_name(step),
        step=step,
        sha256=f"sha-{step}",
        bytes=size,
        run_id=run_id,
        created="2026-11-30T00:00:00Z",
        val_loss=val_loss,
    )


def listing(*entries, temporaries=(), folders=(), damaged=()) -> store.Listing:
    """A Listing from entries: a step (a file with this run's record), (step, run_id), (step, None) for a file
    without a record, (step, "broken") for one whose record does not read; `damaged` steps fail their sha256."""
    files, records = {}, {}
    for entry in entries:
        step, run_id = entry if isinstance(entry, tuple) else (entry, "r")
        name = store.checkpoint_name(step)
        files[name] = 10
        if run_id == "broken":
            records[name] = "is not valid JSON"
        elif run_id is not None:
            records[name] = record(step, run_id)
    digests = {name: "bad" if store.step_of(name) in damaged else f"sha-{store.step_of(name)}" for name in files}
    return store.Listing(
        files=files, records=records, temporaries=list(temporaries), folders=set(folders), sha256=digests.__getitem__
    )


def test_names():
    assert store.checkpoint_name(42) == "step-00000042.pt"
    assert store.record_name("step-00000042.pt") == "step-00000042.pt.json"
    for name, step in [
        ("step-00000003.pt", 3),
        ("step-3.pt", None),
        ("step-00000003.pt.corrupt", None),
        ("step-000000031.pt", None),
        ("latest.json", None),
        ("step-00000003.pt.json", None),
    ]:
        assert store.step_of(name) == step, name


@pytest.mark.parametrize(
    "size, text",
    [
        (0, "0 bytes"),
        (99_999, "99,999 bytes"),
        (100_000, "0.1 MB"),
        (1_050_000, "1.1 MB"),
        (10**12, "1,000,000.0 MB"),
    ],
)
def test_size_text(size, text):
    assert store.size_text(size) == text


@pytest.mark.parametrize(
    "change, problem",
    [
        ({}, None),
        ({"step": 4}, "^has fields of the wrong kind$"),  # the step is the file name's
        ({"bytes": "10"}, "^has fields of the wrong kind$"),
        ({"run_id": None}, "^has fields of the wrong kind$"),
        ({"sha256": None}, "^lacks sha256$"),
        ({"created": None}, "^lacks created$"),
    ],
)
def test_record_from_json(change, problem):
    obj = {**record(3).to_json(), **change}
    obj = {key: value for key, value in obj.items() if not (value is None and key in ("sha256", "created"))}
    if problem is None:
        assert store.Record.from_json(obj) == record(3)
    else:
        with pytest.raises(ValueError, match=problem):
            store.Record.from_json(obj)
    with pytest.raises(ValueError, match="^not a record$"):
        store.Record.from_json(["step-00000003.pt"])


def test_record_json_round_trip_keeps_val_loss_only_when_set():
    assert "val_loss" not in record(3).to_json()
    assert store.Record.from_json(record(3, val_loss=1.5).to_json()).val_loss == 1.5


# (listing, resume) -> (load, set_aside, deleted, warnings, error)
RESUME = [
    ("fresh folder, auto", listing(), "auto", None, [], [], [], None),
    ("fresh folder, none", listing(), "none", None, [], [], [], None),
    (
        "none with checkpoints",
        listing(2, 6, 4),
        "none",
        None,
        [],
        [],
        [],
        "already has checkpoints (step-00000006.pt); pass --resume auto to continue, or choose a new --out",
    ),
    ("the newest verifies", listing(2, 4), "auto", "step-00000004.pt", [], [], [], None),
    (
        "a damaged newest is set aside",
        listing(2, 4, damaged=[4]),
        "auto",
        "step-00000002.pt",
        ["step-00000004.pt"],
        [],
        [
            "step-00000004.pt: it does not match the sha256 in its record (corrupt): set aside as "
            "step-00000004.pt.corrupt (10 bytes; delete it once inspected)",
            "falling back to step-00000002.pt",
        ],
        None,
    ),
    (
        "a file without a record is skipped, not touched",
        listing(2, (4, None)),
        "auto",
        "step-00000002.pt",
        [],
        [],
        [
            "step-00000004.pt has no sha256 record (not written by a train.py save): skipped",
            "falling back to step-00000002.pt",
        ],
        None,
    ),
    (
        "an unreadable record is a damaged checkpoint",
        listing(2, (4, "broken")),
        "auto",
        "step-00000002.pt",
        ["step-00000004.pt"],
        [],
        [
            "step-00000004.pt: is not valid JSON: set aside as step-00000004.pt.corrupt "
            "(10 bytes; delete it once inspected)",
            "falling back to step-00000002.pt",
        ],
        None,
    ),
    (
        "nothing verifies",
        listing(2, 4, damaged=[2, 4]),
        "auto",
        None,
        ["step-00000004.pt", "step-00000002.pt"],
        [],
        None,
        "has checkpoints but none verifies against its sha256 (damaged, set aside: step-00000004.pt, "
        "step-00000002.pt); pass --resume PATH to force one, or choose a new --out",
    ),
    (
        "only record-less files",
        listing((3, None)),
        "auto",
        None,
        [],
        [],
        None,
        "has checkpoints but none verifies against its sha256; pass --resume PATH to force one, or choose a new --out",
    ),
    (
        "only damaged ones set aside earlier: never a fresh start on top",
        store.Listing({}, {}, corrupt=["step-00000003.pt"]),
        "auto",
        None,
        [],
        [],
        [],
        "none verifies against its sha256 (damaged, set aside: step-00000003.pt)",
    ),
    (
        "another run's newest is still the newest",
        listing(2, (4, "other")),
        "auto",
        "step-00000004.pt",
        [],
        [],
        [],
        None,
    ),
    (
        "a save killed mid-write: its temporary and a record of nothing go",
        listing(2, temporaries=[".step-00000004.pt.0a1b2c3d.tmp"]),
        "auto",
        "step-00000002.pt",
        [],
        [".step-00000004.pt.0a1b2c3d.tmp"],
        [],
        None,
    ),
    (
        "a restore killed mid-download leaves a temporary too",
        listing(temporaries=[".step-00000009.pt.deadbeef.tmp"]),
        "auto",
        None,
        [],
        [".step-00000009.pt.deadbeef.tmp"],
        [],
        None,
    ),
    (
        "a PATH is the caller's; the tidying still happens",
        listing(2, temporaries=[".latest.json.0a1b2c3d.tmp"]),
        "/elsewhere/step-00000001.pt",
        None,
        [],
        [".latest.json.0a1b2c3d.tmp"],
        [],
        None,
    ),
]


@pytest.mark.parametrize(
    "case, folder, resume, load, set_aside, deleted, warnings, error", RESUME, ids=[case[0] for case in RESUME]
)
def test_plan_resume(case, folder, resume, load, set_aside, deleted, warnings, error):
    plan = store.plan_resume(folder, resume)
    assert plan.load == load
    assert plan.set_aside == set_aside
    assert plan.delete == deleted
    if warnings is not None:
        assert plan.warnings == warnings
    if error is None:
        assert plan.error is None
    else:
        assert error in plan.error
        if error.startswith(("already", "has checkpoints")):
            assert plan.error == error


def test_plan_resume_deletes_records_of_checkpoints_that_are_gone():
    folder = listing(2)
    folder.records["step-00000004.pt"] = "its checkpoint is gone"  # a save killed before its rename
    plan = store.plan_resume(folder, "auto")
    assert plan.load == "step-00000002.pt" and plan.delete == ["step-00000004.pt.json"] and plan.warnings == []


# (listing, resumed, step, run_id) -> (abandoned, folder, latest step, rewound)
TIMELINE = [
    ("continuing from the newest", listing(2, 4), "step-00000004.pt", 4, "r", [], None, 4, False),
    (
        "a rewind abandons the newer ones",
        listing(2, 4, 6),
        "step-00000002.pt",
        2,
        "r",
        ["step-00000004.pt", "step-00000006.pt"],
        "abandoned-00000002",
        2,
        True,
    ),
    (
        "a second rewind to the same step gets its own folder",
        listing(2, 4),
        "step-00000002.pt",
        2,
        "r",
        ["step-00000004.pt"],
        "abandoned-00000002-2",
        2,
        True,
    ),
    (
        "newer files without records are no timeline",
        listing(2, (4, None)),
        "step-00000002.pt",
        2,
        "r",
        [],
        None,
        2,
        False,
    ),
    (
        "another run's checkpoints are no ancestors",
        listing((2, "other"), 4, (6, "other")),
        "step-00000004.pt",
        4,
        "r",
        ["step-00000002.pt", "step-00000006.pt"],
        "abandoned-00000004",
        4,
        True,
    ),
    (
        "from a file elsewhere: the folder's other run moves, latest.json waits for the next save",
        listing((2, "other")),
        None,
        3,
        "r",
        ["step-00000002.pt"],
        "abandoned-00000003",
        None,
        False,
    ),
    ("from a file elsewhere of this run", listing(2), None, 3, "r", [], None, None, False),
    (
        "from a file elsewhere at the step of another run's checkpoint here",
        listing(2, (3, "other")),
        None,
        3,
        "r",
        ["step-00000003.pt"],
        "abandoned-00000003",
        None,
        False,
    ),
    (
        "a file here whose record does not read: latest.json waits for the next save",
        listing(2, (4, "broken")),
        "step-00000004.pt",
        4,
        "r",
        [],
        None,
        None,
        False,
    ),
    ("a file here without a record", listing(2, (4, None)), "step-00000004.pt", 4, "r", [], None, None, False),
]


@pytest.mark.parametrize(
    "case, folder, resumed, step, run_id, abandoned, into, latest, rewound",
    TIMELINE,
    ids=[case[0] for case in TIMELINE],
)
def test_plan_timeline(case, folder, resumed, step, run_id, abandoned, into, latest, rewound):
    if into == "abandoned-00000002-2":
        folder.folders.add("abandoned-00000002")
    plan = store.plan_timeline(folder, resumed, step, run_id)
    assert plan.abandon == abandoned
    assert plan.folder == into
    assert (plan.latest.step if plan.latest else None) == latest
    assert plan.rewound == rewound
    assert len(plan.warnings) == (1 if abandoned else 0)
    if abandoned:
        assert plan.warnings[0].startswith(f"resuming from step {step} abandons {', '.join(abandoned)} (")
        assert plan.warnings[0].endswith(f"moved to {into}; delete that folder once you no longer need them")


@pytest.mark.parametrize(
    "folder, newest",
    [
        (listing(), None),
        (listing(2, 6, 4), "step-00000006.pt"),
        (listing(2, 4, (6, None), (8, "broken"), damaged=[4]), "step-00000002.pt"),  # never the newest unverified
        (listing(2, damaged=[2]), None),
        (listing(2, (4, "other")), "step-00000004.pt"),  # any run's: the caller asks whether anything resumes
    ],
)
def test_newest_verified(folder, newest):
    assert store.newest_verified(folder) == newest


RETENTION = [
    # steps saved, keep_last, keep_every, best step -> steps deleted
    ([1, 2, 3, 4, 5], 2, 0, None, [1, 2, 3]),
    ([1, 2, 3, 4, 5], 1, 0, None, [1, 2, 3, 4]),
    ([2, 4, 6, 8, 10, 12], 2, 4, None, [2, 6]),  # every multiple of 4 stays
    ([3, 6, 9, 12], 1, 6, None, [3, 9]),
    ([5, 10, 15], 5, 0, None, []),  # fewer than keep_last: all stay
    ([10, 9, 8, 100], 2, 0, None, [8, 9]),  # the newest by step, not by order of saving
    ([1, 2, 3, 4, 5], 1, 0, 2, [1, 3, 4]),  # the best stays
]


@pytest.mark.parametrize("steps, keep_last, keep_every, best, deleted", RETENTION)
def test_retention_deletions(steps, keep_last, keep_every, best, deleted):
    folder = listing(*steps, (7, "another run"), (11, None))  # never ours: neither counted nor deleted
    folder.records["step-00000007.pt"] = record(7, "another run", val_loss=0.5)  # nor its best ours
    for step in steps:
        folder.records[store.checkpoint_name(step)] = record(
            step, val_loss=1.0 if step == best else (2.0 + step if best else None)
        )
    assert store.retention_deletions(folder, "r", keep_last, keep_every) == [
        store.checkpoint_name(step) for step in deleted
    ]


def test_best_is_the_lowest_val_loss_of_a_present_checkpoint():
    folder = listing(1, 2, 3)
    folder.records["step-00000001.pt"] = record(1, val_loss=2.0)
    folder.records["step-00000002.pt"] = record(2, val_loss=1.0)
    folder.records["step-00000003.pt"] = record(3, run_id="other", val_loss=0.5)
    assert folder.best().step == 3 and folder.best("r").step == 2
    del folder.files["step-00000002.pt"]
    assert folder.best("r").step == 1
    assert listing(1).best() is None


# ----------------------------------------------------------------------------------------------
# The folder edge: list_folder, apply_plan, apply_timeline; and the Checkpointer on top.


def write_checkpoint(
    folder: Path, step: int, run_id: str = "r", payload: bytes | None = None, with_record: bool = True
) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / store.checkpoint_name(step)
    path.write_bytes(payload if payload is not None else f"checkpoint {step}".encode())
    if with_record:
        store.write_record(
            folder,
            store.Record(
                path=path.name,
                step=step,
                sha256=sha256_file(path),
                bytes=path.stat().st_size,
                run_id=run_id,
                created="now",
            ),
        )
    return path


def test_list_folder_reads_what_a_folder_holds(tmp_path):
    write_checkpoint(tmp_path, 1)
    write_checkpoint(tmp_path, 2, with_record=False)
    write_checkpoint(tmp_path, 3)
    (tmp_path / "step-00000003.pt.json").write_text("{broken")
    write_checkpoint(tmp_path, 4).unlink()  # its record stays
    (tmp_path / ".step-00000005.pt.0a1b2c3d.tmp").write_bytes(b"half")
    (tmp_path / "abandoned-00000001").mkdir()
    (tmp_path / "notes.txt").write_text("mine")
    found = store.list_folder(tmp_path)
    assert found.files == {"step-00000001.pt": 12, "step-00000002.pt": 12, "step-00000003.pt": 12}
    assert found.records["step-00000001.pt"].sha256 == sha256_file(tmp_path / "step-00000001.pt")
    assert "not valid JSON" in found.records["step-00000003.pt"]
    assert found.records["step-00000004.pt"] == "its checkpoint is gone"
    assert found.temporaries == [".step-00000005.pt.0a1b2c3d.tmp"] and "abandoned-00000001" in found.folders
    assert found.corrupt == []  # plain checkpoints are not set-aside ones
    (tmp_path / "step-00000000.pt.corrupt").write_bytes(b"x")
    (tmp_path / "step-00000000.pt.json.corrupt").write_bytes(b"x")
    assert store.list_folder(tmp_path).corrupt == ["step-00000000.pt"]
    assert found.mismatch("step-00000001.pt") is None
    (tmp_path / "step-00000001.pt").write_bytes(b"checkpoint 9")  # same size, other bytes: the hash tells
    assert (
        found.mismatch("step-00000001.pt") == "step-00000001.pt: it does not match the sha256 in its record (corrupt)"
    )
    assert store.list_folder(tmp_path / "missing").files == {}


def test_list_folder_reads_latest_json_or_says_why_it_does_not_read(tmp_path):
    write_checkpoint(tmp_path, 1)
    assert (store.list_folder(tmp_path).latest, store.list_folder(tmp_path).latest_error) == (None, None)
    written = store.read_record(tmp_path / "step-00000001.pt.json")
    store.write_record(tmp_path, written, name=store.LATEST)
    found = store.list_folder(tmp_path)
    assert (found.latest, found.latest_error) == (written, None)
    (tmp_path / store.LATEST).write_text('{"path": "step-00000001.pt"}')
    found = store.list_folder(tmp_path)
    assert found.latest is None
    assert (
        found.latest_error == f"checkpoint record {tmp_path / store.LATEST} lacks step, sha256, bytes, run_id, created"
    )


def test_list_folder_lists_checkpoints_set_aside(tmp_path):
    write_checkpoint(tmp_path, 3)
    store.set_aside(tmp_path, "step-00000003.pt")
    (tmp_path / "step-3.pt.corrupt").write_bytes(b"not a checkpoint name")
    found = store.list_folder(tmp_path)
    assert (found.files, found.records, found.corrupt) == ({}, {}, ["step-00000003.pt"])
    plan = store.plan_resume(found, "auto")
    assert plan.error == (
        "has checkpoints but none verifies against its sha256 (damaged, set aside: "
        "step-00000003.pt); pass --resume PATH to force one, or choose a new --out"
    )


def test_applying_a_resume_plan(tmp_path):
    write_checkpoint(tmp_path, 1)
    write_checkpoint(tmp_path, 2, payload=b"good")
    (tmp_path / "step-00000002.pt").write_bytes(b"evil")
    write_checkpoint(tmp_path, 4).unlink()
    (tmp_path / ".step-00000005.pt.0a1b2c3d.tmp").write_bytes(b"half")
    plan = store.plan_resume(store.list_folder(tmp_path), "auto")
    store.apply_plan(tmp_path, plan)
    assert plan.load == "step-00000001.pt"
    assert sorted(path.name for path in tmp_path.iterdir()) == [
        "step-00000001.pt",
        "step-00000001.pt.json",
        "step-00000002.pt.corrupt",
        "step-00000002.pt.json.corrupt",
    ]


@pytest.mark.parametrize(
    "resume, message",
    [
        ("run", "--resume {path} is a folder: name a checkpoint file (RUN/checkpoints/step-N.pt), or give the run"),
        ("run/checkpoints", "--resume {path} is a folder: name a checkpoint file"),  # was: no such checkpoint file
        ("run/checkpoints/step-00000009.pt", "--resume {path}: no such checkpoint file"),
    ],
)
def test_resume_path_that_is_no_checkpoint_file_says_what_it_is(tmp_path, resume, message):
    write_checkpoint(tmp_path / "run" / store.CHECKPOINT_DIR, 2)
    path = tmp_path / resume
    with pytest.raises(UserError) as caught:
        store.find_resume_checkpoint(tmp_path / "run", str(path))
    assert str(caught.value).startswith(message.format(path=path)) and "\n" not in str(caught.value)


@pytest.mark.parametrize(
    "checkpoint, resume, continues",
    [
        (None, "auto", False),  # no checkpoints/ yet: a fresh start
        ("verified", "auto", True),
        ("corrupt", "auto", False),  # none that verifies: plan_resume loads nothing (resume_checkpoint refuses)
        ("unrecorded", "auto", False),  # skipped: it has no record to verify against
        (None, "none", False),
        ("verified", "none", False),  # refused by resume_checkpoint, never continued
        (None, "elsewhere/step-00000010.pt", True),  # a PATH, wherever it is; resume_checkpoint checks it
        ("verified", "run/checkpoints/step-00000002.pt", True),
    ],
)
def test_a_resume_continues_a_checkpoint_with_a_path_or_auto_in_a_folder_that_holds_a_verified_one(
    tmp_path, checkpoint, resume, continues
):
    folder = tmp_path / "run" / store.CHECKPOINT_DIR
    if checkpoint is not None:
        path = write_checkpoint(folder, 2, with_record=checkpoint != "unrecorded")
        if checkpoint == "corrupt":
            path.write_bytes(b"checkpoint 9")  # same size, other bytes: its sha256 tells
    given = resume if resume in ("auto", "none") else str(tmp_path / resume)
    assert store.continues_checkpoint(tmp_path / "run", given) is continues


def test_applying_a_resume_plan_removes_folders_and_tolerates_what_is_gone(tmp_path):
    (tmp_path / ".run.0a1b2c3d.tmp").mkdir()  # a folder write killed midway (common.atomic_folder)
    (tmp_path / ".run.0a1b2c3d.tmp" / "config.json").write_text("{}")
    (tmp_path / ".latest.json.0a1b2c3d.tmp").write_text("{}")
    write_checkpoint(tmp_path, 2)
    plan = store.ResumePlan(delete=[".run.0a1b2c3d.tmp", ".latest.json.0a1b2c3d.tmp", "step-00000004.pt.json"])
    store.apply_plan(tmp_path, plan)  # step-00000004.pt.json: already gone (another process tidied first)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["step-00000002.pt", "step-00000002.pt.json"]


def test_delete_removes_checkpoints_with_their_records_whatever_is_left_of_them(tmp_path):
    for step in (1, 2, 3, 4):
        write_checkpoint(tmp_path, step)
    (tmp_path / "step-00000002.pt.json").unlink()  # a file without its record
    (tmp_path / "step-00000003.pt").unlink()  # a record without its file
    store.delete(tmp_path, ["step-00000001.pt", "step-00000002.pt", "step-00000003.pt", "step-00000009.pt"])
    assert sorted(path.name for path in tmp_path.iterdir()) == ["step-00000004.pt", "step-00000004.pt.json"]


def test_applying_a_timeline_from_a_file_elsewhere_removes_latest_json(tmp_path):
    write_checkpoint(tmp_path, 2)
    store.write_record(tmp_path, store.read_record(tmp_path / "step-00000002.pt.json"), store.LATEST)
    plan = store.plan_timeline(store.list_folder(tmp_path), None, 5, "r")
    assert plan == store.TimelinePlan()
    store.apply_timeline(tmp_path, plan)
    assert not (tmp_path / "latest.json").exists()  # the next save writes it
    store.apply_timeline(tmp_path, plan)  # none to remove: no error
    assert sorted(path.name for path in tmp_path.iterdir()) == ["step-00000002.pt", "step-00000002.pt.json"]


def test_applying_a_timeline_moves_files_with_their_records(tmp_path):
    for step in (2, 4, 6):
        write_checkpoint(tmp_path, step)
    plan = store.plan_timeline(store.list_folder(tmp_path), "step-00000002.pt", 2, "r")
    store.apply_timeline(tmp_path, plan)
    assert sorted(path.name for path in (tmp_path / "abandoned-00000002").iterdir()) == [
        "step-00000004.pt",
        "step-00000004.pt.json",
        "step-00000006.pt",
        "step-00000006.pt.json",
    ]
    assert json.loads((tmp_path / "latest.json").read_text())["path"] == "step-00000002.pt"


def test_file_mismatch_checks_a_hand_picked_file_against_its_record_if_any(tmp_path):
    path = write_checkpoint(tmp_path, 4)
    assert store.file_mismatch(path) is None
    path.write_bytes(b"checkpoint 5")
    assert store.file_mismatch(path) == "step-00000004.pt: it does not match the sha256 in its record (corrupt)"
    (tmp_path / "step-00000004.pt.json").unlink()
    assert store.file_mismatch(path) is None  # no record: nothing to check against
    other = tmp_path / "mine.pt"
    other.write_bytes(b"x")
    assert store.file_mismatch(other) is None


def test_read_record_names_the_file(tmp_path):
    path = tmp_path / "step-00000001.pt.json"
    path.write_text('{"path": "step-00000001.pt"}')
    with pytest.raises(UserError) as error:
        store.read_record(path)
    assert str(error.value) == f"checkpoint record {path} lacks step, sha256, bytes, run_id, created"
    path.write_text("{broken")
    with pytest.raises(UserError) as error:
        store.read_record(path)
    assert (
        str(error.value) == f"checkpoint record {path} is not valid JSON (line 1: Expecting property name "
        "enclosed in double quotes)"
    )
    path.unlink()
    with pytest.raises(UserError) as error:
        store.read_record(path)
    assert str(error.value) == f"checkpoint record not found: {path}"


def test_retention_without_a_backup_deletes_what_the_rules_name(tmp_path):
    for step in range(1, 7):
        write_checkpoint(tmp_path, step)
    store.Checkpointer(tmp_path, "r", keep_last=1, keep_every=2).apply_retention()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        f"step-0000000{step}.pt{suffix}" for step in (2, 4, 6) for suffix in ("", ".json")
    ]


def test_retention_deletes_only_what_the_backup_confirmed(tmp_path):
    for step in range(1, 6):
        write_checkpoint(tmp_path, step)

    class Backup:
        def deletable(self, candidates):
            return [path for path in candidates if path.name != store.checkpoint_name(2)]

    store.Checkpointer(tmp_path, "r", keep_last=1, keep_every=0, backup=Backup()).apply_retention()
    assert sorted(store.list_folder(tmp_path).files) == ["step-00000002.pt", "step-00000005.pt"]


def test_retention_asks_a_backup_with_deletable_and_only_that(tmp_path):
    for step in range(1, 6):
        write_checkpoint(tmp_path, step)
    asked = []

    class Backup:  # deletable(paths) is the whole protocol of retention
        def deletable(self, candidates):
            asked.append([path.name for path in candidates])
            return [str(path) for path in candidates if path.name != store.checkpoint_name(3)]

    store.Checkpointer(tmp_path, "r", keep_last=2, keep_every=0, backup=Backup()).apply_retention()
    assert asked == [[store.checkpoint_name(step) for step in (1, 2, 3)]]  # oldest first
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        f"step-0000000{step}.pt{suffix}" for step in (3, 4, 5) for suffix in ("", ".json")
    ]


def test_closing_waits_for_the_backup_as_long_as_asked_then_applies_retention(tmp_path):
    for step in (1, 2, 3):
        write_checkpoint(tmp_path, step)
    waits = []

    class Backup:
        confirmed = False

        def wait(self, timeout_s):
            waits.append(timeout_s)
            self.confirmed = True  # the uploads finish while close waits
            return False

        def deletable(self, candidates):
            return candidates if self.confirmed else []

    saver = store.Checkpointer(tmp_path, "r", keep_last=1, keep_every=0, backup=Backup(), backup_wait_s=2.5)
    assert saver.close() is False and waits == [2.5]
    assert sorted(store.list_folder(tmp_path).files) == ["step-00000003.pt"]  # confirmed during the wait
    assert store.Checkpointer(tmp_path / "none", "r", keep_last=1, keep_every=0).close() is None


@pytest.mark.parametrize(
    "recorded, latest, order",
    [
        ([10, 20, 30], 30, [20, 10]),  # latest.json's own is tried first, by the caller
        ([10, 20, 30, 40], 20, [10]),  # 30, 40: past latest.json, an abandoned timeline: never restored
        ([10, 20], None, [20, 10]),  # no readable latest.json: the newest recorded first
        ([], 5, []),
    ],
)
def test_restore_order(recorded, latest, order):
    assert store.restore_order(recorded, latest) == order


def test_sort_names_is_the_one_naming_rule_for_folders_and_remotes():
    names = store.sort_names(
        [
            "step-00000001.pt",
            "step-00000001.pt.json",
            "step-00000002.pt",
            "step-00000003.pt.json",
            ".step-00000004.pt.0a1b2c3d.tmp",
            "step-00000005.pt.corrupt",
            "step-00000005.pt.json.corrupt",
            "latest.json",
            "notes.txt",
            "step-6.pt",
            "abandoned-00000001",
        ]
    )
    assert names == store.Names(
        checkpoints=["step-00000001.pt", "step-00000002.pt"],
        recorded=["step-00000001.pt"],
        orphaned=["step-00000003.pt"],
        temporaries=[".step-00000004.pt.0a1b2c3d.tmp"],
        corrupt=["step-00000005.pt"],
    )
    assert store.sort_names([]) == store.Names([], [], [], [], [])


# ----------------------------------------------------------------------------------------------
# The backup's plan: what the reconcile loop does next, from the local and the remote Listing.


def mirror_listing(entries, latest=None, changed=()) -> store.Listing:
    """`entries` as in listing(); `latest`: the step latest.json names; `changed`: steps whose file has
    another sha256 than the other side's (a stale remote copy of a timeline left)."""
    side = listing(*entries)
    for step in changed:
        name = store.checkpoint_name(step)
        side.records[name] = dataclasses.replace(side.records[name], sha256="other")
    if latest is not None:
        side.latest = side.records[store.checkpoint_name(latest)]
    return side


def names(*steps) -> list[str]:
    return [store.checkpoint_name(step) for step in steps]


POLICY = store.MirrorPolicy(keep_last=1, keep_every=0, remote_keep_last=2, remote_keep_every=0, max_unbacked=2)

MIRROR = [  # case, local (entries, latest), remote (entries, latest, changed), policy, upload, delete remote,
    #        latest moves to, local deletes, of which unbacked, caught up
    ("nothing saved yet", ([], None), ([5], 5, ()), POLICY, [], [], None, [], [], False),
    ("the first save", ([10], 10), ([], None, ()), POLICY, names(10), [], None, [], [], False),
    ("uploaded: latest moves", ([10], 10), ([10], None, ()), POLICY, [], [], 10, [], [], False),
    ("in step", ([10], 10), ([10], 10, ()), POLICY, [], [], None, [], [], True),
    (
        "newest first; nothing deleted before it is there",
        ([10, 20, 30], 30),
        ([10], 10, ()),
        POLICY,
        names(30, 20),
        [],
        None,
        names(10),
        [],
        False,
    ),
    (
        "retention counts what the remote verified",
        ([30], 30),
        ([10, 20, 30], 20, ()),
        POLICY,
        [],
        names(10),
        30,
        [],
        [],
        False,
    ),
    (
        "local goes once the remote holds it",
        ([10, 20], 20),
        ([10, 20], 20, ()),
        POLICY,
        [],
        [],
        None,
        names(10),
        [],
        True,
    ),
    (
        "one the remote would not keep, once a newer one is there",
        ([10, 20, 30, 40], 40),
        ([40], 40, ()),
        POLICY,
        names(30),
        [],
        None,
        names(10, 20),
        [],
        True,
    ),
    (
        "an outage: the oldest beyond max_unbacked go",
        ([10, 20, 30, 40, 50], 50),
        ([], None, ()),
        POLICY,
        names(50, 40),
        [],
        None,
        names(10, 20),
        names(10, 20),
        False,
    ),
    (
        "every multiple of the step, on both sides",
        ([20, 30, 40], 40),
        ([10, 20, 30, 40], 40, ()),
        dataclasses.replace(POLICY, keep_every=20, remote_keep_every=20),
        [],
        names(10),
        None,
        names(30),
        [],
        True,
    ),
    (
        "another run's files are never counted nor deleted",
        ([30, 40], 40),
        ([(10, "x"), (20, "x"), 30, 40], 40, ()),
        POLICY,
        [],
        [],
        None,
        names(30),
        [],
        True,
    ),
    (
        "a rewind: latest goes back; the timeline left is neither counted nor deleted",
        ([10, 20], 20),
        ([10, 20, 30, 40], 40, ()),
        POLICY,
        [],
        [],
        20,
        names(10),
        [],
        False,
    ),
    (
        "a stale copy of a timeline left is overwritten",
        ([10, 20], 20),
        ([10, 20, 30], 30, (20,)),
        POLICY,
        names(20),
        [],
        10,
        names(10),
        [],
        False,
    ),
    (
        "what the remote latest.json names stays until it has moved",
        ([10, 20, 30], 30),
        ([10, 20, 30], 10, ()),
        POLICY,
        [],
        [],
        30,
        names(10, 20),
        [],
        False,
    ),
]


@pytest.mark.parametrize(
    "case, local, remote, policy, upload, delete_remote, latest, delete_local, unbacked, caught_up",
    MIRROR,
    ids=[row[0] for row in MIRROR],
)
def test_plan_mirror(case, local, remote, policy, upload, delete_remote, latest, delete_local, unbacked, caught_up):
    plan = store.plan_mirror(mirror_listing(*local), mirror_listing(*remote), policy)
    assert plan.upload == upload
    assert plan.delete_remote == delete_remote
    assert (plan.latest.step if plan.latest else None) == latest
    assert plan.delete_local == delete_local and plan.unbacked == unbacked
    assert plan.caught_up is caught_up
    assert plan.empty() is (not (upload or delete_remote or latest or delete_local))


@pytest.mark.parametrize("field", ["upload", "delete_remote", "latest", "delete_local"])
def test_a_mirror_plan_is_empty_only_when_it_has_nothing_to_do(field):
    assert store.MirrorPlan().empty() is True
    value = record(10) if field == "latest" else names(10)
    assert store.MirrorPlan(**{field: value}).empty() is False
    assert store.MirrorPlan(unbacked=names(10), caught_up=True).empty() is True  # facts about the plan, no work


def test_plan_mirror_keeps_the_best_on_the_remote_as_retention_does_locally():
    local = mirror_listing([30, 40], 40)
    remote = mirror_listing([10, 20, 30, 40], 40)
    remote.records[store.checkpoint_name(10)] = record(10, val_loss=1.5)
    plan = store.plan_mirror(local, remote, POLICY)
    assert plan.delete_remote == names(20)  # 10 is the best, 30 and 40 the newest two


def test_a_remote_file_that_is_not_whole_is_not_a_backup():
    remote = mirror_listing([10], None)
    remote.files[store.checkpoint_name(10)] = 3  # its record says 10 bytes: an upload cut short
    plan = store.plan_mirror(mirror_listing([10], 10), remote, POLICY)
    assert plan.upload == names(10) and plan.latest is None
    assert not store.backed_up(mirror_listing([10], 10), remote, store.checkpoint_name(10))


KEEP_LAST = "--remote-keep-recent and --keep-last must be >= 1, got {} and {}"
NOT_NEGATIVE = "--remote-keep-every, --keep-every and --backup-max-unbacked must be >= 0"


@pytest.mark.parametrize(
    "settings, problem",
    [
        ({"remote_keep_last": 0}, KEEP_LAST.format(0, 2)),
        ({"keep_last": 0}, KEEP_LAST.format(3, 0)),
        ({"remote_keep_every": -1}, NOT_NEGATIVE),
        ({"keep_every": -1}, NOT_NEGATIVE),
        ({"max_unbacked": -1}, NOT_NEGATIVE),
    ],
)
def test_a_bad_mirror_policy_is_a_user_error(settings, problem):
    with pytest.raises(UserError) as error:
        store.MirrorPolicy(**settings)
    assert str(error.value) == problem


def test_a_mirror_policy_at_its_edges_is_accepted():
    edges = store.MirrorPolicy(keep_last=1, keep_every=0, remote_keep_last=1, remote_keep_every=0, max_unbacked=0)
    assert (edges.keep_last, edges.remote_keep_last, edges.max_unbacked) == (1, 1, 0)


def test_run_status_amends_what_the_last_session_left_and_nothing_else(tmp_path):
    """`report.py evaluate` keeps model/README.md's sha256 true through RunStatus, run_status.json's one writer."""
    store.RunStatus(tmp_path).amend(model_files={"README.md": "new"})
    assert not (tmp_path / "run_status.json").exists()  # no run: nothing to amend
    store.write_status(
        tmp_path,
        "COMPLETE",
        step=10,
        model_files={"README.md": "old", "config.json": "c"},
        resume_command="python train.py --resume auto",
    )
    before = store.read_json(tmp_path / "run_status.json")
    store.RunStatus(tmp_path).amend(model_files={**before["model_files"], "README.md": "new"})
    after = store.read_json(tmp_path / "run_status.json")
    assert after == {**before, "model_files": {"README.md": "new", "config.json": "c"}, "updated": after["updated"]}
    assert list(after) == list(before)  # the same fields in the same order
