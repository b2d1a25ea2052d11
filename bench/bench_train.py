"""Training speed: train.py against a Hugging Face Trainer loop, MFU, and the checkpoint stall.

    python bench/bench_train.py                  # the issue's benchmark (~2 minutes on 2 quiet cores)
    python bench/bench_train.py --quick          # a smoke run of every part (~20 s once compiled kernels are cached)

Under load from other processes, 2-thread steps slow down several-fold; compare with --threads 1.

Everything runs in one process with the same torch thread count on every side. The machine
is shared, so the sides are interleaved and medians reported:

1. tokens/s of train.py's `Training.train_step()` (eager and `--compile`, fp32 and bf16
   autocast) against `transformers.Trainer` + `DataCollatorForLanguageModeling(mlm=False)`
   over the same fixed blocks of the same corpus: same model and initial weights, batch,
   grad-accum and precision (Trainer defaults otherwise; no eval, no saving, no progress
   bar). A Trainer callback runs one step of every train.py side after each Trainer step,
   so the samples of all sides are taken seconds apart. Target: >= 1.1x in fp32.
2. MFU: `flops_per_token * tokens/s` of train.py against an fp32 `torch.mm` peak (best of
   three square matmuls), sampled between the same steps. Target: >= 60% in fp32.
3. Checkpoint stall of a think72-sized state (vocab 33,069 with AdamW moments, ~860 MB):
   the time `train.save_checkpoint` (staging copy + background Checkpointer) blocks the
   loop, against a synchronous `torch.save` + sha256 of the same state, in alternating
   repeats. Target: <= 25%. (On 2 cores the background writer also takes CPU from the
   steps that overlap it; its duration is printed.)

The corpus is data.py's demo corpus (built in a temporary folder unless --corpus is given).
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

from tinyllm.common import ArgumentParser, UserError, run_main  # noqa: E402
from tinyllm.data import build as data  # noqa: E402
from tinyllm.model import config as model_config  # noqa: E402
from tinyllm.store import checkpoint_store as store  # noqa: E402
from tinyllm.training import (  # noqa: E402
    distributed,
    train,
)

TARGET_VS_TRAINER = 1.1
TARGET_MFU = 0.60
TARGET_STALL = 0.25
THINK72_VOCAB = 33_069
SECOND_COMPILED = "train.py fp32 compiled (beside the compiled Trainer)"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument(
        "--corpus",
        default=None,
        help="corpus folder built by data.py (None: build the demo corpus in a temporary folder)",
    )
    parser.add_argument("--threads", type=int, default=2, help="torch threads, the same for every side")
    parser.add_argument("--repeats", type=int, default=5, help="checkpoint stall: alternating repeats per side")

    speed = parser.add_argument_group("1-2: tokens/s against the Trainer, and MFU")
    speed.add_argument("--preset", default="micro", choices=list(model_config.PRESETS), help="model shape")
    speed.add_argument("--context", type=int, default=None, help="tokens per block (None: the preset's)")
    speed.add_argument("--batch-size", type=int, default=2, help="blocks per micro-step")
    speed.add_argument("--grad-accum", type=int, default=1, help="micro-steps per optimizer step")
    speed.add_argument("--steps", type=int, default=12, help="timed optimizer steps per side (median reported)")
    speed.add_argument("--warmup", type=int, default=2, help="untimed steps per side first")
    speed.add_argument("--precisions", default="fp32,bf16", help="comma list of fp32, bf16")
    speed.add_argument(
        "--compile-precisions",
        default="fp32",
        help="precisions also timed with train.py --compile (comma list; '' for none)",
    )
    speed.add_argument(
        "--trainer-compile", action="store_true", help="also time the Trainer with torch_compile=True (fp32)"
    )
    speed.add_argument("--matmul-size", type=int, default=2048, help="side of the square fp32 matmul for the peak")

    stall = parser.add_argument_group("3: checkpoint stall")
    stall.add_argument(
        "--stall-preset", default="think72", choices=list(model_config.PRESETS), help="model shape whose state is saved"
    )
    stall.add_argument("--stall-vocab", type=int, default=THINK72_VOCAB, help="vocabulary of the saved model")
    stall.add_argument(
        "--stall-context",
        type=int,
        default=32,
        help="context of the steps around the save (the state's size does not depend on it)",
    )
    stall.add_argument("--skip-stall", action="store_true", help="skip part 3")

    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: nano preset at context 128, 2 steps, compile fp32 only, 1 stall repeat on the micro preset",
    )
    parser.add_argument("--json", default=None, help="also write every figure to this JSON file")
    args = parser.parse_args(argv)
    if args.quick:
        args.preset, args.repeats, args.steps, args.warmup = "nano", 1, 2, 1
        args.stall_preset, args.stall_vocab, args.matmul_size = "micro", 4096, 1024
        args.context, args.compile_precisions = 128, "fp32"
    for name in ("threads", "repeats", "batch_size", "grad_accum", "steps", "matmul_size"):
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
# Parts 1-2: the sides interleaved step by step, inside one Trainer run per precision


def ours(corpus: Path, args: argparse.Namespace, precision: str, compiled: bool) -> train.Training:
    """train.py's Training, built as train.py builds it (the same seed, so the same initial model)."""
    argv = [
        "--data",
        str(corpus),
        "--out",
        "unused",
        "--device",
        "cpu",
        "--preset",
        args.preset,
        "--batch-size",
        str(args.batch_size),
        "--grad-accum",
        str(args.grad_accum),
        "--threads",
        str(args.threads),
        "--precision",
        precision,
        "--epochs",
        "1000",
        "--warmup-steps",
        "10",
    ]
    if args.context:
        argv += ["--context", str(args.context)]
    if compiled:
        argv.append("--compile")
    options = train.parse_args(argv)
    return train.build_training(options, distributed.init_distributed("cpu"))


