"""The demo end to end through the real CLI: `python train.py` in an empty folder, shortened by flags.

One shortened demo (the corpus is built by train.py itself, 40 steps) feeds most tests: the
run status, the held-out accuracy, the pictures and samples, the Hugging Face export loaded
back with transformers, --export-only, and the message of a resumable stop.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tinyllm.common import sha256_file
from tinyllm.data import corpus_format, demo_corpus
from tinyllm.model import config as model_config
from tinyllm.model import generation
from tinyllm.outputs import evaluation, export_hf, report
from tinyllm.training import distributed, optimization, train, train_data

ROOT = Path(__file__).resolve().parent.parent
STEPS = 40
SHORT = ["--target-tokens", str(STEPS * 32 * 128), "--eval-every", "20", "--save-every", "20", "--log-every", "10"]


def run_cli(args: list[str], cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    result = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    if check and result.returncode != 0:
        raise AssertionError(f"train.py exited {result.returncode}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """`python train.py` with the demo defaults, 40 steps, in an empty folder (it builds corpus/demo)."""
    work = tmp_path_factory.mktemp("demo")
    result = run_cli([*SHORT, "--log-to", "tensorboard"], cwd=work)
    return work, result


def status(run: Path) -> dict:
    return json.loads((run / "run_status.json").read_text())


def checkpoint_model(path: Path):
    """The Qwen3 model with the weights of a train.py checkpoint, built from its recorded settings."""
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    settings = checkpoint["settings"]["training"]
    preset = model_config.Preset(**{name: settings[f"model.{name}"] for name in model_config.OVERRIDABLE_FIELDS})
    model = model_config.build_model(preset, settings["vocab_size"])
    model.load_state_dict(checkpoint["model"])
    return model.eval()


def test_demo_defaults_apply_only_without_data():
    demo = train.option_values(train.parse_args([]))
    assert demo["demo"] and demo["data"] == train.DEFAULT_DATA and demo["out"] == train.DEFAULT_OUT
    assert {key: demo[key] for key in train.DEMO_DEFAULTS} == train.DEMO_DEFAULTS
    assert train.parse_args(["--lr", "1e-3"]).run.lr == 1e-3  # a given option wins over the demo default
    assert train.parse_args(["--epochs", "2"]).run.target_tokens is None  # --epochs replaces the demo's length
    normal = train.option_values(train.parse_args(["--data", "somewhere", "--out", "runs/somewhere"]))
    assert not normal["demo"] and normal["data"] == "somewhere"
    assert [normal[key] for key in ("batch_size", "lr", "optimizer", "target_tokens")] == [8, None, None, None]
    assert "demo" in train.build_parser().format_help()


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def split_loss(model, corpus: Path, split: str, context: int, settings: dict) -> float:
    """Mean next-token cross-entropy over a split's evaluation blocks (DESIGN.md: block i is tokens
    [i*C, i*C + C + 1); --eval-tokens' worth of them in the fixed evaluation order), read from the
    shards, each document of a block run alone from position 0 (--packing masked, the default)."""
    manifest = json.loads((corpus / "corpus_manifest.json").read_text())
    entry = manifest["splits"][split]
    tokens = np.concatenate([np.fromfile(corpus / item["name"], dtype="<u2") for item in entry["files"]]).astype(
        np.int64
    )
    ends = np.fromfile(corpus / entry["document_index"]["name"], dtype="<u8")
    count = (len(tokens) - 1) // context
    used = min(count, math.ceil(settings["training"]["eval_tokens"] / context))
    order = train_data.BlockPermutation(count, train_data.EVAL_SEED, train_data.EVAL_EPOCH)
    total, counted = 0.0, 0
    with torch.no_grad():
        for start in sorted(order(position) * context for position in range(used)):
            documents = np.searchsorted(ends, np.arange(start, start + context), side="right")
            for document in np.unique(documents):
                piece = start + np.flatnonzero(documents == document)
                inputs = torch.from_numpy(tokens[piece])[None]
                logits = model(input_ids=inputs).logits[0]
                total += torch.nn.functional.cross_entropy(
                    logits, torch.from_numpy(tokens[piece + 1]), reduction="sum"
                ).item()
                counted += len(piece)
    return total / counted


def test_demo_completes_with_an_accuracy(demo):
    work, result = demo
    run = work / "runs" / "demo"
    assert corpus_format.verify_corpus(work / "corpus" / "demo") == []  # built by train.py itself, and whole
    record = status(run)
    assert record["status"] == "COMPLETE" and record["step"] == STEPS
    assert record["report_errors"] is None
    accuracy = record["task_accuracy"]
    problems = (work / "corpus" / "demo" / demo_corpus.DEMO_EVAL_FILE).read_text().splitlines()
    assert accuracy["total"] == len(problems)
    assert {name: task["total"] for name, task in accuracy["by_task"].items()} == demo_corpus.DEMO_EVAL_COUNTS
    # the overall figure is what the per-task counts add up to (the scoring itself: tests/test_core.py)
    assert accuracy["correct"] == sum(task["correct"] for task in accuracy["by_task"].values())
    assert accuracy["accuracy"] == accuracy["correct"] / accuracy["total"]
    for task in accuracy["by_task"].values():
        assert task["accuracy"] == task["correct"] / task["total"]
    assert "held-out task accuracy:" in result.stdout
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith(
        f"COMPLETE: step 40/40 | test loss {record['test_loss']:.4f}, "
        f"{record['test']['bits_per_byte']:.4f} bits/byte | held-out accuracy "
        f"{100 * accuracy['accuracy']:.1f}% | "
    )
    # the test loss: the final model's mean cross-entropy over the whole test split, computed here from the shards
    final = checkpoint_model(run / "checkpoints" / "step-00000040.pt")
    settings = json.loads((run / "training_settings.json").read_text())
    expected = split_loss(final, work / "corpus" / "demo", "test", 128, settings)
    # computed here in fp32; the run evaluates in its precision (bf16 on a CPU with bf16 instructions: its rounding)
    assert record["test_loss"] == pytest.approx(
        expected, rel=1e-4 if settings["runtime"]["precision"] == "fp32" else 2e-3
    )
    assert [r["test_loss"] for r in metrics(run) if r["kind"] == "test"] == [record["test_loss"]]
    card = (run / "model" / "README.md").read_text()
    assert "Held-out demo task accuracy" in card and "**COMPLETE**" in card
    for split in ("validation", "test"):  # each with its bits per byte and the tokens they were measured on
        held_out = record[split]
        assert (
            f"- {split.capitalize()} loss: {held_out['loss']:.4f} (perplexity {held_out['perplexity']:.2f}, "
            f"{held_out['bits_per_byte']:.4f} bits per byte) on {held_out['tokens']:,} held-out tokens\n"
        ) in card


def test_the_demo_trains_with_the_default_recipe_and_a_clean_log(demo):
    """No recipe option given: the rules pick Muon, the width's AdamW lr and a warmup that fits 40 steps."""
    work, result = demo
    settings = json.loads((work / "runs" / "demo" / "training_settings.json").read_text())["training"]
    rule = optimization.OPTIMIZERS[optimization.DEFAULT_OPTIMIZER]
    assert settings["recipe.optimizer"] == optimization.DEFAULT_OPTIMIZER
    assert settings["recipe.lr"] == rule.adamw_lr.at(model_config.PRESETS["tiny"].hidden)
    assert settings["recipe.warmup_steps"] == rule.warmup_steps(STEPS) < STEPS // 2
    assert "recipe: " in result.stdout and "chosen by the rules" in result.stdout
    assert "warning:" not in result.stderr
    assert "Writing model shards" not in result.stderr and "Loading weights" not in result.stderr


