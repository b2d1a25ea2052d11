"""bench/bench_elementwise_quality.py: its two arms run different elementwise code, and a tiny run of the whole
script (a synthetic corpus, one seed, three steps per arm) ends in a table that parses."""

from __future__ import annotations

import json
import random
import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import bench_elementwise_quality as bench  # noqa: E402

from tinyllm.model import config as model_config  # noqa: E402


@pytest.mark.parametrize("arm, dtype", [("before", "float32"), ("after", "bfloat16")])
def test_under_bf16_autocast_the_before_arm_keeps_the_stock_fp32_norms_and_rope(monkeypatch, arm, dtype):
    monkeypatch.setattr(model_config, "autocast_elementwise", model_config.autocast_elementwise)  # restored after
    if arm == "before":
        bench.disable_autocast_elementwise()
    model = model_config.build_training_model(model_config.PRESETS["tiny"], 256, {}, "cpu", False)
    probe = bench.probe_elementwise(model, torch.bfloat16)
    assert (probe["norm_dtype"], probe["q_norm_dtype"], probe["rope_dtype"]) == (dtype, dtype, dtype)
    assert probe["norm_class"] == ("Qwen3RMSNorm" if arm == "before" else "AutocastQwen3RMSNorm")


def synthetic_documents(path: Path, documents: int = 300) -> Path:
    rng = random.Random(0)
    words = ["".join(rng.choice("etaoinshrdlu") for _ in range(rng.randint(2, 7))) for _ in range(200)]
    with open(path, "w", encoding="utf-8") as handle:
        for _ in range(documents):
            handle.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(5, 80)))}) + "\n")
    return path


def test_a_tiny_run_trains_both_arms_and_its_table_parses(tmp_path, capsys):
    source = synthetic_documents(tmp_path / "synthetic.jsonl")
    assert (
        bench.main(
            [
                "--work",
                str(tmp_path / "work"),
                "--corpus",
                f"synthetic={source}",
                "--texts",
                "synthetic",
                "--seeds",
                "7",
                "--preset",
                "tiny",
                "--context",
                "32",
                "--batch-size",
                "4",
                "--steps",
                "3",
                "--vocab-size",
                "300",
                "--jobs",
                "1",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    results = json.loads((tmp_path / "work" / "results.json").read_text())
    runs = results["texts"]["synthetic"]["runs"]
    assert {name: run["probe"]["norm_dtype"] for name, run in runs.items()} == {
        "7-before": "float32",
        "7-after": "bfloat16",
    }
    assert all(run["step"] == 3 and run["tokens"] == 3 * 4 * 32 for run in runs.values())
    assert all(run["final_line"].lower().startswith("complete: step 3/3") for run in runs.values())
    row = re.search(
        r"^\| synthetic \| 7 \| 384 \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| (yes|NO) \| ([\d.]+|-) \| "
        r"\S+, \S+ \|$",
        out,
        re.MULTILINE,
    )
    assert row, out
    before, after, ratio = (float(value) for value in row.groups()[:3])
    assert before == pytest.approx(runs["7-before"]["test_bits_per_byte"], abs=1e-4)
    assert after == pytest.approx(runs["7-after"]["test_bits_per_byte"], abs=1e-4)
    assert ratio == pytest.approx(after / before, abs=2e-4)
    assert "target: after/before within 0.5% in every row:" in out
    assert "before: Qwen3RMSNorm, norm out float32" in out and "after: AutocastQwen3RMSNorm, norm out bfloat16" in out
