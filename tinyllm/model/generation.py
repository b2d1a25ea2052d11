"""Generation from a model being trained or an exported one: how replies are decoded (Sampling), where they
stop, chat and plain-text generation, prompts that fit a corpus, sample_generations.json, the export's
generation config and loading an exported model back.

    replies = generate_chat(model, tokenizer, ["What is 12 plus 7?"], max_new_tokens=64)   # greedy
    generate_samples(model, tokenizer, RUN / "sample_generations.json", step=step)        # never raises
    model, tokenizer = load_exported("runs/demo/model", "cpu")

The model may be wrapped (DDP, torch.compile): each function unwraps it, runs in eval mode with the stock
attention (attention.exportable) and leaves the caller's mode and RNG as they were.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tinyllm.common import UserError, atomic_write_json, read_json_or, utc_now
from tinyllm.data import corpus_format
from tinyllm.data.corpus_format import EOS, IM_END, IM_START
from tinyllm.model import attention

# Shaped like the demo corpus's problems (data.py --demo), plus one it never saw.
DEFAULT_PROMPTS = [
    "What is 12 plus 7?",
    "What is 48 + 35?",
    "What is 75 minus 28?",
    "If a box has 3 rows of 4 apples, how many apples are there?",
    "Say hello in one short sentence.",
]


# ----------------------------------------------------------------------------------------------
# Where a reply stops, and how it is decoded.


def unwrap_model(model):
    """The plain Hugging Face model inside DDP / DataParallel and torch.compile wrappers."""
    while True:
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif hasattr(model, "module") and hasattr(model.module, "generate"):
            model = model.module
        else:
            return model


def stop_token_ids(tokenizer) -> list[int]:
    """[id of <|im_end|>, id of <eos>]: where a chat reply ends."""
    ids = [tokenizer.convert_tokens_to_ids(token) for token in (IM_END, EOS)]
    if any(token_id is None or token_id == tokenizer.unk_token_id for token_id in ids):
        raise UserError(f"tokenizer lacks {IM_END} or {EOS}; build the corpus with data.py")
    return ids


def as_messages(prompt: str | Sequence[dict]) -> list[dict]:
    """A user prompt string, or an already-built message list."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return list(prompt)


def chat_prompt(tokenizer, prompt: str | Sequence[dict]) -> str:
    """The text a reply to `prompt` (a user prompt or a message list) continues: rendered with the tokenizer's
    chat template as data.py renders a training chat (corpus_format.render_prompt), so the two cannot drift apart."""
    return corpus_format.render_prompt(as_messages(prompt), tokenizer.chat_template)


def cut_at_stop(token_ids: list[int], stop_ids: Iterable[int]) -> tuple[list[int], bool]:
    """The tokens before the first stop token, and whether there was one."""
    stops = set(stop_ids)
    for position, token_id in enumerate(token_ids):
        if token_id in stops:
            return token_ids[:position], True
    return token_ids, False


@dataclass(frozen=True)
class Sampling:
    """How replies are decoded: temperature 0 is greedy; above 0, sampled with top-p / top-k (0: off),
    reproducibly: the same seed, prompts and batch size give the same replies."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0

    def __post_init__(self):
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise UserError(f"--temperature must be 0 (greedy) or positive, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise UserError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise UserError(f"--top-k must not be negative (0: off), got {self.top_k}")

    def generation_options(self) -> dict:
        """GenerationConfig options: do_sample and, when sampling, temperature / top_p / top_k."""
        if self.temperature == 0:
            return {"do_sample": False}
        return {"do_sample": True, "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k or None}

    def describe(self) -> dict:
        """What sample_generations.json records as its decoding."""
        if self.temperature == 0:
            return {"decoding": "greedy"}
        return {"decoding": "sampled", **dataclasses.asdict(self)}


GREEDY = Sampling()


def add_sampling_args(parser, prefix: str = "") -> None:
    """--temperature / --top-p / --top-k / --seed (train.py: --sample-temperature ...), read by sampling_from."""
    parser.add_argument(f"--{prefix}temperature", type=float, default=0.0, help="0: greedy; above 0: sampled")
    parser.add_argument(
        f"--{prefix}top-p", type=float, default=1.0, help="nucleus sampling: keep this much probability mass (1: all)"
    )
    parser.add_argument(f"--{prefix}top-k", type=int, default=0, help="keep the k likeliest tokens (0: all)")
    parser.add_argument(f"--{prefix}seed", type=int, default=0, help="seed of the sampling (reproducible replies)")


def sampling_from(values: dict, prefix: str = "") -> Sampling:
    """The Sampling of add_sampling_args's options in `values` (vars(args) or a settings dict)."""
    try:
        return Sampling(*(values[f"{prefix}{name}"] for name in ("temperature", "top_p", "top_k", "seed")))
    except UserError as error:
        raise UserError(str(error).replace("--", "--" + prefix.replace("_", "-"), 1)) from None


