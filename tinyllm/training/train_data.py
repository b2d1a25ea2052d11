"""The training-time reader of a corpus (DESIGN.md, "Data order"): what train.py's --data names, read as
micro-batches and evaluation rows.

    data = train_data.open_train_data(train_data.DataOptions(...), corpus)
    data.start_phases(decay_start)                  # once the run's length is known (a mixture's phases)
    batches = data.micro_batches(step, rank, device)
    rows = data.evaluation_rows("validation", rank)  # {source or None: EvaluationRows}

A split's token stream is cut into rows by the --packing mode (one small class each, `PACKINGS`); which
row each global sample reads is the keyed order (`BlockPermutation`, `BlockSampler`, `MixtureSampler`),
a pure function of (seed, mixture, step). `TrainData` (one corpus) and `MixtureData` (several sources)
are what train.py asks; the corpus files themselves are corpus_format.py's.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from tinyllm.common import UserError, say, script_command
from tinyllm.data import build as data
from tinyllm.data import corpus_format
from tinyllm.data.corpus_format import (
    CORPUS_MANIFEST,
    IGNORE_INDEX,
    MASK_ASSISTANT,
    MASK_CLASSES,
    MASK_TEXT,
    PAD,
    SOURCE_NAME,
    Manifest,
)
from tinyllm.model import attention
from tinyllm.store import remote_store

if TYPE_CHECKING:
    import torch

# ----------------------------------------------------------------------------------------------
# Where a --data value's corpus is: a folder, or a URL pulled once into PULLED_CORPORA.

PULLED_CORPORA = "corpus"  # train.py --data URL is pulled into corpus/<name>-<hash of the URL>


def local_corpus_folder(data_option: str) -> Path:
    """Where the corpus of a --data value is read: a URL's pulled copy, else the folder itself."""
    if remote_store.is_url(data_option):
        url = data_option.rstrip("/")
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", url.rsplit("/", 1)[-1]) or "corpus"
        return Path(PULLED_CORPORA) / f"{name}-{hashlib.sha256(url.encode()).hexdigest()[:8]}"
    return remote_store.local_path(data_option)


def corpus_options(data: str | Sequence[str]) -> list[str]:
    """The corpus of each source of a --data value (one for a plain corpus); the first's tokenizer is the run's."""
    mixture = parse_mixture(data)
    return (
        [data if isinstance(data, str) else data[0]]
        if mixture is None
        else [source.corpus for source in mixture.sources]
    )


def corpus_folders(data: str | Sequence[str]) -> list[Path]:
    """The local folder of each corpus of a --data value (corpus_options)."""
    return [local_corpus_folder(option) for option in corpus_options(data)]


def check_corpus_folder(corpus: Path) -> None:
    """A clear line, and the data.py command that builds one, when `corpus` is not a corpus folder."""
    if (corpus / CORPUS_MANIFEST).is_file():
        return
    folder, hash_sign, label = str(corpus).rpartition("#")
    if hash_sign and (Path(folder) / CORPUS_MANIFEST).is_file():  # one stream of a labelled corpus
        raise UserError(
            f"--data {corpus}: a source label picks a stream of a corpus within a mixture: NAME=CORPUS#LABEL:WEIGHT "
            f"(e.g. --data {label}={corpus}:1, or several such); --data {folder} trains on the whole corpus"
        )
    if not corpus.exists():
        raise UserError(
            f"--data {corpus}: no such corpus folder; build one with: {script_command('data')} --data "
            f"YOUR_FILES --out {corpus}"
        )
    if corpus.name == CORPUS_MANIFEST:
        raise UserError(f"--data {corpus} is the manifest; pass its corpus folder: --data {corpus.parent}")
    raise UserError(
        f"--data {corpus} is not a corpus folder (no {CORPUS_MANIFEST}); build one with: "
        f"{script_command('data')} --data {corpus} --out {PULLED_CORPORA}/{corpus.stem or 'NAME'}"
    )


def prepare_corpus(data: str | Sequence[str], demo: bool) -> Path:
    """The local folder of every corpus of a --data value, made ready: the demo's built if missing, a URL
    pulled once, a folder checked. Returns the first one's (its tokenizer is the run's)."""
    folders = [prepare_one_corpus(option, demo) for option in corpus_options(data)]
    return folders[0]


def prepare_one_corpus(data_option: str, demo: bool) -> Path:
    corpus = local_corpus_folder(data_option)
    if demo:
        if not (corpus / CORPUS_MANIFEST).is_file():
            say(f"demo: building the demo corpus in {corpus} ({script_command('data')} --demo --out {corpus})")
            data.build_demo_corpus(corpus)
        return corpus
    if remote_store.is_url(data_option):
        return remote_store.pull_corpus(data_option, corpus)
    check_corpus_folder(corpus)
    return corpus


def read_manifest(corpus: Path) -> Manifest:
    """corpus_format.load_manifest, with the --data hint when `corpus` is not a corpus folder, and what
    training needs of it: a train split and the vocabulary size."""
    check_corpus_folder(corpus)
    manifest = corpus_format.load_manifest(corpus)
    if "train" not in manifest.splits or "vocab_size" not in manifest.record:
        raise UserError(f"{corpus / CORPUS_MANIFEST} has no train split or no vocab_size")
    return manifest


# ----------------------------------------------------------------------------------------------
# The loss mask: which tokens' targets count (--loss-on, --text-loss).


