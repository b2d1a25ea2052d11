"""Corpus builder: raw documents -> a verified corpus of token shards (see DESIGN.md; its format: corpus_format.py).

    python data.py --demo --out corpus/demo
    python data.py --data docs/ chats.jsonl --out corpus/mine --vocab-size 33069
    python data.py --verify corpus/mine

The recipe (`build_corpus`): resolve the inputs, stream their records through schema
detection, cleaning, scope and de-duplication (`iter_documents`), train a BPE on a sample
of that stream (or reuse `--tokenizer`), then stream it again through the Rust tokenizer
into one token stream per split, cut into shards. Everything is written in a temporary
folder beside `--out` and renamed into place at the end; `corpus_manifest.json` is the
last file written, so its presence means the corpus is complete.
"""

from __future__ import annotations

import argparse
import functools
import glob
import gzip
import hashlib
import itertools
import json
import os
import re
import shutil
import sys
import threading
import time
import zlib
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, fields
from dataclasses import replace as dataclass_replace
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from tinyllm.common import (
    ArgumentParser,
    UserError,
    add_options,
    atomic_folder,
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
    check_options,
    config_argv,
    file_descriptor_to,
    human_count,
    not_negative,
    option,
    os_error_text,
    positive,
    run_main,
    say,
    sha256_bytes,
    sha256_file,
    sha256_tree,
    stop_on_sigterm,
)
from tinyllm.data.corpus_format import (
    BOS,
    CHAT_TEMPLATE,
    CORPUS_MANIFEST,
    DATA_CARD,
    DOCUMENT_INDEX_DTYPE,
    EOS,
    FORMAT_VERSION,
    IM_END,
    IM_START,
    MASK_ASSISTANT,
    MASK_CLASSES,
    MASK_PROMPT,
    MASK_TEXT,
    PAD,
    QWEN2_SPLIT_PATTERN,
    SOURCE_MANIFEST,
    SOURCE_NAME,
    SPECIAL_TOKENS,
    SPLITS,
    THINK_CLOSE,
    THINK_OPEN,
    TOKENIZER_DIR,
    clean_text,
    document_index_name,
    load_tokenizer,
    mask_name,
    message_turns,
    reasoning_of,
    render_chat,
    render_turns,
    shard_name,
    stream_key,
    token_dtype,
    tokenizer_folder,
    verify_corpus,
    vocabulary_sha256,
)
from tinyllm.data.demo_corpus import DEMO_BUILD_DEFAULTS, DEMO_EVAL_FILE, DEMO_SEED, DEMO_VOCAB_SIZE, demo_data

# ----------------------------------------------------------------------------------------------
# Tokenizer: byte-level BPE whose pre-tokenizer llama.cpp reproduces exactly ("qwen2").

DEFAULT_VOCAB_SIZE = 33_069  # a large corpus's: think72 is then exactly 72,000,000 parameters


def new_bpe_tokenizer():
    """An untrained byte-level BPE with the Qwen2 split, ByteLevel bytes and decoder."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    tokenizer = Tokenizer(models.BPE(byte_fallback=False))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def train_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: str | Path, min_frequency: int = 2):
    """Train the BPE on `texts` (streamed) and save a folder AutoTokenizer loads.

    Returns (hf_tokenizer, reached_vocab_size). When the text is too small to reach
    `vocab_size`, BPE stops early and the smaller vocabulary is kept.
    """
    from tokenizers import AddedToken, pre_tokenizers, trainers

    tokenizer = new_bpe_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    hf_tokenizer = wrap_tokenizer(tokenizer)
    hf_tokenizer.save_pretrained(str(out_dir))
    return hf_tokenizer, tokenizer.get_vocab_size()


def wrap_tokenizer(tokenizer):
    """Wrap a `tokenizers.Tokenizer` as a transformers fast tokenizer with our special tokens."""
    from transformers import PreTrainedTokenizerFast

    for position, token in enumerate(SPECIAL_TOKENS):
        if tokenizer.token_to_id(token) != position:
            raise UserError(f"special token {token} must have id {position}, has {tokenizer.token_to_id(token)}")
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        extra_special_tokens=[IM_START, IM_END, THINK_OPEN, THINK_CLOSE],
        chat_template=CHAT_TEMPLATE,
        model_max_length=1 << 30,
        clean_up_tokenization_spaces=False,
        add_bos_token=False,
        add_eos_token=False,
    )


# ----------------------------------------------------------------------------------------------
# Inputs: files, folders, globs, datasets.save_to_disk folders and hf:NAME[:CONFIG][:SPLIT].

FILE_KINDS = {
    ".jsonl": "jsonl",
    ".jsonl.gz": "jsonl",
    ".json": "json",
    ".txt": "text",
    ".md": "text",
    ".parquet": "parquet",
}
MAX_WARNINGS_PER_SOURCE = 5


@dataclass
class Source:
    """One input: a file, a saved dataset folder, a Hub dataset, or generated records."""

    name: str  # as the user wrote it (or as found in a folder): used in messages and manifests
    kind: str  # jsonl | json | text | parquet | arrow | hf | generated
    path: Path | None = None
    records: list | None = None  # kind == "generated": the records themselves
    label: str | None = None  # its source label (--data NAME=PATH, --source-label stem): a stream of its own


def file_kind(path: Path) -> str | None:
    name = path.name.lower()
    for suffix, kind in FILE_KINDS.items():
        if name.endswith(suffix):
            return kind
    return None


def is_saved_dataset(folder: Path) -> bool:
    """A folder written by datasets' save_to_disk (a Dataset or a DatasetDict)."""
    return (folder / "dataset_dict.json").is_file() or (
        (folder / "state.json").is_file() and (folder / "dataset_info.json").is_file()
    )


def folder_sources(folder: Path) -> tuple[list[Source], Counter]:
    """Every supported, non-empty file below `folder` (sorted, hidden names skipped); saved datasets as one
    source. And the files left out, counted by why: "empty" or their suffix ("no suffix" without one)."""
    found, skipped = [], Counter()
    for root, dirs, files in os.walk(folder):
        root_path = Path(root)
        if is_saved_dataset(root_path):
            found.append(Source(str(root_path), "arrow", root_path))
            dirs[:] = []
            continue
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            path = root_path / name
            if name.startswith("."):
                continue
            if not file_kind(path):
                skipped[path.suffix.lower() or "no suffix"] += 1
            elif path.is_file() and path.stat().st_size == 0:
                skipped["empty"] += 1
            else:
                found.append(Source(str(path), file_kind(path), path))
    return sorted(found, key=lambda source: source.name), skipped


# A file's kind is its suffix: plain text without one (LICENSE, COPYING, /usr/share/common-licenses/*) is not guessed.
NO_SUFFIX_HINT = "a plain-text file without a suffix (LICENSE, COPYING) is read when named NAME.txt (a copy or a link)"


def skipped_text(skipped: Counter) -> str:
    """ "3 files skipped (1 .html, 1 empty, 1 no suffix)": what a folder input left out, the commonest first."""
    commonest = sorted(skipped.items(), key=lambda item: (-item[1], item[0]))[:6]
    kinds = ", ".join(f"{count} {kind}" for kind, count in commonest)
    more = ", ..." if len(skipped) > 6 else ""
    return f"{sum(skipped.values())} files skipped ({kinds}{more})"


def skipped_note(folder: Path, skipped: Counter) -> str:
    """One line naming what a folder input left out (the most common kinds first)."""
    return f"note: --data {folder}: {skipped_text(skipped)}; read: non-empty {', '.join(FILE_KINDS)} files"


def input_label(spec: str, label_by_stem: bool) -> tuple[str | None, str]:
    """(source label, the input) of a --data value: `NAME=PATH` names it; with --source-label stem an
    input without a name gets its file or folder name without suffixes (`docs/kjv.jsonl` -> kjv)."""
    name, equals, rest = spec.partition("=")
    if equals and SOURCE_NAME.fullmatch(name) and not Path(os.path.expanduser(spec)).exists():
        return name, rest
    if not label_by_stem:
        return None, spec
    stem = re.sub(r"[^A-Za-z0-9_.-]", "_", Path(spec.removeprefix("hf:").rstrip("/")).name.split(".")[0])
    return stem or "input", spec


def resolve_inputs(specs: Iterable[str], label_by_stem: bool = False, notes: list[str] | None = None) -> list[Source]:
    """Turn --data arguments into sources, failing clearly on anything missing or unsupported; a line for each
    input that left files out (empty or of another type) goes to `notes`."""
    sources = []
    for labelled in specs:
        label, spec = input_label(labelled, label_by_stem)
        sources.extend(dataclass_replace(source, label=label) for source in resolve_input(spec, notes))
    if len({source.label is None for source in sources}) > 1:
        unnamed = next(source.name for source in sources if source.label is None)
        raise UserError(
            f"--data {unnamed}: with source labels every input needs one (NAME={unnamed}, or --source-label stem)"
        )
    unique, seen = [], set()
    for source in sources:
        key = source.path.resolve() if source.path else source.name
        if key not in seen:
            seen.add(key)
            unique.append(source)
    for source in unique:
        if source.path and source.path.is_file() and source.path.stat().st_size == 0:
            raise UserError(f"input file {source.path} is empty; remove it from --data")
    return unique


