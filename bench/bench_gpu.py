"""The first GPU run in one safe command: training speed, memory, kernels, and the GPU-only checks.

    torchrun --nproc_per_node=$(nvidia-smi -L | wc -l) bench/bench_gpu.py --json OUT/gpu.json --max-seconds 540
    python bench/bench_gpu.py --json OUT/gpu.json       # one GPU
    bash bench/gpu_check.sh OUT                         # the same, after a CPU-side sanity run, under a time limit
    python bench/bench_gpu.py --device cpu --preset tiny --vocab 0 --context 32 --steps 2 --warmup 1
                                                        # a smoke run of every part on CPU (tests/test_bench_gpu.py)
    python bench/bench_gpu.py --predict-only            # the throughput prediction table of docs/training.md

It needs nothing beyond requirements.txt. It first prints what `--precision auto` resolves to on this
card and why (hardware.choose_precision, attention.choose_attention, newton_schulz_dtype), the card's row of
hardware.CARDS and the predicted think72 step (hardware.predict_card). Then the parts, in this order
(cheap correctness checks before the long compiles, so that a short budget still covers them):

- side PRESET:PRECISION:MODE: train.py's own `Training` (train.build_training) stepping `train_step()`
  at the README's split (batch 8 x grad-accum 4 per GPU, DDP under torchrun); `--warmup` untimed steps
  (compilation happens there), then `--steps` timed ones. Figures: tokens/s (median step), MFU against
  hardware.peak_tflops, peak memory (reset per side), the attention kernels the profiler saw launched
  in one extra step, and the Muon optimizer step timed on its own. Precisions: fp16 (+ GradScaler)
  everywhere, bf16 only where the card has it natively (emulated bf16 is skipped with a note);
  eager, then --compile. The first side is think72 in the auto precision, eager;
- newton_schulz: Muon's orthogonalization of every think72 matrix, timed alone, in torch's bf16 and in
  hardware.newton_schulz_dtype;
- overflow: an fp16 step whose loss is scaled by inf must skip BOTH optimizers (weights and optimizer
  states bitwise unchanged, the loss scale lowered), and the next step must apply;
- snapshot: Training.snapshot() (the staging buffers) equals the state before it, twice in a row;
- resume: a checkpoint saved through store.Checkpointer and loaded by Training.load continues like the
  uninterrupted run: bitwise when train.py has --deterministic (then used), else the largest relative
  weight difference is reported;
- the other sides of think72, then small125 and medium350 (--also) as memory allows.

Every part runs in its own try/except: an error (or CUDA out of memory) is recorded with its text, the
memory is freed and the next part runs. The JSON (--json) is rewritten atomically after every part and
every event is appended to a JSONL beside it, so a kill or a time-out still leaves the numbers so far.
--max-seconds skips the parts that would start after the budget (a part that started runs to its end).
Under torchrun every rank runs every part (the sides are DDP) and rank 0 writes; the ranks decide
together whether a part starts. An error on one rank only (say an out-of-memory on one card) leaves
the others waiting in a collective until --collective-timeout ends the process: the file keeps every
part before it. At the end it prints the markdown lines to paste into bench/RESULTS.md.

The model is the preset's shape at vocab 33,069 (--vocab) over the demo corpus (built in a temporary
folder unless --corpus is given): its token ids are all valid in the larger vocabulary, so think72 has
its 72,000,000 parameters and the step its work.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import gc
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import checkpoint_store as store  # noqa: E402
import distributed  # noqa: E402
import hardware  # noqa: E402
import model_config  # noqa: E402
from common import ArgumentParser, UserError, append_jsonl, atomic_write_json, run_main  # noqa: E402

THINK72_VOCAB = 33_069
MATMUL_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
CHECK_PARTS = ["newton_schulz", "overflow", "snapshot", "resume"]
# Substrings of the profiler's op and kernel names that belong to attention (lower case), by kernel.
ATTENTION_KINDS = [  # cuDNN's kernel names say "flash" too: it is looked for first
    ("cudnn", ("cudnn_attention", "cudnn_generated_fort_native_sdpa")),
    ("flash", ("flash",)),
    ("efficient", ("efficient_attention", "fmha", "mem_efficient")),
    ("math", ("attention_math",)),
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", default=None,
                        help="corpus folder built by data.py (None: build the demo corpus in a temporary folder)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke run of the logic")
    parser.add_argument("--preset", default="think72", choices=list(model_config.PRESETS),
                        help="the model of the first sides and of every check")
    parser.add_argument("--also", default=None,
                        help="comma list of further presets for sides after the checks (None: small125,medium350 on "
                             "cuda, none on cpu; '' for none)")
    parser.add_argument("--vocab", type=int, default=THINK72_VOCAB, help="model vocabulary (0: the corpus tokenizer's)")
    parser.add_argument("--context", type=int, default=None, help="tokens per block (None: the preset's)")
    parser.add_argument("--batch-size", type=int, default=8, help="blocks per micro-step per GPU (the README's)")
    parser.add_argument("--grad-accum", type=int, default=4, help="micro-steps per optimizer step (the README's)")
    parser.add_argument("--precisions", default="auto",
                        help="comma list of fp16, bf16, fp32; auto: the card's auto precision first, then fp16 "
                             "(bf16 only with bf16 tensor cores; fp32 on cpu)")
    parser.add_argument("--compile-modes", default="eager,compile", help="comma list of eager, compile")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per side (compilation included)")
    parser.add_argument("--steps", type=int, default=8, help="timed optimizer steps per side (median reported)")
    parser.add_argument("--check-batch-size", type=int, default=2, help="blocks per step of the checks")
    parser.add_argument("--matmul-size", type=int, default=None,
                        help="side of the square matmul measured per dtype (None: 8192 on cuda, 256 on cpu)")
    parser.add_argument("--peak-tflops", type=float, default=0,
                        help="the card's dense peak for MFU (0: hardware.CARDS by GPU name)")
    parser.add_argument("--max-seconds", type=float, default=0,
                        help="skip the parts that would start after this many seconds (0: no budget)")
    parser.add_argument("--collective-timeout", type=float, default=600,
                        help="seconds a rank waits in a collective before the process ends (torchrun)")
    parser.add_argument("--json", default=None, help="write every figure here after each part (and events to "
                                                     "NAME.events.jsonl beside it)")
    parser.add_argument("--only", default=None, metavar="PARTS",
                        help="comma list: run only the parts whose names start with one of these (e.g. side:think72,"
                             "resume; matmul included)")
    parser.add_argument("--inject-failure", default=None, metavar="PART",
                        help="raise in this part (side name or check), to test that the others still run")
    parser.add_argument("--predict-only", action="store_true",
                        help="print the throughput prediction table (docs/training.md) and exit")
    args = parser.parse_args(argv)
    if args.matmul_size is None:
        args.matmul_size = 8192 if args.device == "cuda" else 256
    for name in ("batch_size", "grad_accum", "steps", "warmup", "matmul_size", "check_batch_size"):
        if getattr(args, name) <= 0:
            raise UserError(f"--{name.replace('_', '-')} must be positive")
    if args.vocab < 0:
        raise UserError("--vocab must be 0 (the corpus') or a vocabulary size")
    args.precisions = split_list(args.precisions)
    args.compile_modes = split_list(args.compile_modes)
    args.only = split_list(args.only) if args.only is not None else None
    if args.precisions != ["auto"] and (not args.precisions or set(args.precisions) - set(MATMUL_DTYPES)):
        raise UserError(f"--precisions takes auto or a comma list of bf16, fp16, fp32, got {','.join(args.precisions)}")
    if not args.compile_modes or set(args.compile_modes) - {"eager", "compile"}:
        raise UserError(f"--compile-modes takes a comma list of eager and compile, got {','.join(args.compile_modes)}")
    args.also = split_list(args.also if args.also is not None else
                           ("small125,medium350" if args.device == "cuda" else ""))
    unknown = [name for name in args.also if name not in model_config.PRESETS]
    if unknown:
        raise UserError(f"--also: unknown preset(s) {', '.join(unknown)}; "
                        f"choose from {', '.join(model_config.PRESETS)}")
    return args


def split_list(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


# ----------------------------------------------------------------------------------------------
# The plan: which sides run on this card (pure functions, tested in tests/test_bench_gpu.py).


def side_precisions(requested: list[str], device: hardware.Device) -> tuple[list[str], list[str]]:
    """(the precisions to run, notes on those left out). auto: the card's auto precision first, then fp16;
    bf16 (asked for or not) only where the card has bf16 tensor cores: emulated bf16 is slower than fp32
    and says nothing about a real run."""
    auto = hardware.choose_precision("auto", device).value
    if requested == ["auto"]:
        wanted = [auto] + (["fp16"] if device.is_cuda and auto != "fp16" else [])
    else:
        wanted = list(dict.fromkeys(requested))
    notes = []
    if "bf16" in wanted and device.is_cuda and not device.native_bf16:
        wanted.remove("bf16")
        notes.append(f"bf16 skipped: {device.label()} has no bf16 tensor cores (it would run emulated)")
    if requested == ["auto"] and device.is_cuda and not device.native_bf16:
        notes.append(f"bf16 not run: {device.label()} has no bf16 tensor cores")
    return wanted, notes


def plan_parts(preset: str, also: list[str], precisions: list[str], modes: list[str],
               only: list[str] | None = None) -> list[str]:
    """Part names in running order: the first side (preset, first precision, first mode), the checks,
    the preset's other sides, then each further preset's sides; `only`: the names starting with one of these."""
    sides = [f"side:{preset}:{precision}:{mode}" for precision in precisions for mode in modes]
    later = [f"side:{name}:{precision}:{mode}" for name in also if name != preset
             for precision in precisions for mode in modes]
    parts = sides[:1] + CHECK_PARTS + sides[1:] + later
    return parts if only is None else [name for name in parts if any(name.startswith(prefix) for prefix in only)]


def attention_kernels(names: list[str]) -> dict:
    """The attention kernels among the profiler's op and kernel names: {"kinds": [...], "names": [...]}.

    A cutlass GEMM is not attention; the memory-efficient kernel's cutlass names carry "fmha"."""
    kinds, matched = [], []
    for name in names:
        lowered = name.lower()
        for kind, needles in ATTENTION_KINDS:
            if any(needle in lowered for needle in needles):
                matched.append(name)
                if kind not in kinds:
                    kinds.append(kind)
                break
    return {"kinds": kinds, "names": sorted(set(matched))[:12]}


