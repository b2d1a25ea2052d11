"""The corpus format (DESIGN.md, "Corpus folder"): its names and constants, the chat render (a conversation's
messages as the text a model is trained on and prompted with), the manifest (`Manifest`, read once by
`load_manifest`), its verification, and the tokenizer a corpus carries.

data.py writes corpora in this format; train.py (through train_data.py), report.py, checkpoint_cloud.py and
the benchmarks read them through this module only; generation.py renders its chat prompts with its chat render.
"""

from __future__ import annotations

import hashlib
import json
import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from tinyllm.common import UserError, parse_json, sha256_file, sha256_tree

if TYPE_CHECKING:  # torch is imported only where a corpus is read for training: data.py builds without it
    import torch

# ----------------------------------------------------------------------------------------------
# The tokenizer: byte-level BPE (data.py trains it) with these special tokens at ids 0-6.

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
IM_START, IM_END, THINK_OPEN, THINK_CLOSE = "<|im_start|>", "<|im_end|>", "<think>", "</think>"
SPECIAL_TOKENS = [PAD, BOS, EOS, IM_START, IM_END, THINK_OPEN, THINK_CLOSE]


# The Qwen2 split (llama.cpp's LLAMA_VOCAB_PRE_TYPE_QWEN2): digits one by one.
QWEN2_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# The message fields a conversation's reasoning is read from, first non-empty one wins: data.py reads them from
# its input records, and the chat template from the messages a client passes (transformers' and llama.cpp's
# `reasoning_content`, as Qwen3's template names it; ollama's `thinking`).
REASONING_KEYS = ("reasoning", "reasoning_content", "thinking", "think")

# ChatML. Reasoning is part of the assistant's content as "<think>\n...\n</think>\n\n" (render_assistant), so
# the template is the plain ChatML that llama.cpp and ollama know, plus that render of an assistant message's
# reasoning field (REASONING_KEYS): every turn's, in place, as data.py renders a training document (Qwen3's own
# template drops the reasoning of turns before the last user message; a tinyllm model was trained on all of it).
# A field is ignored where the content opens with its own <think> block, as data.py ignores it.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- set content = message['content'] %}"
    "{%- if message['role'] == 'assistant' and not content.startswith('<think>') %}"
    "{%- set found = namespace(reasoning='') %}"
    "{%- for key in " + json.dumps(list(REASONING_KEYS)) + " %}"
    "{%- if not found.reasoning and message[key] is string and message[key].strip() %}"
    "{%- set found.reasoning = message[key].strip() %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if found.reasoning %}"
    "{%- set content = '<think>\\n' + found.reasoning + '\\n</think>\\n\\n' + content %}"
    "{%- endif %}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# The template data.py wrote before CHAT_TEMPLATE read a reasoning field: it renders every message without one
# the same, so a tokenizer that carries it loads with CHAT_TEMPLATE (load_tokenizer, export_gguf.py).
PLAIN_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def current_chat_template(template: str) -> str:
    """CHAT_TEMPLATE for the template it replaced (PLAIN_CHAT_TEMPLATE), any other template as it is."""
    return CHAT_TEMPLATE if template == PLAIN_CHAT_TEMPLATE else template


def render_assistant(answer: str, reasoning: str | None = None) -> str:
    """An assistant turn's content, with the optional reasoning inside <think>...</think>."""
    return "".join(assistant_parts(answer, reasoning))


def assistant_parts(answer: str, reasoning: str | None = None) -> list[str]:
    """render_assistant as parts [text, marker, text, ...]: the <think> markers at odd positions."""
    if reasoning:
        return ["", THINK_OPEN, f"\n{reasoning.strip()}\n", THINK_CLOSE, f"\n\n{answer}"]
    return [answer]


# ----------------------------------------------------------------------------------------------
# The chat render: how a conversation's messages become the text a model is trained on (data.py's
# to_document) and prompted with (generation.chat_prompt), one function for both so the two cannot drift.

