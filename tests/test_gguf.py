"""export_gguf.py: a tiny Qwen3 folder -> GGUF, read back by gguf.GGUFReader and run by llama.cpp."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tinyllm.common import UserError, temporary_target
from tinyllm.data import build as data
from tinyllm.data import corpus_format
from tinyllm.model import config as model_config
from tinyllm.outputs import export_gguf, export_hf

ROOT = Path(__file__).resolve().parent.parent

try:
    import llama_cpp  # noqa: F401

    HAVE_LLAMA_CPP = True
except ImportError:
    HAVE_LLAMA_CPP = False
needs_llama_cpp = pytest.mark.skipif(
    not HAVE_LLAMA_CPP, reason="llama-cpp-python is not installed (pip install -r requirements-dev.txt)"
)

# head_dim 32 with 4 heads of a 64-wide model: head_dim != hidden/heads, as in think72; the LM head tied to the
# embedding table, as in micro and larger (an untied head, as tiny and nano have:
# test_untied_output_is_written_and_runs).
PRESET = dataclasses.replace(model_config.PRESETS["tiny"], head_dim=32, tie_embeddings=True)


def sample_texts(count: int = 300) -> list[str]:
    rng = random.Random(0)
    words = [
        "the",
        "model",
        "learns",
        "tokens",
        "from",
        "text",
        "café",
        "naïve",
        "Straße",
        "日本語",
        "русский",
        "🙂",
        "def",
        "return",
        "print(x)",
        "  ",
        "\t",
        "\n",
        "123",
        "4.56",
        "I'm",
        "don't",
        "x += 1",
    ]
    return [" ".join(rng.choice(words) for _ in range(60)) for _ in range(count)]


def make_model_folder(folder: Path, vocab_size: int = 700, seed: int = 0) -> Path:
    """A random Qwen3 folder as train.py writes it; weights scaled so logits are far from zero."""
    import torch

    tokenizer, _ = data.train_tokenizer(sample_texts(), vocab_size, folder)
    torch.manual_seed(seed)
    model = model_config.build_model(PRESET, len(tokenizer))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.ndim == 1:
                parameter.copy_(1.0 + 0.2 * torch.randn_like(parameter))
            else:
                parameter.normal_(0.0, 0.5 if "embed" in name else 0.12)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_model_folder(tmp_path_factory.mktemp("hf") / "model")


def copy_folder(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def leftovers(folder: Path) -> list[str]:
    """The temporary files and folders (.NAME.<hex>.tmp/.old) left in `folder`."""
    return sorted(path.name for path in folder.iterdir() if temporary_target(path.name) is not None)


def field(reader, key):
    entry = reader.get_field(key)
    return None if entry is None else entry.contents()


# ----------------------------------------------------------------------------------------------
# Writing and the independent reader


@pytest.mark.parametrize("out_type", ["f32", "f16", "bf16", "q8_0"])
def test_reader_reads_back_every_tensor(model_dir, tmp_path, out_type):
    import gguf

    out = tmp_path / f"m-{out_type}.gguf"
    summary = export_gguf.export(model_dir, out, out_type, log=lambda *_: None)
    source = export_gguf.read_model_folder(model_dir)
    check = export_gguf.verify_tensors(source, out, out_type)
    reader = gguf.GGUFReader(str(out))
    types = {tensor.name: tensor.tensor_type.name for tensor in reader.tensors}
    assert check["tensors"] == len(types) == 2 + 11 * PRESET.layers  # output.weight is not duplicated
    assert "output.weight" not in types
    assert {types[name] for name in types if "norm" in name} == {"F32"}
    assert types["blk.0.attn_q.weight"] == export_gguf.OUT_TYPES[out_type][0]
    assert types["token_embd.weight"] == export_gguf.OUT_TYPES[out_type][0]
    if out_type == "q8_0":
        assert 0 < check["max_abs_error"] < 0.01
    elif out_type == "f32":
        assert check["max_abs_error"] == 0
    matrices = 7 * PRESET.layers + 1
    assert summary["tensor_types"] == (
        {"F32": len(types)}
        if out_type == "f32"
        else {"F32": len(types) - matrices, types["token_embd.weight"]: matrices}
    )
    assert leftovers(tmp_path) == []


def test_bulk_array_packing_gives_the_library_bytes():
    import gguf

    writer = export_gguf.BulkArrayWriter("unused.gguf", "qwen3")
    array = gguf.GGUFValueType.ARRAY
    for values in (["<pad>", "Ġthe", "日本", "🙂", ""], [0, 3, -1, 2**31 - 1], [1.5, 2.0], [True, False]):
        for add_vtype in (True, False):
            expected = gguf.GGUFWriter._pack_val(writer, values, array, add_vtype)
            assert writer._pack_val(values, array, add_vtype) == expected


def test_metadata_hparams_and_tokenizer(model_dir, tmp_path):
    import gguf

    out = tmp_path / "m.gguf"
    export_gguf.export(model_dir, out, "f16", name="tiny-test", log=lambda *_: None)
    reader = gguf.GGUFReader(str(out))
    tokenizer = corpus_format.load_tokenizer(model_dir)
    expected = {
        "general.architecture": "qwen3",
        "general.name": "tiny-test",
        "general.file_type": int(gguf.LlamaFileType.MOSTLY_F16),
        "qwen3.context_length": PRESET.context,
        "qwen3.embedding_length": PRESET.hidden,
        "qwen3.block_count": PRESET.layers,
        "qwen3.feed_forward_length": PRESET.intermediate,
        "qwen3.attention.head_count": PRESET.heads,
        "qwen3.attention.head_count_kv": PRESET.kv_heads,
        "qwen3.attention.key_length": 32,
        "qwen3.attention.value_length": 32,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.padding_token_id": 0,
        "tokenizer.ggml.eot_token_id": tokenizer.convert_tokens_to_ids(corpus_format.IM_END),
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.ggml.add_eos_token": False,
        "tokenizer.chat_template": corpus_format.CHAT_TEMPLATE,
    }
    assert {key: field(reader, key) for key in expected} == expected
    assert field(reader, "qwen3.rope.freq_base") == pytest.approx(PRESET.rope_theta)
    assert field(reader, "qwen3.attention.layer_norm_rms_epsilon") == pytest.approx(PRESET.rms_norm_eps)
    tokens = field(reader, "tokenizer.ggml.tokens")
    assert tokens == tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    types = field(reader, "tokenizer.ggml.token_type")
    control = [index for index, kind in enumerate(types) if kind == gguf.TokenType.CONTROL]
    # <think> and </think> are printed text (as in Qwen3's GGUFs); the chat-turn markers stay control tokens
    thinking = [
        corpus_format.SPECIAL_TOKENS.index(token) for token in (corpus_format.THINK_OPEN, corpus_format.THINK_CLOSE)
    ]
    assert control == [index for index in range(len(corpus_format.SPECIAL_TOKENS)) if index not in thinking]
    assert [types[index] for index in thinking] == [gguf.TokenType.USER_DEFINED] * 2
    spec = json.loads((model_dir / "tokenizer.json").read_text())
    assert field(reader, "tokenizer.ggml.merges") == [" ".join(pair) for pair in spec["model"]["merges"]]
    embedding = next(tensor for tensor in reader.tensors if tensor.name == "token_embd.weight")
    assert list(embedding.shape) == [PRESET.hidden, len(tokens)]  # ggml order: columns first


def test_provenance_from_folder_and_command_line(model_dir, tmp_path):
    import gguf

    folder = copy_folder(model_dir, tmp_path / "run" / "model")
    corpus, tokenizer_hash, other = "a" * 64, "b" * 64, "c" * 64
    (folder / "training_provenance.json").write_text(json.dumps({"corpus_sha256": corpus}))
    (folder.parent / "training_settings.json").write_text(
        json.dumps({"corpus_manifest_sha256": other, "tokenizer_sha256": tokenizer_hash})
    )
    summary = export_gguf.export(folder, tmp_path / "p.gguf", "f16", log=lambda *_: None)
    assert summary["provenance"] == {"corpus_sha256": corpus, "tokenizer_sha256": tokenizer_hash}
    reader = gguf.GGUFReader(str(tmp_path / "p.gguf"))
    assert field(reader, "tinyllm.corpus_sha256") == corpus
    assert field(reader, "tinyllm.tokenizer_sha256") == tokenizer_hash
    assert field(reader, "tinyllm.tokenizer_json_sha256") == export_gguf.sha256_file(folder / "tokenizer.json")
    assert field(reader, "general.name") == "run"

    summary = export_gguf.export(
        folder, tmp_path / "q.gguf", "f16", provenance={"corpus_sha256": other}, log=lambda *_: None
    )
    assert summary["provenance"]["corpus_sha256"] == other
    (folder / "training_provenance.json").write_text(json.dumps({"corpus_sha256": "n/a"}))
    assert export_gguf.read_provenance(folder)[0]["corpus_sha256"] == other  # "n/a" is skipped
    with pytest.raises(UserError, match="--corpus-sha256 'xyz' is not a lowercase hex sha256"):
        export_gguf.export(folder, tmp_path / "r.gguf", "f16", provenance={"corpus_sha256": "xyz"})
    assert not (tmp_path / "r.gguf").exists()


def test_provenance_from_corpus_manifest_never_from_the_model_card(model_dir, tmp_path):
    folder = copy_folder(model_dir, tmp_path / "run" / "model")
    manifest = folder.parent / "corpus_manifest.json"
    manifest.write_text(json.dumps({"format_version": 1, "tokenizer_sha256": "d" * 64}))
    values, sources = export_gguf.read_provenance(folder)
    assert values == {"corpus_sha256": export_gguf.sha256_file(manifest), "tokenizer_sha256": "d" * 64}
    assert sources == [str(manifest)]

    manifest.unlink()
    (folder / "README.md").write_text(
        f"# Card\nExact corpus manifest SHA-256: {'E' * 64}. Exact tokenizer SHA-256: {'f' * 64}.\n"
    )
    assert export_gguf.read_provenance(folder) == ({}, [])  # prose is no record


@pytest.mark.parametrize(
    "error, cause",
    [
        (OSError("26048 requested and 23416 written"), "26048 requested and 23416 written (a short write: no space"),
        (OSError(errno.ENOSPC, "No space left on device"), "no space left on device; nothing was written"),
    ],
)
def test_a_full_disk_is_one_line_and_no_file(model_dir, tmp_path, monkeypatch, error, cause):
    """gguf's writer reports a short write without an errno (a traceback before): one line naming the file."""

    def full(*args, **kwargs):
        raise error

    monkeypatch.setattr(export_gguf, "write_gguf", full)
    out = tmp_path / "full.gguf"
    with pytest.raises(UserError, match=f"^writing {re.escape(str(out))}: {re.escape(cause)}"):
        export_gguf.export(model_dir, out, "f16", log=lambda *_: None)
    assert list(tmp_path.iterdir()) == []