def relative_difference(a, b) -> float:
    """max |a - b| / max |a| over two tensors (0 for equal ones)."""
    scale = a.abs().max().item()
    diff = (a.double() - b.double()).abs().max().item()
    return diff / scale if scale else diff


# ----------------------------------------------------------------------------------------------
# Recording: every part in its own try/except, the JSON rewritten after each.


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:400] if text else ''}"


class Recorder:
    """Runs the parts on every rank, records their outcomes on rank 0 (JSON after each, JSONL events)."""

    def __init__(self, args: argparse.Namespace, info, record: dict):
        self.args, self.info, self.record = args, info, record
        self.started = time.monotonic()
        self.json = Path(args.json) if args.json and info.is_main else None
        self.events = self.json.with_name(self.json.stem + ".events.jsonl") if self.json else None
        if self.json:
            self.json.parent.mkdir(parents=True, exist_ok=True)
            if self.events.exists():
                self.events.unlink()
        self.save()

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def save(self) -> None:
        if self.json:
            self.record["elapsed_seconds"] = round(self.elapsed(), 1)
            atomic_write_json(self.json, self.record)

    def event(self, **fields) -> None:
        if self.events:
            append_jsonl(self.events, {"time": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                                       "elapsed_seconds": round(self.elapsed(), 1), **fields})

    def log(self, message: str) -> None:
        if self.info.is_main:
            print(message, flush=True)

    def over_budget(self) -> bool:

        over = bool(self.args.max_seconds) and self.elapsed() >= self.args.max_seconds
        return distributed.broadcast_from_main(over, self.info)  # every rank takes rank 0's decision

    def run(self, name: str, function) -> dict:
        parts = self.record["parts"]
        if self.over_budget():
            outcome = {"status": "skipped", "reason": f"--max-seconds {self.args.max_seconds:g} spent"}
            parts[name] = outcome
            self.event(part=name, **outcome)
            self.save()
            self.log(f"{name}: skipped (--max-seconds {self.args.max_seconds:g} spent)")
            return outcome
        self.log(f"{name} ...")
        self.event(part=name, status="started")
        started = time.perf_counter()
        details = None
        try:
            if self.args.inject_failure == name:
                raise RuntimeError(f"injected failure (--inject-failure {name})")
            figures = function()
            outcome = {"status": "ok" if figures.get("passed", True) else "failed", **figures}
        except Exception as error:  # noqa: BLE001 - every failure is a finding to record, never the end
            import torch

            oom = isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower()
            outcome = {"status": "oom" if oom else "error", "error": first_line(error)}
            frames = traceback.extract_tb(error.__traceback__)
            if frames:
                outcome["where"] = f"{Path(frames[-1].filename).name}:{frames[-1].lineno} ({frames[-1].name})"
            details = traceback.format_exc()
        free_memory()
        outcome["seconds"] = round(time.perf_counter() - started, 2)
        outcome = self.gather(outcome)
        parts[name] = outcome
        self.event(part=name, **outcome, **({"traceback": details} if details else {}))
        self.save()
        self.log(f"{name}: {summary(outcome)}")
        return outcome

    def gather(self, outcome: dict) -> dict:
        """Rank 0's outcome, with every other rank's status (and error) when one differs."""
        if self.info.world == 1:
            return outcome
        import torch.distributed as dist

        every = [None] * self.info.world
        dist.all_gather_object(every, {key: outcome.get(key) for key in ("status", "error")})
        if any(other != every[0] for other in every):
            outcome = {**outcome, "ranks": every}
            if outcome["status"] == "ok":
                outcome["status"] = "error"
        return outcome


