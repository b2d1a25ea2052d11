"""bench_gpu.py's report: the machine's facts and the plan printed first, the markdown lines for bench/RESULTS.md
printed last (or from a gpu.json), and the throughput prediction table of docs/training.md."""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import os
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import bench_roofline  # noqa: E402
from gpu_plan import CATEGORIES, THINK72_VOCAB, part_seconds  # noqa: E402
from gpu_record import first_line  # noqa: E402

from tinyllm.model import (  # noqa: E402
    attention,
    hardware,
)
from tinyllm.model import config as model_config  # noqa: E402


def predicted_step(card, preset, vocab: int, world: int, tokens_per_step: int, micro_batch_tokens: int) -> dict:
    """hardware's throughput model for `card`: the roofline over think72's counts at micro-batch 8 x 1,024
    (hardware.ROOFLINE_COUNTS, bench/bench_roofline.py; `preset`, `vocab` and `micro_batch_tokens` are
    those), for the cards of hardware.ROOFLINE_RATES."""
    step = hardware.predict_card(card, world=world, tokens_per_step=tokens_per_step)
    return {
        **dataclasses.asdict(step),
        "compute_s": step.compute_s,
        "total_s": step.total_s,
        "tokens_per_second": step.tokens_per_second,
        "mfu": "roofline",
        "hours_for_1.5B_tokens": step.hours_for(1.5e9),
    }


def machine_facts(info, args: argparse.Namespace) -> dict:
    import torch
    import transformers

    device = hardware.describe(info.device)
    preset = model_config.resolve_preset(args.preset, context=args.context)
    precision = hardware.choose_precision("auto", device)
    plan = attention.choose_attention(device, precision.value, preset.head_dim)
    card = hardware.card_of(device)
    facts = {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": device.label(),
        "world": info.world,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "memory_gib": round(device.memory_bytes / 2**30, 1),
        "gpus": device.count if device.is_cuda else 0,
        "precision_auto": precision.value,
        "precision_reason": precision.reason,
        "attention_kernel": plan.label(),
        "attention_reason": plan.reason,
        "newton_schulz_dtype": hardware.newton_schulz_dtype(device, precision.value),
        "card": dataclasses.asdict(card) if card else None,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
    }
    if card:
        try:  # the throughput model is being replaced: its absence must not stop the measurements
            facts["prediction"] = predicted_step(
                card, preset, args.vocab or THINK72_VOCAB, max(1, info.world), args.step_tokens, 8 * preset.context
            )
        except Exception as error:  # noqa: BLE001
            facts["prediction_error"] = first_line(error)
    return facts


def print_plan(facts: dict, parts: list[str]) -> None:
    print(
        f"device: {facts['device']} x{facts['world']}, torch {facts['torch']} (CUDA {facts['cuda']}), "
        f"transformers {facts['transformers']}",
        flush=True,
    )
    print(f"--precision auto -> {facts['precision_auto']}: {facts['precision_reason']}")
    print(f"attention -> {facts['attention_kernel']}")
    print(f"Newton-Schulz dtype -> {facts['newton_schulz_dtype']}")
    if facts.get("prediction"):
        prediction = facts["prediction"]
        print(
            f"predicted (hardware.predict_card, {prediction['mfu']}): step "
            f"{prediction['total_s']:.3f} s, {prediction['tokens_per_second']:,.0f} tokens/s"
        )
    print("parts: " + ", ".join(f"{name} (~{part_seconds(name):g} s)" for name in parts), flush=True)


def gib(value) -> str:
    return f"{value / 2**30:.2f} GiB" if value else "n/a"


def mib(value) -> str:
    return f"{value / 2**20:,.0f} MiB" if value is not None else "n/a"


def not_ok(name: str, part: dict) -> str:
    return f"- {name}: {part['status']}: {part.get('error') or part.get('reason', '')}"


def markdown_lines(record: dict) -> list[str]:
    """The lines for bench/RESULTS.md, part by part (a part that did not run: one line saying why)."""
    facts, parts = record["machine"], record["parts"]
    lines = [
        f"### GPU: {facts['device']} x{facts['world']} ({facts['date']}, torch {facts['torch']}, CUDA {facts['cuda']})",
        "",
        f"`{record['command']}` ({record.get('elapsed_seconds', '?')} s)",
        "",
    ]
    for name, part in parts.items():
        if part["status"] not in ("ok", "failed"):
            lines.append(not_ok(name, part))
            continue
        writer = PART_LINES.get(name.split(":")[0] if name.startswith("step:") else name)
        try:
            lines += writer(name, part) if writer else [f"- {name}: {part['status']}; " + check_text(name, part)]
        except (KeyError, TypeError, ValueError) as error:  # a figure missing: the JSON has the rest
            lines.append(f"- {name}: {part['status']} (not shown: {first_line(error)}; see gpu.json)")
    try:
        lines += step_table(parts)
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as error:
        lines.append(f"- steps: not shown ({first_line(error)}; see gpu.json)")
    return lines


