"""Corpus builder: raw documents -> verified, packed token corpus (see shared DESIGN.md).

    python data.py --demo --out corpus/demo
    python data.py --data docs/ chats.jsonl --out corpus/mine --vocab-size 33069
    python data.py --verify corpus/mine
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from common import UserError

# ----------------------------------------------------------------------------------------------
# Tokenizer: byte-level BPE whose pre-tokenizer llama.cpp reproduces exactly ("qwen2").

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
IM_START, IM_END, THINK_OPEN, THINK_CLOSE = "<|im_start|>", "<|im_end|>", "<think>", "</think>"
SPECIAL_TOKENS = [PAD, BOS, EOS, IM_START, IM_END, THINK_OPEN, THINK_CLOSE]
DEFAULT_VOCAB_SIZE = 33_069

# The Qwen2 split (llama.cpp's LLAMA_VOCAB_PRE_TYPE_QWEN2): digits one by one.
QWEN2_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# ChatML. Reasoning is part of the assistant's content as "<think>\n...\n</think>\n\n" (see
# render_assistant), so the template stays the plain ChatML that llama.cpp and ollama know.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def render_assistant(answer: str, reasoning: str | None = None) -> str:
    """An assistant turn's content, with the optional reasoning inside <think>...</think>."""
    if reasoning:
        return f"{THINK_OPEN}\n{reasoning.strip()}\n{THINK_CLOSE}\n\n{answer}"
    return answer


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


def load_tokenizer(folder: str | Path):
    """AutoTokenizer.from_pretrained(folder), with a clear error when it does not load or lacks our specials."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
    except Exception as error:  # transformers raises many types here
        raise UserError(f"tokenizer folder {folder} does not load: {type(error).__name__}: {error}") from None
    for position, token in enumerate(SPECIAL_TOKENS):
        if tokenizer.convert_tokens_to_ids(token) != position:
            raise UserError(f"tokenizer {folder}: special token {token} must have id {position}")
    if not tokenizer.chat_template:
        raise UserError(f"tokenizer {folder} has no chat template")
    return tokenizer