def summary(outcome: dict) -> str:
    if outcome["status"] in ("error", "oom"):
        return f"{outcome['status']}: {outcome.get('error')} ({outcome.get('seconds')} s)"
    shown = {key: value for key, value in outcome.items() if isinstance(value, (int, float, str, bool))
             and key not in ("status",)}
    text = ", ".join(f"{key} {format_value(value)}" for key, value in list(shown.items())[:10])
    return f"{outcome['status']}: {text}"


def format_value(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def free_memory() -> None:
    import torch

    gc.collect()
    if "torch._dynamo" in sys.modules:  # compiled sides leave their graphs (importing it costs seconds)
        torch._dynamo.reset()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------------
# The parts.


class Bench:
    """What every part needs: the options, the rank, the corpus, the device's description."""

    def __init__(self, args: argparse.Namespace, info, corpus: Path, work: Path):
        self.args, self.info, self.corpus, self.work = args, info, corpus, work
        self.device = hardware.describe(info.device)
        self.vocab = args.vocab or None

    def options(self, preset: str, precision: str, compiled: bool = False, batch_size: int | None = None,
                grad_accum: int | None = None, out: Path | None = None, extra: list[str] | None = None):
        import train

        argv = ["--data", str(self.corpus), "--out", str(out or self.work / "unused"), "--device", self.args.device,
                "--preset", preset, "--batch-size", str(batch_size or self.args.batch_size),
                "--grad-accum", str(grad_accum or self.args.grad_accum), "--precision", precision,
                "--epochs", "1000", "--warmup-steps", "10", *(extra or [])]
        if self.args.context:
            argv += ["--context", str(self.args.context)]
        if compiled:
            argv.append("--compile")
        return train.parse_args(argv)

    def build(self, options):
        import train

        return train.build_training(options, self.info, self.vocab)

    def synchronize(self) -> None:
        import torch

        if self.info.device.type == "cuda":
            torch.cuda.synchronize(self.info.device)

    def peak_flops(self, precision: str) -> float | None:
        if self.args.peak_tflops:
            return self.args.peak_tflops * 1e12
        tflops = hardware.peak_tflops(self.device, precision)
        return tflops * 1e12 if tflops else None

    # -- a side ---------------------------------------------------------------------------

    def side(self, preset: str, precision: str, compiled: bool) -> dict:
        """Median tokens/s, MFU, peak memory, attention kernels and the Muon step of one side."""
        import torch

        training = self.build(self.options(preset, precision, compiled))
        muon_timer = OptimizerTimer(training, "muon", self.info.device)
        if self.info.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.info.device)
        started = time.perf_counter()
        training.train_step()
        first_step = time.perf_counter() - started
        for _ in range(self.args.warmup - 1):
            training.train_step()
        muon_timer.clear()
        seconds, skipped_before = [], training.scaler.skipped_total
        for _ in range(self.args.steps):
            seconds.append(training.train_step().seconds)
        muon_seconds = muon_timer.seconds()
        peak_memory = torch.cuda.max_memory_allocated(self.info.device) if self.info.device.type == "cuda" else None
        kernels = profile_attention(training, self.info.device)
        world = self.info.world
        tokens_per_step = self.args.batch_size * self.args.grad_accum * world * training.context
        tokens_per_second = tokens_per_step / statistics.median(seconds)
        peak = self.peak_flops(precision)
        per_gpu_flops = training.flops_per_token * tokens_per_second / world
        return {
            "preset": preset, "precision": precision, "compiled": compiled, "world": world,
            "batch_size": self.args.batch_size, "grad_accum": self.args.grad_accum, "context": training.context,
            "parameters": model_config.parameter_count(training.preset, training.vocab_size),
            "tokens_per_step": tokens_per_step, "tokens_per_second": tokens_per_second,
            "tokens_per_second_per_gpu": tokens_per_second / world,
            "best_tokens_per_second": tokens_per_step / min(seconds), "step_seconds": seconds,
            "first_step_seconds": first_step, "flops_per_token": training.flops_per_token,
            "peak_flops": peak, "mfu": per_gpu_flops / peak if peak else None,
            "peak_memory_bytes": peak_memory, "overflow_skipped_steps": training.scaler.skipped_total - skipped_before,
            "attention_plan": training.sdpa, "attention_kinds": kernels["kinds"], "attention_names": kernels["names"],
            "muon_step_ms": 1000 * statistics.median(muon_seconds) if muon_seconds else None,
        }

    # -- Newton-Schulz on its own -----------------------------------------------------------

    def newton_schulz(self) -> dict:
        """Muon's orthogonalization of every matrix of the preset, timed alone per dtype."""
        import torch

        preset = model_config.resolve_preset(self.args.preset)
        shapes = hardware.muon_matrix_shapes(preset)
        flops = sum(hardware.newton_schulz_flops(*shape) for shape in shapes)
        generator = torch.Generator(device=self.info.device).manual_seed(0)
        grads = [torch.randn(*shape, device=self.info.device, generator=generator) for shape in shapes]
        result = {"preset": self.args.preset, "matrices": len(shapes), "flops_per_step": flops,
                  "train_dtype": hardware.newton_schulz_dtype(self.device)}
        for name in dict.fromkeys(["bf16", hardware.newton_schulz_dtype(self.device)]):
            dtype = getattr(torch, MATMUL_DTYPES[name])
            seconds = time_on_device(lambda dtype=dtype: [orthogonalize(grad, dtype) for grad in grads],
                                     self.info.device)
            result[f"{name}_ms"] = 1000 * seconds
            result[f"{name}_tflops"] = flops / seconds / 1e12
        return result

    # -- the fp16 overflow skips both optimizers ---------------------------------------------

    def overflow(self) -> dict:

        training = self.build(self.options(self.args.preset, "fp16", batch_size=self.args.check_batch_size,
                                           grad_accum=1))
        training.train_step()  # optimizer states exist (AdamW's moments, Muon's momentum)
        model_before = clone(training.model.state_dict())
        optimizer_before = clone(optimizer_states(training))
        scale_before = training.scaler.scaler.get_scale()
        step_before, skipped_before = training.step, training.scaler.skipped_total
        scale = training.scaler.scale
        training.scaler.scale = lambda loss: scale(loss) * math.inf
        try:
            forced = training.train_step()
        finally:
            del training.scaler.scale
        checks = {
            "step_not_applied": not forced.applied and training.step == step_before,
            "weights_unchanged": store.tensor_differences(training.model.state_dict(), model_before, "model") == [],
            "optimizer_states_unchanged":
                store.tensor_differences(optimizer_states(training), optimizer_before, "optimizer") == [],
            "scale_lowered": training.scaler.scaler.get_scale() < scale_before,
            "skip_counted": training.scaler.skipped_total == skipped_before + 1,
        }
        after = training.train_step()
        checks["next_step_applied"] = after.applied and training.step == step_before + 1 and \
            store.tensor_differences(training.model.state_dict(), model_before, "model") != []
        return {"passed": all(checks.values()), "optimizers": sorted(training.optimizer.parts), **checks,
                "scale_before": scale_before, "scale_after": training.scaler.scaler.get_scale()}

    # -- the staged snapshot equals the state ---------------------------------------------------

    def snapshot(self) -> dict:

        training = self.build(self.options(self.args.preset, "auto", batch_size=self.args.check_batch_size,
                                           grad_accum=1))
        checks, seconds = {}, []
        for round_ in (1, 2):  # the second snapshot refills the buffers of the first
            training.train_step()
            expected = {"model": clone(training.model.state_dict()),
                        "optimizer": clone(training.optimizer.state_dict()),
                        "scaler": training.scaler.state_dict()}
            started = time.perf_counter()
            staged = training.snapshot()
            seconds.append(time.perf_counter() - started)
            if staged is None:
                continue  # not rank 0
            differences = store.tensor_differences(staged["model"], expected["model"], "model") + \
                store.tensor_differences(staged["optimizer"], expected["optimizer"], "optimizer")
            checks[f"snapshot_{round_}_equal"] = not differences and staged["step"] == training.step \
                and staged["scaler"]["skipped_total"] == expected["scaler"]["skipped_total"]
            if differences:
                checks[f"snapshot_{round_}_differs_at"] = ", ".join(differences[:5])
            if self.info.device.type == "cuda":
                checks[f"snapshot_{round_}_pinned"] = all(
                    buffer.is_pinned() for buffer in training.staging.buffers.values())
        passed = all(value for key, value in checks.items() if not key.endswith("differs_at"))
        return {"passed": passed, "precision": training.precision, **checks,
                "snapshot_seconds": seconds, "staging_bytes": sum(
                    buffer.numel() * buffer.element_size() for buffer in training.staging.buffers.values())}

    # -- save, resume, continue: equal to the uninterrupted run ------------------------------

    def resume(self) -> dict:
        import train

        deterministic = "--deterministic" in train.build_parser()._option_string_actions
        out = Path(distributed.broadcast_from_main(tempfile.mkdtemp(prefix="resume-", dir=self.work), self.info))
        options = self.options(self.args.preset, "auto", batch_size=self.args.check_batch_size, grad_accum=2,
                               out=out, extra=["--deterministic"] if deterministic else [])
        before, after = 2, 2
        first = self.build(options)
        for _ in range(before):
            first.train_step()
        staged = first.snapshot()
        if self.info.is_main:
            checkpointer = store.Checkpointer(out / "checkpoints", first.run_id, keep_last=2, keep_every=0)
            checkpointer.save(staged, first.step)
            checkpointer.close()
        distributed.broadcast_from_main(None, self.info)  # the checkpoint is on disk before any rank reads it
        uninterrupted = [first.train_step().loss for _ in range(after)]
        expected = clone(first.model.state_dict())
        del first, staged
        free_memory()
        second = self.build(options)
        path = distributed.main_decides(lambda: store.find_resume_checkpoint(out, "auto"), self.info)
        second.load(store.load_checkpoint_file(path), path)
        resumed_at = second.step
        resumed = [second.train_step().loss for _ in range(after)]
        state = second.model.state_dict()
        bitwise = store.tensor_differences(state, expected, "model") == []
        worst = max(relative_difference(expected[name], state[name].detach().cpu()) for name in expected
                    if expected[name].is_floating_point())
        return {"passed": bitwise if deterministic else worst < 1e-2, "deterministic_option": deterministic,
                "resumed_at_step": resumed_at, "checkpoint": path.name, "losses_uninterrupted": uninterrupted,
                "losses_resumed": resumed, "losses_equal": uninterrupted == resumed, "bitwise": bitwise,
                "max_relative_weight_difference": worst}


