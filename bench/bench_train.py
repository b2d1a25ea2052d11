"""Training speed: train.py against a Hugging Face Trainer loop, MFU, and the checkpoint stall.

    python bench/bench_train.py                  # the issue's benchmark (about 8 minutes on 2 shared cores)
    python bench/bench_train.py --quick          # a smoke run of every part (about 2 minutes)

Three measurements, each against a baseline timed in the same process, with the same
torch thread count, alternating the sides repeat by repeat (the machine is shared, so
medians are reported):

1. tokens/s of train.py's `Training.train_step()` (eager and `--compile`, fp32 and bf16
   autocast) against `transformers.Trainer` + `DataCollatorForLanguageModeling(mlm=False)`
   over the same fixed blocks of the same corpus, same model, batch, grad-accum and
   precision (Trainer defaults otherwise: eval, saving and the progress bar off).
   Target: >= 1.1x in fp32.
2. MFU: `flops_per_token * tokens/s` of train.py against an fp32 `torch.mm` peak (best of
   several square matmuls) measured between the repeats. Target: >= 60% in fp32.
3. Checkpoint stall of a think72-sized state (vocab 33,069, AdamW moments: ~860 MB): the
   time `train.save_checkpoint` (snapshot + background Checkpointer) blocks the loop,
   against a synchronous `torch.save` + sha256 of the same state. Target: <= 25%. The
   extra wall time of the steps that run while the writer works (2 cores: it competes
   with training) is reported beside it.

The corpus is data.py's demo corpus (built into a temporary folder unless --corpus is given).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import hashlib
import io
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import data  # noqa: E402
import model_config  # noqa: E402
import train  # noqa: E402
from common import UserError, run_main  # noqa: E402

TARGET_VS_TRAINER = 1.1
TARGET_MFU = 0.60
TARGET_STALL = 0.25
THINK72_VOCAB = 33_069


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--corpus", default=None, help="corpus folder built by data.py (default: build the demo "
                                                       "corpus in a temporary folder)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads, the same for every side")
    parser.add_argument("--repeats", type=int, default=3, help="alternating repeats per side (median reported)")

    speed = parser.add_argument_group("1-2: tokens/s against the Trainer, and MFU")
    speed.add_argument("--preset", default="micro", choices=list(model_config.PRESETS))
    speed.add_argument("--context", type=int, default=None, help="tokens per block (default: the preset's)")
    speed.add_argument("--batch-size", type=int, default=2, help="blocks per micro-step")
    speed.add_argument("--grad-accum", type=int, default=1, help="micro-steps per optimizer step")
    speed.add_argument("--steps", type=int, default=3, help="timed optimizer steps per repeat and side")
    speed.add_argument("--warmup", type=int, default=1, help="untimed steps before each timed run")
    speed.add_argument("--precisions", default="fp32,bf16", help="comma list of fp32, bf16")
    speed.add_argument("--compile-precisions", default="fp32",
                       help="precisions also timed with train.py --compile (comma list; '' for none)")
    speed.add_argument("--trainer-compile", action="store_true",
                       help="also time the Trainer with torch_compile=True (fp32)")
    speed.add_argument("--matmul-size", type=int, default=2048, help="side of the square fp32 matmul for the peak")

    stall = parser.add_argument_group("3: checkpoint stall")
    stall.add_argument("--stall-preset", default="think72", choices=list(model_config.PRESETS))
    stall.add_argument("--stall-vocab", type=int, default=THINK72_VOCAB, help="vocabulary of the saved model")
    stall.add_argument("--stall-context", type=int, default=32,
                       help="context of the steps around the save (the state's size does not depend on it)")
    stall.add_argument("--stall-steps", type=int, default=6,
                       help="training steps timed after a save, while the writer works")
    stall.add_argument("--skip-stall", action="store_true", help="skip part 3")

    parser.add_argument("--quick", action="store_true",
                        help="smoke run: nano preset, 1 repeat, 2 steps, stall on the micro preset")
    parser.add_argument("--json", default=None, help="also write every figure to this JSON file")
    args = parser.parse_args(argv)
    if args.quick:
        args.preset, args.repeats, args.steps, args.warmup = "nano", 1, 2, 1
        args.stall_preset, args.stall_vocab, args.stall_steps, args.matmul_size = "micro", 4096, 2, 1024
        args.context, args.compile_precisions = 128, "fp32"
    for name in ("threads", "repeats", "batch_size", "grad_accum", "steps", "stall_steps", "matmul_size"):
        if getattr(args, name) <= 0:
            raise UserError(f"--{name.replace('_', '-')} must be positive")
    args.precisions = [item.strip() for item in args.precisions.split(",") if item.strip()]
    args.compile_precisions = [item.strip() for item in args.compile_precisions.split(",") if item.strip()]
    if not args.precisions or set(args.precisions) - {"fp32", "bf16"}:
        raise UserError(f"--precisions takes a comma list of fp32 and bf16, got {','.join(args.precisions)}")
    if set(args.compile_precisions) - set(args.precisions):
        raise UserError("--compile-precisions must be among --precisions")
    return args


# ----------------------------------------------------------------------------------------------
# The two sides of part 1


def ours(corpus: Path, args: argparse.Namespace, precision: str, compiled: bool) -> train.Training:
    """train.py's Training, built as train.py builds it (the same seed, so the same initial model)."""
    argv = ["--data", str(corpus), "--out", "unused", "--device", "cpu", "--preset", args.preset,
            "--batch-size", str(args.batch_size), "--grad-accum", str(args.grad_accum), "--threads", str(args.threads),
            "--precision", precision, "--epochs", "1000", "--warmup-steps", "10"]
    if args.context:
        argv += ["--context", str(args.context)]
    if compiled:
        argv.append("--compile")
    options = train.parse_args(argv)
    return train.build_training(options, train.init_distributed("cpu"))