def resolve_input(spec: str, notes: list[str] | None = None) -> list[Source]:
    """The sources of one --data value (a folder: every supported, non-empty file below it)."""
    notes = [] if notes is None else notes
    sources = []
    if spec.startswith("hf:"):
        if not spec[3:]:
            raise UserError("--data hf: needs a dataset name, e.g. hf:roneneldan/TinyStories")
        return [Source(spec, "hf")]
    if any(char in spec for char in "*?["):
        matches = sorted(glob.glob(os.path.expanduser(spec), recursive=True))
        if not matches:
            raise UserError(f"--data {spec}: no files match this pattern")
        paths = [Path(match) for match in matches]
        empty = [path for path in paths if path.is_file() and path.stat().st_size == 0]
        if empty and len(empty) == len(paths):
            raise UserError(f"--data {spec}: every file this pattern matches is empty")
        if empty:
            notes.append(f"note: --data {spec}: {len(empty)} empty files skipped")
            paths = [path for path in paths if path not in empty]
    else:
        paths = [Path(os.path.expanduser(spec))]
    for path in paths:
        if not path.exists():
            raise UserError(f"input not found: {path}")
        if path.is_dir():
            found, skipped = folder_sources(path)
            if not found:
                raise UserError(
                    f"input folder {path} holds no non-empty {', '.join(FILE_KINDS)} files "
                    "and is not a datasets.save_to_disk folder"
                    + (f"; {skipped_text(skipped)}" if skipped else "")
                    + (f"; {NO_SUFFIX_HINT}" if skipped.get("no suffix") else "")
                )
            if skipped:
                notes.append(skipped_note(path, skipped))
            sources.extend(found)
        elif file_kind(path) is None:
            raise UserError(
                f"input {path}: unsupported file type; expected one of {', '.join(FILE_KINDS)}"
                + (
                    f"; {NO_SUFFIX_HINT}" if not path.suffix[1:] or path.suffix[1:].isdigit() else ""
                )  # GPL-3, Apache-2.0
            )
        else:
            sources.append(Source(str(path), file_kind(path), path))
    return sources


class RecordError(Exception):
    """A record that cannot be read or understood; `reason` is the counter it is dropped under."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


BOM = "\ufeff"  # a byte order mark some Windows tools write at a UTF-8 file's start: not part of the text


def iter_jsonl(path: Path) -> Iterator[tuple[str, Any]]:
    """(file:line, record or RecordError) for each non-blank line; never stops at a bad line."""
    for number, raw in enumerate(jsonl_lines(path), start=1):
        location = f"{path}:{number}"
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            yield location, RecordError("invalid_utf8", f"{location}: invalid UTF-8 (byte {error.start})")
            continue
        if number == 1:
            line = line.removeprefix(BOM)
        line = line.rstrip("\r\n")  # else an unterminated string is reported as a bad control character
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            record = RecordError("malformed_json", f"{location}: malformed JSON ({json_error(error)})")
        except RecursionError:
            record = RecordError("malformed_json", f"{location}: malformed JSON (nested too deeply)")
        yield location, record


def jsonl_lines(path: Path) -> Iterator[bytes]:
    """The raw lines of a JSONL file, gunzipped where its name ends in .gz; a compressed file that cannot be read
    to its end (cut short by an interrupted download, or not gzip at all) is one UserError naming it."""
    if not path.name.lower().endswith(".gz"):
        with open(path, "rb") as handle:
            yield from handle
        return
    try:
        with gzip.open(path, "rb") as handle:
            yield from handle
    except (EOFError, gzip.BadGzipFile, zlib.error) as error:
        raise UserError(f"input {path} is not a readable gzip file: {error}") from None


JSON_KINDS = {dict: "an object", list: "a list", str: "text", bool: "true or false", int: "a number", float: "a number"}


def json_kind(value: Any) -> str:
    """What a JSON value is in JSON's words ('a number', 'null'), for messages about a record's shape."""
    return "null" if value is None else JSON_KINDS.get(type(value), f"a {type(value).__name__}")


def json_error(error: json.JSONDecodeError) -> str:
    """'Unterminated string starting at column 10', 'Expecting value at column 1' (one line, no char offset)."""
    where = "column" if error.msg.endswith(" at") else "at column"
    return f"{error.msg} {where} {error.colno}"


def read_utf8(path: Path) -> str | RecordError:
    data = path.read_bytes()
    try:
        return data.decode("utf-8").removeprefix(BOM)
    except UnicodeDecodeError as error:
        return RecordError("invalid_utf8", f"{path}: invalid UTF-8 at byte {error.start}")


def iter_json(path: Path) -> Iterator[tuple[str, Any]]:
    """A .json file: a list of records, a single record, or {"data": [...]} style wrappers."""
    text = read_utf8(path)
    if isinstance(text, RecordError):
        yield str(path), text
        return
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        yield (
            f"{path}:{error.lineno}",
            RecordError("malformed_json", f"{path}:{error.lineno}: malformed JSON ({error.msg})"),
        )
        return
    except RecursionError:
        yield str(path), RecordError("malformed_json", f"{path}: malformed JSON (nested too deeply)")
        return
    if isinstance(data, dict):
        lists = [
            value
            for value in data.values()
            if isinstance(value, list) and value and all(isinstance(item, dict) for item in value)
        ]
        data = lists[0] if len(lists) == 1 and not looks_like_record(data) else [data]
    for index, record in enumerate(data if isinstance(data, list) else [data]):
        yield f"{path}[{index}]", record


def iter_parquet(path: Path) -> Iterator[tuple[str, Any]]:
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except Exception as error:  # pyarrow raises several types for broken files
        raise UserError(f"input {path} is not a readable parquet file: {error}") from None
    index = 0
    for batch in parquet.iter_batches(batch_size=4096):
        for record in batch.to_pylist():
            yield f"{path} row {index}", record
            index += 1


def iter_dataset_rows(dataset, label: str) -> Iterator[tuple[str, Any]]:
    for index, record in enumerate(dataset):
        yield f"{label} row {index}", record


def iter_saved_dataset(path: Path) -> Iterator[tuple[str, Any]]:
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as error:
        raise UserError(f"input {path} looks like a saved dataset but does not load: {error}") from None
    if isinstance(loaded, datasets.DatasetDict):
        for split in sorted(loaded):
            yield from iter_dataset_rows(loaded[split], f"{path}[{split}]")
    else:
        yield from iter_dataset_rows(loaded, str(path))


def parse_hf_spec(spec: str) -> tuple[str, str | None, str]:
    """hf:NAME[:CONFIG][:SPLIT] -> (name, config or None, split, default train)."""
    parts = spec[3:].split(":")
    if len(parts) > 3:
        raise UserError(f"--data {spec}: expected hf:NAME[:CONFIG][:SPLIT]")
    name, config, split = (parts + [None, None])[:3]
    return name, config or None, split or "train"


def iter_hub_dataset(spec: str) -> Iterator[tuple[str, Any]]:
    """A Hub dataset, streamed (nothing is downloaded up front). A local dataset folder works too."""
    import datasets

    name, config, split = parse_hf_spec(spec)
    if is_saved_dataset(Path(name)):
        raise UserError(f"--data {spec}: a datasets.save_to_disk folder is read without hf: (--data {name})")
    try:
        streamed = datasets.load_dataset(name, config, split=split, streaming=True)
    except Exception as error:  # offline, missing, gated, bad config...
        raise UserError(f"--data {spec}: could not open the dataset: {type(error).__name__}: {error}") from None
    yield from iter_dataset_rows(streamed, spec)


def iter_source(source: Source) -> Iterator[tuple[str, Any]]:
    """(location, record) pairs of one source; a record may be a RecordError to count."""
    if source.kind == "jsonl":
        return iter_jsonl(source.path)
    if source.kind == "json":
        return iter_json(source.path)
    if source.kind == "text":
        return iter([(source.name, read_utf8(source.path))])
    if source.kind == "parquet":
        return iter_parquet(source.path)
    if source.kind == "arrow":
        return iter_saved_dataset(source.path)
    if source.kind == "hf":
        return iter_hub_dataset(source.name)
    return ((f"{source.name}[{index}]", record) for index, record in enumerate(source.records))


def source_fingerprint(source: Source) -> str | None:
    """sha256 of what a source holds (file, folder or generated records); None for the Hub."""
    if source.kind == "arrow":
        return sha256_tree(source.path)
    if source.path is not None:
        return sha256_file(source.path)
    if source.records is not None:
        return sha256_bytes("".join(json.dumps(r, sort_keys=True) + "\n" for r in source.records).encode())
    return None


# ----------------------------------------------------------------------------------------------
# Record schemas -> documents, each a chat or plain text; chats are rendered with the tokenizer's
# chat template by corpus_format's chat render, which inference prompts share, so the two match
# exactly. Only the template's own markers (and <think>...</think> around reasoning) become control
# tokens: content stays text.

ROLE_ALIASES = {
    "user": "user",
    "human": "user",
    "prompter": "user",
    "customer": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "bot": "assistant",
    "model": "assistant",
    "chatgpt": "assistant",
    "ai": "assistant",
    "claude": "assistant",
    "gemini": "assistant",
    "system": "system",
    "developer": "system",
    "tool": "tool",
    "function": "tool",
    "ipython": "tool",
}
PAIR_SCHEMAS = (
    ("prompt", "response"),
    ("prompt", "completion"),
    ("question", "answer"),
    ("instruction", "output"),
    ("instruction", "response"),
    ("query", "response"),
)
TEXT_KEYS = ("text", "content")
KNOWN_SHAPES = "text/content, messages, conversations, " + ", ".join(f"{a}/{b}" for a, b in PAIR_SCHEMAS)


def looks_like_record(data: dict) -> bool:
    return (
        "messages" in data
        or "conversations" in data
        or any(key in data for key in TEXT_KEYS)
        or any(a in data and b in data for a, b in PAIR_SCHEMAS)
    )


def content_text(content: Any) -> str:
    """Message content as text: a string, or OpenAI-style parts [{"type": "text", "text": ...}]."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") if isinstance(part, dict) else str(part) for part in content)
    if content is None:
        return ""
    raise RecordError("unknown_schema", f"message content is {json_kind(content)}, expected text")


