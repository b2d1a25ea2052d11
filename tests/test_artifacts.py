"""artifacts.py: the end of a run as artifacts, each one observer that declares the run files it writes, and the
one list of them that the run, --export-only and publishing read. A tiny untrained model and a corpus folder of
a tokenizer and an eval/ task: what each artifact writes, returns and records when it fails.

The whole run with them (train.py's end, --export-only) is in tests/test_train.py and tests/test_demo.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tinyllm.data import build as data
from tinyllm.model import config as model_config
from tinyllm.model import generation
from tinyllm.outputs import artifacts, callbacks, metrics_log, publishing
from tinyllm.store import checkpoint_store as store

SETTINGS = {"training": {"corpus_manifest_sha256": "c0" * 32, "tokenizer_sha256": "70" * 32}}
WORDS = ["What is 1 plus 2?", "3", "What is 2 plus 2?", "4", "the cat sat on the mat"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model, corpus): the tiny preset untrained, and a corpus folder holding a tokenizer and an eval/ task."""
    corpus = tmp_path_factory.mktemp("artifacts") / "corpus"
    tokenizer, _ = data.train_tokenizer([" ".join(WORDS)] * 20, 300, corpus / "tokenizer")
    (corpus / "eval").mkdir()
    (corpus / "eval" / "addition.jsonl").write_text(
        "".join(
            json.dumps({"prompt": f"What is {a} plus 2?", "answer": str(a + 2), "task": "addition"}) + "\n"
            for a in (1, 2)
        )
    )
    torch.manual_seed(0)
    return model_config.build_model(model_config.PRESETS["tiny"], len(tokenizer)).eval(), corpus


def run_folder(tmp_path: Path) -> tuple[Path, metrics_log.MetricsLog]:
    out = tmp_path / "run"
    out.mkdir()
    metrics = metrics_log.MetricsLog(out / "metrics.jsonl", True)
    for step in (1, 2, 3, 4):
        metrics.write("train", step=step, tokens=100 * step, loss=5.0 - step)
    return out, metrics


def end_of(tiny, out: Path, metrics, status: str = store.COMPLETE, corpus: Path | None = None) -> dict:
    model, tiny_corpus = tiny
    facts = artifacts.RunFacts(out, corpus or tiny_corpus, "tiny", SETTINGS, generation.GREEDY, "cpu")
    end = callbacks.RunEnd(
        status, 4, 4 if status == store.COMPLETE else 8, 400, {"step": 4, "loss": 1.5, "perplexity": 4.48}, None
    )
    return callbacks.Callbacks(artifacts.end_of_run(model, facts, metrics)).on_end(end)


def test_a_complete_run_makes_every_artifact_and_the_card_carries_what_came_before(tiny, tmp_path, capsys):
    out, metrics = run_folder(tmp_path)
    found = end_of(tiny, out, metrics)
    assert found["report_errors"] is None
    assert set(found) == {"task_accuracy", "model_files", "model_dir", "report_errors"}
    for artifact in artifacts.ARTIFACTS:
        for file in artifact.files:
            assert (out / file.name).exists(), (artifact.__name__, file.name)
    assert found["task_accuracy"]["total"] == 2 and "held-out task accuracy: " in capsys.readouterr().out
    card = (out / "model" / "README.md").read_text()
    assert "Status: **COMPLETE**" in card and "Held-out demo task accuracy (greedy, chat template): " in card
    assert found["model_dir"] == str(out / "model") and "model.safetensors" in found["model_files"]
    written = json.loads((out / "sample_generations.json").read_text())
    assert written["step"] == 4 and [sample["prompt"] for sample in written["samples"]] == generation.DEFAULT_PROMPTS
    record = [r for r in metrics_log.read_metrics(out / "metrics.jsonl") if r["kind"] == "samples"]
    assert [row["prompt"] for row in record[0]["samples"]] == generation.DEFAULT_PROMPTS  # the same, not read back