def versions_lines(name: str, part: dict) -> list[str]:
    choice = part.get("sdpa_choice")
    chosen = (
        ", ".join(f"{case}: {found['ran']}" for case, found in choice.items()) if isinstance(choice, dict) else choice
    )
    return [
        f"- versions: cuDNN {part.get('cudnn')}, NCCL {part.get('nccl')}, Triton {part.get('triton')}; "
        f"SDPA's global priority {' > '.join(part['sdpa_priority']) or 'n/a'}; SDPA ran (profiler): {chosen}"
    ]


def kernels_lines(name: str, part: dict) -> list[str]:
    lines = [f"- attention kernels at {part['shape']} ({part['precision']}):"]
    for path, found in part["paths"].items():
        if found["status"] != "ok":
            lines.append(f"  - {path}: {found['status']}: {found.get('error') or found.get('reason')}")
        else:
            lines.append(
                f"  - {path}: {', '.join(found['kinds']) or 'none seen'}: "
                f"{'; '.join(name[:90] for name in found['attention_names'][:3])}"
            )
    return lines


def nan_lines(name: str, part: dict) -> list[str]:
    found = []
    for length, outcome in part["lengths"].items():
        found.append(
            f"{length}: {outcome['error']}"
            if "error" in outcome
            else f"{length}: NaN in grad_q {outcome['nan_grad_q']} (output {outcome['nan_output']}, grad_k "
            f"{outcome['nan_grad_k']}, grad_v {outcome['nan_grad_v']})"
        )
    return ["- cuDNN attention with a mask (seq_len dtype): " + "; ".join(found)]