def resolve_text_loss(loss_on: str, text_loss: str | None, sources: dict[str, dict[str, int]]) -> str | None:
    """The --text-loss a run records (None with --loss-on all); UserError when its data cannot serve it.
    `sources`: each source's train tokens per mask class, by the name an error gives it (a plain corpus:
    its folder; a mixture: each --data source). Some source must have assistant tokens, --text-loss is
    required where any has plain text, and every source must have tokens that count."""
    if loss_on == "all":
        return None
    if not any(counts.get("assistant") for counts in sources.values()):
        raise UserError(
            f"--loss-on assistant: the train split of {' or '.join(sources)} has no assistant tokens (no chat "
            "documents with an assistant turn); use --loss-on all"
        )
    texts = {name: counts["text"] for name, counts in sources.items() if counts.get("text")}
    if texts and text_loss is None:
        name, tokens = next(iter(texts.items()))
        raise UserError(
            f"--loss-on assistant: {name} also has {tokens:,} tokens of plain-text "
            "documents; say whether they count with --text-loss full or --text-loss none"
        )
    text_loss = text_loss or "none"
    for name, counts in sources.items():
        if not counts.get("assistant") and not (text_loss == "full" and counts.get("text")):
            raise UserError(
                f"--loss-on assistant --text-loss {text_loss}: the train split of {name} has no assistant "
                f"tokens{' and its plain text is not counted' if counts.get('text') else ''}, so it would be "
                "read and never trained on; count its text with --text-loss full, or leave it out of --data"
            )
    return text_loss


def counted_classes(loss_on: str, text_loss: str | None) -> np.ndarray | None:
    """Which mask classes (MASK_*) the loss counts, as a lookup table; None: every token."""
    if loss_on == "all":
        return None
    table = np.zeros(len(MASK_CLASSES), dtype=bool)
    table[MASK_ASSISTANT] = True
    table[MASK_TEXT] = text_loss == "full"
    return table


# ----------------------------------------------------------------------------------------------
# Packing (--packing): how a split's stream is cut into rows of C + 1 tokens. Each mode is one class:
# built from the document ends and C, it says how many rows there are and which pieces of the stream
# row i is (`spans`); `documents`: a micro-batch carries each token's document (attention.Documents);
# `pads`: a row may end in padding, whose targets are IGNORE_INDEX.