def test_a_resumable_stop_draws_the_curve_and_exports_but_neither_samples_nor_scores(tiny, tmp_path):
    out, metrics = run_folder(tmp_path)
    found = end_of(tiny, out, metrics, store.NEEDS_RESUME)
    assert set(found) == {"model_files", "model_dir", "report_errors"} and found["report_errors"] is None
    assert (out / "loss_curve.png").is_file() and not (out / "sample_generations.json").exists()
    card = (out / "model" / "README.md").read_text()
    assert "CHECKPOINTED_NEEDS_RESUME" in card and "Held-out demo task accuracy" not in card
    assert not [r for r in metrics_log.read_metrics(out / "metrics.jsonl") if r["kind"] == "samples"]


def test_a_failure_is_recorded_under_its_name_and_the_other_artifacts_are_still_made(
    tiny, tmp_path, monkeypatch, capsys
):
    def broken(*args, **kwargs):
        raise RuntimeError("no canvas")

    out, metrics = run_folder(tmp_path)
    monkeypatch.setattr(metrics_log, "plot_loss_curve", broken)
    found = end_of(tiny, out, metrics, store.NEEDS_RESUME)
    assert found["report_errors"] == {"loss_curve": "RuntimeError: no canvas"} and found["model_files"]
    assert "loss_curve failed (RuntimeError: no canvas); the checkpoints are intact" in capsys.readouterr().err


def test_a_tokenizer_that_does_not_load_is_reported_once_and_only_the_curve_is_made(tiny, tmp_path):
    out, metrics = run_folder(tmp_path)
    found = end_of(tiny, out, metrics, corpus=tmp_path / "no-corpus")
    assert list(found["report_errors"]) == ["tokenizer"] and "does not exist" in found["report_errors"]["tokenizer"]
    assert set(found) == {"report_errors"}
    assert (out / "loss_curve.png").is_file() and not (out / "model").exists()


def test_the_curve_is_redrawn_after_each_evaluation_and_a_failure_is_a_warning_line(tiny, tmp_path, monkeypatch):
    out, metrics = run_folder(tmp_path)
    lines = []
    progress = type("Progress", (), {"write": lambda self, message: lines.append(message)})()
    facts = artifacts.RunFacts(out, tiny[1], "tiny", SETTINGS, generation.GREEDY, "cpu")
    curve = next(
        item
        for item in artifacts.end_of_run(tiny[0], facts, metrics, progress)
        if isinstance(item, artifacts.LossCurve)
    )
    curve.on_evaluated(4, [callbacks.Measured("validation")])
    assert (out / "loss_curve.png").is_file() and lines == []
    monkeypatch.setattr(metrics_log, "plot_loss_curve", lambda *args, **kwargs: 1 / 0)
    curve.on_evaluated(8, [callbacks.Measured("validation")])
    assert lines == ["warning: loss_curve.png not drawn (ZeroDivisionError: division by zero)"]


def test_one_list_says_what_each_artifact_writes_and_what_is_published():
    names = [file.name for artifact in artifacts.ARTIFACTS for file in artifact.files]
    assert names == ["loss_curve.png", "sample_generations.json", "model"] and len(set(names)) == len(names)
    assert artifacts.published_files() == ("loss_curve.png",)
    assert publishing.PUBLISHED_RUN_FILES == ("training_settings.json", *artifacts.published_files())
    assert not set(names) & set(store.RUN_FILES)  # made again from the checkpoint and the history: not backed up


def test_a_new_artifact_is_one_class_in_the_list(tiny, tmp_path, monkeypatch):
    class Extra(artifacts.Artifact):
        name = "extra"
        files = (artifacts.RunFile("extra.json", published=True),)

        def make(self, end):
            self.path().write_text(json.dumps({"step": end.step}))
            return {"extra": end.step}

    monkeypatch.setattr(artifacts, "ARTIFACTS", (*artifacts.ARTIFACTS, Extra))
    out, metrics = run_folder(tmp_path)
    found = end_of(tiny, out, metrics, store.NEEDS_RESUME)
    assert found["extra"] == 4 and json.loads((out / "extra.json").read_text()) == {"step": 4}
    assert artifacts.published_files() == ("loss_curve.png", "extra.json")

    monkeypatch.setattr(Extra, "make", lambda self, end: {}[end.step])  # a fault in an artifact: recorded, not raised
    found = end_of(tiny, out, metrics, store.NEEDS_RESUME)
    assert found["report_errors"] == {"extra": "KeyError: 4"} and found["model_files"]
