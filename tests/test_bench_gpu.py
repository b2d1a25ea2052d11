"""bench/bench_gpu.py: its plan per card, the kernel names it reads, and every part on CPU (one failing)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import distributed

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import bench_gpu  # noqa: E402
from test_hardware import CPU, H200, T4  # noqa: E402
from test_train import write_tiny_corpus  # noqa: E402

import hardware  # noqa: E402

# requested, device, the precisions run, a note about bf16
PRECISIONS = [
    (["auto"], T4, ["fp16"], "no bf16 tensor cores"),
    (["auto"], H200, ["bf16", "fp16"], None),
    (["auto"], CPU, ["fp32"], None),
    (["bf16", "fp16"], T4, ["fp16"], "bf16 skipped"),
    (["fp16", "bf16", "fp16"], H200, ["fp16", "bf16"], None),
]


@pytest.mark.parametrize("requested, device, run, note", PRECISIONS)
def test_side_precisions_skip_emulated_bf16(requested, device, run, note):
    precisions, notes = bench_gpu.side_precisions(requested, device)
    assert precisions == run
    assert (note in " ".join(notes)) if note else notes == []


def test_the_checks_come_after_the_first_side_and_before_the_long_ones():
    parts = bench_gpu.plan_parts("think72", ["small125", "think72"], ["bf16", "fp16"], ["eager", "compile"])
    assert parts[:5] == ["side:think72:bf16:eager", "newton_schulz", "overflow", "snapshot", "resume"]
    assert parts[5:8] == ["side:think72:bf16:compile", "side:think72:fp16:eager", "side:think72:fp16:compile"]
    assert parts[8:] == [f"side:small125:{p}:{m}" for p in ("bf16", "fp16") for m in ("eager", "compile")]
    assert bench_gpu.plan_parts("think72", ["small125"], ["fp16"], ["eager", "compile"], only=["side:small", "res"]) \
        == ["resume", "side:small125:fp16:eager", "side:small125:fp16:compile"]


@pytest.mark.parametrize("names, kinds, matched", [
    (["aten::_scaled_dot_product_flash_attention", "void pytorch_flash::flash_fwd_kernel<...>", "aten::mm"],
     ["flash"], 2),
    (["fmha_cutlassF_f16_aligned_64x64_rf_sm75", "aten::_scaled_dot_product_efficient_attention"], ["efficient"], 2),
    (["cutlass_75_tensorop_f16_s1688gemm_f16_256x128", "aten::mm", "aten::softmax"], [], 0),  # GEMMs: not attention
    (["aten::_scaled_dot_product_attention_math", "aten::bmm"], ["math"], 1),
    (["aten::_scaled_dot_product_flash_attention_for_cpu"], ["flash"], 1),
    (["aten::_scaled_dot_product_cudnn_attention", "cudnn_generated_fort_native_sdpa_sm80_flash_fprop"], ["cudnn"], 2),
])
def test_attention_kernels(names, kinds, matched):
    found = bench_gpu.attention_kernels(names)
    assert found["kinds"] == kinds
    assert len(found["names"]) == matched and set(found["names"]) <= set(names)


def test_markdown_lines_show_figures_and_errors():
    record = {"command": "python bench/bench_gpu.py", "machine": {
        "device": "Tesla T4 (sm_75)", "world": 2, "date": "d", "torch": "2.9", "cuda": "12.6",
        "prediction": {"mfu": 0.22, "tokens_per_second": 40_000.0}}, "parts": {
        "side:think72:fp16:eager": {"status": "ok", "tokens_per_second": 41_000.0,
                                    "tokens_per_second_per_gpu": 20_500.0, "mfu": 0.2,
                                    "peak_memory_bytes": 6 * 2**30, "attention_kinds": ["efficient"],
                                    "muon_step_ms": 30.0, "first_step_seconds": 2.0},
        "side:medium350:fp16:eager": {"status": "oom", "error": "OutOfMemoryError: CUDA out of memory"},
        "overflow": {"status": "ok", "weights_unchanged": True, "scale_lowered": True},
        "resume": {"status": "skipped", "reason": "--max-seconds 60 spent"}}}
    text = "\n".join(bench_gpu.markdown_lines(record))
    assert "| think72 fp16 eager | 41,000 | 20,500 | 20.0% | 6.00 GiB | efficient | 30.0 ms | 2.0 s |" in text
    assert "| medium350 fp16 eager | oom: OutOfMemoryError" in text
    assert "- overflow: ok; weights_unchanged True, scale_lowered True" in text
    assert "- resume: skipped: --max-seconds 60 spent" in text
    assert "40,000 tokens/s; measured (first side) 41,000" in text


def test_the_prediction_table_in_the_docs_is_the_model_s():
    docs = (ROOT / "docs" / "training.md").read_text()
    for line in bench_gpu.prediction_table():
        assert line in docs, line


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matrices on a shared 2-core machine: a second thread only waits (conftest restores the count)."""
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_tiny_corpus(tmp_path_factory.mktemp("corpus"))


def smoke_argv(corpus: Path, out: Path, *extra: str) -> list[str]:
    return ["--device", "cpu", "--preset", "tiny", "--vocab", "0", "--context", "32", "--corpus", str(corpus),
            "--precisions", "fp32", "--compile-modes", "eager", "--steps", "2", "--warmup", "1", "--batch-size", "2",
            "--grad-accum", "2", "--matmul-size", "64", "--json", str(out), *extra]


