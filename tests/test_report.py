"""report.py, metrics_log.py and export_hf.py: progress lines, the loss curve, TensorBoard, the HF export and its
model card."""

import argparse
import json
import math
import os
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tinyllm.common import UserError, remove_temporaries, sha256_file, temporary_name
from tinyllm.data import build as data
from tinyllm.data import corpus_format
from tinyllm.model import generation
from tinyllm.outputs import export_hf, metrics_log, report, trackers

# ----------------------------------------------------------------------------------------------
# Progress


def progress_lines(text):
    return [int(match) for match in re.findall(r"^step +(\d+)/", text, flags=re.MULTILINE)]


def test_progress_prints_plain_lines_every_n_steps_when_not_a_terminal(capsys):
    progress = report.Progress(total_steps=25, every=10)  # pytest's stderr is not a terminal
    for step in range(1, 26):
        progress.update(step, loss=1.234, tokens_per_second=12_345, mfu=0.125)
        if step == 12:
            progress.write("eval: val_loss 1.1")
    progress.close()
    out = capsys.readouterr()
    assert progress_lines(out.out) == [1, 10, 20, 25]
    first = out.out.splitlines()[0]
    assert "loss 1.2340" in first and "12.3K tok/s" in first and "MFU 12.5%" in first and "ETA ?" in first
    assert "ETA ?" not in out.out.splitlines()[1]  # the pace is known from the second line on
    assert "eval: val_loss 1.1" in out.out
    assert out.err == ""


def test_the_first_progress_line_carries_the_start_up_compile_time(capsys):
    progress = report.Progress(total_steps=20, every=10, first_note="compiled in 41 s")
    for step in range(1, 21):
        progress.update(step, loss=1.0)
    lines = capsys.readouterr().out.splitlines()
    assert "| compiled in 41 s |" in lines[0] and not any("compiled" in line for line in lines[1:])


def test_progress_eta_leaves_out_the_slow_first_step(monkeypatch, capsys):
    clock = iter([0.0, 100.0, 101.0, 102.0])  # the first step took 100 s (compiling), the next 1 s each
    monkeypatch.setattr(report.time, "monotonic", lambda: next(clock, 102.0))
    progress = report.Progress(total_steps=12, every=1)
    next(clock)  # the run starts: time 0
    progress.update(1, loss=1.0)  # at time 100: ETA ?
    progress.update(2, loss=1.0)
    assert capsys.readouterr().out.splitlines()[-1].endswith("ETA 00:10")  # 1 s per step, 10 steps left
    progress.update(3, loss=1.0)
    assert capsys.readouterr().out.splitlines()[-1].endswith("ETA 00:09")  # not 102 s / 3 steps x 9


def test_progress_after_resume_and_on_other_ranks(capsys):
    progress = report.Progress(total_steps=130, initial_step=100, every=10)
    for step in range(101, 131):
        progress.update(step, loss=2.0)
    assert progress_lines(capsys.readouterr().out) == [101, 110, 120, 130]

    silent = report.Progress(total_steps=10, every=1, enabled=False, bar=True)
    for step in range(1, 11):
        silent.update(step, loss=2.0)
    silent.write("rank 1 says hi")
    silent.close()
    assert capsys.readouterr() == ("", "")


def test_progress_bar_keeps_stdout_clean(capsys):
    with report.Progress(total_steps=5, every=1, bar=True) as progress:
        for step in range(1, 6):
            progress.update(step, loss=0.5, tokens_per_second=100.0, mfu=None)
        progress.write("checkpoint saved")
    out = capsys.readouterr()
    assert progress_lines(out.out) == []
    assert "checkpoint saved" in out.err and "5/5" in out.err and "loss 0.5000" in out.err


# ----------------------------------------------------------------------------------------------
# metrics.jsonl -> loss_curve.png, TensorBoard


