"""The core rules as pure functions, tested by value: data order, splits, shard hashing, the loss,
record verification, retention, answer scoring, the in-loop task scoring.

These are the fast unit tests that mutation testing runs for every mutant (bench/mutation.sh):
each assertion checks a value that a wrong implementation gets wrong.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import pickle
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tinyllm.common import UserError, sha256_file
from tinyllm.data import build as data
from tinyllm.data import corpus_format
from tinyllm.model import losses
from tinyllm.outputs import callbacks, evaluation, report
from tinyllm.store import checkpoint_store as store
from tinyllm.training import optimization, train, train_data

# each test here takes well under a second: a loop that never ends (a permutation that is not a
# bijection cycle-walks forever) fails by name within seconds
pytestmark = pytest.mark.timeout(20)

# ----------------------------------------------------------------------------------------------
# Splits and document hashing (data.py)


@pytest.mark.parametrize(
    "position, expected",
    [
        (0.0, "validation"),
        (0.0499, "validation"),  # [0, val)
        (0.05, "test"),
        (0.0599, "test"),  # [val, val + test)
        (0.0601, "train"),
        (0.5, "train"),
        (0.999999, "train"),
    ],
)
def test_split_of_unequal_fractions(position, expected):
    """--val-fraction 0.05 --test-fraction 0.01: 5% validation, 1% test (unequal, so a swap shows)."""
    assert data.split_of(position, 0.05, 0.01) == expected


@pytest.mark.parametrize(
    "val, test, position, expected",
    [
        (0.0, 0.0, 0.0, "train"),  # no held-out splits: everything trains
        (0.0, 0.1, 0.0, "test"),
        (0.0, 0.1, 0.1, "train"),
        (0.1, 0.0, 0.0999, "validation"),
        (0.1, 0.0, 0.1, "train"),
    ],
)
def test_split_of_empty_splits(val, test, position, expected):
    assert data.split_of(position, val, test) == expected


def test_split_fractions_hold_over_many_documents():
    counts = {"train": 0, "validation": 0, "test": 0}
    for index in range(20_000):
        _, position = data.document_hash(f"document number {index}")
        counts[data.split_of(position, 0.05, 0.01)] += 1
    assert 900 <= counts["validation"] <= 1100  # 5% of 20,000 = 1,000
    assert 150 <= counts["test"] <= 250  # 1% = 200


def test_document_hash_is_blake2b_key_and_position():
    """DESIGN.md: the de-duplication key and the split position come from the text alone."""
    digest = hashlib.blake2b(b"hello", digest_size=16).digest()
    key, position = data.document_hash("hello")
    assert key == int.from_bytes(digest[:8], "little")
    assert position == int.from_bytes(digest[8:], "little") / 2.0**64
    positions = [data.document_hash(str(index))[1] for index in range(2000)]
    assert all(0 <= value < 1 for value in positions)
    assert 0.45 < sum(positions) / len(positions) < 0.55  # uniform: a mean near 1/2
    assert data.document_hash("hello") != data.document_hash("hello ")


# bytes of input and the preset the corpus is for -> data.py's defaults for the options not given (the notebook
# shows the same)
@pytest.mark.parametrize(
    "size, preset, vocab_size, fraction",
    [
        (None, None, 33_069, 0.01),  # not known (a Hub dataset): a large corpus's
        (None, "micro", 33_069, 0.01),
        (0, None, 512, 0.05),
        (999_999, None, 512, 0.05),
        (999_999, "micro", 512, 0.05),  # under 1 MB: not measured for micro
        (1_000_000, None, 8_192, 0.05),  # bench/bench_vocab.py's optimum at ~4 MB (docs/data.md#the-vocabulary)
        (4_182_031, None, 8_192, 0.05),  # its KJV text
        (4_182_031, "tiny", 8_192, 0.05),  # tiny and nano: best at 8,192 on both texts
        (4_182_031, "nano", 8_192, 0.05),
        (4_182_031, "micro", 16_384, 0.05),  # micro: best at 16,384 or more (8,192 0.1-2.4% behind)
        (4_690_780, None, 8_192, 0.05),  # its changelog entries
        (4_690_780, "micro", 16_384, 0.05),
        (9_999_999, None, 8_192, 0.05),
        (10_000_000, None, 8_192, 0.02),
        (10_000_000, "think72", 16_384, 0.02),  # larger than micro: micro's (not measured)
        (999_999_999, None, 16_384, 0.01),
        (999_999_999, "medium350", 16_384, 0.01),
        (1_000_000_000, None, 33_069, 0.01),
        (1_000_000_000, "micro", 33_069, 0.01),  # never smaller for a larger model
        (10**12, None, 33_069, 0.01),
    ],
)
def test_build_defaults_are_sized_to_the_input_and_the_model(size, preset, vocab_size, fraction):
    assert data.sized_build_defaults(size, preset) == {
        "vocab_size": vocab_size,
        "val_fraction": fraction,
        "test_fraction": fraction,
    }


def test_the_data_layer_names_the_presets_as_the_model_layer_does():
    """data.py's --preset names (the data layer imports no model) are model_config.PRESETS', smallest first, and
    the ones given the larger vocabulary are those at least micro's size (the smallest measured to want it)."""
    from tinyllm.model import config as model_config

    assert data.PRESET_NAMES == tuple(model_config.PRESETS)
    sizes = [model_config.parameter_count(model_config.PRESETS[name], 0) for name in data.PRESET_NAMES]
    assert sizes == sorted(sizes)
    micro = model_config.parameter_count(model_config.PRESETS["micro"], 0)
    assert data.LARGE_VOCAB_PRESETS == tuple(name for name, size in zip(data.PRESET_NAMES, sizes) if size >= micro)
    with pytest.raises(UserError, match="unknown preset 'huge'; choose one of tiny, nano, micro"):
        data.sized_build_defaults(4_000_000, "huge")


@pytest.mark.parametrize(
    "vocab_size, dtype", [(263, "uint16"), (65_536, "uint16"), (65_537, "uint32"), (200_000, "uint32")]
)
def test_token_dtype_holds_every_id(vocab_size, dtype):
    assert corpus_format.token_dtype(vocab_size) == dtype
    assert np.iinfo(dtype).max >= vocab_size - 1  # the largest id fits


FRACTIONS = "--val-fraction and --test-fraction must be >= 0 and leave room for training data"


@pytest.mark.parametrize(
    "change, message",
    [
        ({"scope": "everything"}, "--scope 'everything' is unknown; choose one of full, chat, text, reasoning"),
        ({"val_fraction": -0.01}, FRACTIONS),
        ({"test_fraction": -0.01}, FRACTIONS),
        ({"val_fraction": 1.0}, FRACTIONS),
        ({"test_fraction": 1.0}, FRACTIONS),
        ({"val_fraction": 0.5, "test_fraction": 0.5}, FRACTIONS),
        (
            {"vocab_size": 262},
            f"--vocab-size 262 is below 263 (256 bytes + {len(corpus_format.SPECIAL_TOKENS)} special tokens)",
        ),
        (
            {"vocab_size": 10**9},
            "--vocab-size 1,000,000,000 is above 1,048,576: the BPE trainer would reserve memory for that many "
            "entries (the largest vocabularies in use hold about 262,144)",
        ),
        ({"shard_tokens": 0}, "--shard-tokens must be positive, got 0"),  # each option's own check (common.option)
        ({"tokenizer_sample_bytes": 0}, "--tokenizer-sample-bytes must be positive, got 0"),
        ({"batch_bytes": 0}, "--batch-bytes must be positive, got 0"),
        ({"min_chars": -1}, "--min-chars must not be negative, got -1"),
        ({"tokenize_workers": -1}, "--tokenize-workers must not be negative, got -1"),
    ],
)
def test_check_settings_refuses_each_bad_value(change, message):
    with pytest.raises(UserError, match=f"^{re.escape(message)}$"):
        data.check_settings(data.BuildSettings(**change))


@pytest.mark.parametrize(
    "change",
    [
        {},
        {"val_fraction": 0.0, "test_fraction": 0.0},
        {"val_fraction": 0.49, "test_fraction": 0.5},
        {
            "vocab_size": 263,
            "shard_tokens": 1,
            "min_chars": 0,
            "tokenizer_sample_bytes": 1,
            "batch_bytes": 1,
            "tokenize_workers": 0,
        },
        {"scope": "chat"},
        {"vocab_size": 1 << 20},
    ],
)
def test_check_settings_accepts_the_edges(change):
    data.check_settings(data.BuildSettings(**change))


# ----------------------------------------------------------------------------------------------
# Sharding: shards and their sha256 (data.py)


def read_shards(folder: Path, files: list[dict]) -> np.ndarray:
    return np.concatenate([np.fromfile(folder / entry["name"], dtype="<u2") for entry in files])


