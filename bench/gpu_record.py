"""bench_gpu.py's record: every part in its own try/except, its outcome in the JSON (rewritten after each part)
and the events' JSONL, on rank 0."""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gpu_plan import part_seconds, starts_in_budget  # noqa: E402

from tinyllm.common import append_jsonl, atomic_write_json  # noqa: E402
from tinyllm.training import distributed  # noqa: E402


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:400] if text else ''}"


class NotHere(Exception):
    """A part (or a path of one) that cannot run on this device: recorded as skipped with the reason."""


class Recorder:
    """Runs the parts on every rank, records their outcomes on rank 0 (JSON after each, JSONL events)."""

    def __init__(self, args: argparse.Namespace, info, record: dict, started: float | None = None):
        self.args, self.info, self.record = args, info, record
        self.started = time.monotonic() if started is None else started
        self.current: str | None = None
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

    def partial(self, figures: dict) -> None:
        """A running part's figures so far, in the JSON (a kill keeps them)."""
        if self.current is not None:
            self.record["parts"][self.current] = {"status": "running", **figures}
            self.save()

    def event(self, **fields) -> None:
        if self.events:
            append_jsonl(
                self.events,
                {
                    "time": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                    "elapsed_seconds": round(self.elapsed(), 1),
                    **fields,
                },
            )

    def log(self, message: str) -> None:
        if self.info.is_main:
            print(message, flush=True)

    def fits(self, estimate: float) -> bool:
        """Whether a part of `estimate` seconds starts now: rank 0 decides for every rank."""
        fits = starts_in_budget(self.elapsed(), estimate, self.args.max_seconds)
        return distributed.broadcast_from_main(fits, self.info)

    def run(self, name: str, function) -> dict:
        parts = self.record["parts"]
        estimate = part_seconds(name)
        if not self.fits(estimate):
            outcome = {
                "status": "skipped",
                "reason": f"--max-seconds {self.args.max_seconds:g}: "
                f"{max(0.0, self.args.max_seconds - self.elapsed()):.0f} s "
                f"left, {estimate:g} s estimated",
            }
            parts[name] = outcome
            self.event(part=name, **outcome)
            self.save()
            self.log(f"{name}: skipped ({outcome['reason']})")
            return outcome
        self.log(f"{name} ...")
        self.event(part=name, status="started")
        started = time.perf_counter()
        details = None
        self.current = name
        try:
            if self.args.inject_failure == name:
                raise RuntimeError(f"injected failure (--inject-failure {name})")
            figures = function()
            outcome = {"status": "ok" if figures.get("passed", True) else "failed", **figures}
        except NotHere as reason:
            outcome = {"status": "skipped", "reason": str(reason)}
        except Exception as error:  # noqa: BLE001 - every failure is a finding to record, never the end
            import torch

            oom = isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower()
            outcome = {"status": "oom" if oom else "error", "error": first_line(error)}
            frames = traceback.extract_tb(error.__traceback__)
            if frames:
                outcome["where"] = f"{Path(frames[-1].filename).name}:{frames[-1].lineno} ({frames[-1].name})"
            details = traceback.format_exc()
        self.current = None
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
    shown = {
        key: value
        for key, value in outcome.items()
        if isinstance(value, (int, float, str, bool)) and key not in ("status",)
    }
    text = ", ".join(f"{key} {format_value(value)}" for key, value in list(shown.items())[:10])
    return f"{outcome['status']}: {text}"


def format_value(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def free_memory() -> None:
    import torch

    gc.collect()
    if "torch._dynamo" in sys.modules:  # compiled parts leave their graphs (importing it costs seconds)
        torch._dynamo.reset()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
