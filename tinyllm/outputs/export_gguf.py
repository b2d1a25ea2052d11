"""Export a tinyllm model folder (Hugging Face Qwen3) to one GGUF file for llama.cpp and ollama.

    python export_gguf.py RUN/model --out model.gguf --type q8_0
    python export_gguf.py RUN/model --out model-f32.gguf --type f32 --verify
    ollama create tinyllm -f model.Modelfile

The GGUF is written with the `gguf` package alone: architecture `qwen3`, every hyperparameter
llama.cpp reads (including key/value length, since our head_dim is not hidden/heads), norms in
f32, the tied output embedding stored once, and the byte-level BPE as a `gpt2` tokenizer with the
`qwen2` pre-tokenizer. A `Modelfile` for `ollama create` is written beside it.

`--verify` checks the file before it is renamed into place: `gguf.GGUFReader` reads every tensor
back equal to the source (within the quantization error for q8_0), and llama.cpp (through
llama-cpp-python) tokenizes a varied text set exactly like the Hugging Face tokenizer and matches
the Hugging Face model's logits (f32: within 1e-3) or greedy continuations (f16, bf16, q8_0).
llama.cpp's log stays off the terminal; if it cannot load the file, the error quotes the log's
warning and error lines. A failed check leaves no output (an existing --out stays as it was).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import struct
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from tinyllm.common import (
    ArgumentParser,
    UserError,
    atomic_path,
    atomic_write_text,
    os_error_cause,
    read_json,
    run_main,
    sha256_file,
)
from tinyllm.data.corpus_format import (
    BOS,
    EOS,
    IM_END,
    IM_START,
    PAD,
    QWEN2_SPLIT_PATTERN,
    SPECIAL_TOKENS,
    THINK_CLOSE,
    THINK_OPEN,
    current_chat_template,
    load_tokenizer,
)
from tinyllm.model.config import Preset, nonpositive_field

GGUF_SUFFIX = ".gguf"
SHA256_PATTERN = re.compile(r"^[0-9a-f]{64}$")
PROVENANCE_FILE = "training_provenance.json"
PROVENANCE_KEYS = ("corpus_sha256", "tokenizer_sha256")
CONVERT_WORKERS = 2
CONVERT_AHEAD = 8  # tensors converted ahead of the writer (the first ones while the tokenizer is read)

# --type -> (ggml type of the matrices, general.file_type). Vectors (norms) always stay f32.
OUT_TYPES = {
    "f32": ("F32", "ALL_F32"),
    "f16": ("F16", "MOSTLY_F16"),
    "bf16": ("BF16", "MOSTLY_BF16"),
    "q8_0": ("Q8_0", "MOSTLY_Q8_0"),
}

# Stop generating at either end marker: <eos> ends a document, <|im_end|> ends a chat turn.
# The GGUF has eos = <eos> and eot = <|im_end|>; llama.cpp treats both as end-of-generation.
STOP_TOKENS = ("<|im_end|>", "<eos>")

# ChatML in ollama's Go template syntax, rendering exactly what corpus_format.CHAT_TEMPLATE renders with
# add_generation_prompt=True (system messages come through .Messages like any other role).
OLLAMA_TEMPLATE = (
    "{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}<|im_start|>assistant\n"
)

MODELFILE_TEMPLATE = '''# ollama Modelfile written by tinyllm export_gguf.py: `ollama create NAME -f {modelfile}`
FROM ./{gguf}
TEMPLATE """{template}"""
{stops}
PARAMETER num_ctx {context}
'''


# ----------------------------------------------------------------------------------------------
# Reading the Hugging Face folder


@dataclass
class ModelSource:
    """What export needs from a Hugging Face Qwen3 folder: hyperparameters and weight files."""

    folder: Path
    config: dict
    weight_files: list[Path]
    preset: Preset  # the architecture's shape, as model_config describes it
    vocab_size: int
    tied: bool


@dataclass
class Vocab:
    """The tokenizer as GGUF stores it (token types are gguf.TokenType values)."""

    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    bos_id: int
    eos_id: int
    pad_id: int
    eot_id: int | None
    chat_template: str
    tokenizer_json_sha256: str


def rope_theta_of(config: dict, config_path: Path) -> float:
    """rope_theta from transformers 5 (`rope_parameters`) or 4 (`rope_theta`, `rope_scaling`)."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise UserError(f"{config_path}: rope_type {rope_type!r} is not supported (only plain RoPE)")
    theta = rope.get("rope_theta", config.get("rope_theta"))
    if theta is None:
        raise UserError(f"{config_path}: no rope_theta")
    return float(theta)


def read_model_folder(folder: str | Path) -> ModelSource:
    """Validate that `folder` holds a Qwen3ForCausalLM we can export, and read its shape."""
    folder = Path(folder)
    if folder.is_file() and (folder.parent / "config.json").is_file():  # a file of the folder: model.safetensors
        raise UserError(f"{folder} is a file; give its model folder: {folder.parent}")
    if not folder.is_dir():
        raise UserError(f"model folder not found: {folder}")
    config_path = folder / "config.json"
    if not config_path.is_file() and (folder / "model" / "config.json").is_file():  # a run folder
        raise UserError(f"{folder} is a run folder, not its Hugging Face model folder; give {folder / 'model'}")
    if not config_path.is_file():
        raise UserError(f"{folder} is not a Hugging Face model folder (no config.json)")
    config = read_json(config_path, "config")
    architectures = config.get("architectures") or []
    if config.get("model_type") != "qwen3" or architectures[:1] != ["Qwen3ForCausalLM"]:
        raise UserError(
            f"{config_path}: not a Qwen3 model (model_type={config.get('model_type')!r}, "
            f"architectures={architectures}); export_gguf.py exports Qwen3ForCausalLM only"
        )
    for key, expected in (("hidden_act", "silu"), ("attention_bias", False), ("use_sliding_window", False)):
        if config.get(key, expected) != expected:
            raise UserError(f"{config_path}: {key}={config.get(key)!r} is not supported (expected {expected!r})")
    missing = [
        key
        for key in (
            "num_hidden_layers",
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "max_position_embeddings",
            "vocab_size",
            "rms_norm_eps",
        )
        if key not in config
    ]
    if missing:
        raise UserError(f"{config_path}: missing {', '.join(missing)}")
    heads = int(config["num_attention_heads"])
    if heads <= 0:
        raise UserError(f"{config_path}: num_attention_heads must be positive, got {heads}")
    preset = Preset(
        layers=int(config["num_hidden_layers"]),
        hidden=int(config["hidden_size"]),
        intermediate=int(config["intermediate_size"]),
        heads=heads,
        kv_heads=int(config["num_key_value_heads"]),
        head_dim=int(config.get("head_dim") or config["hidden_size"] // heads),
        context=int(config["max_position_embeddings"]),
        rope_theta=rope_theta_of(config, config_path),
        rms_norm_eps=float(config["rms_norm_eps"]),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),  # Qwen3Config's default
    )
    bad = nonpositive_field(preset)
    if bad:  # llama.cpp would assert (and abort) on some of these
        raise UserError(f"{config_path}: {bad[0]} must be positive, got {bad[1]}")
    return ModelSource(
        folder=folder,
        config=config,
        weight_files=weight_files(folder),
        preset=preset,
        vocab_size=int(config["vocab_size"]),
        tied=preset.tie_embeddings,
    )