def time_ours(training: train.Training, steps: int, warmup: int) -> float:
    """tokens/s over `steps` consecutive optimizer steps, after `warmup` untimed ones."""
    for _ in range(warmup):
        training.train_step()
    started = time.perf_counter()
    for _ in range(steps):
        training.train_step()
    return steps * training.tokens_per_step / (time.perf_counter() - started)


class HFSide:
    """The usual Hugging Face recipe: fixed blocks in a Dataset, the LM collator, Trainer defaults."""

    def __init__(self, corpus: Path, reference: train.Training, args: argparse.Namespace, workdir: Path):
        import datasets
        import numpy as np
        from transformers import AutoTokenizer, DataCollatorForLanguageModeling

        split, context = reference.splits["train"], reference.context
        blocks = np.stack([split.block(index)[:context] for index in range(split.blocks)])
        self.dataset = datasets.Dataset.from_dict({"input_ids": blocks.tolist()})
        tokenizer = AutoTokenizer.from_pretrained(corpus / "tokenizer")
        if tokenizer.pad_token is None:
            raise UserError(f"{corpus / 'tokenizer'} has no pad token; the LM collator needs one")
        self.collator = DataCollatorForLanguageModeling(tokenizer=tokenizer, mlm=False)
        self.model = build_like(reference)
        self.args, self.workdir = args, workdir
        self.tokens_per_step = args.batch_size * args.grad_accum * context

    def time(self, precision: str, steps: int, warmup: int, compiled: bool = False) -> float:
        import torch
        from transformers import Trainer, TrainerCallback, TrainingArguments

        marks: list[float] = []
        threads: list[int] = []

        class StepClock(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                marks.append(time.perf_counter())
                threads.append(torch.get_num_threads())

        options = TrainingArguments(
            output_dir=str(self.workdir / "hf"), use_cpu=True, report_to="none", save_strategy="no",
            eval_strategy="no", disable_tqdm=True, per_device_train_batch_size=self.args.batch_size,
            gradient_accumulation_steps=self.args.grad_accum, max_steps=warmup + steps, learning_rate=6e-4,
            weight_decay=0.1, adam_beta2=0.95, max_grad_norm=train.GRAD_CLIP, warmup_steps=10,
            lr_scheduler_type="cosine", bf16=precision == "bf16", torch_compile=compiled, seed=1337,
        )
        trainer = Trainer(model=self.model, args=options, train_dataset=self.dataset, data_collator=self.collator,
                          callbacks=[StepClock()])
        with contextlib.redirect_stdout(io.StringIO()):  # the Trainer's closing metrics line
            trainer.train()
        if set(threads) != {self.args.threads}:
            raise RuntimeError(f"the Trainer ran with {set(threads)} torch threads, not {self.args.threads}")
        return steps * self.tokens_per_step / (marks[-1] - marks[warmup - 1] if warmup else marks[-1] - marks[0])


def build_like(reference: train.Training):
    """A Qwen3ForCausalLM of the same shape and initial weights as train.py's model."""
    model = model_config.build_model(reference.preset, reference.vocab_size, pad_token_id=0, bos_token_id=1,
                                     eos_token_id=2)
    model.load_state_dict(reference.model.state_dict())
    model.config.use_cache = False
    return model


def matmul_peak(size: int, tries: int = 5) -> float:
    """fp32 FLOP/s of the fastest of `tries` square matmuls with the current thread count."""
    import torch

    generator = torch.Generator().manual_seed(0)
    a, b = torch.randn(size, size, generator=generator), torch.randn(size, size, generator=generator)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(tries):
        started = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - started)
    return 2 * size**3 / best


