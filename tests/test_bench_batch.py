"""bench/bench_batch.py: a batch as train.py's micro-steps, and the table against the baseline batch."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import bench_batch  # noqa: E402

from tinyllm.common import UserError  # noqa: E402


@pytest.mark.parametrize(
    "batch, context, expected",
    [
        (4096, 256, (16, 8, 2)),  # nano: two micro-steps of train.py's 8 blocks
        (2048, 256, (8, 8, 1)),
        (1024, 256, (4, 4, 1)),  # one micro-step of the 4 blocks
        (4096, 128, (32, 8, 4)),  # tiny
    ],
)
def test_a_batch_is_whole_micro_steps_of_blocks(batch, context, expected):
    assert bench_batch.batch_split(batch, context) == expected


@pytest.mark.parametrize("batch, context", [(1000, 256), (128, 256), (3072, 256)])
def test_a_batch_that_is_no_whole_micro_steps_is_refused(batch, context):
    with pytest.raises(UserError, match="--batches"):
        bench_batch.batch_split(batch, context)


@pytest.mark.parametrize("spec", ["kjv:nano", "kjv:huge:1000", "kjv:nano:many", "kjv:nano:1:2"])
def test_a_run_that_is_not_text_preset_tokens_is_refused(spec):
    with pytest.raises(UserError, match="--runs"):
        bench_batch.run_spec(spec)
    assert bench_batch.run_spec("kjv:nano:471040") == ("kjv", "nano", 471_040)


def test_each_run_is_against_the_baseline_batch_of_its_text_preset_and_seed():
    def run(batch, seed, bpb, text="kjv"):
        return {
            "text": text,
            "preset": "nano",
            "tokens": 1000,
            "batch": batch,
            "seed": seed,
            "bpb": bpb,
            "steps": 1,
            "seconds": 9.0,
        }

    runs = [run(4096, 1, 1.2), run(2048, 1, 1.08), run(4096, 2, 1.5), run(2048, 2, 1.5), run(2048, 1, 1.0, "other")]
    rows = bench_batch.report(runs, baseline=4096)[2:]
    assert [row.split(" | ")[7] for row in rows] == ["1.0000x", "0.9000x", "1.0000x", "1.0000x", "-"]
