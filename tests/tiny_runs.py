"""Tiny train.py runs for the tests: a corpus written in the DESIGN.md format without data.py's builder
(`write_tiny_corpus`), the options of a run of a few seconds (`options`), train.py in a process (`run_cli`),
and what two runs are compared by (`final_state`, `assert_same_state`, `train_losses`). Used by the test
modules that train (test_train, test_checkpoints, test_faults, test_mixtures, ...): no test module imports
another."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import torch
from cards import this_cpu_precision

from tinyllm.common import atomic_write_json, sha256_file, sha256_tree
from tinyllm.data import build as data
from tinyllm.data import corpus_format
from tinyllm.store import checkpoint_store as store

ROOT = Path(__file__).resolve().parent.parent
WORDS = "the a cat dog sees runs over under big small red blue tree river stone bird sings and".split()


def write_tiny_corpus(
    folder: Path,
    documents: int = 900,
    shard_tokens: int = 4000,
    words: list[str] = WORDS,
    tokenizer_from: Path | None = None,
) -> Path:
    """A small corpus in the DESIGN.md format: BPE tokenizer, uint16 shards, corpus_manifest.json.

    `tokenizer_from`: a corpus whose tokenizer this one reuses (a mixture's sources share one)."""
    rng = random.Random(0 if words is WORDS else len(words))
    texts = []
    for _ in range(documents):
        a, b = rng.randrange(100), rng.randrange(100)
        sentence = " ".join(rng.choice(words) for _ in range(rng.randrange(4, 12)))
        texts.append(f"{a} plus {b} is {a + b}. {sentence}.")
    folder.mkdir(parents=True, exist_ok=True)
    if tokenizer_from is None:
        tokenizer, vocab_size = data.train_tokenizer(texts, 300, folder / "tokenizer")
    else:
        shutil.copytree(tokenizer_from / "tokenizer", folder / "tokenizer")
        tokenizer = corpus_format.load_tokenizer(folder / "tokenizer")
    train_end, validation_end = 800 * documents // 900, 850 * documents // 900
    splits = {"train": texts[:train_end], "validation": texts[train_end:validation_end], "test": texts[validation_end:]}
    manifest_splits = {}
    for split, docs in splits.items():
        stream, ends = [], []
        for text in docs:
            stream.extend(tokenizer.encode(text, add_special_tokens=False) + [2])
            ends.append(len(stream))
        tokens = np.asarray(stream, dtype="<u2")
        document_index = folder / f"{split}.docs"
        document_index.write_bytes(np.asarray(ends, dtype="<u8").tobytes())
        files = []
        for index, start in enumerate(range(0, len(tokens), shard_tokens)):
            path = folder / f"{split}-{index:05d}.bin"
            path.write_bytes(tokens[start : start + shard_tokens].tobytes())
            mask = path.with_suffix(".mask")  # plain text: every token is corpus_format.MASK_TEXT
            mask.write_bytes(bytes([corpus_format.MASK_TEXT]) * len(tokens[start : start + shard_tokens]))
            files.append(
                {
                    "name": path.name,
                    "bytes": path.stat().st_size,
                    "sha256": sha256_file(path),
                    "tokens": len(tokens[start : start + shard_tokens]),
                    "mask": {"name": mask.name, "bytes": mask.stat().st_size, "sha256": sha256_file(mask)},
                }
            )
        manifest_splits[split] = {
            "files": files,
            "tokens": len(tokens),
            "documents": len(docs),
            "mask_tokens": {"prompt": 0, "assistant": 0, "text": len(tokens)},
            "document_index": {
                "name": document_index.name,
                "bytes": document_index.stat().st_size,
                "sha256": sha256_file(document_index),
            },
        }
    atomic_write_json(
        folder / "corpus_manifest.json",
        {
            "format_version": corpus_format.FORMAT_VERSION,
            "dtype": "uint16",
            "vocab_size": len(tokenizer),
            "special_tokens": {"<pad>": 0, "<bos>": 1, "<eos>": 2},
            "tokenizer_sha256": sha256_tree(folder / "tokenizer"),
            "splits": manifest_splits,
            "vocabulary_sha256": corpus_format.vocabulary_sha256(corpus_format.load_tokenizer(folder / "tokenizer")),
        },
    )
    return folder


# What users' runs train in: --precision auto (fp32, or bf16 on a CPU with bf16 instructions) and bf16 (what auto
# gives on such a CPU). The tests that stand for a user's run (resume after a stop, a SIGTERM or kill -9; world size
# 2 against 1) run in each, once where they are the same; the rest pin fp32 (options), for exact arithmetic.
USER_PRECISIONS = tuple(dict.fromkeys([this_cpu_precision(), "bf16"]))


def options(corpus: Path, out: Path, *extra: str, steps: int = 12) -> list[str]:
    """A tiny, fast run: 4 blocks of 32 tokens per step, `steps` steps (the report: tests/test_demo.py). In
    fp32 on every CPU, so its losses and states are the same whatever the CPU's instructions; the tests of a
    user's run give `--precision` from USER_PRECISIONS in `extra` (the last one given wins)."""
    return [
        "--data",
        str(corpus),
        "--out",
        str(out),
        "--preset",
        "tiny",
        "--context",
        "32",
        "--batch-size",
        "2",
        "--grad-accum",
        "2",
        "--target-tokens",
        str(steps * 4 * 32),
        "--warmup-steps",
        "3",
        "--lr",
        "3e-3",
        "--final-lr-fraction",
        "0.1",
        "--eval-every",
        "4",
        "--eval-tokens",
        "256",
        "--save-every",
        "4",
        "--log-every",
        "1",
        "--threads",
        "1",
        "--peak-tflops",
        "1",
        "--keep-last",
        "10",
        "--precision",
        "fp32",
        "--no-report",
        *extra,
    ]


def run_cli(args: list[str], world: int = 1, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
    launcher = (
        [sys.executable, "train.py"]
        if world == 1
        else [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}", "train.py"]
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    result = subprocess.run(launcher + args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, **kwargs)
    if world > 1 and check and result.returncode != 0 and "error: " not in result.stderr:
        # A launch that failed outside train.py (gloo/rendezvous on a busy machine) gets one more try;
        # a real failure of train.py repeats. What went wrong is kept in the test report either way.
        clues = [
            line
            for line in result.stderr.splitlines()
            if any(word in line for word in ("terminate", "what()", "Error", "error", "Abort"))
        ][:12]
        warnings.warn(
            f"torchrun failed once, retrying:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}\n"
            "clues from the whole stderr:\n" + "\n".join(clues),
            stacklevel=2,
        )
        result = subprocess.run(
            launcher + args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, **kwargs
        )
    if check and result.returncode != 0:
        raise AssertionError(f"train.py exited {result.returncode}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result


def final_state(out: Path) -> dict:
    latest = json.loads((out / "checkpoints" / "latest.json").read_text())
    return torch.load(out / "checkpoints" / latest["path"], map_location="cpu", weights_only=True)


def assert_same_state(a: dict, b: dict) -> None:
    assert a["step"] == b["step"]
    assert store.tensor_differences(a["model"], b["model"], "model") == []
    assert store.tensor_differences(a["optimizer"], b["optimizer"], "optimizer") == []
    assert a["sampler"] == b["sampler"] and a["settings"]["training"] == b["settings"]["training"]


def train_losses(out: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}