def attention_lines(name: str, part: dict) -> list[str]:
    lines = [
        "",
        f"Attention, one layer, {part['precision']}, documents log-normal (median {part['document_median']}, "
        f"sigma {part['document_sigma']}):",
        "",
        "| shape | path | fwd+bwd | per micro-batch (x layers + prepare) | prepare | peak memory | max error "
        "| useful TFLOP/s | computed / useful |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for shape, figures in part["shapes"].items():
        label = f"{shape} ({figures['documents_per_row']:.1f} documents/row)"
        for path, found in figures["paths"].items():
            if found["status"] != "ok":
                lines.append(
                    f"| {label} | {path} | {found['status']}: {found.get('error') or found.get('reason')} | | | | | | |"
                )
                continue
            error = f"{found['max_error']:.1e}" + ("" if found["exact"] else " (causal over the row)")
            lines.append(
                f"| {label} | {path} | {found['forward_backward_ms']:.3f} ms | "
                f"{found['per_micro_batch_ms']:.2f} ms | {found['prepare_ms']:.3f} ms | "
                f"{mib(found['peak_memory_bytes'])} | {error} | {found['useful_tflops']:.1f} | "
                f"{found['computed_over_useful']:.2f} |"
            )
    return lines + [""]


def newton_schulz_lines(name: str, part: dict) -> list[str]:
    figures = [
        f"{dtype} {found['ms']:.2f} ms ({found['tflops']:.3g} TFLOP/s, error {found['max_relative_error']:.1e})"
        for dtype, found in part["dtypes"].items()
    ]
    return [
        f"- muon.newton_schulz over {part['matrices']} matrices of {part['preset']} (train.py uses "
        f"{part['train_dtype']}): " + ", ".join(figures)
    ]


def gemm_lines(name: str, part: dict) -> list[str]:
    shapes = ", ".join(f"{shape['name']} {shape['tflops']:.3g}" for shape in part["shapes"])
    return [
        f"- GEMMs at {part['tokens']} tokens ({part['precision']}), TFLOP/s: {shapes}; weighted "
        f"{part['weighted_tflops']:.3g} ({part['gemm_ms_per_micro_step']:.2f} ms per micro-step); square "
        f"{part['square_size']}: {part['square_tflops']:.3g}"
    ]


def copy_lines(name: str, part: dict) -> list[str]:
    return [
        f"- bandwidth ({part['bytes'] / 2**20:.0f} MiB): copy {part['copy_gbs']:.0f} GB/s, fp16 add "
        f"{part['add_gbs']:.0f} GB/s"
    ]


def compare_lines(name: str, part: dict) -> list[str]:
    runs = part["runs"]
    if part.get("steps", 0) == 0:
        return [f"- fp16 vs bf16: no steps ({', '.join(runs)})"]
    return [
        f"- fp16 (Newton-Schulz {runs['fp16']['newton_schulz_dtype']}, {runs['fp16']['skipped_steps']} overflow "
        f"skips) vs bf16 over {part['steps']} steps at micro-batch {part['batch_size']}: last-10 mean loss "
        f"{part['last_mean_second']:.4f} vs {part['last_mean_first']:.4f} "
        f"({100 * part['last_relative_difference']:.2f}%), largest 10-step running-mean difference "
        f"{part['max_running_mean_difference']:.4f}: "
        f"{'close' if part['close'] else 'NOT close'}"
    ]


def step_table(parts: dict) -> list[str]:
    steps = {name: part for name, part in parts.items() if name.startswith("step:") and part["status"] == "ok"}
    if not steps:
        return []
    lines = [
        "",
        "| step | tokens/s (all GPUs) | MFU | peak memory | step_memory | first loss | compile: seconds, "
        "graph breaks / recompiles | per micro-step: matmul / attention / elementwise / optimizer / "
        "communication (+ kernels no op claimed) (ms) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    for name, part in steps.items():
        mfu = f"{100 * part['mfu']:.1f}%" if part.get("mfu") else "n/a"
        compiled = "eager"
        if part["compiled"]:
            seconds = part.get("compile_seconds")
            compiled = (
                "failed: eager"
                if part.get("compiled_in_the_end") is False
                else f"{seconds:.0f} s"
                if seconds is not None
                else "?"
            ) + f", {part.get('graph_breaks', 0)} / {part.get('recompiles', 0)}"
        split = (
            " / ".join(f"{part['profiled_step_ms_per_micro_step'][category]:.2f}" for category in CATEGORIES)
            + f" (+ {part.get('unattributed_ms', 0) / part['grad_accum']:.2f})"
        )
        lines.append(
            f"| {name[5:]} (x{part['grad_accum']}) | {part['tokens_per_second']:,.0f} | {mfu} | "
            f"{gib(part['peak_memory_bytes'])} | {gib(part['step_memory_bytes'])} | "
            f"{part['first_step_loss']:.4f} | {compiled} | {split} |"
        )
    for size in sorted({part["batch_size"] for part in steps.values()}):
        eager, compiled = steps.get(f"step:eager:{size}"), steps.get(f"step:compile:{size}")
        if eager and compiled:
            lines.append(
                f"- micro-batch {size}: first-step loss eager {eager['first_step_loss']:.6f}, compiled "
                f"{compiled['first_step_loss']:.6f} (difference "
                f"{abs(eager['first_step_loss'] - compiled['first_step_loss']):.2e}); compiled "
                f"{compiled['tokens_per_second'] / eager['tokens_per_second']:.2f}x eager"
            )
    return lines


def check_text(name: str, part: dict) -> str:
    if name == "resume":
        return (
            f"resumed at step {part['resumed_at_step']}, --deterministic "
            f"{'used' if part['deterministic_option'] else 'absent'}: bitwise {part['bitwise']}, losses equal "
            f"{part['losses_equal']}, max relative weight difference {part['max_relative_weight_difference']:.2e}"
        )
    checks = [key for key, value in part.items() if isinstance(value, bool) and key != "passed"]
    return ", ".join(f"{key} {part[key]}" for key in checks)


PART_LINES = {
    "versions": versions_lines,
    "attention:kernels": kernels_lines,
    "attention:nan": nan_lines,
    "attention:bench": attention_lines,
    "newton_schulz": newton_schulz_lines,
    "roofline:gemm": gemm_lines,
    "roofline:copy": copy_lines,
    "fp16_vs_bf16": compare_lines,
    "step": lambda name, part: [],
}


def prediction_table(vocab: int = THINK72_VOCAB, tokens: float = 1.5e9) -> list[str]:
    """The think72 rows of docs/training.md's throughput table (bench/bench_roofline.py's, from the recorded
    counts hardware.ROOFLINE_COUNTS)."""
    return bench_roofline.card_rows(hardware.ROOFLINE_COUNTS, tokens=tokens)