def weight_files(folder: Path) -> list[Path]:
    """model.safetensors, or every shard named by model.safetensors.index.json."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(read_json(index, "safetensors index").get("weight_map", {}).values()))
        files = [folder / name for name in shards]
    else:
        files = [folder / "model.safetensors"]
    absent = [str(path) for path in files if not path.is_file()]
    if absent:
        hint = " (only safetensors weights are supported)" if (folder / "pytorch_model.bin").exists() else ""
        raise UserError(f"weights not found: {', '.join(absent)}{hint}")
    return files


def token_text(value) -> str | None:
    """tokenizer_config.json stores special tokens as strings or as AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def read_vocab(source: ModelSource) -> Vocab:
    """The tokenizer of `source.folder` as GGUF wants it, checked against the model and llama.cpp."""

    folder = source.folder
    tokenizer_path = folder / "tokenizer.json"
    if not tokenizer_path.is_file():
        raise UserError(f"{folder} has no tokenizer.json: save the tokenizer into the model folder")
    spec = read_json(tokenizer_path, "tokenizer")
    check_tokenizer_is_qwen2_bpe(spec, tokenizer_path, QWEN2_SPLIT_PATTERN)
    id_to_token = {index: token for token, index in spec["model"]["vocab"].items()}
    id_to_token.update({entry["id"]: entry["content"] for entry in spec.get("added_tokens", [])})
    count = len(id_to_token)
    if count != source.vocab_size:
        raise UserError(
            f"{tokenizer_path} has {count} tokens but {folder / 'config.json'} has vocab_size "
            f"{source.vocab_size} (embedding rows): the tokenizer does not belong to this model"
        )
    if set(id_to_token) != set(range(count)):
        raise UserError(f"{tokenizer_path}: token ids are not exactly 0..{count - 1}")
    added = {entry["id"]: entry for entry in spec.get("added_tokens", [])}
    for position, token in enumerate(SPECIAL_TOKENS):
        if id_to_token.get(position) != token or not added.get(position, {}).get("special"):
            raise UserError(f"{tokenizer_path}: special token {token} must have id {position}")

    tokens = [id_to_token[index] for index in range(count)]
    token_types = [token_type(tokens[index], added.get(index)) for index in range(count)]
    merges = [merge if isinstance(merge, str) else " ".join(merge) for merge in spec["model"].get("merges", [])]
    tokenizer_config = read_json(folder / "tokenizer_config.json", "tokenizer config")
    ids = role_token_ids(source, tokens, tokenizer_config)
    return Vocab(
        tokens=tokens,
        token_types=token_types,
        merges=merges,
        bos_id=ids["bos"],
        eos_id=ids["eos"],
        pad_id=ids["pad"],
        eot_id=tokens.index(IM_END) if IM_END in tokens else None,
        chat_template=read_chat_template(folder, tokenizer_config),
        tokenizer_json_sha256=sha256_file(tokenizer_path),
    )


def token_type(token: str, added: dict | None) -> int:
    """GGUF's type of a token: normal, or for an added one control (special) or user-defined."""

    if added is None:
        return int(gguf.TokenType.NORMAL)
    if token in (THINK_OPEN, THINK_CLOSE):
        # printed text in llama.cpp's output (a control token is hidden), as in Qwen3's own GGUFs:
        # clients that split the reasoning from the answer look for <think> in the text
        return int(gguf.TokenType.USER_DEFINED)
    return int(gguf.TokenType.CONTROL if added.get("special") else gguf.TokenType.USER_DEFINED)


def role_token_ids(source: ModelSource, tokens: list[str], tokenizer_config: dict) -> dict[str, int]:
    """The bos, eos and pad ids the tokenizer config names, checked against the model's config.json."""

    folder, ids = source.folder, {}
    for role, default in (("bos", BOS), ("eos", EOS), ("pad", PAD)):
        text = token_text(tokenizer_config.get(f"{role}_token")) or default
        if text not in tokens:
            raise UserError(f"{folder / 'tokenizer_config.json'}: {role}_token {text!r} is not in the vocabulary")
        ids[role] = tokens.index(text)
        declared = source.config.get(f"{role}_token_id")
        declared = declared if isinstance(declared, list) else [declared]
        if declared != [None] and ids[role] not in declared:
            raise UserError(
                f"{folder / 'config.json'}: {role}_token_id {declared} does not match the tokenizer's "
                f"{role}_token {text!r} (id {ids[role]}): mismatched tokenizer"
            )
    return ids


def check_tokenizer_is_qwen2_bpe(spec: dict, path: Path, split_pattern: str) -> None:
    """llama.cpp reproduces our tokenizer only if it is byte-level BPE with the Qwen2 split."""
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        raise UserError(f"{path}: tokenizer model is {model.get('type')!r}, expected byte-level 'BPE'")
    if spec.get("normalizer") is not None:
        raise UserError(f"{path}: a normalizer is set; llama.cpp's qwen2 tokenizer has none")
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre])
    patterns = [(step.get("pattern") or {}).get("Regex") for step in steps if step.get("type") == "Split"]
    byte_level = [step for step in steps if step.get("type") == "ByteLevel"]
    if patterns != [split_pattern] or len(byte_level) != 1 or byte_level[0].get("add_prefix_space"):
        raise UserError(
            f"{path}: pre-tokenizer is not the Qwen2 split + ByteLevel that data.py writes; "
            "llama.cpp would tokenize differently"
        )