def test_every_part_on_cpu_and_a_failing_part_does_not_stop_the_others(corpus, tmp_path, capsys):
    out = tmp_path / "gpu.json"
    assert bench_gpu.main(smoke_argv(corpus, out, "--inject-failure", "newton_schulz")) == 0
    record = json.loads(out.read_text())
    parts = record["parts"]
    assert list(parts) == ["matmul:fp32", "side:tiny:fp32:eager", "newton_schulz", "overflow", "snapshot", "resume"]
    side = parts["side:tiny:fp32:eager"]
    assert side["status"] == "ok" and side["tokens_per_second"] > 0 and len(side["step_seconds"]) == 2
    assert side["attention_kinds"] == ["flash"]  # the CPU flash kernel, seen by the profiler
    assert side["muon_step_ms"] > 0 and side["tokens_per_step"] == 2 * 2 * 32
    assert parts["newton_schulz"] == {**parts["newton_schulz"], "status": "error",
                                      "error": "RuntimeError: injected failure (--inject-failure newton_schulz)"}
    overflow = parts["overflow"]
    assert overflow["status"] == "ok" and overflow["optimizers"] == ["adamw", "muon"]
    assert overflow["weights_unchanged"] and overflow["optimizer_states_unchanged"] and overflow["scale_lowered"]
    assert overflow["next_step_applied"] and overflow["scale_after"] == overflow["scale_before"] / 2
    snapshot = parts["snapshot"]
    assert snapshot["status"] == "ok" and snapshot["snapshot_1_equal"] and snapshot["snapshot_2_equal"]
    resume = parts["resume"]
    assert resume["status"] == "ok" and resume["bitwise"] and resume["losses_equal"], resume
    assert resume["resumed_at_step"] == 2
    events = [json.loads(line) for line in (tmp_path / "gpu.events.jsonl").read_text().splitlines()]
    assert [event["part"] for event in events if event["status"] != "started"] == list(parts)
    failed = next(event for event in events if event["part"] == "newton_schulz" and "traceback" in event)
    assert "Traceback" in failed["traceback"] and "injected failure" in failed["traceback"]
    printed = capsys.readouterr().out
    assert "--precision auto -> fp32" in printed and "| tiny fp32 eager |" in printed


def test_the_budget_skips_the_parts_that_would_start_late(corpus, tmp_path):
    out = tmp_path / "gpu.json"
    assert bench_gpu.main(smoke_argv(corpus, out, "--max-seconds", "1e-9")) == 0
    record = json.loads(out.read_text())
    assert list(record["parts"]) == ["matmul:fp32", *record["plan"]]
    assert {part["status"] for part in record["parts"].values()} == {"skipped"}


def test_the_newton_schulz_part_times_each_dtype(corpus, tmp_path):
    args = bench_gpu.parse_args(smoke_argv(corpus, tmp_path / "gpu.json"))
    figures = bench_gpu.Bench(args, distributed.init_distributed("cpu"), corpus, tmp_path).newton_schulz()
    assert figures["matrices"] == 14 and figures["train_dtype"] == "fp32"
    assert figures["bf16_ms"] > 0 and figures["fp32_ms"] > 0
    assert figures["flops_per_step"] == 2 * sum(hardware.newton_schulz_flops(*shape) for shape in
                                                [(64, 64), (32, 64), (32, 64), (64, 64), (192, 64), (192, 64),
                                                 (64, 192)])


def test_two_ranks_under_torchrun_on_gloo(corpus, tmp_path):
    out = tmp_path / "gpu.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             "bench/bench_gpu.py",
                             *smoke_argv(corpus, out, "--collective-timeout", "120", "--only", "side,resume",
                                         "--steps", "1")],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    parts = json.loads(out.read_text())["parts"]
    assert {name: part["status"] for name, part in parts.items()} == {name: "ok" for name in parts}, parts
    assert parts["side:tiny:fp32:eager"]["world"] == 2 and parts["side:tiny:fp32:eager"]["tokens_per_step"] == 256
    assert list(parts) == ["matmul:fp32", "side:tiny:fp32:eager", "resume"]
    assert parts["resume"]["bitwise"] and parts["resume"]["losses_equal"]


def test_predict_only_prints_the_table():
    assert bench_gpu.main(["--predict-only"]) == 0
    assert hardware.ASSUMED_MFU["T4"] == 0.22


def test_an_out_of_memory_part_is_recorded_and_the_next_runs(tmp_path):
    args = bench_gpu.parse_args(["--device", "cpu", "--json", str(tmp_path / "gpu.json")])
    recorder = bench_gpu.Recorder(args, distributed.init_distributed("cpu"), {"parts": {}})

    def too_big():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    assert recorder.run("side:medium350:fp16:eager", too_big)["status"] == "oom"
    assert recorder.run("overflow", lambda: {"passed": False, "weights_unchanged": False})["status"] == "failed"
    assert recorder.run("snapshot", lambda: {"passed": True})["status"] == "ok"
    parts = json.loads((tmp_path / "gpu.json").read_text())["parts"]
    oom = parts["side:medium350:fp16:eager"]
    assert oom["error"] == "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    assert oom["where"].startswith("test_bench_gpu.py:")
    assert [parts[name]["status"] for name in parts] == ["oom", "failed", "ok"]