def chat_turns(turns: Any, role_key: str, content_key: str) -> list[dict]:
    """[{role, content}] from `messages` or ShareGPT `conversations`, roles relabeled."""
    if not isinstance(turns, list) or not turns:
        raise RecordError("unknown_schema", "conversation is not a non-empty list of turns")
    messages = []
    for turn in turns:
        if not isinstance(turn, dict) or role_key not in turn:
            keys = sorted(turn) if isinstance(turn, dict) else type(turn).__name__
            raise RecordError("unknown_schema", f"a turn lacks '{role_key}' (saw {keys})")
        role = ROLE_ALIASES.get(str(turn[role_key]).strip().lower())
        if role is None:
            raise RecordError(
                "unknown_role", f"unknown role {turn[role_key]!r} (known: {', '.join(sorted(ROLE_ALIASES))})"
            )
        content = content_text(turn.get(content_key))
        messages.append({"role": role, "content": content, "reasoning": reasoning_of(turn)})
    return messages


def record_messages(record: dict) -> list[dict] | None:
    """The conversation in a record, or None when it is plain text."""
    if "messages" in record:
        return chat_turns(record["messages"], "role", "content")
    if "conversations" in record:
        first = (
            record["conversations"][0] if isinstance(record["conversations"], list) and record["conversations"] else {}
        )
        role_key = "from" if isinstance(first, dict) and "from" in first else "role"
        content_key = "value" if isinstance(first, dict) and "value" in first else "content"
        return chat_turns(record["conversations"], role_key, content_key)
    for prompt_key, answer_key in PAIR_SCHEMAS:
        if prompt_key in record and answer_key in record:
            prompt = content_text(record[prompt_key])
            if isinstance(record.get("input"), str) and record["input"].strip():
                prompt = f"{prompt}\n\n{record['input']}"
            messages = (
                [{"role": "system", "content": record["system"], "reasoning": None}]
                if isinstance(record.get("system"), str) and record["system"].strip()
                else []
            )
            messages.append({"role": "user", "content": prompt, "reasoning": None})
            messages.append(
                {"role": "assistant", "content": content_text(record[answer_key]), "reasoning": reasoning_of(record)}
            )
            return messages
    return None


def record_text(record: Any) -> str:
    if isinstance(record, str):
        return record
    for key in TEXT_KEYS:
        if isinstance(record.get(key), str):
            return record[key]
    for key in TEXT_KEYS:
        if key in record:
            raise RecordError("unknown_schema", f"'{key}' is {json_kind(record[key])}, expected text")
    raise RecordError(
        "unknown_schema", f"unknown record shape with keys {sorted(record)}; expected one of: {KNOWN_SHAPES}"
    )


# ----------------------------------------------------------------------------------------------
# Scopes, de-duplication and split assignment (the cleaning and the chat render: corpus_format.py).

# Named document filters (--scope): name -> (what it keeps, predicate on (kind, pieces)).
SCOPES: dict[str, tuple[str, Callable[[str, list[str]], bool]]] = {
    "full": ("every document", lambda kind, pieces: True),
    "chat": ("conversation-like records only", lambda kind, pieces: kind == "chat"),
    "text": ("plain text only", lambda kind, pieces: kind == "text"),
    "reasoning": (
        "conversations with <think> reasoning",
        lambda kind, pieces: kind == "chat" and THINK_OPEN in pieces[1::2],
    ),
}


# Message-wise tokenization (as torchtune and axolotl do): the template is rendered around numbered
# placeholders, so every special-token string in that skeleton is the template's own markup; the
# content that fills the placeholders is tokenized as text, whatever it contains. Private-use code
# points never occur in a template, and the content is filled in after the skeleton is cut.
PLACEHOLDER = "\ue000{}\ue001"
PLACEHOLDER_PATTERN = re.compile("\ue000([0-9]+)\ue001")
CONTROL_TOKEN_PATTERN = re.compile("(" + "|".join(map(re.escape, SPECIAL_TOKENS)) + ")")


@functools.lru_cache(maxsize=1024)
def chat_skeleton(chat_template: str, shape: tuple) -> tuple[str, ...]:
    """The template rendered around placeholders and cut at its control tokens (odd positions).

    `shape` is ((role, markers inside the content), ...) per turn; there are few, so it is cached.
    """
    numbers = itertools.count()
    messages = []
    for role, markers in shape:
        content = PLACEHOLDER.format(next(numbers))
        for marker in markers:
            content += marker + PLACEHOLDER.format(next(numbers))
        messages.append({"role": role, "content": content})
    return tuple(CONTROL_TOKEN_PATTERN.split(render_chat(messages, chat_template)))


def chat_pieces(turns: list[dict], chat_template: str) -> list[str]:
    """The rendered chat as pieces [text, control token, text, ..., text].

    `turns` are {"role", "parts"}, parts being the content as [text, marker, text, ...].
    """
    shape = tuple((turn["role"], tuple(turn["parts"][1::2])) for turn in turns)
    texts = [text for turn in turns for text in turn["parts"][::2]]
    pieces = list(chat_skeleton(chat_template, shape))
    for position in range(0, len(pieces), 2):
        pieces[position] = PLACEHOLDER_PATTERN.sub(lambda found: texts[int(found[1])], pieces[position])
    return pieces


def document_hash(text: str) -> tuple[int, float]:
    """(de-duplication key, position in [0, 1) that picks the split), both from the text alone."""
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest()
    return int.from_bytes(digest[:8], "little"), int.from_bytes(digest[8:], "little") / 2.0**64


def split_of(position: float, val_fraction: float, test_fraction: float) -> str:
    if position < val_fraction:
        return "validation"
    if position < val_fraction + test_fraction:
        return "test"
    return "train"


@dataclass
class SourceStats:
    """Per-source counters for source_manifest.json."""

    records_read: int = 0
    documents_kept: int = 0
    dropped: Counter = field(default_factory=Counter)
    warnings: int = 0
    also_in: Counter = field(default_factory=Counter)  # kept documents an earlier source label has too, by label


WHAT, BUILD = "what to do (one of)", "building a corpus"  # data.py's option groups

# Defaults sized to the input (sized_build_defaults): a larger share held out of a small corpus (enough documents
# to validate on), and the vocabulary bench/bench_vocab.py measured best (docs/data.md#the-vocabulary): from 1 MB to
# 100 MB 8,192, within 1% of the best of 1,024-32,768 for tiny and nano at equal wall time on two texts of ~4 MB
# (2,048, the rule before, 3-7% behind); under 1 MB 512, the best for nano at 0.6 MB (the model such a corpus trains
# best; tiny would take 2,048-8,192), and from 100 MB as before. BPE stops early where the text supports fewer.
# (input bytes below, vocab_size, val_fraction = test_fraction)
SIZED_DEFAULTS = (
    (1_000_000, 512, 0.05),
    (10_000_000, 8_192, 0.05),
    (100_000_000, 8_192, 0.02),
    (1_000_000_000, 16_384, 0.01),
)


# The vocabulary a model measured best at, at equal wall time (bench/bench_vocab.py, three texts of 4-4.8 MB, two
# seeds; docs/data.md#the-vocabulary): tiny and nano at 8,192 (SIZED_DEFAULTS' from 1 MB; within 1% of the best),
# micro (4.7M non-embedding parameters) at 16,384 or more (8,192 0.1-2.5% behind, 16,384 within 0.6% of the best).
# Larger presets take micro's (not measured: the optimum grew with the model, its head a smaller part of its step).
# The presets by name, smallest first: tinyllm.model.config.PRESETS' (a test keeps them so; data imports no model).
PRESET_NAMES = ("tiny", "nano", "micro", "think72", "small125", "medium350")
LARGE_VOCAB_PRESETS = PRESET_NAMES[PRESET_NAMES.index("micro") :]
LARGE_MODEL_VOCAB = 16_384


def model_vocab_size(vocab_size: int, preset: str | None) -> int:
    """The vocabulary for a corpus the model `preset` will train (None: not said) where its size gave
    `vocab_size`: micro and larger take LARGE_MODEL_VOCAB over 8,192 up to it (what was measured); otherwise
    `vocab_size` as it is."""
    if preset in LARGE_VOCAB_PRESETS and 8_192 <= vocab_size < LARGE_MODEL_VOCAB:
        return LARGE_MODEL_VOCAB
    return vocab_size


def sized_build_defaults(input_bytes: int | None, preset: str | None = None) -> dict:
    """--vocab-size, --val-fraction and --test-fraction for about `input_bytes` of input (None: unknown, e.g. a Hub
    dataset: the defaults of a large corpus), for the model `preset` will train (None: not said, tiny's and nano's
    rule). data.py uses them for the options not given; so does the notebook."""
    if preset is not None and preset not in PRESET_NAMES:
        raise UserError(f"unknown preset {preset!r}; choose one of {', '.join(PRESET_NAMES)}")
    for below, vocab_size, fraction in SIZED_DEFAULTS if input_bytes is not None else ():
        if input_bytes < below:
            vocab_size = model_vocab_size(vocab_size, preset)
            return {"vocab_size": vocab_size, "val_fraction": fraction, "test_fraction": fraction}
    return {"vocab_size": DEFAULT_VOCAB_SIZE, "val_fraction": 0.01, "test_fraction": 0.01}