class StreamPacking:
    """Row i is tokens [i*C, i*C + C + 1) of the stream."""

    help = "blocks of the stream, attention across documents"
    reads_document_index = False
    documents = False
    pads = False

    def __init__(self, ends: np.ndarray, context: int):
        self.context, self.ends = context, ends
        self.rows = max(0, (int(ends[-1]) - 1) // context)

    def spans(self, index: int) -> list[tuple[int, int]]:
        """Row `index` as (stream offset, tokens) pieces, C + 1 tokens in all or fewer (then padded)."""
        return [(index * self.context, self.context + 1)]


class MaskedPacking(StreamPacking):
    """The stream's rows, each input token with its document: attention and RoPE positions stay inside it."""

    help = "blocks of the token stream, attention and RoPE positions kept inside each document"
    reads_document_index = True
    documents = True

    def segments(self, index: int) -> np.ndarray:
        """The document of each of row `index`'s C input tokens, numbered from 0."""
        start = index * self.context
        documents = np.searchsorted(self.ends, np.arange(start, start + self.context, dtype=np.uint64), side="right")
        return (documents - documents[0]).astype(np.int32)


BEST_FIT_WINDOW = 1024  # pieces best-fit packing chooses among (nanochat's buffer of documents)


class BestFitPacking:
    """Documents cut into pieces of at most C + 1 tokens (document_pieces), packed into rows that start
    at a piece by best fit (best_fit_rows); the unfilled end of a row is padding. A pure function of the
    document ends and C."""

    help = "rows that start at a document, filled by best fit, no mask"
    reads_document_index = True
    documents = False
    pads = True

    def __init__(self, ends: np.ndarray, context: int):
        self.rows, self.row_ends = 0, np.zeros(0, dtype=np.int64)
        self.piece_starts = self.piece_lengths = np.zeros(0, dtype=np.int64)
        if int(ends[-1]):
            starts, lengths = document_pieces(ends, context + 1)
            order, self.row_ends = best_fit_rows(lengths, context + 1)
            self.piece_starts, self.piece_lengths = starts[order], lengths[order]
            self.rows = len(self.row_ends)

    def spans(self, index: int) -> list[tuple[int, int]]:
        first = int(self.row_ends[index - 1]) if index else 0
        return list(
            zip(
                self.piece_starts[first : self.row_ends[index]].tolist(),
                self.piece_lengths[first : self.row_ends[index]].tolist(),
            )
        )


PACKINGS = {"masked": MaskedPacking, "bestfit": BestFitPacking, "stream": StreamPacking}  # the first: the default
PACKING_HELP = "; ".join(f"{name}: {kind.help}" for name, kind in PACKINGS.items()) + " (docs/training.md)"


def document_pieces(ends: np.ndarray, row_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """(start, length) of the pieces documents ending at `ends` are cut into: a document of up to
    `row_tokens` tokens is one piece; a longer one is cut into pieces of `row_tokens`, each starting on
    the last token of the one before (as stream blocks do), so that every token after its first is a target once."""
    starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
    lengths = ends.astype(np.int64) - starts
    stride = row_tokens - 1
    counts = np.maximum(1, -(-(lengths - 1) // stride))  # pieces per document
    document = np.repeat(np.arange(len(ends)), counts)
    within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    piece_starts = starts[document] + within * stride
    return piece_starts, np.minimum(row_tokens, ends[document].astype(np.int64) - piece_starts)


def best_fit_rows(lengths: np.ndarray, row_tokens: int, window: int = BEST_FIT_WINDOW) -> tuple[np.ndarray, np.ndarray]:
    """Pieces (of `lengths` tokens, in stream order) packed into rows of `row_tokens` tokens by best fit:
    each row starts with the longest of the next `window` pieces and is filled with the longest ones that
    still fit; what none fills is padding. Returns (the pieces in row order, each row's end in that order).
    A pure function of its inputs (nanochat's BOS-aligned best fit, with padding instead of cropping)."""
    pending: list[tuple[int, int]] = []  # (length, piece), sorted
    order, row_ends, following = [], [], 0
    while pending or following < len(lengths):
        while len(pending) < window and following < len(lengths):
            bisect.insort(pending, (int(lengths[following]), following))
            following += 1
        room = row_tokens
        while pending:
            fits = bisect.bisect_right(pending, (room, len(lengths))) - 1
            if fits < 0:
                break
            length, piece = pending.pop(fits)
            order.append(piece)
            room -= length
        row_ends.append(len(order))
    return np.array(order, dtype=np.int64), np.array(row_ends, dtype=np.int64)


def document_ends(corpus: Path, entry: dict, split: str, packing: str) -> np.ndarray:
    """The stream offset just past each document of a split's manifest `entry`: its document index, or for
    a split of labelled sources (one stream each, in the order of its files) theirs, offset to follow on."""
    parts = [entry] if "document_index" in entry or "sources" not in entry else list(entry["sources"].values())
    ends, offset = [], 0
    for part in parts:
        if "document_index" not in part:
            raise UserError(
                f"{corpus / CORPUS_MANIFEST}: split {split} lists no document index, which "
                f"--packing {packing} needs; rebuild the corpus with this data.py"
            )
        ends.append(
            np.fromfile(corpus / part["document_index"]["name"], dtype=corpus_format.DOCUMENT_INDEX_DTYPE) + offset
        )
        offset += part["tokens"]
    return np.concatenate(ends).astype(corpus_format.DOCUMENT_INDEX_DTYPE)


# ----------------------------------------------------------------------------------------------
# A split's rows and micro-batches.


class Batch(NamedTuple):
    """One micro-batch: inputs and targets (B, C); documents (attention.Documents: each token's document and
    position, the documents' starts) when attention is to stay inside documents (None: plain causal)."""

    inputs: torch.Tensor
    targets: torch.Tensor
    documents: attention.Documents | None = None


class TokenSplit:
    """One split's token stream (memory-mapped shards) cut into rows ("blocks") of C + 1 tokens (inputs and
    shifted targets), as `packing` (a PACKINGS name) says. Row i is `spans(i)`: (start, length) pieces of
    the stream. With `counted` (counted_classes), targets the loss does not count are IGNORE_INDEX.
    """

    def __init__(
        self,
        corpus: Path,
        manifest: Manifest,
        split: str,
        context: int,
        counted: np.ndarray | None = None,
        packing: str = "stream",
        source: str | None = None,
    ):
        entry = manifest.split(split, source)  # `source`: one labelled source's own stream (data.py --source-label)
        self.name, self.context, self.counted = split, context, counted
        items = [item for item in entry["files"] if item["bytes"] > 0]
        self.shards = [np.memmap(corpus / item["name"], dtype=manifest.shard_dtype, mode="r") for item in items]
        self.masks = (
            [np.memmap(corpus / item["mask"]["name"], dtype=np.uint8, mode="r") for item in items]
            if counted is not None
            else []
        )
        self.starts = np.cumsum([0] + [len(shard) for shard in self.shards])
        self.tokens = int(self.starts[-1])
        self.pad_id = int(manifest.special_tokens.get(PAD, 0))
        self.ends = np.array([self.tokens], dtype=np.uint64)  # "stream": one document, as far as rows go
        if PACKINGS[packing].reads_document_index and self.tokens:
            self.ends = document_ends(corpus, entry, split, packing)
        self.packing = PACKINGS[packing](self.ends, context)
        self.blocks = self.packing.rows

    def spans(self, index: int) -> list[tuple[int, int]]:
        """Row `index` as (stream offset, tokens) pieces, C + 1 tokens in all or fewer (then padded)."""
        return self.packing.spans(index)

    def _read(self, streams: list[np.ndarray], start: int, length: int) -> np.ndarray:
        end = start + length
        shard = int(np.searchsorted(self.starts, start, side="right")) - 1
        pieces = []
        while start < end:
            offset = start - self.starts[shard]
            piece = streams[shard][offset : offset + end - start]
            pieces.append(piece)
            start += len(piece)
            shard += 1
        return np.concatenate(pieces) if len(pieces) > 1 else pieces[0]

    def _row(self, streams: list[np.ndarray], index: int, fill: int) -> np.ndarray:
        pieces = [np.asarray(self._read(streams, start, length)) for start, length in self.spans(index)]
        row = np.concatenate(pieces) if len(pieces) > 1 else pieces[0]
        return np.pad(row, (0, self.context + 1 - len(row)), constant_values=fill)

    def block(self, index: int) -> np.ndarray:
        """Tokens of row `index` (C + 1 of them, possibly spanning shards, padding <pad>) as int64."""
        return self._row(self.shards, index, self.pad_id).astype(np.int64)

    def block_mask(self, index: int) -> np.ndarray:
        """The mask classes of row `index`'s C + 1 tokens (needs `counted`), len(MASK_CLASSES) for padding."""
        return self._row(self.masks, index, len(MASK_CLASSES))

    def row_tokens(self, index: int) -> int:
        """Tokens of row `index` before its padding (C + 1 unless the packing pads)."""
        return sum(length for _, length in self.spans(index))

    def batch(self, indices: list[int], device: torch.device) -> Batch:
        """The Batch of these rows, on `device`; targets not counted (padding too) are IGNORE_INDEX."""
        return to_batch([(self, index) for index in indices], device)


def to_batch(rows: list[tuple[TokenSplit, int]], device: torch.device) -> Batch:
    """The Batch of these (split, row) pairs on `device` (the splits alike in context, packing and counted
    classes: one corpus' split, or the sources of a mixture): targets the loss does not count, and a
    padded row's padding, are IGNORE_INDEX; a packing that keeps documents adds them (attention.documents_of,
    on the host: the device never waits to learn where they start)."""
    import torch

    first = rows[0][0]
    array = np.stack([split.block(index) for split, index in rows])
    targets = array[:, 1:].copy()
    if first.counted is not None:
        counted = np.append(first.counted, False)  # padding is never counted
        targets[~counted[np.stack([split.block_mask(index)[1:] for split, index in rows])]] = IGNORE_INDEX
    elif first.packing.pads:
        lengths = np.array([split.row_tokens(index) for split, index in rows])
        targets[np.arange(first.context)[None, :] >= lengths[:, None] - 1] = IGNORE_INDEX
    tensors = [torch.from_numpy(np.ascontiguousarray(array[:, :-1])), torch.from_numpy(targets)]
    if first.packing.documents:
        tensors.append(attention.documents_of(np.stack([split.packing.segments(index) for split, index in rows])))
    if device.type == "cuda":
        tensors = [tensor.pin_memory().to(device, non_blocking=True) for tensor in tensors]
    return Batch(*tensors)


class MixtureSplit:
    """One split of every source of a mixture (TokenSplit each); a batch takes (source, block) pairs."""

    def __init__(self, parts: list[TokenSplit]):
        self.parts = parts
        self.counted = parts[0].counted
        self.blocks = sum(part.blocks for part in parts)
        self.tokens = sum(part.tokens for part in parts)

    def batch(self, pairs: list[tuple[int, int]], device: torch.device) -> Batch:
        return to_batch([(self.parts[source], index) for source, index in pairs], device)


# ----------------------------------------------------------------------------------------------
# The data order: a keyed, stateless permutation of the rows per epoch.

MASK64 = (1 << 64) - 1
EVAL_EPOCH = 1 << 40  # evaluation blocks follow their own fixed order, never a training epoch's
EVAL_SEED = 0  # ... keyed alike for every run: the same blocks whatever the run's --seed


def mix64(value: int) -> int:
    """splitmix64's finalizer: a fast, well-mixed 64-bit hash."""
    value = (value + 0x9E3779B97F4A7C15) & MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & MASK64
    return value ^ (value >> 31)


class BlockPermutation:
    """A stateless pseudo-random bijection of range(n), keyed by (seed, epoch).

    A 4-round Feistel network over the smallest even-width bit domain holding n (fewer than
    4n values), with cycle-walking: re-encrypt until the value falls inside range(n). Any
    position is computed on its own, so seeking is O(1).
    """

    ROUNDS = 4

    def __init__(self, n: int, seed: int, epoch: int):
        if n <= 0:
            raise ValueError("a permutation needs at least one element")
        self.n = n
        self.half_bits = max(1, ((n - 1).bit_length() + 1) // 2)
        self.mask = (1 << self.half_bits) - 1
        base = mix64(mix64(seed & MASK64) ^ epoch)
        self.keys = [mix64(base + round_index) for round_index in range(self.ROUNDS)]

    def _encrypt(self, value: int) -> int:
        left, right = value >> self.half_bits, value & self.mask
        for key in self.keys:
            left, right = right, left ^ (mix64(right ^ key) & self.mask)
        return (left << self.half_bits) | right

    def __call__(self, position: int) -> int:
        value = self._encrypt(position)
        while value >= self.n:
            value = self._encrypt(value)
        return value


class BlockSampler:
    """The training data cursor: optimizer step s reads global samples [s*G, (s+1)*G).

    Within a step, sample j goes to micro-step j // (world * batch), rank (j // batch) % world,
    so the same global batch on any number of ranks reads the same samples per step.
    """

    def __init__(self, blocks: int, seed: int, batch_size: int, grad_accum: int, world: int):
        if blocks <= 0:
            raise UserError("the train split has fewer tokens than one block; use a smaller --context")
        self.blocks, self.seed = blocks, seed
        self.batch_size, self.grad_accum, self.world = batch_size, grad_accum, world
        self.global_batch = batch_size * grad_accum * world
        self._permutations: dict[int, BlockPermutation] = {}

    def block_of(self, sample: int) -> int:
        epoch, position = divmod(sample, self.blocks)
        if epoch not in self._permutations:
            self._permutations = {epoch: BlockPermutation(self.blocks, self.seed, epoch)}
        return self._permutations[epoch](position)

    def step_blocks(self, step: int) -> list[int]:
        """The G blocks of optimizer step `step`, in global order."""
        start = step * self.global_batch
        return [self.block_of(sample) for sample in range(start, start + self.global_batch)]

    def micro_batches(self, step: int, rank: int) -> list[list[int]]:
        """This rank's blocks of `step`, one list per micro-step."""
        blocks = self.step_blocks(step)
        per_micro = self.world * self.batch_size
        starts = [micro * per_micro + rank * self.batch_size for micro in range(self.grad_accum)]
        return [blocks[start : start + self.batch_size] for start in starts]

    def state_dict(self) -> dict:
        """What the data order depends on besides the step (which the checkpoint holds once, for all)."""
        return {"seed": self.seed, "blocks": self.blocks, "global_batch": self.global_batch}

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "blocks", "global_batch"):
            if state[key] != getattr(self, key):
                raise UserError(f"checkpoint data cursor has {key} {state[key]}, this run has {getattr(self, key)}")


# ----------------------------------------------------------------------------------------------
# Mixtures (train.py --data NAME=CORPUS[#LABEL]:WEIGHT ... and --mixture-schedule): which source each
# global sample reads, a pure function of the sample index (DESIGN.md, "Data order").


@dataclass(frozen=True)
class MixtureSource:
    name: str
    corpus: str  # a corpus folder or URL, as given
    label: str | None  # a labelled source inside that corpus (data.py --source-label); None: all of it


@dataclass(frozen=True)
class MixturePhase:
    start: str  # "0", a step number, or "decay" (the first step of --schedule wsd's decay)
    weights: tuple[float, ...]  # one per source, in --data order (0: not read in this phase)


@dataclass(frozen=True)
class Mixture:
    sources: tuple[MixtureSource, ...]
    phases: tuple[MixturePhase, ...]  # the first starts at step 0

    @property
    def names(self) -> list[str]:
        return [source.name for source in self.sources]

    def recorded(self) -> dict:
        """What the data order depends on (training_settings.json; a resume must match it)."""
        return {
            "sources": [{"name": source.name, "label": source.label} for source in self.sources],
            "phases": [
                {"start": phase.start, "weights": dict(zip(self.names, phase.weights))} for phase in self.phases
            ],
        }


def is_mixture_spec(value: str) -> bool:
    """`NAME=CORPUS...` (a mixture source) rather than a plain corpus folder or URL."""
    name, equals, _ = value.partition("=")
    return bool(equals) and SOURCE_NAME.fullmatch(name) is not None


def parse_weight(text: str, where: str) -> float:
    try:
        weight = float(text)
    except ValueError:
        weight = math.nan
    if not (math.isfinite(weight) and weight >= 0):
        raise UserError(f"{where}: the weight {text!r} is not a number >= 0")
    return weight


def parse_mixture_source(spec: str) -> tuple[MixtureSource, float]:
    """`NAME=CORPUS[#LABEL]:WEIGHT` -> (the source, its weight)."""
    name, _, rest = spec.partition("=")
    corpus, colon, weight = rest.rpartition(":")
    if not colon or not corpus or "/" in weight:
        raise UserError(f"--data {spec}: a mixture source is NAME=CORPUS:WEIGHT (e.g. web=corpus/web:0.8)")
    corpus, _, label = corpus.partition("#")
    return MixtureSource(name, corpus, label or None), parse_weight(weight, f"--data {spec}")


def parse_schedule_phase(text: str, names: list[str]) -> MixturePhase:
    """`START:NAME=WEIGHT,...` (a source not named has weight 0 in this phase)."""
    start, colon, pairs = text.strip().partition(":")
    start = start.strip()
    if not colon or not (start == "decay" or (start.isdigit() and int(start) > 0)):
        raise UserError(
            f"--mixture-schedule {text!r}: a phase is START:NAME=WEIGHT,... with START a step "
            "number > 0 or 'decay' (e.g. decay:web=0.3,chat=0.7)"
        )
    weights = dict.fromkeys(names, 0.0)
    for pair in pairs.split(","):
        name, _, weight = pair.strip().partition("=")
        if name not in weights:
            raise UserError(
                f"--mixture-schedule {text!r}: {name!r} is not a source of --data (they are {', '.join(names)})"
            )
        weights[name] = parse_weight(weight, f"--mixture-schedule {text!r}")
    return MixturePhase(str(int(start)) if start != "decay" else start, tuple(weights.values()))


def parse_mixture(specs: str | Sequence[str], schedule: str | None = None) -> Mixture | None:
    """The mixture of `--data` values (None: one plain corpus, read as a whole) and --mixture-schedule."""
    specs = [specs] if isinstance(specs, str) else list(specs)
    if len(specs) == 1 and not is_mixture_spec(specs[0]):
        if schedule:
            raise UserError("--mixture-schedule needs a mixture: --data NAME=CORPUS:WEIGHT ...")
        return None
    if not all(is_mixture_spec(spec) for spec in specs):
        plain = next(spec for spec in specs if not is_mixture_spec(spec))
        raise UserError(f"--data {plain}: with several values each is a mixture source NAME=CORPUS:WEIGHT")
    parsed = [parse_mixture_source(spec) for spec in specs]
    sources = tuple(source for source, _ in parsed)
    names = [source.name for source in sources]
    if len(set(names)) < len(names):
        raise UserError(f"--data: source names must differ, got {', '.join(names)}")
    phases = [MixturePhase("0", tuple(weight for _, weight in parsed))]
    phases += [parse_schedule_phase(text, names) for text in (schedule or "").split(";") if text.strip()]
    for phase in phases:
        if sum(phase.weights) <= 0:
            where = "--data" if phase.start == "0" else f"--mixture-schedule phase {phase.start}"
            raise UserError(f"{where}: the weights sum to 0; give at least one source a positive weight")
    return Mixture(sources, tuple(phases))


def phase_steps(mixture: Mixture, decay_start: int | None) -> list[int]:
    """The first step of each phase; UserError when they are not increasing ('decay' needs wsd)."""
    steps = []
    for phase in mixture.phases:
        if phase.start == "decay" and decay_start is None:
            raise UserError(
                "--mixture-schedule decay:... needs --schedule wsd (a cosine has no decay phase "
                "start); give a step number instead"
            )
        steps.append(decay_start if phase.start == "decay" else int(phase.start))
    if any(later <= earlier for earlier, later in zip(steps, steps[1:])):
        starts = ", ".join(f"{phase.start} (step {step})" for phase, step in zip(mixture.phases, steps))
        raise UserError(f"--mixture-schedule: the phases must start at increasing steps, got {starts}")
    return steps


def unreached_phases(mixture: Mixture, steps: list[int], total_steps: int) -> str | None:
    """The warning for the phases that start at or after the run's last step (`steps`: phase_steps'), which
    it never trains (an extended run may reach them); None when every phase is reached."""
    late = [f"{phase.start}" for phase, step in zip(mixture.phases, steps) if step >= total_steps]
    if not late:
        return None
    return (
        f"--mixture-schedule: the phase(s) starting at step {', '.join(late)} come after the run's last step "
        f"({total_steps - 1}): never trained in this run"
    )


def integer_weights(weights: tuple[float, ...]) -> tuple[int, ...]:
    """The weights as integers in the same exact ratio (from their decimal text: 0.8 and 0.2 -> 4 and 1)."""
    fractions = [Fraction(repr(weight)) for weight in weights]
    denominator = math.lcm(*(fraction.denominator for fraction in fractions))
    integers = [int(fraction * denominator) for fraction in fractions]
    divisor = math.gcd(*integers)
    return tuple(value // divisor for value in integers)


def apportion(weights: tuple[int, ...], count: int) -> list[int]:
    """How many of a phase's first `count` samples each source reads (Sainte-Lague's divisor method).

    Item j of source i sits at (2j + 1) / weight_i, ties to the lower i; the samples are those items
    in order. So every prefix's counts are within one sample of count * weight_i / total (two sources),
    and each count follows in closed form: round(count * share), then at most n/2 items moved."""
    total = sum(weights)
    counts = [(2 * count * weight + total) // (2 * total) for weight in weights]
    while sum(counts) > count:  # drop the last item: the largest position
        last = max((i for i, c in enumerate(counts) if c), key=lambda i: (Fraction(2 * counts[i] - 1, weights[i]), i))
        counts[last] -= 1
    while sum(counts) < count:
        counts[next_source(weights, counts)] += 1
    return counts


def next_source(weights: tuple[int, ...], counts: list[int]) -> int:
    """The source of the sample after these counts: its next item has the smallest position."""
    return min(
        (i for i, weight in enumerate(weights) if weight), key=lambda i: (Fraction(2 * counts[i] + 1, weights[i]), i)
    )


def source_seed(seed: int, name: str) -> int:
    """Each source's block order has its own key, so adding a source changes no other's order."""
    return (seed ^ int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")) & MASK64


class MixtureSampler(BlockSampler):
    """The data cursor of a mixture: global sample g -> (source, block), a pure function of g.

    Phase p (from step S_p, weights w_p) apportions its samples among the sources in closed form
    (apportion); source i's m-th sample overall is block perm(source_seed, epoch = m // blocks_i) of
    its own blocks, so a small source repeats (its epoch counter grows) and a large one is
    subsampled. Seeking to any step costs O(phases * sources)."""

    def __init__(
        self,
        names: list[str],
        source_blocks: list[int],
        phases: list[tuple[int, ...]],
        starts: list[int],
        seed: int,
        batch_size: int,
        grad_accum: int,
        world: int,
    ):
        super().__init__(max(1, sum(source_blocks)), seed, batch_size, grad_accum, world)
        for name, blocks, weights in zip(names, source_blocks, zip(*phases)):
            if blocks <= 0 and any(weights):
                raise UserError(
                    f"mixture source {name} has fewer train tokens than one block; use a smaller "
                    "--context or give it weight 0"
                )
        self.names, self.source_blocks = list(names), list(source_blocks)
        self.phases = [integer_weights(weights) for weights in phases]
        self.starts = list(starts)
        self._source_permutations: dict[tuple[int, int], BlockPermutation] = {}

    def _phase_of(self, step: int) -> int:
        return max(index for index, start in enumerate(self.starts) if start <= step)

    def source_counts(self, sample: int) -> list[int]:
        """How many samples each source has given before global sample `sample` (its epochs: / blocks)."""
        counts = [0] * len(self.names)
        for index, weights in enumerate(self.phases):
            begin = self.starts[index] * self.global_batch
            end = self.starts[index + 1] * self.global_batch if index + 1 < len(self.starts) else sample
            if sample <= begin:
                break
            taken = apportion(weights, min(sample, end) - begin)
            counts = [total + part for total, part in zip(counts, taken)]
        return counts

    def progress(self, step: int, context: int) -> dict[str, float]:
        """Tokens and epochs each source has given by optimizer step `step` (metrics.jsonl's fields)."""
        counts = self.source_counts(step * self.global_batch)
        fields = {}
        for name, count, blocks in zip(self.names, counts, self.source_blocks):
            fields[f"tokens/{name}"] = count * context
            fields[f"epochs/{name}"] = count / blocks if blocks else 0.0
        return fields

    def source_block(self, source: int, index: int) -> int:
        """Block of source `source`'s `index`-th sample (its own permutation per source epoch)."""
        epoch, position = divmod(index, self.source_blocks[source])
        if (source, epoch) not in self._source_permutations:
            if len(self._source_permutations) > 4 * len(self.names):
                self._source_permutations.clear()
            self._source_permutations[source, epoch] = BlockPermutation(
                self.source_blocks[source], source_seed(self.seed, self.names[source]), epoch
            )
        return self._source_permutations[source, epoch](position)

    def step_blocks(self, step: int) -> list[tuple[int, int]]:
        """The G (source, block) pairs of optimizer step `step`, in global order."""
        start = step * self.global_batch
        phase = self._phase_of(step)
        weights = self.phases[phase]
        counts = self.source_counts(start)
        within = apportion(weights, start - self.starts[phase] * self.global_batch)
        pairs = []
        for _ in range(self.global_batch):
            source = next_source(weights, within)
            pairs.append((source, self.source_block(source, counts[source])))
            counts[source] += 1
            within[source] += 1
        return pairs

    def state_dict(self) -> dict:
        return {**super().state_dict(), "sources": dict(zip(self.names, self.source_blocks))}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        theirs = state.get("sources")
        if theirs != dict(zip(self.names, self.source_blocks)):
            raise UserError(
                f"checkpoint data cursor has mixture sources (train blocks) {theirs}, this run has "
                f"{dict(zip(self.names, self.source_blocks))}"
            )


# ----------------------------------------------------------------------------------------------
# The reader train.py asks: micro-batches, evaluation rows, what it records, its state.


@dataclass(frozen=True)
class DataOptions:
    """What a run's data depends on (train.py's options, the model's context and the world size)."""

    data: str | Sequence[str]  # --data: a corpus folder or URL, or mixture sources NAME=CORPUS[#LABEL]:WEIGHT
    mixture_schedule: str | None
    packing: str  # a PACKINGS name
    loss_on: str
    text_loss: str | None
    context: int
    seed: int
    batch_size: int
    grad_accum: int
    world: int
    eval_tokens: int  # tokens' worth of evaluation rows (--eval-tokens)


@dataclass(frozen=True)
class EvaluationRows:
    """This rank's evaluation rows of one split (of one source): the first `total` of the split's fixed
    evaluation order (BlockPermutation at EVAL_EPOCH), every world-th from the rank's own."""

    split: TokenSplit
    rows: list[int]
    total: int  # over all ranks: 0 when the split has no rows

    def batches(self, batch_size: int, device: torch.device) -> Iterator[Batch]:
        for start in range(0, len(self.rows), batch_size):
            yield self.split.batch(self.rows[start : start + batch_size], device)


def evaluation_rows(split: TokenSplit, options: DataOptions, rank: int) -> EvaluationRows:
    """--eval-tokens' worth of a split's rows (the whole split when it is smaller) in their fixed order, this
    rank's share: the same rows whatever the batch, the split between ranks and the run's --seed, so the held-out
    scores of runs on one corpus compare (until 2026-12-06 they were --eval-batches global batches: a run at a
    quarter of another's batch scored a quarter of its blocks)."""
    if split.blocks == 0:
        return EvaluationRows(split, [], 0)
    count = min(split.blocks, math.ceil(options.eval_tokens / options.context))
    order = BlockPermutation(split.blocks, EVAL_SEED, EVAL_EPOCH)
    return EvaluationRows(split, [order(i) for i in range(rank, count, options.world)], count)


class TrainData:
    """One corpus read for training (open_train_data): its train split's micro-batches in the data order,
    the evaluation rows of its validation and test splits, and what a run records about it."""

    def __init__(self, options: DataOptions, corpus: Path, manifest: Manifest):
        self.options, self.corpus, self.manifest = options, corpus, manifest
        self.text_loss = resolve_text_loss(options.loss_on, options.text_loss, self.mask_tokens())
        self.counted = counted_classes(options.loss_on, self.text_loss)
        self.splits = self.read_splits()
        self.sampler = BlockSampler(
            self.splits["train"].blocks, options.seed, options.batch_size, options.grad_accum, options.world
        )

    def mask_tokens(self) -> dict[str, dict[str, int]]:
        """Each source's train tokens per mask class, by the name an error gives it (resolve_text_loss)."""
        return {str(self.corpus): self.manifest.mask_tokens("train")}

    def read_splits(self) -> dict[str, TokenSplit | MixtureSplit]:
        return {name: self.token_split(self.corpus, self.manifest, name) for name in corpus_format.SPLITS}

    def token_split(self, corpus: Path, manifest: Manifest, split: str, label: str | None = None) -> TokenSplit:
        return TokenSplit(corpus, manifest, split, self.options.context, self.counted, self.options.packing, label)

    def start_phases(self, decay_start: int | None) -> None:
        """Where a mixture's phases start ('decay': the recipe's decay start, known once the run's length
        is, which needs `train_blocks`); a plain corpus has one phase."""

    def unreached_phases(self, total_steps: int) -> str | None:
        """The warning for a mixture's phases a run of `total_steps` never reaches (a plain corpus: none)."""
        return None

    @property
    def train_blocks(self) -> int:
        return self.sampler.blocks

    @property
    def global_batch(self) -> int:
        """Rows per optimizer step, over all ranks and micro-steps."""
        return self.sampler.global_batch

    @property
    def documents(self) -> bool:
        """Whether a micro-batch carries its documents (the --packing keeps attention inside them)."""
        return PACKINGS[self.options.packing].documents

    def micro_batches(self, step: int, rank: int, device: torch.device) -> list[Batch]:
        """Rank `rank`'s micro-batches of optimizer step `step`, on `device`."""
        return [self.splits["train"].batch(rows, device) for rows in self.sampler.micro_batches(step, rank)]

    def evaluation_rows(self, split: str, rank: int) -> dict[str | None, EvaluationRows]:
        """{None: this rank's evaluation rows of `split`} (a mixture: one entry per source, by name)."""
        return {None: evaluation_rows(self.splits[split], self.options, rank)}

    def progress(self, step: int) -> dict[str, float]:
        """metrics.jsonl's fields of what each source has given by `step` (a mixture's; none here)."""
        return {}

    def recorded(self) -> dict:
        """What a resumed run must share (training_settings.json's "training"): the --text-loss as resolved and
        the corpus, by its manifest's sha256 and its tokenizer's."""
        return {
            "text_loss": self.text_loss,
            "corpus_manifest_sha256": self.manifest.sha256,
            "tokenizer_sha256": self.manifest.tokenizer_sha256,
        }

    def runtime(self) -> dict:
        """What may change between sessions (training_settings.json's "runtime"): where the corpus was read."""
        return {"data": str(self.corpus)}

    def summary(self, total_steps: int) -> list[str]:
        """The start-up lines about the data besides the warnings (a mixture's sources and phases)."""
        return []

    def warnings(self) -> list[str]:
        """What a run should know about its corpus at start: empty held-out splits, tiny train splits."""
        empty = [name for name in ("validation", "test") if self.splits[name].blocks == 0]
        context, lines = self.options.context, []
        if empty:
            fractions = " / ".join({"validation": "--val-fraction", "test": "--test-fraction"}[name] for name in empty)
            lines.append(
                f"the corpus has no {' or '.join(empty)} blocks of {context} tokens: no "
                f"{' and no '.join(f'{name} loss' for name in empty)} will be measured (rebuild the corpus "
                f"with more documents or a larger {fractions})"
            )
        if self.global_batch > self.train_blocks:
            lines.append(
                f"one step reads {self.global_batch} blocks but the train split has only "
                f"{self.train_blocks} blocks of {context} tokens: every step covers more than an epoch "
                "(use a smaller --batch-size or --grad-accum, or a larger corpus)"
            )
        return lines

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)


class MixtureData(TrainData):
    """Several sources (a corpus each, or a labelled source inside one) read as one: every split a
    MixtureSplit of the sources' own, the data order a MixtureSampler whose phases start at steps
    (start_phases). `corpora`: each corpus folder's manifest, the first source's first."""

    def __init__(self, options: DataOptions, mixture: Mixture, corpora: dict[Path, Manifest]):
        self.mixture, self.corpora = mixture, corpora
        corpus, manifest = next(iter(corpora.items()))  # its tokenizer is the run's
        for source in mixture.sources:
            check_source(source, corpora[local_corpus_folder(source.corpus)], mixture.sources[0].name, manifest)
        super().__init__(options, corpus, manifest)  # until start_phases, the sampler of all sources' blocks

    def mask_tokens(self) -> dict[str, dict[str, int]]:
        """Each source's own train tokens per mask class (a labelled source's, not its whole corpus')."""
        return {
            f"--data {source.name}": self.corpora[local_corpus_folder(source.corpus)].mask_tokens("train", source.label)
            for source in self.mixture.sources
        }

    def read_splits(self) -> dict[str, MixtureSplit]:
        parts = {name: [] for name in corpus_format.SPLITS}
        for source in self.mixture.sources:
            folder = local_corpus_folder(source.corpus)
            theirs = self.corpora[folder]
            for name, split_parts in parts.items():
                split_parts.append(self.token_split(folder, theirs, name, source.label))
        return {name: MixtureSplit(split_parts) for name, split_parts in parts.items()}

    def start_phases(self, decay_start: int | None) -> None:
        options = self.options
        self.sampler = MixtureSampler(
            self.mixture.names,
            [part.blocks for part in self.splits["train"].parts],
            [phase.weights for phase in self.mixture.phases],
            phase_steps(self.mixture, decay_start),
            options.seed,
            options.batch_size,
            options.grad_accum,
            options.world,
        )

    def unreached_phases(self, total_steps: int) -> str | None:
        return unreached_phases(self.mixture, self.sampler.starts, total_steps)

    def evaluation_rows(self, split: str, rank: int) -> dict[str | None, EvaluationRows]:
        """Each source's own evaluation rows of `split`, by name (so each gets a loss of its own)."""
        return {
            name: evaluation_rows(part, self.options, rank)
            for name, part in zip(self.mixture.names, self.splits[split].parts)
        }

    def progress(self, step: int) -> dict[str, float]:
        return self.sampler.progress(step, self.options.context)

    def recorded(self) -> dict:
        """TrainData's, and the mixture: its sources (each corpus by its manifest, its train blocks) and
        weights per phase."""
        mixture = self.mixture.recorded()
        for source, recorded, part in zip(self.mixture.sources, mixture["sources"], self.splits["train"].parts):
            recorded.update(
                corpus_manifest_sha256=self.corpora[local_corpus_folder(source.corpus)].sha256, train_blocks=part.blocks
            )
        return {**super().recorded(), "mixture": mixture}

    def runtime(self) -> dict:
        """--data as given, and where its phases start in this session's length (an extension moves decay)."""
        return {"data": list(self.options.data), "mixture_phase_steps": list(self.sampler.starts)}

    def summary(self, total_steps: int) -> list[str]:
        """Each source's size, each phase's weights, and the tokens and epochs planned over `total_steps`."""
        sampler, context = self.sampler, self.options.context
        lines = [
            "mixture: "
            + ", ".join(
                f"{name} {blocks:,} train blocks ({blocks * context:,} tokens)"
                for name, blocks in zip(sampler.names, sampler.source_blocks)
            )
        ]
        for phase, start in zip(self.mixture.phases, sampler.starts):
            weights = ", ".join(f"{name} {weight:g}" for name, weight in zip(sampler.names, phase.weights))
            lines.append(f"  from step {start}" + (" (decay)" if phase.start == "decay" else "") + f": {weights}")
        planned = self.progress(total_steps)
        lines.append(
            "  over the run: "
            + ", ".join(
                f"{name} {planned[f'tokens/{name}']:,} tokens ({planned[f'epochs/{name}']:.2f} epochs)"
                for name in sampler.names
            )
        )
        return lines


def check_source(source: MixtureSource, theirs: Manifest, first_name: str, first: Manifest) -> None:
    """A mixture source's corpus has the run's tokenizer (that of the first source's corpus), and the label
    it names."""
    if theirs.tokenizer_sha256 != first.tokenizer_sha256:
        raise UserError(
            f"--data {source.name}={source.corpus}: its tokenizer (sha256 "
            f"{str(theirs.tokenizer_sha256)[:12]}) is not that of the first source {first_name} "
            f"({str(first.tokenizer_sha256)[:12]}): a mixture needs one tokenizer; build the corpora "
            "with data.py --tokenizer FIRST_CORPUS"
        )
    labels = theirs.labels("train")
    if source.label is not None and source.label not in labels:
        raise UserError(
            f"--data {source.name}={source.corpus}#{source.label}: the corpus has no source labelled "
            f"{source.label} (it has: {', '.join(labels) or 'no labels'}; data.py --source-label)"
        )


def open_train_data(options: DataOptions, corpus: Path | None = None) -> TrainData:
    """The reader of --data: one corpus (TrainData) or a mixture of sources (MixtureData). `corpus`: the
    local folder of a plain corpus (None: corpus_folders'); every manifest is read once, here."""
    mixture = parse_mixture(options.data, options.mixture_schedule)
    if mixture is None:
        corpus = corpus or corpus_folders(options.data)[0]
        return TrainData(options, corpus, read_manifest(corpus))
    folders = dict.fromkeys(local_corpus_folder(source.corpus) for source in mixture.sources)
    return MixtureData(options, mixture, {folder: read_manifest(folder) for folder in folders})
