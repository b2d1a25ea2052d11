"""Four chats a tiny model memorizes in a few seconds (conftest.py's `chat_model`): generation must reproduce
their replies exactly (tests/test_generation.py), the export must keep them (tests/test_report.py) and
exact-match scoring must count them (tests/test_evaluation.py)."""

from __future__ import annotations

import torch

from tinyllm.data import build as data
from tinyllm.data import corpus_format
from tinyllm.model import config as model_config

CHATS = [
    ("What is 2 plus 3?", corpus_format.render_assistant("5")),
    ("What is 10 plus 7?", corpus_format.render_assistant("17", "10 + 7 = 17")),
    ("Say hello.", "Hello there!"),
    ("Name a color.", "Blue"),
]
PROMPTS = [prompt for prompt, _ in CHATS]
REPLIES = [reply for _, reply in CHATS]


def train_chat_model(folder):
    """(model, tokenizer): the tiny preset trained on CHATS (tokenizer in `folder`) until it answers them and
    then says <|im_end|>; in eval mode."""
    conversations = [[{"role": "user", "content": q}, {"role": "assistant", "content": a}] for q, a in CHATS]
    texts = [f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n{a}<|im_end|>\n" for q, a in CHATS]
    tokenizer, _ = data.train_tokenizer(texts * 3, 400, folder)
    torch.manual_seed(0)
    model = model_config.build_model(model_config.PRESETS["tiny"], len(tokenizer))
    rendered = [tokenizer.apply_chat_template(conversation, tokenize=False) for conversation in conversations]
    batch = tokenizer(rendered, padding=True, add_special_tokens=False, return_tensors="pt")
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(200):
        loss = model(**batch, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.2
    return model.eval(), tokenizer