def clone(obj):
    """A CPU copy of a state dict (tensors cloned, containers rebuilt)."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {key: clone(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(clone(value) for value in obj)
    return obj


def optimizer_states(training) -> dict:
    """Each optimizer's per-parameter state (moments, momentum, step counts), without the param groups
    (their lr follows the step the schedule is at)."""
    return {name: state["state"] for name, state in training.optimizer.state_dict().items()}


def orthogonalize(grad, dtype):
    """torch.optim.Muon's quintic Newton-Schulz (torch.optim._muon, 5 steps), in `dtype` (torch's is bf16)."""
    a, b, c = (3.4445, -4.775, 2.0315)
    x = grad.to(dtype)
    if grad.size(0) > grad.size(1):
        x = x.T
    x = x / x.norm().clamp(min=1e-7)
    for _ in range(5):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if grad.size(0) > grad.size(1) else x


def time_on_device(function, device, repeats: int = 5) -> float:
    """Median seconds of `function()` after two untimed calls: CUDA events on a GPU, perf_counter on CPU."""
    import torch

    for _ in range(2):
        function()
    seconds = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            function()
            end.record()
            end.synchronize()
            seconds.append(start.elapsed_time(end) / 1000)
        else:
            started = time.perf_counter()
            function()
            seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


class OptimizerTimer:
    """Times each call of `training.optimizer.parts[name].step` (CUDA events on a GPU, read only in
    seconds(): no sync of its own inside the step)."""

    def __init__(self, training, name: str, device):
        self.device, self.marks = device, []
        optimizer = training.optimizer.parts.get(name)
        if optimizer is None:
            return
        step = optimizer.step

        def timed(*args, **kwargs):
            start = self.mark()
            result = step(*args, **kwargs)
            self.marks.append((start, self.mark()))
            return result

        optimizer.step = timed

    def mark(self):
        import torch

        if self.device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def clear(self) -> None:
        self.marks = []

    def seconds(self) -> list[float]:
        if self.device.type != "cuda":
            return [end - start for start, end in self.marks]
        if self.marks:
            self.marks[-1][1].synchronize()
        return [start.elapsed_time(end) / 1000 for start, end in self.marks]


def profile_attention(training, device) -> dict:
    """The attention ops and kernels launched in one more training step (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as profiler:
        training.train_step()
    return attention_kernels([event.key for event in profiler.key_averages()])


def matmul_tflops(device, precision: str, size: int) -> float:
    """TFLOP/s of a square matmul in the precision's dtype (median of 5, CUDA events on a GPU)."""
    import torch

    dtype = getattr(torch, MATMUL_DTYPES[precision])
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, device=device, generator=generator).to(dtype)
    b = torch.randn(size, size, device=device, generator=generator).to(dtype)
    return 2 * size**3 / time_on_device(lambda: torch.mm(a, b), device) / 1e12