def train_split_empty(splits: dict[str, dict]) -> str:
    """Why a build left nothing to train on: every document went to a held-out split, which a document's hash
    picks (a corpus of a document or two can lose them all), or the fractions asked for it."""
    held_out = {name: info["documents"] for name, info in splits.items() if name != "train" and info["documents"]}
    where = " and ".join(f"{count:,} in {name}" for name, count in held_out.items())
    return (
        f"no documents landed in the train split (of {sum(held_out.values()):,} kept: {where}); each document goes "
        "to one split by its hash, so a corpus of few documents needs more of them (split a long text into "
        "several records), or a lower --val-fraction / --test-fraction"
    )


def input_bytes(sources: Iterable[Source]) -> int | None:
    """The bytes on disk of the inputs (compressed files as stored); None when one is a Hub dataset."""
    total = 0
    for source in sources:
        if source.path is None:
            return None
        files = [source.path] if source.path.is_file() else [path for path in source.path.rglob("*") if path.is_file()]
        total += sum(path.stat().st_size for path in files)
    return total


@dataclass
class BuildSettings:
    """Everything that decides the corpus bytes (recorded in the manifests), each a data.py option
    declared once (common.option: default, help and checks together; check_settings: the rules
    between them). --demo's defaults differ: DEMO_BUILD_DEFAULTS."""

    scope: str = option(
        "full", "document filter: " + "; ".join(f"{k}: {v[0]}" for k, v in SCOPES.items()), BUILD, choices=list(SCOPES)
    )
    vocab_size: int = option(
        DEFAULT_VOCAB_SIZE,
        "BPE vocabulary to train; not given, sized to the input (512 under "
        "1 MB, 8192 under 100 MB (16384 for a --preset of micro or larger), 16384 under 1 GB, this above: "
        "SIZED_DEFAULTS; "
        f"{DEMO_VOCAB_SIZE} with --demo)",
        BUILD,
    )
    tokenizer: str | None = option(
        None, "reuse this tokenizer folder (or a corpus folder's tokenizer/)", BUILD, metavar="DIR"
    )
    tokenizer_sample_bytes: int = option(
        200_000_000, "train the BPE on at most this much text (the first documents)", BUILD, checks=(positive,)
    )
    min_frequency: int = option(2, "BPE merge min count", BUILD)
    val_fraction: float = option(
        0.01,
        "share of documents in validation; sized to the input when not given (0.05 "
        "under 10 MB and with --demo, 0.02 under 100 MB, this above)",
        BUILD,
    )
    test_fraction: float = option(0.01, "share of documents in test; sized as --val-fraction", BUILD)
    shard_tokens: int = option(100_000_000, "tokens per shard file", BUILD, checks=(positive,))
    min_chars: int = option(10, "drop documents with fewer characters of content", BUILD, checks=(not_negative,))
    remove_uuids: bool = option(True, "strip UUIDs from the text", BUILD)
    strict: bool = option(False, "stop at the first malformed record", BUILD)
    skip_unknown: bool = option(False, "drop (and count) records of unknown shape instead of stopping", BUILD)
    batch_bytes: int = option(4_000_000, "characters of text per tokenization batch", BUILD, checks=(positive,))
    tokenize_workers: int = option(
        0,
        "0: the Rust tokenizer threads in this process; N: a pool of N single-threaded tokenizer processes",
        BUILD,
        checks=(not_negative,),
    )
    progress: bool = option(True, "progress bar", BUILD)

    def recorded(self) -> dict:
        """The settings that shape the output (not how fast it is made)."""
        speed_only = ("progress", "batch_bytes", "tokenize_workers")
        return {key: value for key, value in asdict(self).items() if key not in speed_only}


@dataclass(frozen=True, kw_only=True)
class DataCommand:
    """What this data.py command does, besides the BuildSettings of the corpus it builds."""

    data: tuple[str, ...] | None = option(
        None,
        "input files, folders, globs (.jsonl .jsonl.gz .json .txt .md .parquet), datasets.save_to_disk "
        "folders, hf:NAME[:CONFIG][:SPLIT]; LABEL=PATH gives the input a source label (kept apart, for "
        "train.py mixtures)",
        WHAT,
        type=str,
        nargs="+",
        metavar="PATH",
    )
    demo: bool = option(False, "build the embedded arithmetic chat corpus (no input)", WHAT)
    verify: str | None = option(None, "re-hash a corpus against its manifest and exit", WHAT, metavar="CORPUS")
    config: str | None = option(
        None,
        "read options from this TOML or YAML file (long names as keys, e.g. data = "
        '["a.jsonl"], vocab-size = 8000); options given on the command line win',
        WHAT,
        metavar="FILE",
    )
    out: str | None = option(None, "corpus folder to create", BUILD)
    overwrite: bool = option(False, "replace an existing corpus at --out", BUILD)
    source_label: str = option(
        "none",
        "stem: label each --data input without a LABEL= by its file or folder name "
        "(kjv.jsonl -> kjv), each label a stream of its own",
        BUILD,
        choices=("none", "stem"),
    )
    seed: int = option(DEMO_SEED, "seed of the --demo generator", BUILD)
    preset: str | None = option(
        None,
        "the model this corpus is for (train.py --preset): a --vocab-size not given is the one that model "
        f"measured best at: {LARGE_MODEL_VOCAB} for micro and larger where the input's size gives 8192; "
        "not given: tiny's and nano's (the size's)",
        BUILD,
        choices=PRESET_NAMES,
    )


MAX_VOCAB_SIZE = 1 << 20  # a typo guard: --vocab-size 1000000000 made the BPE trainer ask for 70 GB and abort


def check_settings(settings: BuildSettings) -> None:
    """Each option's own checks (check_options), then the rules between them: one UserError line."""
    check_options(settings)
    if settings.scope not in SCOPES:
        raise UserError(f"--scope {settings.scope!r} is unknown; choose one of {', '.join(SCOPES)}")
    if (
        not 0 <= settings.val_fraction < 1
        or not 0 <= settings.test_fraction < 1
        or settings.val_fraction + settings.test_fraction >= 1
    ):
        raise UserError("--val-fraction and --test-fraction must be >= 0 and leave room for training data")
    if settings.vocab_size < len(SPECIAL_TOKENS) + 256:
        raise UserError(
            f"--vocab-size {settings.vocab_size} is below 263 (256 bytes + {len(SPECIAL_TOKENS)} special tokens)"
        )
    if settings.vocab_size > MAX_VOCAB_SIZE:
        raise UserError(
            f"--vocab-size {settings.vocab_size:,} is above {MAX_VOCAB_SIZE:,}: the BPE trainer would reserve memory "
            "for that many entries (the largest vocabularies in use hold about 262,144)"
        )


def to_document(record: Any, chat_template: str, remove_uuids: bool) -> tuple[str, str, list[str], int]:
    """(kind, document text, pieces, characters of content) for one record; raises RecordError.

    `pieces` is the text cut at its control tokens, [text, control token, text, ..., text]: for a
    chat, the template's markup; plain text is one piece.
    """
    if isinstance(record, RecordError):
        raise record
    if not isinstance(record, (dict, str)):
        raise RecordError("unknown_schema", f"record is {json_kind(record)}, expected an object or text")
    messages = record_messages(record) if isinstance(record, dict) else None
    if messages is None:
        text = clean_text(record_text(record), remove_uuids)
        return "text", text, [text], len(text)
    turns = message_turns(messages, remove_uuids)
    characters = sum(len(part) for turn in turns for part in turn["parts"])
    if not characters:
        return "chat", "", [""], 0
    answers = [message for message in messages if message["role"] == "assistant"]
    if answers and not clean_text(answers[-1]["content"], remove_uuids).strip():
        # "content": null (a tool call), or only an image part: training on it teaches answering nothing
        raise RecordError("empty_answer", "the last assistant turn has no text")
    text = render_turns(turns, chat_template)
    pieces = chat_pieces(turns, chat_template)
    if "".join(pieces) != text:
        raise RecordError(
            "chat_template",
            "the tokenizer's chat template changes message content, so its markup "
            "cannot be told from the content; use a template that inserts it as is",
        )
    return "chat", text, pieces, characters


class Document(NamedTuple):
    """A kept document. `pieces` is `text` cut at its control tokens: [text, control token, ..., text]."""

    split: str
    kind: str  # "chat" (rendered with the chat template) or "text"
    text: str
    pieces: list[str]
    source: str | None = None  # its input's source label (None: the corpus has none)


