"""train.py: data order, checkpoint machinery and bit-exact resume (CPU, fp32, the tiny preset).

The corpus is written here in the DESIGN.md format (shards + corpus_manifest.json + tokenizer),
so these tests do not depend on data.py's builder.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from cards import this_cpu, this_cpu_precision
from tiny_runs import (
    ROOT,
    USER_PRECISIONS,
    assert_same_state,
    final_state,
    options,
    run_cli,
    train_losses,
    write_tiny_corpus,
)

from tinyllm import common
from tinyllm.common import UserError, sha256_file
from tinyllm.data import build as data
from tinyllm.data import corpus_format, demo_corpus
from tinyllm.model import attention, hardware, losses
from tinyllm.model import config as model_config
from tinyllm.outputs import artifacts, callbacks, metrics_log, report
from tinyllm.store import checkpoint_store as store
from tinyllm.training import distributed, optimization, train, train_data


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_tiny_corpus(tmp_path_factory.mktemp("corpus"))


def relative_difference(a: dict, b: dict) -> float:
    """||a - b|| / ||a|| over all the tensors of two state dicts (float64)."""
    difference = sum((a[name].double() - b[name].double()).square().sum() for name in a)
    return math.sqrt(difference / sum(a[name].double().square().sum() for name in a))


def status(out: Path) -> dict:
    return json.loads((out / "run_status.json").read_text())


# ----------------------------------------------------------------------------------------------
# Units: data order, checkpoint files (the schedule: tests/test_optimization.py)


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 100, 1000, 4097])
def test_block_permutation_is_a_bijection(n):
    perm = train_data.BlockPermutation(n, seed=5, epoch=0)
    assert sorted(perm(i) for i in range(n)) == list(range(n))


def test_block_permutation_depends_on_seed_and_epoch_and_is_not_affine():
    n = 1000
    orders = [
        [train_data.BlockPermutation(n, seed, epoch)(i) for i in range(n)] for seed, epoch in [(1, 0), (1, 1), (2, 0)]
    ]
    assert orders[0] != orders[1] and orders[0] != orders[2]
    assert orders[0] == [train_data.BlockPermutation(n, 1, 0)(i) for i in range(n)]  # stateless: same again
    steps = {(orders[0][i + 1] - orders[0][i]) % n for i in range(n - 1)}
    assert len(steps) > n // 4  # an affine map a*i+b has one constant step


def test_sampler_same_samples_per_step_whatever_the_split():
    """Global batch 8 as world 2 x accum 2 x batch 2, world 1 x accum 4 x batch 2, world 4 x accum 1 x batch 2."""
    layouts = [(2, 2, 2), (1, 4, 2), (4, 1, 2), (1, 1, 8)]
    for step in (0, 1, 37, 250):  # 250 crosses into another epoch
        seen = []
        for world, accum, batch in layouts:
            sampler = train_data.BlockSampler(blocks=60, seed=3, batch_size=batch, grad_accum=accum, world=world)
            samples = [block for rank in range(world) for micro in sampler.micro_batches(step, rank) for block in micro]
            assert len(samples) == 8
            seen.append(sorted(samples))
            assert sorted(samples) == sorted(sampler.step_blocks(step))
        assert all(s == seen[0] for s in seen)


def test_sampler_visits_every_block_once_per_epoch_and_seeks_in_o1():
    sampler = train_data.BlockSampler(blocks=40, seed=9, batch_size=2, grad_accum=2, world=2)  # 5 steps per epoch
    epoch0 = [block for step in range(5) for block in sampler.step_blocks(step)]
    epoch1 = [block for step in range(5, 10) for block in sampler.step_blocks(step)]
    assert sorted(epoch0) == sorted(epoch1) == list(range(40)) and epoch0 != epoch1
    far = train_data.BlockSampler(blocks=10**9, seed=9, batch_size=2, grad_accum=2, world=2)
    # no state to replay: a step far away is computed from its index alone, the same from any sampler
    assert far.step_blocks(10**8) == train_data.BlockSampler(
        blocks=10**9, seed=9, batch_size=8, grad_accum=1, world=1
    ).step_blocks(10**8)


def in_process_training(corpus: Path, out: Path, *extra: str) -> train.Training:
    settings = train.parse_args(options(corpus, out, *extra))
    return train.build_training(
        settings, distributed.DistInfo(rank=0, local_rank=0, world=1, device=torch.device("cpu"))
    )


def test_a_compile_failure_at_start_falls_back_to_eager_with_one_warning(corpus, tmp_path, monkeypatch, capsys):
    """Triton has failed on sm_75 cards before: the run goes on eagerly, saying so once, instead of dying."""
    calls = []

    class Broken(torch.nn.Module):
        def __init__(self, module, options=None):
            super().__init__()
            self.module = module

        def forward(self, *args, **kwargs):
            calls.append(len(args))
            raise RuntimeError("backend='inductor' raised:\nTritonMissing: no Triton for sm_75")

    monkeypatch.setattr(torch, "compile", Broken)
    training = in_process_training(corpus, tmp_path, "--compile")
    assert calls == [4] and training.compile is False and training.compile_seconds is None
    assert not isinstance(training.forward_model, Broken)
    warning = [line for line in capsys.readouterr().err.splitlines() if "torch.compile failed" in line]
    assert len(warning) == 1 and "TritonMissing" not in warning[0] and "--no-compile" in warning[0]
    assert all(parameter.grad is None for parameter in training.model.parameters())  # the probe left nothing
    assert math.isfinite(training.train_step().loss)
    train.describe_run(training)  # the start lines say that it went eager, and why
    assert (
        "  torch.compile: fell back to eager at start (RuntimeError: backend='inductor' raised:)"
        in capsys.readouterr().out
    )


def test_the_t4_document_path_compiles_at_start(corpus, tmp_path, monkeypatch, capsys):
    """The T4's document kernel (the memory-efficient varlen custom op, its CPU kernel here) under --compile
    --packing masked: compiled at start with a document boundary, no fallback to eager, and it trains."""
    plan = attention.AttentionPlan(
        "efficient varlen", "cpu flash", attention.EFFICIENT, (), "the T4's document kernel, on CPU"
    )
    monkeypatch.setattr(attention, "attention_plans", lambda *args: [plan])
    training = in_process_training(corpus, tmp_path, "--compile", "--packing", "masked")
    assert training.model.config._attn_implementation == attention.EFFICIENT and training.data.documents
    assert training.compile and training.compile_seconds is not None and training.compile_fallback is None
    assert "torch.compile failed" not in capsys.readouterr().err
    assert math.isfinite(training.train_step().loss)


def test_compile_at_start_keeps_the_first_step(corpus, tmp_path):
    """The start-up compile (a probe forward and backward) leaves the run as it was: step 1 the eager one's."""
    eager = in_process_training(corpus, tmp_path / "eager", "--no-compile")
    compiled = in_process_training(corpus, tmp_path / "compiled", "--compile")
    assert eager.compile_seconds is None and compiled.compile and compiled.compile_seconds > 0
    assert compiled.train_step().loss == pytest.approx(eager.train_step().loss, rel=1e-5)


def test_a_step_is_the_same_whatever_the_batch_is_split_into(corpus, tmp_path):
    """Batch 4 x accumulation 1 and batch 1 x accumulation 4 read the same 4 blocks: the same loss and gradient
    norm. The loss is the mean over the step's blocks, computed here by hand from the model before the step."""
    whole = in_process_training(corpus, tmp_path / "a", "--batch-size", "4", "--grad-accum", "1", "--packing", "stream")
    split = in_process_training(corpus, tmp_path / "b", "--batch-size", "1", "--grad-accum", "4", "--packing", "stream")
    assert store.tensor_differences(whole.model.state_dict(), split.model.state_dict(), "model") == []
    blocks = whole.data.sampler.step_blocks(0)
    assert blocks == split.data.sampler.step_blocks(0) and len(blocks) == 4
    with torch.no_grad():
        inputs, targets, _ = whole.data.splits["train"].batch(blocks, torch.device("cpu"))
        logits = whole.model(input_ids=inputs).logits
        expected = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
    first, second = whole.train_step(), split.train_step()
    assert first.loss == pytest.approx(expected.item(), rel=1e-5)
    assert second.loss == pytest.approx(expected.item(), rel=1e-5)
    # the gradient too is the mean's: not the sum over micro-steps, nor divided by the batch size
    assert second.grad_norm == pytest.approx(first.grad_norm, rel=1e-4)


def test_resume_restores_the_random_number_generators(corpus, tmp_path):
    """After loading a checkpoint, Python's, NumPy's and torch's generators continue where the saved run was."""
    first = in_process_training(corpus, tmp_path / "a")
    first.train_step()
    random.seed(11), np.random.seed(11), torch.manual_seed(11)
    path = tmp_path / "step.pt"
    torch.save(first.snapshot(), path)
    expected = (random.random(), float(np.random.random()), torch.rand(3))
    second = in_process_training(corpus, tmp_path / "b")
    random.seed(99), np.random.seed(99), torch.manual_seed(99)  # what a fresh process would have drawn
    second.load(store.load_checkpoint_file(path), path)
    assert second.step == 1
    got = (random.random(), float(np.random.random()), torch.rand(3))
    assert got[:2] == expected[:2] and torch.equal(got[2], expected[2])