# ----------------------------------------------------------------------------------------------
# What is printed first and last.


def machine_facts(info, args: argparse.Namespace) -> dict:
    import torch
    import transformers

    import attention
    import train

    device = hardware.describe(info.device)
    preset = model_config.resolve_preset(args.preset, context=args.context)
    precision = hardware.choose_precision("auto", device)
    plan = attention.choose_attention(device, precision.value, preset.head_dim)
    card = hardware.card_of(device)
    facts = {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "device": device.label(),
        "world": info.world, "torch": torch.__version__, "cuda": torch.version.cuda,
        "transformers": transformers.__version__, "python": platform.python_version(),
        "memory_gib": round(device.memory_bytes / 2**30, 1), "gpus": device.count if device.is_cuda else 0,
        "precision_auto": precision.value, "precision_reason": precision.reason,
        "attention_kernel": plan.label(), "attention_reason": plan.reason,
        "newton_schulz_dtype": hardware.newton_schulz_dtype(device),
        "wrap_order": hardware.wrap_order(True, info.world),
        "card": dataclasses.asdict(card) if card else None,
        "deterministic_option": "--deterministic" in train.build_parser()._option_string_actions,
        "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
    }
    if card:
        step = hardware.predict_card(card, preset, args.vocab or THINK72_VOCAB, world=max(1, info.world),
                                     tokens_per_step=args.batch_size * args.grad_accum * max(1, info.world)
                                     * preset.context, micro_batch_tokens=args.batch_size * preset.context)
        facts["prediction"] = {**dataclasses.asdict(step), "total_s": step.total_s,
                               "tokens_per_second": step.tokens_per_second, "mfu": hardware.ASSUMED_MFU[card.key],
                               "hours_for_1.5B_tokens": step.hours_for(1.5e9)}
    return facts