def read_chat_template(folder: Path, tokenizer_config: dict) -> str:
    """transformers 5 saves chat_template.jinja; older versions put it in tokenizer_config.json. The template
    data.py wrote before it read a reasoning field is written as the one that does (current_chat_template)."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return current_chat_template(jinja.read_text(encoding="utf-8"))
    template = tokenizer_config.get("chat_template")
    if isinstance(template, str) and template:
        return current_chat_template(template)
    raise UserError(f"{folder} has no chat template (chat_template.jinja or tokenizer_config.json)")


def provenance_candidates(folder: Path) -> list[tuple[str, dict]]:
    """(where, {corpus_sha256, tokenizer_sha256}) from every place that may record them, best first."""
    candidates = []
    aliases = {"corpus_manifest_sha256": "corpus_sha256"}
    for path, section in (
        (folder / PROVENANCE_FILE, None),
        (folder / "config.json", "tinyllm"),
        (folder.parent / "training_settings.json", None),
    ):
        if path.is_file():
            record = read_json(path)
            record = (record.get(section) or {}) if section else record
            if isinstance(record, dict):
                label = f"{path} [{section}]" if section else str(path)
                candidates.append((label, {aliases.get(key, key): value for key, value in record.items()}))
    manifest = folder.parent / "corpus_manifest.json"
    if manifest.is_file():  # train.py's copy of the corpus manifest: its hash names the corpus
        record = read_json(manifest, "corpus manifest")
        candidates.append(
            (
                str(manifest),
                {"corpus_sha256": sha256_file(manifest), "tokenizer_sha256": record.get("tokenizer_sha256")},
            )
        )
    return candidates


def read_provenance(folder: Path, overrides: dict | None = None) -> tuple[dict, list[str]]:
    """Corpus and tokenizer sha256 for the metadata, each from the first place that has it.

    Order: command line, MODEL/training_provenance.json, the `tinyllm` section of config.json,
    RUN/training_settings.json (keys corpus_manifest_sha256, tokenizer_sha256, as the original
    trainer wrote them), RUN/corpus_manifest.json. Returns (values, where read).
    """
    found = {key: value for key, value in (overrides or {}).items() if value}
    for key, value in found.items():
        if not is_sha256(value):
            raise UserError(f"--{key.replace('_', '-')} {value!r} is not a lowercase hex sha256")
    sources = ["command line"] if found else []
    for label, record in provenance_candidates(folder):  # values like "n/a" are skipped
        new = {key: record[key] for key in PROVENANCE_KEYS if is_sha256(record.get(key)) and key not in found}
        if new:
            found.update(new)
            sources.append(label)
    return found, sources


def is_sha256(value) -> bool:
    return isinstance(value, str) and SHA256_PATTERN.match(value) is not None


# ----------------------------------------------------------------------------------------------
# Tensors


@dataclass
class PlannedTensor:
    """One tensor of the GGUF, known before any weight is read (the header lists them first)."""

    hf_name: str
    gguf_name: str
    file: Path
    shape: tuple[int, ...]
    ggml_type: gguf.GGMLQuantizationType

    @property
    def nbytes(self) -> int:
        block, type_size = gguf.GGML_QUANT_SIZES[self.ggml_type]
        return int(np.prod(self.shape)) // block * type_size


def ggml_type_for(shape: tuple[int, ...], out_type: str) -> gguf.GGMLQuantizationType:
    """Vectors (norms) stay f32; matrices take `out_type`.

    q8_0 needs rows that are a multiple of 32; a matrix whose rows are not falls back to f16,
    as llama.cpp's own converter does.
    """
    wanted = gguf.GGMLQuantizationType[OUT_TYPES[out_type][0]]
    if len(shape) < 2:
        return gguf.GGMLQuantizationType.F32
    if wanted == gguf.GGMLQuantizationType.Q8_0 and shape[-1] % gguf.GGML_QUANT_SIZES[wanted][0]:
        return gguf.GGMLQuantizationType.F16
    return wanted


def gguf_tensor_name(name_map, hf_name: str, source: ModelSource) -> str | None:
    """The GGUF name of a Hugging Face tensor; None for a tied lm_head (stored once, as token_embd)."""
    if hf_name == "lm_head.weight" and source.tied:
        return None
    mapped = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
    if mapped is None:
        raise UserError(f"{source.folder}: tensor {hf_name} has no GGUF name for qwen3")
    return mapped


@contextlib.contextmanager
def open_safetensors(path: Path):
    """safetensors.safe_open, with a truncated or garbage file (SafetensorError) one UserError naming it."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            yield handle
    except SafetensorError as error:
        raise UserError(
            f"{path} is not a readable safetensors file, truncated or corrupt ({error}); export "
            "the model again (train.py --export-only --out RUN)"
        ) from None


def plan_tensors(source: ModelSource, out_type: str) -> list[PlannedTensor]:
    """Every tensor to write, from the safetensors headers alone, checked against config.json."""
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3, source.preset.layers)
    plan: dict[str, PlannedTensor] = {}
    for path in source.weight_files:
        with open_safetensors(path) as handle:
            for hf_name in handle.keys():
                gguf_name = gguf_tensor_name(name_map, hf_name, source)
                if gguf_name is None:
                    continue
                if gguf_name in plan:
                    raise UserError(f"{source.folder}: tensor {gguf_name} appears twice in the weights")
                shape = tuple(handle.get_slice(hf_name).get_shape())
                plan[gguf_name] = PlannedTensor(hf_name, gguf_name, path, shape, ggml_type_for(shape, out_type))
    expected = expected_tensor_shapes(source)
    missing = sorted(set(expected) - set(plan))
    if missing:
        raise UserError(f"{source.folder}: weights lack {len(missing)} tensor(s), e.g. {', '.join(missing[:3])}")
    for gguf_name, shape in expected.items():
        if plan[gguf_name].shape != shape:
            raise UserError(
                f"{source.folder}: {plan[gguf_name].hf_name} has shape {list(plan[gguf_name].shape)}, "
                f"config.json says {list(shape)}"
            )
    return list(plan.values())


def expected_tensor_shapes(source: ModelSource) -> dict[str, tuple[int, ...]]:
    """The Hugging Face shape ([out, in] for a linear layer) config.json implies for each GGUF tensor."""
    p = source.preset
    query, key_value = p.heads * p.head_dim, p.kv_heads * p.head_dim
    per_layer = {
        "attn_norm": (p.hidden,),
        "attn_q": (query, p.hidden),
        "attn_k": (key_value, p.hidden),
        "attn_v": (key_value, p.hidden),
        "attn_output": (p.hidden, query),
        "attn_q_norm": (p.head_dim,),
        "attn_k_norm": (p.head_dim,),
        "ffn_norm": (p.hidden,),
        "ffn_gate": (p.intermediate, p.hidden),
        "ffn_up": (p.intermediate, p.hidden),
        "ffn_down": (p.hidden, p.intermediate),
    }
    shapes = {"token_embd.weight": (source.vocab_size, p.hidden), "output_norm.weight": (p.hidden,)}
    shapes |= {f"blk.{layer}.{part}.weight": shape for layer in range(p.layers) for part, shape in per_layer.items()}
    if not source.tied:
        shapes["output.weight"] = (source.vocab_size, p.hidden)
    return shapes


def iter_source_tensors(source: ModelSource):
    """Yield (hf_name, float32 torch tensor) for every tensor in the safetensors files."""
    import torch

    for path in source.weight_files:
        with open_safetensors(path) as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name).to(torch.float32)


