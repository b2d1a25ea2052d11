"""notebooks/kaggle_t4x2.ipynb, executed as a person's "Run all" would be (papermill, CPU, tiny parameters).

Two sessions: the first builds the demo corpus, keeps it in the store and stops resumably with the
checkpoint backed up; the second starts on an empty working folder, restores from the backup,
finishes, exports the GGUF and publishes. Every cell runs the scripts' documented commands, so the
README's Kaggle flow breaking fails this test.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "notebooks" / "kaggle_t4x2.ipynb"
STEPS, TOKENS_PER_STEP = 16, 4 * 64


def run_notebook(work: Path, store: Path, output: Path, train_args: str) -> str:
    """Execute the notebook with tiny parameters; returns the text its cells printed."""
    papermill = pytest.importorskip("papermill")
    nbformat = pytest.importorskip("nbformat")
    parameters = {
        "WORK": str(work),
        "TINYLLM": str(ROOT),
        "INSTALL": False,
        "DATA": "demo",
        "CORPUS_URL": str(store / "corpus"),
        "BACKUP_TO": str(store / "run"),
        "RUN": "runs/demo",
        "PRESET": "tiny",
        "GPUS": 1,
        "MAX_HOURS": 1.0,
        "LOG_TO": "tensorboard",
        "SECRETS": [],
        "GGUF_TYPE": "q8_0",
        "PUBLISH_TO": str(store / "published"),
        "TRAIN_ARGS": f"--context 64 --batch-size 4 --grad-accum 1 --target-tokens {STEPS * TOKENS_PER_STEP} "
        f"--eval-every 8 --save-every 8 --log-every 4 --eval-tokens 256 --threads 1 {train_args}",
    }
    papermill.execute_notebook(
        str(NOTEBOOK), str(output), parameters=parameters, kernel_name="python3", progress_bar=False, cwd=str(ROOT)
    )
    cells = nbformat.read(output, as_version=4).cells
    return "\n".join(out.get("text", "") for cell in cells if cell.cell_type == "code" for out in cell.outputs)


def test_the_parameters_are_one_tagged_cell():
    nbformat = pytest.importorskip("nbformat")
    cells = nbformat.read(NOTEBOOK, as_version=4).cells
    tagged = [index for index, cell in enumerate(cells) if "parameters" in cell.metadata.get("tags", [])]
    assert len(tagged) == 1 and cells[tagged[0]].source.startswith("# Parameters")
    assert all(not cell.outputs for cell in cells if cell.cell_type == "code")  # committed without outputs
    papermill = pytest.importorskip("papermill")
    assert list(papermill.inspect_notebook(str(NOTEBOOK))) == [  # each one parses, so `-p NAME VALUE` reaches it
        "WORK",
        "TINYLLM",
        "INSTALL",
        "DATA",
        "VOCAB_SIZE",
        "VAL_FRACTION",
        "SOURCE_LABEL",
        "CORPUS_URL",
        "BACKUP_TO",
        "RUN",
        "PRESET",
        "GPUS",
        "MAX_HOURS",
        "TRAIN_ARGS",
        "LOG_TO",
        "SECRETS",
        "GGUF_TYPE",
        "PUBLISH_TO",
    ]


def test_a_store_without_credentials_stops_run_all_with_one_error_line(tmp_path, monkeypatch):
    """The notebook's own check of CORPUS_URL, with a placeholder bucket and no credentials (a first try on
    Kaggle before the secrets are attached): one `error:` line, not botocore's NoCredentialsError traceback.
    Its install cell found the torch present new enough and kept it; its data options are sized to the data."""
    papermill = pytest.importorskip("papermill")
    pytest.importorskip("s3fs")
    for name in [name for name in os.environ if name.startswith("AWS_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no credentials from an instance either
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing would be reached
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "a.txt").write_text("A few words of a very small corpus. " * 100)
    parameters = {
        "WORK": str(tmp_path / "work"),
        "TINYLLM": str(ROOT),
        "INSTALL": False,
        "DATA": str(texts),
        "CORPUS_URL": "s3://my-bucket/corpora/mine",
        "SECRETS": [],
    }
    with pytest.raises(papermill.PapermillExecutionError) as error:
        papermill.execute_notebook(
            str(NOTEBOOK),
            str(tmp_path / "out.ipynb"),
            parameters=parameters,
            kernel_name="python3",
            progress_bar=False,
            cwd=str(ROOT),
        )
    assert [line for line in error.value.traceback if line.strip()] == [
        "error: looking for a corpus at s3://my-bucket/corpora/mine failed (NoCredentialsError); check the URL, "
        "the network and the credentials"
    ]
    import nbformat

    printed = "\n".join(
        out.get("text", "")
        for cell in nbformat.read(tmp_path / "out.ipynb", as_version=4).cells
        if cell.cell_type == "code"
        for out in cell.outputs
    )
    from importlib.metadata import version

    # what the cell reads without importing torch: PyPI's CUDA wheels say 2.10.0 there, 2.10.0+cu128 in __version__
    assert f"torch {version('torch')} is kept" in printed
    assert (
        "data options: --vocab-size 512 --val-fraction 0.05 --test-fraction 0.05 --source-label none (sized to "
        "3,600 bytes of input, for think72)" in printed
    )


@pytest.mark.slow
def test_two_sessions_of_run_all_train_resume_from_the_backup_and_publish(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    store = tmp_path / "store"
    store.mkdir()
    first = run_notebook(tmp_path / "session1", store, tmp_path / "session1.ipynb", f"--stop-after-steps {STEPS // 2}")
    run = tmp_path / "session1" / "runs" / "demo"
    assert json.loads((run / "run_status.json").read_text())["status"] == "CHECKPOINTED_NEEDS_RESUME"
    assert "run this notebook again" in first and "corpus ready" in first
    assert "data options: --vocab-size 512 --val-fraction 0.05 --test-fraction 0.05 (the demo's)" in first
    assert (store / "corpus" / "corpus_manifest.json").is_file() and (store / "run" / "checkpoints").is_dir()
    assert not (run / "model-q8_0.gguf").exists()  # the end's cells wait for the run to complete

    second = run_notebook(tmp_path / "session2", store, tmp_path / "session2.ipynb", "")  # an empty folder
    run = tmp_path / "session2" / "runs" / "demo"
    assert "the corpus is in the store" in second and "corpus ready" not in second
    assert "resumed from runs/demo/checkpoints/step-00000008.pt" in second
    assert "events.out.tfevents.tinyllm restored into runs/demo" in second
    status = json.loads((run / "run_status.json").read_text())
    assert (status["status"], status["step"]) == ("COMPLETE", STEPS) and status["test"]["bits_per_byte"] > 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 4, 8, 12, 16]  # session 1 restored too
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run))
    events.Reload()
    assert [event.step for event in events.Scalars("train/loss")] == [1, 4, 8, 12, 16]
    published = {path.name for path in (store / "published").iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "README.md",
        "model-q8_0.gguf",
        "training_settings.json",
        "loss_curve.png",
    } <= published
    assert (store / "published" / "model-q8_0.gguf").read_bytes() == (run / "model-q8_0.gguf").read_bytes()
    assert "Test loss: " in (store / "published" / "README.md").read_text()