def print_plan(facts: dict, notes: list[str], parts: list[str]) -> None:
    print(f"device: {facts['device']} x{facts['world']}, torch {facts['torch']} (CUDA {facts['cuda']}), "
          f"transformers {facts['transformers']}", flush=True)
    print(f"--precision auto -> {facts['precision_auto']}: {facts['precision_reason']}")
    print(f"attention -> {facts['attention_kernel']}: {facts['attention_reason']}")
    print(f"Newton-Schulz dtype -> {facts['newton_schulz_dtype']}; wrapping (innermost first) under --compile: "
          f"{' > '.join(facts['wrap_order'])}; train.py --deterministic: "
          f"{'present' if facts['deterministic_option'] else 'absent (resume closeness is reported instead)'}")
    card = facts["card"]
    print("card row: " + (", ".join(f"{key} {value}" for key, value in card.items()) if card
                          else "none (a CPU, or a GPU not in hardware.CARDS: no MFU unless --peak-tflops)"))
    if facts.get("prediction"):
        prediction = facts["prediction"]
        print(f"predicted (hardware.predict_card, MFU {prediction['mfu']} assumed): step {prediction['total_s']:.3f} s "
              f"= compute {prediction['compute_s']:.3f} + Newton-Schulz {prediction['newton_schulz_s']:.3f} + "
              f"optimizer {prediction['optimizer_s']:.3f} + all-reduce {prediction['all_reduce_s']:.3f}; "
              f"{prediction['tokens_per_second']:,.0f} tokens/s")
    for note in notes:
        print(f"note: {note}")
    print("parts: " + ", ".join(parts), flush=True)