def write_metrics(path, truncated_tail=True):
    lines = []
    for step in range(1, 31):
        lines.append(
            {
                "kind": "train",
                "step": step,
                "tokens": step * 512,
                "loss": 5.0 / step**0.5,
                "adamw_lr": 1e-3 * min(1.0, step / 5),
                "grad_norm": 1.0,
                "step_seconds": 0.1,
                "tokens_per_second": 5120.0,
                "mfu": None,
                "peak_memory_bytes": 0,
                "time": "t",
            }
        )
        if step % 10 == 0:
            lines.append(
                {
                    "kind": "eval",
                    "step": step,
                    "tokens": step * 512,
                    "val_loss": 5.5 / step**0.5,
                    "val_perplexity": 9.0,
                    "time": "t",
                }
            )
    lines.append(
        {"kind": "test", "step": 30, "tokens": 30 * 512, "test_loss": 1.05, "test_perplexity": 2.9, "time": "t"}
    )
    text = "".join(json.dumps(line) + "\n" for line in lines)
    if truncated_tail:
        text += '{"kind": "train", "step": 31, "tokens": 15872, "lo'
    path.write_text(text)


def test_read_metrics_skips_broken_lines_and_keeps_the_last_repeat(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(
        '{"kind": "train", "step": 1, "loss": 3.0}\n'
        '{"kind": "train", "step": 2, "loss": 2.9}\n'
        '{"kind": "train", "step": 3, "lo'  # killed mid-line, then the run resumed from step 1
        '{"kind": "train", "step": 2, "loss": 2.5}\n'
        '{"kind": "eval", "step": 2, "val_loss": 2.7}\n'
        '{"kind": "train", "step": 3, "loss": 2.4}\n'
        '{"kind": "train", "step": 4, "lo'
    )
    records = metrics_log.read_metrics(path)
    assert [(r["kind"], r["step"], r.get("loss", r.get("val_loss"))) for r in records] == [
        ("train", 1, 3.0),
        ("train", 2, 2.5),
        ("eval", 2, 2.7),
        ("train", 3, 2.4),
    ]
    assert metrics_log.read_metrics(tmp_path / "missing.jsonl") == []


def test_plot_loss_curve_writes_a_png_atomically(tmp_path):
    from matplotlib.image import imread

    metrics = tmp_path / "metrics.jsonl"
    write_metrics(metrics)
    out = tmp_path / "loss_curve.png"
    assert metrics_log.plot_loss_curve(metrics, out, title="demo") is True
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width, _ = imread(out).shape
    assert (width, height) == (990, 550)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loss_curve.png", "metrics.jsonl"]

    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"kind": "train", "st')
    assert metrics_log.plot_loss_curve(empty, tmp_path / "none.png") is False
    assert not (tmp_path / "none.png").exists()

    assert report.main(["plot", str(tmp_path), "--out", str(tmp_path / "cli.png")]) == 0
    assert (tmp_path / "cli.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(UserError, match=f"run {tmp_path / 'nope'}: no such folder"):
        report.main(["plot", str(tmp_path / "nope")])


@pytest.mark.parametrize(
    "argv",
    [
        ["samples", "RUN/model", "--device", "cuda", "--prompt", "hi"],
        ["evaluate", "RUN", "--tasks", "t.jsonl", "--device", "cuda"],
    ],
)
def test_report_refuses_a_device_torch_does_not_see_as_train_py_does(argv, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    argv = [str(tmp_path / arg) if arg.startswith("RUN") else arg for arg in argv]
    with pytest.raises(UserError, match="^--device cuda, but torch sees no CUDA device$"):
        report.main(argv)


@pytest.mark.parametrize(
    "argv, says",
    [
        (["samples", "RUN/model", "--device", "banana"], "argument --device: invalid choice: 'banana'"),
        (["evaluate", "RUN", "--tasks", "t.jsonl", "--device", "banana"], "argument --device: invalid choice"),
        (["samples", "RUN/model", "--max-new-tokens", "0"], "argument --max-new-tokens: must be positive, got 0"),
        (["samples", "RUN/model", "--max-new-tokens", "-5"], "argument --max-new-tokens: must be positive, got -5"),
        (["evaluate", "RUN", "--tasks", "t.jsonl", "--max-new-tokens", "0"], "must be positive, got 0"),
        (["evaluate", "RUN", "--tasks", "t.jsonl", "--batch-size", "0"], "argument --batch-size: must be positive"),
    ],
)
def test_report_refuses_bad_options_at_parse_time_in_one_line(argv, says, capsys):
    with pytest.raises(SystemExit) as exited:
        report.parse_args(argv)
    error = capsys.readouterr().err
    assert exited.value.code == 2 and error.startswith("error: ") and says in error and error.count("\n") == 1


def subcommand_options() -> dict[str, tuple[argparse.ArgumentParser, argparse.Action]]:
    """ "samples --device" -> (its subcommand's parser, the option) for every option of report.py but --help."""
    commands = next(action for action in report.build_parser()._actions if action.choices)
    return {
        f"{name} {action.option_strings[0]}": (parser, action)
        for name, parser in commands.choices.items()
        for action in parser._actions
        if action.option_strings and action.dest != "help"
    }


@pytest.mark.parametrize("option", subcommand_options())
def test_every_report_option_has_help_that_says_its_default_once(option):
    parser, action = subcommand_options()[option]
    shown = parser._get_formatter()._expand_help(action)
    assert action.help and shown.count("default") <= 1, shown


def test_the_loss_curve_plots_the_series_of_metrics_jsonl(tmp_path, monkeypatch):
    """What is drawn, line by line: the train loss and its smoothing, validation, the test star and the learning
    rate, each against tokens seen and equal to metrics.jsonl's values."""
    from matplotlib.axes import Axes

    drawn = {}
    plot = Axes.plot

    def recording_plot(self, x, y, *args, label=None, **kwargs):
        drawn[label] = (list(x), list(y))
        return plot(self, x, y, *args, label=label, **kwargs)

    monkeypatch.setattr(Axes, "plot", recording_plot)
    metrics = tmp_path / "metrics.jsonl"
    lines = []
    for step in range(1, 61):  # 60 train points: the raw series and a smoothed one
        lines.append(
            {
                "kind": "train",
                "step": step,
                "tokens": step * 512,
                "loss": 6.0 - step / 20 + (step % 2) / 5,
                "adamw_lr": 1e-3 * min(1.0, step / 5),
                "muon_lr": 2e-2 * min(1.0, step / 5),
            }
        )
        if step % 20 == 0:
            lines.append({"kind": "eval", "step": step, "tokens": step * 512, "val_loss": 5.5 - step / 30})
    lines.append(
        {"kind": "train", "step": 61, "tokens": 61 * 512, "loss": float("nan"), "adamw_lr": 1e-3, "muon_lr": 2e-2}
    )  # skipped
    lines.append({"kind": "test", "step": 61, "tokens": 61 * 512, "test_loss": 3.25})
    lines.append({"kind": "samples", "step": 61, "samples": []})  # the run's last record carries no tokens
    metrics.write_text("".join(json.dumps(line) + "\n" for line in lines))
    titles = []
    monkeypatch.setattr("matplotlib.figure.Figure.suptitle", lambda self, text, **kwargs: titles.append(text))
    assert metrics_log.plot_loss_curve(metrics, tmp_path / "curve.png") is True
    assert titles == ["tinyllm: step 61, 31.2K tokens"]
    train = [line for line in lines if line["kind"] == "train" and line["step"] <= 60]
    tokens = [line["tokens"] for line in train]
    losses = [line["loss"] for line in train]
    assert drawn["train loss"] == (tokens, losses)
    smoothed_tokens, smoothed = drawn["train loss (smoothed)"]
    assert smoothed_tokens == tokens and smoothed[0] == losses[0]
    assert smoothed[30] == pytest.approx(sum(losses[29:32]) / 3)  # a centred moving average of 3 (60 points // 25)
    assert drawn["validation loss"] == ([20 * 512, 40 * 512, 60 * 512], [5.5 - 20 / 30, 5.5 - 40 / 30, 5.5 - 2.0])
    assert drawn["test loss 3.250"] == ([61 * 512], [3.25])
    # each param group's learning rate, named as the records name it (NAME_lr)
    assert drawn["adamw lr"] == (tokens + [61 * 512], [line["adamw_lr"] for line in train] + [1e-3])
    assert drawn["muon lr"] == (tokens + [61 * 512], [line["muon_lr"] for line in train] + [2e-2])
    assert not any(label and " acc" in label for label in drawn)  # no --eval-tasks: no second panel


def test_the_learning_rates_are_the_param_groups_the_records_name():
    """A train record's NAME_lr is the lr of the param groups named NAME: any optimizer's groups, no fixed list."""
    assert metrics_log.lr_fields({"muon": 0.02, "adamw": 0.05}) == {"muon_lr": 0.02, "adamw_lr": 0.05}
    records = [
        {"kind": "train", "step": 1, "tokens": 64, "loss": 3.0, "matrices_lr": 0.1, "embeddings_lr": 0.2},
        {"kind": "train", "step": 2, "tokens": 128, "loss": 2.9, "matrices_lr": 0.05},
        {"kind": "eval", "step": 2, "tokens": 128, "other_lr": 1.0},
    ]
    assert metrics_log.lr_series(records) == {"matrices lr": ([64, 128], [0.1, 0.05]), "embeddings lr": ([64], [0.2])}


def test_eval_task_scores_get_a_second_panel(tmp_path, monkeypatch):
    """A run with --eval-tasks: below the losses, each task's acc and acc_norm against tokens seen, its
    chance as a dashed line; the figure grows to hold the panel."""
    from matplotlib.axes import Axes
    from matplotlib.image import imread

    drawn, lines_at = {}, []
    plot, axhline = Axes.plot, Axes.axhline
    monkeypatch.setattr(
        Axes,
        "plot",
        lambda self, x, y, *args, label=None, **kwargs: (
            drawn.__setitem__(label, (list(x), list(y))),
            plot(self, x, y, *args, label=label, **kwargs),
        )[1],
    )
    monkeypatch.setattr(
        Axes, "axhline", lambda self, y, *args, **kwargs: (lines_at.append(y), axhline(self, y, *args, **kwargs))[1]
    )
    records = [{"kind": "train", "step": step, "tokens": 100 * step, "loss": 5.0 - step / 10} for step in range(1, 9)]
    scores = {4: {"sums": (0.3, 0.35), "words": (0.5, 0.45)}, 8: {"sums": (0.6, 0.55), "words": (0.7, 0.75)}}
    for step, by_task in scores.items():
        fields = {
            f"{name}/{metric}": value
            for name, (acc, norm) in by_task.items()
            for metric, value in (("acc", acc), ("acc_norm", norm), ("acc_bytes", norm), ("n", 20))
        }
        records.append(
            {"kind": "tasks", "step": step, "tokens": 100 * step, **fields, "sums/chance": 0.25, "words/chance": 0.5}
        )
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(record) + "\n" for record in records))
    assert metrics_log.plot_loss_curve(metrics, tmp_path / "curve.png") is True
    assert drawn["sums acc"] == ([400, 800], [0.3, 0.6]) and drawn["sums acc_norm"] == ([400, 800], [0.35, 0.55])
    assert drawn["words acc"] == ([400, 800], [0.5, 0.7]) and drawn["words acc_norm"] == ([400, 800], [0.45, 0.75])
    assert lines_at == [0.25, 0.5]
    height, width, _ = imread(tmp_path / "curve.png").shape
    assert (width, height) == (990, 825)


def test_tensorboard_logger_writes_the_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = trackers.TensorBoardLogger(tmp_path)
    logger.log({"kind": "train", "step": 1, "tokens": 512, "loss": 3.5, "lr": 1e-3, "mfu": None, "time": "t"})
    logger.log({"kind": "train", "step": 2, "tokens": 1024, "loss": 3.0, "lr": 2e-3, "time": "t"})
    logger.log({"kind": "eval", "step": 2, "tokens": 1024, "val_loss": 3.2, "val_perplexity": 24.5})
    logger.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert set(events.Tags()["scalars"]) == {
        "train/tokens",
        "train/loss",
        "train/lr",
        "eval/tokens",
        "eval/val_loss",
        "eval/val_perplexity",
    }
    assert [(e.step, round(e.value, 4)) for e in events.Scalars("train/loss")] == [(1, 3.5), (2, 3.0)]
    assert [e.step for e in events.Scalars("eval/val_loss")] == [2]


# ----------------------------------------------------------------------------------------------
# Hugging Face export

CARD_INFO = {
    "model_name": "tinyllm-test",
    "status": "COMPLETE",
    "preset": "tiny",
    "steps": 200,
    "total_steps": 200,
    "tokens": 25_600,
    "corpus_sha256": "c0" * 32,
    "tokenizer_sha256": "70" * 32,
    "settings": {"training": {"preset": "tiny", "lr": 0.01}},
    "validation_loss": 0.1234,
    "validation_perplexity": 1.13,
    "validation_tokens": 8_192,
    "test_loss": 0.2345,
    "test_perplexity": 1.26,
    "test_bits_per_byte": 0.0812,
    "demo_accuracy": {
        "accuracy": 0.925,
        "correct": 37,
        "total": 40,
        "by_task": {"addition": {"accuracy": 0.925, "correct": 37, "total": 40}},
    },
}


def test_export_reloads_with_transformers_and_matches_the_training_model(chat_model, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

    model, tokenizer = chat_model
    out = tmp_path / "run" / "model"
    hashes = export_hf.export_hf_model(model, tokenizer, out, CARD_INFO)

    names = {
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "README.md",
        "training_provenance.json",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    assert names <= set(hashes)
    assert hashes == {p.name: sha256_file(p) for p in out.iterdir()}
    assert [p.name for p in out.parent.iterdir()] == ["model"]

    loaded = AutoModelForCausalLM.from_pretrained(out)
    loaded_tokenizer = AutoTokenizer.from_pretrained(out)
    assert loaded_tokenizer.chat_template == corpus_format.CHAT_TEMPLATE
    inputs = loaded_tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 10 plus 7?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        assert torch.equal(loaded(**inputs).logits, model(**inputs).logits)

    generation = json.loads((out / "generation_config.json").read_text())
    im_end, eos = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<eos>"])
    assert generation["eos_token_id"] == [im_end, eos] and (im_end, eos) == (4, 2)
    assert (generation["pad_token_id"], generation["bos_token_id"]) == (0, 1)
    assert generation.get("do_sample", False) is False
    assert generation["max_new_tokens"] == 96  # a quarter of the 128-token context left for the prompt

    chat = pipeline("text-generation", model=str(out), device="cpu")
    reply = chat([{"role": "user", "content": "Say hello."}], max_new_tokens=16)[0]["generated_text"][-1]
    assert reply == {"role": "assistant", "content": "Hello there!"}

    card = (out / "README.md").read_text()
    parameters = sum(p.numel() for p in model.parameters())
    for expected in [
        "Status: **COMPLETE**",
        "Optimizer steps: 200 of 200",
        "Tokens trained on: 25,600",
        export_hf.parameters_line(export_hf.architecture_of(model)),
        "2 decoder layers",
        "c0" * 32,
        "70" * 32,
        "Validation loss: 0.1234 (perplexity 1.13) on 8,192 held-out tokens",  # no bits per byte recorded
        "Test loss: 0.2345 (perplexity 1.26, 0.0812 bits per byte)\n",  # nor its tokens
        "92.5% exact match (37/40)",
        "AutoModelForCausalLM.from_pretrained",
        "## Limitations",
    ]:
        assert expected in card, expected
    provenance = json.loads((out / "training_provenance.json").read_text())
    assert (provenance["corpus_sha256"], provenance["tokenizer_sha256"]) == ("c0" * 32, "70" * 32)
    assert (provenance["steps"], provenance["tokens"]) == (200, 25_600)
    assert provenance["architecture"]["parameters"] == parameters
    assert provenance["settings"] == CARD_INFO["settings"] and "and the training settings" in card
    export_gguf = pytest.importorskip("tinyllm.outputs.export_gguf")  # the GGUF exporter reads the same provenance
    assert export_gguf.read_provenance(out)[0] == {"corpus_sha256": "c0" * 32, "tokenizer_sha256": "70" * 32}

    assert report.main(["samples", str(out), "--prompt", "Name a color.", "--max-new-tokens", "8"]) == 0
    capsys.readouterr()  # the run folder names its model/, as evaluate's does
    assert report.main(["samples", str(out.parent), "--prompt", "Name a color.", "--max-new-tokens", "8"]) == 0
    assert "> Name a color." in capsys.readouterr().out
    assert report.main(["samples", str(out), "--system", "Be brief.", "--prompt", "Say hello."]) == 0
    assert capsys.readouterr().out.startswith("system: Be brief.\n\n> Say hello.\n")
    with pytest.raises(UserError, match="^samples --system is a chat model's system turn, but these prompts"):
        report.main(["samples", str(out), "--text", "--system", "Be brief.", "--prompt", "Once"])
    with pytest.raises(UserError, match="neither a run folder"):
        report.main(["samples", str(tmp_path), "--prompt", "hi"])
    eval_file = tmp_path / "eval.jsonl"
    eval_file.write_text(json.dumps({"prompt": "What is 10 plus 7?", "answer": "17", "task": "addition"}) + "\n")
    capsys.readouterr()
    assert report.main(["evaluate", str(out), "--tasks", str(eval_file), "--json", str(tmp_path / "scores.json")]) == 0
    assert "| eval | exact | 1 | - | - | 1.0000 |" in capsys.readouterr().out
    scores = json.loads((tmp_path / "scores.json").read_text())
    assert scores["tasks"]["eval"]["exact_match"] == 1.0 and scores["harness"]["exact_match"]["decoding"] == "greedy"
    assert "## Benchmark scores" in (out / "README.md").read_text()
    with pytest.raises(UserError, match="neither a run folder"):
        report.main(["evaluate", str(tmp_path), "--tasks", str(eval_file)])


# A conversation as data.py reads it: a system turn, then replies whose reasoning sits in a field of the message.
REASONING_CHAT = [
    {"role": "system", "content": "Answer with the number."},
    {"role": "user", "content": "What is 2 plus 3?"},
    {"role": "assistant", "content": "5", "reasoning_content": "2 + 3 = 5"},
    {"role": "user", "content": "And 10 plus 7?"},
    {"role": "assistant", "content": "17", "reasoning": "\n10 + 7 = 17\n"},
]


def training_render(messages: list[dict]) -> str:
    """The document data.py trains on for `messages`."""
    kind, text, _, _ = data.to_document({"messages": messages}, corpus_format.CHAT_TEMPLATE, True)
    assert kind == "chat"
    return text


@pytest.mark.parametrize(
    "record",
    [
        {"system": "Answer in one word.", "prompt": "Name a color.", "response": "Blue"},
        {"messages": [{"role": "system", "content": " Answer in one word.\n"}, {"role": "user", "content": "Hi"}]},
    ],
)
def test_samples_system_turn_renders_as_the_training_chat(record):
    """`samples --system S --prompt P` gives the model what data.py renders for that conversation, up to the reply."""
    tokenizer = SimpleNamespace(chat_template=corpus_format.CHAT_TEMPLATE)
    system, prompt = (
        (record["system"], record["prompt"]) if "system" in record else (m["content"] for m in record["messages"])
    )
    [conversation] = report.sample_conversations([prompt], system, text=False)
    rendered = generation.chat_prompt(tokenizer, conversation)
    reply = {"role": "assistant", "content": "Blue"}
    messages = data.record_messages(record)
    assert rendered + "Blue<|im_end|>\n" == training_render([*messages[:2], reply])
    assert rendered.startswith("<|im_start|>system\nAnswer in one word.<|im_end|>\n<|im_start|>user\n")
    assert rendered.endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_chat_prompts_render_earlier_replies_with_their_reasoning_as_training_did():
    tokenizer = SimpleNamespace(chat_template=corpus_format.CHAT_TEMPLATE)
    rendered = generation.chat_prompt(tokenizer, REASONING_CHAT[:-1])
    assert rendered + "<think>\n10 + 7 = 17\n</think>\n\n17<|im_end|>\n" == training_render(REASONING_CHAT)
    assert "<think>\n2 + 3 = 5\n</think>\n\n5<|im_end|>" in rendered


@pytest.mark.parametrize(
    "system, text, says",
    [
        (
            "Be brief.",
            True,
            "^samples --system is a chat model's system turn, but these prompts are continued as plain",
        ),
        (" \n", False, "^samples --system is empty; leave it out"),
    ],
)
def test_samples_refuses_a_system_turn_it_cannot_give(system, text, says):
    with pytest.raises(UserError, match=says):
        report.sample_conversations(["Once upon a time"], system, text)
    assert report.sample_conversations(["hi"], None, text) == [[{"role": "user", "content": "hi"}]]


def test_the_exported_chat_template_renders_reasoning_as_training_did(chat_model, tmp_path):
    """A client's messages with their reasoning (`reasoning_content` as Qwen3's template names it, or any name
    data.py reads) render through the exported folder's template exactly as data.py rendered them for training:
    every reply's reasoning in place."""
    from transformers import AutoTokenizer

    model, tokenizer = chat_model
    out = tmp_path / "model"
    export_hf.export_hf_model(model, tokenizer, out, CARD_INFO)
    exported = AutoTokenizer.from_pretrained(out)
    rendered = exported.apply_chat_template(REASONING_CHAT, tokenize=False)
    assert rendered == training_render(REASONING_CHAT)
    assert rendered.count("<think>\n") == 2 and "<think>\n10 + 7 = 17\n</think>\n\n17<|im_end|>" in rendered
    for key in corpus_format.REASONING_KEYS:
        messages = [*REASONING_CHAT[:2], {"role": "assistant", "content": "5", key: "2 + 3 = 5"}]
        assert exported.apply_chat_template(messages, tokenize=False) == training_render(messages), key
    prompt = exported.apply_chat_template(REASONING_CHAT[:-1], tokenize=False, add_generation_prompt=True)
    assert prompt == generation.chat_prompt(exported, REASONING_CHAT[:-1])


@pytest.mark.parametrize(
    "tied, says",
    [
        (True, "(the input embedding and the LM head one tied matrix, counted once)"),
        (False, "(the input embedding and the LM head separate matrices, both counted)"),
    ],
)
def test_the_card_says_whether_the_embedding_and_the_head_are_one_matrix(tied, says):
    assert (
        export_hf.parameters_line({"parameters": 164_224, "tied_embeddings": tied}) == f"- Parameters: 164,224 {says}"
    )


def test_interrupted_export_leaves_the_previous_folder_intact(chat_model, tmp_path, monkeypatch):
    model, tokenizer = chat_model
    out = tmp_path / "model"
    first = export_hf.export_hf_model(model, tokenizer, out, {**CARD_INFO, "status": "CHECKPOINTED_NEEDS_RESUME"})

    def crash(*args, **kwargs):
        raise RuntimeError("killed mid-export")

    monkeypatch.setattr(export_hf, "write_provenance", crash)
    with torch.no_grad():
        model.model.norm.weight.add_(1.0)  # the new export would differ
    try:
        with pytest.raises(RuntimeError, match="killed mid-export"):
            export_hf.export_hf_model(model, tokenizer, out, CARD_INFO)
        assert {p.name: sha256_file(p) for p in out.iterdir()} == first
        assert sorted(os.listdir(tmp_path)) == ["model"]
        assert "training did not finish" in (out / "README.md").read_text()

        monkeypatch.undo()
        # A kill between the swap's two renames leaves the old folder aside, and a kill mid-export its
        # temporary folder: the next export sweeps both, putting the old folder back first.
        os.replace(out, tmp_path / temporary_name("model", "old"))
        (tmp_path / temporary_name("model")).mkdir()
        remove_temporaries(tmp_path, "model")
        assert sorted(os.listdir(tmp_path)) == ["model"]
        assert {p.name: sha256_file(p) for p in out.iterdir()} == first
        (tmp_path / temporary_name("model")).mkdir()

        second = export_hf.export_hf_model(model, tokenizer, out, CARD_INFO)
        assert second["model.safetensors"] != first["model.safetensors"]
        assert {p.name: sha256_file(p) for p in out.iterdir()} == second
        assert sorted(os.listdir(tmp_path)) == ["model"]
    finally:
        with torch.no_grad():
            model.model.norm.weight.sub_(1.0)


def test_export_shows_no_transformers_progress_bars_and_restores_the_setting(chat_model, tmp_path, capfd):
    from transformers.utils import logging as hf_logging

    model, tokenizer = chat_model
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.enable_progress_bar()  # other tests (datasets, data.py) may have switched the bars off
    try:
        export_hf.export_hf_model(model, tokenizer, tmp_path / "model", CARD_INFO)
        generation.load_exported(str(tmp_path / "model"), "cpu")
        assert hf_logging.is_progress_bar_enabled()  # only our export is quiet
    finally:
        if not was_enabled:
            hf_logging.disable_progress_bar()
    captured = capfd.readouterr()
    assert "Writing model shards" not in captured.err + captured.out
    assert "Loading weights" not in captured.err + captured.out


def demo_like_metrics(path, train_points: int) -> None:
    """Train loss falling from 6 to 0.3 and validation right on it (the demo's curve), as train.py logs them."""
    records = []
    for index in range(train_points):
        step = 1 + index * 1500 // train_points
        loss = 0.3 + 5.7 * math.exp(-step / 120)
        records.append({"kind": "train", "step": step, "tokens": step * 4096, "loss": loss, "lr": 3e-3})
        if index and index % 5 == 0:
            records.append({"kind": "eval", "step": step, "tokens": step * 4096, "val_loss": loss})
    path.write_text("".join(json.dumps(record) + "\n" for record in records))


@pytest.mark.parametrize("train_points", [3, 31, 300])
def test_loss_curve_shows_the_train_line_in_full_colour_whatever_the_run_length(tmp_path, train_points):
    from matplotlib.colors import to_rgb
    from matplotlib.image import imread

    demo_like_metrics(tmp_path / "metrics.jsonl", train_points)
    assert metrics_log.plot_loss_curve(tmp_path / "metrics.jsonl", tmp_path / "loss_curve.png")
    pixels = imread(tmp_path / "loss_curve.png")[..., :3]
    blue = np.abs(pixels - np.array(to_rgb("tab:blue"))).max(axis=-1) < 0.05  # not the pale, see-through line
    assert blue.sum() > 1500, f"only {blue.sum()} pixels of the train line in full colour"


def test_smooth_is_centred_so_a_falling_curve_does_not_lag():
    falling = [10.0 - index for index in range(10)]
    assert metrics_log.smooth(falling, window=5) == falling  # a moving average that trails would sit above it
    assert metrics_log.smooth([1.0, 5.0, 1.0, 5.0, 1.0], window=3) == [1.0, 7 / 3, 11 / 3, 7 / 3, 1.0]
    assert metrics_log.smooth([]) == [] and metrics_log.smooth([2.0]) == [2.0]


# ----------------------------------------------------------------------------------------------
# The model card's usage example comes from the corpus


def card_code(card: str) -> str:
    return card.split("```python\n", 1)[1].split("```", 1)[0]


@pytest.mark.parametrize(
    "example, expected",
    [
        (
            {"kind": "chat", "prompt": 'What does "tiny" mean?\nSay it.'},
            'messages = [{"role": "user", "content": "What does \\"tiny\\" mean?\\nSay it."}]',
        ),
        ({"kind": "text", "prompt": "Once upon a time, a small"}, 'inputs = tokenizer("Once upon a time, a small"'),
    ],
)
def test_the_card_example_is_valid_python_with_the_corpus_prompt(example, expected):
    architecture = {
        "parameters": 1000,
        "tied_embeddings": True,
        "layers": 1,
        "hidden": 8,
        "intermediate": 16,
        "heads": 2,
        "kv_heads": 1,
        "head_dim": 4,
        "context": 64,
        "vocab_size": 300,
    }
    card = export_hf.model_card(architecture, {"usage_example": example, "status": "COMPLETE"})
    code = card_code(card)
    compile(code, "card", "exec")  # a prompt with quotes and newlines still makes valid Python
    assert expected in code and "12 plus 7" not in card
    assert ("apply_chat_template" in code) is (example["kind"] == "chat")


def test_usage_example_from_a_text_corpus_is_a_held_out_opening(tmp_path):
    from tiny_runs import write_tiny_corpus

    corpus = write_tiny_corpus(tmp_path / "corpus", documents=300)
    tokenizer = corpus_format.load_tokenizer(corpus / "tokenizer")
    example = export_hf.usage_example_from(corpus, tokenizer)
    kind, openings = generation.held_out_prompts(corpus, tokenizer, count=1)
    assert example == {"kind": "text", "prompt": openings[0]} and kind == "text"
    assert " plus " in example["prompt"]  # the corpus's sentences ("12 plus 30 is 42. the cat ..."), not a demo's
    assert export_hf.usage_example_from(tmp_path / "missing", tokenizer) == {"kind": "chat", "prompt": "Hello!"}
