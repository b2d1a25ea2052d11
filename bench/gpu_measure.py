"""bench_gpu.py's measuring tools: time on the device or the host, the optimizer's own steps, one profiled
step split by category, Dynamo's compile counts."""

from __future__ import annotations

import contextlib
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gpu_plan import OPTIMIZER_RANGES, attention_kernels, compile_counts, split_by_category  # noqa: E402

from tinyllm.training import optimization  # noqa: E402


def time_on_device(function, device, repeats: int = 5, warmup: int = 2) -> float:
    """Median seconds of `function()` after `warmup` untimed calls: CUDA events on a GPU, perf_counter on CPU."""
    import torch

    for _ in range(warmup):
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


def host_seconds(function, repeats: int = 5) -> float:
    """Median wall seconds of `function()` (host work, a CUDA sync inside if it needs one)."""
    seconds = []
    for _ in range(repeats + 1):
        started = time.perf_counter()
        function()
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds[1:])


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


def in_optimizer(event) -> bool:
    """Whether a profiler event ran inside an optimizer range (OPTIMIZER_RANGES), itself or an ancestor."""
    while event is not None:
        if event.name.startswith(OPTIMIZER_RANGES):
            return True
        event = event.cpu_parent
    return False


def profiled_items(profiler, cuda: bool) -> tuple[list[tuple[str, float, bool]], float]:
    """(name, microseconds, inside the optimizer) of what one profiled step ran, and the device time no
    op claimed: on CUDA every kernel (attached to the op that launched it), on CPU each aten op's self time."""
    from torch.autograd import DeviceType

    items, claimed, total = [], 0.0, 0.0
    for event in profiler.events():
        if cuda:
            if event.device_type == DeviceType.CPU:
                for kernel in event.kernels:
                    items.append((kernel.name, float(kernel.duration), in_optimizer(event)))
                    claimed += kernel.duration
            elif event.device_type == DeviceType.CUDA:
                total += event.time_range.end - event.time_range.start
        elif event.device_type == DeviceType.CPU and event.name.startswith("aten::"):
            items.append((event.name, float(event.self_cpu_time_total), in_optimizer(event)))
    return items, max(0.0, total - claimed)


@contextlib.contextmanager
def optimizer_ranges(training):
    """The optimizer's part of train_step outside optimizer.step (the unscale, the gradient norm and clip,
    zero_grad) inside a "tinyllm.optimizer" profiler range, as the roofline counts them."""
    import torch

    def ranged(function):
        def call(*args, **kwargs):
            with torch.profiler.record_function("tinyllm.optimizer"):
                return function(*args, **kwargs)

        return call

    clip = optimization.clip_gradients
    optimization.clip_gradients = ranged(clip)
    training.scaler.unscale_ = ranged(training.scaler.unscale_)
    training.optimizer.zero_grad = ranged(training.optimizer.zero_grad)
    try:
        yield
    finally:
        optimization.clip_gradients = clip
        del training.scaler.unscale_, training.optimizer.zero_grad


def profile_step(training, device) -> dict:
    """One more training step under torch.profiler: its time split by category (ms), the attention
    kernels seen, and the ten costliest kernels (or CPU ops)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with optimizer_ranges(training), profile(activities=activities) as profiler:
        training.train_step()
    items, unclaimed = profiled_items(profiler, cuda)
    split = split_by_category(items)
    by_name: dict[str, float] = {}
    for name, microseconds, _ in items:
        by_name[name] = by_name.get(name, 0.0) + microseconds / 1000
    top = sorted(by_name.items(), key=lambda item: -item[1])[:10]
    return {
        "split_ms": split,
        "unattributed_ms": unclaimed / 1000,
        "split_of": "kernels" if cuda else "cpu ops",
        "top_ms": [[name[:120], round(ms, 3)] for name, ms in top],
        **{f"attention_{key}": value for key, value in attention_kernels(list(by_name)).items()},
    }


class CompileWatch:
    """Dynamo's compile ids and counters from here on (compile_counts)."""

    def __init__(self):
        from torch._dynamo.callback import callback_handler
        from torch._dynamo.utils import counters

        counters.clear()
        self.ids: list[str] = []
        self.handler = callback_handler
        callback_handler.register_start_callback(self.callback)

    def callback(self, *args) -> None:
        """A compile started (torch passes CallbackArgs with its compile id; an older torch nothing)."""
        self.ids.append(str(getattr(args[0], "compile_id", "?")) if args else "?")

    def counts(self) -> dict:
        from torch._dynamo.utils import counters

        return {
            **compile_counts(self.ids, {key: dict(value) for key, value in counters.items()}),
            "compile_starts": len(self.ids),
        }

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.handler.remove_start_callback(self.callback)