def convert_tensor(tensor, ggml_type: gguf.GGMLQuantizationType, buffer=None) -> np.ndarray:
    """The bytes of one tensor in `ggml_type`, as a numpy array the writer can dump.

    f32 is the source itself (no copy); f16 is cast by torch (the same round-to-nearest-even as
    numpy, several times faster) into `buffer` when given, since fresh memory costs more than
    the cast; bf16 and q8_0 go through gguf.quants.
    """
    import torch

    if ggml_type == gguf.GGMLQuantizationType.F32:
        return tensor.to(torch.float32).contiguous().numpy()
    if ggml_type == gguf.GGMLQuantizationType.F16:
        if buffer is None:
            return tensor.to(torch.float16).contiguous().numpy()
        out = buffer[: tensor.numel()].view(tensor.shape)
        out.copy_(tensor)
        return out.numpy()
    return gguf.quants.quantize(tensor.to(torch.float32).numpy(), ggml_type)


@contextlib.contextmanager
def torch_threads(count: int):
    """Run torch ops with `count` intra-op threads, restoring the caller's setting after."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class BulkArrayWriter(gguf.GGUFWriter):
    """A GGUFWriter that packs long metadata arrays (tokens, token types, merges) in bulk.

    gguf-py packs arrays one item at a time through struct (about 0.7 s for a 33k vocabulary,
    longer than writing all of think72's f16 weights). The bytes are identical; a test compares.
    """

    def _pack_val(self, val, vtype, add_vtype, sub_type=None) -> bytes:
        array, little = gguf.GGUFValueType.ARRAY, gguf.GGUFEndian.LITTLE
        if vtype != array or self.endianess != little or not isinstance(val, list) or not val:
            return super()._pack_val(val, vtype, add_vtype, sub_type)
        item_type = sub_type or gguf.GGUFValueType.get_type(val[0])
        if item_type == gguf.GGUFValueType.STRING and all(type(item) is str for item in val):
            pack_length = struct.Struct("<Q").pack
            body = b"".join([pack_length(len(item)) + item for item in (text.encode("utf-8") for text in val)])
        elif item_type == gguf.GGUFValueType.INT32 and all(type(item) is int for item in val):
            body = np.asarray(val, dtype="<i4").tobytes()
        else:
            return super()._pack_val(val, vtype, add_vtype, sub_type)
        head = struct.pack("<I", vtype) if add_vtype else b""
        return head + struct.pack("<IQ", item_type, len(val)) + body


# ----------------------------------------------------------------------------------------------
# Writing


def model_name(folder: Path) -> str:
    folder = folder.resolve()
    return folder.parent.name if folder.name == "model" else folder.name


def add_metadata(
    writer: gguf.GGUFWriter,
    source: ModelSource,
    vocab: Vocab,
    out_type: str,
    name: str,
    provenance: dict,
    parameters: int,
) -> None:
    """general.*, provenance, every hyperparameter llama.cpp reads for qwen3, and the tokenizer."""
    file_type = gguf.LlamaFileType[OUT_TYPES[out_type][1]]
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name)
    writer.add_description("Qwen3 language model pretrained from scratch with tinyllm")
    writer.add_size_label(gguf.size_label(parameters, 0, 0, 0))
    writer.add_file_type(file_type)
    if file_type == gguf.LlamaFileType.MOSTLY_Q8_0:
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_string("tinyllm.tokenizer_json_sha256", vocab.tokenizer_json_sha256)
    for key, value in provenance.items():
        writer.add_string(f"tinyllm.{key}", value)

    writer.add_context_length(source.preset.context)
    writer.add_embedding_length(source.preset.hidden)
    writer.add_block_count(source.preset.layers)
    writer.add_feed_forward_length(source.preset.intermediate)
    writer.add_head_count(source.preset.heads)
    writer.add_head_count_kv(source.preset.kv_heads)
    writer.add_key_length(source.preset.head_dim)
    writer.add_value_length(source.preset.head_dim)
    writer.add_rope_freq_base(source.preset.rope_theta)
    writer.add_layer_norm_rms_eps(source.preset.rms_norm_eps)
    writer.add_vocab_size(source.vocab_size)

    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.token_types)
    writer.add_token_merges(vocab.merges)
    writer.add_bos_token_id(vocab.bos_id)
    writer.add_eos_token_id(vocab.eos_id)
    writer.add_pad_token_id(vocab.pad_id)
    if vocab.eot_id is not None:
        writer.add_eot_token_id(vocab.eot_id)
    writer.add_add_bos_token(False)
    writer.add_add_eos_token(False)
    writer.add_chat_template(vocab.chat_template)


class Conversions:
    """Convert the planned tensors in worker threads, `ahead` at a time; iterate for them in order.

    Work starts on construction, so the first tensors (the embedding is the largest) convert
    while the tokenizer is read and the metadata packed. torch runs single-threaded inside each
    worker (its own thread pool stalls on a busy machine), and f16 tensors are cast into
    `ahead + 1` recycled buffers, since fresh memory costs more than the cast: a buffer goes
    back to the pool when the loop asks for the next tensor, i.e. after the previous one was
    written. Only the part of a buffer a tensor fills is ever touched.
    """

    def __init__(
        self, source: ModelSource, plan: list[PlannedTensor], stack: contextlib.ExitStack, ahead: int = CONVERT_AHEAD
    ):
        import torch

        self.handles = {path: stack.enter_context(open_safetensors(path)) for path in source.weight_files}
        stack.enter_context(torch_threads(1))
        self.pool = ThreadPoolExecutor(max_workers=CONVERT_WORKERS)
        stack.callback(self.pool.shutdown, wait=True, cancel_futures=True)
        f16 = [int(np.prod(t.shape)) for t in plan if t.ggml_type == gguf.GGMLQuantizationType.F16]
        self.buffers = [torch.empty(max(f16), dtype=torch.float16) for _ in range(ahead + 1)] if f16 else []
        self.waiting = iter(plan)
        self.running: deque = deque()
        for _ in range(ahead):
            self.submit_next()

    def submit_next(self) -> None:
        planned = next(self.waiting, None)
        if planned is None:
            return
        tensor = self.handles[planned.file].get_tensor(planned.hf_name)
        buffer = self.buffers.pop() if planned.ggml_type == gguf.GGMLQuantizationType.F16 else None
        self.running.append((planned, buffer, self.pool.submit(convert_tensor, tensor, planned.ggml_type, buffer)))

    def __iter__(self):
        while self.running:
            planned, buffer, future = self.running.popleft()
            self.submit_next()
            data = future.result()
            if data.nbytes != planned.nbytes:
                raise RuntimeError(f"{planned.gguf_name}: {data.nbytes} bytes, planned {planned.nbytes}")
            yield data
            if buffer is not None:
                self.buffers.append(buffer)


def write_gguf(
    path: Path,
    source: ModelSource,
    vocab: Vocab,
    plan: list[PlannedTensor],
    tensors: Conversions,
    out_type: str,
    name: str,
    provenance: dict,
) -> dict:
    """Write the GGUF to `path`: metadata, tensor infos, then the tensors as they are converted."""
    writer = BulkArrayWriter(str(path), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.QWEN3])
    add_metadata(writer, source, vocab, out_type, name, provenance, sum(int(np.prod(t.shape)) for t in plan))
    for planned in plan:
        dtype = np.float16 if planned.ggml_type == gguf.GGMLQuantizationType.F16 else np.float32
        writer.add_tensor_info(planned.gguf_name, planned.shape, dtype, planned.nbytes, raw_dtype=planned.ggml_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for data in tensors:
        writer.write_tensor_data(data)
    writer.close()
    counts: dict[str, int] = {}
    for planned in plan:
        counts[planned.ggml_type.name] = counts.get(planned.ggml_type.name, 0) + 1
    return counts


def modelfile_text(gguf_path: Path, modelfile_path: Path, context: int) -> str:
    stops = "\n".join(f'PARAMETER stop "{token}"' for token in STOP_TOKENS)
    return MODELFILE_TEMPLATE.format(
        modelfile=modelfile_path.name, gguf=gguf_path.name, template=OLLAMA_TEMPLATE, stops=stops, context=context
    )


def modelfile_path_for(gguf_path: Path) -> Path:
    return gguf_path.with_suffix(".Modelfile")


def verify_export(source: ModelSource, temp: Path, out: Path, out_type: str, log) -> dict:
    """Both checks on the temporary file; a failure says that `out` was left alone."""
    checks = {}
    try:
        checks["reader"] = verify_tensors(source, temp, out_type)
        log(
            f"reader: {checks['reader']['tensors']} tensors match the source "
            f"(max abs error {checks['reader']['max_abs_error']:.3g})"
        )
        checks["llama_cpp"] = verify_with_llama_cpp(source.folder, temp, out_type, log=log)
    except VerificationFailed as error:
        raise VerificationFailed(f"--verify failed, so {out} was not written: {error}") from None
    return checks


@contextlib.contextmanager
def written_or_one_line(out: Path):
    """A failed write of the GGUF `out` as one UserError naming it: the cause of an OSError, and gguf's own
    short-write error ('26048 requested and 23416 written', no errno) as the full disk it is."""
    try:
        yield
    except OSError as error:
        cause = os_error_cause(error) if error.errno else f"{error} (a short write: no space left on the device?)"
        raise UserError(f"writing {out}: {cause}; nothing was written") from None


def export(
    folder: str | Path,
    out: str | Path,
    out_type: str = "f16",
    *,
    overwrite: bool = False,
    name: str | None = None,
    provenance: dict | None = None,
    verify: bool = False,
    modelfile: bool = True,
    log=print,
) -> dict:
    """Export `folder` to the GGUF `out` (and its Modelfile); returns a summary dict.

    With `verify`, the checks run on the temporary file and the output appears only if they pass.
    """
    if out_type not in OUT_TYPES:
        raise UserError(f"unknown --type {out_type!r}; choose one of {', '.join(OUT_TYPES)}")
    out = Path(out)
    if out.suffix != GGUF_SUFFIX:
        raise UserError(f"--out {out} must end in {GGUF_SUFFIX}")
    model_file = modelfile_path_for(out)
    existing = [path for path in (out, model_file if modelfile else None) if path is not None and path.exists()]
    if existing and not overwrite:
        raise UserError(f"{existing[0]} already exists; pass --overwrite to replace it")
    started = time.perf_counter()
    source = read_model_folder(folder)
    plan = plan_tensors(source, out_type)
    out.parent.mkdir(parents=True, exist_ok=True)

    with atomic_path(out) as temp:
        with contextlib.ExitStack() as stack, written_or_one_line(out):
            tensors = Conversions(source, plan, stack)  # converting starts now, in the background
            vocab = read_vocab(source)
            values, sources = read_provenance(source.folder, provenance)
            name = name or model_name(source.folder)
            counts = write_gguf(temp, source, vocab, plan, tensors, out_type, name, values)
        seconds = time.perf_counter() - started
        checks = verify_export(source, temp, out, out_type, log) if verify else {}
    if modelfile:
        atomic_write_text(model_file, modelfile_text(out, model_file, source.preset.context))
    return {
        "path": str(out),
        "modelfile": str(model_file) if modelfile else None,
        "type": out_type,
        "bytes": out.stat().st_size,
        "seconds": seconds,
        "tensor_types": counts,
        "vocab_size": len(vocab.tokens),
        "provenance": values,
        "provenance_sources": sources,
        "checks": checks,
    }


# ----------------------------------------------------------------------------------------------
# Verification


class VerificationFailed(UserError):
    """The GGUF does not reproduce the source model (the output is not renamed into place)."""


def expected_readback(array: np.ndarray, ggml_type) -> tuple[np.ndarray, np.ndarray | float]:
    """What a tensor should read back as, and the allowed absolute error per element.

    Computed with torch/numpy rounding, independently of the gguf.quants code that wrote it.
    """
    import torch

    name = ggml_type.name
    if name == "F32":
        return array, 0.0
    if name == "F16":
        return array.astype(np.float16).astype(np.float32), 0.0
    if name == "BF16":
        return torch.from_numpy(array).to(torch.bfloat16).to(torch.float32).numpy(), 0.0
    if name == "Q8_0":
        blocks = array.reshape(-1, 32)
        scale = np.abs(blocks).max(axis=1, keepdims=True) / 127.0
        # Half a step of rounding, plus the scale's own f16 rounding times the largest code (127).
        bound = scale * (0.5 + 127 * 2.0**-11) + 1e-12
        return array, np.broadcast_to(bound, blocks.shape).reshape(array.shape)
    raise VerificationFailed(f"unexpected tensor type {name}")


def verify_tensors(source: ModelSource, gguf_path: Path, out_type: str) -> dict:
    """Read the GGUF back with gguf.GGUFReader and compare metadata and every tensor with the source."""
    reader = gguf.GGUFReader(str(gguf_path))
    fields = {
        "general.architecture": "qwen3",
        "qwen3.block_count": source.preset.layers,
        "qwen3.context_length": source.preset.context,
        "qwen3.embedding_length": source.preset.hidden,
        "qwen3.feed_forward_length": source.preset.intermediate,
        "qwen3.attention.head_count": source.preset.heads,
        "qwen3.attention.head_count_kv": source.preset.kv_heads,
        "qwen3.attention.key_length": source.preset.head_dim,
        "qwen3.attention.value_length": source.preset.head_dim,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.add_bos_token": False,
    }
    for key, expected in fields.items():
        entry = reader.get_field(key)
        value = None if entry is None else entry.contents()
        if value != expected:
            raise VerificationFailed(f"{gguf_path}: metadata {key} is {value!r}, expected {expected!r}")
    for key, expected in (
        ("qwen3.rope.freq_base", source.preset.rope_theta),
        ("qwen3.attention.layer_norm_rms_epsilon", source.preset.rms_norm_eps),
    ):
        entry = reader.get_field(key)
        if entry is None or not np.isclose(entry.contents(), expected, rtol=1e-6):
            raise VerificationFailed(f"{gguf_path}: metadata {key} is not {expected}")

    stored = {tensor.name: tensor for tensor in reader.tensors}
    expected_names = set(expected_tensor_shapes(source))
    if set(stored) != expected_names:
        extra = sorted(set(stored) - expected_names)
        lacking = sorted(expected_names - set(stored))
        raise VerificationFailed(f"{gguf_path}: tensor names differ (extra {extra}, missing {lacking})")

    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3, source.preset.layers)
    worst = 0.0
    for hf_name, source_tensor in iter_source_tensors(source):
        gguf_name = gguf_tensor_name(name_map, hf_name, source)
        if gguf_name is None:
            continue
        array = source_tensor.numpy()
        tensor = stored[gguf_name]
        if array.ndim == 1 and tensor.tensor_type != gguf.GGMLQuantizationType.F32:
            raise VerificationFailed(f"{gguf_name} is {tensor.tensor_type.name}; norms must stay F32")
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(array.shape)
        target, tolerance = expected_readback(array, tensor.tensor_type)
        error = np.abs(values.astype(np.float32) - target)
        if not np.all(error <= tolerance):
            raise VerificationFailed(
                f"{gguf_path}: tensor {gguf_name} ({tensor.tensor_type.name}) differs from {hf_name} "
                f"by up to {float(error.max()):.3g}"
            )
        worst = max(worst, float(np.abs(values - array).max()))
    return {"tensors": len(stored), "max_abs_error": worst}


VERIFY_TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "Ünïcödé: café, naïve, Straße, Ελληνικά, русский, 日本語のテキスト, 中文, 한국어, emoji 🙂🚀👍🏽.",
    "def add(a, b):\n    return a + b  # sum\n\nprint(add(2, 3))\n",
    "Numbers: 3.14159, 1,234,567, -42, 2026-11-30, 0x1F, 1e-9, 100%.",
    "whitespace:   three spaces,\ttab,\t\ttwo tabs,\n\n\nnewlines,  \n  mixed \r\n CRLF     end    ",
    "Contractions: I'm, you're, we've, they'll, she'd, it's, DON'T, Can't.",
    " leading space and trailing space ",
    "",
]
VERIFY_CHAT = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 12 * 7?"},
    {"role": "assistant", "content": "<think>\n12 * 7 = 84.\n</think>\n\n84"},
    {"role": "user", "content": "And 13 * 7?"},
]
DEMO_QUESTIONS = ["What is 12 plus 7?", "Say hello in one short sentence."]
DEMO_PROMPTS = ["The capital of France is", "def fibonacci(n):\n"]
GREEDY_TOKENS = 16


def verify_texts(tokenizer) -> list[str]:
    """The varied text set: plain texts, every special token alone and inline, and a rendered chat."""
    specials = list(tokenizer.all_special_tokens)
    for token in tokenizer.get_added_vocab():
        if token not in specials:
            specials.append(token)
    rendered = tokenizer.apply_chat_template(VERIFY_CHAT, tokenize=False, add_generation_prompt=True)
    inline = "text" + " mid ".join(specials) + "tail" + "".join(specials)
    return [*VERIFY_TEXTS, *specials, inline, rendered]


def llama_cpp_chat(llama_cpp, llm, messages: list[dict]) -> str:
    """The chat as llama.cpp's built-in template support renders the GGUF's template (llama-cli, server)."""
    import ctypes

    template = llama_cpp.llama_model_chat_template(llm._model.model, None)
    chat = (llama_cpp.llama_chat_message * len(messages))(
        *[llama_cpp.llama_chat_message(role=m["role"].encode(), content=m["content"].encode()) for m in messages]
    )
    size = 1 << 16
    buffer = ctypes.create_string_buffer(size)
    length = llama_cpp.llama_chat_apply_template(template, chat, len(messages), True, buffer, size)
    if length < 0 or length > size:
        raise VerificationFailed(f"llama.cpp cannot apply the chat template (returned {length})")
    return buffer.raw[:length].decode("utf-8")


def llama_scores(llm, ids: list[int]) -> np.ndarray:
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[: len(ids)], dtype=np.float32)


def hf_greedy(model, ids: list[int], steps: int) -> list[int]:
    """Plain argmax decoding (whole sequence each step: no cache API, no generate() stop rules)."""
    import torch

    sequence = list(ids)
    with torch.no_grad():
        for _ in range(steps):
            sequence.append(int(model(torch.tensor([sequence])).logits[0, -1].argmax()))
    return sequence[len(ids) :]


def llama_greedy(llm, ids: list[int], steps: int) -> list[int]:
    llm.reset()
    llm.eval(ids)
    produced = []
    for _ in range(steps):
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        produced.append(token)
        llm.eval([token])
    return produced


def token_label(llm, token: int) -> str:
    """A token id with its text, e.g. `305 ' the'`."""
    return f"{token} {llm.detokenize([token], special=True).decode('utf-8', errors='replace')!r}"


def compare_greedy(model, llm, ids: list[int], prompt: str, tie_tolerance: float, log) -> float | None:
    """Fail unless llama.cpp continues `ids` greedily as HF does; returns the margin of an accepted near tie.

    Rounded weights may flip a near tie, after which the texts rightly differ. At the first
    token where they part, the margin is how far HF's logit for llama.cpp's token lies below
    HF's own top logit; the divergence is accepted only if that margin is within `tie_tolerance`
    (anything larger fails). Returns None when all GREEDY_TOKENS tokens are the same.
    """
    import torch

    expected = hf_greedy(model, ids, GREEDY_TOKENS)
    got = llama_greedy(llm, ids, GREEDY_TOKENS)
    if got == expected:
        log(f"greedy {prompt[:30]!r}: same {GREEDY_TOKENS} tokens")
        return None
    step = next(index for index, (a, b) in enumerate(zip(got, expected)) if a != b)
    with torch.no_grad():
        logits = model(torch.tensor([ids + expected[:step]])).logits[0, -1]
    margin = float(logits[expected[step]] - logits[got[step]])
    if margin > tie_tolerance:
        raise VerificationFailed(
            f"greedy {prompt[:30]!r}: diverges at token {step} of the continuation, where llama.cpp gives "
            f"{token_label(llm, got[step])} and HF {token_label(llm, expected[step])}; HF's logit for "
            f"llama.cpp's token is {margin:.3g} below its top (more than the near-tie threshold "
            f"{tie_tolerance:.3g}): llama.cpp {got}, HF {expected}"
        )
    log(
        f"greedy {prompt[:30]!r}: diverges at token {step}, where HF's logit for llama.cpp's token is only "
        f"{margin:.3g} below its top (a near tie within {tie_tolerance:.3g}, accepted)"
    )
    return margin


def greedy_summary(prompts: int, tie_margins: list[float], tie_tolerance: float) -> str:
    """One line: how many prompts matched fully and how many diverged at an accepted near tie."""
    line = f"llama.cpp greedy: {prompts - len(tie_margins)} of {prompts} prompts give the same {GREEDY_TOKENS} tokens"
    if tie_margins:
        verb = "diverges" if len(tie_margins) == 1 else "diverge"
        line += f", {len(tie_margins)} {verb} at a near tie (largest margin {max(tie_margins):.3g})"
    return line + f"; near ties are accepted within {tie_tolerance:.3g} (twice the max logit difference)"


def verify_passed_line(checks: dict, out_type: str) -> str:
    """--verify's last line: what passed, from export's `checks` (verify_tensors, verify_with_llama_cpp)."""
    reader, llama = checks["reader"], checks["llama_cpp"]
    ties = f", {llama['greedy_ties']} at an accepted near tie" if llama["greedy_ties"] else ""
    return (
        f"verify: passed: {reader['tensors']} tensors read back as written; {llama['texts']} texts tokenize "
        f"identically in llama.cpp and transformers; logits agree to {llama['max_logit_diff']:.3g} ({out_type}); "
        f"{llama['greedy_prompts']} prompts give the same {GREEDY_TOKENS} greedy tokens{ties}"
    )


# ggml_log_level in ggml.h (llama-cpp-python's _logger.py still lists the older numbering).
GGML_LOG_LEVEL_WARN = 3
GGML_LOG_LEVEL_ERROR = 4
GGML_LOG_LEVEL_CONT = 5  # the rest of the previous message


class LlamaCppLog:
    """llama.cpp's native log, held in memory instead of printed, to explain a failure.

    llama.cpp sends its log in pieces (a CONT piece continues the previous message), so pieces
    are joined into lines. Only the warning and error lines and the last few lines are kept:
    a full load logs a line per tensor.
    """

    def __init__(self, tail: int = 8):
        self.serious: deque[str] = deque(maxlen=40)
        self.tail: deque[str] = deque(maxlen=tail)
        self.level = 0
        self.pending = ""

    def write(self, level: int, text: bytes) -> None:
        if level != GGML_LOG_LEVEL_CONT:
            self.level = level
        self.pending += text.decode("utf-8", errors="replace")
        *lines, self.pending = self.pending.split("\n")
        for line in lines:
            self.add_line(line)

    def add_line(self, line: str) -> None:
        line = line.rstrip()
        if not line.strip():
            return
        self.tail.append(line)
        if self.level in (GGML_LOG_LEVEL_WARN, GGML_LOG_LEVEL_ERROR):
            self.serious.append(line)

    def reason(self) -> list[str]:
        """The warning and error lines so far, or else the last lines (a failed load ends with its reason)."""
        self.add_line(self.pending)
        self.pending = ""
        return list(self.serious or self.tail)


@contextlib.contextmanager
def llama_cpp_log_captured(llama_cpp):
    """Send llama.cpp's native log (loading details, context warnings) to a LlamaCppLog, not the terminal.

    `verbose=False` alone is not enough: llama-cpp-python's own log callback still prints
    warnings. The previous callback is restored on exit.
    """
    import ctypes

    previous = llama_cpp.llama_log_callback()
    user_data = ctypes.c_void_p()
    llama_cpp.llama_log_get(ctypes.byref(previous), ctypes.byref(user_data))
    log = LlamaCppLog()
    capture = llama_cpp.llama_log_callback(lambda level, text, data: log.write(level, text))
    llama_cpp.llama_log_set(capture, None)
    try:
        yield log
    finally:
        llama_cpp.llama_log_set(previous, user_data)


def load_llama(llama_cpp, gguf_path: Path, log: LlamaCppLog, **options):
    """llama_cpp.Llama(gguf_path), failing with llama.cpp's own reason (from its log), not only the generic one."""
    try:
        return llama_cpp.Llama(str(gguf_path), **options)
    except (ValueError, RuntimeError) as error:  # e.g. "Failed to load model from file: ..."
        reason = log.reason()
        if not reason:
            raise VerificationFailed(f"llama.cpp cannot load the GGUF: {error}") from None
        details = "\n".join(f"  {line}" for line in reason)
        raise VerificationFailed(f"llama.cpp cannot load the GGUF; its log says:\n{details}") from None


def verify_with_llama_cpp(
    folder: Path, gguf_path: Path, out_type: str, log=print, logit_tolerance: float = 1e-3
) -> dict:
    """Run the GGUF in llama.cpp and compare tokens, logits and greedy text with the HF model.

    The GGUF is loaded once, with the model's own context length: a vocab-only load would still
    get a context (llama-cpp-python's default of 512 tokens) for a model whose hyperparameters,
    context length included, were never read ("n_ctx_train (0)"). llama.cpp still rounds the
    context up to a multiple of 256 and warns about it, so its native log stays off the terminal.
    """
    # On a failed GGML_ASSERT, ggml prints a backtrace through forked gdb/backtrace helpers, which
    # can hang forever (seen with two threads asserting at once); without it the process aborts.
    os.environ.setdefault("GGML_NO_BACKTRACE", "1")
    try:
        import llama_cpp
    except ImportError:
        raise UserError(
            "--verify needs llama-cpp-python: pip install llama-cpp-python (it compiles llama.cpp: minutes)"
        ) from None
    import torch
    from transformers import Qwen3ForCausalLM
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    tokenizer = load_tokenizer(folder)
    try:
        model = Qwen3ForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    except Exception as error:  # the reference side of the comparison cannot be built
        first_line = (str(error).strip().splitlines() or [""])[0]
        raise VerificationFailed(f"transformers cannot load {folder} ({type(error).__name__}: {first_line})") from None
    context = model.config.max_position_embeddings
    options = dict(
        n_ctx=context,
        n_batch=context,
        logits_all=True,
        verbose=False,
        seed=0,
        type_k=llama_cpp.GGML_TYPE_F32,
        type_v=llama_cpp.GGML_TYPE_F32,
        flash_attn=False,
    )
    with (
        llama_cpp_log_captured(llama_cpp) as native_log,
        contextlib.closing(load_llama(llama_cpp, gguf_path, native_log, **options)) as llm,
    ):
        texts = verify_llama_cpp_tokenizer(llama_cpp, llm, tokenizer)
        log(
            f"llama.cpp tokenizer: {len(texts)} texts tokenize and detokenize exactly as HF; "
            f"its chat template renders as HF's; {', '.join(STOP_TOKENS)} end generation"
        )

        worst, largest = logit_differences(
            model, llm, tokenizer, [VERIFY_TEXTS[0], VERIFY_TEXTS[2], texts[-1]], context
        )
        log(f"llama.cpp logits: max abs difference {worst:.3g} from HF ({out_type}; largest |logit| {largest:.3g})")
        if out_type == "f32" and worst > logit_tolerance:
            raise VerificationFailed(f"f32 logits differ from HF by {worst:.3g} (> {logit_tolerance})")

        prompts = [
            *DEMO_PROMPTS,
            *(
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
                )
                for question in DEMO_QUESTIONS
            ),
        ]
        tie_tolerance = max(logit_tolerance, 2 * worst)
        tie_margins = []
        for prompt in prompts:
            ids = tokenizer.encode(prompt, add_special_tokens=False)[-(context - GREEDY_TOKENS) :]
            margin = compare_greedy(model, llm, ids, prompt, tie_tolerance, log)
            if margin is not None:
                tie_margins.append(margin)
    log(greedy_summary(len(prompts), tie_margins, tie_tolerance))
    return {
        "texts": len(texts),
        "max_logit_diff": worst,
        "max_abs_logit": largest,
        "greedy_prompts": len(prompts),
        "greedy_ties": len(tie_margins),
        "greedy_tie_tolerance": tie_tolerance,
        "greedy_max_tie_margin": max(tie_margins, default=0.0),
    }