def iter_documents(
    sources: list[Source],
    settings: BuildSettings,
    chat_template: str,
    stats: dict[str, SourceStats] | None = None,
    warn: bool = True,
) -> Iterator[Document]:
    """Every kept document, in input order; counts every drop in `stats`.

    A bad record (malformed JSON, invalid UTF-8) is counted and warned about as file:line, or is fatal
    with `strict`; an unknown record shape is fatal unless `skip_unknown`.
    """
    accept = SCOPES[settings.scope][1]
    seen: dict[int, list[str | None]] = {}  # text key -> the source labels that kept it
    stats = {} if stats is None else stats
    for source in sources:
        counts = stats.setdefault(source.name, SourceStats())
        for location, record in iter_source(source):
            counts.records_read += 1
            try:
                kind, text, pieces, characters = to_document(record, chat_template, settings.remove_uuids)
            except RecordError as error:
                if error.reason == "empty_answer":  # common in tool-call logs: counted, not warned one by one
                    counts.dropped["empty_answer"] += 1
                    continue
                schema_error = error.reason in ("unknown_schema", "unknown_role")
                if settings.strict or error.reason == "chat_template" or (schema_error and not settings.skip_unknown):
                    hint = " (or pass --skip-unknown to drop such records)" if schema_error else ""
                    message = str(error) if str(error).startswith(str(source.name)) else f"{location}: {error}"
                    raise UserError(message + hint) from None
                counts.dropped[error.reason] += 1
                counts.warnings += 1
                if warn and counts.warnings <= MAX_WARNINGS_PER_SOURCE:
                    message = str(error) if str(error).startswith(str(source.name)) else f"{location}: {error}"
                    print(f"warning: {message}; skipped", file=sys.stderr)
                continue
            if characters == 0:
                counts.dropped["empty"] += 1
                continue
            if characters < settings.min_chars:
                counts.dropped["too_short"] += 1
                continue
            if not accept(kind, pieces):
                counts.dropped[f"scope_{settings.scope}"] += 1
                continue
            key, position = document_hash(text)
            if source.label in seen.get(key, ()):
                counts.dropped["duplicate"] += 1
                continue
            for label in seen.get(key, ()):  # kept in each source (an upweighted one keeps it), and reported
                counts.also_in[label] += 1
            seen.setdefault(key, []).append(source.label)
            counts.documents_kept += 1
            yield Document(
                split_of(position, settings.val_fraction, settings.test_fraction), kind, text, pieces, source.label
            )
        if warn and counts.warnings > MAX_WARNINGS_PER_SOURCE:
            print(
                f"warning: {source.name}: {counts.warnings - MAX_WARNINGS_PER_SOURCE} more bad records skipped "
                "(counted in source_manifest.json)",
                file=sys.stderr,
            )


# ----------------------------------------------------------------------------------------------
# Tokenizer: train on a sample of the document stream, or reuse --tokenizer.


def sample_texts(documents: Iterable[Document], max_bytes: int) -> Iterator[str]:
    """Document texts until about `max_bytes` of UTF-8 have been yielded (the first documents)."""
    total = 0
    for document in documents:
        yield from split_for_encoding(document.text, ENCODE_CHUNK_CHARS)  # the same words, bounded memory
        total += len(document.text.encode("utf-8"))
        if total >= max_bytes:
            return


def prepare_tokenizer(settings: BuildSettings, sources: list[Source], out_dir: Path):
    """Train (or copy) the tokenizer into `out_dir`; returns (the loaded transformers tokenizer, a note on its
    vocabulary or None), the note said once the build is known to go on (not before an error)."""
    if settings.tokenizer:
        source_dir = Path(settings.tokenizer)
        if not source_dir.is_dir():
            raise UserError(f"--tokenizer {source_dir} is not a folder")
        source_dir = tokenizer_folder(source_dir)  # a corpus folder works too
        load_tokenizer(source_dir)  # fails clearly before anything is copied
        shutil.copytree(source_dir, out_dir, ignore=shutil.ignore_patterns(".*"))
        return load_tokenizer(out_dir), None
    documents = iter_documents(sources, settings, CHAT_TEMPLATE, warn=False)
    texts = sample_texts(documents, settings.tokenizer_sample_bytes)
    _, reached = train_tokenizer(texts, settings.vocab_size, out_dir, min_frequency=settings.min_frequency)
    note = (
        (f"note: the text only supports a vocabulary of {reached} (asked for {settings.vocab_size}); keeping {reached}")
        if reached < settings.vocab_size
        else None
    )
    return load_tokenizer(out_dir), note


# ----------------------------------------------------------------------------------------------
# Sharding: parallel tokenization, streamed into shards.


class ShardWriter:
    """Appends token ids to `{split}-NNNNN.bin` files of at most `shard_tokens` tokens, and their mask
    classes (one uint8 per token) to `{split}-NNNNN.mask` cut at the same places, hashing as it goes;
    where each document ends goes to `{split}.docs` (the document index)."""

    def __init__(self, folder: Path, split: str, dtype: str, shard_tokens: int):
        self.folder, self.split, self.dtype, self.shard_tokens = folder, split, np.dtype(dtype), shard_tokens
        self.files: list[dict] = []
        self.documents = 0
        self.tokens = 0
        self.handles = None
        self.digests = None
        self.in_shard = 0
        self.mask_tokens: Counter = Counter()
        self.index_handle, self.index_digest = None, hashlib.sha256()

    def _open(self) -> None:
        name = shard_name(self.split, len(self.files))
        self.handles = (open(self.folder / name, "wb"), open(self.folder / mask_name(name), "wb"))
        self.digests = (hashlib.sha256(), hashlib.sha256())
        self.in_shard = 0
        self.files.append(
            {
                "name": name,
                "bytes": 0,
                "sha256": "",
                "tokens": 0,
                "mask": {"name": mask_name(name), "bytes": 0, "sha256": ""},
            }
        )

    def _close_shard(self) -> None:
        for handle in self.handles:
            handle.close()  # build_in_place's atomic_folder fsyncs every file before the swap
        self.files[-1].update(
            bytes=self.in_shard * self.dtype.itemsize, sha256=self.digests[0].hexdigest(), tokens=self.in_shard
        )
        self.files[-1]["mask"].update(bytes=self.in_shard, sha256=self.digests[1].hexdigest())
        self.handles = None

    def _index(self, lengths: np.ndarray) -> None:
        """Append the end offsets of documents of `lengths` tokens to the document index."""
        if self.index_handle is None:
            self.index_handle = open(self.folder / document_index_name(self.split), "wb")
        raw = (self.tokens + np.cumsum(lengths, dtype=np.int64)).astype(DOCUMENT_INDEX_DTYPE).tobytes()
        self.index_handle.write(raw)
        self.index_digest.update(raw)

    def write(self, ids: np.ndarray, lengths: Iterable[int], mask: np.ndarray | None = None) -> None:
        """Append `ids`, the documents of `lengths` tokens each (their <eos> included), and their mask
        classes (None: all MASK_TEXT, plain text)."""
        lengths = np.asarray(lengths, dtype=np.int64)
        ids = ids.astype(self.dtype, copy=False)
        mask = np.full(len(ids), MASK_TEXT, dtype=np.uint8) if mask is None else mask.astype(np.uint8, copy=False)
        if len(mask) != len(ids) or int(lengths.sum()) != len(ids):
            raise ValueError(f"{len(mask)} mask values and {int(lengths.sum())} document tokens for {len(ids)} tokens")
        self._index(lengths)
        self.documents += len(lengths)
        self.tokens += len(ids)
        self.mask_tokens.update({name: int(np.count_nonzero(mask == value)) for name, value in MASK_CLASSES.items()})
        while len(ids):
            if self.handles is None:
                self._open()
            take = min(len(ids), self.shard_tokens - self.in_shard)
            for handle, digest, data in zip(
                self.handles,
                self.digests,
                (ids[:take].astype(self.dtype.newbyteorder("<"), copy=False).tobytes(), mask[:take].tobytes()),
            ):
                handle.write(data)
                digest.update(data)
            self.in_shard += take
            ids, mask = ids[take:], mask[take:]
            if self.in_shard == self.shard_tokens:
                self._close_shard()

    def finish(self) -> dict:
        if self.handles is not None:
            self._close_shard()
        result = {
            "files": self.files,
            "tokens": sum(entry["tokens"] for entry in self.files),
            "documents": self.documents,
            "mask_tokens": {name: self.mask_tokens[name] for name in MASK_CLASSES},
        }
        if self.index_handle is not None:
            self.index_handle.close()
            result["document_index"] = {
                "name": document_index_name(self.split),
                "bytes": 8 * self.documents,
                "sha256": self.index_digest.hexdigest(),
            }
        return result


def batches(documents: Iterable[Document], batch_bytes: int) -> Iterator[tuple[list[str], list[list[str]]]]:
    """Group documents into (splits, pieces) lists of about `batch_bytes` characters."""
    splits, pieces, size = [], [], 0
    for document in documents:
        splits.append(stream_key(document.split, document.source))
        pieces.append(document.pieces)
        size += len(document.text)
        if size >= batch_bytes:
            yield splits, pieces
            splits, pieces, size = [], [], 0
    if pieces:
        yield splits, pieces


_WORKER_TOKENIZER = None  # set in each --tokenize-workers process by start_tokenize_worker


def literal_tokenizer(backend):
    """The same Rust tokenizer, reading special-token strings such as a literal `<|im_start|>` or
    `<think>` as the text they are: text never injects a control token (see encode_batch)."""
    from tokenizers import Tokenizer

    literal = Tokenizer.from_str(backend.to_str())
    literal.encode_special_tokens = True
    return literal


WORKER_TOKENIZER_FILE = "worker-tokenizer.json"  # in the build's temporary folder while the workers run


def start_tokenize_worker(tokenizer_file: str, builder: int) -> None:
    """Process-pool initializer: a single-threaded Rust tokenizer in each process, which ends as soon as
    its data.py (process `builder`) is gone: a kill -9 of the build leaves no worker behind, busy or idle
    (an idle one would wait forever on a queue whose writing end it holds itself), and no traceback. The
    tokenizer comes as a file: a worker's start-up data then fits the pipe at once, where a large
    tokenizer's (MBs) kept data.py writing it for a second, and a kill then left the worker a traceback."""
    global _WORKER_TOKENIZER
    from tokenizers import Tokenizer

    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER_TOKENIZER = literal_tokenizer(Tokenizer.from_file(tokenizer_file))
    threading.Thread(target=exit_without, args=(builder,), name="exit-without-data.py", daemon=True).start()