@contextlib.contextmanager
def seeded_sampling(sampling: Sampling, batch: int, device):
    """Torch's RNG seeded from (seed, batch) inside the block, the caller's RNG state restored after."""
    import torch

    devices = [device] if getattr(device, "type", None) == "cuda" else []
    with torch.random.fork_rng(devices=devices, enabled=sampling.temperature > 0):
        if sampling.temperature > 0:
            torch.manual_seed(sampling.seed * 1_000_003 + batch)
        yield


# ----------------------------------------------------------------------------------------------
# Chat replies and plain-text continuations: batched, eval mode, the caller's mode and RNG kept.


def generate_chat_details(
    model,
    tokenizer,
    prompts: Sequence[str | Sequence[dict]],
    max_new_tokens: int = 64,
    device=None,
    batch_size: int = 16,
    sampling: Sampling = GREEDY,
) -> list[dict]:
    """Replies to `prompts` through the chat template (greedy unless `sampling` says otherwise), as dicts.

    Each dict: completion (text before <|im_end|> / <eos>, special tokens such as <think> kept),
    stopped (a stop token was produced), new_tokens. Prompts are batched by length with left
    padding; the result equals one-at-a-time decoding. New tokens are capped so prompt plus reply
    fit the model's context.
    """
    import torch
    from transformers import GenerationConfig

    model = unwrap_model(model)
    device = torch.device(device) if device is not None else next(model.parameters()).device
    stops = stop_token_ids(tokenizer)
    context = getattr(model.config, "max_position_embeddings", None)
    encoded = []
    for prompt in prompts:
        encoded.append(tokenizer(chat_prompt(tokenizer, prompt), add_special_tokens=False)["input_ids"])
    order = sorted(range(len(encoded)), key=lambda index: len(encoded[index]))
    results: list[dict] = [{}] * len(encoded)

    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(order), batch_size):
            chunk = order[start : start + batch_size]
            batch = tokenizer.pad(
                {"input_ids": [encoded[index] for index in chunk]},
                padding=True,
                padding_side="left",
                return_tensors="pt",
            ).to(device)
            prompt_length = batch["input_ids"].shape[1]
            new_tokens = max_new_tokens if context is None else min(max_new_tokens, context - prompt_length)
            if new_tokens < 1:
                raise UserError(f"a prompt of {prompt_length} tokens leaves no room in the model's context {context}")
            config = GenerationConfig(
                max_new_tokens=new_tokens,
                num_beams=1,
                eos_token_id=stops,
                pad_token_id=tokenizer.pad_token_id,
                use_cache=True,
                **sampling.generation_options(),
            )
            # the stock "sdpa" attention: the training kernels take no padding mask (attention.exportable)
            with torch.no_grad(), seeded_sampling(sampling, start, device), attention.exportable(model):
                output = model.generate(
                    input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], generation_config=config
                )
            for index, row in zip(chunk, output[:, prompt_length:].tolist()):
                reply, stopped = cut_at_stop(row, stops)
                text = tokenizer.decode(reply, skip_special_tokens=False, clean_up_tokenization_spaces=False)
                results[index] = {"completion": text, "stopped": stopped, "new_tokens": len(reply)}
    finally:
        model.train(was_training)
    return results