UUID_PATTERN = re.compile(r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b")


def clean_text(text: str, remove_uuids: bool = True) -> str:
    """NFC unicode, \\n newlines, UUIDs removed (they are noise to a language model), ends stripped."""
    if not unicodedata.is_normalized("NFC", text):
        text = unicodedata.normalize("NFC", text)
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    if remove_uuids and "-" in text:
        text = UUID_PATTERN.sub("", text)
    return text.strip()


def reasoning_of(mapping: dict) -> str | None:
    """The first non-empty reasoning field (REASONING_KEYS) of a message or record, else None."""
    for key in REASONING_KEYS:
        if isinstance(mapping.get(key), str) and mapping[key].strip():
            return mapping[key]
    return None


def think_parts(content: str) -> list[str]:
    """Assistant content as parts [text, marker, text, ...]: a leading <think>...</think> (reasoning
    already inside the content) keeps its markers; any other special-token string is text."""
    close = content.find(THINK_CLOSE, len(THINK_OPEN))
    if content.startswith(THINK_OPEN) and close >= 0:
        return ["", THINK_OPEN, content[len(THINK_OPEN) : close], THINK_CLOSE, content[close + len(THINK_CLOSE) :]]
    return [content]


def render_chat(messages: list[dict], chat_template: str, add_generation_prompt: bool = False) -> str:
    """The chat template applied exactly as transformers' apply_chat_template(tokenize=False) does."""
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(
        conversations=[messages], chat_template=chat_template, add_generation_prompt=add_generation_prompt
    )
    return rendered[0]


def message_turns(messages: list[dict], remove_uuids: bool) -> list[dict]:
    """Messages ({"role", "content"}, reasoning under a REASONING_KEYS name) as the turns a chat is rendered from:
    {"role", "parts"}, the content cleaned, an assistant's reasoning in <think> (parts: [text, marker, text, ...])."""
    turns = []
    for message in messages:
        content = clean_text(message["content"], remove_uuids)
        reasoning = reasoning_of(message)
        reasoning = reasoning and clean_text(reasoning, remove_uuids)
        if message["role"] != "assistant":
            parts = [content]
        elif reasoning and not content.startswith(THINK_OPEN):
            parts = assistant_parts(content, reasoning)
        else:
            parts = think_parts(content)
        turns.append({"role": message["role"], "parts": parts})
    return turns


def render_turns(turns: list[dict], chat_template: str, add_generation_prompt: bool = False) -> str:
    """message_turns' turns through the chat template: a training document, or with `add_generation_prompt` a
    prompt that ends in the assistant's header."""
    messages = [{"role": turn["role"], "content": "".join(turn["parts"])} for turn in turns]
    return render_chat(messages, chat_template, add_generation_prompt)


def render_prompt(messages: list[dict], chat_template: str) -> str:
    """The prompt for a reply to `messages` (a system turn, user turns, earlier replies): rendered as a training
    document is (data.py's to_document), then the assistant's header. Content is cleaned as data.py cleans it;
    the UUIDs are kept, being the user's."""
    return render_turns(message_turns(messages, remove_uuids=False), chat_template, add_generation_prompt=True)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def tokenizer_folder(folder: str | Path) -> Path:
    """The folder holding the tokenizer files: `folder` itself, its `tokenizer/` subfolder (a corpus) or its
    `model/` subfolder (a run: the exported model's tokenizer).

    Checked here because transformers answers a folder without them with a long sentencepiece/tiktoken hint.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise UserError(f"tokenizer folder {folder} does not exist")
    for candidate in (folder, folder / TOKENIZER_DIR, folder / "model"):
        if any((candidate / name).is_file() for name in TOKENIZER_FILES):
            return candidate
    raise UserError(
        f"tokenizer folder {folder} has no {' or '.join(TOKENIZER_FILES)} (nor a {TOKENIZER_DIR}/ or model/ "
        "subfolder with one)"
    )


def load_tokenizer(folder: str | Path):
    """AutoTokenizer.from_pretrained(folder), with a clear error when it does not load or lacks our specials;
    the chat template data.py wrote before CHAT_TEMPLATE is read as CHAT_TEMPLATE (current_chat_template).

    `folder` is a tokenizer folder, or a corpus folder (its `tokenizer/` subfolder is used).
    """
    from transformers import AutoTokenizer

    folder = tokenizer_folder(folder)
    if not (folder / "tokenizer.json").is_file():  # else transformers' hint about sentencepiece, 5 lines long
        raise UserError(
            f"tokenizer folder {folder} has no tokenizer.json (a fast tokenizer's file, which tinyllm's "
            "tokenizers are saved as; data.py writes one into CORPUS/tokenizer)"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
    except Exception as error:  # transformers raises many types here
        raise UserError(f"tokenizer folder {folder} does not load: {type(error).__name__}: {error}") from None
    for position, token in enumerate(SPECIAL_TOKENS):
        if tokenizer.convert_tokens_to_ids(token) != position:
            raise UserError(f"tokenizer {folder}: special token {token} must have id {position}")
    if not tokenizer.chat_template:
        raise UserError(f"tokenizer {folder} has no chat template")
    tokenizer.chat_template = current_chat_template(tokenizer.chat_template)
    return tokenizer


def vocabulary_sha256(tokenizer) -> str:
    """sha256 of what decides the token ids: the vocabulary (token -> id) and the special tokens.

    Two tokenizers with the same value read and write the same ids whatever their other files say
    (a corpus' tokenizer/ and the copy an export writes into RUN/model compare equal)."""
    specials = sorted(
        (index, token.content) for index, token in tokenizer.added_tokens_decoder.items() if token.special
    )
    payload = {"vocabulary": sorted(tokenizer.get_vocab().items(), key=lambda item: item[1]), "special": specials}
    return hashlib.sha256(json.dumps(payload, ensure_ascii=False).encode("utf-8")).hexdigest()


def token_byte_lengths(tokenizer_file: Path, size: int) -> torch.Tensor:
    """Each token id's UTF-8 bytes as the byte-level BPE decodes it (int64, `size` ids): one byte per
    character of a vocabulary token (ByteLevel's alphabet), an added token's text in UTF-8, 0 for a
    special token and for an id past the tokenizer's vocabulary. Bits per byte divide by their sum."""
    import torch
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    lengths = [0] * size
    for token, index in tokenizer.get_vocab(with_added_tokens=False).items():
        lengths[index] = len(token)
    for index, added in tokenizer.get_added_tokens_decoder().items():
        lengths[index] = 0 if added.special else len(added.content.encode("utf-8"))
    return torch.tensor(lengths, dtype=torch.int64)


# ----------------------------------------------------------------------------------------------
# Corpus format (DESIGN.md, "Corpus folder").

FORMAT_VERSION = 3  # 2: each shard has a .mask beside it; 3: each split has a .docs (where its documents end)
SPLITS = ("train", "validation", "test")
CORPUS_MANIFEST = "corpus_manifest.json"
SOURCE_MANIFEST = "source_manifest.json"
DATA_CARD = "DATA_CARD.md"
TOKENIZER_DIR = "tokenizer"


def token_dtype(vocab_size: int) -> str:
    """uint16 while every id fits, else uint32."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:05d}.bin"


# The mask stream: one uint8 per token, in files `{split}-NNNNN.mask` cut exactly like the token
# shards. It says what each token is, so train.py --loss-on assistant can count only the answers.
MASK_PROMPT = 0  # a chat's markup, system and user turns, the role header and the document's EOS
MASK_ASSISTANT = 1  # an assistant's answer: its content (reasoning and <think> markers included) and <|im_end|>
MASK_TEXT = 2  # a plain-text document (its EOS included)
MASK_CLASSES = {"prompt": MASK_PROMPT, "assistant": MASK_ASSISTANT, "text": MASK_TEXT}
IGNORE_INDEX = -100  # a target the loss skips (F.cross_entropy's default ignore_index): the tokens not counted


def mask_name(shard: str) -> str:
    """The mask file beside token shard `shard` (train-00000.bin -> train-00000.mask)."""
    return shard[: -len(".bin")] + ".mask"


# The document index: `{split}.docs`, one little-endian uint64 per document, the offset in the split's
# stream just past its <eos> (increasing; the last is the split's token count). train.py --packing reads
# it to start rows at documents and to keep attention inside one (DESIGN.md, "Data order").
DOCUMENT_INDEX_DTYPE = "<u8"


def document_index_name(split: str) -> str:
    return f"{split}.docs"


SOURCE_NAME = re.compile(r"[A-Za-z0-9_.-]+")  # a source label (data.py) and a mixture source's name (train.py)


def stream_key(split: str, label: str | None) -> str:
    """Which token stream a document goes to: its split, or with source labels `{split}-{label}`
    (whose shards are then `{split}-{label}-NNNNN.bin`)."""
    return split if label is None else f"{split}-{label}"


@dataclass(frozen=True)
class Manifest:
    """corpus_manifest.json of a finished corpus, read and checked once (load_manifest, parse_manifest).

    Layout of `record`: {"format_version", "dtype", "vocab_size", "special_tokens": {name: id},
    "tokenizer_sha256", "vocabulary_sha256" (see vocabulary_sha256),
    "splits": {split: {"files": [{"name", "bytes", "sha256", "tokens",
    "mask": {"name", "bytes", "sha256"}}], "tokens", "documents", "mask_tokens": {class: count},
    "document_index": {"name", "bytes", "sha256"} (absent when the split has no document),
    "sources": {label: the same, for its own stream} (only with source labels)}},
    "files": {relative path: sha256} for the other files, ...}.
    """

    record: dict  # the JSON as data.py wrote it
    sha256: str  # of the file's bytes: what names the corpus in a run's settings

    @property
    def shard_dtype(self) -> np.dtype:
        """The token ids' type in the shards (little-endian)."""
        return np.dtype(self.record["dtype"]).newbyteorder("<")

    @property
    def vocab_size(self) -> int:
        return int(self.record["vocab_size"])

    @property
    def asked_vocab_size(self) -> int:
        """The --vocab-size data.py was given or chose; more than vocab_size where the text supported fewer."""
        return int(self.record.get("settings", {}).get("vocab_size", self.vocab_size))

    @property
    def special_tokens(self) -> dict[str, int]:
        return self.record.get("special_tokens", {})

    @property
    def tokenizer_sha256(self) -> str | None:
        return self.record.get("tokenizer_sha256")

    @property
    def vocabulary_sha256(self) -> str | None:
        return self.record.get("vocabulary_sha256")

    @property
    def splits(self) -> dict[str, dict]:
        return self.record["splits"]

    @property
    def tokens(self) -> int:
        """Tokens in all splits."""
        return int(self.record["tokens"])

    @property
    def documents(self) -> int:
        """Documents in all splits."""
        return int(self.record["documents"])

    def split(self, name: str, label: str | None = None) -> dict:
        """Split `name`'s entry (an empty one when the corpus has none), or labelled source `label`'s in it."""
        entry = self.splits.get(name, {"files": []})
        return entry if label is None else entry.get("sources", {}).get(label, {"files": []})

    def labels(self, split: str = "train") -> list[str]:
        """The source labels of a split (data.py --source-label); none without labels."""
        return list(self.split(split).get("sources", {}))

    def mask_tokens(self, split: str = "train", label: str | None = None) -> dict[str, int]:
        """Tokens per mask class ("prompt", "assistant", "text") in a split, or in its labelled source `label`."""
        return self.split(split, label).get("mask_tokens", {})

    def files(self) -> dict[str, tuple[str, int | None]]:
        """{relative name: (sha256, bytes or None)} of every single file the manifest lists: shards, masks,
        document indexes and the other files (the tokenizer folder is covered by one tree hash)."""
        files = {}
        for split in self.splits.values():
            for entry in split.get("files", []):
                files[entry["name"]] = (entry["sha256"], entry.get("bytes"))
                if "mask" in entry:
                    files[entry["mask"]["name"]] = (entry["mask"]["sha256"], entry["mask"].get("bytes"))
            for part in [split, *split.get("sources", {}).values()]:
                if "document_index" in part:
                    index = part["document_index"]
                    files[index["name"]] = (index["sha256"], index.get("bytes"))
        for name, sha in self.record.get("files", {}).items():
            files[name] = (sha, None)
        return files


def load_manifest(corpus_dir: str | Path) -> Manifest:
    """The manifest of the corpus in `corpus_dir` (UserError when it is missing, unreadable or of another format)."""
    path = Path(corpus_dir) / CORPUS_MANIFEST
    if not Path(corpus_dir).is_dir():
        raise UserError(f"corpus {corpus_dir}: no such folder")
    if not path.is_file():
        raise UserError(f"{corpus_dir} is not a finished corpus: {CORPUS_MANIFEST} is missing")
    try:
        raw = path.read_bytes()
    except OSError as error:
        raise UserError(f"corpus manifest {path} cannot be read ({error.strerror or error})") from None
    return parse_manifest(raw, str(path))


def is_current_corpus(folder: Path) -> bool:
    """Whether `folder` holds a finished corpus this version reads (the benchmarks rebuild theirs when not)."""
    try:
        load_manifest(folder)
    except UserError:
        return False
    return True


def parse_manifest(raw: bytes, where: str) -> Manifest:
    """The manifest in `raw` (the bytes of a corpus_manifest.json at `where`, a path or a URL), checked."""
    record = parse_json(raw, f"corpus manifest {where}")
    if not isinstance(record, dict) or "splits" not in record or "dtype" not in record:
        raise UserError(f"corpus manifest {where} lacks 'splits' or 'dtype'")
    version = record.get("format_version")
    if isinstance(version, int) and version < FORMAT_VERSION:
        raise UserError(
            f"corpus {where.rsplit('/', 1)[0]} was built by an older data.py (format_version {version}; "
            f"this one reads {FORMAT_VERSION}, which adds the document index train.py --packing "
            "needs); rebuild it with the same data.py command (see its source_manifest.json)"
        )
    if version != FORMAT_VERSION:
        raise UserError(f"corpus manifest {where} has format_version {version!r}, this data.py reads {FORMAT_VERSION}")
    return Manifest(record, hashlib.sha256(raw).hexdigest())


def verify_corpus(corpus_dir: str | Path) -> list[str]:
    """Re-hash every shard, the tokenizer folder and the other listed files against the manifest.

    Returns one human-readable problem per mismatch, naming the file (empty list: all good).
    Raises UserError when the manifest itself is missing or unreadable.
    """
    root = Path(corpus_dir)
    manifest = load_manifest(root)
    try:
        return verify_files(root, manifest.record)
    except (KeyError, TypeError, ValueError) as error:
        raise UserError(f"corpus manifest in {corpus_dir} is malformed ({type(error).__name__}: {error})") from None


def verify_files(root: Path, manifest: dict) -> list[str]:
    """verify_corpus's problems with the files of `manifest` (a Manifest's record) in `root`."""
    itemsize = np.dtype(manifest["dtype"]).itemsize
    problems = []
    for split, info in manifest["splits"].items():
        for entry in info["files"]:
            path = root / entry["name"]
            if not path.is_file():
                problems.append(f"{entry['name']}: missing ({split} shard)")
                continue
            size = path.stat().st_size
            if size != entry["bytes"]:
                problems.append(f"{entry['name']}: {size} bytes, manifest says {entry['bytes']}")
            elif sha256_file(path) != entry["sha256"]:
                problems.append(f"{entry['name']}: sha256 does not match the manifest (corrupted or edited)")
            elif size != entry["tokens"] * itemsize:
                problems.append(f"{entry['name']}: {size} bytes is not {entry['tokens']} {manifest['dtype']} tokens")
            if "mask" in entry:
                problems.extend(verify_mask(root, entry))
            elif manifest.get("format_version", 0) >= 2:
                problems.append(f"{entry['name']}: the manifest lists no mask file for it")
        if sum(entry["tokens"] for entry in info["files"]) != info["tokens"]:
            problems.append(f"{split}: shard tokens do not add up to the split's {info['tokens']} tokens")
        for label, part in ({None: info} if "sources" not in info else info["sources"]).items():
            if "document_index" in part:
                problems.extend(verify_document_index(root, part))
            elif manifest.get("format_version", 0) >= 3 and part.get("documents"):
                stream = stream_key(split, label)  # a labelled source's index is {split}-{label}.docs
                problems.append(f"{stream}: the manifest lists no document index ({document_index_name(stream)})")
    tokenizer_dir = root / TOKENIZER_DIR
    if not tokenizer_dir.is_dir():
        problems.append(f"{TOKENIZER_DIR}/: missing")
    elif sha256_tree(tokenizer_dir) != manifest["tokenizer_sha256"]:
        problems.append(f"{TOKENIZER_DIR}/: sha256 of the folder does not match the manifest")
    for name, digest in manifest.get("files", {}).items():
        path = root / name
        if not path.is_file():
            problems.append(f"{name}: missing")
        elif sha256_file(path) != digest:
            problems.append(f"{name}: sha256 does not match the manifest")
    return problems


def recorded_file_problem(root: Path, record: dict, what: str) -> str | None:
    """Whether the file a manifest records ({name, bytes, sha256}) is there with its size and sha256."""
    path = root / record["name"]
    if not path.is_file():
        return f"{record['name']}: missing ({what})"
    size = path.stat().st_size
    if size != record["bytes"]:
        return f"{record['name']}: {size} bytes, manifest says {record['bytes']}"
    if sha256_file(path) != record["sha256"]:
        return f"{record['name']}: sha256 does not match the manifest (corrupted or edited)"
    return None


def verify_mask(root: Path, entry: dict) -> list[str]:
    """Problems with the mask file of shard `entry`: one byte per token, hashed, only known classes."""
    mask = entry["mask"]
    problem = recorded_file_problem(root, mask, f"mask of {entry['name']}")
    if problem:
        return [problem]
    size = (root / mask["name"]).stat().st_size
    if size != entry["tokens"]:
        return [f"{mask['name']}: {size} bytes for {entry['tokens']} tokens (one per token)"]
    return []


def verify_document_index(root: Path, info: dict) -> list[str]:
    """Problems with a split's document index: hashed, one uint64 per document, increasing to the split's end."""
    index = info["document_index"]
    problem = recorded_file_problem(root, index, "document index")
    if problem:
        return [problem]
    path = root / index["name"]
    size = path.stat().st_size
    if size != 8 * info["documents"]:
        return [f"{index['name']}: {size} bytes for {info['documents']} documents (8 per document)"]
    ends = np.fromfile(path, dtype=DOCUMENT_INDEX_DTYPE)
    if len(ends) and (ends[-1] != info["tokens"] or (len(ends) > 1 and np.any(ends[1:] <= ends[:-1]))):
        return [f"{index['name']}: the document ends do not increase to the split's {info['tokens']} tokens"]
    return []


# ----------------------------------------------------------------------------------------------