@pytest.mark.parametrize(
    "shard_tokens, batch_sizes",
    [
        (10, [3, 4, 5, 6, 2]),  # several tokenizer batches per shard, one batch across a boundary
        (5, [5, 5, 5]),  # each batch fills one shard exactly
        (7, [20]),  # one batch over three shards
        (100, [1, 1, 1]),  # one shard, three batches
    ],
)
def test_shard_writer_hashes_every_batch_written(tmp_path, shard_tokens, batch_sizes):
    writer = data.ShardWriter(tmp_path, "train", "uint16", shard_tokens)
    stream, start = [], 1000
    for size in batch_sizes:
        ids = np.arange(start, start + size, dtype=np.int64)  # int64 in, uint16 out
        writer.write(ids, [size])
        stream.extend(ids.tolist())
        start += size
    result = writer.finish()
    total = len(stream)
    expected_sizes = [shard_tokens] * (total // shard_tokens) + ([total % shard_tokens] if total % shard_tokens else [])
    assert [entry["tokens"] for entry in result["files"]] == expected_sizes
    assert [entry["name"] for entry in result["files"]] == [
        corpus_format.shard_name("train", i) for i in range(len(expected_sizes))
    ]
    for entry in result["files"]:
        path = tmp_path / entry["name"]
        assert entry["sha256"] == sha256_file(path), entry["name"]
        assert entry["bytes"] == path.stat().st_size == 2 * entry["tokens"]
    assert read_shards(tmp_path, result["files"]).tolist() == stream
    assert result["tokens"] == total
    assert result["documents"] == len(batch_sizes)
    ends = np.fromfile(tmp_path / "train.docs", dtype="<u8").tolist()
    assert ends == np.cumsum(batch_sizes).tolist()
    assert result["document_index"] == {
        "name": "train.docs",
        "bytes": 8 * len(batch_sizes),
        "sha256": sha256_file(tmp_path / "train.docs"),
    }


def test_shard_writer_with_nothing_written_writes_no_file(tmp_path):
    assert data.ShardWriter(tmp_path, "test", "uint16", 10).finish() == {
        "files": [],
        "tokens": 0,
        "documents": 0,
        "mask_tokens": {"prompt": 0, "assistant": 0, "text": 0},
    }
    assert list(tmp_path.iterdir()) == []


def test_shard_writer_writes_little_endian_uint32(tmp_path):
    writer = data.ShardWriter(tmp_path, "validation", "uint32", 4)
    writer.write(np.array([1, 70_000, 2**32 - 1], dtype=np.int64), [3])
    entry = writer.finish()["files"][0]
    raw = (tmp_path / entry["name"]).read_bytes()
    assert raw == (1).to_bytes(4, "little") + (70_000).to_bytes(4, "little") + (2**32 - 1).to_bytes(4, "little")
    mask = bytes([corpus_format.MASK_TEXT]) * 3  # no mask given: plain text
    assert (tmp_path / "validation-00000.mask").read_bytes() == mask
    assert entry == {
        "name": "validation-00000.bin",
        "bytes": 12,
        "sha256": hashlib.sha256(raw).hexdigest(),
        "tokens": 3,
        "mask": {"name": "validation-00000.mask", "bytes": 3, "sha256": hashlib.sha256(mask).hexdigest()},
    }


def test_shard_writer_writes_the_mask_given_cut_like_the_shards(tmp_path):
    writer = data.ShardWriter(tmp_path, "train", "uint16", 3)
    classes = [
        corpus_format.MASK_PROMPT,
        corpus_format.MASK_ASSISTANT,
        corpus_format.MASK_ASSISTANT,
        corpus_format.MASK_TEXT,
        corpus_format.MASK_PROMPT,
    ]
    writer.write(np.arange(10, 15, dtype=np.int64), [2, 3], mask=np.array(classes, dtype=np.int64))  # uint8 out
    writer.write(np.array([15], dtype=np.int64), [1])  # no mask: plain text
    with pytest.raises(ValueError, match="^2 mask values and 3 document tokens for 3 tokens$"):
        writer.write(np.array([1, 2, 3]), [3], mask=np.array([corpus_format.MASK_TEXT] * 2))
    with pytest.raises(ValueError, match="^3 mask values and 2 document tokens for 3 tokens$"):
        writer.write(np.array([1, 2, 3]), [2])
    result = writer.finish()
    assert (tmp_path / "train-00000.mask").read_bytes() == bytes(classes[:3])
    assert (tmp_path / "train-00001.mask").read_bytes() == bytes(classes[3:] + [corpus_format.MASK_TEXT])
    assert [entry["mask"] for entry in result["files"]] == [
        {"name": f"train-0000{index}.mask", "bytes": 3, "sha256": sha256_file(tmp_path / f"train-0000{index}.mask")}
        for index in (0, 1)
    ]
    assert result["mask_tokens"] == {"prompt": 2, "assistant": 2, "text": 2}
    assert np.fromfile(tmp_path / "train.docs", dtype="<u8").tolist() == [2, 5, 6] and result["documents"] == 3
    assert read_shards(tmp_path, result["files"]).tolist() == list(range(10, 16))


def test_batches_group_documents_by_characters():
    documents = [
        data.Document(split=f"s{index}", kind="text", text="x" * size, pieces=[f"p{index}"])
        for index, size in enumerate([3, 3, 4, 10, 1])
    ]
    groups = list(data.batches(documents, batch_bytes=6))
    # 3 + 3 reaches 6: a batch; 4 + 10 passes it: a batch; the last 1 is the remainder
    assert groups == [(["s0", "s1"], [["p0"], ["p1"]]), (["s2", "s3"], [["p2"], ["p3"]]), (["s4"], [["p4"]])]
    assert list(data.batches([], batch_bytes=6)) == []
    five_one = [data.Document(split="train", kind="text", text="x" * size, pieces=[str(size)]) for size in (5, 1, 2)]
    assert [pieces for _, pieces in data.batches(five_one, batch_bytes=6)] == [[["5"], ["1"]], [["2"]]]
    six_five_one = [
        data.Document(split="train", kind="text", text="x" * size, pieces=[str(size)]) for size in (6, 5, 1)
    ]
    assert [pieces for _, pieces in data.batches(six_five_one, batch_bytes=6)] == [[["6"]], [["5"], ["1"]]]


def test_batches_send_a_labelled_document_to_its_sources_stream():
    documents = [
        data.Document(split="train", kind="text", text="x", pieces=["a"], source="web"),
        data.Document(split="test", kind="text", text="x", pieces=["b"]),
    ]
    assert list(data.batches(documents, batch_bytes=100)) == [(["train-web", "test"], [["a"], ["b"]])]


# ----------------------------------------------------------------------------------------------
# Corpus record verification (corpus_format.py)


def tiny_corpus_files(root: Path) -> dict:
    """Two shards and a tokenizer folder with a manifest that matches them."""
    (root / corpus_format.TOKENIZER_DIR).mkdir(parents=True)
    (root / corpus_format.TOKENIZER_DIR / "tokenizer.json").write_text("{}")
    files = []
    for index, ids in enumerate([[1, 2, 3], [4, 5]]):
        raw = np.array(ids, dtype="<u2").tobytes()
        name = corpus_format.shard_name("train", index)
        (root / name).write_bytes(raw)
        files.append({"name": name, "bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest(), "tokens": len(ids)})
    (root / "eval.jsonl").write_text("{}\n")
    from tinyllm.common import sha256_tree

    return {
        "dtype": "uint16",
        "splits": {"train": {"files": files, "tokens": 5, "documents": 2}},
        "tokenizer_sha256": sha256_tree(root / corpus_format.TOKENIZER_DIR),
        "files": {"eval.jsonl": sha256_file(root / "eval.jsonl")},
    }


def test_verify_files_accepts_a_matching_corpus_and_names_each_fault(tmp_path):
    manifest = tiny_corpus_files(tmp_path)
    assert corpus_format.verify_files(tmp_path, manifest) == []
    first, second = tmp_path / corpus_format.shard_name("train", 0), tmp_path / corpus_format.shard_name("train", 1)

    raw = bytearray(first.read_bytes())
    raw[0] ^= 1
    first.write_bytes(bytes(raw))  # same size, other bytes
    assert corpus_format.verify_files(tmp_path, manifest) == [
        "train-00000.bin: sha256 does not match the manifest (corrupted or edited)"
    ]
    raw[0] ^= 1
    first.write_bytes(bytes(raw))

    second.write_bytes(second.read_bytes()[:-2])
    assert corpus_format.verify_files(tmp_path, manifest) == ["train-00001.bin: 2 bytes, manifest says 4"]
    second.unlink()
    assert corpus_format.verify_files(tmp_path, manifest) == ["train-00001.bin: missing (train shard)"]


def test_verify_files_reports_every_missing_shard_and_a_missing_tokenizer(tmp_path):
    manifest = tiny_corpus_files(tmp_path)
    for index in (0, 1):
        (tmp_path / corpus_format.shard_name("train", index)).unlink()
    (tmp_path / corpus_format.TOKENIZER_DIR / "tokenizer.json").unlink()
    (tmp_path / corpus_format.TOKENIZER_DIR).rmdir()
    del manifest["files"]  # a manifest without extra files is fine
    assert corpus_format.verify_files(tmp_path, manifest) == [
        "train-00000.bin: missing (train shard)",
        "train-00001.bin: missing (train shard)",
        f"{corpus_format.TOKENIZER_DIR}/: missing",
    ]


def test_verify_files_checks_token_counts_tokenizer_and_extra_files(tmp_path):
    manifest = tiny_corpus_files(tmp_path)
    manifest["splits"]["train"]["files"][1]["tokens"] = 3  # bytes and sha256 fine, the count is not
    manifest["splits"]["train"]["tokens"] = 6
    assert corpus_format.verify_files(tmp_path, manifest) == ["train-00001.bin: 4 bytes is not 3 uint16 tokens"]
    manifest["splits"]["train"]["tokens"] = 7
    assert (
        corpus_format.verify_files(tmp_path, manifest)[-1]
        == "train: shard tokens do not add up to the split's 7 tokens"
    )
    manifest = tiny_corpus_files(tmp_path / "again")
    (tmp_path / "again" / corpus_format.TOKENIZER_DIR / "tokenizer.json").write_text('{"edited": 1}')
    (tmp_path / "again" / "eval.jsonl").write_text("{}\n{}\n")
    assert corpus_format.verify_files(tmp_path / "again", manifest) == [
        f"{corpus_format.TOKENIZER_DIR}/: sha256 of the folder does not match the manifest",
        "eval.jsonl: sha256 does not match the manifest",
    ]
    (tmp_path / "again" / "eval.jsonl").unlink()
    assert corpus_format.verify_files(tmp_path / "again", manifest)[-1] == "eval.jsonl: missing"


def test_verify_files_checks_the_mask_files(tmp_path):
    manifest = tiny_corpus_files(tmp_path)
    manifest["format_version"] = 2  # a mask file for every shard
    for entry, classes in zip(manifest["splits"]["train"]["files"], [[0, 1, 1], [2, 2]]):
        path = tmp_path / corpus_format.mask_name(entry["name"])
        path.write_bytes(bytes(classes))
        entry["mask"] = {"name": path.name, "bytes": len(classes), "sha256": sha256_file(path)}
    assert corpus_format.verify_files(tmp_path, manifest) == []
    (tmp_path / "train-00001.mask").write_bytes(bytes([2, 1]))
    assert corpus_format.verify_files(tmp_path, manifest) == [
        "train-00001.mask: sha256 does not match the manifest (corrupted or edited)"
    ]
    del manifest["splits"]["train"]["files"][1]["mask"]
    assert corpus_format.verify_files(tmp_path, manifest) == ["train-00001.bin: the manifest lists no mask file for it"]
    del manifest["format_version"]  # a corpus from before masks: none expected
    assert corpus_format.verify_files(tmp_path, manifest) == []


def add_masks(root: Path, manifest: dict) -> None:
    """A plain-text mask file for each shard of tiny_corpus_files, as format 2 and later have."""
    for entry in manifest["splits"]["train"]["files"]:
        path = root / corpus_format.mask_name(entry["name"])
        path.write_bytes(bytes([corpus_format.MASK_TEXT]) * entry["tokens"])
        entry["mask"] = {"name": path.name, "bytes": entry["tokens"], "sha256": sha256_file(path)}


def write_document_index(root: Path, name: str, ends: list[int]) -> dict:
    path = root / name
    path.write_bytes(np.array(ends, dtype="<u8").tobytes())
    return {"name": name, "bytes": path.stat().st_size, "sha256": sha256_file(path)}


def test_verify_files_checks_the_document_index(tmp_path):
    manifest = tiny_corpus_files(tmp_path)
    add_masks(tmp_path, manifest)
    train = manifest["splits"]["train"]
    train["document_index"] = write_document_index(tmp_path, "train.docs", [3, 5])
    manifest["splits"]["test"] = {"files": [], "tokens": 0, "documents": 0}  # no document: no index needed
    manifest["format_version"] = 3
    assert corpus_format.verify_files(tmp_path, manifest) == []
    (tmp_path / "train.docs").write_bytes(np.array([3, 4], dtype="<u8").tobytes())  # same size, other ends
    assert corpus_format.verify_files(tmp_path, manifest) == [
        "train.docs: sha256 does not match the manifest (corrupted or edited)"
    ]
    del train["document_index"]
    assert corpus_format.verify_files(tmp_path, manifest) == [
        "train: the manifest lists no document index (train.docs)"
    ]
    manifest["format_version"] = 2  # a corpus from before the index: none expected
    assert corpus_format.verify_files(tmp_path, manifest) == []
    del manifest["format_version"]
    assert corpus_format.verify_files(tmp_path, manifest) == []


def test_verify_files_checks_each_labelled_sources_document_index(tmp_path):
    manifest = tiny_corpus_files(tmp_path)
    add_masks(tmp_path, manifest)
    manifest["format_version"] = 3
    train = manifest["splits"]["train"]  # one stream per source: web's shard holds 3 tokens, code's 2
    train["sources"] = {
        "web": {
            "files": train["files"][:1],
            "tokens": 3,
            "documents": 2,
            "document_index": write_document_index(tmp_path, "train-web.docs", [1, 3]),
        },
        "code": {
            "files": train["files"][1:],
            "tokens": 2,
            "documents": 1,
            "document_index": write_document_index(tmp_path, "train-code.docs", [2]),
        },
    }
    train["documents"] = 3
    assert corpus_format.verify_files(tmp_path, manifest) == []  # the split itself has no index: its sources do
    (tmp_path / "train-code.docs").write_bytes(np.array([1], dtype="<u8").tobytes())
    assert corpus_format.verify_files(tmp_path, manifest) == [
        "train-code.docs: sha256 does not match the manifest (corrupted or edited)"
    ]
    del train["sources"]["code"]["document_index"]
    assert corpus_format.verify_files(tmp_path, manifest) == [
        "train-code: the manifest lists no document index (train-code.docs)"
    ]


# ----------------------------------------------------------------------------------------------
# Data order and --packing (train_data.py)


def test_mix64_is_splitmix64():
    """The first outputs of splitmix64 seeded with 0 (Vigna's reference: state += golden gamma, then mix)."""
    gamma = 0x9E3779B97F4A7C15
    assert [train_data.mix64(index * gamma & train_data.MASK64) for index in range(3)] == [
        0xE220A8397B1DCDAF,
        0x6E789E6AA1B965F4,
        0x06C45D188009454F,
    ]
    assert all(0 <= train_data.mix64(value) < 2**64 for value in (0, 1, 2**64 - 1, 12345))


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 15, 16, 17, 63, 64, 65, 255, 256, 257, 1023, 1024, 1025])
def test_block_permutation_is_a_bijection_around_every_domain_size(n):
    for seed, epoch in [(0, 0), (7, 3), (2**70 + 5, 1)]:  # a seed beyond 64 bits is masked, not an error
        perm = train_data.BlockPermutation(n, seed, epoch)
        assert sorted(perm(i) for i in range(n)) == list(range(n)), (n, seed, epoch)


@pytest.mark.parametrize("n", [2, 3, 4, 5, 17, 100, 1000])
def test_block_permutation_walks_a_domain_of_fewer_than_4n_values(n):
    """The Feistel domain is the smallest even bit width holding n: cycle-walking stays short."""
    perm = train_data.BlockPermutation(n, 1, 0)
    domain = 1 << (2 * perm.half_bits)
    assert n <= domain < 4 * n
    assert perm.mask == (1 << perm.half_bits) - 1


def test_block_permutation_encrypt_is_a_bijection_of_its_domain():
    perm = train_data.BlockPermutation(1000, 3, 0)  # domain 1024: values 1000..1023 are walked past
    domain = 1 << (2 * perm.half_bits)
    assert sorted(perm._encrypt(value) for value in range(domain)) == list(range(domain))


def test_block_permutation_is_keyed_and_mixes():
    n = 4096
    base = [train_data.BlockPermutation(n, 1, 0)(i) for i in range(n)]
    for seed, epoch in [(2, 0), (1, 1), (1 << 32, 0), (0, 0)]:
        other = [train_data.BlockPermutation(n, seed, epoch)(i) for i in range(n)]
        same = sum(a == b for a, b in zip(base, other))
        assert same < 20, (seed, epoch, same)  # ~1 expected by chance
    assert sum(base[i] == i for i in range(n)) < 20  # not near the identity
    # the first half of positions is not sent to the first half (a weak mix would keep halves apart)
    assert 900 < sum(value < n // 2 for value in base[: n // 2]) < 1150  # ~1024 of 2048
    assert train_data.BlockPermutation(n, 1, 0).keys == train_data.BlockPermutation(n, 1, 0).keys
    assert len(set(train_data.BlockPermutation(n, 1, 0).keys)) == train_data.BlockPermutation.ROUNDS


@pytest.mark.parametrize(
    "ends, row_tokens, pieces",
    [
        ([3, 5, 6], 4, [(0, 3), (3, 2), (5, 1)]),  # documents that fit are one piece each
        ([10], 4, [(0, 4), (3, 4), (6, 4)]),  # a long one: pieces of 4, each starting on the last token before
        ([11], 4, [(0, 4), (3, 4), (6, 4), (9, 2)]),  # ... and its remainder
        ([4, 6, 13], 4, [(0, 4), (4, 2), (6, 4), (9, 4)]),  # exactly a row; short; 7 tokens = 4 + 4 sharing one
    ],
)
def test_document_pieces(ends, row_tokens, pieces):
    starts, lengths = train_data.document_pieces(np.array(ends, dtype=np.uint64), row_tokens)
    assert list(zip(starts.tolist(), lengths.tolist())) == pieces


@pytest.mark.parametrize(
    "lengths, window, rows",
    [
        ([5, 3, 2], 8, [[0, 1], [2]]),  # the longest first (5), then the longest that fits (3); 2 waits
        ([2, 3, 5], 8, [[2, 1], [0]]),  # the same pieces in another stream order, the same rows
        ([8, 1, 7], 8, [[0], [2, 1]]),  # a full row; 7 + 1 fill the next exactly
        ([4, 4, 4], 8, [[2, 1], [0]]),  # ties: the later piece first (deterministic)
        ([6, 6, 2, 2], 2, [[1], [0, 2], [3]]),  # a window of 2: piece 3 is not yet seen when row 2 closes
        ([], 8, []),
    ],
)
def test_best_fit_rows(lengths, window, rows):
    order, row_ends = train_data.best_fit_rows(np.array(lengths, dtype=np.int64), 8, window)
    got = [order[start:end].tolist() for start, end in zip([0, *row_ends[:-1].tolist()], row_ends.tolist())]
    assert got == rows
    assert sorted(order.tolist()) == list(range(len(lengths)))  # every piece once
    assert all(sum(lengths[piece] for piece in row) <= 8 for row in got)


@pytest.mark.parametrize(
    "packing, rows, spans, pads, documents",
    [
        ("stream", 3, [(0, 5), (4, 5), (8, 5)], False, False),  # blocks of the stream, across documents
        ("masked", 3, [(0, 5), (4, 5), (8, 5)], False, True),  # the same rows, each token with its document
        ("bestfit", 3, [(8, 5), (3, 5), (0, 3), (12, 2)], True, False),  # pieces (the 6-token one cut), padded
    ],
)
def test_each_packing_mode_is_one_class_with_one_interface(packing, rows, spans, pads, documents):
    """Documents of 3, 5 and 6 tokens (ends 3, 8, 14), rows of C + 1 = 5 tokens."""
    mode = train_data.PACKINGS[packing](np.array([3, 8, 14], dtype=np.uint64), 4)
    assert mode.rows == rows
    assert [piece for row in range(mode.rows) for piece in mode.spans(row)] == spans
    assert (mode.pads, mode.documents, mode.reads_document_index) == (pads, documents, packing != "stream")
    assert packing in train_data.PACKING_HELP and mode.help in train_data.PACKING_HELP
    if documents:  # row 0's inputs are tokens 0..3: document 0 ends at 3; row 1's (4..7) are all document 1
        assert mode.segments(0).tolist() == [0, 0, 0, 1] and mode.segments(1).tolist() == [0, 0, 0, 0]
    assert train_data.PACKINGS[packing](np.array([0], dtype=np.uint64), 4).rows == 0  # an empty split


@pytest.mark.parametrize("blocks, world, count", [(100, 1, 24), (100, 3, 24), (10, 2, 10), (0, 2, 0)])
def test_evaluation_rows_are_the_fixed_order_shared_between_ranks(blocks, world, count):
    """--eval-tokens 760 of blocks of 32 tokens: 24 rows (a part block's tokens take a block), the first `count`
    of the EVAL_EPOCH order keyed by EVAL_SEED (not the run's --seed), every world-th to each rank, whatever the
    world size."""
    options = SimpleNamespace(eval_tokens=760, context=32, seed=7, world=world)
    split = SimpleNamespace(blocks=blocks)
    shares = [train_data.evaluation_rows(split, options, rank) for rank in range(world)]
    assert all(share.total == count for share in shares)
    order = train_data.BlockPermutation(blocks, train_data.EVAL_SEED, train_data.EVAL_EPOCH) if blocks else None
    assert sorted(row for share in shares for row in share.rows) == sorted(order(i) for i in range(count))
    assert shares[-1].rows == [order(i) for i in range(world - 1, count, world)] if blocks else shares[-1].rows == []


def test_a_manifest_lists_every_file_it_records(tmp_path):
    record = tiny_corpus_files(tmp_path)
    add_masks(tmp_path, record)
    record["splits"]["train"]["document_index"] = write_document_index(tmp_path, "train.docs", [3, 5])
    files = corpus_format.Manifest(record, "0" * 64).files()
    assert sorted(files) == [
        "eval.jsonl",
        "train-00000.bin",
        "train-00000.mask",
        "train-00001.bin",
        "train-00001.mask",
        "train.docs",
    ]
    assert files["train.docs"] == (sha256_file(tmp_path / "train.docs"), 16)
    assert files["eval.jsonl"] == (sha256_file(tmp_path / "eval.jsonl"), None)  # other files: a sha256 alone


def test_block_permutation_rejects_an_empty_range():
    with pytest.raises(ValueError, match="^a permutation needs at least one element$"):
        train_data.BlockPermutation(0, 1, 0)


@pytest.mark.parametrize("world, accum, batch", [(1, 1, 6), (1, 3, 2), (2, 3, 1), (3, 1, 2), (2, 1, 3)])
def test_sampler_layout_of_a_step(world, accum, batch):
    """Sample j of a step goes to micro-step j // (world * batch), rank (j // batch) % world."""
    sampler = train_data.BlockSampler(blocks=50, seed=4, batch_size=batch, grad_accum=accum, world=world)
    assert sampler.global_batch == world * accum * batch == 6
    for step in (0, 3, 9):  # step 9 reads samples 54..59: into epoch 1
        blocks = sampler.step_blocks(step)
        order0, order1 = train_data.BlockPermutation(50, 4, 0), train_data.BlockPermutation(50, 4, 1)
        assert blocks == [order0(g) if g < 50 else order1(g - 50) for g in range(step * 6, step * 6 + 6)]
        for rank in range(world):
            expected = [
                [blocks[j] for j in range(6) if j // (world * batch) == micro and (j // batch) % world == rank]
                for micro in range(accum)
            ]
            assert sampler.micro_batches(step, rank) == expected


def test_sampler_state_dict_and_each_mismatch():
    sampler = train_data.BlockSampler(blocks=50, seed=1, batch_size=2, grad_accum=3, world=1)
    assert sampler.state_dict() == {"seed": 1, "blocks": 50, "global_batch": 6}  # the step is the checkpoint's
    for key, value in [("seed", 2), ("blocks", 49), ("global_batch", 8)]:
        with pytest.raises(UserError, match=f"checkpoint data cursor has {key} {value}"):
            sampler.load_state_dict({**sampler.state_dict(), key: value})
    other = train_data.BlockSampler(blocks=50, seed=1, batch_size=6, grad_accum=1, world=1)
    other.load_state_dict(sampler.state_dict())  # another split of the same global batch
    with pytest.raises(UserError, match="^the train split has fewer tokens than one block; use a smaller --context$"):
        train_data.BlockSampler(blocks=0, seed=1, batch_size=1, grad_accum=1, world=1)
    single = train_data.BlockSampler(blocks=1, seed=1, batch_size=2, grad_accum=1, world=1)  # one block is enough
    assert single.step_blocks(0) == [0, 0]


# ----------------------------------------------------------------------------------------------
# The loss and gradient clipping (train.py)


class FixedLogits(torch.nn.Module):
    """A 'model' whose logits are a table indexed by the input token: its decoder gives one-hot hidden
    states, its LM head's weight is the table transposed (language_model_loss takes the two apart)."""

    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.lm_head = torch.nn.Linear(*table.shape, bias=False, dtype=table.dtype)
        self.lm_head.weight.data = table.t().contiguous()
        self.model = lambda input_ids: SimpleNamespace(
            last_hidden_state=torch.nn.functional.one_hot(input_ids, len(table)).to(table.dtype)
        )


def test_language_model_loss_is_hand_computed_cross_entropy():
    # vocab 2: after token 0 the model says logits (0, ln 3), i.e. p = (1/4, 3/4); after token 1 uniform
    model = FixedLogits(torch.tensor([[0.0, math.log(3.0)], [0.0, 0.0]], dtype=torch.float64))
    inputs = torch.tensor([[0, 0], [1, 0]])
    targets = torch.tensor([[1, 0], [1, 1]])
    nats = [-math.log(3 / 4), -math.log(1 / 4), -math.log(1 / 2), -math.log(3 / 4)]
    assert losses.language_model_loss(model, inputs, targets).item() == pytest.approx(sum(nats) / 4)
    assert losses.language_model_loss(model, inputs, targets, reduction="sum").item() == pytest.approx(sum(nats))
    assert losses.LanguageModelLoss(model)(inputs, targets).item() == pytest.approx(sum(nats) / 4)
    assert losses.LanguageModelLoss(model)(inputs, targets, "sum").item() == pytest.approx(sum(nats))


def test_language_model_loss_computes_in_fp32_under_low_precision_logits():
    logits = torch.tensor([[0.0, 8.0, 8.0625]], dtype=torch.bfloat16)  # bf16 logits, a fp32 loss
    loss = losses.language_model_loss(FixedLogits(logits), torch.tensor([[0]]), torch.tensor([[2]]))
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(math.log(1 + math.exp(-8.0625) + math.exp(8 - 8.0625)), rel=1e-6)


def gradients(*values: list[float]) -> list[torch.nn.Parameter]:
    parameters = []
    for value in values:
        parameter = torch.nn.Parameter(torch.zeros(len(value)))
        parameter.grad = torch.tensor(value)
        parameters.append(parameter)
    return parameters


@pytest.mark.parametrize(
    "grads, max_norm, norm, scaled",
    [
        ([[3.0], [4.0]], 1.0, 5.0, True),  # norm 5 > 1: scaled to norm 1
        ([[0.3], [0.4]], 1.0, 0.5, False),  # below: untouched
        ([[0.6], [0.8]], 1.0, 1.0, True),  # at the limit the coefficient 1/(1 + 1e-6) is < 1: scaled, as torch does
        ([[0.999999]], 1.0, 0.999999, False),  # norm + 1e-6 rounds to 1.0 in float32: coefficient exactly 1, no clip
    ],
)
def test_clip_gradients_by_value(grads, max_norm, norm, scaled):
    parameters = gradients(*grads) + [torch.nn.Parameter(torch.zeros(2))]  # one without a gradient
    total = optimization.clip_gradients(parameters, max_norm)
    assert total.item() == pytest.approx(norm)
    after = [p.grad for p in parameters[:-1]]
    if scaled:
        assert [g.item() for g in after] == pytest.approx([g[0] * max_norm / (norm + 1e-6) for g in grads])
    else:  # untouched: not even multiplied by 1.0 (the work clip_gradients exists to skip)
        assert [g.item() for g in after] == [torch.tensor(g[0]).item() for g in grads]
        assert [g._version for g in after] == [0] * len(after)


def test_clip_gradients_is_bitwise_torchs_clip_grad_norm():
    for scale in (1e-3, 0.5, 1.0, 1.0 - 1e-7, 3.0, float("inf")):
        torch.manual_seed(0)
        ours, theirs = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(3)], []
        for parameter in ours:
            parameter.grad = torch.randn_like(parameter)
        norm = torch.nn.utils.get_total_norm([p.grad for p in ours])
        for parameter in ours:
            parameter.grad.mul_(scale / norm)  # total norm ~scale: below, at and above the clip
            twin = torch.nn.Parameter(parameter.detach().clone())
            twin.grad = parameter.grad.clone()
            theirs.append(twin)
        got = optimization.clip_gradients(ours, 1.0)
        want = torch.nn.utils.clip_grad_norm_(theirs, 1.0)
        assert torch.equal(got, want) or (got.isnan() and want.isnan())
        for mine, twin in zip(ours, theirs):
            assert torch.equal(mine.grad, twin.grad) or (mine.grad.isnan().all() and twin.grad.isnan().all())


def test_clip_gradients_sets_non_finite_gradients_to_nan():
    parameters = gradients([float("nan"), 1.0])
    assert math.isnan(optimization.clip_gradients(parameters, 1.0).item())
    assert torch.isnan(parameters[0].grad).all()


MIXTURE = {
    "sources": [{"name": "web", "label": None}, {"name": "chat", "label": "chat"}],
    "phases": [{"start": 0, "weights": {"web": 0.8, "chat": 0.2}}],
}


@pytest.mark.parametrize(
    "old, new, expected",
    [
        ({"a": 1}, {"a": 1}, []),
        ({"a": 1, "b": 2}, {"a": 1, "b": 3}, ["b: 2 -> 3"]),
        ({"a": 1}, {"b": 2}, ["a: 1 -> (unset)", "b: (unset) -> 2"]),
        ({"lr": 1e-3, "z": None}, {"lr": 2e-3, "z": None}, ["lr: 0.001 -> 0.002"]),
        ({"x": True}, {"x": None}, ["x: true -> null"]),  # JSON's words, not Python's
        ({"betas": [0.9, 0.95]}, {"betas": [0.9, 0.99]}, ["betas[1]: 0.95 -> 0.99"]),
        (
            {"mixture": MIXTURE},
            {"mixture": {**MIXTURE, "phases": [{"start": 0, "weights": {"web": 0.7, "chat": 0.3}}]}},
            ["mixture.phases[0].weights.chat: 0.2 -> 0.3", "mixture.phases[0].weights.web: 0.8 -> 0.7"],
        ),
        (
            {"mixture": MIXTURE},
            {"mixture": {**MIXTURE, "sources": [{"name": "web", "label": None}]}},
            [
                'mixture.sources: [{"name": "web", "label": null}, {"name": "chat", "label": "chat"}] -> '
                '[{"name": "web", "label": null}]'
            ],
        ),
        ({"s": "x" * 100}, {"s": "y"}, ["s: " + "x" * 77 + "... -> y"]),
        # an option and its resolved value: one change, the resolved values under the option's name
        ({"lr": None, "recipe.lr": 0.002}, {"lr": 0.003, "recipe.lr": 0.003}, ["lr: 0.002 -> 0.003"]),
        ({"heads": None, "model.heads": 4}, {"heads": 8, "model.heads": 8}, ["heads: 4 -> 8"]),
        ({"lr": None, "recipe.lr": 0.002}, {"lr": 0.002, "recipe.lr": 0.002}, ["lr: null -> 0.002"]),
        ({"recipe.lr": 0.002}, {"recipe.lr": 0.003}, ["recipe.lr: 0.002 -> 0.003"]),  # a default that moved
        # a derived setting beside what it derives from: once
        (
            {"global_batch_blocks": 8, "tokens_per_step": 1024},
            {"global_batch_blocks": 16, "tokens_per_step": 2048},
            ["global_batch_blocks: 8 -> 16"],
        ),
        (
            {"context": None, "model.context": 128, "tokens_per_step": 1024},
            {"context": 256, "model.context": 256, "tokens_per_step": 2048},
            ["context: 128 -> 256"],
        ),
        ({"tokens_per_step": 1024}, {"tokens_per_step": 2048}, ["tokens_per_step: 1024 -> 2048"]),
    ],
)
def test_settings_changes_are_described_one_by_one(old, new, expected):
    assert store.describe_changes(store.settings_changes(old, new)) == "; ".join(expected)


@pytest.mark.parametrize(
    "old, new, extend, others",
    [
        ({"lr": 1, "total_steps": 10}, {"lr": 1, "total_steps": 10}, False, {}),
        # a default of one epoch resumed with an explicit --epochs 1: the same length said another way
        ({"epochs": None, "total_steps": 10}, {"epochs": 1.0, "total_steps": 10}, False, {}),
        (
            {"target_tokens": 100, "total_steps": 10, "recipe.total_steps": 10},
            {"target_tokens": 200, "total_steps": 20, "recipe.total_steps": 20},
            True,
            {},
        ),
        ({"lr": 1, "total_steps": 10}, {"lr": 2, "total_steps": 10}, False, {"lr": (1, 2)}),
        ({"lr": 1, "total_steps": 10}, {"lr": 2, "total_steps": 20}, True, {"lr": (1, 2)}),
        ({"seed": 1}, {}, False, {"seed": (1, store.UNSET)}),
        # a shape option given where the checkpoint took its preset's (or the reverse), the same shape: no change
        ({"heads": None, "model.heads": 4}, {"heads": 4, "model.heads": 4}, False, {}),
        ({"heads": 4, "model.heads": 4}, {"heads": None, "model.heads": 4}, False, {}),
        (
            {"heads": None, "model.heads": 4},
            {"heads": 8, "model.heads": 8},
            False,
            {"heads": (None, 8), "model.heads": (4, 8)},
        ),
        ({"heads": None, "model.heads": 4}, {"heads": None, "model.heads": 2}, False, {"model.heads": (4, 2)}),
        ({"lr": None, "recipe.lr": 0.05}, {"lr": 0.05, "recipe.lr": 0.05}, False, {"lr": (None, 0.05)}),  # no shape
    ],
)
def test_resume_verdict(old, new, extend, others):
    verdict = store.resume_verdict(old, new)
    assert verdict.extend == extend and verdict.others == others


@pytest.mark.parametrize(
    "old, total, expected",
    [
        (
            {"total_steps": 25, "target_tokens": 200000},
            154,
            "note: this resume changes the run's length from 25 to 154 steps; to keep it, give --target-tokens 200000",
        ),
        ({"total_steps": 154, "epochs": 2.5}, 300, "to keep it, give --epochs 2.5"),
        ({"total_steps": 154, "target_tokens": None, "epochs": None}, 300, "to keep it, give --epochs 1"),
    ],
)
def test_length_change_note(old, total, expected):
    assert expected in train.length_change_note(old, total)


@pytest.mark.parametrize(
    "changes, unset, expected",
    [
        # a default that changed since the checkpoint: the option given as the checkpoint had it
        (
            {"beta1": (0.9, None), "muon_momentum": (0.95, None), "recipe.betas": ([0.9, 0.95], [0.6, 0.95])},
            {"beta1", "muon_momentum"},
            ["--beta1 0.9", "--muon-momentum 0.95"],
        ),
        ({"lr": (0.001, 0.002)}, set(), []),  # given otherwise on the command line: the message names it already
        ({"preset": ("nano", None), "vocab_size": (512, None)}, {"preset"}, ["--preset nano"]),  # vocab_size: no option
        ({"mixture": ({"web": 1}, None), "seed": (1, store.UNSET)}, {"mixture"}, []),  # not plain values
        # a preset whose shape changed since: the shape options it had, where this run takes the preset's
        (
            {"model.heads": (4, 2), "model.head_dim": (32, 64), "model.tie_embeddings": (True, False)},
            {"heads", "head_dim", "tie_embeddings"},
            ["--heads 4", "--head-dim 32", "--tie-embeddings"],
        ),
        ({"model.tie_embeddings": (False, True)}, {"tie_embeddings"}, ["--no-tie-embeddings"]),
        ({"model.heads": (4, 8)}, set(), []),  # --heads given: named in the change already
        ({"model.rope_scaling": (None, "yarn")}, {"rope_scaling"}, []),  # no such option
        # the preset left out (its default, tiny) on a nano run: --preset nano, not the shape nano gives anyway
        (
            {"preset": ("nano", "tiny"), "model.heads": (2, 4), "model.head_dim": (64, 16)},
            {"preset", "heads", "head_dim"},
            ["--preset nano"],
        ),
        # --preset given otherwise: the change names it; the shape the checkpoint's preset gave is not listed
        ({"preset": ("tiny", "nano"), "model.heads": (4, 2), "model.head_dim": (16, 64)}, {"heads", "head_dim"}, []),
        # ... but a shape the run had beyond its preset's is kept too
        (
            {"preset": ("nano", "tiny"), "model.heads": (8, 4), "model.head_dim": (64, 16)},
            {"preset", "heads", "head_dim"},
            ["--preset nano", "--heads 8"],
        ),
    ],
)
def test_options_to_keep(changes, unset, expected):
    flags = {
        "beta1": "--beta1",
        "muon_momentum": "--muon-momentum",
        "lr": "--lr",
        "preset": "--preset",
        "mixture": "--mixture",
        "seed": "--seed",
        "heads": "--heads",
        "head_dim": "--head-dim",
        "tie_embeddings": "--tie-embeddings",
    }
    presets = {"nano": {"heads": 2, "head_dim": 64}, "tiny": {"heads": 4, "head_dim": 16}}
    assert store.options_to_keep(changes, flags, unset, presets) == expected


# backup wait, signalled, under torchrun, seconds since the signal -> how long the end waits for the upload
@pytest.mark.parametrize(
    "wait, signalled, torchrun, elapsed, expected",
    [
        (600, False, False, 0, 600),
        (600, False, True, 100, 600),  # no signal: --backup-wait-seconds
        (600, True, False, 3, 600),  # a signal without torchrun: no SIGKILL to fit under
        (600, True, True, 0, 25),
        (600, True, True, 10, 15),  # torchrun: 30 s grace, 5 s margin
        (8, True, True, 10, 8),  # --backup-wait-seconds is still the upper bound
        (600, True, True, 25, 0),
        (600, True, True, 40, 0),  # the save took the whole grace: no wait
    ],
)
def test_stop_wait_seconds(wait, signalled, torchrun, elapsed, expected):
    assert train.stop_wait_seconds(wait, signalled, torchrun, elapsed) == expected


def test_stop_wait_seconds_follows_a_longer_grace_period_from_the_environment():
    assert train.torchrun_grace_seconds({}) == 30
    assert train.torchrun_grace_seconds({"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "120"}) == 120
    assert train.torchrun_grace_seconds({"PET_SHUTDOWN_TIMEOUT": "60"}) == 60
    assert train.torchrun_grace_seconds({"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "soon"}) == 30
    assert train.stop_wait_seconds(600, True, True, 10, grace=120) == 105


GLOO_RESET = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
    "[127.0.0.1]:15748: Connection reset by peer. This is typically caused by a remote worker hanging "
    "or bugs in the application. Check the logs of the remote worker before reporting an error."
)


@pytest.mark.parametrize(
    "error, world, cause",
    [
        (RuntimeError(GLOO_RESET), 2, "Read error [127.0.0.1]:15748: Connection reset by peer"),  # as gloo raises it
        (RuntimeError(GLOO_RESET), 1, None),  # no peer to lose
        (
            torch.distributed.DistBackendError("NCCL error: remote process exited\nmore"),
            4,
            "NCCL error: remote process exited",
        ),
        (RuntimeError("CUDA out of memory"), 2, None),  # an error of this rank, not of a peer
        (RuntimeError("mat1 and mat2 shapes cannot be multiplied"), 2, None),
    ],
)
def test_lost_rank_cause(error, world, cause):
    assert train.lost_rank_cause(error, world) == cause


def test_tensor_differences_names_each_difference():
    stored = {"w": torch.ones(2), "nested": {"b": torch.zeros(1), "n": 3}, "list": [torch.ones(1)]}
    assert (
        store.tensor_differences(
            {"w": torch.ones(2), "nested": {"b": torch.zeros(1), "n": 3}, "list": [torch.ones(1)]}, stored, "m"
        )
        == []
    )
    live = {
        "w": torch.tensor([1.0, 1.0 + 2**-20]),
        "nested": {"b": torch.zeros(1, dtype=torch.float64), "n": 4},
        "list": [torch.ones(1)],
    }
    assert store.tensor_differences(live, stored, "m") == ["m.w", "m.nested.b", "m.nested.n"]
    assert store.tensor_differences({**live, "extra": 1}, stored, "m") == ["m keys"]
    assert store.tensor_differences({"list": [torch.ones(1), 2]}, {"list": [torch.ones(1)]}, "m") == ["m.list length"]
    assert store.tensor_differences([torch.ones(1), 5], [torch.zeros(1), 5], "o") == ["o[0]"]
    assert store.tensor_differences(torch.ones(1), 1.0, "t") == ["t"]
    assert store.tensor_differences(1.0, torch.ones(1), "t") == ["t"]
    assert store.tensor_differences({"a": 1}, 5, "d") == ["d"] and store.tensor_differences(5, {"a": 1}, "d") == ["d"]
    assert store.tensor_differences([1], 5, "l") == ["l"] and store.tensor_differences(5, (1,), "l") == ["l"]
    assert store.tensor_differences((1, 2), [1, 2], "l") == []  # a tuple stored as a list (torch.load) is equal


class Hostile:
    """Unpickling this runs code: Path.touch(marker)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (self.marker,)


def test_a_hostile_checkpoint_is_refused_without_running_its_code(tmp_path):
    marker = tmp_path / "code-ran"
    path = tmp_path / "step-00000001.pt"
    torch.save(
        {
            "format_version": store.FORMAT_VERSION,
            "step": 1,
            "model": {},
            "optimizer": {},
            "settings": {},
            "payload": Hostile(marker),
        },
        path,
    )
    with pytest.raises(UserError, match="does not load: UnpicklingError"):
        store.load_checkpoint_file(path)
    assert not marker.exists()
    with open(path, "rb") as handle:  # the file does carry the payload: a plain unpickler would run it
        assert b"touch" in handle.read()


def test_load_checkpoint_file_checks_keys_and_format_version(tmp_path):
    good = {
        "format_version": store.FORMAT_VERSION,
        "step": 3,
        "model": {"w": torch.ones(1)},
        "optimizer": {},
        "settings": {},
    }
    torch.save(good, tmp_path / "good.pt")
    assert store.load_checkpoint_file(tmp_path / "good.pt")["step"] == 3
    for key in ("format_version", "step", "model", "optimizer", "settings"):
        torch.save({k: v for k, v in good.items() if k != key}, tmp_path / "bad.pt")
        with pytest.raises(UserError, match=f"^checkpoint {re.escape(str(tmp_path / 'bad.pt'))} lacks '{key}'$"):
            store.load_checkpoint_file(tmp_path / "bad.pt")
    torch.save({**good, "format_version": store.FORMAT_VERSION + 1}, tmp_path / "new.pt")
    with pytest.raises(
        UserError,
        match=f"^checkpoint {re.escape(str(tmp_path / 'new.pt'))} has format_version {store.FORMAT_VERSION + 1}, ",
    ):
        store.load_checkpoint_file(tmp_path / "new.pt")
    (tmp_path / "cut.pt").write_bytes((tmp_path / "good.pt").read_bytes()[:50])
    with pytest.raises(UserError, match=f"^checkpoint {re.escape(str(tmp_path / 'cut.pt'))} does not load: "):
        store.load_checkpoint_file(tmp_path / "cut.pt")
    with pytest.raises(UserError, match=f"^weights {re.escape(str(tmp_path / 'cut.pt'))} does not load: "):
        store.load_checkpoint_file(tmp_path / "cut.pt", what="weights")


# ----------------------------------------------------------------------------------------------
# The bound on unbacked checkpoints (checkpoint_store.py; the backup's plan is tested in test_store.py)


@pytest.mark.parametrize(
    "waiting, bound, allowed",
    [
        ([5, 1, 3], 1, [1, 3]),
        ([5, 1, 3], 3, []),
        ([5, 1, 3], 0, [1, 3, 5]),
        ([], 2, []),
        ([2, 1], 5, []),
        ([10, 9, 100], 1, [9, 10]),
    ],
)
def test_beyond_unbacked_bound(waiting, bound, allowed):
    assert store.beyond_unbacked_bound(waiting, lambda step: step, bound) == allowed
    # ordered by the step, not by the items themselves
    names = [f"step-{step}" for step in waiting]
    assert store.beyond_unbacked_bound(names, lambda name: int(name[5:]), bound) == [f"step-{step}" for step in allowed]


# ----------------------------------------------------------------------------------------------
# Answer scoring (report.py)


@pytest.mark.parametrize(
    "completion, answer",
    [
        ("42", "42"),
        ("  42\n", "42"),
        ("<think>7 + 5 = 12</think>12", "12"),
        ("<think>a</think> x <think>b</think>\n 9 ", "9"),  # the text after the last </think>
        ("no think close 5", "no think close 5"),
        ("<think>unfinished", "<think>unfinished"),
    ],
)
def test_extract_final_answer(completion, answer):
    assert evaluation.extract_final_answer(completion) == answer


def test_score_answers_known_accuracy():
    examples = [
        {"task": "add", "prompt": "p1", "answer": "3"},
        {"task": "add", "prompt": "p2", "answer": "5"},
        {"task": "sub", "prompt": "p3", "answer": "1"},
        {"task": "add", "prompt": "p4", "answer": "8"},
    ]
    completions = ["<think>1+2</think>3", "<think>2+3</think>6", " 1 ", "8 apples"]
    result = evaluation.score_answers(examples, completions, max_wrong_examples=1)
    assert (result["accuracy"], result["correct"], result["total"]) == (0.5, 2, 4)
    assert result["by_task"] == {
        "add": {"correct": 1, "total": 3, "accuracy": pytest.approx(1 / 3)},
        "sub": {"correct": 1, "total": 1, "accuracy": 1.0},
    }
    assert list(result["by_task"]) == ["add", "sub"]
    assert result["wrong_examples"] == [{**examples[1], "predicted": "6", "completion": "<think>2+3</think>6"}]
    assert len(evaluation.score_answers(examples, completions)["wrong_examples"]) == 2
    many = evaluation.score_answers(examples * 3, ["wrong"] * 12)
    assert many["accuracy"] == 0.0 and len(many["wrong_examples"]) == 5  # at most 5 by default
    assert evaluation.score_answers([], []) == {
        "accuracy": 0.0,
        "correct": 0,
        "total": 0,
        "by_task": {},
        "wrong_examples": [],
    }
    with pytest.raises(ValueError):
        evaluation.score_answers(examples, completions[:3])  # a missing completion is an error, not a skip


def test_pickle_is_what_the_hostile_test_relies_on(tmp_path):
    """Guard for the hostile-checkpoint test: plain pickle does run the payload."""
    marker = tmp_path / "ran"
    pickle.loads(pickle.dumps(Hostile(marker)))
    assert marker.exists()


# ----------------------------------------------------------------------------------------------
# GGUF metadata (export_gguf.py)


@pytest.mark.parametrize(
    "value, expected",
    [
        ("0123456789abcdef" * 4, True),
        ("0123456789ABCDEF" * 4, False),
        ("a" * 63, False),
        ("a" * 65, False),
        ("g" * 64, False),
        (None, False),
        (1, False),
    ],
)
def test_is_sha256(value, expected):
    from tinyllm.outputs import export_gguf

    assert export_gguf.is_sha256(value) is expected


@pytest.mark.parametrize(
    "shape, out_type, expected",
    [
        ((64,), "f16", "F32"),
        ((64,), "q8_0", "F32"),  # vectors (norms) stay f32
        ((64, 64), "f32", "F32"),
        ((64, 64), "f16", "F16"),
        ((64, 64), "bf16", "BF16"),
        ((64, 64), "q8_0", "Q8_0"),
        ((64, 48), "q8_0", "F16"),  # rows of 48 are no multiple of q8_0's 32: f16, as llama.cpp's converter does
        ((48, 64), "q8_0", "Q8_0"),  # only the row length matters
        ((64, 48), "f16", "F16"),
        ((64, 48), "bf16", "BF16"),
        ((2, 64, 48), "q8_0", "F16"),
    ],
)
def test_ggml_type_for(shape, out_type, expected):
    from tinyllm.outputs import export_gguf

    assert export_gguf.ggml_type_for(shape, out_type).name == expected


def test_model_name_is_the_run_folder_for_a_model_subfolder(tmp_path, monkeypatch):
    from tinyllm.outputs import export_gguf

    assert export_gguf.model_name(tmp_path / "my-run" / "model") == "my-run"
    assert export_gguf.model_name(tmp_path / "exported") == "exported"
    (tmp_path / "my-run").mkdir()
    monkeypatch.chdir(tmp_path / "my-run")
    assert export_gguf.model_name(Path(".")) == "my-run"  # a relative folder is resolved first


def gguf_metadata(tmp_path: Path, out_type: str, provenance: dict, eot_id: int | None = 5) -> dict:
    """add_metadata written to a GGUF without tensors, read back by gguf's own reader."""
    import gguf

    from tinyllm.model import config as model_config
    from tinyllm.outputs import export_gguf

    preset = model_config.PRESETS["tiny"]
    source = export_gguf.ModelSource(
        folder=tmp_path, config={}, weight_files=[], preset=preset, vocab_size=6, tied=True
    )
    vocab = export_gguf.Vocab(
        tokens=["<pad>", "<bos>", "<eos>", "a", "b", "ab"],
        token_types=[3, 3, 3, 1, 1, 1],
        merges=["a b"],
        bos_id=1,
        eos_id=2,
        pad_id=0,
        eot_id=eot_id,
        chat_template="{{ x }}",
        tokenizer_json_sha256="e" * 64,
    )
    path = tmp_path / f"{out_type}.gguf"
    writer = export_gguf.BulkArrayWriter(str(path), "qwen3")
    export_gguf.add_metadata(writer, source, vocab, out_type, "tiny-run", provenance, parameters=72_000_000)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    reader = gguf.GGUFReader(str(path))
    return {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}


def test_gguf_metadata_holds_every_field_llama_cpp_reads(tmp_path):
    import gguf

    from tinyllm.model import config as model_config

    preset = model_config.PRESETS["tiny"]
    fields = gguf_metadata(tmp_path, "f16", {"corpus_sha256": "c" * 64, "tokenizer_sha256": "d" * 64})
    expected = {
        "general.architecture": "qwen3",
        "general.type": "model",
        "general.name": "tiny-run",
        "general.description": "Qwen3 language model pretrained from scratch with tinyllm",
        "general.size_label": "72M",
        "general.file_type": int(gguf.LlamaFileType.MOSTLY_F16),
        "tinyllm.tokenizer_json_sha256": "e" * 64,
        "tinyllm.corpus_sha256": "c" * 64,
        "tinyllm.tokenizer_sha256": "d" * 64,
        "qwen3.context_length": preset.context,
        "qwen3.embedding_length": preset.hidden,
        "qwen3.block_count": preset.layers,
        "qwen3.feed_forward_length": preset.intermediate,
        "qwen3.attention.head_count": preset.heads,
        "qwen3.attention.head_count_kv": preset.kv_heads,
        "qwen3.attention.key_length": preset.head_dim,
        "qwen3.attention.value_length": preset.head_dim,
        "qwen3.rope.freq_base": pytest.approx(preset.rope_theta),
        "qwen3.attention.layer_norm_rms_epsilon": pytest.approx(preset.rms_norm_eps),
        "qwen3.vocab_size": 6,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": ["<pad>", "<bos>", "<eos>", "a", "b", "ab"],
        "tokenizer.ggml.token_type": [3, 3, 3, 1, 1, 1],
        "tokenizer.ggml.merges": ["a b"],
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.padding_token_id": 0,
        "tokenizer.ggml.eot_token_id": 5,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.ggml.add_eos_token": False,
        "tokenizer.chat_template": "{{ x }}",
    }
    assert fields == expected
    assert "general.quantization_version" not in fields  # only a quantized file has one


def test_gguf_metadata_of_a_q8_0_file_and_without_an_end_of_turn_token(tmp_path):
    import gguf

    fields = gguf_metadata(tmp_path, "q8_0", {}, eot_id=None)
    assert fields["general.file_type"] == int(gguf.LlamaFileType.MOSTLY_Q8_0)
    assert fields["general.quantization_version"] == gguf.GGML_QUANT_VERSION
    assert "tokenizer.ggml.eot_token_id" not in fields
    assert [name for name in fields if name.startswith("tinyllm.")] == ["tinyllm.tokenizer_json_sha256"]


# ----------------------------------------------------------------------------------------------
# The end of a step (train.plan_step_end) and of a run (train.failure_reason, store.RunStatus)

FLAGS = train.StepFlags(total_steps=100, save_every=10, save_seconds=60, max_hours=1, stop_after_steps=0)
CLOCK = train.StepClock(elapsed=100, since_save=5, slowest_step=1, slowest_eval=2, last_write=3)


# step, clock, flags -> save, stop, why
@pytest.mark.parametrize(
    "step, clock, flags, save, stop, why",
    [
        (7, CLOCK, FLAGS, False, False, None),  # nothing due
        (20, CLOCK, FLAGS, True, False, None),  # --save-every
        (7, train.StepClock(since_save=60), FLAGS, True, False, None),  # --save-seconds
        (7, train.StepClock(since_save=600), train.StepFlags(100), False, False, None),  # 0: never by time
        (7, CLOCK, train.StepFlags(100, new_best=True), True, False, None),  # a new best is recorded in a save
        (7, train.StepClock(signal=15), FLAGS, True, True, "stopped by SIGTERM"),
        (
            7,
            train.StepClock(signal=2, elapsed=3600),
            FLAGS,
            True,
            True,
            "stopped by SIGINT",
        ),  # the signal is named first
        # --max-hours 1: 3600 s less twice the slowest step, evaluation and write, less 10 s
        (
            7,
            train.StepClock(elapsed=3600 - 22, slowest_step=1, slowest_eval=2, last_write=3),
            FLAGS,
            True,
            True,
            "stopped by --max-hours budget",
        ),
        (
            7,
            train.StepClock(elapsed=3600 - 22.5, slowest_step=1, slowest_eval=2, last_write=3),
            FLAGS,
            False,
            False,
            None,
        ),
        (7, train.StepClock(elapsed=10**6), train.StepFlags(100), False, False, None),  # no --max-hours
        (30, CLOCK, train.StepFlags(100, stop_after_steps=30), True, True, "stopped by --stop-after-steps 30"),
        (31, CLOCK, train.StepFlags(100, stop_after_steps=30), True, True, "stopped by --stop-after-steps 30"),
        (29, CLOCK, train.StepFlags(100, stop_after_steps=30), False, False, None),
        (
            100,
            train.StepClock(signal=15, elapsed=10**6),
            train.StepFlags(100, stop_after_steps=50),
            True,
            False,
            None,
        ),  # the last step completes the run, whatever asked to stop
    ],
)
def test_plan_step_end(step, clock, flags, save, stop, why):
    assert train.plan_step_end(step, clock, flags) == train.StepEnd(save=save, stop=stop, why=why)


class FakeOSError(OSError):
    pass


CONTEXT = train.FailureContext(
    step=7,
    checkpoints=Path("run/checkpoints"),
    status_file=Path("run/run_status.json"),
    resume_command="python train.py --resume auto",
    rank=0,
    world=2,
    out_of_memory_advice="CUDA out of memory on T4: try --batch-size 1 --grad-accum 6",
)
KEPT = "; the last good checkpoint, step-00000006.pt, is intact (status FAILED in run/run_status.json)"
NONE_KEPT = "; no checkpoint had been written yet (status FAILED in run/run_status.json)"


# error, last checkpoint -> status, reason, the error line (None: the error goes on as it is)
@pytest.mark.parametrize(
    "error, last, status, reason, message",
    [
        (
            torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 GiB"),
            "step-00000006.pt",
            "FAILED",
            CONTEXT.out_of_memory_advice,
            CONTEXT.out_of_memory_advice + KEPT,
        ),
        (
            store.CheckpointWriteFailed("writing checkpoint run/checkpoints/step-00000007.pt: no space left on device"),
            "step-00000006.pt",
            "FAILED",
            "writing checkpoint run/checkpoints/step-00000007.pt: no space left on device",
            "training failed: writing checkpoint run/checkpoints/step-00000007.pt: no space left on device" + KEPT,
        ),
        (
            train.NonFiniteLoss("non-finite loss nan at step 7"),
            None,
            "FAILED",
            "non-finite loss nan at step 7",
            "training failed: non-finite loss nan at step 7" + NONE_KEPT,
        ),
        (
            FakeOSError(28, "No space left on device", "run/metrics.jsonl"),
            "step-00000006.pt",
            "FAILED",
            "run/metrics.jsonl: no space left on device",
            "training failed: run/metrics.jsonl: no space left on device" + KEPT,
        ),
        (OSError("a library's own OSError"), None, "FAILED", "OSError: a library's own OSError", None),  # no errno
        (
            RuntimeError(GLOO_RESET),
            "step-00000006.pt",
            "CHECKPOINTED_NEEDS_RESUME",
            "rank 1 stopped (Read error [127.0.0.1]:15748: Connection reset by peer); this rank exits too",
            "rank 1 stopped (Read error [127.0.0.1]:15748: Connection reset by peer); this rank exits too; "
            "resume with: python train.py --resume auto",
        ),
        (
            RuntimeError(GLOO_RESET),
            None,
            "FAILED",  # a lost rank before any checkpoint: nothing to resume from
            "rank 1 stopped (Read error [127.0.0.1]:15748: Connection reset by peer); this rank exits too",
            "rank 1 stopped (Read error [127.0.0.1]:15748: Connection reset by peer); this rank exits too; "
            "resume with: python train.py --resume auto",
        ),
        (
            KeyboardInterrupt(),
            "step-00000006.pt",
            "FAILED",
            "aborted by the user (second interrupt) at step 7; the last checkpoint is "
            f"{Path('run/checkpoints/step-00000006.pt')}; continue with: python train.py --resume auto",
            None,
        ),
        (
            KeyboardInterrupt(),
            None,
            "FAILED",
            "aborted by the user (second interrupt) at step 7; no checkpoint was "
            "saved yet; continue with: python train.py --resume auto",
            None,
        ),
        (ValueError("a bug"), "step-00000006.pt", "FAILED", "ValueError: a bug", None),  # the traceback stays
        (RuntimeError("index out of range"), "step-00000006.pt", "FAILED", "RuntimeError: index out of range", None),
    ],
)
def test_failure_reason(error, last, status, reason, message):
    failure = train.failure_reason(error, last, CONTEXT)
    assert (failure.status, failure.reason, failure.message) == (status, reason, message)
    assert failure.urgent == (status == "CHECKPOINTED_NEEDS_RESUME" or "rank 1 stopped" in reason)
    assert failure.say == (reason if isinstance(error, KeyboardInterrupt) else None)


def test_failure_reason_after_a_final_status_and_under_deterministic():
    context = dataclasses.replace(CONTEXT, recorded="COMPLETE")
    second = train.failure_reason(KeyboardInterrupt(), "step-00000007.pt", context)
    assert second.say == (
        "interrupted again after the run recorded COMPLETE; continue with: python train.py --resume auto"
    )
    full = train.failure_reason(train.NonFiniteLoss("x"), "step-00000007.pt", context)
    assert full.message.endswith("is intact (status COMPLETE in run/run_status.json)")  # the recorded status stays
    error = RuntimeError(
        "cumsum_cuda_kernel does not have a deterministic implementation, but you set "
        "'torch.use_deterministic_algorithms(True)'. You can ..."
    )
    assert train.failure_reason(error, None, CONTEXT).message is None  # without --deterministic: as it is
    failure = train.failure_reason(error, None, dataclasses.replace(CONTEXT, deterministic=True))
    assert failure.message == (
        "--deterministic: cumsum_cuda_kernel does not have a deterministic implementation; "
        "this run cannot be deterministic on this device: resume without --deterministic "
        "(a session setting)"
    )
    assert failure.reason == f"RuntimeError: {error}"
    four = dataclasses.replace(CONTEXT, world=4)
    assert train.failure_reason(RuntimeError(GLOO_RESET), "s", four).reason.startswith("another rank stopped (")


def test_run_status_keeps_a_final_status_and_writes_only_on_rank_0(tmp_path):
    status = store.RunStatus(tmp_path)
    assert status.previous == {} and status.final is None
    status.running(3, 10, loss=2.5)
    running = store.read_json(tmp_path / "run_status.json")
    assert running == {"status": "RUNNING", "step": 3, "total_steps": 10, "loss": 2.5, "updated": running["updated"]}
    assert status.final is None
    assert status.failed("FAILED", reason="x", step=3)  # no final status yet: recorded
    status.finished("COMPLETE", step=10, outputs={"report": "pending"})
    status.update(backup_complete=True)
    assert not status.failed("FAILED", reason="a second Ctrl-C during the report")  # COMPLETE is true: it stays
    written = store.read_json(tmp_path / "run_status.json")
    assert (written["status"], written["step"], written["backup_complete"]) == ("COMPLETE", 10, True)
    assert written["outputs"] == {"report": "pending"} and "updated" in written
    assert store.RunStatus(tmp_path).previous["status"] == "COMPLETE"
    other = tmp_path / "rank1"
    other.mkdir()
    store.RunStatus(other, enabled=False).running(1, 10)
    assert list(other.iterdir()) == []
    assert store.RunStatus(tmp_path, enabled=False).previous == {}  # only rank 0 reads what the last session left


def test_every_run_status_record_carries_the_resume_command(tmp_path):
    status = store.RunStatus(tmp_path, resume_command="python train.py --out run --resume auto")
    for write in (
        lambda: status.running(0, 10),
        lambda: status.running(3, 10, loss=2.5),
        lambda: status.failed("FAILED", reason="x", step=3),
        lambda: status.finished("COMPLETE", step=10),
        lambda: status.update(backup_complete=True),
    ):
        write()
        assert (
            store.read_json(tmp_path / "run_status.json")["resume_command"] == "python train.py --out run --resume auto"
        )


# what the last session left, the step this one resumes from -> the note (None: nothing to say)
@pytest.mark.parametrize(
    "previous, resumed, note",
    [
        ({}, 0, None),  # a new run
        ({"status": "CHECKPOINTED_NEEDS_RESUME", "step": 6}, 6, None),
        ({"status": "COMPLETE", "step": 12, "outputs": {"report": "done", "model": "done"}}, 12, None),
        ({"status": "FAILED", "step": 7}, 6, None),  # it said why itself
        (
            {"status": "RUNNING", "step": 9},
            8,
            "note: the previous session died without a word after step 9 "
            "(run_status.json still said RUNNING: killed, out of memory, or its machine went away); "
            "resuming from step 8; "
            "steps done again: 1 or more",
        ),
        (
            {"status": "RUNNING", "step": 5},
            8,
            "note: the previous session died without a word after step 8 "
            "(run_status.json still said RUNNING: killed, out of memory, or its machine went away); "
            "resuming from step 8; "
            "steps done again: 0 or more",
        ),  # saved after its last logged step
        (
            {"status": "RUNNING", "step": 4},
            0,
            "note: the previous session died without a word after step 4 "
            "(run_status.json still said RUNNING: killed, out of memory, or its machine went away); "
            "no checkpoint is left: "
            "starting at step 0; steps done again: 4 or more",
        ),
        (
            {"status": "COMPLETE", "step": 12, "outputs": {"report": "pending", "model": "pending"}},
            12,
            "note: the previous session ended before its report was made (run_status.json: COMPLETE, report pending); "
            "this session makes it at its end",
        ),
    ],
)
def test_previous_session_note(previous, resumed, note):
    assert store.previous_session_note(previous, resumed) == note


@pytest.mark.parametrize(
    "asked, found, outputs",
    [
        (False, None, {"report": "off", "model": "off"}),
        (True, None, {"report": "pending", "model": "pending"}),
        (
            True,
            {"report_errors": None, "model_files": {"model.safetensors": "ab"}},
            {"report": "done", "model": "done"},
        ),
        (True, {"report_errors": {"export": "OSError: disk full"}}, {"report": "failed", "model": "failed"}),
        (True, {"report_errors": {"samples": "x"}, "model_files": {"a": "b"}}, {"report": "failed", "model": "done"}),
    ],
)
def test_report_outputs(asked, found, outputs):
    assert train.report_outputs(asked, found) == outputs


def test_the_final_line_says_what_makes_a_missing_model():
    record = {
        "step": 12,
        "total_steps": 12,
        "test_loss": 1.5,
        "test": {},
        "report_errors": {"export": "OSError: x"},
        "outputs": {"report": "failed", "model": "failed"},
        "report_command": "python train.py --resume auto",
    }
    assert report.final_line(Path("run"), "COMPLETE", record) == (
        f"COMPLETE: step 12/12 | test loss 1.5000 | model/ not made (export: report_errors in "
        f"{Path('run/run_status.json')}) | make it again with: python train.py --resume auto"
    )
    record.update(outputs={"report": "done", "model": "done"}, report_command=None, report_errors=None)
    assert report.final_line(Path("run"), "COMPLETE", record) == "COMPLETE: step 12/12 | test loss 1.5000"


def test_the_final_line_gives_the_last_task_scores_and_their_step_when_older():
    record = {
        "step": 12,
        "total_steps": 12,
        "test_loss": 1.5,
        "test": {},
        "tasks_step": 12,
        "tasks": {"arc": {"acc": 0.31234, "chance": 0.25}, "mine": {"acc": 0.5, "chance": 0.5}},
    }
    assert report.final_line(Path("run"), "COMPLETE", record) == (
        "COMPLETE: step 12/12 | test loss 1.5000 | arc acc 0.312 (chance 0.250) | mine acc 0.500 (chance 0.500)"
    )
    record["tasks_step"] = 8  # a resume without --eval-tasks: the scores are the last ones taken
    assert "| arc acc 0.312 at step 8 (chance 0.250) |" in report.final_line(Path("run"), "COMPLETE", record)


# ----------------------------------------------------------------------------------------------
# In-loop --eval-tasks: lm-eval's encoding and scoring rules, and when the tasks are scored.


def test_encode_pair_moves_trailing_spaces_and_prefixes_an_empty_context():
    encode = lambda text: [ord(character) for character in text]  # noqa: E731 (one token per character)
    assert evaluation.encode_pair("ab ", "c", encode, 1) == ([97, 98], [32, 99])
    assert evaluation.encode_pair("ab", " c", encode, 1) == ([97, 98], [32, 99])
    assert evaluation.encode_pair("", " c", encode, 1) == ([1], [32, 99])
    assert evaluation.encode_pair("", "\x01c", encode, 1) == ([1], [99])  # starts with the prefix already
    rows = evaluation.choice_rows(
        [{"context": "abcdef", "choices": ["x", "yz"], "answer": 0}, {"context": "", "choices": ["q"], "answer": 0}],
        encode,
        1,
        4,
    )
    assert rows == [
        ([100, 101, 102, 32, 120], 2),
        ([101, 102, 32, 121, 122], 3),  # cut to max_length + 1
        ([1, 32, 113], 2),
    ]  # an empty context: the prefix token


def test_choice_counts_score_by_sum_by_character_and_by_byte():
    items = [
        {"choices": ["a", "bbbb"], "answer": 1},
        {"choices": ["é", "ab"], "answer": 0},
        {"choices": ["x", "y", "z"], "answer": 2},
    ]
    # item 1: sums pick a, per character bbbb; item 2: per character "é" (-1.5 over 1) loses to "ab"
    # (-2 over 2), per byte it wins (-1.5 over 2 bytes); item 3: a tie goes to the first choice
    counts = evaluation.choice_counts(items, [-1.0, -2.0, -1.5, -2.0, -1.0, -1.0, -1.0])
    assert counts == [1.0, 1.0, 2.0, 3.0]
    tasks = [evaluation.LoopTask("t", tuple(items))]
    assert evaluation.loop_scores(tasks, [counts]) == {
        "t": {"acc": 1 / 3, "acc_norm": 1 / 3, "acc_bytes": 2 / 3, "n": 3, "chance": (0.5 + 0.5 + 1 / 3) / 3}
    }


@pytest.mark.parametrize(
    "step, total, every, expected",
    [
        (4, 12, 4, True),
        (5, 12, 4, False),
        (6, 12, 3, True),
        (8, 12, 3, False),
        (12, 12, 5, True),  # at the last step, even when off (0) by count or not a multiple
        (12, 12, 0, True),
        (5, 12, 0, False),
        (3, 12, 1, True),  # every step
        (4, 12, None, False),  # off: no tasks
        (12, 12, None, False),
    ],
)
def test_due_table(step, total, every, expected):
    assert callbacks.due(step, total, every) is expected


@pytest.mark.parametrize(
    "validation_every, total, task_tokens, step_tokens, expected",
    [
        (250, 1400, 4096 * 15, 4096, 250),  # 15 steps' tokens scored cost 5 steps: 2% of 250 steps
        (250, 1400, 4096 * 45, 4096, 500),  # cost 15 steps: 5% of 300 steps, so every second validation
        (30, 150, 88_000, 4096, 0),  # a short run: only at its end
        (4, 12, 960, 128, 0),
        (4, 100, 960, 128, 52),  # 960 / (0.15 * 128) = 50 steps: the next multiple of 4
        (0, 100, 10, 128, 0),  # validation only at the end: the tasks too
    ],
)
def test_default_tasks_every_keeps_the_scoring_near_5_percent(
    validation_every, total, task_tokens, step_tokens, expected
):
    assert evaluation.default_tasks_every(validation_every, total, task_tokens, step_tokens) == expected


# validation every, tasks every (default_tasks_every's), tokens scored, tokens per step -> the note at the start
@pytest.mark.parametrize(
    "validation_every, tasks_every, task_tokens, step_tokens, note",
    [
        (250, 250, 4096 * 15, 4096, None),  # together: nothing to explain
        (0, 0, 10, 128, None),  # both only at the end
        (
            250,
            500,
            4096 * 45,
            4096,
            "note: --eval-tasks are scored every 500 steps (with one validation in 2), not "
            "with each validation (every 250 steps): one scoring reads 184,320 tokens, "
            "about 6% of the training between "
            "two validations, and the default keeps it near 5%; --eval-tasks-every N chooses",
        ),
        (
            30,
            0,
            88_000,
            4096,
            "note: --eval-tasks are scored only at the end, not with each validation (every 30 "
            "steps): one scoring reads 88,000 tokens, about 24% of the training between two validations, "
            "and the default "
            "keeps it near 5%; --eval-tasks-every N chooses",
        ),
    ],
)
def test_the_tasks_cadence_note_says_when_and_why(validation_every, tasks_every, task_tokens, step_tokens, note):
    assert evaluation.tasks_cadence_note(validation_every, tasks_every, task_tokens, step_tokens) == note


def test_a_file_descriptor_points_at_a_file_for_a_block_and_back(tmp_path):
    """What a child process writes to fd 2 inside the block lands in the file (as the resource tracker's
    warning does); after it, fd 2 is what it was."""
    import os
    import subprocess
    import sys

    from tinyllm.common import file_descriptor_to

    before = os.fstat(2)
    with open(tmp_path / "err", "wb") as target, file_descriptor_to(2, target):
        subprocess.run([sys.executable, "-c", "import os; os.write(2, b'to the file')"], check=True)
    after = os.fstat(2)
    assert (tmp_path / "err").read_bytes() == b"to the file"
    assert (after.st_dev, after.st_ino) == (before.st_dev, before.st_ino)
