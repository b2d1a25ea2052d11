"""The Hugging Face export of a run: RUN/model/ (config, safetensors, tokenizer, generation config), its model
card (README.md, written here and only here: the run's facts, and the benchmark scores `report.py evaluate` adds)
and training_provenance.json. export_gguf.py converts the folder this writes to GGUF.

    info = card_info(RUN.name, status, preset, step, total_steps, tokens, settings, validation, test, accuracy,
                     usage_example_from(corpus, tokenizer))   # what the card and the provenance say
    with attention.exportable(model):
        model_files = export_hf_model(model, tokenizer, RUN / "model", info)   # {file: sha256}, swapped in whole
    write_scores(RUN / "model", result)   # evaluation.evaluate's scores into the card's benchmark section
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tinyllm.common import UserError, atomic_folder, atomic_write_text, human_count, json_safe, sha256_file, utc_now
from tinyllm.model import generation

MODEL_DIR = "model"  # RUN/model/: the exported folder (publishing.publish_layout puts its files at the root)

# ----------------------------------------------------------------------------------------------
# What the card and the provenance say.


def card_info(
    name: str,
    status: str,
    preset: str,
    step: int,
    total_steps: int,
    tokens: int,
    settings: dict,
    validation: dict | None,
    test: dict | None,
    accuracy: dict | None,
    usage_example: dict | None = None,
) -> dict:
    """What export_hf_model writes into the model card and training_provenance.json. `usage_example`:
    {"kind": "chat" or "text", "prompt": ...} from the corpus (usage_example_from), the card's example."""
    training = settings["training"]
    return {
        "model_name": name,
        "status": status,
        "preset": preset,
        "steps": step,
        "total_steps": total_steps,
        "tokens": tokens,
        "corpus_sha256": training["corpus_manifest_sha256"],
        "tokenizer_sha256": training["tokenizer_sha256"],
        "validation_loss": validation["loss"] if validation else None,
        "validation_perplexity": validation["perplexity"] if validation else None,
        "validation_bits_per_byte": (validation or {}).get("bits_per_byte"),
        "validation_tokens": (validation or {}).get("tokens"),
        "test_loss": test["loss"] if test else None,
        "test_perplexity": test["perplexity"] if test else None,
        "test_bits_per_byte": (test or {}).get("bits_per_byte"),
        "test_tokens": (test or {}).get("tokens"),
        "demo_accuracy": accuracy,
        "init_from": settings.get("init_from"),
        "settings": settings,
        "usage_example": usage_example,
    }


def usage_example_from(corpus: Path, tokenizer) -> dict:
    """The model card's usage example from the corpus it was trained on: a held-out chat's first
    question, or the opening of a held-out text (generation.held_out_prompts); a greeting when none reads."""
    try:
        kind, prompts = generation.held_out_prompts(corpus, tokenizer, count=1)
    except (UserError, OSError, ValueError, KeyError):
        kind, prompts = "chat", []
    return {"kind": kind, "prompt": prompts[0] if prompts else "Hello!"}