def step_seconds(training: train.Training) -> tuple[float, float]:
    """Wall and process CPU seconds of one train.py optimizer step (data, micro-steps, clipping, AdamW)."""
    started, cpu_started = time.perf_counter(), time.process_time()
    training.train_step()
    return time.perf_counter() - started, time.process_time() - cpu_started


def matmul_peak(size: int, tries: int = 3) -> tuple[float, float]:
    """fp32 FLOP per wall second and per CPU second of the fastest of `tries` square matmuls."""
    import torch

    generator = torch.Generator().manual_seed(0)
    a, b = torch.randn(size, size, generator=generator), torch.randn(size, size, generator=generator)
    torch.mm(a, b)
    best = (float("inf"), float("inf"))
    for _ in range(tries):
        started, cpu_started = time.perf_counter(), time.process_time()
        torch.mm(a, b)
        best = min(best, (time.perf_counter() - started, time.process_time() - cpu_started))
    return 2 * size**3 / best[0], 2 * size**3 / best[1]


def build_like(reference: train.Training):
    """A Qwen3ForCausalLM of the same shape and initial weights as train.py's model."""
    model = model_config.build_model(
        reference.preset, reference.vocab_size, pad_token_id=0, bos_token_id=1, eos_token_id=2
    )
    model.load_state_dict(reference.model.state_dict())
    model.config.use_cache = False
    return model


