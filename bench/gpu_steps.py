"""bench_gpu.py's step parts: train.py's Training timed eager and compiled, fp16 against bf16, and the checks
(the fp16 overflow, the staged snapshot, save and resume)."""

from __future__ import annotations

import dataclasses
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gpu_measure import CompileWatch, OptimizerTimer, profile_step  # noqa: E402
from gpu_plan import curves_close, relative_difference  # noqa: E402
from gpu_record import NotHere, free_memory  # noqa: E402

from tinyllm.model import hardware  # noqa: E402
from tinyllm.store import checkpoint_store as store  # noqa: E402
from tinyllm.training import (  # noqa: E402
    distributed,
    train,
)


class StepParts:
    """The parts `step:MODE:B`, `fp16_vs_bf16`, `overflow`, `snapshot` and `resume` (of a `BenchContext`)."""

    # -- whole steps ---------------------------------------------------------------------------------

    def step(self, compiled: bool, batch_size: int) -> dict:
        """train.py's Training at micro-batch `batch_size` and --step-tokens per step, eager or compiled."""
        import torch

        world, context = self.info.world, self.preset.context
        grad_accum = max(1, self.args.step_tokens // (batch_size * context * world))
        watch = CompileWatch() if compiled else None
        try:
            training = self.build(self.options(self.args.preset, "auto", compiled, batch_size, grad_accum))
            muon_timer = OptimizerTimer(training, "muon", self.info.device)
            if self.device.is_cuda:
                torch.cuda.reset_peak_memory_stats(self.info.device)
            started = time.perf_counter()
            first = training.train_step()
            first_step = time.perf_counter() - started
            for _ in range(self.args.warmup - 1):
                training.train_step()
            muon_timer.clear()
            seconds = []
            for _ in range(self.args.steps):
                seconds.append(training.train_step().seconds)
                if self.time_up():
                    break
            muon_seconds = muon_timer.seconds()
            peak_memory = torch.cuda.max_memory_allocated(self.info.device) if self.device.is_cuda else None
            estimate = hardware.step_memory(
                training.preset,
                training.vocab_size,
                batch_size,
                context,
                training.precision,
                training.recipe.rule.state,
                False,
                attention=training.attention_plan.documents,
            )
            profiled = profile_step(training, self.info.device)
            counts = watch.counts() if watch else {}
        finally:
            if watch:
                watch.close()
        tokens_per_step = batch_size * grad_accum * world * context
        tokens_per_second = tokens_per_step / statistics.median(seconds)
        peak = self.peak_flops(training.precision)
        step_ms = 1000 * statistics.median(seconds)
        return {
            "preset": self.args.preset,
            "precision": training.precision,
            "compiled": compiled,
            "world": world,
            "batch_size": batch_size,
            "grad_accum": grad_accum,
            "context": context,
            "attention_plan": training.sdpa,
            "tokens_per_step": tokens_per_step,
            "tokens_per_second": tokens_per_second,
            "tokens_per_second_per_gpu": tokens_per_second / world,
            "compile_seconds": getattr(training, "compile_seconds", None),
            "compiled_in_the_end": getattr(training, "compile", compiled),  # False: the compile failed, eager
            "step_ms": step_ms,
            "step_seconds": seconds,
            "first_step_seconds": first_step,
            "first_step_loss": first.loss,
            "flops_per_token": training.flops_per_token,
            "mfu": training.flops_per_token * tokens_per_second / world / peak if peak else None,
            "peak_memory_bytes": peak_memory,
            "step_memory_bytes": estimate.total,
            "step_memory": dataclasses.asdict(estimate),
            "muon_step_ms": 1000 * statistics.median(muon_seconds) if muon_seconds else None,
            "profiled_step_ms_per_micro_step": {key: value / grad_accum for key, value in profiled["split_ms"].items()},
            **profiled,
            **counts,
        }

    def fp16_vs_bf16(self) -> dict:
        """--compare-steps steps from one seed in bf16 and in fp16 with fp16 Newton-Schulz (the T4's path)."""
        if self.device.is_cuda and not self.device.native_bf16:
            raise NotHere(f"{self.device.label()} has no bf16 tensor cores: the comparison needs an sm_80+ card")
        started, result = time.monotonic(), {"batch_size": self.args.compare_batch_size, "runs": {}}
        share = (self.deadline - started) / 2
        steps_limit = self.args.compare_steps
        for index, precision in enumerate(("bf16", "fp16")):
            training = self.build(self.options(self.args.preset, precision, batch_size=self.args.compare_batch_size))
            if precision == "fp16" and "muon" in training.optimizer.parts:
                training.optimizer.parts["muon"].ns_dtype = "fp16"
            until = started + share * (index + 1)
            losses, run_started = [], time.perf_counter()
            while len(losses) < steps_limit:
                losses.append(training.train_step().loss)
                if distributed.broadcast_from_main(time.monotonic() > until, self.info):
                    break
            steps_limit = len(losses)  # fp16 runs as many steps as bf16 did
            muon_dtype = training.optimizer.parts["muon"].ns_dtype if "muon" in training.optimizer.parts else None
            result["runs"][precision] = {
                "losses": losses,
                "newton_schulz_dtype": muon_dtype,
                "skipped_steps": training.scaler.skipped_total,
                "seconds": time.perf_counter() - run_started,
            }
            self.recorder.partial(result)
            del training
            free_memory()
        return {**result, **curves_close(result["runs"]["bf16"]["losses"], result["runs"]["fp16"]["losses"])}

    # -- the fp16 overflow skips both optimizers ---------------------------------------------

    def overflow(self) -> dict:

        training = self.build(
            self.options(self.args.preset, "fp16", batch_size=self.args.check_batch_size, grad_accum=1)
        )
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
            "optimizer_states_unchanged": store.tensor_differences(
                optimizer_states(training), optimizer_before, "optimizer"
            )
            == [],
            "scale_lowered": training.scaler.scaler.get_scale() < scale_before,
            "skip_counted": training.scaler.skipped_total == skipped_before + 1,
        }
        after = training.train_step()
        checks["next_step_applied"] = (
            after.applied
            and training.step == step_before + 1
            and store.tensor_differences(training.model.state_dict(), model_before, "model") != []
        )
        return {
            "passed": all(checks.values()),
            "optimizers": sorted(training.optimizer.parts),
            **checks,
            "scale_before": scale_before,
            "scale_after": training.scaler.scaler.get_scale(),
        }

    # -- the staged snapshot equals the state ---------------------------------------------------

    def snapshot(self) -> dict:

        training = self.build(
            self.options(self.args.preset, "auto", batch_size=self.args.check_batch_size, grad_accum=1)
        )
        checks, seconds = {}, []
        for round_ in (1, 2):  # the second snapshot refills the buffers of the first
            training.train_step()
            expected = {
                "model": clone(training.model.state_dict()),
                "optimizer": clone(training.optimizer.state_dict()),
                "scaler": training.scaler.state_dict(),
            }
            started = time.perf_counter()
            staged = training.snapshot()
            seconds.append(time.perf_counter() - started)
            if staged is None:
                continue  # not rank 0
            differences = store.tensor_differences(
                staged["model"], expected["model"], "model"
            ) + store.tensor_differences(staged["optimizer"], expected["optimizer"], "optimizer")
            checks[f"snapshot_{round_}_equal"] = (
                not differences
                and staged["step"] == training.step
                and staged["scaler"]["skipped_total"] == expected["scaler"]["skipped_total"]
            )
            if differences:
                checks[f"snapshot_{round_}_differs_at"] = ", ".join(differences[:5])
            if self.info.device.type == "cuda":
                checks[f"snapshot_{round_}_pinned"] = all(
                    buffer.is_pinned() for buffer in training.staging.buffers.values()
                )
        passed = all(value for key, value in checks.items() if not key.endswith("differs_at"))
        return {
            "passed": passed,
            "precision": training.precision,
            **checks,
            "snapshot_seconds": seconds,
            "staging_bytes": sum(
                buffer.numel() * buffer.element_size() for buffer in training.staging.buffers.values()
            ),
        }

    # -- save, resume, continue: equal to the uninterrupted run ------------------------------

    def resume(self) -> dict:

        deterministic = "--deterministic" in train.build_parser()._option_string_actions
        out = Path(distributed.broadcast_from_main(tempfile.mkdtemp(prefix="resume-", dir=self.work), self.info))
        options = self.options(
            self.args.preset,
            "auto",
            batch_size=self.args.check_batch_size,
            grad_accum=2,
            out=out,
            extra=["--deterministic"] if deterministic else [],
        )
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
        worst = max(
            relative_difference(expected[name], state[name].detach().cpu())
            for name in expected
            if expected[name].is_floating_point()
        )
        return {
            "passed": bitwise if deterministic else worst < 1e-2,
            "deterministic_option": deterministic,
            "resumed_at_step": resumed_at,
            "checkpoint": path.name,
            "losses_uninterrupted": uninterrupted,
            "losses_resumed": resumed,
            "losses_equal": uninterrupted == resumed,
            "bitwise": bitwise,
            "max_relative_weight_difference": worst,
        }


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