def test_token_split_blocks_cross_shard_boundaries(corpus):
    manifest = corpus_format.load_manifest(corpus)
    split = train_data.TokenSplit(corpus, manifest, "train", context=32)
    files = manifest.splits["train"]["files"]
    stream = np.concatenate([np.fromfile(corpus / f["name"], dtype="<u2") for f in files])
    assert len(manifest.splits["train"]["files"]) > 1 and split.blocks == (len(stream) - 1) // 32
    for index in (0, 1, 4000 // 32, split.blocks - 1):  # 4000 // 32 spans the first shard boundary
        assert np.array_equal(split.block(index), stream[index * 32 : index * 32 + 33].astype(np.int64))
    inputs, targets, documents = split.batch([0, 5], torch.device("cpu"))
    assert inputs.shape == targets.shape == (2, 32) and torch.equal(inputs[:, 1:], targets[:, :-1])
    assert documents is None  # "stream": attention across documents


def test_corpus_check_names_the_changed_file(corpus, tmp_path, flip_byte):
    assert corpus_format.verify_corpus(corpus) == []
    broken = tmp_path / "broken"
    broken.mkdir()
    for item in corpus.iterdir():
        if item.is_file():
            (broken / item.name).write_bytes(item.read_bytes())
    (broken / "tokenizer").symlink_to(corpus / "tokenizer")
    shard = broken / "train-00001.bin"
    flip_byte(shard, 10)
    problems = corpus_format.verify_corpus(broken)
    assert len(problems) == 1 and "train-00001.bin" in problems[0]
    result = run_cli(options(broken, tmp_path / "run"), check=False)
    assert result.returncode == 2 and "train-00001.bin" in result.stderr


def test_checkpointer_retention_and_backup_seam(tmp_path):
    class Backup:
        def __init__(self):
            self.submitted, self.confirmed = [], set()

        def submit(self, path, step):
            self.submitted.append(step)

        def deletable(self, candidates):
            return [path for path in candidates if Path(path).name in self.confirmed]

        def wait(self, timeout_s):
            return True

    folder = tmp_path / "checkpoints"
    folder.mkdir()
    foreign = folder / "step-00000001.pt"
    foreign.write_bytes(b"not ours")  # no record of this run writing it: never deleted
    backup = Backup()
    saver = store.Checkpointer(folder, run_id="r1", keep_last=2, keep_every=4, backup=backup)
    for step in range(2, 9):
        if step == 7:
            backup.confirmed = {store.checkpoint_name(s) for s in range(2, 6)}
        saver.save(
            {"format_version": 1, "step": step, "x": torch.full((3,), step)},
            step,
            val_loss=1.0 / step if step == 5 else None,
        )
    saver.close()
    names = sorted(p.name for p in folder.glob("step-*.pt"))
    # kept: foreign 1; 4 and 8 (keep-every); 5 (the best); 7, 8 (keep-last); 6 (not yet backed up when 7, 8 were saved)
    assert names == [store.checkpoint_name(s) for s in (1, 4, 5, 6, 7, 8)]
    assert backup.submitted == list(range(2, 9))
    latest = json.loads((folder / "latest.json").read_text())
    assert latest == json.loads((folder / "step-00000008.pt.json").read_text())
    assert {key: latest[key] for key in ("path", "step", "sha256", "bytes", "run_id")} == {
        "path": "step-00000008.pt",
        "step": 8,
        "sha256": sha256_file(folder / latest["path"]),
        "bytes": (folder / latest["path"]).stat().st_size,
        "run_id": "r1",
    }
    assert json.loads((folder / "step-00000005.pt.json").read_text())["val_loss"] == 0.2
    assert store.list_folder(folder).best().step == 5


def test_retention_asks_a_backup_with_deletable(tmp_path):
    class Backup:
        def submit(self, path, step):
            pass

        def deletable(self, candidates):
            return [path for path in candidates if path.name != "step-00000002.pt"]

    saver = store.Checkpointer(tmp_path, run_id="r", keep_last=1, keep_every=0, backup=Backup())
    for step in range(1, 5):
        saver.save({"step": step}, step)
    saver.wait()
    assert sorted(p.name for p in tmp_path.glob("step-*.pt")) == ["step-00000002.pt", "step-00000004.pt"]


def test_resume_auto_falls_back_past_a_corrupt_newest(tmp_path, flip_byte):
    folder = tmp_path / "checkpoints"
    saver = store.Checkpointer(folder, run_id="r", keep_last=5, keep_every=0)
    for step in (1, 2, 3):
        saver.save({"step": step}, step)
    saver.close()
    assert store.find_resume_checkpoint(tmp_path, "auto").name == "step-00000003.pt"
    newest = folder / "step-00000003.pt"
    newest.write_bytes(newest.read_bytes()[:-7])
    second = folder / "step-00000002.pt"
    flip_byte(second, 40, 0xFF)
    assert store.find_resume_checkpoint(tmp_path, "auto").name == "step-00000001.pt"
    with pytest.raises(UserError, match="already has checkpoints"):
        store.find_resume_checkpoint(tmp_path, "none")
    for path in folder.glob("step-*.pt"):
        path.write_bytes(b"broken")
    with pytest.raises(UserError, match="none verifies"):
        store.find_resume_checkpoint(tmp_path, "auto")


def test_settings_changes_list_each_change():
    old = {"lr": 0.001, "seed": 1, "total_steps": 10}
    new = {"lr": 0.002, "seed": 1, "total_steps": 12}
    assert store.settings_changes(old, new) == {"lr": (0.001, 0.002), "total_steps": (10, 12)}


def test_resume_command_drops_stop_and_resume_options():
    info = distributed.DistInfo(rank=0, local_rank=0, world=2, device=torch.device("cpu"))
    command = train.resume_command(info, ["--data", "c d", "--stop-after-steps", "5", "--resume=none", "--lr", "1"])
    assert command == "torchrun --nproc_per_node=2 train.py --data 'c d' --lr 1 --resume auto"
    for given in (["--resume", "--lr", "1"], ["--lr", "1", "--resume"], ["--resume", "x.pt", "--lr", "1"]):
        assert train.resume_command(info, given) == "torchrun --nproc_per_node=2 train.py --lr 1 --resume auto"


def test_resume_command_names_the_script_as_run_from_here_the_interpreter_and_the_nodes(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    script = str(ROOT / "train.py")  # outside the current folder: its absolute path
    single = distributed.DistInfo(rank=0, local_rank=0, world=1, device=torch.device("cpu"))
    monkeypatch.setattr(distributed.shutil, "which", lambda name: sys.executable)
    assert train.resume_command(single, ["--lr", "1"]) == f"python {script} --lr 1 --resume auto"
    monkeypatch.setattr(distributed.shutil, "which", lambda name: "/usr/bin/python-without-torch")
    assert train.resume_command(single, []) == f"{sys.executable} {script} --resume auto"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # 2 nodes x 2 processes
    four = distributed.DistInfo(rank=0, local_rank=0, world=4, device=torch.device("cpu"))
    assert (
        train.resume_command(four, [])
        == f"torchrun --nnodes=2 (with your rendezvous options) --nproc_per_node=2 {script} --resume auto"
    )


# sys.argv[0] -> the console script a command is printed as (None: python SCRIPT)
@pytest.mark.parametrize(
    "argv0, shown",
    [
        ("/venv/bin/tinyllm-train", "tinyllm-train"),  # started through pyproject.toml's [project.scripts]
        ("tinyllm-train", "tinyllm-train"),
        ("train.py", None),
        ("/work/tinyllm/train.py", None),
        ("/venv/bin/tinyllm-data", None),  # another script's command
        ("", None),  # python -c
    ],
)
def test_console_script_is_read_off_argv0(argv0, shown):
    assert common.console_script("train", argv0) == shown


def test_the_resume_command_is_tinyllm_train_when_started_so(monkeypatch):
    single = distributed.DistInfo(rank=0, local_rank=0, world=1, device=torch.device("cpu"))
    monkeypatch.setattr(sys, "argv", ["/venv/bin/tinyllm-train", "--lr", "1"])
    assert train.resume_command(single) == "tinyllm-train --lr 1 --resume auto"
    assert common.script_command("data") == "tinyllm-data"  # the commands it suggests too
    with pytest.raises(UserError, match="no such corpus folder; build one with: tinyllm-data --data YOUR_FILES"):
        train_data.check_corpus_folder(Path("no-such-corpus"))
    monkeypatch.setattr(sys, "argv", ["train.py"])
    assert common.script_command("data") == "python data.py"


def test_bad_options_give_one_clear_line(tmp_path):
    result = run_cli(["--batch-size", "0", "--out", str(tmp_path)], check=False)
    assert result.returncode == 2 and result.stderr.strip() == "error: --batch-size must be positive, got 0"
    result = run_cli(["--data", str(tmp_path / "nope"), "--out", str(tmp_path / "run")], check=False)
    assert result.returncode == 2 and "corpus folder" in result.stderr and "Traceback" not in result.stderr
    # a typo or a prefix of an option is one line too, never the usage text or a silent guess
    for typo, named in ((["--epohcs", "1"], "--epohcs"), (["--epoch", "1"], "--epoch")):
        result = run_cli([*typo, "--out", str(tmp_path / "run")], check=False)
        assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
        assert result.stderr.startswith("error: unrecognized arguments: ") and named in result.stderr
        assert "; did you mean --epochs? (see train.py --help)" in result.stderr  # the option it is closest to
    result = run_cli(["--zzz", "--out", str(tmp_path / "run")], check=False)
    assert result.stderr == "error: unrecognized arguments: --zzz (see train.py --help)\n"  # nothing close: no guess
    result = run_cli(["--data", str(tmp_path / "nope")], check=False)  # where would the run go?
    assert (
        result.returncode == 2
        and result.stderr.strip()
        == "error: --data needs --out RUN: the run folder for its checkpoints, metrics and status"
    )


@pytest.mark.parametrize(
    "bad, message",
    [
        (["--heads", "0"], "heads (--heads) must be positive, got 0"),
        (["--hidden", "0"], "hidden (--hidden) must be positive, got 0"),
        (["--rms-norm-eps", "-1"], "rms_norm_eps (--rms-norm-eps) must be positive, got -1.0"),
        (["--rope-theta", "nan"], "rope_theta (--rope-theta) must be positive, got nan"),
        (["--lr", "nan"], "--lr must be a finite number, got nan"),
        (["--lr", "inf"], "--lr must be a finite number, got inf"),
        (["--final-lr-fraction", "1.5"], "--final-lr-fraction must be in [0, 1], got 1.5"),
        (["--beta2", "1"], "--beta2 must be in [0, 1), got 1.0"),
        (["--muon-lr", "0"], "--muon-lr must be positive, got 0.0"),
        (["--optimizer", "adamw", "--muon-lr", "0.02"], "--muon-lr needs --optimizer muon"),
        (["--schedule", "cosine", "--decay-fraction", "0.2"], "--decay-fraction belongs to --schedule wsd"),
        (["--epochs", "inf"], "--epochs must be a positive finite number, got inf"),
        (["--target-tokens", "1.5x"], "argument --target-tokens: not a number: '1.5x'"),
        (["--target-tokens", "1.5"], "argument --target-tokens: not a whole number of tokens: '1.5'"),
    ],
)
def test_bad_model_and_schedule_values_are_one_line_errors(corpus, tmp_path, bad, message, capsys):
    with pytest.raises((UserError, SystemExit)) as error:
        train.main(["--data", str(corpus), "--out", str(tmp_path / "run"), *bad])
    text = str(error.value) if error.type is UserError else capsys.readouterr().err
    assert message in text and "Traceback" not in text
    assert not (tmp_path / "run").exists()


def test_token_counts_may_be_written_in_exponent_form(corpus, tmp_path):
    run = train.parse_args(["--data", str(corpus), "--out", str(tmp_path / "run"), "--target-tokens", "1.5e9"]).run
    assert run.target_tokens == 1_500_000_000 and isinstance(run.target_tokens, int)


def test_the_training_attentions_match_sdpa_with_gradients(monkeypatch):
    """Every attention train.py plans, on whole blocks (no documents): transformers' "sdpa" logits and
    gradients. The masked one (CPU) also takes a padding mask, as generation passes one."""
    from tinyllm.model import attention
    from tinyllm.model import config as model_config

    torch.manual_seed(0)
    model = model_config.build_model(model_config.PRESETS["tiny"], 300)
    inputs = torch.randint(0, 300, (2, 32))

    def logits_and_grads():
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=inputs).logits
        logits.square().mean().backward()
        return logits.detach(), [p.grad.clone() for p in model.parameters()]

    expected = logits_and_grads()
    for implementation in attention.ATTENTION_FUNCTIONS:
        attention.use_attention(model, implementation)
        assert model.config._attn_implementation == implementation
        got = logits_and_grads()
        assert torch.allclose(got[0], expected[0], atol=1e-6), implementation
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got[1], expected[1])), implementation
    mask = torch.ones_like(inputs)
    mask[1, :5] = 0  # left padding, as in batched generation
    model.set_attn_implementation("sdpa")
    padded_expected = model(input_ids=inputs, attention_mask=mask).logits
    attention.use_attention(model, attention.MASKED)
    padded = model(input_ids=inputs, attention_mask=mask).logits
    assert torch.allclose(padded[0], padded_expected[0], atol=1e-6)
    assert torch.allclose(padded[1, 5:], padded_expected[1, 5:], atol=1e-6)


def test_generation_runs_the_stock_attention_whatever_the_training_one():
    """The varlen attentions take no padding mask; generation switches to "sdpa" (attention.exportable)."""
    from tinyllm.model import attention
    from tinyllm.model import config as model_config

    model = model_config.build_model(model_config.PRESETS["tiny"], 300)
    attention.use_attention(model, attention.FLASH)
    seen = []
    with attention.exportable(model):
        seen.append(model.config._attn_implementation)
        with attention.exportable(model):  # nested: nothing changes, nothing is restored early
            seen.append(model.config._attn_implementation)
        seen.append(model.config._attn_implementation)
    assert seen == ["sdpa"] * 3 and model.config._attn_implementation == attention.FLASH