def test_sharded_bf16_weights(model_dir, tmp_path):
    """A folder saved in bf16 and in shards exports too; f32 output holds the bf16 values exactly."""
    import torch
    from transformers import Qwen3ForCausalLM

    folder = copy_folder(model_dir, tmp_path / "m")
    (folder / "model.safetensors").unlink()
    model = Qwen3ForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16)
    model.save_pretrained(folder, max_shard_size="100KB")
    assert (folder / "model.safetensors.index.json").is_file()
    out = tmp_path / "m.gguf"
    export_gguf.export(folder, out, "f32", log=lambda *_: None)
    check = export_gguf.verify_tensors(export_gguf.read_model_folder(folder), out, "f32")
    assert check["tensors"] == 2 + 11 * PRESET.layers and check["max_abs_error"] == 0


@needs_llama_cpp
def test_untied_output_is_written_and_runs(model_dir, tmp_path):
    import gguf
    import torch
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.config.tie_word_embeddings = False
    head = model.model.embed_tokens.weight.detach().clone()
    model.lm_head.weight = torch.nn.Parameter(head + 0.3 * torch.randn_like(head))
    folder = copy_folder(model_dir, tmp_path / "untied")
    model.save_pretrained(folder)
    assert json.loads((folder / "config.json").read_text())["tie_word_embeddings"] is False
    out = tmp_path / "untied.gguf"
    summary = export_gguf.export(folder, out, "f32", verify=True, log=lambda *_: None)
    names = [tensor.name for tensor in gguf.GGUFReader(str(out)).tensors]
    assert "output.weight" in names and len(names) == 3 + 11 * PRESET.layers
    assert summary["checks"]["llama_cpp"]["max_logit_diff"] <= 1e-3