def start_quiet_resource_tracker() -> None:
    """Start multiprocessing's resource tracker (the process that unlinks the pool's semaphores once data.py is
    gone) with its stderr on /dev/null: after a kill -9 of the build it would print, to the user's terminal,
    that it found them leaked ("resource_tracker: There appear to be 5 leaked semaphore objects")."""
    from multiprocessing import resource_tracker

    with open(os.devnull, "wb") as null, file_descriptor_to(2, null):
        resource_tracker.ensure_running()  # inherits fd 2 as it is now; started once per process


def exit_without(parent: int, every_s: float = 0.5) -> None:
    """End this process, saying nothing, once `parent` is no longer its parent (it died)."""
    while os.getppid() == parent:
        time.sleep(every_s)
    os._exit(0)


ENCODE_CHUNK_CHARS = 1 << 18  # the Rust tokenizer needs ~100 bytes per character of one text it encodes
WORD_START = re.compile(r"(?<=\S) (?=[^\W\d_])")  # a space after a non-space, before a letter


def split_for_encoding(text: str, limit: int = ENCODE_CHUNK_CHARS) -> list[str]:
    """`text` cut into pieces of about `limit` characters that encode to exactly the ids of the whole:
    each cut is before a space that follows a non-space and precedes a letter, where the Qwen2
    pre-tokenizer starts a new word (" word") anyway. Measured on a 10 MB one-line file: a 2.1 GB
    peak encoded whole, 0.5 GB in chunks (both for training the tokenizer and for sharding)."""
    pieces, start = [], 0
    while len(text) - start > limit:
        cut = WORD_START.search(text, start + limit)
        if cut is None:
            break
        pieces.append(text[start : cut.start()])
        start = cut.start()
    pieces.append(text[start:])
    return pieces


def encode_batch(backend, eos_id: int, dtype: str, splits: list[str], documents: list[list[str]]) -> dict[str, tuple]:
    """Tokenize one batch (the Rust tokenizer threads it, without the GIL): split -> (ids array, documents).

    Each document is its pieces [text, control token, ..., text]: the texts are encoded with
    `backend`, a literal_tokenizer (None in a worker process: its own), and the control tokens are
    put between them by id. This gives the ids that encoding the whole text with special tokens
    on would give, as that too encodes the stretches between control tokens one by one; but a
    special-token string inside a message stays text.
    """
    backend = backend or _WORKER_TOKENIZER
    control_ids = {token: backend.token_to_id(token) for token in SPECIAL_TOKENS}
    texts = [text for pieces in documents for text in pieces[::2]]
    short = iter(
        backend.encode_batch_fast([text for text in texts if len(text) <= ENCODE_CHUNK_CHARS], add_special_tokens=False)
    )

    def ids_of(text: str) -> list[int]:
        if len(text) <= ENCODE_CHUNK_CHARS:
            return next(short).ids
        return [
            token
            for chunk in split_for_encoding(text, ENCODE_CHUNK_CHARS)  # one at a time: bounded memory
            for token in backend.encode(chunk, add_special_tokens=False).ids
        ]

    encodings = (ids_of(text) for text in texts)
    header = backend.encode(ASSISTANT_HEADER, add_special_tokens=False).ids
    streams: dict[str, tuple[list[int], list[int], list[int]]] = {}
    for split, pieces in zip(splits, documents):
        stream, mask, lengths = streams.setdefault(split, ([], [], []))
        document_ids = [next(encodings)]
        for control_token in pieces[1::2]:
            document_ids += [[control_ids[control_token]], next(encodings)]
        before = len(stream)
        stream.extend(token for ids in document_ids for token in ids)
        mask.extend(document_mask(pieces, document_ids, header))
        stream.append(eos_id)
        mask.append(MASK_TEXT if len(pieces) == 1 else MASK_PROMPT)
        lengths.append(len(stream) - before)
    return {
        split: (np.array(stream, dtype=dtype), lengths, np.array(mask, dtype=np.uint8))
        for split, (stream, mask, lengths) in streams.items()
    }


ASSISTANT_HEADER = "assistant\n"  # what the chat template puts after <|im_start|> for an assistant turn


def document_mask(pieces: list[str], piece_ids: list[list[int]], header: list[int]) -> list[int]:
    """The mask classes of one document's tokens (its EOS not included), from its pieces
    [text, control token, ..., text] and each piece's ids.

    Plain text (one piece) is all MASK_TEXT. In a chat, an assistant turn is the text after
    <|im_start|> that starts with the role header "assistant\n": every token after the header's
    up to and including the turn's <|im_end|> is MASK_ASSISTANT (its <think> block too); the rest
    is MASK_PROMPT. The header encodes to its own tokens (the content is stripped, and the Qwen2
    split starts a new word after a newline), so its ids are a prefix of the piece's; where they
    are not, the tokens after the common prefix count as the answer.
    """
    if len(pieces) == 1:
        return [MASK_TEXT] * len(piece_ids[0])
    mask: list[int] = []
    answering = False
    for index, (piece, ids) in enumerate(zip(pieces, piece_ids)):
        if index % 2 == 1:  # a control token
            mask.append(MASK_ASSISTANT if answering else MASK_PROMPT)
            if piece == IM_END:
                answering = False
            continue
        if index > 0 and pieces[index - 1] == IM_START and piece.startswith(ASSISTANT_HEADER):
            prefix = 0
            while prefix < min(len(header), len(ids)) and ids[prefix] == header[prefix]:
                prefix += 1
            mask.extend([MASK_PROMPT] * prefix + [MASK_ASSISTANT] * (len(ids) - prefix))
            answering = True
            continue
        mask.extend([MASK_ASSISTANT if answering else MASK_PROMPT] * len(ids))
    return mask


def write_shards(
    documents: Iterable[Document],
    tokenizer,
    folder: Path,
    settings: BuildSettings,
    dtype: str,
    labels: list[str | None] | None = None,
) -> dict[str, dict]:
    """Tokenize `documents` into shards; returns the per-split manifest entries. With source `labels`,
    each source of a split is a stream of its own (labelled_split).

    One worker thread runs the Rust tokenizer (threaded across cores) on batch k while this
    thread reads and cleans batch k+1, so parsing and tokenization overlap. With
    `settings.tokenize_workers` > 0, a pool of single-threaded tokenizer processes does it
    instead. Either way results are written in input order, so the bytes are the same.
    """
    from tqdm import tqdm

    backend = literal_tokenizer(tokenizer.backend_tokenizer)
    eos_id = tokenizer.convert_tokens_to_ids(EOS)
    labels = labels or [None]
    writers = {
        stream_key(split, label): ShardWriter(folder, stream_key(split, label), dtype, settings.shard_tokens)
        for split in SPLITS
        for label in labels
    }
    # no bar unless stderr is a terminal: redrawn `\r` lines only clutter a log file
    show = settings.progress and sys.stderr.isatty()
    bar = tqdm(desc="tokenizing", unit=" docs", disable=not show, file=sys.stderr, smoothing=0.1)
    started, tokens = time.perf_counter(), 0

    def write(result: dict[str, tuple]) -> None:
        nonlocal tokens
        for split, (ids, lengths, mask) in result.items():
            writers[split].write(ids, lengths, mask)
            tokens += len(ids)
            bar.update(len(lengths))
        bar.set_postfix_str(f"{tokens / max(time.perf_counter() - started, 1e-9):,.0f} tokens/s", refresh=False)

    if settings.tokenize_workers > 0:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        start_quiet_resource_tracker()
        worker_tokenizer = folder / WORKER_TOKENIZER_FILE
        backend.save(str(worker_tokenizer))
        pool = ProcessPoolExecutor(
            settings.tokenize_workers,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=start_tokenize_worker,
            initargs=(str(worker_tokenizer), os.getpid()),
        )
        backend, in_flight = None, settings.tokenize_workers + 1
    else:
        pool, in_flight = ThreadPoolExecutor(max_workers=1), 2
    pending: deque = deque()
    with pool:
        for splits, pieces in batches(documents, settings.batch_bytes):
            pending.append(pool.submit(encode_batch, backend, eos_id, dtype, splits, pieces))
            if len(pending) >= in_flight:
                write(pending.popleft().result())
        while pending:
            write(pending.popleft().result())
    if settings.tokenize_workers > 0:
        worker_tokenizer.unlink()
    bar.close()
    finished = {key: writer.finish() for key, writer in writers.items()}
    if labels == [None]:
        return finished
    return {split: labelled_split({label: finished[stream_key(split, label)] for label in labels}) for split in SPLITS}


def labelled_split(parts: dict[str, dict]) -> dict:
    """A split's manifest entry from its sources' streams: the files of all (the split as one stream),
    the sums, and each source's own entry under "sources"."""
    entries = list(parts.values())
    return {
        "files": [item for entry in entries for item in entry["files"]],
        "tokens": sum(entry["tokens"] for entry in entries),
        "documents": sum(entry["documents"] for entry in entries),
        "mask_tokens": {name: sum(entry["mask_tokens"][name] for entry in entries) for name in MASK_CLASSES},
        "sources": parts,
    }


# ----------------------------------------------------------------------------------------------
# Manifests and the data card.