# ----------------------------------------------------------------------------------------------
# Part 1-2: alternate the sides, repeat by repeat


def run_speed(corpus: Path, args: argparse.Namespace, workdir: Path) -> dict:
    sides: dict[str, Callable[[], float]] = {}
    flops, hf = {}, None
    for precision in args.precisions:
        eager = ours(corpus, args, precision, compiled=False)
        flops[precision] = eager.flops_per_token
        if hf is None:
            hf = HFSide(corpus, eager, args, workdir)
        sides[f"trainer {precision}"] = lambda p=precision, side=hf: side.time(p, args.steps, args.warmup)
        sides[f"train.py {precision} eager"] = lambda t=eager: time_ours(t, args.steps, args.warmup)
        if precision in args.compile_precisions:
            compiled = ours(corpus, args, precision, compiled=True)
            print(f"compiling train.py's model ({precision}) ...", flush=True)
            started = time.perf_counter()
            compiled.train_step()
            print(f"  first compiled step: {time.perf_counter() - started:.1f} s", flush=True)
            sides[f"train.py {precision} compiled"] = lambda t=compiled: time_ours(t, args.steps, args.warmup)
    if args.trainer_compile and "fp32" in args.precisions:
        sides["trainer fp32 compiled"] = lambda: hf.time("fp32", args.steps, args.warmup + 1, compiled=True)
    sides["matmul peak fp32"] = lambda: matmul_peak(args.matmul_size)

    samples: dict[str, list[float]] = {name: [] for name in sides}
    for repeat in range(args.repeats):
        order = list(sides) if repeat % 2 == 0 else list(reversed(sides))
        for name in order:
            value = sides[name]()
            samples[name].append(value)
            unit = "GFLOP/s" if name.startswith("matmul") else "tok/s"
            scaled = value / 1e9 if name.startswith("matmul") else value
            print(f"  repeat {repeat + 1}/{args.repeats} {name:<28} {scaled:>10,.1f} {unit}", flush=True)
    medians = {name: statistics.median(values) for name, values in samples.items()}
    return {"samples": samples, "medians": medians, "flops_per_token": flops,
            "tokens_per_step": args.batch_size * args.grad_accum * (args.context or
                                                                    model_config.PRESETS[args.preset].context)}


def speed_summary(result: dict, args: argparse.Namespace) -> list[tuple[str, str, str]]:
    """(figure, value, verdict) rows."""
    medians, rows = result["medians"], []
    peak = medians["matmul peak fp32"]
    for precision in args.precisions:
        base = medians[f"trainer {precision}"]
        for kind in ("eager", "compiled"):
            name = f"train.py {precision} {kind}"
            if name not in medians:
                continue
            ratio = medians[name] / base
            verdict = ("target >= 1.1x: " + ("met" if ratio >= TARGET_VS_TRAINER else "NOT met")) \
                if precision == "fp32" else "reported"
            rows.append((f"{name} / trainer {precision} (tokens/s)", f"{ratio:.2f}x", verdict))
    if "trainer fp32 compiled" in medians:
        best_ours = max(medians.get(f"train.py fp32 {kind}", 0) for kind in ("eager", "compiled"))
        ratio = best_ours / medians["trainer fp32 compiled"]
        rows.append(("best train.py fp32 / trainer fp32 compiled", f"{ratio:.2f}x", "reported"))
    for precision in args.precisions:
        for kind in ("eager", "compiled"):
            name = f"train.py {precision} {kind}"
            if name in medians:
                mfu = result["flops_per_token"][precision] * medians[name] / peak
                verdict = ("target >= 60%: " + ("met" if mfu >= TARGET_MFU else "NOT met")) if precision == "fp32" \
                    else "against the fp32 peak"
                rows.append((f"MFU {name} (of fp32 matmul peak)", f"{100 * mfu:.1f}%", verdict))
    return rows