def test_the_gguf_chat_template_renders_reasoning_as_training_did(model_dir, tmp_path):
    """The GGUF's template, rendered by jinja2 as llama-cpp-python's chat formatter does (trim_blocks,
    lstrip_blocks) and as transformers does, gives the chat data.py trained on: each reply's reasoning
    field (`reasoning_content`, or any name data.py reads) in <think> before it."""
    import gguf
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    out = tmp_path / "m.gguf"
    export_gguf.export(model_dir, out, "f32", log=lambda *_: None)
    template = field(gguf.GGUFReader(str(out)), "tokenizer.chat_template")
    chat = [
        {"role": "system", "content": "Answer with the number."},
        {"role": "user", "content": "What is 2 plus 3?"},
        {"role": "assistant", "content": "5", "reasoning_content": "2 + 3 = 5"},
        {"role": "user", "content": "And 10 plus 7?"},
        {"role": "assistant", "content": "17", "thinking": "10 + 7 = 17"},
    ]
    _, trained, _, _ = data.to_document({"messages": chat}, corpus_format.CHAT_TEMPLATE, True)
    assert trained.count("<think>\n") == 2
    for blocks in (False, True):
        environment = ImmutableSandboxedEnvironment(trim_blocks=blocks, lstrip_blocks=blocks)
        assert environment.from_string(template).render(messages=chat, add_generation_prompt=False) == trained