def gib(value) -> str:
    return f"{value / 2**30:.2f} GiB" if value else "n/a"


def markdown_lines(record: dict) -> list[str]:
    """The lines for bench/RESULTS.md: a table of the sides, then one line per check."""
    facts, parts = record["machine"], record["parts"]
    lines = [f"### GPU: {facts['device']} x{facts['world']} ({facts['date']}, torch {facts['torch']}, "
             f"CUDA {facts['cuda']})", "", f"`{record['command']}`", ""]
    lines += ["| side | tokens/s (all GPUs) | per GPU | MFU | peak memory | attention launched | Muon step "
              "| 1st step |", "| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: |"]
    for name, part in parts.items():
        if not name.startswith("side:"):
            continue
        label = name[len("side:"):].replace(":", " ")
        if part["status"] != "ok":
            lines.append(f"| {label} | {part['status']}: {part.get('error') or part.get('reason', '')} | | | | | | |")
            continue
        mfu = f"{100 * part['mfu']:.1f}%" if part.get("mfu") else "n/a"
        muon = f"{part['muon_step_ms']:.1f} ms" if part.get("muon_step_ms") is not None else "n/a"
        lines.append(f"| {label} | {part['tokens_per_second']:,.0f} | {part['tokens_per_second_per_gpu']:,.0f} | "
                     f"{mfu} | {gib(part['peak_memory_bytes'])} | {', '.join(part['attention_kinds']) or 'none seen'} "
                     f"| {muon} | {part['first_step_seconds']:.1f} s |")
    lines.append("")
    for name, part in parts.items():
        if name.startswith("side:"):
            continue
        if part["status"] not in ("ok", "failed"):
            lines.append(f"- {name}: {part['status']}: {part.get('error') or part.get('reason', '')}")
            continue
        lines.append(f"- {name}: {part['status']}; " + check_text(name, part))
    if facts.get("prediction"):
        prediction = facts["prediction"]
        first = next((part for name, part in parts.items() if name.startswith("side:") and part["status"] == "ok"),
                     None)
        measured = f"; measured (first side) {first['tokens_per_second']:,.0f}" if first else ""
        lines.append(f"- prediction (hardware.predict_card, MFU {prediction['mfu']} assumed): "
                     f"{prediction['tokens_per_second']:,.0f} tokens/s{measured}")
    return lines