def logit_differences(model, llm, tokenizer, texts: list[str], context: int) -> tuple[float, float]:
    """(largest |llama.cpp logit - HF logit|, largest |HF logit|) over these texts."""
    import torch

    worst = largest = 0.0
    for text in texts:
        ids = tokenizer.encode(text, add_special_tokens=False)[:context]
        with torch.no_grad():
            expected = model(torch.tensor([ids])).logits[0].numpy()
        worst = max(worst, float(np.abs(llama_scores(llm, ids) - expected).max()))
        largest = max(largest, float(np.abs(expected).max()))
    return worst, largest


def verify_llama_cpp_tokenizer(llama_cpp, llm, tokenizer) -> list[str]:
    """Fail unless llama.cpp tokenizes, detokenizes, renders chats and stops as HF; returns the texts."""
    texts = verify_texts(tokenizer)
    for text in texts:
        expected = tokenizer.encode(text, add_special_tokens=False)
        got = llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
        if got != expected:
            raise VerificationFailed(f"llama.cpp tokenizes {text[:40]!r} as {got[:12]}..., HF as {expected[:12]}...")
        back = llm.detokenize(got, special=True).decode("utf-8")
        if back != text:
            raise VerificationFailed(f"llama.cpp detokenizes {text[:40]!r} as {back[:40]!r}")
    rendered = llama_cpp_chat(llama_cpp, llm, VERIFY_CHAT)
    if rendered != tokenizer.apply_chat_template(VERIFY_CHAT, tokenize=False, add_generation_prompt=True):
        raise VerificationFailed(f"llama.cpp's built-in chat template renders the chat differently: {rendered!r}")
    vocab = llm._model.vocab
    not_stop = [
        token
        for token in STOP_TOKENS
        if not llama_cpp.llama_vocab_is_eog(vocab, tokenizer.convert_tokens_to_ids(token))
    ]
    if not_stop:
        raise VerificationFailed(f"llama.cpp does not stop generating at {not_stop}")
    if llama_cpp.llama_vocab_get_add_bos(vocab):
        raise VerificationFailed("llama.cpp would add a BOS token to every prompt")

    for token, shown in ((THINK_OPEN, THINK_OPEN), (THINK_CLOSE, THINK_CLOSE), (IM_START, "")):
        printed = llm.detokenize([tokenizer.convert_tokens_to_ids(token)], special=False).decode("utf-8")
        if printed != shown:
            raise VerificationFailed(f"llama.cpp prints {token} as {printed!r} in generated text, not {shown!r}")
    return texts