def test_a_folder_with_the_plain_chat_template_exports_the_one_that_reads_reasoning(tmp_path):
    config = {"chat_template": corpus_format.PLAIN_CHAT_TEMPLATE}
    assert export_gguf.read_chat_template(tmp_path, config) == corpus_format.CHAT_TEMPLATE
    (tmp_path / "chat_template.jinja").write_text(corpus_format.PLAIN_CHAT_TEMPLATE)
    assert export_gguf.read_chat_template(tmp_path, {}) == corpus_format.CHAT_TEMPLATE
    (tmp_path / "chat_template.jinja").write_text("{{ mine }}")
    assert export_gguf.read_chat_template(tmp_path, config) == "{{ mine }}"


def test_reader_check_detects_a_corrupted_tensor(model_dir, tmp_path):
    import gguf

    out = tmp_path / "m.gguf"
    export_gguf.export(model_dir, out, "f32", log=lambda *_: None)
    reader = gguf.GGUFReader(str(out))
    target = next(tensor for tensor in reader.tensors if tensor.name == "blk.1.ffn_down.weight")
    offset = target.data_offset + 4 * 100
    del reader
    with open(out, "r+b") as handle:
        handle.seek(offset)
        handle.write(np.float32(123.0).tobytes())
    source = export_gguf.read_model_folder(model_dir)
    with pytest.raises(export_gguf.VerificationFailed, match="blk.1.ffn_down.weight"):
        export_gguf.verify_tensors(source, out, "f32")


def test_modelfile_for_ollama(model_dir, tmp_path):
    out = tmp_path / "chat.gguf"
    summary = export_gguf.export(model_dir, out, "q8_0", log=lambda *_: None)
    text = Path(summary["modelfile"]).read_text()
    assert Path(summary["modelfile"]) == tmp_path / "chat.Modelfile"
    assert out.stat().st_mode & 0o044 == Path(summary["modelfile"]).stat().st_mode & 0o044 == 0o044
    assert "\nFROM ./chat.gguf\n" in text
    assert 'PARAMETER stop "<|im_end|>"' in text and 'PARAMETER stop "<eos>"' in text
    assert f"PARAMETER num_ctx {PRESET.context}" in text
    assert 'TEMPLATE """{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n' in text
    assert text.count('"""') == 2


# ----------------------------------------------------------------------------------------------
# llama.cpp


@needs_llama_cpp
@pytest.mark.parametrize("out_type", ["f32", "f16", "q8_0"])
def test_export_and_verify_with_llama_cpp(model_dir, tmp_path, out_type, monkeypatch, capfd):
    import ctypes

    import llama_cpp

    def log_callback() -> int:
        callback, user_data = llama_cpp.llama_log_callback(), ctypes.c_void_p()
        llama_cpp.llama_log_get(ctypes.byref(callback), ctypes.byref(user_data))
        return ctypes.cast(callback, ctypes.c_void_p).value

    loads = []
    real_llama = llama_cpp.Llama

    def recording_llama(*args, **kwargs):
        loads.append(kwargs)
        return real_llama(*args, **kwargs)

    monkeypatch.setattr(llama_cpp, "Llama", recording_llama)
    callback_before = log_callback()
    lines = []
    out = tmp_path / f"m-{out_type}.gguf"
    summary = export_gguf.export(model_dir, out, out_type, verify=True, log=lines.append)
    checks = summary["checks"]["llama_cpp"]
    assert checks["texts"] >= len(export_gguf.VERIFY_TEXTS) + len(corpus_format.SPECIAL_TOKENS) + 2
    prompts = len(export_gguf.DEMO_PROMPTS) + len(export_gguf.DEMO_QUESTIONS)
    assert checks["greedy_prompts"] == prompts
    assert checks["greedy_ties"] == 0
    # One full load, no bigger than the model's context (no vocab-only load, which has no context length).
    assert [(load.get("n_ctx"), load.get("vocab_only", False)) for load in loads] == [(PRESET.context, False)]
    # llama.cpp's native log (e.g. "n_ctx_seq (256) > n_ctx_train (128)") stays off the terminal ...
    err = capfd.readouterr().err
    assert "llama_context" not in err and "n_ctx" not in err, err
    # ... and only while verifying: the previous log callback is back.
    assert log_callback() == callback_before
    assert sum(line.endswith(f": same {export_gguf.GREEDY_TOKENS} tokens") for line in lines) == prompts
    assert lines[-1].startswith(
        f"llama.cpp greedy: {prompts} of {prompts} prompts give the same {export_gguf.GREEDY_TOKENS} tokens; "
        f"near ties are accepted within {checks['greedy_tie_tolerance']:.3g}"
    )
    if out_type == "f32":
        assert checks["max_logit_diff"] <= 1e-3
    else:
        # Really rounded, and still close: within 3% of the largest logit.
        assert 1e-4 < checks["max_logit_diff"] < 0.03 * checks["max_abs_logit"]
    assert checks["max_abs_logit"] > 5
    assert out.exists() and leftovers(tmp_path) == []
    assert any("tokenize and detokenize exactly" in line for line in lines)