def check_text(name: str, part: dict) -> str:
    if name == "newton_schulz":
        figures = [f"{key[:-3]} {part[key]:.2f} ms ({part[key[:-3] + '_tflops']:.3g} TFLOP/s)"
                   for key in part if key.endswith("_ms")]
        return f"{part['matrices']} matrices of {part['preset']}: " + ", ".join(figures)
    if name == "resume":
        return (f"resumed at step {part['resumed_at_step']}, --deterministic "
                f"{'used' if part['deterministic_option'] else 'absent'}: bitwise {part['bitwise']}, losses equal "
                f"{part['losses_equal']}, max relative weight difference {part['max_relative_weight_difference']:.2e}")
    if name.startswith("matmul:"):
        return f"{part['size']}^3: {part['tflops']:.3g} TFLOP/s"
    checks = [key for key, value in part.items() if isinstance(value, bool) and key != "passed"]
    return ", ".join(f"{key} {part[key]}" for key in checks)


def prediction_table(vocab: int = THINK72_VOCAB, tokens: float = 1.5e9) -> list[str]:
    """The think72 rows of docs/training.md's throughput table (hardware.predict_card at ASSUMED_MFU)."""
    preset = model_config.PRESETS["think72"]
    rows = [("T4", 2), ("P100", 1), ("V100", 1), ("A10G", 1), ("L4", 1), ("A100", 1), ("H100", 1), ("H200", 1)]
    cards = {card.key: card for card in hardware.CARDS}
    lines = ["| card | precision | peak TFLOP/s | assumed MFU | step (65,536 tokens) | of which NS / optimizer / "
             "all-reduce | tokens/s | 1.5B tokens |",
             "| --- | --- | ---: | ---: | ---: | --- | ---: | ---: |"]
    for key, world in rows:
        card = cards[key]
        device = hardware.Device("cuda", key, card.capability)
        precision = hardware.choose_precision("auto", device).value
        step = hardware.predict_card(card, preset, vocab, world=world)
        lines.append(f"| {key}{f' x{world}' if world > 1 else ''} | {precision} | "
                     f"{hardware.peak_tflops(device, precision):g} | {hardware.ASSUMED_MFU[key]:.2f} | "
                     f"{step.total_s:.3f} s | {step.newton_schulz_s:.3f} / {step.optimizer_s:.3f} / "
                     f"{step.all_reduce_s:.3f} s | {step.tokens_per_second:,.0f} | {step.hours_for(tokens):.1f} h |")
    return lines


# ----------------------------------------------------------------------------------------------


def init_ranks(args: argparse.Namespace):
    """distributed.init_distributed, with the process group's timeout set to --collective-timeout first."""
    import datetime

    import torch
    import torch.distributed as dist


    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        use_cuda = args.device == "cuda" and torch.cuda.is_available()
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if use_cuda:
            torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl" if use_cuda else "gloo",
                                timeout=datetime.timedelta(seconds=args.collective_timeout),
                                device_id=torch.device("cuda", local_rank) if use_cuda else None)
    return distributed.init_distributed(args.device)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.predict_only:
        print("\n".join(prediction_table()))
        return 0
    warnings.filterwarnings("ignore")
    import data

    hardware.check_torch()
    info = init_ranks(args)
    try:
        facts = machine_facts(info, args)
        device = hardware.describe(info.device)
        precisions, notes = side_precisions(args.precisions, device)
        parts = plan_parts(args.preset, args.also, precisions, args.compile_modes, args.only)
        if info.is_main:
            print_plan(facts, notes, parts)
        command = " ".join([f"torchrun --nproc_per_node={info.world}" if info.world > 1 else "python",
                            "bench/bench_gpu.py",
                            *(sys.argv[1:] if argv is None else argv)])
        record = {"machine": facts, "command": command, "notes": notes, "plan": parts, "parts": {}}
        recorder = Recorder(args, info, record)
        with tempfile.TemporaryDirectory(prefix="bench_gpu-") as temp:
            work = Path(distributed.broadcast_from_main(temp, info))
            corpus = Path(args.corpus) if args.corpus else Path(distributed.main_decides(
                lambda: str(data.build_demo_corpus(work / "corpus", progress=False)), info))
            bench = Bench(args, info, corpus, work)
            for precision in precisions:
                recorder.run(f"matmul:{precision}", lambda precision=precision: {
                    "tflops": matmul_tflops(info.device, precision, args.matmul_size), "size": args.matmul_size})
            for name in parts:
                if name.startswith("side:"):
                    _, preset, precision, mode = name.split(":")
                    recorder.run(name, lambda preset=preset, precision=precision, mode=mode:
                                 bench.side(preset, precision, mode == "compile"))
                else:
                    recorder.run(name, getattr(bench, name))
        if info.is_main:
            print("\nfor bench/RESULTS.md:\n")
            print("\n".join(markdown_lines(record)))
            if args.json:
                print(f"\nwritten: {args.json} (and {recorder.events})")
        return 0
    finally:
        distributed.shutdown_distributed()


if __name__ == "__main__":
    run_main(main)