# ----------------------------------------------------------------------------------------------
# Part 3: checkpoint stall


def stall_training(corpus: Path, args: argparse.Namespace) -> train.Training:
    """A Training whose model has the stall preset's shape at --stall-vocab, with AdamW state.

    train.build_training takes the vocabulary from the corpus; we pass Training a manifest with
    the vocab raised instead (the demo corpus' token ids are all valid in a larger vocabulary).
    """
    argv = ["--data", str(corpus), "--out", "unused", "--device", "cpu", "--preset", args.stall_preset,
            "--context", str(args.stall_context), "--batch-size", "1", "--grad-accum", "1",
            "--threads", str(args.threads), "--precision", "fp32", "--epochs", "1000"]
    options = train.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    manifest = dict(train.load_manifest(corpus), vocab_size=args.stall_vocab)
    training = train.Training(options, train.init_distributed("cpu"), manifest, corpus)
    training.train_step()  # AdamW's moments exist from the first step on
    return training


def synchronous_save(state: dict, path: Path) -> dict:
    """torch.save then sha256 of the file, on the calling thread (seconds of each, and with fsync)."""
    import torch

    started = time.perf_counter()
    with open(path, "wb") as handle:
        torch.save(state, handle)
        handle.flush()
        saved = time.perf_counter()
        os.fsync(handle.fileno())
        synced = time.perf_counter()
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(8 << 20):
            digest.update(block)
    hashed = time.perf_counter()
    size = path.stat().st_size
    path.unlink()
    return {"save_s": saved - started, "fsync_s": synced - saved, "sha256_s": hashed - synced,
            "seconds": (saved - started) + (hashed - synced), "with_fsync_s": hashed - started, "bytes": size}


def background_save(training: train.Training, folder: Path, steps: int) -> dict:
    """Blocked time of one train.save_checkpoint, and the wall time of `steps` steps after it + wait."""
    checkpointer = train.Checkpointer(folder, training.run_id, keep_last=1, keep_every=0)
    started = time.perf_counter()
    train.save_checkpoint(training, checkpointer, None)
    blocked = time.perf_counter() - started
    for _ in range(steps):
        training.train_step()
    after_steps = time.perf_counter()
    checkpointer.wait()
    finished = time.perf_counter()
    latest = json.loads((folder / "latest.json").read_text())
    return {"blocked_s": blocked, "steps_and_wait_s": finished - started, "wait_at_end_s": finished - after_steps,
            "write_s": checkpointer.last_write_seconds, "bytes": latest["bytes"]}


def run_stall(corpus: Path, args: argparse.Namespace, workdir: Path) -> dict:
    training = stall_training(corpus, args)
    parameters = model_config.parameter_count(training.preset, training.vocab_size)
    print(f"checkpoint stall: {args.stall_preset} at vocab {args.stall_vocab:,} ({parameters:,} parameters)",
          flush=True)
    first = background_save(training, workdir / "checkpoints-first", 0)  # allocates the staging buffers
    shutil.rmtree(workdir / "checkpoints-first")
    print(f"  first save (staging buffers allocated): blocked {first['blocked_s']:.3f} s, "
          f"background write {first['write_s']:.2f} s", flush=True)
    rows: dict[str, list] = {"sync": [], "background": [], "steps_alone_s": []}
    for repeat in range(args.repeats):
        folder = workdir / f"checkpoints-{repeat}"
        started = time.perf_counter()
        for _ in range(args.stall_steps):
            training.train_step()
        rows["steps_alone_s"].append(time.perf_counter() - started)
        rows["background"].append(background_save(training, folder, args.stall_steps))
        shutil.rmtree(folder)
        state = training.snapshot()
        rows["sync"].append(synchronous_save(state, workdir / "sync.pt"))
        del state
        sync, back = rows["sync"][-1], rows["background"][-1]
        print(f"  repeat {repeat + 1}/{args.repeats}: sync torch.save {sync['save_s']:.2f} s + sha256 "
              f"{sync['sha256_s']:.2f} s (fsync {sync['fsync_s']:.2f} s); train.py blocked {back['blocked_s']:.3f} s, "
              f"background write {back['write_s']:.2f} s; {args.stall_steps} steps alone "
              f"{rows['steps_alone_s'][-1]:.2f} s, after the save + wait {back['steps_and_wait_s']:.2f} s", flush=True)
    median = statistics.median
    sync_s = median(item["seconds"] for item in rows["sync"])
    blocked = median(item["blocked_s"] for item in rows["background"])
    extra = median(item["steps_and_wait_s"] - alone for item, alone in zip(rows["background"], rows["steps_alone_s"]))
    return {"samples": rows, "first_save": first, "parameters": parameters, "bytes": rows["sync"][0]["bytes"],
            "sync_s": sync_s, "sync_with_fsync_s": median(item["with_fsync_s"] for item in rows["sync"]),
            "blocked_s": blocked, "extra_wall_s": extra,
            "write_s": median(item["write_s"] for item in rows["background"])}