@needs_llama_cpp
def test_folder_written_by_export_hf_model(model_dir, tmp_path):
    """The folder train.py writes (through export_hf.export_hf_model) exports and verifies as is."""
    import torch
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    tokenizer = corpus_format.load_tokenizer(model_dir)
    card = {"model_name": "demo", "corpus_sha256": "c0" * 32, "tokenizer_sha256": "70" * 32}
    folder = tmp_path / "run" / "model"
    export_hf.export_hf_model(model, tokenizer, folder, card)
    summary = export_gguf.export(folder, tmp_path / "run" / "model-f32.gguf", "f32", verify=True, log=lambda *_: None)
    assert summary["provenance"] == {"corpus_sha256": "c0" * 32, "tokenizer_sha256": "70" * 32}
    assert summary["provenance_sources"] == [str(folder / "training_provenance.json")]
    assert summary["checks"]["llama_cpp"]["max_logit_diff"] <= 1e-3


@needs_llama_cpp
def test_llama_cpp_tokenizes_random_text_like_hf(model_dir, tmp_path):
    """Beyond --verify's fixed set: random mixes of scripts, marks, digits, whitespace, contractions."""
    import llama_cpp

    out = tmp_path / "m.gguf"
    export_gguf.export(model_dir, out, "f16", log=lambda *_: None)
    tokenizer = corpus_format.load_tokenizer(model_dir)
    llm = llama_cpp.Llama(str(out), vocab_only=True, verbose=False)
    pools = [
        "abcXYZ",
        "0123456789",
        " \t\n\r",
        "!?.,;:'\"()[]{}<>/\\|@#$%^&*-_=+`~",
        "éüßçñ",
        "日本語中文한국어",
        "русскийΕλληνικά",
        "🙂🚀👍🏽\u200d",
        "\u0301\u0308\u200b\u00a0\u3000",
        "٠١٢३४५",
        "'s 're 'll 'D 'M",
    ]
    rng = random.Random(1)
    for _ in range(1000):
        text = "".join(rng.choice(rng.choice(pools)) for _ in range(rng.randint(1, 40)))
        expected = tokenizer.encode(text, add_special_tokens=False)
        assert llm.tokenize(text.encode(), add_bos=False, special=True) == expected, repr(text)


@needs_llama_cpp
def test_logits_are_far_from_zero(model_dir):
    """The f32 tolerance means something only if the logits are large (weights were scaled up)."""
    import torch
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    tokenizer = corpus_format.load_tokenizer(model_dir)
    with torch.no_grad():
        logits = model(torch.tensor([tokenizer.encode(export_gguf.VERIFY_TEXTS[0])])).logits
    assert float(logits.std()) > 1.0


@needs_llama_cpp
def test_verify_catches_a_model_that_differs(model_dir, tmp_path):
    out = tmp_path / "m.gguf"
    export_gguf.export(model_dir, out, "f32", log=lambda *_: None)
    changed = copy_folder(model_dir, tmp_path / "changed")
    config = json.loads((changed / "config.json").read_text())
    config["rope_parameters"]["rope_theta"] = PRESET.rope_theta * 100  # the GGUF keeps the exported base
    (changed / "config.json").write_text(json.dumps(config))
    with pytest.raises(export_gguf.VerificationFailed, match="logits differ"):
        export_gguf.verify_with_llama_cpp(changed, out, "f32", log=lambda *_: None)

    # The greedy check (what q8_0 relies on) fails on a changed model, unless the margin is called a tie.
    import llama_cpp
    import torch
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        model.model.norm.weight.neg_()  # every logit negated: HF's top token is llama.cpp's bottom one
    llm = llama_cpp.Llama(str(out), n_ctx=PRESET.context, logits_all=True, verbose=False)
    ids = corpus_format.load_tokenizer(model_dir).encode(export_gguf.VERIFY_TEXTS[2])
    with pytest.raises(export_gguf.VerificationFailed, match="diverges at token .* near-tie threshold 0.001") as error:
        export_gguf.compare_greedy(model, llm, ids, "code", 1e-3, log=lambda *_: None)
    got = export_gguf.llama_greedy(llm, ids, export_gguf.GREEDY_TOKENS)
    expected = export_gguf.hf_greedy(model, ids, export_gguf.GREEDY_TOKENS)
    step = next(index for index, (a, b) in enumerate(zip(got, expected)) if a != b)
    tokenizer = corpus_format.load_tokenizer(model_dir)
    assert (
        f"diverges at token {step} of the continuation, where llama.cpp gives {got[step]} "
        f"{tokenizer.decode([got[step]])!r} and HF {expected[step]} {tokenizer.decode([expected[step]])!r}; "
    ) in str(error.value)
    lines = []
    margin = export_gguf.compare_greedy(model, llm, ids, "code", 1e9, log=lines.append)
    assert margin > 1e-3
    assert re.fullmatch(
        r"greedy 'code': diverges at token \d+, where HF's logit for llama.cpp's token is only "
        rf"{margin:.3g} below its top \(a near tie within 1e\+09, accepted\)",
        lines[-1],
    ), lines
    llm.close()