def test_demo_leaves_pictures_samples_and_hashed_model_files(demo):
    work, _ = demo
    run = work / "runs" / "demo"
    from matplotlib.image import imread

    picture = imread(run / "loss_curve.png")
    assert picture.shape[:2] == (550, 990) and picture[..., :3].std() > 0.05  # a drawn picture, not a blank one
    samples = json.loads((run / "sample_generations.json").read_text())
    assert samples["error"] is None and samples["step"] == STEPS
    assert [s["prompt"] for s in samples["samples"]] == generation.DEFAULT_PROMPTS
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run))
    events.Reload()
    records = metrics(run)
    for tag, kind, key in [
        ("train/loss", "train", "loss"),
        ("train/adamw_lr", "train", "adamw_lr"),
        ("train/muon_lr", "train", "muon_lr"),
        ("eval/val_loss", "eval", "val_loss"),
    ]:
        logged = [(event.step, event.value) for event in events.Scalars(tag)]
        expected = [(r["step"], r[key]) for r in records if r["kind"] == kind]
        assert [step for step, _ in logged] == [step for step, _ in expected] and len(logged) >= 2, tag
        assert [value for _, value in logged] == pytest.approx([value for _, value in expected], rel=1e-6), tag
    files = status(run)["model_files"]
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json", "README.md"} <= set(files)
    for name, sha in files.items():
        assert sha256_file(run / "model" / name) == sha, name


def test_exported_model_loads_with_transformers_and_matches_the_checkpoint(demo):
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

    work, _ = demo
    run = work / "runs" / "demo"
    model = AutoModelForCausalLM.from_pretrained(run / "model").eval()
    tokenizer = AutoTokenizer.from_pretrained(run / "model")
    reference = checkpoint_model(run / "checkpoints" / "step-00000040.pt")
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 12 plus 7?"}], add_generation_prompt=True, tokenize=False
    )
    ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, reference(input_ids=ids).logits)
    assert model.config.use_cache and model.generation_config.pad_token_id == 0
    chat = pipeline("text-generation", model=model, tokenizer=tokenizer)
    reply = chat([{"role": "user", "content": "What is 12 plus 7?"}], max_new_tokens=8)
    assert reply[0]["generated_text"][-1]["role"] == "assistant"