def stall_summary(result: dict) -> list[tuple[str, str, str]]:
    ratio = result["blocked_s"] / result["sync_s"]
    return [
        ("checkpoint size", f"{result['bytes'] / 1e6:,.0f} MB", f"{result['parameters']:,} parameters + AdamW"),
        ("sync torch.save + sha256 (no fsync)", f"{result['sync_s']:.2f} s",
         f"with fsync {result['sync_with_fsync_s']:.2f} s"),
        ("train.py loop blocked by the first save", f"{result['first_save']['blocked_s']:.3f} s",
         "allocates the reused staging buffers"),
        ("train.py loop blocked by one save (later saves)", f"{result['blocked_s']:.3f} s",
         f"background write {result['write_s']:.2f} s"),
        ("blocked / sync", f"{100 * ratio:.1f}%", "target <= 25%: " + ("met" if ratio <= TARGET_STALL else "NOT met")),
        ("extra wall time of the steps overlapping the write", f"{result['extra_wall_s']:.2f} s",
         f"{100 * result['extra_wall_s'] / result['sync_s']:.0f}% of sync (CPU shared with the writer)"),
    ]


# ----------------------------------------------------------------------------------------------
# The recipe


def machine_facts(threads: int) -> dict:
    import torch
    import transformers

    return {"date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "threads": threads,
            "cpu_count": os.cpu_count(), "cpu": platform.processor() or platform.machine(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "load_average_1min": round(os.getloadavg()[0], 2)}


def print_rows(title: str, rows: list[tuple[str, str, str]]) -> None:
    print(f"\n{title}")
    for figure, value, verdict in rows:
        print(f"  {figure:<52} {value:>10}   {verdict}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    warnings.filterwarnings("ignore")
    import torch

    torch.set_num_threads(args.threads)
    facts = machine_facts(args.threads)
    print("machine: " + ", ".join(f"{key} {value}" for key, value in facts.items()), flush=True)
    with tempfile.TemporaryDirectory(prefix="bench_train-") as temp:
        workdir = Path(temp)
        corpus = Path(args.corpus) if args.corpus else data.build_demo_corpus(workdir / "corpus", progress=False)
        print(f"corpus: {corpus}", flush=True)
        speed = run_speed(corpus, args, workdir)
        rows = speed_summary(speed, args)
        stall = None if args.skip_stall else run_stall(corpus, args, workdir)
    facts["load_average_1min_at_end"] = round(os.getloadavg()[0], 2)

    preset = model_config.resolve_preset(args.preset, context=args.context)
    print(f"\ntokens/s medians ({args.repeats} alternating repeats, {args.steps} steps each, {args.threads} threads, "
          f"{args.preset} context {preset.context}, batch {args.batch_size} x accum {args.grad_accum}):")
    for name, value in speed["medians"].items():
        text = f"{value / 1e9:,.1f} GFLOP/s" if name.startswith("matmul") else f"{value:,.0f} tok/s"
        print(f"  {name:<28} {text}")
    print_rows("ratios (speed, MFU)", rows)
    if stall:
        print_rows("checkpoint stall (medians)", stall_summary(stall))
    if args.json:
        record = {"machine": facts, "argv": sys.argv[1:], "speed": speed, "speed_rows": rows,
                  "stall": stall, "stall_rows": stall_summary(stall) if stall else None}
        with contextlib.suppress(FileNotFoundError):
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    run_main(main)