def test_length_options_and_hardware_refusals(corpus, tmp_path):
    info = distributed.DistInfo(rank=0, local_rank=0, world=1, device=torch.device("cpu"))
    blocks = train.build_training(train.parse_args(options(corpus, tmp_path)), info).data.train_blocks
    epoch_args = options(corpus, tmp_path)
    position = epoch_args.index("--target-tokens")
    del epoch_args[position : position + 2]
    by_epochs = train.build_training(train.parse_args([*epoch_args, "--epochs", "2"]), info)
    assert by_epochs.total_steps == -(-2 * blocks // 4)  # ceil(2 epochs x blocks / 4 blocks per step)
    for extra, message in [
        (["--8bit-adam"], "--8bit-adam needs --optimizer adamw"),
        (["--8bit-adam", "--optimizer", "adamw"], "needs a CUDA device"),
        (["--preset", "tiny", "--kv-heads", "3"], "multiple of kv_heads"),
    ]:
        with pytest.raises(UserError, match=message):
            train.main(options(corpus, tmp_path / "refused", *extra))
    for extra, message in [
        (["--require-gpus", "1"], "--require-gpus 1"),
        (["--require-gpu-name", "T4"], "--require-gpu-name T4"),
    ]:
        backup = tmp_path / "backup"
        with pytest.raises(UserError, match=message):  # before the run folder or the backup store is touched
            train.main(options(corpus, tmp_path / "gated", *extra, "--backup-to", str(backup)))
        assert not (tmp_path / "gated").exists() and not backup.exists()


def test_out_of_memory_while_building_is_one_line_naming_the_preset_and_the_card(corpus, tmp_path, monkeypatch):
    def no_room(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(model_config, "build_training_model", no_room)
    with pytest.raises(
        UserError,
        match=r"CUDA out of memory on .* while building --preset tiny \([\d,]+ parameters\) "
        r"and probing attention on one block of 32 tokens: .*smaller --preset",
    ):
        train.main(options(corpus, tmp_path / "run"))
    assert not (tmp_path / "run").exists()  # nothing left behind


def test_bf16_autocast_and_grad_checkpoint_train_on_cpu(corpus, tmp_path):
    out = tmp_path / "run"
    assert train.main(options(corpus, out, "--precision", "bf16", "--grad-checkpoint", steps=4)) == 0
    settings = json.loads((out / "training_settings.json").read_text())
    assert settings["runtime"]["precision"] == "bf16" and status(out)["status"] == "COMPLETE"
    assert settings["training"]["recipe.optimizer"] == "muon"  # Muon's Newton-Schulz under bf16 autocast
    losses = train_losses(out)
    assert all(np.isfinite(loss) for loss in losses.values()) and losses[4] < losses[1]


def test_save_seconds_0_is_off_and_a_stop_is_the_last_metrics_record(corpus, tmp_path, monkeypatch):
    out = tmp_path / "run"
    quiet = ["--save-every", "0", "--save-seconds", "0", "--log-every", "4", "--eval-every", "0"]
    handlers_when_running = []

    def write_status(folder, state, **fields):
        if state == store.RUNNING:  # a SIGTERM from now on must end in a checkpoint, not a dead RUNNING status
            handlers_when_running.append(type(getattr(signal.getsignal(signal.SIGTERM), "__self__", None)))
        real_write_status(folder, state, **fields)

    real_write_status = store.write_status
    monkeypatch.setattr(store, "write_status", write_status)
    assert train.main(options(corpus, out, *quiet, "--stop-after-steps", "6")) == 0
    assert handlers_when_running and set(handlers_when_running) == {train.StopRequest}
    checkpoints = sorted(path.name for path in (out / "checkpoints").glob("step-*.pt"))
    assert checkpoints == [store.checkpoint_name(6)]  # the stop's save only: 0 means never by time
    assert list(train_losses(out)) == [1, 4, 6]  # every --log-every step, and the step it stopped at
    record = status(out)
    assert record["status"] == store.NEEDS_RESUME and record["reason"] == "stopped by --stop-after-steps 6"
    files = [out / "run_status.json", out / "training_settings.json", out / "checkpoints" / checkpoints[0]]
    assert {oct(path.stat().st_mode & 0o777) for path in files} == {oct(common.PLAIN_FILE_MODE)}

    # a --stop-after-steps the run is already past: nothing trained, nothing written but the status
    assert train.main(options(corpus, out, *quiet, "--stop-after-steps", "3")) == 0
    record = status(out)
    assert record["status"] == store.NEEDS_RESUME and record["step"] == 6
    assert "already at step 6, at or past --stop-after-steps 3: no step taken" in record["reason"]
    assert sorted(path.name for path in (out / "checkpoints").glob("step-*.pt")) == checkpoints
    assert list(train_losses(out)) == [1, 4, 6]


def test_max_hours_stops_resumably_before_the_budget(corpus, tmp_path):
    out = tmp_path / "run"
    assert train.main(options(corpus, out, "--max-hours", "0.0025")) == 0  # 9 s: within the 10 s save margin
    record = status(out)
    assert record["status"] == "CHECKPOINTED_NEEDS_RESUME" and "--max-hours" in record["reason"]
    assert record["step"] == 1
    assert record["last_checkpoint"] == store.checkpoint_name(record["step"])


# ----------------------------------------------------------------------------------------------
# Exactness: interrupted runs end bit for bit where an uninterrupted run ends


@pytest.fixture(scope="module")
def sums_task(tmp_path_factory) -> Path:
    """A multiple-choice task on the tiny corpus' sentences: 'a plus b is' and the right sum among 3 wrong."""
    rng, lines = random.Random(7), []
    for _ in range(30):
        a, b = rng.randrange(100), rng.randrange(100)
        choices = [f"{a + b + offset}." for offset in (0, *rng.sample([-10, -1, 1, 10, 11], 3))]
        rng.shuffle(choices)
        lines.append(
            json.dumps({"context": f"{a} plus {b} is", "choices": choices, "answer": choices.index(f"{a + b}.")}) + "\n"
        )
    path = tmp_path_factory.mktemp("tasks") / "sums.jsonl"
    path.write_text("".join(lines))
    return path


def task_records(out: Path) -> list[dict]:
    return [record for record in metrics_log.read_metrics(out / "metrics.jsonl") if record["kind"] == "tasks"]


@pytest.fixture(scope="module")
def references(corpus, tmp_path_factory):
    """references(precision): 12 uninterrupted steps at world size 1 in `precision`, run in-process once."""
    made = {}

    def reference_in(precision: str) -> Path:
        if precision not in made:
            made[precision] = tmp_path_factory.mktemp(f"reference-{precision}")
            assert train.main(options(corpus, made[precision], "--precision", precision)) == 0
        return made[precision]

    return reference_in


@pytest.fixture(scope="module")
def reference(references) -> Path:
    """12 uninterrupted steps at world size 1 in fp32, run in-process."""
    return references("fp32")


def test_uninterrupted_run_writes_the_run_folder(reference):
    assert status(reference)["status"] == "COMPLETE"
    assert sorted(p.name for p in reference.iterdir()) == [  # .lock: the pid of the last train.py to run here
        ".lock",
        "checkpoints",
        "config.toml",
        "hardware.json",
        "metrics.jsonl",
        "run_status.json",
        "training_settings.json",
    ]
    records = [json.loads(line) for line in (reference / "metrics.jsonl").read_text().splitlines()]
    train_keys = {
        "kind",
        "step",
        "tokens",
        "loss",
        "adamw_lr",
        "muon_lr",
        "head_lr",
        "grad_norm",
        "step_seconds",
        "tokens_per_second",
        "mfu",
        "peak_memory_bytes",
        "time",
    }  # head_lr: tiny's LM head is its own
    assert [r["step"] for r in records if r["kind"] == "train"] == list(range(1, 13))
    assert all(set(r) == train_keys for r in records if r["kind"] == "train")
    assert [r["step"] for r in records if r["kind"] == "eval"] == [4, 8, 12]
    assert all(
        set(r)
        == {
            "kind",
            "step",
            "tokens",
            "val_loss",
            "val_perplexity",
            "val_tokens",
            "val_bits_per_byte",
            "val_bytes",
            "time",
        }
        for r in records
        if r["kind"] == "eval"
    )
    assert all(r["val_bits_per_byte"] > 0 and r["val_bytes"] > r["val_tokens"] for r in records if r["kind"] == "eval")
    assert {r["val_tokens"] for r in records if r["kind"] == "eval"} == {2 * 4 * 32}  # 2 global batches of 4 x 32
    tests = [r for r in records if r["kind"] == "test"]
    assert len(tests) == 1 and set(tests[0]) == {
        "kind",
        "step",
        "tokens",
        "test_loss",
        "test_perplexity",
        "test_bits_per_byte",
        "test_bytes",
        "time",
    }
    test = status(reference)["test"]
    assert test["bits_per_byte"] == tests[0]["test_bits_per_byte"]
    assert test["bits_per_byte"] == pytest.approx(test["loss"] * test["tokens"] / math.log(2) / test["bytes"])
    assert f"{test['bits_per_byte']:.4f} bits/byte" in report.final_line(reference, "COMPLETE", status(reference))
    losses = train_losses(reference)
    assert losses[12] < losses[1]  # it learns
    state = final_state(reference)
    assert state["step"] == 12 and {"format_version", "model", "optimizer", "settings", "rng"} <= set(state)


def test_stop_then_resume_is_bitwise_identical(corpus, reference, tmp_path):
    out = tmp_path / "run"
    assert train.main(options(corpus, out, "--stop-after-steps", "5")) == 0
    assert status(out)["status"] == "CHECKPOINTED_NEEDS_RESUME" and status(out)["step"] == 5
    result = run_cli(options(corpus, out, "--resume", "auto"))  # a new process
    assert "resumed from" in result.stdout and "step 5/12" in result.stdout
    assert (
        "recipe: muon: Muon lr 0.02 (hidden matrices, momentum 0.9), AdamW lr 0.003 (embeddings, norms; 0.0141 "
        "the untied LM head); 3 warmup steps"
    ) in result.stdout
    assert_same_state(final_state(out), final_state(reference))
    assert train_losses(out) == train_losses(reference)  # the metrics log continues without duplicates


def test_a_checkpoint_recorded_before_a_recipe_knob_existed_resumes_bit_for_bit(
    corpus, reference, tmp_path, monkeypatch
):
    """A knob added since a checkpoint was written (as if --8bit-adam had just become one) reads at its default
    (optimization.with_recorded_defaults): the resume is the uninterrupted run, not a refusal."""
    out, recorded = tmp_path / "run", train.recorded_settings

    def before_the_knob(training):
        settings = recorded(training)
        settings["training"] = {
            key: value for key, value in settings["training"].items() if key not in ("adam8bit", "recipe.adam8bit")
        }
        return settings

    monkeypatch.setattr(train, "recorded_settings", before_the_knob)
    assert train.main(options(corpus, out, "--stop-after-steps", "5")) == 0
    assert "recipe.adam8bit" not in final_state(out)["settings"]["training"]
    monkeypatch.undo()
    with pytest.raises(UserError, match=r"settings differ from checkpoint .*: grad_clip: 1\.0 -> 0\.5\. A resume"):
        train.main(options(corpus, out, "--grad-clip", "0.5"))  # a changed value still refuses
    assert train.main(options(corpus, out)) == 0
    assert_same_state(final_state(out), final_state(reference))


def test_a_checkpoint_whose_default_changed_since_says_how_to_keep_it(corpus, tmp_path):
    """A run that recorded --beta1 0.9 (as every run did before the default under Muon became 0.6), resumed
    without it: refused, and the message gives the option that resumes it as it was; with it, it resumes."""
    out = tmp_path / "run"
    assert train.main(options(corpus, out, "--beta1", "0.9", "--stop-after-steps", "5")) == 0
    with pytest.raises(UserError, match=r"beta1: 0\.9 -> null.*values, add --beta1 0\.9; for a new run"):
        train.main(options(corpus, out))
    assert train.main(options(corpus, out, "--beta1", "0.9")) == 0


def test_a_checkpoint_whose_preset_changed_since_says_which_shape_options_keep_it(corpus, tmp_path, monkeypatch):
    """A run of a preset whose heads changed since (as nano's did: 4 of 32 -> 2 of 64), resumed without shape
    options: refused, naming the options that give the checkpoint's shape; with them, it resumes."""
    out = tmp_path / "run"
    assert train.main(options(corpus, out, "--stop-after-steps", "5")) == 0
    tiny = model_config.PRESETS["tiny"]
    monkeypatch.setitem(model_config.PRESETS, "tiny", dataclasses.replace(tiny, heads=2, head_dim=32))
    with pytest.raises(UserError, match=r"values, add --head-dim 16 --heads 4; for a new run"):
        train.main(options(corpus, out))
    assert train.main(options(corpus, out, "--heads", "4", "--head-dim", "16")) == 0


def test_eval_tasks_change_no_step_and_a_resume_keeps_their_curve(corpus, reference, sums_task, tmp_path):
    """--eval-tasks on, stopped and resumed, ends bit for bit where the run without them ends; the scores
    are in metrics.jsonl and the checkpoints, which give back the records metrics.jsonl lost."""
    out = tmp_path / "run"
    tasks = ("--eval-tasks", str(sums_task), "--eval-tasks-every", "4")
    assert train.main(options(corpus, out, *tasks, "--stop-after-steps", "5")) == 0
    assert [record["step"] for record in task_records(out)] == [4]
    lines = (out / "metrics.jsonl").read_text().splitlines(keepends=True)
    (out / "metrics.jsonl").write_text("".join(line for line in lines if '"tasks"' not in line))  # lost
    assert train.main(options(corpus, out, *tasks, "--eval-tasks-limit", "20")) == 0
    assert_same_state(final_state(out), final_state(reference))
    assert train_losses(out) == train_losses(reference)
    records = task_records(out)
    assert [(record["step"], record["local_sums/n"]) for record in records] == [(4, 30), (8, 20), (12, 20)]
    assert all(0 <= record["local_sums/acc"] <= 1 and record["local_sums/chance"] == 0.25 for record in records)
    history = final_state(out)["callbacks"]["tasks"]["history"]
    assert [entry["step"] for entry in history] == [4, 8, 12] and history[-1]["local_sums/acc"] == records[-1][
        "local_sums/acc"
    ]
    assert f"local_sums acc {records[-1]['local_sums/acc']:.3f} (chance 0.250)" in report.final_line(
        out, "COMPLETE", status(out)
    )


def test_the_config_a_run_writes_starts_the_same_run_again(corpus, reference, tmp_path):
    """RUN/config.toml holds every option of the run: `--config` with it (and only a new --out) trains
    the same steps bit for bit."""
    config = (reference / "config.toml").read_text()
    assert 'preset = "tiny"' in config and "context = 32" in config and "resume" not in config
    out = tmp_path / "again"
    assert train.main(["--config", str(reference / "config.toml"), "--out", str(out)]) == 0
    assert_same_state(final_state(out), final_state(reference))
    assert train_losses(out) == train_losses(reference)


def test_truncated_newest_checkpoint_falls_back_and_still_matches(corpus, reference, tmp_path, capsys):
    out = tmp_path / "run"
    assert train.main(options(corpus, out, "--stop-after-steps", "9")) == 0  # saves at 4, 8 and 9
    newest = out / "checkpoints" / "step-00000009.pt"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    capsys.readouterr()
    assert train.main(options(corpus, out, "--resume", "auto")) == 0
    assert "falling back to step-00000008.pt" in capsys.readouterr().err
    assert_same_state(final_state(out), final_state(reference))


def start_cli(args: list[str]) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.Popen(
        [sys.executable, "train.py", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for_line(process: subprocess.Popen, prefix: str) -> None:
    for line in process.stdout:
        if " ".join(line.split()).startswith(prefix):  # progress lines pad the step: "step  3/12"
            return
    raise AssertionError(f"train.py ended before printing {prefix!r}: {process.stderr.read()[-2000:]}")


@pytest.mark.parametrize("precision", USER_PRECISIONS)
def test_kill_9_mid_save_and_at_a_random_moment_then_resume_matches(corpus, references, tmp_path, precision):
    out = tmp_path / "run"
    folder = out / "checkpoints"
    args = options(corpus, out, "--save-every", "2", "--resume", "auto", "--precision", precision)
    process = start_cli(args)  # 1: killed while the checkpoint of step 4 or later is being written
    caught = None
    while process.poll() is None and caught is None:
        names = os.listdir(folder) if folder.is_dir() else []
        caught = next(
            (name for name in names if name.startswith(".step-") and name.endswith(".tmp") and int(name[6:14]) >= 4),
            None,
        )
    process.kill()
    process.wait()
    assert caught, "no checkpoint write was caught in flight"
    assert status(out)["status"] == "RUNNING" and status(out)["resume_command"].endswith("--resume auto")
    process = start_cli(args)  # 2: resumes, says that the first died, then is killed at a random moment
    wait_for_line(process, "resumed from")
    note = process.stdout.readline()
    assert note.startswith("note: the previous session died without a word after step "), note
    died, resumed = (int(note.split(marker)[1].split()[0].strip(";,")) for marker in ("after step", "from step"))
    assert died >= resumed >= 2 and note.rstrip().endswith(f"steps done again: {died - resumed} or more")
    time.sleep(random.Random().uniform(0.0, 0.5))
    process.kill()
    process.wait()
    command = shlex.split(status(out)["resume_command"])  # what a user reads after the crash, run as it says
    assert os.path.realpath(shutil.which(command[0]) or command[0]) == os.path.realpath(sys.executable)
    assert command[1] == "train.py" and command[-2:] == ["--resume", "auto"]
    assert train.main(command[2:]) == 0  # 3: finishes
    assert status(out)["status"] == "COMPLETE"
    assert not [name for name in os.listdir(folder) if name.endswith(".tmp")]
    assert_same_state(final_state(out), final_state(references(precision)))


@pytest.mark.parametrize("precision", USER_PRECISIONS)
def test_sigterm_saves_and_exits_0_then_resume_matches(corpus, references, tmp_path, precision):
    out = tmp_path / "run"
    process = start_cli(options(corpus, out, "--save-every", "100", "--precision", precision))
    wait_for_line(process, "step 3/")
    process.send_signal(signal.SIGTERM)
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 0, stderr
    assert "SIGTERM" in stderr and "CHECKPOINTED_NEEDS_RESUME" in stdout.splitlines()[-1]
    record = status(out)
    assert record["status"] == "CHECKPOINTED_NEEDS_RESUME" and "SIGTERM" in record["reason"]
    assert 3 <= record["step"] < 12 and record["last_checkpoint"] == store.checkpoint_name(record["step"])
    assert record["resume_command"].endswith("--resume auto")
    assert train.main(options(corpus, out, "--save-every", "100", "--resume", "auto", "--precision", precision)) == 0
    assert_same_state(final_state(out), final_state(references(precision)))


def test_every_parameter_gets_a_gradient_so_zeroing_in_place_is_bitwise_the_same(
    corpus, reference, tmp_path, monkeypatch
):
    """Under DDP the gradients are zeroed in place (set_to_none=False keeps DDP's bucket views); AdamW and
    Muon treat a zero gradient unlike a missing one, so every parameter must get one in every step."""
    for tied in (False, True):  # tiny's own LM head; tied (micro and larger): one parameter, two uses
        extra = ("--tie-embeddings",) if tied else ()
        training = train.build_training(
            train.parse_args(options(corpus, tmp_path / f"unit-{tied}", *extra)), distributed.init_distributed("cpu")
        )
        model = training.model
        assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
        batch = training.data.micro_batches(0, 0, training.device)[0]
        training.loss_of(batch).backward()
        held = [
            param
            for optimizer in training.optimizer.parts.values()
            for group in optimizer.param_groups
            for param in group["params"]
        ]
        assert len(held) == len(list(model.parameters())) == len({id(param) for param in held})
        assert all(param.grad is not None and bool(param.grad.abs().sum() > 0) for param in held)
    zero_grad = optimization.Optimizers.zero_grad
    monkeypatch.setattr(optimization.Optimizers, "zero_grad", lambda self, set_to_none=True: zero_grad(self, False))
    out = tmp_path / "in-place"
    assert train.main(options(corpus, out, "--stop-after-steps", "4")) == 0
    assert train_losses(out) == {step: loss for step, loss in train_losses(reference).items() if step <= 4}
    assert_same_state(
        final_state(out), torch.load(reference / "checkpoints" / store.checkpoint_name(4), weights_only=True)
    )


def test_deterministic_is_a_session_setting_and_cpu_stays_bit_for_bit(corpus, reference, tmp_path):
    out = tmp_path / "run"
    assert train.main(options(corpus, out, "--deterministic", "--stop-after-steps", "5")) == 0
    assert torch.are_deterministic_algorithms_enabled()  # main() turned them on (warn_only=False)
    assert not torch.is_deterministic_algorithms_warn_only_enabled()
    assert final_state(out)["settings"]["runtime"]["deterministic"] is True
    assert train.main(options(corpus, out, "--resume", "auto")) == 0  # may be dropped on resume
    assert not torch.are_deterministic_algorithms_enabled()
    assert_same_state(final_state(out), final_state(reference))


def test_an_op_without_a_deterministic_kernel_is_one_line_naming_deterministic(corpus, tmp_path, monkeypatch):
    def strict_step(self):  # what torch raises for such an op under use_deterministic_algorithms(True)
        raise RuntimeError(
            "index_add_cuda_ does not have a deterministic implementation, but you set "
            "'torch.use_deterministic_algorithms(True)'. You can turn off determinism just for this "
            "operation, or you can use the 'warn_only=True' option, if that's acceptable"
        )

    monkeypatch.setattr(train.Training, "train_step", strict_step)
    with pytest.raises(UserError) as error:
        train.main(options(corpus, tmp_path / "run", "--deterministic"))
    assert str(error.value).startswith(
        "--deterministic: index_add_cuda_ does not have a deterministic "
        "implementation; this run cannot be deterministic on this device"
    )
    assert status(tmp_path / "run")["status"] == "FAILED"


def test_muon_state_is_in_the_checkpoint_and_the_recipe_in_the_settings(reference):
    state = final_state(reference)
    assert set(state["optimizer"]) == {"muon", "adamw"}
    buffers = [entry["momentum_buffer"] for entry in state["optimizer"]["muon"]["state"].values()]
    assert len(buffers) == 14 and all(buffer.abs().sum() > 0 for buffer in buffers)
    settings = json.loads((reference / "training_settings.json").read_text())["training"]
    assert settings["recipe.optimizer"] == "muon"
    assert settings["recipe.muon_lr"] == optimization.OPTIMIZERS["muon"].muon_lr
    assert settings["recipe.lr"] == 3e-3 and settings["recipe.warmup_steps"] == 3
    assert settings["recipe.schedule"] == optimization.DEFAULT_SCHEDULE and settings["recipe.total_steps"] == 12


def test_grad_clip_0_is_off_not_a_zero_bound(corpus, tmp_path):
    """The embedding (AdamW, no decay) moves only if its gradient survives the clipping."""
    training = in_process_training(corpus, tmp_path / "run", "--grad-clip", "0")
    before = training.model.get_input_embeddings().weight.detach().clone()
    result = training.train_step()
    assert result.grad_norm > 0 and not torch.equal(training.model.get_input_embeddings().weight, before)


def test_adamw_stop_then_resume_is_bitwise_identical(corpus, tmp_path):
    full, split = tmp_path / "full", tmp_path / "split"
    assert train.main(options(corpus, full, "--optimizer", "adamw", "--save-every", "6", "--eval-every", "0")) == 0
    assert (
        train.main(
            options(
                corpus,
                split,
                "--optimizer",
                "adamw",
                "--save-every",
                "6",
                "--eval-every",
                "0",
                "--stop-after-steps",
                "5",
            )
        )
        == 0
    )
    assert train.main(options(corpus, split, "--optimizer", "adamw", "--save-every", "6", "--eval-every", "0")) == 0
    assert set(final_state(full)["optimizer"]) == {"adamw"}
    assert_same_state(final_state(split), final_state(full))
    assert train_losses(split) == train_losses(full)


def test_resuming_with_another_optimizer_is_refused(corpus, reference, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(reference / "checkpoints", out / "checkpoints")
    with pytest.raises(UserError, match="from checkpoint .*: optimizer: muon -> adamw; ") as error:
        train.main(options(corpus, out, "--optimizer", "adamw", "--resume", "auto"))
    assert "recipe.optimizer" not in str(error.value)  # the option and its resolved value: one change


def test_changed_settings_are_listed_old_to_new(corpus, reference, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(reference / "checkpoints", out / "checkpoints")
    with pytest.raises(UserError) as error:
        train.main(options(corpus, out, "--lr", "1e-3", "--seed", "7", "--eval-tokens", "512", "--resume", "auto"))
    message = str(error.value)
    assert message.startswith("settings differ from checkpoint")
    assert "lr: 0.003 -> 0.001" in message and "seed: 1337 -> 7" in message
    assert "recipe.lr" not in message and "lr: null" not in message  # the option and its resolved value: once
    assert "eval_tokens: 256 -> 512" in message  # the blocks best_val_loss is measured on
    # another world-size split of the same global batch is not a change
    assert train.main(options(corpus, out, "--batch-size", "1", "--grad-accum", "4")) == 0


def test_the_recorded_settings_are_the_run_and_session_settings(corpus, tmp_path):
    """training: RunSettings (text_loss resolved) and what they resolve to; runtime: SessionSettings without the
    backup URL (it may carry credentials), precision as resolved on this device."""
    training = in_process_training(corpus, tmp_path / "run", "--precision", "auto")
    recorded = train.recorded_settings(training)
    run = dataclasses.asdict(training.run)
    assert {key: recorded["training"][key] for key in run} == {**run, "text_loss": None}
    derived = set(recorded["training"]) - set(run)
    assert {key for key in derived if not key.startswith(("model.", "recipe."))} == {
        "corpus_manifest_sha256",
        "tokenizer_sha256",
        "vocab_size",
        "global_batch_blocks",
        "tokens_per_step",
        "total_steps",
    }
    session = dataclasses.asdict(training.session)
    assert set(recorded["runtime"]) == set(session) - {"backup_to"} | {"world_size", "device"}
    assert recorded["runtime"]["data"] == str(corpus) and recorded["runtime"]["batch_size"] == 2
    assert recorded["runtime"]["precision"] == this_cpu_precision()
    assert recorded["runtime"]["device"] == this_cpu().label()


def test_a_default_length_run_resumes_with_the_same_length_given_as_epochs_1(corpus, tmp_path):
    """No --target-tokens / --epochs is one epoch; resuming with --epochs 1 changes nothing and is accepted."""
    out = tmp_path / "run"
    default_length = options(corpus, out)
    at = default_length.index("--target-tokens")
    del default_length[at : at + 2]
    assert train.main([*default_length, "--stop-after-steps", "2"]) == 0
    assert train.main([*default_length, "--epochs", "1", "--stop-after-steps", "3"]) == 0
    assert status(out)["step"] == 3


def test_resume_from_a_path_into_a_new_run_folder(corpus, reference, tmp_path):
    out = tmp_path / "run"
    assert train.main(options(corpus, out, "--resume", str(reference / "checkpoints" / "step-00000008.pt"))) == 0
    assert_same_state(final_state(out), final_state(reference))
    assert train_losses(out) == {step: loss for step, loss in train_losses(reference).items() if step > 8}


def test_a_run_recorded_with_eval_batches_resumes_with_a_note(corpus, reference, tmp_path, capsys):
    """A checkpoint of tinyllm before 2026-12-06 records --eval-batches: it resumes, scored on --eval-tokens'
    blocks from then on, and says its validation losses before and after do not compare; the steps are the same."""
    checkpoint = torch.load(reference / "checkpoints" / "step-00000008.pt", weights_only=True)
    recorded = checkpoint["settings"]["training"]
    recorded["eval_batches"] = 2
    del recorded["eval_tokens"]
    older = tmp_path / "older.pt"
    torch.save(checkpoint, older)
    out = tmp_path / "run"
    assert train.main(options(corpus, out, "--resume", str(older))) == 0
    assert train.EVAL_BLOCKS_CHANGE in capsys.readouterr().out
    assert_same_state(final_state(out), final_state(reference))


def test_non_finite_loss_fails_and_keeps_the_last_checkpoint(corpus, tmp_path):
    out = tmp_path / "run"
    with pytest.raises(UserError, match="non-finite loss") as error:
        train.main(options(corpus, out, "--lr", "1e30", "--warmup-steps", "0", "--save-every", "1"))
    record = status(out)
    assert record["status"] == "FAILED" and "non-finite" in record["reason"]
    failed_at = int(str(error.value).split(" at step ")[1].split(";")[0])
    good = out / "checkpoints" / store.newest_verified(store.list_folder(out / "checkpoints"))
    assert good.name == record["last_checkpoint"] == store.checkpoint_name(failed_at - 1)
    assert torch.load(good, weights_only=True)["step"] == failed_at - 1
    assert f"the last good checkpoint, {good.name}, is intact" in str(error.value)


# World size 2 (micro-batch 1) against world size 1 (micro-batch 2) with the same global batch, after 12 steps:
# the largest relative difference of the final train loss and of the weights. fp32: the gradient sums in
# another order (docs/training.md "Changing the number of GPUs", bench/bench_world_sizes.py); bf16: besides,
# each micro-batch's matmuls round to bf16 over another number of rows.
WORLD_SIZES_APART = {"fp32": (1e-4, 1e-6), "bf16": (2e-3, 2e-2)}  # bf16 measured: 3.3e-4, 3.8e-3


@pytest.mark.slow
@pytest.mark.parametrize("precision", USER_PRECISIONS)
def test_world_size_2_stop_resume_is_bitwise_identical_and_2_to_1_is_close(
    corpus, references, sums_task, tmp_path, precision
):
    full, split, moved = tmp_path / "full", tmp_path / "split", tmp_path / "moved"
    user = ("--precision", precision)
    run_cli(options(corpus, full, "--batch-size", "1", "--report", *user), world=2)  # rank 1 waits for the report
    assert (full / "model" / "model.safetensors").is_file() and status(full)["model_files"]
    tasks = ("--eval-tasks", str(sums_task), "--eval-tasks-every", "4")  # in the split run only: scored in shares
    run_cli(options(corpus, split, "--batch-size", "1", "--stop-after-steps", "6", *tasks, *user), world=2)
    shutil.copytree(split, moved)
    run_cli(options(corpus, split, "--batch-size", "1", "--resume", "auto", *tasks, *user), world=2)
    assert_same_state(final_state(split), final_state(full))
    assert [(record["step"], record["local_sums/n"]) for record in task_records(split)] == [(4, 30), (8, 30), (12, 30)]
    assert len(final_state(full)["rng"]) == 2 and set(final_state(full)["optimizer"]) == {"muon", "adamw"}
    # the same global batch (1 x 2 accum x 2 ranks = 2 x 2 accum x 1 rank) continues in one process
    loss_apart, weights_apart = WORLD_SIZES_APART[precision]
    assert train.main(options(corpus, moved, "--batch-size", "2", "--resume", "auto", *user)) == 0
    full_losses, moved_losses = train_losses(full), train_losses(moved)
    assert full_losses.keys() == moved_losses.keys() == set(range(1, 13))
    for step in full_losses:
        assert moved_losses[step] == pytest.approx(full_losses[step], rel=loss_apart, abs=1e-5)
    # and world size 1 reads the same samples as world size 2, so it lands close to the 1-process reference
    reference = references(precision)
    assert train_losses(reference)[12] == pytest.approx(full_losses[12], rel=loss_apart)
    assert relative_difference(final_state(reference)["model"], final_state(full)["model"]) < weights_apart


def test_bf16_on_a_cpu_resumes_bit_for_bit(corpus, tmp_path):
    """bf16 autocast on CPU (auto's choice where it has avx512_bf16 or AMX; emulated, slowly, elsewhere): a
    stopped-and-resumed run ends bit for bit where the uninterrupted one does, and lands near the fp32 one."""
    full, split = tmp_path / "full", tmp_path / "split"
    bf16 = ("--precision", "bf16")
    assert train.main(options(corpus, full, *bf16)) == 0
    assert train.main(options(corpus, split, *bf16, "--stop-after-steps", "6")) == 0
    assert train.main(options(corpus, split, *bf16, "--resume", "auto")) == 0
    assert_same_state(final_state(split), final_state(full))
    assert train_losses(split) == train_losses(full)
    assert json.loads((full / "training_settings.json").read_text())["runtime"]["precision"] == "bf16"
    fp32 = tmp_path / "fp32"
    assert train.main(options(corpus, fp32)) == 0
    assert train_losses(full)[12] == pytest.approx(train_losses(fp32)[12], rel=0.02)  # bf16's 8-bit rounding
    assert train_losses(full)[12] != train_losses(fp32)[12]  # it did run in bf16


def start_two_ranks(args: list[str], logs: Path) -> list[subprocess.Popen]:
    """Rank 0 and rank 1 of a gloo run, started as torchrun starts its workers (the same environment) but
    without its agent, so the only signals they get are the test's: each order of events is driven, not raced."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    logs.mkdir()
    ranks = []
    for rank in range(2):
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PYTHONWARNINGS": "ignore",
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        with open(logs / f"{rank}.out", "w") as out, open(logs / f"{rank}.err", "w") as err:
            ranks.append(
                subprocess.Popen(
                    [sys.executable, "train.py", *args],
                    cwd=ROOT,
                    env=env,
                    stdout=out,
                    stderr=err,
                    stdin=subprocess.DEVNULL,
                )
            )
    return ranks


# torchrun's agent sends SIGTERM to rank 0 once rank 1 died; rank 0 meanwhile finds its peer gone in a
# collective. Each moment that signal can land at, made to happen (in rank 0, through a sitecustomize):
SIGNAL_AT = {  # (module, class or None, function)
    # the lost peer found; its status being written
    "recording": ("tinyllm.store.checkpoint_store", "RunStatus", "failed"),
    "exiting": ("tinyllm.training.distributed", None, "shutdown_distributed"),  # the failure recorded; group torn down
}
SELF_SIGNAL = """
import importlib, os, signal
if os.environ.get("RANK") == "0":
    module, owner_name, name = {where!r}
    owner = importlib.import_module(module)
    owner = getattr(owner, owner_name) if owner_name else owner
    original = getattr(owner, name)
    def signalled(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return original(*args, **kwargs)
    setattr(owner, name, signalled)
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    "order",
    ["peer lost, then SIGTERM while recording", "peer lost, then SIGTERM while exiting", "SIGTERM, then peer lost"],
)
def test_a_rank_that_dies_ends_the_other_with_one_line_and_a_resumable_status(
    corpus, tmp_path, order, patch_python_children
):
    out, logs = tmp_path / "run", tmp_path / "logs"
    if order.startswith("peer lost"):
        patch_python_children(SELF_SIGNAL.format(where=SIGNAL_AT[order.split(" while ")[1]]))
    args = options(corpus, out, "--batch-size", "1", "--save-every", "2", steps=5000)  # far longer than the test
    rank0, rank1 = start_two_ranks(args, logs)
    try:
        while rank0.poll() is None and not (out / "checkpoints" / store.checkpoint_name(2)).is_file():
            time.sleep(0.1)
        if order.startswith("SIGTERM"):
            rank1.send_signal(signal.SIGSTOP)  # rank 0 cannot find it gone before the signal is delivered
            rank0.send_signal(signal.SIGTERM)
            time.sleep(1.0)
        rank1.kill()
        rank0.wait(timeout=120)  # rank 0 exits by itself: blocked in a collective, it would not
    finally:
        rank0.kill(), rank1.kill()
    stderr = (logs / "0.err").read_text()
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in stderr, stderr
    assert errors[0].startswith("error: rank 1 stopped (") and "peer" in errors[0]  # gloo: connection closed
    assert "; this rank exits too; resume with: torchrun --nproc_per_node=2 train.py " in errors[0]
    if order.startswith("SIGTERM"):  # what the signal started is said first; the lost peer then ends it
        assert stderr.index("SIGTERM: finishing this step, saving, then stopping") < stderr.index(errors[0])
    else:  # the error line says it all: no word of a stop the run will not make
        assert "SIGTERM:" not in stderr
    assert rank0.returncode in (2, -signal.SIGTERM)  # killed by the signal only once its line is out
    record = status(out)
    assert record["status"] == "CHECKPOINTED_NEEDS_RESUME" and record["reason"].startswith("rank 1 stopped (")
    assert (out / "checkpoints" / record["last_checkpoint"]).is_file() and record["step"] >= 2
    assert record["resume_command"] == errors[0].split("resume with: ")[1]


# ----------------------------------------------------------------------------------------------
# The cloud backup wired in (checkpoint_cloud.py against a local folder)


def test_backup_to_a_folder_keeps_every_checkpoint_until_it_is_verified_remotely(
    corpus, tmp_path, monkeypatch, capsys, patch_python_children
):
    from tinyllm.store import checkpoint_cloud, remote_store

    # uploads lag well behind the saves (one every 2 steps); they run in the backup's child process, which
    # also deletes the local checkpoints retention lets go: each deletion is noted with what the remote held
    remote, out, deleted = tmp_path / "remote", tmp_path / "run", tmp_path / "deleted.jsonl"
    patch_python_children(
        "\n".join(
            [
                "import json, os, time",
                "from tinyllm.store import checkpoint_store, remote_store",
                "upload, delete = remote_store.upload_verified, checkpoint_store.delete",
                "def slow_upload(*args, **kwargs):",
                "    time.sleep(1.0)",
                "    return upload(*args, **kwargs)",
                "def noted_delete(folder, names):",
                "    held = [n for n in os.listdir(folder) if n.endswith('.pt')]",
                f"    with open({str(deleted)!r}, 'a') as notes:",
                "        for name in names:",
                f"            there = os.path.exists(os.path.join({str(remote / 'checkpoints')!r}, name + '.json'))",
                "            notes.write(json.dumps([name, there, len(held)]) + '\\n')",
                "    return delete(folder, names)",
                "remote_store.upload_verified, checkpoint_store.delete = slow_upload, noted_delete",
            ]
        )
    )
    backup = ["--backup-to", str(remote), "--remote-keep-recent", "100", "--backup-max-unbacked", "100"]
    assert train.main(options(corpus, out, "--save-every", "2", "--keep-last", "1", *backup)) == 0
    notes = [json.loads(line) for line in deleted.read_text().splitlines()]
    assert notes and all(there for _, there, _ in notes)  # nothing deleted before its copy was on the remote
    assert max(held for _, _, held in notes) > 2  # retention did meet files still waiting for their upload
    listing = checkpoint_cloud.remote_listing(*remote_store.open_remote(str(remote)))
    assert listing.latest.step == 12 and "step-00000012.pt" in listing.records
    local = {int(p.stem.split("-")[1]) for p in (out / "checkpoints").glob("step-*.pt")}
    remote_steps = {record.step for record in listing.records.values()}
    assert remote_steps | local == {2, 4, 6, 8, 10, 12}  # each save is on the remote or still here
    for name in listing.records:
        record = json.loads((remote / "checkpoints" / f"{name}.json").read_text())
        assert sha256_file(remote / "checkpoints" / name) == record["sha256"], name
    assert status(out)["backup_complete"] is True
    assert "| newest checkpoint backed up" in capsys.readouterr().out.strip().splitlines()[-1]


def test_resume_auto_restores_from_the_backup_on_a_fresh_disk(corpus, reference, tmp_path, capsys):
    remote, first, second = tmp_path / "remote", tmp_path / "first", tmp_path / "second"
    assert train.main(options(corpus, first, "--stop-after-steps", "6", "--backup-to", str(remote))) == 0
    assert status(first)["backup_complete"] is True
    capsys.readouterr()
    assert train.main(options(corpus, second, "--backup-to", str(remote), "--resume", "auto")) == 0
    output = capsys.readouterr().out
    assert "restored from the remote and verified" in output and "resumed from" in output
    assert_same_state(final_state(second), final_state(reference))


def test_a_signal_under_torchrun_records_the_resumable_status_before_a_wait_that_fits_the_grace(
    corpus, tmp_path, monkeypatch
):
    out, remote = tmp_path / "run", tmp_path / "remote"
    waits = []
    close = store.Checkpointer.close

    def watched_close(self, backup_wait_s=None):
        waits.append((status(out), backup_wait_s))  # what run_status.json says while the upload is awaited
        return close(self, backup_wait_s)

    step = train.Training.train_step

    def signalled_step(self):
        if self.step == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # as torchrun forwards it
        return step(self)

    monkeypatch.setattr(store.Checkpointer, "close", watched_close)
    monkeypatch.setattr(train.Training, "train_step", signalled_step)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")  # as under torchrun: SIGKILL 30 s after the signal
    assert train.main(options(corpus, out, "--backup-to", str(remote))) == 0
    ((before, wait),) = waits
    assert before["status"] == "CHECKPOINTED_NEEDS_RESUME" and before["last_checkpoint"] == store.checkpoint_name(3)
    assert before["backup_complete"] is None and before["resume_command"].endswith("--resume auto")
    assert 0 <= wait <= train.TORCHRUN_GRACE_SECONDS - train.STOP_MARGIN_SECONDS  # not --backup-wait-seconds 600
    after = status(out)
    assert after["status"] == "CHECKPOINTED_NEEDS_RESUME" and after["backup_complete"] is True


def test_think72_env_alias_turns_the_backup_on(corpus, tmp_path, monkeypatch):
    remote = tmp_path / "remote"
    monkeypatch.setenv("THINK72_CLOUD_RESUME", "1")
    monkeypatch.setenv("THINK72_BACKUP_URL", str(remote))
    assert train.main(options(corpus, tmp_path / "run", steps=4)) == 0
    assert json.loads((remote / "checkpoints" / "latest.json").read_text())["step"] == 4
    # the run's final status reached the remote too, not only the one of the last checkpoint
    assert (remote / "run_status.json").read_bytes() == (tmp_path / "run" / "run_status.json").read_bytes()
    assert status(tmp_path / "run")["status"] == "COMPLETE"


# ----------------------------------------------------------------------------------------------
# What a new user runs into: a busy or foreign --out, a wrong --data, --resume typos, interrupts


def test_a_second_train_py_on_a_locked_run_folder_is_refused_with_the_holders_pid(corpus, tmp_path):
    out = tmp_path / "run"
    lock = store.lock_run_folder(out)  # another train.py holds RUN/.lock
    try:
        result = run_cli(options(corpus, out), check=False)
        assert result.returncode == 2, result.stderr
        assert result.stderr.strip() == f"error: run folder {out} is in use by another train.py (pid {os.getpid()})"
        assert sorted(os.listdir(out)) == [".lock"]  # nothing written, nothing deleted
    finally:
        lock.close()
    assert train.main(options(corpus, out, steps=2)) == 0  # the lock goes with its holder
    assert status(out)["status"] == "COMPLETE"


def test_an_out_that_is_a_corpus_or_holds_other_files_is_refused(corpus, tmp_path):
    before = sorted(os.listdir(corpus))
    with pytest.raises(UserError, match=f"--out {corpus} is a corpus folder"):
        train.main(options(corpus, corpus))
    assert sorted(os.listdir(corpus)) == before
    foreign = tmp_path / "photos"
    foreign.mkdir()
    (foreign / "cat.jpg").write_bytes(b"\xff\xd8")
    with pytest.raises(UserError, match=f"--out {foreign} holds files but is not a tinyllm run folder"):
        train.main(options(corpus, foreign))
    assert os.listdir(foreign) == ["cat.jpg"]
    (tmp_path / "empty").mkdir()
    store.check_run_folder(tmp_path / "empty")  # an empty or missing folder is fine
    store.check_run_folder(tmp_path / "missing")


def test_a_data_file_or_plain_folder_gets_the_data_py_command_that_builds_a_corpus(corpus, tmp_path):
    jsonl = tmp_path / "notes.jsonl"
    jsonl.write_text('{"text": "hello"}\n')
    for path in (jsonl, tmp_path):
        with pytest.raises(UserError) as error:
            train.main(["--data", str(path), "--out", str(tmp_path / "run"), "--no-report"])
        assert str(error.value) == (
            f"--data {path} is not a corpus folder (no corpus_manifest.json); build one "
            f"with: python data.py --data {path} --out corpus/{path.stem}"
        )
    with pytest.raises(UserError, match=f"is the manifest; pass its corpus folder: --data {corpus}$"):
        train.main(["--data", str(corpus / "corpus_manifest.json"), "--out", str(tmp_path / "run")])
    with pytest.raises(UserError) as error:  # one stream of a labelled corpus, outside the mixture form
        train.main(["--data", f"{corpus}#prose", "--out", str(tmp_path / "run")])
    assert str(error.value) == (
        f"--data {corpus}#prose: a source label picks a stream of a corpus within a mixture: "
        f"NAME=CORPUS#LABEL:WEIGHT (e.g. --data prose={corpus}#prose:1, or several such); --data {corpus} trains on "
        "the whole corpus"
    )
    assert not (tmp_path / "run").exists()


def test_resume_typo_lists_the_choices(tmp_path):
    with pytest.raises(UserError, match=r"--resume Auto: not a choice and no such file; use auto .* none .* PATH"):
        train.parse_args(["--data", str(tmp_path), "--out", str(tmp_path / "run"), "--resume", "Auto"])


def test_warmup_longer_than_the_run_and_a_run_of_few_steps_warn(corpus, tmp_path, capsys):
    assert train.main(options(corpus, tmp_path / "run", "--warmup-steps", "20", steps=2)) == 0
    err = capsys.readouterr().err
    assert "warning: --warmup-steps 20 >= the run's 2 steps" in err
    assert "warning: the run is only 2 optimizer steps" in err


def test_token_byte_lengths_sum_to_the_utf8_bytes_of_the_text(corpus):
    tokenizer = corpus_format.load_tokenizer(corpus)
    lengths = corpus_format.token_byte_lengths(corpus / "tokenizer" / "tokenizer.json", len(tokenizer) + 5)
    text = "the cat sees 12 birds, café naïve 日本語 — 🙂 and a river."
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) < len(text.encode("utf-8"))  # merges made some tokens longer than a byte
    assert int(lengths[ids].sum()) == len(text.encode("utf-8"))
    specials = [tokenizer.convert_tokens_to_ids(token) for token in ("<pad>", "<bos>", "<eos>")]
    assert lengths[specials].tolist() == [0, 0, 0] and lengths[-5:].tolist() == [0] * 5


def test_heldout_loss_gives_bits_per_byte_of_the_scored_text(corpus, tmp_path):
    training = in_process_training(corpus, tmp_path / "run")
    result = train.heldout_loss(training, "test")
    split = training.data.splits["test"]
    count = min(split.blocks, math.ceil(training.run.eval_tokens / split.context))
    order = train_data.BlockPermutation(split.blocks, train_data.EVAL_SEED, train_data.EVAL_EPOCH)
    targets = split.batch([order(i) for i in range(count)], torch.device("cpu")).targets
    scored = targets[targets != train_data.IGNORE_INDEX].tolist()
    text = corpus_format.load_tokenizer(corpus).decode(scored, skip_special_tokens=True)
    assert result["tokens"] == len(scored) and result["bytes"] == len(text.encode("utf-8"))
    assert result["bits_per_byte"] == pytest.approx(result["loss"] * result["tokens"] / math.log(2) / result["bytes"])


def test_validation_reads_the_same_blocks_whatever_the_batch_split_and_seed(corpus, tmp_path):
    """Held-out scores compare between runs on one corpus: a run at a quarter of another's batch scored a
    quarter of its blocks until 2026-12-06 (--eval-batches); --eval-tokens counts them in tokens."""
    info = distributed.DistInfo(rank=0, local_rank=0, world=1, device=torch.device("cpu"))
    results, rows = [], []
    for split in (
        ["--batch-size", "2", "--grad-accum", "2"],
        ["--batch-size", "4", "--grad-accum", "1"],
        ["--batch-size", "1", "--grad-accum", "4"],
        ["--batch-size", "1", "--grad-accum", "1"],  # another global batch
        ["--batch-size", "8", "--grad-accum", "2"],
    ):
        settings = train.parse_args(options(corpus, tmp_path / "run", *split))
        training = train.build_training(settings, info)
        results.append(train.heldout_loss(training, "validation"))
        rows.append(training.data.evaluation_rows("validation", 0)[None].rows)
    assert results[0]["tokens"] == 8 * 32  # --eval-tokens 256 of blocks of 32 tokens
    assert all(result["tokens"] == results[0]["tokens"] for result in results)
    assert all(result["loss"] == pytest.approx(results[0]["loss"], rel=1e-6) for result in results)
    other_seed = train.build_training(train.parse_args(options(corpus, tmp_path / "run", "--seed", "7")), info)
    assert all(these == rows[0] for these in [*rows, other_seed.data.evaluation_rows("validation", 0)[None].rows])
    assert len(rows[0]) == 8 < other_seed.data.splits["validation"].blocks  # a part of the split: the order decides


def test_a_step_larger_than_the_train_split_warns(corpus, tmp_path, capsys):
    assert train.main(options(corpus, tmp_path / "run", "--batch-size", "1000", "--eval-every", "0", steps=1)) == 0
    assert re.search(
        r"warning: one step reads 2000 blocks but the train split has only \d+ blocks of 32 tokens",
        capsys.readouterr().err,
    )


@pytest.mark.parametrize(
    "batch_size, grad_accum, world, context, expected",
    [
        (8, 4, 2, 1024, None),
        (65_536, 1, 1, 256, None),  # 16,777,216 tokens: the largest micro-batch
        (65_537, 1, 1, 256, "--batch-size 65,537: a micro-batch of 16,777,472 tokens (65,537 blocks of 256) is more"),
        (10**9, 1, 1, 128, "--batch-size 1,000,000,000: a micro-batch of 128,000,000,000 tokens"),
        (4096, 1024, 1, 256, None),  # 2**30 tokens a step: the largest
        (4096, 1024, 2, 256, "--batch-size 4,096 x --grad-accum 1,024 x 2 rank(s): a step of 2,147,483,648 tokens"),
    ],
)
def test_a_batch_no_run_takes_is_a_typo(batch_size, grad_accum, world, context, expected):
    problem = train.batch_problem(batch_size, grad_accum, world, context)
    assert problem == expected if expected is None else problem.startswith(expected)


def test_an_absurd_batch_stops_at_once_with_one_line(corpus, tmp_path):
    with pytest.raises(UserError, match="^--batch-size 1,000,000,000: a micro-batch of 32,000,000,000 tokens"):
        train.main(options(corpus, tmp_path / "run", "--batch-size", "1000000000"))
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_second_ctrl_c_records_an_honest_reason_and_the_continue_command(corpus, tmp_path, monkeypatch):
    out = tmp_path / "run"
    original = train.Training.train_step

    def interrupted_twice(self):
        result = original(self)
        if result.step == 3:
            signal.raise_signal(signal.SIGINT)  # the first: finish the step, save, stop
            signal.raise_signal(signal.SIGINT)  # the second: abort now
        return result

    monkeypatch.setattr(train.Training, "train_step", interrupted_twice)
    with pytest.raises(KeyboardInterrupt):
        train.main(options(corpus, out, "--save-every", "2"))
    record = status(out)
    assert record["status"] == "FAILED" and record["step"] == 3
    assert record["reason"] == (
        f"aborted by the user (second interrupt) at step 3; the last checkpoint is "
        f"{out / 'checkpoints' / 'step-00000002.pt'}; continue with: "
        + train.resume_command(
            distributed.DistInfo(0, 0, 1, torch.device("cpu")), options(corpus, out, "--save-every", "2")
        )
    )
    assert f"--data {corpus}" in record["reason"]  # from main's argv, not pytest's sys.argv


def interrupt_twice() -> None:
    signal.raise_signal(signal.SIGINT)  # the first: finish the step, save, stop
    signal.raise_signal(signal.SIGINT)  # the second: abort now


def test_a_second_ctrl_c_after_the_last_step_but_before_the_final_status_still_records_failed(
    corpus, tmp_path, monkeypatch
):
    out = tmp_path / "run"
    original = train.heldout_loss

    def heldout_loss(training, split):
        if split == "test":  # in finish_run, before the status is written
            interrupt_twice()
        return original(training, split)

    monkeypatch.setattr(train, "heldout_loss", heldout_loss)
    with pytest.raises(KeyboardInterrupt):
        train.main(options(corpus, out, steps=4))
    record = status(out)
    last = out / "checkpoints" / "step-00000004.pt"
    assert record["status"] == "FAILED" and record["reason"].startswith(
        f"aborted by the user (second interrupt) at step 4; the last checkpoint is {last}; continue with: "
    )


def test_a_second_ctrl_c_during_the_report_keeps_the_complete_status(corpus, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    make = artifacts.LossCurve.make  # the first artifact made
    monkeypatch.setattr(artifacts.LossCurve, "make", lambda *args: interrupt_twice())
    with pytest.raises(KeyboardInterrupt):
        train.main(options(corpus, out, "--report", steps=4))
    record = status(out)
    assert record["status"] == "COMPLETE" and record["outputs"] == {"report": "pending", "model": "pending"}
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("interrupted again after the run recorded COMPLETE; continue with: ")
    assert record["report_command"] == last.split("continue with: ")[1]  # what makes the report and model/
    assert not (out / "model").exists()

    monkeypatch.setattr(artifacts.LossCurve, "make", make)  # the same command again: no step, the report made
    assert train.main(options(corpus, out, "--report", steps=4)) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert (
        "note: the previous session ended before its report was made (run_status.json: COMPLETE, report "
        "pending); this session makes it at its end" in lines
    )
    record = status(out)
    assert record["outputs"] == {"report": "done", "model": "done"} and record["report_command"] is None
    assert (out / "model" / "model.safetensors").is_file() and lines[-1].startswith("COMPLETE: step 4/4 | ")


def test_a_start_after_a_silent_death_says_so_and_how_many_steps_are_done_again(corpus, tmp_path, capsys):
    out = tmp_path / "run"
    assert train.main(options(corpus, out, "--stop-after-steps", "5")) == 0  # saves at 4 and 5
    store.write_status(out, store.RUNNING, step=7, total_steps=12)  # what a session killed after step 7 leaves
    capsys.readouterr()
    assert train.main(options(corpus, out, "--stop-after-steps", "8")) == 0
    assert (
        "note: the previous session died without a word after step 7 (run_status.json still said RUNNING: "
        "killed, out of memory, or its machine went away); resuming from step 5; steps done again: 2 or more"
    ) in capsys.readouterr().out.splitlines()
    assert status(out)["status"] == store.NEEDS_RESUME and status(out)["step"] == 8
    assert train.main(options(corpus, out, "--stop-after-steps", "9")) == 0
    assert "note:" not in capsys.readouterr().out  # a stop that said so: nothing to note


def test_cuda_out_of_memory_in_a_step_is_one_line_with_a_split_that_fits(corpus, tmp_path, monkeypatch, capsys):
    """The step raises torch.OutOfMemoryError as on a T4: one error line naming the preset, the micro-batch
    and a split of the same global batch that hardware.fitting_split fits; the run is FAILED."""
    out = tmp_path / "run"
    original = train.Training.train_step
    small_card = hardware.Device("cuda", "Tesla T4", (7, 5), 2_800_000)  # the tiny model fits at 1 x 32, not 2 x 32

    def out_of_memory(self):
        if self.step == 4:
            self.hardware = small_card
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
        return original(self)

    monkeypatch.setattr(train.Training, "train_step", out_of_memory)
    with pytest.raises(SystemExit) as exit_status:
        common.run_main(lambda: train.main(options(corpus, out, "--grad-accum", "3")))
    assert exit_status.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith(
        "error: CUDA out of memory on Tesla T4 (sm_75) (2.7 MiB): tiny at micro-batch 2 x 32 "
        "tokens (--batch-size 2 --grad-accum 3, fp32) needs about "
    )
    assert "MiB by hardware.step_memory; --batch-size 1 --grad-accum 6 keeps the global batch" in lines[-1]
    assert "the last good checkpoint, step-00000004.pt, is intact" in lines[-1]
    assert not any("Traceback" in line for line in lines)
    record = status(out)
    assert record["status"] == "FAILED" and record["step"] == 4 and "--batch-size 1 --grad-accum 6" in record["reason"]


def test_a_run_refused_before_it_began_leaves_no_run_folder(corpus, tmp_path):
    out = tmp_path / "new-run"
    result = run_cli(options(corpus, out, "--heads", "3"), check=False)  # 3 query heads, 2 KV heads: refused
    assert result.returncode == 2 and "kv_heads" in result.stderr
    assert not out.exists()
    out.mkdir()  # a folder the user made stays (with its .lock), refused once claimed: no assistant tokens
    result = run_cli(options(corpus, out, "--loss-on", "assistant"), check=False)
    assert result.returncode == 2 and "no assistant tokens" in result.stderr
    assert out.is_dir() and [p.name for p in out.iterdir()] == [".lock"]


def test_the_compiled_model_trains_like_the_eager_one(corpus, reference, tmp_path):
    """--compile on CPU: the same losses within float tolerance (a different kernel schedule, not bitwise)."""
    out = tmp_path / "compiled"
    assert train.main(options(corpus, out, "--compile", "--stop-after-steps", "4")) == 0
    assert set(final_state(out)["optimizer"]) == {"muon", "adamw"}  # Muon steps the compiled model's matrices
    compiled, eager = train_losses(out), train_losses(reference)
    assert sorted(compiled) == [1, 2, 3, 4]
    for step, loss in compiled.items():
        assert loss == pytest.approx(eager[step], rel=2e-4), step


def test_compiled_plain_causal_blocks_skip_the_full_mask(monkeypatch):
    """Under torch.compile, blocks without padding go to SDPA's is_causal (its flash kernel skips the
    masked half); padding or a cache offset still gets transformers' mask."""
    from transformers.masking_utils import sdpa_mask

    shape = {"batch_size": 2, "q_length": 8, "kv_length": 8, "q_offset": 0, "kv_offset": 0}
    padding = torch.ones(2, 8, dtype=torch.long)
    padding[1, :3] = 0
    eager = attention.causal_sdpa_mask(**shape, attention_mask=padding)
    assert torch.equal(eager, sdpa_mask(**shape, attention_mask=padding))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert attention.causal_sdpa_mask(**shape, attention_mask=None, allow_is_causal_skip=False) is None
    assert torch.equal(attention.causal_sdpa_mask(**shape, attention_mask=padding), eager)
    assert attention.causal_sdpa_mask(**{**shape, "kv_length": 12, "q_offset": 4}, attention_mask=None) is not None


def sdpa_calls_when_compiled(implementation: str) -> list[dict]:
    """The keyword arguments of every scaled_dot_product_attention call in the graph torch.compile
    traces for a tiny model under `implementation` (None: transformers' stock "sdpa")."""
    from tinyllm.model import config as model_config

    torch.manual_seed(0)
    model = model_config.build_model(model_config.PRESETS["tiny"], 300)
    model.config.use_cache = False  # as Training builds it
    if implementation is not None:
        attention.use_attention(model, implementation)
    calls = []

    def backend(graph_module, example_inputs):
        for node in graph_module.graph.nodes:
            if node.op == "call_function" and "scaled_dot_product_attention" in str(node.target):
                calls.append(
                    {
                        "attn_mask": node.kwargs.get("attn_mask", node.args[3] if len(node.args) > 3 else None),
                        "is_causal": node.kwargs.get("is_causal", False),
                    }
                )
        return graph_module.forward

    torch._dynamo.reset()
    torch.compile(model, backend=backend, fullgraph=False)(input_ids=torch.randint(0, 300, (2, 32)))
    torch._dynamo.reset()
    return calls


@pytest.mark.parametrize("implementation", list(attention.ATTENTION_FUNCTIONS))
def test_every_planned_attention_keeps_is_causal_under_compile(implementation):
    """The attention of every plan (flash on sm_80+, memory-efficient on a T4, CPU) reaches SDPA as
    is_causal with no mask tensor when compiled on whole blocks: flash takes no mask, and a dense one
    doubles its work."""
    calls = sdpa_calls_when_compiled(implementation)
    assert len(calls) == model_config_tiny_layers()
    assert all(call["attn_mask"] is None and call["is_causal"] is True for call in calls), calls


def test_stock_sdpa_gets_a_dense_mask_under_compile():
    """Why the plans above never use transformers' "sdpa" as it is: traced, it builds the full mask."""
    calls = sdpa_calls_when_compiled(None)
    assert calls and all(call["attn_mask"] is not None and not call["is_causal"] for call in calls)


def model_config_tiny_layers() -> int:
    from tinyllm.model import config as model_config

    return model_config.PRESETS["tiny"].layers


def test_a_corpus_without_held_out_blocks_is_trained_with_a_warning(tmp_path, capsys):
    texts = [{"text": f"{i} plus {i + 1} is {2 * i + 1}. the cat sees the dog."} for i in range(300)]
    corpus = data.build_corpus(
        [data.Source("generated", "generated", records=texts)],
        tmp_path / "corpus",
        data.BuildSettings(vocab_size=300, val_fraction=0, test_fraction=0),
    )
    assert train.main(options(corpus, tmp_path / "run", steps=2)) == 0
    err = capsys.readouterr().err
    assert (
        "warning: the corpus has no validation or test blocks of 32 tokens: no validation loss and no test "
        "loss will be measured (rebuild the corpus with more documents or a larger --val-fraction / "
        "--test-fraction)"
    ) in err
    assert status(tmp_path / "run")["status"] == "COMPLETE"
    corpus = data.build_corpus(
        [data.Source("generated", "generated", records=texts)],
        tmp_path / "validated",
        data.BuildSettings(vocab_size=300, val_fraction=0.3, test_fraction=0),
    )
    assert train.main(options(corpus, tmp_path / "validated-run", steps=2)) == 0
    assert (
        "no test loss will be measured (rebuild the corpus with more documents or a larger --test-fraction)"
        in capsys.readouterr().err
    )  # the option of the split that is empty, only


def test_fp16_autocast_and_loss_scaling_run_on_cpu_end_to_end_and_resume_bitwise(corpus, tmp_path, monkeypatch, capsys):
    """Issue 14.14: the T4 path (fp16 autocast + GradScaler) on CPU: overflow steps are skipped and
    retried, the scaler's state is in the checkpoint, and a stop + resume matches an uninterrupted run."""
    import functools

    # a first scale far too large: the first steps overflow in fp16, as on a GPU at the start of a run
    monkeypatch.setattr(torch.amp, "GradScaler", functools.partial(torch.amp.GradScaler, init_scale=2.0**40))
    whole, halves = tmp_path / "whole", tmp_path / "halves"
    assert train.main(options(corpus, whole, "--precision", "fp16", steps=8)) == 0
    out = capsys.readouterr()
    assert "fp16 overflow: step 1 skipped" in out.out + out.err and "--precision fp16 on CPU" in out.err
    state = final_state(whole)
    assert set(state["optimizer"]) == {"muon", "adamw"}  # GradScaler over both of Muon's optimizers
    assert status(whole)["status"] == "COMPLETE" and state["scaler"]["skipped_total"] > 0
    assert state["scaler"]["scaler"]["scale"] < 2.0**40
    assert all(np.isfinite(loss) for loss in train_losses(whole).values())

    assert train.main(options(corpus, halves, "--precision", "fp16", "--stop-after-steps", "3", steps=8)) == 0
    assert status(halves)["step"] == 3
    assert train.main(options(corpus, halves, "--precision", "fp16", "--resume", "auto", steps=8)) == 0
    resumed = final_state(halves)
    assert_same_state(resumed, state)
    assert resumed["scaler"] == state["scaler"]
    assert train_losses(halves) == train_losses(whole)


@pytest.mark.parametrize("first, then", [("fp16", "bf16"), ("bf16", "fp16")])
def test_a_run_moves_between_cards_of_another_precision(corpus, tmp_path, capsys, first, then):
    """A T4 session (fp16 + loss scaling) continued on an A100 (bf16), and back: the precision is the
    device's, the resume says so and continues from the same fp32 weights and optimizer states."""
    out = tmp_path / "run"
    assert train.main(options(corpus, out, "--precision", first, "--stop-after-steps", "3", steps=6)) == 0
    saved = final_state(out)
    capsys.readouterr()
    settings = train.parse_args(options(corpus, out, "--precision", then, steps=6))
    training = train.build_training(
        settings, distributed.DistInfo(rank=0, local_rank=0, world=1, device=torch.device("cpu"))
    )
    training.load(saved, out / "checkpoints" / "step-00000003.pt")
    assert f"precision changes from {first} (the checkpoint's) to {then}" in capsys.readouterr().out
    assert training.step == 3 and training.scaler.enabled == (then == "fp16")
    if then == "fp16":
        assert training.scaler.scaler.get_scale() == 2.0**16  # a fresh scaler, not the checkpoint's none
    assert train.main(options(corpus, out, "--precision", then, "--resume", "auto", steps=6)) == 0
    assert status(out)["status"] == "COMPLETE" and status(out)["step"] == 6
    assert json.loads((out / "training_settings.json").read_text())["runtime"]["precision"] == then


# ----------------------------------------------------------------------------------------------
# --loss-on assistant: the corpus' mask (data.py) turns the targets the loss skips into IGNORE_INDEX


@pytest.fixture(scope="module")
def chat_corpus(tmp_path_factory) -> Path:
    """A mixed chat + plain-text corpus built by data.py, its shards cut every 997 tokens."""
    records = demo_corpus.demo_data()[0][:1500]
    settings = data.BuildSettings(
        vocab_size=300, val_fraction=0.05, test_fraction=0.05, shard_tokens=997, progress=False
    )
    return data.build_corpus(
        [data.Source("chats", "generated", records=records)], tmp_path_factory.mktemp("chats") / "corpus", settings
    )


def whole_stream(corpus: Path, split: str, mask: bool) -> np.ndarray:
    files = json.loads((corpus / "corpus_manifest.json").read_text())["splits"][split]["files"]
    return np.concatenate(
        [np.fromfile(corpus / (f["mask"]["name"] if mask else f["name"]), dtype="u1" if mask else "<u2") for f in files]
    )


@pytest.mark.parametrize("text_loss, counted", [("none", {1}), ("full", {1, 2})])
def test_the_mask_stream_stays_aligned_with_the_tokens_across_shard_and_block_boundaries(
    chat_corpus, text_loss, counted
):
    manifest = corpus_format.load_manifest(chat_corpus)
    table = train_data.counted_classes("assistant", text_loss)
    split = train_data.TokenSplit(chat_corpus, manifest, "train", context=64, counted=table)
    tokens, mask = whole_stream(chat_corpus, "train", False), whole_stream(chat_corpus, "train", True)
    assert len(split.masks) == len(split.shards) > 20 and len(mask) == len(tokens) == split.tokens
    crossing = [index for index in range(split.blocks) if (index * 64) // 997 != (index * 64 + 64) // 997]
    assert len(crossing) > 10  # blocks that span a shard boundary
    for index in [0, 1, split.blocks - 1, *crossing]:
        window = slice(index * 64, index * 64 + 65)
        assert np.array_equal(split.block(index), tokens[window].astype(np.int64))
        assert np.array_equal(split.block_mask(index), mask[window])
    blocks = crossing[:3] + [split.blocks - 1]
    inputs, targets, _ = split.batch(blocks, torch.device("cpu"))
    for row, index in enumerate(blocks):
        window = slice(index * 64 + 1, index * 64 + 65)
        keep = np.isin(mask[window], list(counted))
        expected = torch.from_numpy(tokens[window][keep].astype(np.int64))
        assert torch.equal(targets[row][torch.from_numpy(keep)], expected)
        assert (targets[row][torch.from_numpy(~keep)] == train_data.IGNORE_INDEX).all()
        assert torch.equal(inputs[row], torch.from_numpy(tokens[index * 64 : index * 64 + 64].astype(np.int64)))
    # an <|im_end|> (id 4) that closes an answer is counted; the <eos> (id 2) after a chat is not
    all_targets = torch.cat(
        [split.batch(list(range(start, start + 8)), torch.device("cpu"))[1] for start in range(0, 64, 8)]
    )
    assert (all_targets == 4).any() and (all_targets == 2).any() == (text_loss == "full")


def test_a_masked_loss_equals_the_hand_computed_one_on_a_tiny_batch():
    class Fixed(torch.nn.Module):  # a "model" whose logits are given: one-hot hidden states of the position
        def __init__(self):
            super().__init__()
            logits = torch.tensor(
                [[0.0, 1.0, 2.0], [1.0, 0.0, 0.0], [0.5, 0.5, -1.0], [3.0, 0.0, 0.0], [0.0, 0.0, 0.0], [-2.0, 1.0, 0.0]]
            )
            self.lm_head = torch.nn.Linear(6, 3, bias=False)
            self.lm_head.weight.data = logits.t().contiguous()
            self.model = lambda input_ids: type("Out", (), {"last_hidden_state": torch.eye(6).reshape(2, 3, 6)})

    targets = torch.tensor([[2, train_data.IGNORE_INDEX, 0], [train_data.IGNORE_INDEX, train_data.IGNORE_INDEX, 1]])

    def nll(row: list[float], target: int) -> float:
        return math.log(sum(math.exp(value) for value in row)) - row[target]

    hand = [nll([0.0, 1.0, 2.0], 2), nll([0.5, 0.5, -1.0], 0), nll([-2.0, 1.0, 0.0], 1)]
    inputs = torch.zeros(2, 3, dtype=torch.long)
    assert losses.language_model_loss(Fixed(), inputs, targets).item() == pytest.approx(sum(hand) / 3, rel=1e-6)
    assert losses.language_model_loss(Fixed(), inputs, targets, "sum").item() == pytest.approx(sum(hand), rel=1e-6)


def test_an_assistant_step_is_the_mean_over_the_steps_counted_targets(chat_corpus, tmp_path):
    """With accumulation, the step's loss is the mean over all its counted targets (not a mean of the
    micro-steps' means, whose counts differ); computed here by hand from the model before the step."""
    training = in_process_training(
        chat_corpus,
        tmp_path / "a",
        "--loss-on",
        "assistant",
        "--text-loss",
        "none",
        "--batch-size",
        "1",
        "--grad-accum",
        "4",
    )
    whole = in_process_training(
        chat_corpus,
        tmp_path / "b",
        "--loss-on",
        "assistant",
        "--text-loss",
        "none",
        "--batch-size",
        "4",
        "--grad-accum",
        "1",
    )
    blocks = training.data.sampler.step_blocks(0)
    with torch.no_grad():
        inputs, targets, documents = training.data.splits["train"].batch(blocks, torch.device("cpu"))
        # the default --packing masked
        logits = training.model(input_ids=inputs, **attention.decoder_inputs(training.model, documents)).logits
        per_token = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)), targets.reshape(-1), reduction="none", ignore_index=-100
        )
    kept = targets.reshape(-1) != train_data.IGNORE_INDEX
    counts = (targets != train_data.IGNORE_INDEX).sum(dim=1)
    assert len(set(counts.tolist())) > 1 and 0 < kept.sum() < targets.numel()  # uneven micro-steps, some skipped
    expected = per_token[kept].sum() / kept.sum()
    first, second = training.train_step(), whole.train_step()
    assert first.loss == pytest.approx(expected.item(), rel=1e-5)
    assert second.loss == pytest.approx(expected.item(), rel=1e-5)
    assert first.grad_norm == pytest.approx(second.grad_norm, rel=1e-4)


def test_loss_on_assistant_refusals_are_one_clear_line(corpus, chat_corpus, tmp_path):
    with pytest.raises(UserError, match="--text-loss needs --loss-on assistant"):
        train.parse_args(options(chat_corpus, tmp_path / "a", "--text-loss", "full"))
    with pytest.raises(
        UserError,
        match=r"--loss-on assistant: .* also has [\d,]+ tokens of plain-text documents; "
        "say whether they count with --text-loss full or --text-loss none",
    ):
        train.main(options(chat_corpus, tmp_path / "b", "--loss-on", "assistant"))
    with pytest.raises(UserError, match="--loss-on assistant: the train split of .* has no assistant tokens"):
        train.main(options(corpus, tmp_path / "c", "--loss-on", "assistant"))
    assert not (tmp_path / "b").exists() and not (tmp_path / "c").exists()


def test_an_assistant_loss_run_resumes_bitwise_and_refuses_another_loss_on(chat_corpus, tmp_path):
    assistant = ("--loss-on", "assistant", "--text-loss", "none")
    reference, out = tmp_path / "reference", tmp_path / "run"
    assert train.main(options(chat_corpus, reference, *assistant, steps=8)) == 0
    settings = json.loads((reference / "training_settings.json").read_text())
    assert settings["training"]["loss_on"] == "assistant" and settings["training"]["text_loss"] == "none"
    assert train.main(options(chat_corpus, out, *assistant, "--stop-after-steps", "5", steps=8)) == 0
    with pytest.raises(UserError, match="loss_on: assistant -> all"):
        train.main(options(chat_corpus, out, steps=8))
    with pytest.raises(UserError, match="text_loss: none -> full"):
        train.main(options(chat_corpus, out, "--loss-on", "assistant", "--text-loss", "full", steps=8))
    assert train.main(options(chat_corpus, out, *assistant, steps=8)) == 0
    assert_same_state(final_state(out), final_state(reference))
    assert train_losses(out) == train_losses(reference)
    evals = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    counted = [r["val_tokens"] for r in evals if r["kind"] == "eval"]
    assert counted and all(0 < tokens < 2 * 4 * 32 for tokens in counted)  # only the answers' targets count


# ----------------------------------------------------------------------------------------------
# --init-from: a new run from a checkpoint, a run folder or a Hugging Face folder


def exported_model(run: Path) -> Path:
    """RUN/model of a finished run, exported from its last checkpoint (--export-only)."""
    if not (run / "model").is_dir():
        assert (
            train.main(
                [
                    "--data",
                    json.loads((run / "training_settings.json").read_text())["runtime"]["data"],
                    "--out",
                    str(run),
                    "--export-only",
                    "--threads",
                    "1",
                ]
            )
            == 0
        )
    return run / "model"


def test_export_only_makes_the_end_of_run_artifacts_of_its_checkpoint(corpus, reference, tmp_path, capsys):
    """--export-only runs the artifacts the run's own end runs (artifacts.ARTIFACTS): a complete checkpoint gets
    its samples and RUN/model/; the run's history (metrics.jsonl, run_status.json) is neither written nor read
    into being."""
    out, checkpoint = tmp_path / "exported", reference / "checkpoints" / "step-00000012.pt"
    assert (
        train.main(
            ["--data", str(corpus), "--out", str(out), "--resume", str(checkpoint), "--export-only", "--threads", "1"]
        )
        == 0
    )
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith(f"exported {checkpoint} (step 12/12, COMPLETE) to {out / 'model'}: model.safetensors ")
    assert sorted(path.name for path in out.iterdir() if not path.name.startswith(".")) == [
        "model",
        "sample_generations.json",
    ]
    samples = json.loads((out / "sample_generations.json").read_text())
    assert samples["step"] == 12 and len(samples["samples"]) == 5 and samples["error"] is None
    assert "Status: **COMPLETE**" in (out / "model" / "README.md").read_text()

    run = tmp_path / "run"  # an older step exported into the complete run's own folder
    shutil.copytree(reference, run)
    older = run / "checkpoints" / "step-00000008.pt"
    assert train.main(["--data", str(corpus), "--out", str(run), "--resume", str(older), "--export-only"]) == 0
    status = json.loads((run / "run_status.json").read_text())
    assert (status["status"], status["step"]) == (store.COMPLETE, 12)  # the run's status stays the run's
    assert status["model_files"] == {p.name: sha256_file(p) for p in (run / "model").iterdir() if p.is_file()}


@pytest.mark.parametrize("kind", ["checkpoint", "run", "huggingface"])
def test_init_from_each_kind_of_source_loads_its_weights_and_starts_fresh(corpus, reference, tmp_path, kind):
    source = {
        "checkpoint": reference / "checkpoints" / "step-00000008.pt",
        "run": reference,
        "huggingface": exported_model(reference),
    }[kind]
    training = in_process_training(corpus, tmp_path / "new", "--init-from", str(source), "--seed", "5")
    fresh = training.model.state_dict()["model.embed_tokens.weight"].clone()
    train.start_from(training, store.read_init_source(str(source)))
    step = 8 if kind == "checkpoint" else 12  # a run folder: its newest verified checkpoint
    expected = torch.load(reference / "checkpoints" / f"step-{step:08d}.pt", weights_only=True)["model"]
    assert store.tensor_differences(training.model.state_dict(), expected, "model") == []  # the export is fp32
    assert not torch.equal(fresh, expected["model.embed_tokens.weight"])
    assert training.step == 0 and all(not part.state for part in training.optimizer.parts.values())
    lineage = training.lineage
    assert lineage["kind"] == kind and lineage["source"] == str(source) and lineage["step"] == step
    assert lineage["corpus_manifest_sha256"] == sha256_file(corpus / "corpus_manifest.json")
    file = source / "model.safetensors" if kind == "huggingface" else reference / "checkpoints" / f"step-{step:08d}.pt"
    assert lineage["sha256"] == sha256_file(file)


def test_an_init_from_run_records_its_lineage_and_resumes_bit_for_bit(corpus, reference, tmp_path, capsys):
    source = reference / "checkpoints" / "step-00000012.pt"
    whole, out = tmp_path / "whole", tmp_path / "run"
    assert train.main(options(corpus, whole, "--init-from", str(source), "--seed", "3", steps=8)) == 0
    settings = json.loads((whole / "training_settings.json").read_text())
    assert settings["init_from"]["path"] == str(source) and settings["init_from"]["step"] == 12
    assert settings["init_from"]["sha256"] == sha256_file(source)
    assert train_losses(whole)[1] < train_losses(reference)[1] - 0.5  # it starts from trained weights
    assert (
        train.main(options(corpus, out, "--init-from", str(source), "--seed", "3", "--stop-after-steps", "5", steps=8))
        == 0
    )
    result = run_cli(options(corpus, out, "--init-from", str(source), "--seed", "3", steps=8))  # the same command
    assert "resumed from" in result.stdout and f"its weights first came from {source}" in result.stdout
    assert_same_state(final_state(out), final_state(whole))
    assert train_losses(out) == train_losses(whole)
    assert final_state(out)["settings"]["init_from"] == settings["init_from"]
    model = exported_model(out)  # the model card and training_provenance.json name the source
    card = (model / "README.md").read_text()
    assert f"Initialized from: `{source}` (checkpoint, step 12, sha256 `{sha256_file(source)}`)" in card
    assert "starting from the weights" in card and "from scratch" not in card
    provenance = json.loads((model / "training_provenance.json").read_text())
    assert provenance["init_from"] == settings["init_from"]
    other = reference / "checkpoints" / "step-00000008.pt"  # another source for a folder that holds a run
    capsys.readouterr()
    assert train.main(options(corpus, out, "--init-from", str(other), "--seed", "3", steps=8)) == 0
    assert f"warning: --init-from {other} is not used: {out} already holds a run" in capsys.readouterr().err
    assert final_state(out)["settings"]["init_from"] == settings["init_from"]


def test_init_from_refuses_another_tokenizer_another_shape_and_non_sources(corpus, chat_corpus, reference, tmp_path):
    checkpoint = reference / "checkpoints" / "step-00000008.pt"
    for source in (checkpoint, exported_model(reference)):
        with pytest.raises(
            UserError,
            match=rf"--init-from {source}: its tokenizer is not the corpus' "
            r"\(vocabulary and special tokens sha256 \w+, the corpus' \w+\)",
        ):
            train.main(options(chat_corpus, tmp_path / "a", "--init-from", str(source)))
    with pytest.raises(
        UserError,
        match=rf"--init-from {checkpoint}: its shapes do not fit this run's model .*"
        "model.hidden: 64 there, 32 here",
    ):
        train.main(options(corpus, tmp_path / "b", "--init-from", str(checkpoint), "--hidden", "32"))
    with pytest.raises(  # another preset (a --budget run's, say): the message names the source's
        UserError,
        match=rf"--init-from {checkpoint}: its shapes do not fit this run's model \(the source is --preset tiny, "
        r"this run nano: give --preset tiny\): model.head_dim: 16 there, 64 here",
    ):
        train.main(options(corpus, tmp_path / "b", "--init-from", str(checkpoint), "--preset", "nano"))
    # tiny's own LM head into a tied model: loading both into the one matrix would drop the trained embedding
    with pytest.raises(UserError, match=r"its shapes do not fit .*model.tie_embeddings: False there, True here"):
        train.main(options(corpus, tmp_path / "t", "--init-from", str(checkpoint), "--tie-embeddings"))
    with pytest.raises(UserError, match="lm_head.weight: its own matrix there, tied to model.embed_tokens.weight here"):
        train.main(options(corpus, tmp_path / "t", "--init-from", str(exported_model(reference)), "--tie-embeddings"))
    with pytest.raises(
        UserError,
        match=r"its shapes do not fit .*model.layers.2.self_attn.q_proj.weight: missing "
        "there",
    ):
        train.main(
            options(
                corpus,
                tmp_path / "c",
                "--init-from",
                str(exported_model(reference)),
                "--layers",
                str(train.model_config.PRESETS["tiny"].layers + 1),
            )
        )
    with pytest.raises(UserError, match="no such file or folder"):
        train.main(options(corpus, tmp_path / "d", "--init-from", str(tmp_path / "nothing")))
    with pytest.raises(UserError, match="not a checkpoint, a run folder with checkpoints/ or a Hugging Face"):
        train.main(options(corpus, tmp_path / "e", "--init-from", str(corpus)))
    exported = tmp_path / "exported-run"  # a run folder kept without its checkpoints
    shutil.copytree(exported_model(reference), exported / "model")
    with pytest.raises(UserError, match=f"a run folder without checkpoints; .*: --init-from {exported / 'model'}$"):
        train.main(options(corpus, tmp_path / "e", "--init-from", str(exported)))
    with pytest.raises(UserError, match="give one of them"):
        train.main(options(corpus, tmp_path / "f", "--init-from", str(checkpoint), "--resume", str(checkpoint)))
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(UserError, match="a 'gpt2' model; tinyllm trains Qwen3 models only"):
        train.main(options(corpus, tmp_path / "g", "--init-from", str(gpt2)))
    assert not any((tmp_path / name).exists() for name in "abcdefg")


# ----------------------------------------------------------------------------------------------
# Extending a run on resume: wsd from the stable phase only; cosine never


def test_a_wsd_run_extended_in_its_stable_phase_is_the_longer_run_bit_for_bit(corpus, tmp_path):
    """12 steps (decay from step 7), stopped at 5, extended to 20 and stopped at 15 (inside the extended run),
    then resumed: bit for bit the run planned for 20 steps from the start."""
    planned, out = tmp_path / "planned", tmp_path / "run"
    assert train.main(options(corpus, planned, steps=20)) == 0
    assert train.main(options(corpus, out, "--stop-after-steps", "5", steps=12)) == 0
    assert train.main(options(corpus, out, "--stop-after-steps", "15", steps=20)) == 0
    extended = json.loads((out / "training_settings.json").read_text())
    assert extended["extended"] == [{"at_step": 5, "from_total_steps": 12, "to_total_steps": 20}]
    assert extended["training"]["total_steps"] == 20 and extended["training"]["recipe.decay_steps"] == 8
    result = run_cli(options(corpus, out, steps=20))  # a plain resume inside the extended run
    assert "resumed from" in result.stdout and "step 15/20" in result.stdout
    assert_same_state(final_state(out), final_state(planned))
    assert train_losses(out) == train_losses(planned)
    assert final_state(out)["settings"]["extended"] == extended["extended"]


def test_extension_is_refused_after_the_decay_began_and_with_cosine(corpus, tmp_path):
    wsd, cosine = tmp_path / "wsd", tmp_path / "cosine"
    assert train.main(options(corpus, wsd, "--stop-after-steps", "9", steps=12)) == 0
    with pytest.raises(
        UserError,
        match=r"is a run of 12 steps and this one asks for 20: its length cannot change: its "
        r"decay began at step 7 and it is at step 9: .* Resume it with its length "
        r"\(--target-tokens 1536\), or start a new run from its weights with "
        "--init-from",
    ):
        train.main(options(corpus, wsd, steps=20))
    assert train.main(options(corpus, cosine, "--schedule", "cosine", "--stop-after-steps", "5", steps=12)) == 0
    with pytest.raises(UserError, match="its length cannot change: its schedule is cosine, whose decay spans"):
        train.main(options(corpus, cosine, "--schedule", "cosine", steps=20))
    with pytest.raises(UserError, match=r"settings differ from checkpoint .*seed: 1337 -> 4.*only the length"):
        train.main(options(corpus, wsd, "--seed", "4", steps=20))  # the length with another setting: no extension
    assert train.main(options(corpus, cosine, "--schedule", "cosine", steps=12)) == 0  # its own length resumes


def test_an_extension_keeps_the_warmup_the_rule_chose_for_the_first_length(corpus, tmp_path):
    out = tmp_path / "run"
    first = [
        arg for arg in options(corpus, out, "--optimizer", "adamw", steps=20) if arg not in ("--warmup-steps", "3")
    ]
    assert train.main([*first, "--stop-after-steps", "5"]) == 0  # the rule: 0.05 x 20 = 1 warmup step
    assert json.loads((out / "training_settings.json").read_text())["training"]["recipe.warmup_steps"] == 1
    longer = [arg if arg != str(20 * 4 * 32) else str(60 * 4 * 32) for arg in first]  # the rule would say 3
    assert train.main([*longer, "--stop-after-steps", "6"]) == 0
    settings = json.loads((out / "training_settings.json").read_text())["training"]
    assert settings["recipe.warmup_steps"] == 1 and settings["total_steps"] == 60
    assert settings["recipe.decay_steps"] == 24  # re-derived for the new length: 0.4 x 60
    assert train.main([*longer, "--stop-after-steps", "7"]) == 0  # a plain resume inside the extended run
    assert json.loads((out / "training_settings.json").read_text())["training"] == settings


def test_a_signal_after_the_loop_says_training_has_ended(capsys):
    stop = train.StopRequest()
    stop._handle(signal.SIGTERM, None)
    assert capsys.readouterr().err == "SIGTERM: finishing this step, saving, then stopping\n"
    stop.loop_ended = True  # no step left: the report is what remains
    stop._handle(signal.SIGTERM, None)
    assert capsys.readouterr().err.startswith("SIGTERM: training has already ended; finishing the run's status")
    assert stop.requested
    other_rank = train.StopRequest(is_main=False)  # under torchrun every rank gets the signal: one says so
    other_rank._handle(signal.SIGTERM, None)
    assert other_rank.requested and capsys.readouterr().err == ""


@pytest.mark.parametrize(
    "total_steps, every", [(1, 1), (4, 1), (40, 8), (100, 20), (1250, 250), (1400, 250), (100_000, 250)]
)
def test_the_default_eval_every_gives_a_short_run_a_validation_curve(total_steps, every):
    assert callbacks.default_eval_every(total_steps) == every


def test_the_default_cadence_keeps_validation_near_its_share_and_says_so(corpus, tmp_path, capsys):
    """12 steps of 128 tokens and a validation of 256: 13.3 steps of training would pay for one, so the run
    validates only at its end (a fifth of it: every 2 steps), and the start-up says why."""
    out, argv = tmp_path / "run", options(corpus, tmp_path / "run")
    at = argv.index("--eval-every")
    del argv[at : at + 2]
    assert train.main(argv) == 0
    assert (
        "note: validation only at the end, not every fifth of the run: one reads 256 tokens, and the default keeps "
        "validating near 5% of the training; --eval-every N chooses"
    ) in capsys.readouterr().out
    records = metrics_log.read_metrics(out / "metrics.jsonl")
    assert [record["step"] for record in records if record["kind"] == "eval"] == [12]


@pytest.mark.parametrize(
    "total_steps, validation_tokens, step_tokens, every",
    [
        (116, 28_160, 4096, 46),  # KJV's whole validation split: 28,160 / (3 x 0.05 x 4,096) = 45.8 steps
        (63, 28_160, 8192, 23),  # the fixed nano's one epoch: 22.9
        (1_000, 28_160, 8192, 200),  # a fifth of the run is cheaper
        (40, 28_160, 4096, 0),  # no cadence within the run: only at the end
        (12, 256, 128, 0),  # 13.3 steps
        (11_000, 524_288, 131_072, 250),  # a T4's run: 26.7 steps; at most 250 apart
    ],
)
def test_the_default_eval_every_keeps_validation_near_its_share(total_steps, validation_tokens, step_tokens, every):
    assert callbacks.default_eval_every(total_steps, validation_tokens, step_tokens) == every


# ----------------------------------------------------------------------------------------------
# Document-aware packing (--packing)


def corpus_split(corpus: Path, packing: str, context: int = 32) -> tuple[train_data.TokenSplit, np.ndarray, np.ndarray]:
    """The train split under `packing`, its whole token stream and its document ends."""
    split = train_data.TokenSplit(corpus, corpus_format.load_manifest(corpus), "train", context, None, packing)
    return split, whole_stream(corpus, "train", False), np.fromfile(corpus / "train.docs", dtype="<u8")


def test_masked_rows_are_stream_blocks_with_each_tokens_document(corpus):
    split, stream, ends = corpus_split(corpus, "masked")
    stream_split = corpus_split(corpus, "stream")[0]
    assert split.blocks == stream_split.blocks == (len(stream) - 1) // 32
    rows = [0, 7, split.blocks - 1]
    batch, plain = split.batch(rows, torch.device("cpu")), stream_split.batch(rows, torch.device("cpu"))
    assert torch.equal(batch.inputs, plain.inputs) and torch.equal(batch.targets, plain.targets)
    for row, index in enumerate(rows):
        documents = np.searchsorted(ends, np.arange(index * 32, index * 32 + 32), side="right")
        assert batch.documents.segments[row].tolist() == (documents - documents[0]).tolist()
    assert batch.documents.segments.max() > 0 and batch.documents.has_boundary  # rows with several documents
    rebuilt = attention.documents_of(batch.documents.segments.numpy())
    assert all(torch.equal(a, b) for a, b in zip(batch.documents[:3], rebuilt[:3]))
    assert batch.documents.longest == rebuilt.longest


def test_bestfit_rows_start_at_documents_and_hold_every_document_once(corpus):
    split, stream, ends = corpus_split(corpus, "bestfit")
    starts = set([0, *ends[:-1].tolist()])
    pieces = [span for index in range(split.blocks) for span in split.spans(index)]
    assert sorted(pieces) == sorted(zip(*[array.tolist() for array in train_data.document_pieces(ends, 33)]))
    firsts = [split.spans(index)[0][0] for index in range(split.blocks)]
    later_pieces = set(train_data.document_pieces(ends, 33)[0].tolist()) - starts  # of documents longer than a row
    assert later_pieces and all(first in starts or first in later_pieces for first in firsts)
    assert sum(first in starts for first in firsts) > 0.9 * len(firsts)
    assert all(sum(length for _, length in split.spans(index)) <= 33 for index in range(split.blocks))
    rows = list(range(0, split.blocks, 97))
    batch = split.batch(rows, torch.device("cpu"))
    assert batch.documents is None
    for row, index in enumerate(rows):
        expected = np.concatenate([stream[start : start + length] for start, length in split.spans(index)])
        assert batch.inputs[row, : len(expected) - 1].tolist() == expected[:-1].tolist()
        assert batch.targets[row, : len(expected) - 1].tolist() == expected[1:].tolist()
        assert (batch.targets[row, len(expected) - 1 :] == train_data.IGNORE_INDEX).all()  # padding is never counted
        assert (batch.inputs[row, len(expected) :] == 0).all()  # <pad>
    padded = sum(33 - sum(length for _, length in split.spans(index)) for index in range(split.blocks))
    assert padded < 0.15 * split.blocks * 33  # best fit leaves little room


@pytest.mark.parametrize("packing", train_data.PACKINGS)
def test_rows_are_a_pure_function_so_a_resume_seeks_to_the_same_samples(corpus, tmp_path, packing):
    """A second Training (as a resumed run builds) reads at step 5 exactly what the first reads there."""
    first = in_process_training(corpus, tmp_path / "a", "--packing", packing)
    second = in_process_training(corpus, tmp_path / "b", "--packing", packing)
    blocks = first.data.sampler.micro_batches(5, 0)
    assert blocks == second.data.sampler.micro_batches(5, 0)
    one, other = (training.data.splits["train"].batch(blocks[0], training.device) for training in (first, second))
    assert torch.equal(one.inputs, other.inputs) and torch.equal(one.targets, other.targets)
    assert (one.documents is None) == (other.documents is None) == (packing != "masked")
    if one.documents is not None:
        assert all(torch.equal(a, b) for a, b in zip(one.documents[:3], other.documents[:3]))


def test_the_masked_loss_equals_running_each_document_alone(corpus):
    split = corpus_split(corpus, "masked")[0]
    torch.manual_seed(0)
    model = model_config.build_model(model_config.PRESETS["tiny"], 300).eval()
    batch = split.batch([3, 11], torch.device("cpu"))
    with torch.no_grad():
        masked = losses.language_model_loss(model, *batch[:2], reduction="sum", documents=batch.documents)
        alone = torch.zeros(())
        segments = batch.documents.segments
        for row in range(2):
            for document in segments[row].unique():
                tokens = (segments[row] == document).nonzero().flatten()
                alone += losses.language_model_loss(
                    model, batch.inputs[row : row + 1, tokens], batch.targets[row : row + 1, tokens], reduction="sum"
                )
        across = losses.language_model_loss(model, *batch[:2], reduction="sum")
    assert masked.item() == pytest.approx(alone.item(), rel=1e-5)
    assert abs(across.item() - alone.item()) > 1e-3 * alone.item()  # without the mask they see each other


def test_the_document_mask_reaches_sdpa_under_compile():
    """Compiled, each attention gets the block-diagonal mask (not is_causal), and the same loss as eagerly."""
    torch.manual_seed(0)
    model = model_config.build_model(model_config.PRESETS["tiny"], 300)
    model.config.use_cache = False
    attention.use_attention(model, attention.MASKED)
    inputs, targets = torch.randint(0, 300, (2, 16)), torch.randint(0, 300, (2, 16))
    documents = attention.documents_of(np.array([[0] * 5 + [1] * 11, [0] * 16]))
    masks = []

    def backend(graph_module, example_inputs):
        for node in graph_module.graph.nodes:
            if node.op == "call_function" and "scaled_dot_product_attention" in str(node.target):
                masks.append(
                    (
                        node.kwargs.get("attn_mask", node.args[3] if len(node.args) > 3 else None),
                        node.kwargs.get("is_causal", False),
                    )
                )
        return graph_module.forward

    def loss(inputs, targets, documents):
        return losses.language_model_loss(model, inputs, targets, reduction="sum", documents=documents)

    torch._dynamo.reset()
    compiled = torch.compile(loss, backend=backend)(inputs, targets, documents)
    torch._dynamo.reset()
    assert len(masks) == model_config.PRESETS["tiny"].layers
    assert all(mask is not None and not causal for mask, causal in masks)
    assert compiled.item() == pytest.approx(loss(inputs, targets, documents).item(), rel=1e-6)


def test_bestfit_stop_then_resume_is_bitwise_identical(corpus, tmp_path):
    whole, out = tmp_path / "whole", tmp_path / "run"
    assert train.main(options(corpus, whole, "--packing", "bestfit", steps=8)) == 0
    assert train.main(options(corpus, out, "--packing", "bestfit", "--stop-after-steps", "3", steps=8)) == 0
    with pytest.raises(UserError, match="packing: bestfit -> stream"):  # another packing is another run
        train.main(options(corpus, out, "--packing", "stream", "--resume", "auto", steps=8))
    assert train.main(options(corpus, out, "--packing", "bestfit", "--resume", "auto", steps=8)) == 0
    assert_same_state(final_state(out), final_state(whole))


def test_zero_init_output_zeroes_only_the_output_projections(corpus, tmp_path):
    training = in_process_training(corpus, tmp_path / "run", "--zero-init-output")
    for name, param in training.model.named_parameters():
        assert (param.count_nonzero() == 0) == name.endswith(("o_proj.weight", "down_proj.weight")), name


ROUND_2 = (
    "--muon-coefficients",
    "polar-express",
    "--normuon-beta2",
    "0.95",
    "--cautious-weight-decay",
    "--momentum-warmup-steps",
    "4",
    "--momentum-cooldown-steps",
    "4",
    "--weight-decay-schedule",
    "linear",
    "--zero-init-output",
    "--no-tie-embeddings",
    "--head-lr",
    "0.02",
)


def test_round_2_recipe_stop_then_resume_is_bitwise_identical(corpus, tmp_path):
    """Every recipe option of issue 30 on: NorMuon's second moments travel in the checkpoint, the momentum and
    weight decay schedules are functions of the step."""
    full, split = tmp_path / "full", tmp_path / "split"
    assert train.main(options(corpus, full, *ROUND_2, "--save-every", "6", "--eval-every", "0")) == 0
    assert (
        train.main(
            options(corpus, split, *ROUND_2, "--save-every", "6", "--eval-every", "0", "--stop-after-steps", "5")
        )
        == 0
    )
    state = final_state(split)["optimizer"]["muon"]["state"]
    assert state and all("second_moment" in entry for entry in state.values())
    head = final_state(split)["optimizer"]["adamw"]["param_groups"][-1]  # the untied LM head's own group
    assert head["peak_lr"] == 0.02 and len(head["params"]) == 1
    result = run_cli(options(corpus, split, *ROUND_2, "--save-every", "6", "--eval-every", "0", "--resume", "auto"))
    assert "resumed from" in result.stdout
    assert_same_state(final_state(split), final_state(full))
    assert train_losses(split) == train_losses(full)