class HFSide:
    """The usual Hugging Face recipe: the corpus' fixed blocks in a Dataset, the LM collator, a Trainer.

    `run` trains `warmup + steps` Trainer steps; after each one a callback runs one step of
    every other side (train.py's Training objects, the matmul peak), so each sample of every
    side is taken within seconds of the others (the machine is shared). The Trainer's step
    is the time from the end of one callback to the next on_step_end.
    """

    def __init__(self, corpus: Path, reference: train.Training, args: argparse.Namespace, workdir: Path):
        import datasets
        import numpy as np
        from transformers import AutoTokenizer, DataCollatorForLanguageModeling

        split, context = reference.data.splits["train"], reference.context
        blocks = np.stack([split.block(index)[:context] for index in range(split.blocks)])
        self.dataset = datasets.Dataset.from_dict({"input_ids": blocks.tolist()})
        tokenizer = AutoTokenizer.from_pretrained(corpus / "tokenizer")
        if tokenizer.pad_token is None:
            raise UserError(f"{corpus / 'tokenizer'} has no pad token; the LM collator needs one")
        self.collator = DataCollatorForLanguageModeling(tokenizer=tokenizer, mlm=False)
        self.model = build_like(reference)
        self.args, self.workdir, self.grad_clip = args, workdir, reference.recipe.grad_clip

    def run(
        self, precision: str, others: dict[str, Callable[[], float]], compiled: bool = False
    ) -> dict[str, list[float]]:
        """Samples per side: seconds per step (Trainer and train.py), FLOP/s for the matmul."""
        import torch
        from transformers import Trainer, TrainerCallback, TrainingArguments

        name = f"trainer {precision}" + (" compiled" if compiled else "")
        samples: dict[str, list[float]] = {name: [], **{other: [] for other in others}}
        warmup, threads = self.args.warmup, self.args.threads

        class Interleave(TrainerCallback):
            resumed = (0.0, 0.0)

            def on_step_begin(self, args, state, control, **kwargs):
                if not self.resumed[0]:
                    self.resumed = time.perf_counter(), time.process_time()

            def on_step_end(self, args, state, control, **kwargs):
                seconds = time.perf_counter() - self.resumed[0], time.process_time() - self.resumed[1]
                if torch.get_num_threads() != threads:
                    raise RuntimeError(f"the Trainer runs with {torch.get_num_threads()} threads, not {threads}")
                keep = state.global_step > warmup
                if keep:
                    samples[name].append(seconds)
                order = list(others)
                shift = state.global_step % len(order) if order else 0
                for other in order[shift:] + order[:shift]:
                    value = others[other]()
                    if keep:
                        samples[other].append(value)
                self.resumed = time.perf_counter(), time.process_time()

        options = TrainingArguments(
            output_dir=str(self.workdir / "hf"),
            use_cpu=True,
            report_to="none",
            save_strategy="no",
            eval_strategy="no",
            disable_tqdm=True,
            per_device_train_batch_size=self.args.batch_size,
            gradient_accumulation_steps=self.args.grad_accum,
            max_steps=warmup + self.args.steps,
            learning_rate=6e-4,
            weight_decay=0.1,
            adam_beta2=0.95,
            max_grad_norm=self.grad_clip,
            warmup_steps=10,
            lr_scheduler_type="cosine",
            bf16=precision == "bf16",
            torch_compile=compiled,
            seed=1337,
        )
        trainer = Trainer(
            model=self.model,
            args=options,
            train_dataset=self.dataset,
            data_collator=self.collator,
            callbacks=[Interleave()],
        )
        with contextlib.redirect_stdout(io.StringIO()):  # the Trainer's closing metrics line
            trainer.train()
        return samples