def generate_chat(
    model,
    tokenizer,
    prompts: Sequence[str | Sequence[dict]],
    max_new_tokens: int = 64,
    device=None,
    batch_size: int = 16,
    sampling: Sampling = GREEDY,
) -> list[str]:
    """Replies (text before <|im_end|> / <eos>) to user prompts, through the chat template; greedy by default."""
    details = generate_chat_details(model, tokenizer, prompts, max_new_tokens, device, batch_size, sampling)
    return [detail["completion"] for detail in details]


def generate_text_details(
    model, tokenizer, prompts: Sequence[str], max_new_tokens: int = 64, device=None, sampling: Sampling = GREEDY
) -> list[dict]:
    """Plain-text continuations of `prompts` (no chat template; greedy unless `sampling` says otherwise),
    one prompt at a time: dicts {completion, stopped (at <eos>), new_tokens}, like generate_chat_details."""
    import torch
    from transformers import GenerationConfig

    model = unwrap_model(model)
    device = torch.device(device) if device is not None else next(model.parameters()).device
    eos = tokenizer.convert_tokens_to_ids(EOS)
    context = getattr(model.config, "max_position_embeddings", None)
    results = []
    was_training = model.training
    model.eval()
    try:
        for number, prompt in enumerate(prompts):
            ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            if context is not None:
                ids = ids[-(context - 1) :]
            new_tokens = max_new_tokens if context is None else min(max_new_tokens, context - len(ids))
            config = GenerationConfig(
                max_new_tokens=new_tokens,
                num_beams=1,
                eos_token_id=[eos],
                pad_token_id=tokenizer.pad_token_id,
                use_cache=True,
                **sampling.generation_options(),
            )
            with torch.no_grad(), seeded_sampling(sampling, number, device), attention.exportable(model):
                output = model.generate(
                    input_ids=torch.tensor([ids], device=device),
                    attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=device),
                    generation_config=config,
                )
            reply, stopped = cut_at_stop(output[0, len(ids) :].tolist(), [eos])
            text = tokenizer.decode(reply, skip_special_tokens=False, clean_up_tokenization_spaces=False)
            results.append({"completion": text, "stopped": stopped, "new_tokens": len(reply)})
    finally:
        model.train(was_training)
    return results


# ----------------------------------------------------------------------------------------------
# sample_generations.json: prompts that fit the corpus, replies that never fail the run.


def held_out_prompts(
    corpus: str | os.PathLike, tokenizer, count: int = 5, opening_tokens: int = 24, documents_read: int = 200
) -> tuple[str, list[str]]:
    """("chat" or "text", prompts) that fit a corpus: the first user turns of its held-out chats, or
    the openings of its held-out texts (its first `opening_tokens` tokens) to be continued. The test
    split is read first, then validation, then train (a corpus without held-out documents)."""
    corpus = Path(corpus)
    manifest = corpus_format.load_manifest(corpus)
    eos, im_start = (tokenizer.convert_tokens_to_ids(token) for token in (EOS, IM_START))
    documents: list[list[int]] = []
    for split in ("test", "validation", "train"):
        current: list[int] = []
        for entry in manifest.split(split)["files"]:
            for token in np.fromfile(corpus / entry["name"], dtype=manifest.shard_dtype).tolist():
                if token != eos:
                    current.append(token)
                    continue
                documents.append(current)
                current = []
                if len(documents) >= documents_read:
                    break
            if len(documents) >= documents_read:
                break
        if documents:
            break
    chats = [doc for doc in documents if doc[:1] == [im_start]]
    if len(chats) * 2 > len(documents):
        user_turn = re.compile(re.escape(IM_START) + r"user\n(.*?)" + re.escape(IM_END), re.S)
        found = (user_turn.search(tokenizer.decode(doc, skip_special_tokens=False)) for doc in chats)
        prompts = [match.group(1).strip() for match in found if match and match.group(1).strip()]
        return "chat", list(dict.fromkeys(prompts))[:count] or list(DEFAULT_PROMPTS)
    openings = [tokenizer.decode(doc[:opening_tokens]) for doc in documents if doc and doc[:1] != [im_start]]
    return "text", list(dict.fromkeys(opening for opening in openings if opening.strip()))[:count]


