"""bench/bench_rescore.py: a finished run scored again over every held-out block, as train.py scored it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from tiny_runs import options, write_tiny_corpus

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import bench_rescore  # noqa: E402

from tinyllm.model import config as model_config  # noqa: E402
from tinyllm.training import train  # noqa: E402


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_tiny_corpus(tmp_path_factory.mktemp("corpus"))


def test_a_run_that_scored_every_block_is_scored_the_same_and_one_that_scored_some_is_not(corpus, tmp_path):
    every, some = tmp_path / "every", tmp_path / "some"
    assert train.main(options(corpus, every, "--eval-tokens", str(10**9), "--layers", "3", "--no-tie-embeddings")) == 0
    assert train.main(options(corpus, some, "--layers", "3", "--no-tie-embeddings")) == 0  # --eval-tokens 256
    scored = {run: json.loads((run / "run_status.json").read_text())["test"] for run in (every, some)}
    again = {run: bench_rescore.rescore(corpus, run, tmp_path / "scratch") for run in (every, some)}
    assert again[every]["test"] == pytest.approx(scored[every]["bits_per_byte"], rel=1e-6)
    assert again[every]["test_tokens"] == scored[every]["tokens"] > scored[some]["tokens"]
    assert again[some]["test"] == pytest.approx(again[every]["test"], rel=1e-6)  # the same weights (same seed)
    assert again[some]["test"] != pytest.approx(scored[some]["bits_per_byte"], rel=1e-6)  # over 8 blocks: other


def test_the_options_restate_the_recorded_shape_and_precision():
    shape = model_config.recorded_shape(model_config.resolve_preset("nano", layers=3))  # every field, as runs record
    recorded = {
        "training": {"preset": "nano", "packing": "masked", "loss_on": "all", "text_loss": None, **shape},
        "runtime": {"precision": "fp32"},
    }
    options = bench_rescore.run_options(recorded)
    settings = train.parse_args(["--data", "C", "--out", "R", *options])
    assert settings.run.layers == 3 and settings.run.hidden == 128 and settings.run.tie_embeddings is False
    assert settings.session.precision == "fp32" and settings.run.packing == "masked"