def test_greedy_summary_counts_matches_and_near_ties():
    assert export_gguf.greedy_summary(4, [], 0.649) == (
        "llama.cpp greedy: 4 of 4 prompts give the same 16 tokens; "
        "near ties are accepted within 0.649 (twice the max logit difference)"
    )
    assert export_gguf.greedy_summary(4, [0.05, 0.113], 0.649) == (
        "llama.cpp greedy: 2 of 4 prompts give the same 16 tokens, 2 diverge at a near tie (largest margin 0.113); "
        "near ties are accepted within 0.649 (twice the max logit difference)"
    )
    assert ", 1 diverges at a near tie (largest margin 0.05)" in export_gguf.greedy_summary(4, [0.05], 0.649)


def test_verify_passed_line_says_what_passed():
    checks = {
        "reader": {"tensors": 30, "max_abs_error": 0.0},
        "llama_cpp": {"texts": 40, "max_logit_diff": 2.5e-5, "greedy_prompts": 6, "greedy_ties": 0},
    }
    assert export_gguf.verify_passed_line(checks, "f32") == (
        "verify: passed: 30 tensors read back as written; 40 texts tokenize identically in llama.cpp and "
        "transformers; logits agree to 2.5e-05 (f32); 6 prompts give the same 16 greedy tokens"
    )
    checks["llama_cpp"]["greedy_ties"] = 1
    assert export_gguf.verify_passed_line(checks, "q8_0").endswith(
        "(q8_0); 6 prompts give the same 16 greedy tokens, 1 at an accepted near tie"
    )