def recorded_prompts(samples_file: str | os.PathLike) -> tuple[bool, list[str]] | None:
    """(text, prompts) of a run's sample_generations.json: the prompts that fit its corpus, and whether they
    are text openings to continue (not chats); None where there is no such record (no file, or no prompts)."""
    record = read_json_or(Path(samples_file), {})
    samples = record.get("samples") if isinstance(record, dict) else None
    prompts = [sample["prompt"] for sample in samples or [] if isinstance(sample, dict) and sample.get("prompt")]
    if not prompts:
        return None
    return not record.get("settings", {}).get("chat_template", True), prompts


def sample_prompts(
    given: Sequence[str] | None, text: bool, recorded: tuple[bool, list[str]] | None
) -> tuple[bool, list[str]]:
    """(text, prompts) for `report.py samples`: the prompts given; else the run's recorded ones (a run's
    text openings are continued, its chats answered), unless --text asks to continue the run's chats; else
    the built-in chat prompts. --text needs text: the given or the run's."""
    if given:
        return text, list(given)
    if recorded is not None and (recorded[0] or not text):
        return recorded
    if text:
        raise UserError("samples --text continues the text you give: pass --prompt TEXT (repeatable)")
    return False, list(DEFAULT_PROMPTS)


def generate_samples(
    model,
    tokenizer,
    out_path: str | os.PathLike,
    prompts: Sequence[str] = tuple(DEFAULT_PROMPTS),
    max_new_tokens: int = 96,
    device=None,
    step: int | None = None,
    text: bool = False,
    sampling: Sampling = GREEDY,
) -> dict:
    """Write sample_generations.json (replies to `prompts`, or with `text` their plain-text
    continuations; greedy unless `sampling` says otherwise) atomically; never raises.

    Returns what it wrote: {"format_version", "time", "step", "settings", "samples": [{prompt,
    completion, stopped, new_tokens}], "error"}; a failure (generation or writing) is in "error".
    """
    record: dict[str, Any] = {
        "format_version": 1,
        "time": utc_now(),
        "step": step,
        "settings": {
            **sampling.describe(),
            "chat_template": not text,
            "max_new_tokens": max_new_tokens,
            "stop_tokens": [EOS] if text else [IM_END, EOS],
        },
        "samples": [],
        "error": None,
    }
    try:
        generate = generate_text_details if text else generate_chat_details
        details = generate(model, tokenizer, list(prompts), max_new_tokens, device, sampling=sampling)
        record["samples"] = [{"prompt": prompt, **detail} for prompt, detail in zip(prompts, details)]
    except Exception as error:  # samples are a courtesy: a failure must never lose the run
        record["error"] = f"generation failed: {type(error).__name__}: {error}"
    try:
        atomic_write_json(out_path, record)
    except Exception as error:
        record["error"] = (record["error"] + "; " if record["error"] else "") + (
            f"writing {out_path} failed: {type(error).__name__}: {error}"
        )
    return record


# ----------------------------------------------------------------------------------------------
# The exported model: its generation config, loading it back.


def generation_config_for(tokenizer, context: int | None = None):
    """Greedy defaults that stop at <|im_end|> or <eos>, pad 0, bos 1.

    max_new_tokens leaves a quarter of the model's context for the prompt (96 of 128), at most 256.
    """
    from transformers import GenerationConfig

    max_new_tokens = 256 if context is None else max(1, min(256, context - context // 4))
    return GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=stop_token_ids(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
        num_beams=1,
        max_new_tokens=max_new_tokens,
    )


@contextlib.contextmanager
def quiet_transformers_progress():
    """No "Writing model shards" / "Loading weights" bars from transformers inside the block."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def load_exported(model_dir: str, device: str):
    """An exported RUN/model/ folder as (model, tokenizer), with a clear error when it does not load."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    missing = [name for name in ("config.json", "tokenizer.json") if not (Path(model_dir) / name).is_file()]
    if missing:
        raise UserError(
            f"{model_dir} is not an exported model folder (no {', '.join(missing)}); train.py writes one to RUN/model"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        with quiet_transformers_progress():
            model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).to(device)
    except (OSError, ValueError) as error:
        raise UserError(f"{model_dir} does not load: {type(error).__name__}: {str(error).splitlines()[0]}") from None
    return model, tokenizer