def test_export_only_writes_the_model_of_any_checkpoint(demo):
    work, _ = demo
    checkpoint = work / "runs" / "demo" / "checkpoints" / "step-00000020.pt"
    result = run_cli(["--export-only", "--resume", str(checkpoint), "--out", "runs/exported"], cwd=work)
    exported = work / "runs" / "exported" / "model"
    assert "exported" in result.stdout.strip().splitlines()[-1]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(exported).eval()
    reference = checkpoint_model(checkpoint)
    for name, tensor in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name
    card = (exported / "README.md").read_text()
    assert "CHECKPOINTED_NEEDS_RESUME" in card and f"- Optimizer steps: 20 of {STEPS}" in card
    assert not (work / "runs" / "exported" / "run_status.json").exists()  # no run was touched
    missing = run_cli(["--export-only", "--out", "runs/nothing-here"], cwd=work, check=False)
    assert missing.returncode == 2 and "--export-only needs a checkpoint" in missing.stderr


def test_a_resumable_stop_exports_and_prints_the_continue_command(demo):
    work, _ = demo
    args = [*SHORT, "--out", "runs/stopped", "--stop-after-steps", "10"]
    result = run_cli(args, cwd=work)
    run = work / "runs" / "stopped"
    record = status(run)
    assert record["status"] == "CHECKPOINTED_NEEDS_RESUME" and record["step"] == 10
    expected = (
        f"{distributed.python_command()} {ROOT / 'train.py'} " + " ".join(SHORT) + " --out runs/stopped --resume auto"
    )
    assert record["resume_command"] == expected
    assert (
        result.stdout.strip().splitlines()[-1]
        == f"CHECKPOINTED_NEEDS_RESUME: step 10/{STEPS} | stopped by --stop-after-steps 10 | continue with: {expected}"
    )
    assert "CHECKPOINTED_NEEDS_RESUME" in (run / "model" / "README.md").read_text()
    assert not (run / "sample_generations.json").exists()  # samples and accuracy only for a finished run


def test_a_failing_report_never_loses_the_run(demo, tmp_path, monkeypatch, capsys):
    work, _ = demo

    def broken_export(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(export_hf, "export_hf_model", broken_export)
    out = tmp_path / "run"
    assert (
        train.main(
            [
                "--data",
                str(work / "corpus" / "demo"),
                "--out",
                str(out),
                "--batch-size",
                "2",
                "--target-tokens",
                str(4 * 2 * 128),
                "--threads",
                "1",
                "--warmup-steps",
                "1",
            ]
        )
        == 0
    )
    record = status(out)
    assert record["status"] == "COMPLETE" and "model_files" not in record
    assert record["report_errors"]["export"] == "OSError: disk full"
    assert "task_accuracy" in record and (out / "loss_curve.png").is_file()
    assert not (out / "model").exists()
    assert record["outputs"] == {"report": "failed", "model": "failed"}
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert f" | model/ not made (export: report_errors in {out / 'run_status.json'}) | make it again with: " in last
    assert last.endswith(record["report_command"]) and record["report_command"].endswith("--resume auto")


LONGER_STEPS = 120  # measured: 0.60 on the items below (40 steps: 0.20 on 100 of them, chance)


@pytest.mark.slow
@pytest.mark.timeout(900)  # a second, longer training run and two lm-eval runs (~9 min on a 2-core machine at load 9)
def test_a_multiple_choice_task_on_the_demo_is_above_chance_trained_and_at_chance_untrained(demo, tmp_path):
    work, _ = demo
    run_cli(
        ["--target-tokens", str(LONGER_STEPS * 32 * 128), "--eval-every", "0", "--no-report", "--out", "runs/longer"],
        cwd=work,
    )
    tokenizer = corpus_format.load_tokenizer(work / "corpus" / "demo" / "tokenizer")
    items = evaluation.demo_choice_items(tokenizer)
    assert len(items) == sum(demo_corpus.DEMO_EVAL_COUNTS.values())
    task = tmp_path / "demo_results.jsonl"
    task.write_text("".join(json.dumps(item) + "\n" for item in items))
    trained = checkpoint_model(work / "runs" / "longer" / "checkpoints" / f"step-{LONGER_STEPS:08d}.pt")
    torch.manual_seed(0)
    untrained = model_config.build_model(model_config.PRESETS["tiny"], len(tokenizer)).eval()
    scores = {}
    for name, model in (("trained", trained), ("untrained", untrained)):
        export_hf.export_hf_model(model, tokenizer, tmp_path / name / "model", {"status": "COMPLETE"})
        assert (
            report.main(
                [
                    "evaluate",
                    str(tmp_path / name / "model"),
                    "--tasks",
                    str(task),
                    "--limit",
                    "130",
                    "--json",
                    str(tmp_path / f"{name}.json"),
                ]
            )
            == 0
        )
        scores[name] = json.loads((tmp_path / f"{name}.json").read_text())["tasks"]["local_demo_results"]
        assert scores[name]["n"] == 130  # a seeded half of the items: the suite's time
    # chance is 0.25, with a 0.027 standard error on 260 items; the untrained model (measured: 0.165) leans
    # below it, towards results of fewer tokens (every token about equally unlikely)
    assert scores["trained"]["acc"] > 0.45, scores
    assert 0.1 < scores["untrained"]["acc"] < 0.35, scores
