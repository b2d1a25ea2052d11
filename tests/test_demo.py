"""The demo end to end through the real CLI: `python train.py` in an empty folder, shortened by flags.

One shortened demo (the corpus is built by train.py itself, 40 steps) feeds most tests: the
run status, the held-out accuracy, the pictures and samples, the Hugging Face export loaded
back with transformers, --export-only, and the message of a resumable stop.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import data
import model_config
import report
import train
from common import sha256_file

ROOT = Path(__file__).resolve().parent.parent
STEPS = 40
SHORT = ["--target-tokens", str(STEPS * 32 * 128), "--eval-every", "20", "--save-every", "20", "--log-every", "10"]


def run_cli(args: list[str], cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    result = subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=cwd, env=env, capture_output=True,
                            text=True, timeout=300)
    if check and result.returncode != 0:
        raise AssertionError(f"train.py exited {result.returncode}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """`python train.py` with the demo defaults, 40 steps, in an empty folder (it builds corpus/demo)."""
    work = tmp_path_factory.mktemp("demo")
    result = run_cli([*SHORT, "--tensorboard"], cwd=work)
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
    demo = train.parse_args([])
    assert demo.demo and demo.data == train.DEFAULT_DATA and demo.out == train.DEFAULT_OUT
    assert {key: getattr(demo, key) for key in train.DEMO_DEFAULTS} == train.DEMO_DEFAULTS
    assert train.parse_args(["--lr", "1e-3"]).lr == 1e-3  # a given option wins over the demo default
    assert train.parse_args(["--epochs", "2"]).target_tokens is None  # --epochs replaces the demo's length
    normal = train.parse_args(["--data", "somewhere", "--out", "runs/somewhere"])
    assert not normal.demo and normal.data == "somewhere"
    assert (normal.batch_size, normal.lr, normal.optimizer, normal.target_tokens) == (8, None, None, None)
    assert "demo" in train.build_parser().format_help()


def test_demo_completes_with_an_accuracy(demo):
    work, result = demo
    run = work / "runs" / "demo"
    assert (work / "corpus" / "demo" / "corpus_manifest.json").is_file()  # built by train.py itself
    record = status(run)
    assert record["status"] == "COMPLETE" and record["step"] == STEPS
    assert record["report_errors"] is None
    accuracy = record["task_accuracy"]
    problems = (work / "corpus" / "demo" / data.DEMO_EVAL_FILE).read_text().splitlines()
    assert accuracy["total"] == len(problems) and 0 <= accuracy["accuracy"] <= 1
    assert {name: task["total"] for name, task in accuracy["by_task"].items()} == data.DEMO_EVAL_COUNTS
    assert "held-out task accuracy:" in result.stdout
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith("COMPLETE: step 40/40 | test loss ") and "held-out accuracy" in last
    assert isinstance(record["test_loss"], float)
    card = (run / "model" / "README.md").read_text()
    assert "Held-out demo task accuracy" in card and "**COMPLETE**" in card


def test_the_demo_trains_with_the_default_recipe_and_a_clean_log(demo):
    """No recipe option given: the rules pick Muon, the width's AdamW lr and a warmup that fits 40 steps."""
    work, result = demo
    settings = json.loads((work / "runs" / "demo" / "training_settings.json").read_text())["training"]
    assert settings["recipe.optimizer"] == train.DEFAULT_OPTIMIZER
    assert settings["recipe.lr"] == train.adamw_lr_for_width(model_config.PRESETS["tiny"].hidden,
                                                                train.DEFAULT_OPTIMIZER)
    assert settings["recipe.warmup_steps"] == train.default_warmup_steps(train.DEFAULT_OPTIMIZER, STEPS) < STEPS // 2
    assert "recipe: " in result.stdout and "chosen by the rules" in result.stdout
    assert "warning:" not in result.stderr
    assert "Writing model shards" not in result.stderr and "Loading weights" not in result.stderr


def test_demo_leaves_pictures_samples_and_hashed_model_files(demo):
    work, _ = demo
    run = work / "runs" / "demo"
    assert (run / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    samples = json.loads((run / "sample_generations.json").read_text())
    assert samples["error"] is None and samples["step"] == STEPS
    assert [s["prompt"] for s in samples["samples"]] == report.DEFAULT_PROMPTS
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
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
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is 12 plus 7?"}],
                                         add_generation_prompt=True, tokenize=False)
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
    assert "CHECKPOINTED_NEEDS_RESUME" in card and "step" in card.lower()
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
    expected = f"{train.python_command()} {ROOT / 'train.py'} " + " ".join(SHORT) + " --out runs/stopped --resume auto"
    assert record["resume_command"] == expected
    assert result.stdout.strip().splitlines()[-1] == \
        f"CHECKPOINTED_NEEDS_RESUME: step 10/{STEPS} | stopped by --stop-after-steps 10 | continue with: {expected}"
    assert "CHECKPOINTED_NEEDS_RESUME" in (run / "model" / "README.md").read_text()
    assert not (run / "sample_generations.json").exists()  # samples and accuracy only for a finished run


def test_a_failing_report_never_loses_the_run(demo, tmp_path, monkeypatch):
    work, _ = demo

    def broken_export(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(report, "export_hf_model", broken_export)
    out = tmp_path / "run"
    assert train.main(["--data", str(work / "corpus" / "demo"), "--out", str(out), "--batch-size", "2",
                       "--target-tokens", str(4 * 2 * 128), "--threads", "1",
                       "--warmup-steps", "1"]) == 0
    record = status(out)
    assert record["status"] == "COMPLETE" and "model_files" not in record
    assert record["report_errors"]["export"] == "OSError: disk full"
    assert "task_accuracy" in record and (out / "loss_curve.png").is_file()
    assert not (out / "model").exists()
