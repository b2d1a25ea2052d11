"""train.py's checkpoint folder over several sessions: damaged checkpoints, rewinds, leftovers of kill -9.

The rules (docs/training.md and DESIGN.md): a checkpoint found damaged is set aside as step-N.pt.corrupt; resuming
from an older checkpoint moves the newer ones to checkpoints/abandoned-STEP/; what a killed save
leaves behind is removed by the next session. Runs are the tiny preset on CPU, in-process.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from tiny_runs import assert_same_state, final_state, options, write_tiny_corpus

from tinyllm.common import UserError, atomic_write_json, sha256_file
from tinyllm.store import checkpoint_store as store
from tinyllm.training import optimization, train


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_tiny_corpus(tmp_path_factory.mktemp("corpus"))


def run_options(corpus: Path, out: Path, *extra: str) -> list[str]:
    """12 steps, a checkpoint every 2 steps, the newest 2 kept, validation (and a best) at 4, 8, 12."""
    return options(corpus, out, "--save-every", "2", "--keep-last", "2", *extra)


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("reference")
    assert train.main(run_options(corpus, out)) == 0
    return out


def step_files(folder: Path) -> list[str]:
    return sorted(path.name for path in folder.glob("step-*.pt"))


def test_a_damaged_checkpoint_is_set_aside_and_never_costs_a_good_one(corpus, reference, tmp_path, capsys, flip_byte):
    out = tmp_path / "run"
    folder = out / "checkpoints"
    assert train.main(run_options(corpus, out, "--stop-after-steps", "6")) == 0
    assert step_files(folder) == ["step-00000004.pt", "step-00000006.pt"]
    flip_byte(folder / "step-00000006.pt", 3000, 0xFF)
    # a look without the lock (--export-only) moves nothing
    assert store.find_resume_checkpoint(out, "auto").name == "step-00000004.pt"
    assert (folder / "step-00000006.pt").is_file()

    capsys.readouterr()
    assert train.main(run_options(corpus, out, "--stop-after-steps", "5")) == 0
    # the damaged 6 no longer counts as one of the newest 2: step 4, resumed from, is still there
    assert step_files(folder) == ["step-00000004.pt", "step-00000005.pt"]
    assert "set aside as step-00000006.pt.corrupt" in capsys.readouterr().err
    assert (folder / "step-00000006.pt.corrupt").is_file() and (folder / "step-00000006.pt.json.corrupt").is_file()
    assert json.loads((folder / "latest.json").read_text())["path"] == "step-00000005.pt"
    # falling back cost nothing: the run goes on from 5 and ends as the uninterrupted one
    assert train.main(run_options(corpus, out)) == 0
    assert_same_state(final_state(out), final_state(reference))

    # nothing verifies any more: one error, and never a start over on top of the damaged ones
    for path in folder.glob("step-*.pt"):
        flip_byte(path, 3000, 0xFF)
    with pytest.raises(UserError, match="none verifies against its sha256 \\(damaged, set aside: step-00000012"):
        train.main(run_options(corpus, out))
    assert step_files(folder) == []
    with pytest.raises(UserError, match="none verifies"):
        train.main(run_options(corpus, out))


def test_resuming_an_older_checkpoint_starts_a_new_timeline(corpus, reference, tmp_path, capsys):
    out = tmp_path / "run"
    folder = out / "checkpoints"
    keep = ("--keep-last", "3")
    assert train.main(run_options(corpus, out, *keep, "--stop-after-steps", "8")) == 0
    assert step_files(folder) == ["step-00000004.pt", "step-00000006.pt", "step-00000008.pt"]
    assert store.list_folder(folder).best().step == 8  # the best is a record's val_loss, not a copy

    capsys.readouterr()
    rewind = ("--resume", str(folder / "step-00000004.pt"), "--stop-after-steps", "5")
    assert train.main(run_options(corpus, out, *keep, *rewind)) == 0
    # the checkpoint chosen on purpose stays; auto, latest.json and retention see the new timeline only
    assert store.find_resume_checkpoint(out, "auto").name == "step-00000005.pt"
    assert step_files(folder) == ["step-00000004.pt", "step-00000005.pt"]
    assert json.loads((folder / "latest.json").read_text())["path"] == "step-00000005.pt"
    # the best was the abandoned step 8; step 4, resumed from, is this timeline's best (and kept by retention)
    assert store.list_folder(folder).best().step == 4
    warnings = [line for line in capsys.readouterr().err.splitlines() if "abandoned-00000004" in line]
    assert len(warnings) == 1 and "MB" in warnings[0]
    assert all(name in warnings[0] for name in ("step-00000006.pt", "step-00000008.pt"))
    assert set(os.listdir(folder / "abandoned-00000004")) == {
        "step-00000006.pt",
        "step-00000006.pt.json",
        "step-00000008.pt",
        "step-00000008.pt.json",
    }

    capsys.readouterr()
    assert train.main(run_options(corpus, out, *keep)) == 0  # the printed command: --resume auto
    assert f"resumed from {folder / 'step-00000005.pt'} at step 5/12" in capsys.readouterr().out
    assert_same_state(final_state(out), final_state(reference))
    assert store.list_folder(folder).best().step == 12


def test_a_rewind_points_the_backups_latest_at_the_resumed_checkpoint(corpus, tmp_path, capsys):
    from tinyllm.store import checkpoint_cloud, remote_store

    out, remote = tmp_path / "run", tmp_path / "remote"
    backup = ("--keep-last", "3", "--backup-to", str(remote))
    assert train.main(run_options(corpus, out, *backup, "--stop-after-steps", "8")) == 0
    listing = checkpoint_cloud.remote_listing(*remote_store.open_remote(str(remote)))
    assert listing.latest.step == 8
    # a rewind that stops before its first save: the remote must not keep naming the abandoned step 8
    rewind = ("--resume", str(out / "checkpoints" / "step-00000004.pt"), "--stop-after-steps", "4")
    assert train.main(run_options(corpus, out, *backup, *rewind)) == 0
    listing = checkpoint_cloud.remote_listing(*remote_store.open_remote(str(remote)))
    assert listing.latest.step == 4 and listing.latest.path == "step-00000004.pt"
    fresh = tmp_path / "fresh-disk"
    restored = checkpoint_cloud.restore_latest(str(remote), fresh / "checkpoints", log=lambda line: None)
    assert restored.name == "step-00000004.pt"


def test_resume_path_that_fails_its_record_is_loaded_with_a_warning(corpus, tmp_path, capsys, flip_byte):
    out = tmp_path / "run"
    assert train.main(run_options(corpus, out, "--stop-after-steps", "8")) == 0
    chosen = out / "checkpoints" / "step-00000008.pt"
    flip_byte(chosen, chosen.stat().st_size // 2, 0xFF)  # in the tensor data: it still loads
    capsys.readouterr()
    assert train.main(run_options(corpus, out, "--resume", str(chosen), "--stop-after-steps", "8")) == 0
    captured = capsys.readouterr()
    assert (
        f"warning: --resume {chosen}: step-00000008.pt: it does not match the sha256 in its record (corrupt)"
        in captured.err
    )
    # already at step 8: said on the terminal, not only in run_status.json
    assert "the run was already at step 8, at or past --stop-after-steps 8: no step taken" in captured.out


def test_resuming_another_runs_checkpoint_sets_this_folders_other_run_aside(corpus, tmp_path, capsys):
    run_a, run_b = tmp_path / "a", tmp_path / "b"
    keep = ("--keep-last", "3")
    assert train.main(run_options(corpus, run_a, *keep, "--stop-after-steps", "8")) == 0
    assert train.main(run_options(corpus, run_b, *keep, "--stop-after-steps", "8", "--seed", "7")) == 0
    capsys.readouterr()
    borrowed = ("--resume", str(run_a / "checkpoints" / "step-00000004.pt"), "--stop-after-steps", "5")
    assert train.main(run_options(corpus, run_b, *keep, *borrowed)) == 0
    # run b's own 4, 6 and 8 are no ancestors of this timeline: auto must never fall back to them
    assert step_files(run_b / "checkpoints") == ["step-00000005.pt"]
    assert {"step-00000004.pt", "step-00000006.pt", "step-00000008.pt"} <= set(
        os.listdir(run_b / "checkpoints" / "abandoned-00000004")
    )
    assert "abandoned-00000004" in capsys.readouterr().err
    assert store.find_resume_checkpoint(run_b, "auto").name == "step-00000005.pt"


def test_leftovers_of_killed_saves_are_removed_by_the_next_session(corpus, tmp_path, capsys):
    out = tmp_path / "run"
    folder = out / "checkpoints"
    keep = ("--keep-last", "10")
    assert train.main(run_options(corpus, out, *keep, "--stop-after-steps", "6")) == 0
    # a checkpoint without a record (copied in by hand): never trusted, never deleted
    (folder / "step-00000006.pt.json").unlink()
    # killed before a rename, or a retention killed between its two deletes: a record without a checkpoint
    record = json.loads((folder / "step-00000004.pt.json").read_text())
    atomic_write_json(folder / "step-00000008.pt.json", {**record, "path": "step-00000008.pt", "step": 8})
    (folder / ".step-00000010.pt.0a1b2c3d.tmp").write_bytes(b"half a checkpoint")  # a save or restore killed
    (out / ".metrics.jsonl.0a1b2c3d.tmp").write_bytes(b"half a download")  # a restore of the run files killed
    foreign = folder / "step-00000020.pt"
    torch.save({"run_id": "another-run", "step": 20}, foreign)
    (folder / "notes.txt").write_text("mine")

    capsys.readouterr()
    assert train.main(run_options(corpus, out, *keep, "--stop-after-steps", "7")) == 0
    captured = capsys.readouterr()
    assert f"resumed from {folder / 'step-00000004.pt'}" in captured.out
    assert not (folder / "step-00000008.pt.json").exists() and not list(folder.glob(".*.tmp"))
    assert not list(out.glob(".*.tmp"))
    removed = [line for line in (captured.out + captured.err).splitlines() if "removed" in line]
    assert len(removed) == 1
    assert all(name in removed[0] for name in ("step-00000008.pt.json", ".step-00000010.pt.0a1b2c3d.tmp"))
    assert "step-00000020.pt has no sha256 record (not written by a train.py save): skipped" in captured.err
    assert foreign.is_file() and (folder / "notes.txt").is_file()
    # the run went on from step 4 and wrote its own 6 (with its record) and 7
    assert step_files(folder) == [
        "step-00000002.pt",
        "step-00000004.pt",
        "step-00000006.pt",
        "step-00000007.pt",
        "step-00000020.pt",
    ]
    assert (folder / "step-00000006.pt.json").is_file()


def test_a_save_killed_before_its_rename_leaves_only_its_record(tmp_path, monkeypatch):
    folder = tmp_path / "checkpoints"
    saver = store.Checkpointer(folder, run_id="r", keep_last=2, keep_every=0)
    saver.save({"run_id": "r", "step": 1}, 1)
    saver.wait()
    replace = os.replace

    def killed_at_the_rename(source, target):
        if str(target).endswith("step-00000002.pt"):
            raise KeyboardInterrupt
        replace(source, target)

    monkeypatch.setattr(os, "replace", killed_at_the_rename)
    saver.save({"run_id": "r", "step": 2}, 2)
    with pytest.raises(KeyboardInterrupt):
        saver.wait()
    monkeypatch.setattr(os, "replace", replace)
    # the record came first, so no checkpoint exists that nobody can verify
    assert step_files(folder) == ["step-00000001.pt"] and (folder / "step-00000002.pt.json").is_file()
    assert store.tidy_and_find_resume_checkpoint(tmp_path, "auto").name == "step-00000001.pt"
    assert sorted(path.name for path in folder.iterdir()) == [
        "latest.json",
        "step-00000001.pt",
        "step-00000001.pt.json",
    ]


def test_retention_counts_only_this_runs_checkpoints(tmp_path):
    foreign = tmp_path / "step-00000009.pt"  # no record of this run: neither deleted nor one of the kept
    shutil.copyfile(__file__, foreign)
    saver = store.Checkpointer(tmp_path, run_id="r", keep_last=2, keep_every=0)
    for step in range(1, 5):
        saver.save({"step": step}, step)
    saver.wait()
    assert step_files(tmp_path) == ["step-00000003.pt", "step-00000004.pt", "step-00000009.pt"]


def test_the_same_command_after_the_run_completed_says_so(corpus, reference, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    before = step_files(out / "checkpoints")
    capsys.readouterr()
    assert train.main(run_options(corpus, out)) == 0
    printed = "".join(capsys.readouterr())
    assert "the run was already complete at step 12/12: no step taken" in printed
    assert f"a longer run: a new --out with --init-from {out}, or --resume PATH of a checkpoint at step" in printed
    assert "COMPLETE: step 12/12" in printed and step_files(out / "checkpoints") == before


@pytest.mark.parametrize(
    "schedule, budget, words",
    [
        (
            "wsd",
            None,
            "a longer run: a new --out with --init-from RUN, or --resume PATH of a checkpoint at step 60 or before"
            " (its decay's start) with a larger --target-tokens or --epochs",
        ),
        ("cosine", None, "a longer run: a new --out with --init-from RUN"),  # every step's rate depends on the length
        ("wsd", "90s", "a longer run: a new --out with --init-from RUN"),  # a --budget run keeps its plan's length
    ],
)
def test_a_complete_run_says_how_it_is_made_longer(schedule, budget, words):
    """The completed run's last checkpoint has decayed: a larger --target-tokens from it is refused, so the
    line names what works (it used to say "a larger --target-tokens or --epochs")."""
    recipe, _ = optimization.choose_recipe(optimization.RecipeOptions(schedule=schedule), 128, 100)
    assert train.longer_run_words(recipe, budget, "RUN") == words


def test_the_same_command_after_an_evaluation_keeps_the_card_s_scores_of_these_weights(corpus, tmp_path):
    """`report.py evaluate` wrote RUN/eval/*.json and the card's scores; the model exported again from the same
    weights keeps them (run_status.json's card hash with it), scores of other weights are not carried."""
    out = tmp_path / "run"
    command = options(corpus, out, "--report", steps=4)
    assert train.main(command) == 0
    weights = sha256_file(out / "model" / "model.safetensors")
    scores = {"exact_match": 0.75, "n": 4, "kind": "exact", "source": "tasks.jsonl"}
    result = {"format_version": 1, "model": str(out / "model"), "run": str(out), "harness": {"limit": None}}
    for name, digest, time in (("arith", weights, "2026-12-05T21:00:00Z"), ("older", weights, "2026-12-05T20:00:00Z")):
        atomic_write_json(
            out / "eval" / f"{name}.json",
            {**result, "time": time, "model_sha256": digest, "task": name, "scores": scores},
        )
    atomic_write_json(
        out / "eval" / "other.json",
        {**result, "time": "2026-12-05T22:00:00Z", "model_sha256": "0" * 64, "task": "other", "scores": scores},
    )
    assert train.main(command) == 0
    card = (out / "model" / "README.md").read_text()
    assert "## Benchmark scores" in card and "| arith | exact | 4 | - | - | 0.7500 |" in card
    assert "| older |" not in card and "| other |" not in card  # an earlier evaluation; other weights
    status = json.loads((out / "run_status.json").read_text())
    assert status["model_files"]["README.md"] == sha256_file(out / "model" / "README.md")
