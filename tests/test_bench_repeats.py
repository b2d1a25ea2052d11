"""bench/bench_repeats.py: the shares of a text (the same held-out documents), Muennighoff's effective tokens, the
differences against the full split and the discount fitted to them."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import bench_repeats  # noqa: E402


def documents(count: int) -> list[str]:
    return [f"document {index}: " + "word " * (index % 7 + 3) for index in range(count)]


def test_a_share_keeps_every_held_out_document_and_a_random_part_of_the_train_bytes():
    texts = documents(400)
    held_out = [text for text in texts if bench_repeats.held_out(text)]
    train = [text for text in texts if not bench_repeats.held_out(text)]
    half = bench_repeats.share_documents(texts, 2)
    assert held_out and set(held_out) <= set(half)
    kept = [text for text in half if text not in held_out]
    assert abs(sum(map(len, kept)) / sum(map(len, train)) - 0.5) < 0.02
    assert kept != train[: len(kept)]  # drawn at random, not the text's first documents
    assert half == bench_repeats.share_documents(texts, 2)  # the same draw every time
    assert [text for text in texts if text in set(half)] == half  # in the text's order
    assert bench_repeats.share_documents(texts + texts[:5], 1) == texts  # duplicates once, as data.py keeps them


@pytest.mark.parametrize(
    "tokens, unique, repeats, expected",
    [
        (100.0, 200.0, 1.0, 100.0),  # within one pass: every token new
        (200.0, 200.0, 1.0, 200.0),
        (400.0, 200.0, 1.0, 200.0 * (2 - math.exp(-1))),  # a second pass worth 1 - 1/e of new text at R = 1
        (1e9, 200.0, 1.0, 400.0),  # repeats forever: at most R passes' worth more
        (400.0, 200.0, 0.0, 200.0),  # R = 0: a repeat is worth nothing
        (400.0, 200.0, 1e6, pytest.approx(400.0)),  # R large: as new
    ],
)
def test_effective_tokens(tokens, unique, repeats, expected):
    assert bench_repeats.effective_tokens(tokens, unique, repeats) == expected


def run(text: str, preset: str, share: int, seed: int, bpb: float) -> dict:
    return {
        "text": text,
        "preset": preset,
        "share": share,
        "seed": seed,
        "bpb": bpb,
        "tokens": 600_000,
        "train_tokens": 600_000 // share,
        "parameters": 98_688 if preset == "tiny" else 792_192,
    }


def test_each_repeated_run_is_against_the_full_split_of_its_own_text_preset_and_seed():
    runs = [
        run("kjv", "tiny", 1, 1337, 1.30),
        run("changelog", "tiny", 1, 1337, 1.50),
        run("kjv", "tiny", 2, 1337, 1.33),
        run("changelog", "tiny", 2, 1337, 1.56),
        run("kjv", "tiny", 2, 1338, 1.40),  # no full run of its seed: no difference
    ]
    measured = {(pair["text"], pair["seed"]): pair["measured"] for pair in bench_repeats.differences(runs)}
    assert measured == {("kjv", 1337): pytest.approx(0.03), ("changelog", 1337): pytest.approx(0.06)}


def test_the_fit_finds_the_discount_that_made_the_two_pass_differences():
    truth = 1.0
    pairs = []
    for preset in ("tiny", "nano"):
        for share in (2, 4):
            pair = run("kjv", preset, share, 1337, 0.0)
            measured = bench_repeats.predicted(pair, truth)
            pairs.append({**pair, "measured": measured if share == 2 else measured + 0.3})  # 4 passes: overfit
    repeats, error = bench_repeats.fit_repeats(pairs)
    assert repeats == pytest.approx(truth, rel=0.03) and error < 1e-3  # the four-pass runs are not fitted