def run_speed(corpus: Path, args: argparse.Namespace, workdir: Path) -> dict:
    hf, samples, flops, compiled = None, {}, {}, {}
    peak = {"matmul peak fp32": lambda: matmul_peak(args.matmul_size)}
    for precision in args.precisions:
        eager = ours(corpus, args, precision, compiled=False)
        flops[precision] = eager.flops_per_token
        hf = hf or HFSide(corpus, eager, args, workdir)
        others = {f"train.py {precision} eager": lambda t=eager: step_seconds(t)}
        if precision in args.compile_precisions:
            compiled[precision] = ours(corpus, args, precision, compiled=True)
            print(f"compiling train.py's model ({precision}) ...", flush=True)
            print(f"  first compiled step: {step_seconds(compiled[precision])[0]:.1f} s", flush=True)
            others[f"train.py {precision} compiled"] = lambda t=compiled[precision]: step_seconds(t)
        print(
            f"{precision}: {args.warmup} + {args.steps} Trainer steps, each followed by one step of "
            f"{', '.join(others)} and a matmul",
            flush=True,
        )
        for name, values in hf.run(precision, {**others, **peak}).items():
            samples.setdefault(name, []).extend(values)
    if args.trainer_compile and "fp32" in args.precisions:
        print(
            "fp32: the Trainer with torch_compile=True, each step followed by one of train.py fp32 compiled", flush=True
        )
        others = {SECOND_COMPILED: lambda: step_seconds(compiled["fp32"])} if "fp32" in compiled else {}
        for name, values in hf.run("fp32", others, compiled=True).items():
            samples.setdefault(name, []).extend(values)
    tokens_per_step = hf.args.batch_size * hf.args.grad_accum * eager.context
    return summarize_speed(samples, flops, tokens_per_step)


def summarize_speed(samples: dict[str, list[tuple[float, float]]], flops: dict[str, int], tokens_per_step: int) -> dict:
    """Medians of tokens/s and of the matmul peak, per wall second and per CPU second; step-paired ratios.

    Samples are (wall, CPU) seconds per step, or (per wall, per CPU) FLOP/s for the matmul.
    """

    def rates(name: str, clock: int) -> list[float]:
        values = [sample[clock] for sample in samples[name]]
        return values if name.startswith("matmul") else [tokens_per_step / value for value in values]

    medians = {name: statistics.median(rates(name, 0)) for name in samples}
    cpu_medians = {name: statistics.median(rates(name, 1)) for name in samples}
    bests = {name: max(rates(name, 0)) for name in samples}
    paired = {}
    for name, values in samples.items():
        if name.startswith("train.py") and name != SECOND_COMPILED:
            trainer = samples[f"trainer {name.split()[1]}"]
            paired[name] = statistics.median(base[0] / ours[0] for base, ours in zip(trainer, values))
    return {
        "samples_wall_cpu": samples,
        "medians": medians,
        "cpu_medians": cpu_medians,
        "bests": bests,
        "paired_ratio_medians": paired,
        "flops_per_token": flops,
        "tokens_per_step": tokens_per_step,
    }


def speed_summary(result: dict) -> list[tuple[str, str, str]]:
    """(figure, median value, notes) rows: tokens/s ratios against the Trainer, MFU.

    Beside each median: the same figure from each side's fastest step (the quietest moment
    of a shared machine) and, for ratios, the median of step-by-step ratios.
    """
    medians, bests, paired, rows = result["medians"], result["bests"], result["paired_ratio_medians"], []
    cpu = result["cpu_medians"]
    for name, pair in paired.items():
        precision = name.split()[1]
        ratio = medians[name] / medians[f"trainer {precision}"]
        best = bests[name] / bests[f"trainer {precision}"]
        per_cpu = cpu[name] / cpu[f"trainer {precision}"]
        target = (
            ("target >= 1.1x: " + ("met" if ratio >= TARGET_VS_TRAINER else "NOT met"))
            if precision == "fp32"
            else "no target"
        )
        rows.append(
            (
                f"{name} / trainer {precision} (tokens/s)",
                f"{ratio:.2f}x",
                f"per CPU-s {per_cpu:.2f}x, best-of {best:.2f}x, step-paired {pair:.2f}x; {target}",
            )
        )
    if "trainer fp32 compiled" in medians and SECOND_COMPILED in medians:
        ratio = medians[SECOND_COMPILED] / medians["trainer fp32 compiled"]
        best = bests[SECOND_COMPILED] / bests["trainer fp32 compiled"]
        pair = statistics.median(
            base[0] / ours[0]
            for base, ours in zip(
                result["samples_wall_cpu"]["trainer fp32 compiled"], result["samples_wall_cpu"][SECOND_COMPILED]
            )
        )
        rows.append(
            (
                "train.py fp32 compiled / trainer fp32 torch_compile",
                f"{ratio:.2f}x",
                f"best-of {best:.2f}x, step-paired {pair:.2f}x; no target",
            )
        )
    for name in paired:
        precision = name.split()[1]
        per_token = result["flops_per_token"][precision]
        mfu = per_token * medians[name] / medians["matmul peak fp32"]
        best = per_token * bests[name] / bests["matmul peak fp32"]
        per_cpu = per_token * cpu[name] / cpu["matmul peak fp32"]
        target = (
            ("target >= 60%: " + ("met" if mfu >= TARGET_MFU else "NOT met"))
            if precision == "fp32"
            else "no target (bf16 work against the fp32 peak)"
        )
        rows.append(
            (
                f"MFU {name} (of the fp32 matmul peak)",
                f"{100 * mfu:.1f}%",
                f"per CPU-s {100 * per_cpu:.1f}%, best-of {100 * best:.1f}%; {target}",
            )
        )
    return rows