def source_manifest(
    sources: list[Source], stats: dict[str, SourceStats], settings: BuildSettings, generator: dict | None
) -> dict:
    inputs, dropped = [], Counter()
    for source in sources:
        counts = stats.get(source.name, SourceStats())
        dropped.update(counts.dropped)
        inputs.append(
            {
                "source": source.name,
                "kind": source.kind,
                "bytes": (source.path.stat().st_size if source.path and source.path.is_file() else None),
                "sha256": source_fingerprint(source),
                "records_read": counts.records_read,
                "documents_kept": counts.documents_kept,
                "dropped": dict(sorted(counts.dropped.items())),
                **({"label": source.label, "also_in": dict(sorted(counts.also_in.items()))} if source.label else {}),
            }
        )
    duplicates = Counter()  # "first~second" source labels -> documents both kept
    for entry in inputs:
        duplicates.update({f"{other}~{entry['label']}": count for other, count in entry.get("also_in", {}).items()})
    return {
        "format_version": FORMAT_VERSION,
        "settings": settings.recorded(),
        "generator": generator,
        "inputs": inputs,
        "totals": {
            "records_read": sum(entry["records_read"] for entry in inputs),
            "documents_kept": sum(entry["documents_kept"] for entry in inputs),
            "dropped": dict(sorted(dropped.items())),
            **({"cross_source_duplicates": dict(sorted(duplicates.items()))} if any(s.label for s in sources) else {}),
        },
    }


def data_card(corpus: dict, sources: dict) -> str:
    """DATA_CARD.md: the manifests, for people."""
    lines = [
        "# Data card",
        "",
        f"Built by `data.py` (corpus format {corpus['format_version']}); the build time is in {CORPUS_MANIFEST}. "
        "Check it with `python data.py --verify <this folder>`.",
        "",
        "## Inputs",
        "",
        "| source | kind | sha256 | records read | kept | dropped |",
        "|---|---|---|---:|---:|---|",
    ]
    for entry in sources["inputs"]:
        drops = ", ".join(f"{reason} {count}" for reason, count in entry["dropped"].items()) or "-"
        digest = (entry["sha256"] or "n/a (streamed)")[:16]
        lines.append(
            f"| `{entry['source']}` | {entry['kind']} | `{digest}` | {entry['records_read']} | "
            f"{entry['documents_kept']} | {drops} |"
        )
    totals = sources["totals"]
    lines += [
        "",
        f"Total: {totals['records_read']} records read, {totals['documents_kept']} documents kept, "
        f"dropped {sum(totals['dropped'].values())} "
        f"({', '.join(f'{k} {v}' for k, v in totals['dropped'].items()) or 'none'}).",
        "",
        "## Splits",
        "",
        "| split | documents | tokens | shards |",
        "|---|---:|---:|---:|",
    ]
    for split, info in corpus["splits"].items():
        lines.append(
            f"| {split} | {info['documents']} | {info['tokens']} ({human_count(info['tokens'])}) | "
            f"{len(info['files'])} |"
        )
    lines += source_label_lines(corpus, sources)
    settings = sources["settings"]
    lines += [
        "",
        "## Tokenizer and settings",
        "",
        f"- vocabulary: {corpus['vocab_size']} ids stored as `{corpus['dtype']}`; "
        f"{'reused from ' + settings['tokenizer'] if settings['tokenizer'] else 'byte-level BPE trained here'} "
        "(Qwen2 pre-tokenizer, digits split one by one, ChatML chat template)",
        f"- special tokens: {', '.join(f'`{name}`={index}' for name, index in corpus['special_tokens'].items())}",
        f"- scope `{settings['scope']}` ({SCOPES[settings['scope']][0]}); documents shorter than "
        f"{settings['min_chars']} characters dropped; UUIDs {'removed' if settings['remove_uuids'] else 'kept'}; "
        "unicode NFC; exact duplicates removed "
        + (
            "within each source label"
            if any(entry.get("label") for entry in sources["inputs"])
            else "across all inputs"
        ),
        f"- splits by a hash of each document's text: validation {settings['val_fraction']}, "
        f"test {settings['test_fraction']}; every document ends with `<eos>`",
    ]
    if sources.get("generator"):
        lines += ["", "## Generated data", "", f"`{json.dumps(sources['generator'])}`"]
    return "\n".join(lines) + "\n"


def source_label_lines(corpus: dict, sources: dict) -> list[str]:
    """DATA_CARD.md's table of the labelled sources (train.py mixes them: NAME=CORPUS#LABEL:WEIGHT)."""
    labels = list(corpus["splits"]["train"].get("sources", {}))
    if not labels:
        return []
    lines = [
        "",
        "## Sources (labels)",
        "",
        "| label | " + " | ".join(f"{split} tokens (docs)" for split in SPLITS) + " |",
        "|---|" + "---:|" * len(SPLITS),
    ]
    for label in labels:
        parts = [corpus["splits"][split]["sources"][label] for split in SPLITS]
        lines.append(
            f"| `{label}` | " + " | ".join(f"{part['tokens']:,} ({part['documents']})" for part in parts) + " |"
        )
    duplicates = sources["totals"].get("cross_source_duplicates", {})
    lines += [
        "",
        "Exact duplicates across sources are kept in each source (one source's weight does not take "
        "them from another) and counted here: "
        + (", ".join(f"{pair.replace('~', ' and ')}: {count}" for pair, count in duplicates.items()) or "none")
        + ".",
    ]
    return lines


# ----------------------------------------------------------------------------------------------
# The build: temporary folder beside --out, renamed into place at the end.


def check_out_dir(out: Path, overwrite: bool) -> None:
    """Refuse an --out that cannot become the corpus, before any work: the corpus is built in a
    folder beside it (which must be writable) and renamed into place (which a mount point cannot be)."""
    if out.exists() and os.path.ismount(out):
        raise UserError(
            f"--out {out} is a mount point: the corpus is built beside it and renamed into place, "
            f"which a mount point cannot be; use a folder inside it, e.g. --out {out / 'corpus'}"
        )
    parent = out.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not os.access(parent, os.W_OK):  # false on a read-only mount, for root too
        raise UserError(f"--out {out}: {parent} cannot be written (a read-only file system, or no permission)")
    if not out.exists():
        return
    if not out.is_dir():
        raise UserError(f"--out {out} exists and is not a folder")
    if not any(out.iterdir()):
        return
    if not overwrite:
        raise UserError(f"--out {out} exists and is not empty; pass --overwrite to replace it")
    if not (out / CORPUS_MANIFEST).is_file():
        raise UserError(
            f"--out {out} is not a corpus folder (no {CORPUS_MANIFEST}); refusing to replace it even with --overwrite"
        )


def build_corpus(
    sources: list[Source],
    out_dir: str | Path,
    settings: BuildSettings,
    overwrite: bool = False,
    extra_files: dict[str, bytes] | None = None,
    generator: dict | None = None,
) -> Path:
    """Build the corpus folder `out_dir` from `sources` (see the module docstring for the recipe)."""
    out = Path(out_dir)
    if out.name in ("", ".", ".."):
        out = out.resolve()  # so the temporary folder and the rename have a real name to work with
    check_settings(settings)
    check_out_dir(out, overwrite)
    started = time.perf_counter()
    try:
        corpus, stats, splits = build_in_place(sources, out, settings, extra_files, generator)
    except OSError as error:
        if not error.errno:
            raise
        raise UserError(
            f"building {out} failed: {os_error_text(error)}; nothing was written to --out "
            "(the partial build was removed)"
        ) from None
    empty = empty_splits(splits, settings)
    print_summary(out, corpus, stats, time.perf_counter() - started, empty)
    for message in [*empty.values(), *small_splits(splits, settings).values()]:
        print(f"warning: {message}", file=sys.stderr)
    return out


def build_in_place(
    sources: list[Source],
    out: Path,
    settings: BuildSettings,
    extra_files: dict[str, bytes] | None,
    generator: dict | None,
) -> tuple[dict, dict, dict]:
    """build_corpus's work: everything in a temporary folder beside `out`, swapped into place at the end
    (a failure, Ctrl-C or SIGTERM removes it; a build killed outright leaves it to the next build's sweep)."""
    with atomic_folder(out) as temp:
        tokenizer, note = prepare_tokenizer(settings, sources, temp / TOKENIZER_DIR)
        vocab_size = len(tokenizer)
        dtype = token_dtype(vocab_size)
        stats: dict[str, SourceStats] = {}
        documents = iter_documents(sources, settings, tokenizer.chat_template, stats)
        labels = list(dict.fromkeys(source.label for source in sources))
        splits = write_shards(documents, tokenizer, temp, settings, dtype, labels)
        kept = sum(info["documents"] for info in splits.values())
        if kept == 0:
            raise UserError(
                f"no documents left after reading and filtering the inputs ({describe_drops(stats)}); nothing to build"
            )
        if splits["train"]["tokens"] == 0:
            raise UserError(train_split_empty(splits))
        if note:
            print(note, file=sys.stderr)
        for name, data in (extra_files or {}).items():
            atomic_write_bytes(temp / name, data)
        sources_doc = source_manifest(sources, stats, settings, generator)
        atomic_write_json(temp / SOURCE_MANIFEST, sources_doc)
        corpus = {
            "format_version": FORMAT_VERSION,
            "dtype": dtype,
            "vocab_size": vocab_size,
            "special_tokens": {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS},
            "tokenizer_sha256": sha256_tree(temp / TOKENIZER_DIR),
            "vocabulary_sha256": vocabulary_sha256(tokenizer),
            "splits": splits,
            "documents": kept,
            "tokens": sum(info["tokens"] for info in splits.values()),
            "settings": settings.recorded(),
        }
        atomic_write_text(temp / DATA_CARD, data_card(corpus, sources_doc))
        listed = [SOURCE_MANIFEST, DATA_CARD, *sorted(extra_files or {})]
        corpus["files"] = {name: sha256_file(temp / name) for name in listed}
        atomic_write_json(temp / CORPUS_MANIFEST, corpus)
    return corpus, stats, splits