# ----------------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        description="Export a tinyllm Hugging Face Qwen3 folder to GGUF (llama.cpp, ollama).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("model", type=Path, help="Hugging Face model folder, e.g. RUN/model")
    parser.add_argument("--out", type=Path, default=None, help="output .gguf; None: RUN/model-TYPE.gguf")
    parser.add_argument("--type", default="f16", help=f"tensor type: {', '.join(OUT_TYPES)}")
    parser.add_argument("--name", default=None, help="general.name; None: the run folder's name")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output")
    parser.add_argument(
        "--verify",
        action="store_true",
        help="check with gguf.GGUFReader and llama.cpp before renaming the output into place",
    )
    parser.add_argument("--no-modelfile", action="store_true", help="do not write the ollama Modelfile")
    parser.add_argument("--corpus-sha256", default=None, help="corpus manifest sha256; None: read from the run")
    parser.add_argument("--tokenizer-sha256", default=None, help="corpus tokenizer sha256; None: read from the run")
    return parser


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.type not in OUT_TYPES:
        raise UserError(f"unknown --type {args.type!r}; choose one of {', '.join(OUT_TYPES)}")
    out = args.out or args.model.parent / f"{args.model.resolve().name}-{args.type}{GGUF_SUFFIX}"
    provenance = {"corpus_sha256": args.corpus_sha256, "tokenizer_sha256": args.tokenizer_sha256}
    summary = export(
        args.model,
        out,
        args.type,
        overwrite=args.overwrite,
        name=args.name,
        provenance=provenance,
        verify=args.verify,
        modelfile=not args.no_modelfile,
    )
    shown = ", ".join(f"{key}={value[:12]}..." for key, value in summary["provenance"].items()) or "none found"
    print(f"provenance: {shown} (from {', '.join(summary['provenance_sources']) or 'nowhere'})")
    print(
        f"wrote {Path(summary['path']).resolve()} ({summary['bytes'] / 1e6:.1f} MB, {args.type}, tensors "
        f"{summary['tensor_types']}) in {summary['seconds']:.1f}s"
    )
    if summary["modelfile"]:
        modelfile = Path(summary["modelfile"]).resolve()
        print(f"wrote {modelfile} (ollama: ollama create {model_name(args.model)} -f {modelfile})")
    if args.verify:
        print(verify_passed_line(summary["checks"], args.type))


def command() -> None:
    """The `tinyllm-gguf` console script (pyproject.toml): `python export_gguf.py` from anywhere."""
    run_main(main, script=True)


if __name__ == "__main__":
    run_main(main)