# ----------------------------------------------------------------------------------------------
# Part 3: checkpoint stall


def stall_training(corpus: Path, args: argparse.Namespace) -> train.Training:
    """A Training whose model has the stall preset's shape at --stall-vocab, with AdamW state."""
    argv = [
        "--data",
        str(corpus),
        "--out",
        "unused",
        "--device",
        "cpu",
        "--preset",
        args.stall_preset,
        "--context",
        str(args.stall_context),
        "--batch-size",
        "1",
        "--grad-accum",
        "1",
        "--threads",
        str(args.threads),
        "--precision",
        "fp32",
        "--epochs",
        "1000",
    ]
    training = train.build_training(train.parse_args(argv), distributed.init_distributed("cpu"), args.stall_vocab)
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
    return {
        "save_s": saved - started,
        "fsync_s": synced - saved,
        "sha256_s": hashed - synced,
        "seconds": (saved - started) + (hashed - synced),
        "with_fsync_s": hashed - started,
        "bytes": size,
    }


def background_save(training: train.Training, folder: Path) -> dict:
    """Seconds one train.save_checkpoint blocks the caller, then (untimed) the background write's own seconds."""
    checkpointer = store.Checkpointer(folder, training.run_id, keep_last=1, keep_every=0)
    started = time.perf_counter()
    train.save_checkpoint(training, checkpointer, None, {})
    blocked = time.perf_counter() - started
    checkpointer.wait()
    latest = json.loads((folder / "latest.json").read_text())
    shutil.rmtree(folder)
    return {"blocked_s": blocked, "write_s": checkpointer.last_write_seconds, "bytes": latest["bytes"]}


def run_stall(corpus: Path, args: argparse.Namespace, workdir: Path) -> dict:
    training = stall_training(corpus, args)
    parameters = model_config.parameter_count(training.preset, training.vocab_size)
    print(
        f"checkpoint stall: {args.stall_preset} at vocab {args.stall_vocab:,} ({parameters:,} parameters), "
        f"{args.repeats} alternating repeats",
        flush=True,
    )
    first = background_save(training, workdir / "checkpoints-first")  # allocates the staging buffers
    print(
        f"  first save (staging buffers allocated): blocked {first['blocked_s']:.3f} s, "
        f"background write {first['write_s']:.2f} s",
        flush=True,
    )
    rows: dict[str, list] = {"sync": [], "background": []}
    for repeat in range(args.repeats):
        training.train_step()  # the state changes between saves, as in training
        sides = [
            ("sync", lambda: synchronous_save(training.snapshot(), workdir / "sync.pt")),
            ("background", lambda r=repeat: background_save(training, workdir / f"checkpoints-{r}")),
        ]
        for side, measure in sides if repeat % 2 == 0 else reversed(sides):
            rows[side].append(measure())
        sync, back = rows["sync"][-1], rows["background"][-1]
        print(
            f"  repeat {repeat + 1}/{args.repeats}: sync torch.save {sync['save_s']:.2f} s + sha256 "
            f"{sync['sha256_s']:.2f} s (+ fsync {sync['fsync_s']:.2f} s); train.py blocked {back['blocked_s']:.3f} s "
            f"(background write {back['write_s']:.2f} s)",
            flush=True,
        )
    median = statistics.median
    return {
        "samples": rows,
        "first_save": first,
        "parameters": parameters,
        "bytes": rows["sync"][0]["bytes"],
        "sync_s": median(item["seconds"] for item in rows["sync"]),
        "sync_with_fsync_s": median(item["with_fsync_s"] for item in rows["sync"]),
        "blocked_s": median(item["blocked_s"] for item in rows["background"]),
        "write_s": median(item["write_s"] for item in rows["background"]),
        "ratios": [back["blocked_s"] / sync["seconds"] for back, sync in zip(rows["background"], rows["sync"])],
    }