def architecture_of(model) -> dict:
    config = model.config
    return {
        "model_type": config.model_type,
        "layers": config.num_hidden_layers,
        "hidden": config.hidden_size,
        "intermediate": config.intermediate_size,
        "heads": config.num_attention_heads,
        "kv_heads": config.num_key_value_heads,
        "head_dim": getattr(config, "head_dim", config.hidden_size // config.num_attention_heads),
        "context": config.max_position_embeddings,
        "vocab_size": config.vocab_size,
        "tied_embeddings": bool(getattr(config, "tie_word_embeddings", False)),
        "parameters": sum(parameter.numel() for parameter in model.parameters()),
    }


def parameters_line(arch: dict) -> str:
    """The card's parameter count, saying how the input embedding and the LM head are in it."""
    embedding = (
        "the input embedding and the LM head one tied matrix, counted once"
        if arch["tied_embeddings"]
        else "the input embedding and the LM head separate matrices, both counted"
    )
    return f"- Parameters: {arch['parameters']:,} ({embedding})"


def _number(value, digits: int = 4) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def _accuracy_line(accuracy) -> str | None:
    """A demo-accuracy sentence from an evaluation.exact_match_accuracy() dict or a bare fraction."""
    if accuracy is None:
        return None
    if isinstance(accuracy, dict):
        tasks = ", ".join(
            f"{name} {100 * task['accuracy']:.1f}% ({task['correct']}/{task['total']})"
            for name, task in accuracy.get("by_task", {}).items()
        )
        line = f"{100 * accuracy['accuracy']:.1f}% exact match ({accuracy['correct']}/{accuracy['total']})"
        return line + (f"; by task: {tasks}" if tasks else "")
    return f"{100 * float(accuracy):.1f}% exact match"


def _lineage_lines(lineage: dict | None) -> list[str]:
    """The model card's lines on the weights a run started from (train.py --init-from)."""
    if not lineage:
        return []
    return [
        f"- Initialized from: `{lineage.get('source')}` ({lineage.get('kind')}, step {lineage.get('step')}, "
        f"sha256 `{lineage.get('sha256')}`), itself trained on corpus manifest sha256 "
        f"`{lineage.get('corpus_manifest_sha256') or 'n/a'}`"
    ]


def _mixture_lines(mixture: dict | None) -> list[str]:
    """The model card's lines on a train.py --data mixture: its sources and each phase's weights."""
    if not mixture:
        return []
    sources = ", ".join(
        f"`{source['name']}`"
        + (f" (label `{source['label']}`)" if source.get("label") else "")
        + f" corpus manifest sha256 `{source['corpus_manifest_sha256'][:16]}`"
        for source in mixture["sources"]
    )
    starts = {"0": "from the start", "decay": "from the decay"}
    phases = "; ".join(
        starts.get(phase["start"], f"from step {phase['start']}")
        + ": "
        + ", ".join(f"{name} {weight:g}" for name, weight in phase["weights"].items())
        for phase in mixture["phases"]
    )
    return [f"- Mixture of sources: {sources}", f"- Mixture weights: {phases}"]


def model_card(architecture: dict, card_info: dict) -> str:
    """README.md for RUN/model/: what the model is, how it was made, how to load it, what it cannot do."""
    return "\n".join(
        [
            *_card_header(architecture, card_info),
            *_card_provenance(card_info),
            *_card_evaluation(architecture, card_info),
            *_card_limitations(architecture, card_info),
        ]
    )


def _card_header(arch: dict, card_info: dict) -> list[str]:
    """The card's front matter, title, status and architecture."""
    name = card_info.get("model_name", "tinyllm")
    status = card_info.get("status", "UNKNOWN")
    steps, total_steps = card_info.get("steps"), card_info.get("total_steps")
    tokens = card_info.get("tokens")
    finished = status == "COMPLETE"
    return [
        "---",
        "library_name: transformers",
        "pipeline_tag: text-generation",
        "license: other",
        "tags: [qwen3, tinyllm, " + ("continued]" if card_info.get("init_from") else "from-scratch]"),
        "---",
        "",
        f"# {name}",
        "",
        f"A {human_count(arch['parameters'])}-parameter Qwen3-architecture causal language model trained "
        + (
            "with tinyllm, starting from the weights named under Data and provenance (its own byte-level BPE "
            "tokenizer)."
            if card_info.get("init_from")
            else "from scratch with tinyllm (random initialization, its own byte-level BPE tokenizer; no pretrained "
            "weights were loaded)."
        ),
        "",
        "## Status",
        "",
        f"- Status: **{status}**"
        + ("" if finished else " (training did not finish; this is an intermediate checkpoint)"),
        f"- Optimizer steps: {_number(steps)}" + (f" of {total_steps:,}" if isinstance(total_steps, int) else ""),
        f"- Tokens trained on: {f'{tokens:,}' if isinstance(tokens, int) else _number(tokens)}",
        f"- Preset: {card_info.get('preset', 'n/a')}",
        f"- Exported: {utc_now()}",
        "",
        "## Architecture",
        "",
        parameters_line(arch),
        f"- {arch['layers']} decoder layers, hidden size {arch['hidden']}, MLP (SwiGLU) size {arch['intermediate']}",
        f"- {arch['heads']} query heads and {arch['kv_heads']} key/value heads of dimension {arch['head_dim']}, "
        "Q/K RMSNorm, RoPE",
        f"- Context: {arch['context']} tokens; vocabulary: {arch['vocab_size']:,} tokens",
        "",
    ]


def _card_provenance(card_info: dict) -> list[str]:
    return [
        "## Data and provenance",
        "",
        f"- Corpus manifest sha256: `{card_info.get('corpus_sha256', 'n/a')}`",
        f"- Tokenizer sha256: `{card_info.get('tokenizer_sha256', 'n/a')}`",
        *_lineage_lines(card_info.get("init_from")),
        *_mixture_lines((card_info.get("settings") or {}).get("training", {}).get("mixture")),
        *_budget_lines((card_info.get("settings") or {}).get("budget")),
        "- `training_provenance.json` in this folder holds these"
        + (" and the training settings." if "settings" in card_info else "."),
        "",
    ]


def _budget_lines(plan: dict | None) -> list[str]:
    """The --budget plan the run was made by (budget.Plan's record), and why."""
    if not plan:
        return []
    return [f"- Planned by {plan['summary']}; {plan['why']}"]


def _held_out_line(split: str, card_info: dict) -> str:
    """A held-out split's loss, perplexity and bits per byte, and how many tokens they were measured on (a
    split of a few documents scores far from the next run's: the count says how far to trust it)."""
    key = split.lower()
    bpb, tokens = card_info.get(f"{key}_bits_per_byte"), card_info.get(f"{key}_tokens")
    return (
        f"- {split} loss: {_number(card_info.get(f'{key}_loss'))} "
        f"(perplexity {_number(card_info.get(f'{key}_perplexity'), 2)}"
        + (f", {_number(bpb)} bits per byte" if bpb is not None else "")
        + ")"
        + (f" on {tokens:,} held-out tokens" if isinstance(tokens, int) else "")
    )


def _card_evaluation(arch: dict, card_info: dict) -> list[str]:
    """The held-out losses (and the demo's accuracy), then how to use the model."""
    accuracy = _accuracy_line(card_info.get("demo_accuracy"))
    lines = ["## Evaluation", "", _held_out_line("Validation", card_info), _held_out_line("Test", card_info)]
    if accuracy:
        lines.append(f"- Held-out demo task accuracy (greedy, chat template): {accuracy}")
    return lines + [
        "",
        "Losses are mean cross-entropy in nats per token on the corpus's held-out splits; bits per byte "
        "divide the summed loss by ln 2 and the UTF-8 bytes of the scored text, comparable across tokenizers. "
        "A low loss is "
        "not task accuracy; inspect `sample_generations.json` in the run folder and evaluate on your own tasks.",
        "",
        "## How to use",
        "",
        *usage_lines(card_info.get("usage_example") or {"kind": "chat", "prompt": "Hello!"}),
        "",
        "The chat template is ChatML (`<|im_start|>role ... <|im_end|>`); optional reasoning appears "
        "inside `<think> ... </think>` before the answer, and an earlier reply's `reasoning_content` is rendered "
        f"there as in training. Keep prompt plus reply within {arch['context']} tokens.",
        "",
    ]


def _card_limitations(arch: dict, card_info: dict) -> list[str]:
    tokens = card_info.get("tokens")
    lines = [
        "## Limitations",
        "",
        f"- A {human_count(arch['parameters'])}-parameter model trained on "
        f"{human_count(tokens) if isinstance(tokens, (int, float)) else 'an unknown number of'} tokens: expect "
        "factual errors, repetition and unreliable reasoning outside the narrow data it saw.",
        "- It knows only its training corpus; it was not instruction-tuned or aligned beyond the chat "
        "examples in that corpus, and has no safety training.",
        "- The Qwen3 architecture does not bring any Qwen3 model's abilities: the weights are "
        + ("tinyllm's own (see Initialized from)." if card_info.get("init_from") else "from scratch."),
    ]
    if card_info.get("status", "UNKNOWN") != "COMPLETE":
        lines.append("- Training stopped before its planned end; quality is below what the full run would give.")
    return lines + [
        "- The license of these weights follows the terms of the training data; set `license` above "
        "before you publish.",
        "",
    ]


USAGE_PROMPT_CHARACTERS = 300  # a longer corpus prompt is cut in the card's example


def usage_lines(example: dict) -> list[str]:
    """The card's "How to use" code: the chat template for a chat corpus, plain continuation for text."""
    prompt = str(example.get("prompt", ""))[:USAGE_PROMPT_CHARACTERS]
    literal = json.dumps(prompt, ensure_ascii=False)  # a JSON string is a Python string literal
    load = [
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline",
        "",
        'tokenizer = AutoTokenizer.from_pretrained("path/to/model")',
        'model = AutoModelForCausalLM.from_pretrained("path/to/model")',
    ]
    if example.get("kind") == "text":
        return [
            *load,
            f'inputs = tokenizer({literal}, return_tensors="pt")  # an opening from the corpus',
            "output = model.generate(**inputs, max_new_tokens=64)  # greedy; stops at <eos>",
            "print(tokenizer.decode(output[0], skip_special_tokens=True))",
            "",
            'generate = pipeline("text-generation", model="path/to/model")',
            f'print(generate({literal}, max_new_tokens=64)[0]["generated_text"])',
            "```",
        ]
    return [
        *load,
        f'messages = [{{"role": "user", "content": {literal}}}]  # a question from the corpus',
        'inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",',
        "                                       return_dict=True)",
        "output = model.generate(**inputs, max_new_tokens=64)  # greedy; stops at <|im_end|> or <eos>",
        'print(tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))',
        "",
        'chat = pipeline("text-generation", model="path/to/model")',
        'print(chat(messages, max_new_tokens=64)[0]["generated_text"][-1]["content"])',
        "```",
    ]


# ----------------------------------------------------------------------------------------------
# The card's benchmark scores (`report.py evaluate`): one section, replaced on each evaluation.

CARD_START, CARD_END = "<!-- tinyllm:benchmarks -->", "<!-- /tinyllm:benchmarks -->"


def _cell(value) -> str:
    return "-" if value is None else f"{value:.4f}" if isinstance(value, float) else str(value)


def score_table(result: dict) -> str:
    """A Markdown table: task, kind, n, acc, acc_norm, exact_match."""
    columns = ("acc", "acc_norm", "exact_match")
    lines = ["| task | kind | n | " + " | ".join(columns) + " |", "|---|---|---:|" + "---:|" * len(columns)]
    for name, scores in result["tasks"].items():
        lines.append(
            f"| {name} | {scores['kind']} | {scores['n']} | "
            + " | ".join(_cell(scores.get(column)) for column in columns)
            + " |"
        )
    return "\n".join(lines)


def settings_line(harness: dict) -> str:
    return ", ".join(f"{key} {value}" for key, value in harness.items() if not isinstance(value, dict))


def card_section(result: dict) -> str:
    return "\n".join(
        [
            CARD_START,
            "## Benchmark scores",
            "",
            score_table(result),
            "",
            f"Zero-shot, `python report.py evaluate` ({result['time']}); settings: "
            f"{settings_line(result['harness'])}. Scores from other harnesses or normalisations "
            "do not compare with these.",
            CARD_END,
            "",
        ]
    )


def add_to_card(card: str, result: dict) -> str:
    """The model card with its benchmark section replaced (or added before 'How to use')."""
    section = card_section(result)
    if CARD_START in card and CARD_END in card:
        head, rest = card.split(CARD_START, 1)
        return head + section + rest.split(CARD_END, 1)[1].lstrip("\n")
    marker = "## How to use"
    return card.replace(marker, section + "\n" + marker, 1) if marker in card else card + "\n" + section


def write_scores(model_dir: Path, result: dict) -> Path | None:
    """MODEL_DIR/README.md with `result`'s scores (evaluation.evaluate) in its benchmark section; None: no card."""
    card = Path(model_dir) / "README.md"
    if not card.is_file():
        return None
    atomic_write_text(card, add_to_card(card.read_text(encoding="utf-8"), result))
    return card


# ----------------------------------------------------------------------------------------------
# The Hugging Face export: RUN/model/, built beside and swapped in.


def write_model_card(folder: Path, architecture: dict, card_info: dict) -> None:
    (folder / "README.md").write_text(model_card(architecture, card_info), encoding="utf-8")


def write_provenance(folder: Path, architecture: dict, card_info: dict) -> None:
    """training_provenance.json: card_info (corpus_sha256, tokenizer_sha256, steps, tokens, ...) plus the shape."""
    import torch
    import transformers

    provenance = {
        "format_version": 1,
        "exported_utc": utc_now(),
        **json_safe(card_info),
        "architecture": architecture,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
    }
    (folder / "training_provenance.json").write_text(json.dumps(provenance, indent=2) + "\n", encoding="utf-8")


def export_hf_model(model, tokenizer, out_dir: str | os.PathLike, card_info: dict) -> dict[str, str]:
    """Write `out_dir` as a Hugging Face model folder and return {relative filename: sha256}.

    Files: config.json, model.safetensors, the tokenizer (chat template included),
    generation_config.json (greedy, eos = [<|im_end|>, <eos>], pad 0, bos 1), README.md (model
    card from `card_info`, see model_card) and training_provenance.json. The folder is built
    beside `out_dir` and swapped in only when complete; a failure leaves the old folder as it was.
    """
    model = generation.unwrap_model(model)
    with atomic_folder(out_dir) as temp:  # safetensors writes owner-only files: atomic_folder makes them plain
        architecture = architecture_of(model)
        with generation.quiet_transformers_progress():
            model.save_pretrained(temp, max_shard_size="100GB")  # transformers 5 always writes safetensors
        tokenizer.save_pretrained(temp)
        context = getattr(model.config, "max_position_embeddings", None)
        generation.generation_config_for(tokenizer, context).save_pretrained(temp)
        write_model_card(temp, architecture, card_info)
        write_provenance(temp, architecture, card_info)
        hashes = {
            path.relative_to(temp).as_posix(): sha256_file(path)
            for path in sorted(p for p in temp.rglob("*") if p.is_file())
        }
    return hashes