def empty_splits(splits: dict[str, dict], settings: BuildSettings) -> dict[str, str]:
    """{split: warning} for each held-out split that was asked for (fraction > 0) but got no documents.

    Not fatal: the corpus is still usable for training, only evaluation on that split is not.
    """
    kept = sum(info["documents"] for info in splits.values())
    warnings = {}
    for split, flag, fraction in (
        ("validation", "--val-fraction", settings.val_fraction),
        ("test", "--test-fraction", settings.test_fraction),
    ):
        if fraction > 0 and splits[split]["documents"] == 0:
            warnings[split] = (
                f"the {split} split is empty ({flag} {fraction} of {kept} documents picked none); "
                f"add more documents or raise {flag}"
            )
    return warnings


# A held-out split under this many tokens scores a model only roughly: over a third of KJV's test split (8,192 of
# 26,624 tokens) two runs' ratio was up to 8% off the ratio over all of it (bench/RESULTS.md "Held-out scores over
# the same blocks").
SMALL_SPLIT_TOKENS = 16_384


def small_splits(splits: dict[str, dict], settings: BuildSettings) -> dict[str, str]:
    """{split: warning} for each held-out split with documents but under SMALL_SPLIT_TOKENS tokens."""
    warnings = {}
    for split, flag, fraction in (
        ("validation", "--val-fraction", settings.val_fraction),
        ("test", "--test-fraction", settings.test_fraction),
    ):
        tokens, documents = splits[split]["tokens"], splits[split]["documents"]
        if documents and tokens < SMALL_SPLIT_TOKENS:
            warnings[split] = (
                f"the {split} split holds {tokens:,} tokens ({documents} doc{'' if documents == 1 else 's'}): its "
                f"bits per byte compare runs only roughly (a few percent) under {SMALL_SPLIT_TOKENS:,}; raise {flag} "
                f"(now {fraction:g}) or add documents"
            )
    return warnings


def describe_drops(stats: dict[str, SourceStats]) -> str:
    read = sum(counts.records_read for counts in stats.values())
    dropped = sum((counts.dropped for counts in stats.values()), Counter())
    reasons = ", ".join(f"{reason} {count}" for reason, count in sorted(dropped.items()))
    return f"{read} records read; " + (f"dropped: {reasons}" if reasons else "none dropped")


def print_summary(
    out: Path, corpus: dict, stats: dict[str, SourceStats], seconds: float, empty: Iterable[str] = ()
) -> None:
    print(f"corpus ready: {out}")
    print(f"  documents: {corpus['documents']} kept ({describe_drops(stats)})")
    invalid = sum(counts.dropped["invalid_utf8"] for counts in stats.values())
    if invalid:
        print(
            f"  {invalid} record(s) dropped for invalid UTF-8; a .txt or .json file is decoded whole, so whole files "
            "were dropped: convert them to UTF-8 first (e.g. iconv -f latin1 -t utf-8)"
        )
    empty_answers = sum(counts.dropped["empty_answer"] for counts in stats.values())
    if empty_answers:
        print(
            f"  {empty_answers} chat(s) dropped whose last assistant turn has no text (a tool call, an image "
            "only): trained on, they would teach the model to answer nothing"
        )
    per_split = ", ".join(
        f"{split} {info['tokens']:,} ({info['documents']} doc{'' if info['documents'] == 1 else 's'}"
        f"{', EMPTY' if split in empty else ''})"
        for split, info in corpus["splits"].items()
    )
    print(f"  tokens: {per_split}; vocab {corpus['vocab_size']} as {corpus['dtype']}")
    labelled = corpus["splits"]["train"].get("sources")
    if labelled:
        also = sum(count for counts in stats.values() for count in counts.also_in.values())
        print(
            "  sources: "
            + ", ".join(f"{label} {part['tokens']:,} train tokens" for label, part in labelled.items())
            + f"; {also} exact duplicate(s) across sources, kept in each (source_manifest.json)"
        )
    print(f"  {seconds:.1f} s, {corpus['tokens'] / max(seconds, 1e-9):,.0f} tokens/s overall")


# ----------------------------------------------------------------------------------------------
# The embedded demo corpus (its problems and held-out set: demo_corpus.py).


def build_demo_corpus(out_dir: str | Path, overwrite: bool = False, seed: int = DEMO_SEED, **options) -> Path:
    """The embedded demo corpus (no input needed): `options` are BuildSettings fields.

    Defaults differ from a real corpus: vocab 512, 5% validation and 5% test documents.
    Held-out problems go to `DEMO_EVAL_FILE` ({"prompt", "answer", "task"} per line) and
    never appear in any split.
    """
    options = {**DEMO_BUILD_DEFAULTS, **options}
    unknown = set(options) - {f.name for f in fields(BuildSettings)}
    if unknown:
        raise TypeError(f"unknown demo corpus option(s): {', '.join(sorted(unknown))}")
    records, eval_problems = demo_data(seed)
    eval_jsonl = "".join(json.dumps(problem, ensure_ascii=False) + "\n" for problem in eval_problems)
    source = Source("demo:arithmetic", "generated", records=records)
    generator = {
        "name": "demo:arithmetic",
        "seed": seed,
        "records": len(records),
        "eval_problems": dict(Counter(problem["task"] for problem in eval_problems)),
    }
    return build_corpus(
        [source],
        out_dir,
        BuildSettings(**options),
        overwrite=overwrite,
        extra_files={DEMO_EVAL_FILE: eval_jsonl.encode()},
        generator=generator,
    )


# ----------------------------------------------------------------------------------------------
# Command line.


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    add_options(parser, (WHAT, BUILD), DataCommand, BuildSettings)
    return parser


def parse_args(
    argv: list[str] | None = None, notes: list[str] | None = None
) -> tuple[DataCommand, BuildSettings, argparse.ArgumentParser, list[Source] | None]:
    """(what to do, the corpus' settings, the parser, the --data sources) of this command line: a --config
    file's options first, then the command line's; the options not given get defaults sized to the --data
    inputs (sized_build_defaults), or DEMO_BUILD_DEFAULTS with --demo. The inputs are resolved here, once
    (`notes` gets the lines about files left out); sources is None without --data to build."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(config_argv(parser, argv) + argv)
    sources = None
    if args.data and not (args.demo or args.verify):
        sources = resolve_inputs(args.data, label_by_stem=args.source_label == "stem", notes=notes)
    if args.demo or sources is not None:
        sized = DEMO_BUILD_DEFAULTS if args.demo else sized_build_defaults(input_bytes(sources), args.preset)
        parser.set_defaults(**sized)
        args = parser.parse_args(config_argv(parser, argv) + argv)
    values = {**vars(args), "data": tuple(args.data) if args.data else None}
    command = DataCommand(**{field.name: values[field.name] for field in fields(DataCommand)})
    settings = BuildSettings(**{field.name: values[field.name] for field in fields(BuildSettings)})
    return command, settings, parser, sources


def verify(corpus: str) -> int:
    """--verify: every file against the manifest, each bad one a line, exit 1 (a manifest that is there but
    damaged too: the corpus failed its check); a folder without a corpus at all is an error line, exit 2."""
    try:
        problems = verify_corpus(corpus)
    except UserError as error:
        if not (Path(corpus) / CORPUS_MANIFEST).is_file():
            raise
        problems = [str(error)]
    for problem in problems:
        print(f"MISMATCH {problem}")
    print(f"{corpus}: {'FAILED, ' + str(len(problems)) + ' problem(s)' if problems else 'OK'}")
    return 1 if problems else 0


def warn_unused_vocab_size(tokenizer: str, vocab_size: int) -> None:
    """--vocab-size with --tokenizer: the tokenizer's vocabulary is used; say so when they differ."""
    try:
        size = len(load_tokenizer(tokenizer))
    except UserError:
        return  # the build says what is wrong with the tokenizer
    if size != vocab_size:
        print(
            f"warning: --vocab-size {vocab_size} is not used: --tokenizer {tokenizer} has {size} tokens, and the "
            "corpus uses them",
            file=sys.stderr,
        )


def main(argv: list[str] | None = None) -> int:
    notes: list[str] = []
    command, settings, parser, sources = parse_args(argv, notes)
    if sum(bool(x) for x in (command.data, command.demo, command.verify)) != 1:
        parser.error("give exactly one of --data, --demo or --verify")

    if command.verify:
        return verify(command.verify)

    if not command.out:
        parser.error("--out is required to build a corpus")
    if settings.tokenizer and settings.vocab_size != parser.get_default("vocab_size"):
        warn_unused_vocab_size(settings.tokenizer, settings.vocab_size)
    if settings.tokenizer and command.preset:
        say(f"--preset {command.preset} is not used: --tokenizer's vocabulary is the corpus'", warning=True)
    if command.demo:
        build_demo_corpus(command.out, overwrite=command.overwrite, seed=command.seed, **asdict(settings))
    else:
        for note in notes:
            print(note, file=sys.stderr)
        build_corpus(sources, command.out, settings, overwrite=command.overwrite)
    return 0


def command() -> None:
    """`python data.py` and the `tinyllm-data` console script (pyproject.toml)."""
    stop_on_sigterm()  # the command line only: a kill leaves no .NAME.<hex>.tmp/ behind
    run_main(main, script=True)


if __name__ == "__main__":
    command()