def stall_summary(result: dict) -> list[tuple[str, str, str]]:
    ratio = result["blocked_s"] / result["sync_s"]
    paired = statistics.median(result["ratios"])
    return [
        ("checkpoint size", f"{result['bytes'] / 1e6:,.0f} MB", f"{result['parameters']:,} parameters + AdamW"),
        ("sync torch.save + sha256", f"{result['sync_s']:.2f} s", f"with fsync {result['sync_with_fsync_s']:.2f} s"),
        (
            "train.py loop blocked by the first save",
            f"{result['first_save']['blocked_s']:.3f} s",
            "allocates the reused staging buffers",
        ),
        (
            "train.py loop blocked by a later save",
            f"{result['blocked_s']:.3f} s",
            f"then written in the background in {result['write_s']:.2f} s",
        ),
        (
            "blocked / sync",
            f"{100 * ratio:.1f}%",
            f"repeat-paired {100 * paired:.1f}%; target <= 25%: " + ("met" if ratio <= TARGET_STALL else "NOT met"),
        ),
        (
            "first save blocked / sync",
            f"{100 * result['first_save']['blocked_s'] / result['sync_s']:.1f}%",
            "no target",
        ),
    ]


# ----------------------------------------------------------------------------------------------
# The recipe


def machine_facts(threads: int) -> dict:
    import torch
    import transformers

    return {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "threads": threads,
        "cpu_count": os.cpu_count(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "load_average_1min": round(os.getloadavg()[0], 2),
    }


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
        rows = speed_summary(speed)
        stall = None if args.skip_stall else run_stall(corpus, args, workdir)
    facts["load_average_1min_at_end"] = round(os.getloadavg()[0], 2)

    preset = model_config.resolve_preset(args.preset, context=args.context)
    print(
        f"\nmedians of {args.steps} steps per side, interleaved step by step ({args.threads} threads, "
        f"{args.preset} context {preset.context}, batch {args.batch_size} x grad-accum {args.grad_accum}, "
        f"{speed['flops_per_token'][args.precisions[0]] / 1e6:.1f} MFLOP/token):"
    )
    for name, value in speed["medians"].items():
        best, cpu = speed["bests"][name], speed["cpu_medians"][name]
        text = (
            f"{value / 1e9:,.1f} GFLOP/s (best {best / 1e9:,.1f}; per CPU-s {cpu / 1e9:,.1f})"
            if name.startswith("matmul")
            else f"{value:,.0f} tok/s (best step {best:,.0f}; per CPU-s {cpu:,.0f})"
        )
        print(f"  {name:<28} {text}")
    print_rows("ratios (speed, MFU)", rows)
    if stall:
        print_rows("checkpoint stall (medians)", stall_summary(stall))
    if args.json:
        record = {
            "machine": facts,
            "argv": sys.argv[1:],
            "speed": speed,
            "speed_rows": rows,
            "stall": stall,
            "stall_rows": stall_summary(stall) if stall else None,
        }
        with contextlib.suppress(FileNotFoundError):
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    run_main(main)