@needs_llama_cpp
def test_cli_verify_ends_with_the_line_that_says_it_passed(model_dir, tmp_path, capsys):
    out = tmp_path / "m.gguf"
    export_gguf.main([str(model_dir), "--out", str(out), "--type", "f32", "--verify", "--no-modelfile"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("verify: passed: ") and "tokenize identically in llama.cpp and transformers" in last
    assert out.is_file()


@needs_llama_cpp
def test_verify_catches_a_tokenizer_that_differs(model_dir, tmp_path, monkeypatch):
    read_vocab = export_gguf.read_vocab

    def without_late_merges(source):
        vocab = read_vocab(source)
        vocab.merges = vocab.merges[: len(vocab.merges) // 2]
        return vocab

    monkeypatch.setattr(export_gguf, "read_vocab", without_late_merges)
    out = tmp_path / "m.gguf"
    with pytest.raises(export_gguf.VerificationFailed, match="llama.cpp tokenizes"):
        export_gguf.export(model_dir, out, "f32", verify=True, log=lambda *_: None)
    assert not out.exists() and not out.with_suffix(".Modelfile").exists()
    assert leftovers(tmp_path) == []


def log_callback_address(llama_cpp) -> int:
    """The address of llama.cpp's current log callback."""
    import ctypes

    callback, user_data = llama_cpp.llama_log_callback(), ctypes.c_void_p()
    llama_cpp.llama_log_get(ctypes.byref(callback), ctypes.byref(user_data))
    return ctypes.cast(callback, ctypes.c_void_p).value


def open_fds() -> list[str]:
    return sorted(os.listdir("/proc/self/fd")) if Path("/proc/self/fd").is_dir() else []


def test_llama_cpp_log_keeps_warnings_and_errors_as_lines():
    log = export_gguf.LlamaCppLog(tail=2)
    info, warn, error, cont = 2, export_gguf.GGML_LOG_LEVEL_WARN, export_gguf.GGML_LOG_LEVEL_ERROR, 5
    log.write(info, b"print_info: n_vocab = 700\nload_tensors: ")
    log.write(cont, b"loading\n")
    assert log.reason() == ["print_info: n_vocab = 700", "load_tensors: loading"]  # no warnings: the last lines
    log.write(warn, b"load: missing pre-tokenizer type\n")
    log.write(info, b"print_info: n_merges = 115\n")
    log.write(error, b"llama_model_load: error loading model: ")
    log.write(cont, b"key not found in model: qwen3.block_count\n\n")
    log.write(error, b"llama_model_load_from_file_impl: failed to load model")  # no newline yet
    assert log.reason() == [
        "load: missing pre-tokenizer type",
        "llama_model_load: error loading model: key not found in model: qwen3.block_count",
        "llama_model_load_from_file_impl: failed to load model",
    ]


@needs_llama_cpp
def test_verify_reports_why_llama_cpp_cannot_load(model_dir, tmp_path, monkeypatch, capfd):
    """A GGUF llama.cpp refuses fails --verify with llama.cpp's own reason, not llama-cpp-python's generic one."""
    import gguf
    import llama_cpp

    callback_before, fds_before = log_callback_address(llama_cpp), open_fds()
    # Without merges the GGUFReader check passes, but llama.cpp cannot build the tokenizer.
    monkeypatch.setattr(gguf.GGUFWriter, "add_token_merges", lambda writer, merges: None)
    out = tmp_path / "m.gguf"
    with pytest.raises(export_gguf.VerificationFailed) as error:
        export_gguf.export(model_dir, out, "f32", verify=True, log=lambda *_: None)
    lines = str(error.value).splitlines()
    assert lines[0] == f"--verify failed, so {out} was not written: llama.cpp cannot load the GGUF; its log says:"
    assert any(line.endswith("cannot find tokenizer merges in model file") for line in lines[1:]), lines
    assert not any("print_info" in line for line in lines), lines  # only the warning and error lines
    assert not out.exists() and not out.with_suffix(".Modelfile").exists() and leftovers(tmp_path) == []
    assert log_callback_address(llama_cpp) == callback_before and open_fds() == fds_before
    captured = capfd.readouterr()
    assert "llama_model_load" not in captured.err + captured.out

    # A missing hyperparameter (here checked by llama.cpp alone) is named.
    monkeypatch.undo()
    monkeypatch.setattr(gguf.GGUFWriter, "add_block_count", lambda writer, count: None)
    export_gguf.export(model_dir, out, "f32", modelfile=False, log=lambda *_: None)
    with pytest.raises(export_gguf.VerificationFailed, match="key not found in model: qwen3.block_count"):
        export_gguf.verify_with_llama_cpp(model_dir, out, "f32", log=lambda *_: None)
    assert log_callback_address(llama_cpp) == callback_before and open_fds() == fds_before


@needs_llama_cpp
def test_cli_load_failure_exits_2_with_llama_cpp_reason(model_dir, tmp_path, patch_python_children):
    patch_python_children("import gguf\ngguf.GGUFWriter.add_token_merges = lambda writer, merges: None")
    out = tmp_path / "x.gguf"
    result = subprocess.run(
        [sys.executable, str(ROOT / "export_gguf.py"), str(model_dir), "--out", str(out), "--type", "f32", "--verify"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines[0] == (
        f"error: --verify failed, so {out} was not written: llama.cpp cannot load the GGUF; its log says:"
    )
    assert "cannot find tokenizer merges in model file" in result.stderr
    assert len(lines) <= 1 + 40 and "print_info" not in result.stderr + result.stdout
    assert not out.exists() and leftovers(tmp_path) == []


# ----------------------------------------------------------------------------------------------
# Bad input


def test_not_a_qwen3_folder(model_dir, tmp_path):
    with pytest.raises(UserError, match="no config.json"):
        export_gguf.export(tmp_path, tmp_path / "x.gguf")
    folder = copy_folder(model_dir, tmp_path / "llama")
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="llama", architectures=["LlamaForCausalLM"])
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match="not a Qwen3 model"):
        export_gguf.export(folder, tmp_path / "x.gguf")
    with pytest.raises(UserError, match="model folder not found"):
        export_gguf.export(tmp_path / "absent", tmp_path / "x.gguf")
    run = tmp_path / "run"  # the run folder, or a file of the model folder: the message names the folder to give
    copy_folder(model_dir, run / "model")
    with pytest.raises(
        UserError, match=f"^{re.escape(str(run))} is a run folder, .*; give {re.escape(str(run / 'model'))}$"
    ):
        export_gguf.export(run, tmp_path / "x.gguf")
    weights = run / "model" / "model.safetensors"
    with pytest.raises(UserError, match=f"^{re.escape(str(weights))} is a file; give its model folder: "):
        export_gguf.export(weights, tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists()


@pytest.mark.parametrize(
    "change, message",
    [
        ({"head_dim": 8}, r"model.layers.0.self_attn.q_proj.weight has shape \[\d+, \d+\], config.json says"),
        ({"num_key_value_heads": 1}, r"k_proj.weight has shape .*, config.json says"),
        ({"intermediate_size": 7}, r"mlp.(gate|up)_proj.weight has shape .*, config.json says \[7, "),
        ({"rms_norm_eps": -1e-6}, r"config.json: rms_norm_eps must be positive, got -1e-06"),
        (
            {"rope_theta": 0, "rope_parameters": {"rope_type": "default", "rope_theta": 0}},
            r"config.json: rope_theta must be positive, got 0",
        ),
    ],
)
def test_a_config_that_disagrees_with_the_weights_or_cannot_run_writes_nothing(model_dir, tmp_path, change, message):
    folder = copy_folder(model_dir, tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    config.update(change)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match=message):
        export_gguf.export(folder, tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists() and leftovers(tmp_path) == []


def test_missing_tokenizer_and_weights(model_dir, tmp_path):
    folder = copy_folder(model_dir, tmp_path / "m")
    (folder / "tokenizer.json").unlink()
    with pytest.raises(UserError, match="no tokenizer.json"):
        export_gguf.export(folder, tmp_path / "x.gguf")
    folder = copy_folder(model_dir, tmp_path / "w")
    (folder / "model.safetensors").unlink()
    with pytest.raises(UserError, match="weights not found"):
        export_gguf.export(folder, tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists() and leftovers(tmp_path) == []


def test_mismatched_tokenizer(model_dir, tmp_path):
    folder = copy_folder(model_dir, tmp_path / "m")
    data.train_tokenizer(sample_texts(100), 500, tmp_path / "other")
    shutil.copy(tmp_path / "other" / "tokenizer.json", folder / "tokenizer.json")
    with pytest.raises(UserError, match="does not belong to this model"):
        export_gguf.export(folder, tmp_path / "x.gguf")

    folder = copy_folder(model_dir, tmp_path / "eos")
    config = json.loads((folder / "config.json").read_text())
    config["eos_token_id"] = 4
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match="eos_token_id"):
        export_gguf.export(folder, tmp_path / "x.gguf")

    folder = copy_folder(model_dir, tmp_path / "split")
    spec = json.loads((folder / "tokenizer.json").read_text())
    spec["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = r"\s+|\S+"
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(UserError, match="not the Qwen2 split"):
        export_gguf.export(folder, tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists() and leftovers(tmp_path) == []


def test_unknown_type_and_existing_output(model_dir, tmp_path):
    with pytest.raises(UserError, match="unknown --type 'q4_k'"):
        export_gguf.main([str(model_dir), "--out", str(tmp_path / "x.gguf"), "--type", "q4_k"])
    out = tmp_path / "x.gguf"
    out.write_bytes(b"precious")
    with pytest.raises(UserError, match="already exists; pass --overwrite"):
        export_gguf.main([str(model_dir), "--out", str(out)])
    assert out.read_bytes() == b"precious"
    export_gguf.main([str(model_dir), "--out", str(out), "--overwrite"])
    assert out.read_bytes()[:4] == b"GGUF"
    out.with_name("z.Modelfile").write_text("mine")
    with pytest.raises(UserError, match="z.Modelfile already exists"):
        export_gguf.main([str(model_dir), "--out", str(out.with_name("z.gguf"))])
    assert not out.with_name("z.gguf").exists()
    assert leftovers(tmp_path) == []


def test_cli_says_where_both_files_went(model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    export_gguf.main([str(model_dir), "--out", "demo.gguf", "--type", "q8_0"])
    last = capsys.readouterr().out.strip().splitlines()[-2:]
    gguf_path, modelfile = tmp_path.resolve() / "demo.gguf", tmp_path.resolve() / "demo.Modelfile"
    assert last[0].startswith(f"wrote {gguf_path} (")
    assert last[1] == f"wrote {modelfile} (ollama: ollama create {export_gguf.model_name(model_dir)} -f {modelfile})"
    assert (tmp_path / "demo.gguf").is_file() and (tmp_path / "demo.Modelfile").is_file()


def test_gitignore_covers_exported_files():
    """`--out demo.gguf` in the checkout writes demo.gguf and demo.Modelfile there; git must not list them."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    result = subprocess.run(
        ["git", "check-ignore", "--no-index", "demo.gguf", "demo.Modelfile"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=30,
    )
    assert result.stdout.split() == ["demo.gguf", "demo.Modelfile"]


def test_cli_error_is_one_line_and_exit_2(model_dir, tmp_path):
    out = tmp_path / "x.gguf"
    out.write_bytes(b"precious")
    result = subprocess.run(
        [sys.executable, str(ROOT / "export_gguf.py"), str(model_dir), "--out", str(out)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f"error: {out} already exists; pass --overwrite to replace it"]
    assert out.read_bytes() == b"precious"


@pytest.mark.parametrize("damage", ["truncated", "garbage", "truncated_data"])
def test_a_truncated_or_garbage_safetensors_is_one_line_and_writes_nothing(model_dir, tmp_path, damage):
    """Issue 14.6: no SafetensorError traceback, with or without --verify."""
    folder = copy_folder(model_dir, tmp_path / "m")
    weights = folder / "model.safetensors"
    raw = weights.read_bytes()
    weights.write_bytes(
        {"truncated": raw[:100], "garbage": os.urandom(len(raw)), "truncated_data": raw[: len(raw) // 2]}[damage]
    )
    for verify in (False, True):
        with pytest.raises(UserError, match="model.safetensors is not a readable safetensors file"):
            export_gguf.export(folder, tmp_path / "x.gguf", verify=verify)
    assert not (tmp_path / "x.gguf").exists() and leftovers(tmp_path) == []
