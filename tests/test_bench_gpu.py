"""bench/bench_gpu.py: its plan and budget, the pure pieces of its GPU parts (document lengths, which path runs
on which card, kernel names by category, compile counts, GEMM shapes, loss curves, the markdown), and every
part on CPU (the CUDA-only ones skipped with their reason, one part made to fail)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tinyllm.model import attention, hardware
from tinyllm.model import config as model_config
from tinyllm.training import distributed

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import bench_gpu  # noqa: E402
import gpu_attention  # noqa: E402
import gpu_bench  # noqa: E402
import gpu_plan  # noqa: E402
import gpu_record  # noqa: E402
import gpu_report  # noqa: E402
from cards import A100, CPU, H200, T4, this_cpu_precision  # noqa: E402
from references import reference_varlen  # noqa: E402
from tiny_runs import write_tiny_corpus  # noqa: E402

THINK72 = model_config.PRESETS["think72"]


# ----------------------------------------------------------------------------------------------
# The plan and the budget.


def test_the_parts_run_by_importance():
    parts = gpu_plan.plan_parts([8, 32], ["eager", "compile"])
    assert parts == [
        "versions",
        "attention:kernels",
        "attention:nan",
        "attention:bench",
        "newton_schulz",
        "roofline:gemm",
        "roofline:copy",
        "step:eager:8",
        "step:eager:32",
        "fp16_vs_bf16",
        "step:compile:8",
        "step:compile:32",
        "overflow",
        "snapshot",
        "resume",
    ]
    assert gpu_plan.plan_parts([8], ["eager"], only=["attention", "step"]) == [
        "attention:kernels",
        "attention:nan",
        "attention:bench",
        "step:eager:8",
    ]
    assert all(gpu_plan.part_seconds(name) > 0 for name in parts)


def test_the_default_budget_fits_one_device_command():
    """gpu_check.sh's 480 s, plus its 60 s hard-stop margin, under a device command's 600 s; by their
    estimates (a T4's pace) the cheap answers and the first compiled step fit in it."""
    script = (ROOT / "bench" / "gpu_check.sh").read_text()
    assert "budget=${2:-480}" in script and "$((budget + 60))" in script and "cpu_smoke" not in script
    parts = gpu_plan.plan_parts([8, 32], ["eager", "compile"])
    cheap = parts[: parts.index("step:compile:8")]
    assert sum(gpu_plan.part_seconds(name) for name in cheap) + gpu_plan.part_seconds("step:compile") <= 480
    assert subprocess.run(["bash", "-n", str(ROOT / "bench" / "gpu_check.sh")]).returncode == 0


def test_gpu_check_sh_writes_the_machine_the_json_and_the_log(corpus, tmp_path):
    """The one-line command itself, on CPU (BENCH_GPU_ARGS makes it a CPU smoke of one part)."""
    out = tmp_path / "gpu"
    extra = " ".join([*smoke_argv(corpus, tmp_path / "unused.json")[:-2], "--only", "versions"])  # its own --json
    env = {**os.environ, "PYTHON": sys.executable, "BENCH_GPU_ARGS": extra, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        ["bash", "bench/gpu_check.sh", str(out), "60"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "torch " in (out / "machine.txt").read_text()
    parts = json.loads((out / "gpu.json").read_text())["parts"]
    assert (
        parts["versions"]["status"] == "ok"
        and "--max-seconds 60" in json.loads((out / "gpu.json").read_text())["command"]
    )
    assert "for bench/RESULTS.md:" in (out / "gpu.log").read_text() and "- versions: cuDNN" in result.stdout
    plan = (out / "plan.txt").read_text()  # the torch-capability rule's answer on this machine's torch
    assert plan.startswith("torch ") and "_efficient_attention_forward [" in plan and "fp16 on " in plan, plan
    assert "Traceback" not in plan and "the torch-capability rule on this card" in result.stdout


@pytest.mark.parametrize(
    "elapsed, estimate, budget, starts",
    [
        (0, 150, 0, True),  # no budget
        (300, 150, 480, True),
        (331, 150, 480, False),
        (470, 10, 480, True),
        (0, 1, 1e-9, False),
    ],
)
def test_a_part_starts_only_when_its_estimate_fits(elapsed, estimate, budget, starts):
    assert gpu_plan.starts_in_budget(elapsed, estimate, budget) is starts


# ----------------------------------------------------------------------------------------------
# The pure pieces of the GPU parts.


@pytest.mark.parametrize(
    "device, precision, runs",
    [
        (H200, "bf16", set(gpu_plan.ATTENTION_PATHS)),
        (A100, "fp16", set(gpu_plan.ATTENTION_PATHS)),
        (T4, "fp16", {"masked sdpa", "efficient varlen", "causal efficient"}),
        (T4, "bf16", {"masked sdpa"}),
        (CPU, "fp32", {"masked sdpa", "causal flash"}),
    ],
)
def test_which_attention_paths_run_on_which_card(device, precision, runs):
    problems = {
        path: gpu_plan.attention_path_problem(path, device, precision, THINK72.head_dim)
        for path in gpu_plan.ATTENTION_PATHS
    }
    assert {path for path, problem in problems.items() if problem is None} == runs
    assert all(problem for path, problem in problems.items() if path not in runs)


def test_document_lengths_are_a_packed_stream_of_realistic_documents():
    segments = gpu_plan.sample_segments(16, 2048, seed=3)
    assert segments.shape == (16, 2048) and segments.dtype == np.int32
    assert (segments[:, 0] == 0).all() and set(np.unique(np.diff(segments, axis=1))) <= {0, 1}
    assert np.array_equal(segments, gpu_plan.sample_segments(16, 2048, seed=3))
    assert not np.array_equal(segments, gpu_plan.sample_segments(16, 2048, seed=4))
    documents = attention.documents_of(segments)
    assert documents.has_boundary and documents.longest <= 2048
    # the documents inside a row (not cut by its edges) are log-normal around the median
    whole = [length for row in gpu_plan.row_lengths(gpu_plan.sample_segments(64, 8192, seed=0)) for length in row[1:-1]]
    assert 300 < np.median(whole) < 520 and np.mean(whole) > np.median(whole)
    assert gpu_plan.row_lengths(np.array([[0, 0, 1, 2, 2, 2]])) == [[2, 1, 3]]
    short = gpu_plan.sample_segments(4, 64, seed=0, median=8)
    assert short.max(axis=1).min() >= 2  # several documents in every row


@pytest.mark.parametrize(
    "name, category",
    [
        ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false>, true>", "attention"),
        ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<...>", "attention"),
        ("fmha_cutlassF_f16_aligned_64x64_rf_sm75(PyTorchMemEffAttention::AttentionKernel<...>::Params)", "attention"),
        ("fmha_cutlassB_f16_aligned_64x64_k128_sm75", "attention"),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x128x128", "attention"),
        ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
        (
            "sm90_xmma_gemm_f16f16_f16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel",
            "matmul",
        ),
        ("ampere_fp16_s16816gemm_fp16_128x128_ldg8_f2f_stages_32x5_tn", "matmul"),
        ("turing_fp16_s1688gemm_fp16_128x128_ldg8_f2f_tn", "matmul"),
        ("cutlass_75_tensorop_f16_s1688gemm_f16_256x128_32x2_nt_align8", "matmul"),
        ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_f16_s161616gemm_f16_32x32_128x2_tn_align8>(...)", "matmul"),
        ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", "matmul"),  # cuBLAS 12.8+ on Hopper
        ("void gemmSN_TN_kernel<float, 128, 16, 2, 4, 4, 4, true, ...>", "matmul"),
        ("void splitKreduce_kernel<32, 16, int, float, __half, float, __half, true, false, false>", "matmul"),
        ("triton_tem_fused_mm_0", "matmul"),
        ("aten::mm", "matmul"),
        ("aten::addmm", "matmul"),
        ("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "communication"),
        ("triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0", "elementwise"),
        (
            "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::Half>, ...>",
            "elementwise",
        ),
        ("Memcpy HtoD (Pageable -> Device)", "elementwise"),
        ("aten::mul", "elementwise"),
    ],
)
def test_kernel_names_by_category(name, category):
    assert gpu_plan.kernel_category(name) == category


def test_the_time_split_puts_the_optimizer_s_kernels_in_its_own_category():
    split = gpu_plan.split_by_category(
        [
            ("ampere_fp16_s16816gemm", 2000.0, False),
            ("ampere_fp16_s16816gemm", 500.0, True),
            ("flash_fwd_kernel", 1000.0, False),
            ("elementwise_kernel", 250.0, True),
            ("elementwise_kernel", 750.0, False),
        ]
    )
    assert split == {"matmul": 2.0, "attention": 1.0, "elementwise": 0.75, "optimizer": 0.75, "communication": 0.0}


def test_compile_counts_read_recompiles_and_graph_breaks():
    counts = gpu_plan.compile_counts(
        ["0/0", "1/0", "0/1", "[0/1]", "1/1_1", "0/2"],
        {"graph_break": {"Failed to trace builtin operator\n  Explanation: print": 3}, "stats": {"unique_graphs": 6}},
    )
    assert counts == {
        "frames_compiled": 5,
        "recompiles": 3,
        "graph_breaks": 3,
        "graph_break_reasons": ["Failed to trace builtin operator"],
        "unique_graphs": 6,
    }
    assert gpu_plan.compile_counts([], {})["recompiles"] == 0


def test_the_gemm_shapes_are_the_step_s_matmuls():
    tokens, vocab = 8 * 1024, gpu_plan.THINK72_VOCAB
    shapes = gpu_plan.gemm_shapes(THINK72, vocab, tokens)
    flops = {
        kind: sum(2 * m * k * n * count for name, m, k, n, count in shapes if kind in name)
        for kind in ("forward", "input grad", "weight grad")
    }
    matrices = sum(rows * columns for rows, columns in hardware.muon_matrix_shapes(THINK72))
    assert flops["forward"] == 2 * tokens * (matrices + vocab * THINK72.hidden)  # 2 N per token, the head included
    assert flops["input grad"] == flops["forward"] == flops["weight grad"]
    chunk = hardware.logits_chunk_tokens(vocab, "cuda")
    assert ("lm head forward", chunk, 512, vocab, tokens // chunk) in shapes
    assert ("lm head forward (last chunk)", tokens % chunk, 512, vocab, 1) in shapes
    assert ("gate/up weight grad", 1536, tokens, 512, 28) in shapes


def test_loss_curves_side_by_side():
    same = gpu_plan.curves_close([3.0, 2.5, 2.0, 1.9], [3.0, 2.5, 2.0, 1.9], window=2)
    assert same["close"] and same["last_relative_difference"] == 0 and same["steps"] == 4
    apart = gpu_plan.curves_close([3.0, 2.0, 1.0, 1.0], [3.0, 2.5, 2.0, 1.5, 1.2], window=2)
    assert not apart["close"] and apart["steps"] == 4 and apart["max_running_mean_difference"] == pytest.approx(0.75)
    assert gpu_plan.curves_close([], [1.0]) == {"steps": 0, "close": False}


@pytest.mark.parametrize(
    "names, kinds, matched",
    [
        (
            ["aten::_scaled_dot_product_flash_attention", "void pytorch_flash::flash_fwd_kernel<...>", "aten::mm"],
            ["flash"],
            2,
        ),
        (
            ["fmha_cutlassF_f16_aligned_64x64_rf_sm75", "aten::_scaled_dot_product_efficient_attention"],
            ["efficient"],
            2,
        ),
        (["cutlass_75_tensorop_f16_s1688gemm_f16_256x128", "aten::mm", "aten::softmax"], [], 0),  # GEMMs: not attention
        (["aten::_scaled_dot_product_attention_math", "aten::bmm"], ["math"], 1),
        (["aten::_scaled_dot_product_flash_attention_for_cpu"], ["flash"], 1),
        (
            ["aten::_scaled_dot_product_cudnn_attention", "cudnn_generated_fort_native_sdpa_sm80_flash_fprop"],
            ["cudnn"],
            2,
        ),
    ],
)
def test_attention_kernels(names, kinds, matched):
    found = gpu_plan.attention_kernels(names)
    assert found["kinds"] == kinds
    assert len(found["names"]) == matched and set(found["names"]) <= set(names)


def a_record() -> dict:
    """A gpu.json as an H200 run would write it (figures made up), with a part of each outcome."""
    step = {
        "status": "ok",
        "compiled": False,
        "batch_size": 8,
        "grad_accum": 8,
        "tokens_per_second": 400_000.0,
        "mfu": 0.2,
        "peak_memory_bytes": 6 * 2**30,
        "step_memory_bytes": 5 * 2**30,
        "first_step_loss": 10.4,
        "profiled_step_ms_per_micro_step": {
            "matmul": 5.0,
            "attention": 1.0,
            "elementwise": 4.0,
            "optimizer": 0.5,
            "communication": 0.0,
        },
    }
    path = {
        "status": "ok",
        "forward_backward_ms": 1.5,
        "per_micro_batch_ms": 21.1,
        "prepare_ms": 0.1,
        "peak_memory_bytes": 64 * 2**20,
        "max_error": 2e-3,
        "useful_tflops": 150.0,
        "computed_over_useful": 1.0,
        "exact": True,
    }
    return {
        "command": "python bench/bench_gpu.py --json gpu.json --max-seconds 480",
        "elapsed_seconds": 470.0,
        "machine": {"device": "NVIDIA H200 (sm_90)", "world": 1, "date": "d", "torch": "2.13", "cuda": "12.9"},
        "parts": {
            "versions": {
                "status": "ok",
                "cudnn": 91500,
                "nccl": "2.27.5",
                "triton": "3.6.0",
                "sdpa_priority": ["flash_attention", "cudnn_attention", "efficient_attention", "math"],
                "sdpa_choice": {"causal, grouped heads": {"ran": "flash"}, "masked, heads repeated": {"ran": "cudnn"}},
            },
            "attention:kernels": {
                "status": "ok",
                "shape": "8x1024",
                "precision": "bf16",
                "paths": {
                    "flash varlen": {"status": "ok", "kinds": ["flash"], "attention_names": ["flash_fwd_kernel"]},
                    "causal efficient": {"status": "error", "error": "RuntimeError: No available kernel"},
                },
            },
            "attention:nan": {
                "status": "ok",
                "precision": "bf16",
                "lengths": {
                    "1088 bf16": {"nan_output": False, "nan_grad_q": True, "nan_grad_k": False, "nan_grad_v": False},
                    "1024 bf16": {"error": "RuntimeError: no cuDNN"},
                },
            },
            "attention:bench": {
                "status": "ok",
                "precision": "bf16",
                "document_median": 400,
                "document_sigma": 1.0,
                "shapes": {
                    "8x1024": {
                        "documents_per_row": 3.5,
                        "paths": {
                            "flash varlen": path,
                            "masked sdpa": {**path, "computed_over_useful": 3.2},
                            "efficient varlen": {"status": "oom", "error": "OutOfMemoryError: CUDA"},
                        },
                    }
                },
            },
            "newton_schulz": {
                "status": "ok",
                "matrices": 98,
                "preset": "think72",
                "train_dtype": "bf16",
                "dtypes": {"fp16": {"ms": 2.0, "tflops": 300.0, "max_relative_error": 1e-3}},
            },
            "roofline:gemm": {
                "status": "ok",
                "tokens": 8192,
                "precision": "bf16",
                "weighted_tflops": 500.0,
                "gemm_ms_per_micro_step": 3.0,
                "square_size": 8192,
                "square_tflops": 700.0,
                "shapes": [{"name": "q forward", "tflops": 400.0}],
            },
            "roofline:copy": {"status": "ok", "bytes": 2**30, "copy_gbs": 4000.0, "add_gbs": 4200.0},
            "step:eager:8": step,
            "fp16_vs_bf16": {
                "status": "ok",
                "batch_size": 8,
                "steps": 150,
                "last_mean_first": 2.0,
                "last_mean_second": 2.01,
                "last_relative_difference": 0.005,
                "max_running_mean_difference": 0.05,
                "close": True,
                "runs": {"bf16": {}, "fp16": {"newton_schulz_dtype": "fp16", "skipped_steps": 4}},
            },
            "step:compile:8": {
                **step,
                "compiled": True,
                "first_step_loss": 10.4001,
                "tokens_per_second": 600_000.0,
                "graph_breaks": 1,
                "recompiles": 2,
                "compile_seconds": 41.2,
            },
            "step:compile:32": {"status": "skipped", "reason": "--max-seconds 480: 100 s left, 150 s estimated"},
            "overflow": {"status": "ok", "weights_unchanged": True, "scale_lowered": True},
            "resume": {"status": "error", "error": "RuntimeError: boom"},
        },
    }


def test_markdown_lines_show_every_part():
    text = "\n".join(gpu_report.markdown_lines(a_record()))
    assert "### GPU: NVIDIA H200 (sm_90) x1" in text and "(470.0 s)" in text
    assert "SDPA's global priority flash_attention > cudnn_attention > efficient_attention > math" in text
    assert "SDPA ran (profiler): causal, grouped heads: flash, masked, heads repeated: cudnn" in text
    assert "  - flash varlen: flash: flash_fwd_kernel" in text
    assert "  - causal efficient: error: RuntimeError: No available kernel" in text
    assert "1088 bf16: NaN in grad_q True" in text and "1024 bf16: RuntimeError: no cuDNN" in text
    assert (
        "| 8x1024 (3.5 documents/row) | flash varlen | 1.500 ms | 21.10 ms | 0.100 ms | 64 MiB | 2.0e-03 | 150.0 "
        "| 1.00 |" in text
    )
    assert "| masked sdpa |" in text and "| 3.20 |" in text and "| efficient varlen | oom: OutOfMemoryError" in text
    assert "fp16 2.00 ms (300 TFLOP/s, error 1.0e-03)" in text
    assert "weighted 500" in text and "copy 4000 GB/s" in text
    assert "4 overflow skips) vs bf16 over 150 steps" in text and ": close" in text
    assert (
        "| eager:8 (x8) | 400,000 | 20.0% | 6.00 GiB | 5.00 GiB | 10.4000 | eager | 5.00 / 1.00 / 4.00 / 0.50 "
        "/ 0.00 (+ 0.00) |" in text
    )
    assert "| compile:8 (x8) | 600,000 |" in text and "| 41 s, 1 / 2 |" in text
    assert "first-step loss eager 10.400000, compiled 10.400100 (difference 1.00e-04); compiled 1.50x eager" in text
    assert "- step:compile:32: skipped: --max-seconds 480: 100 s left, 150 s estimated" in text
    assert "- overflow: ok; weights_unchanged True, scale_lowered True" in text
    assert "- resume: error: RuntimeError: boom" in text


def test_a_part_with_a_figure_missing_is_one_line_not_a_crash():
    record = a_record()
    del record["parts"]["roofline:copy"]["copy_gbs"]
    text = "\n".join(gpu_report.markdown_lines(record))
    assert "- roofline:copy: ok (not shown: KeyError: 'copy_gbs'; see gpu.json)" in text
    assert "| compile:8 (x8) | 600,000 |" in text


def test_the_markdown_is_printed_again_from_a_saved_json(tmp_path, capsys):
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(a_record()))
    assert bench_gpu.main(["--markdown-from", str(path)]) == 0
    assert "| compile:8 (x8) | 600,000 |" in capsys.readouterr().out


def test_the_prediction_table_in_the_docs_is_the_model_s():
    docs = (ROOT / "docs" / "training.md").read_text()
    for line in gpu_report.prediction_table():
        assert line in docs, line


def test_predict_only_prints_the_table(capsys):
    assert bench_gpu.main(["--predict-only"]) == 0
    assert "| T4 x2 | fp16 |" in capsys.readouterr().out


# ----------------------------------------------------------------------------------------------
# Every part on CPU.


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matrices on a shared 2-core machine: a second thread only waits (conftest restores the count)."""
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_tiny_corpus(tmp_path_factory.mktemp("corpus"))


# The bench on CPU runs in the CPU's auto precision: fp32, or bf16 where it has bf16 instructions, whose
# error against the fp32 reference is bf16's 8-bit rounding
CPU_PRECISION = this_cpu_precision()
CPU_TOLERANCE = 1e-5 if CPU_PRECISION == "fp32" else 2e-2


def smoke_argv(corpus: Path, out: Path, *extra: str) -> list[str]:
    return [
        "--device",
        "cpu",
        "--preset",
        "tiny",
        "--vocab",
        "0",
        "--context",
        "32",
        "--corpus",
        str(corpus),
        "--attention-shapes",
        "2x32,2x64",
        "--document-median",
        "8",
        "--step-batch-sizes",
        "2,4",
        "--step-tokens",
        "256",
        "--compile-modes",
        "eager",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--compare-steps",
        "3",
        "--compare-batch-size",
        "2",
        "--repeats",
        "1",
        "--json",
        str(out),
        *extra,
    ]


def test_every_part_on_cpu_and_a_failing_part_does_not_stop_the_others(corpus, tmp_path, capsys):
    out = tmp_path / "gpu.json"
    assert bench_gpu.main(smoke_argv(corpus, out, "--inject-failure", "roofline:copy")) == 0
    record = json.loads(out.read_text())
    parts = record["parts"]
    assert list(parts) == record["plan"] == gpu_plan.plan_parts([2, 4], ["eager"])
    assert {name: part["status"] for name, part in parts.items() if part["status"] != "ok"} == {
        "attention:nan": "skipped",
        "roofline:copy": "error",
    }
    assert parts["attention:nan"]["reason"] == "cuDNN attention needs CUDA"
    assert parts["roofline:copy"]["error"] == "RuntimeError: injected failure (--inject-failure roofline:copy)"

    assert parts["versions"]["sdpa_priority"] and parts["versions"]["torch"] == torch.__version__
    kernels = parts["attention:kernels"]["paths"]
    assert kernels["masked sdpa"]["kinds"] == kernels["causal flash"]["kinds"] == ["flash"]  # the CPU flash kernel
    assert kernels["flash varlen"]["status"] == "skipped"  # for the reason attention.KERNELS' record gives
    assert kernels["flash varlen"]["reason"].startswith("flash attention needs sm_80+ (CPU")
    for shape in ("2x32", "2x64"):
        figures = parts["attention:bench"]["shapes"][shape]
        assert figures["documents_per_row"] > 1
        for path in ("masked sdpa", "causal flash"):
            found = figures["paths"][path]
            assert found["status"] == "ok" and found["forward_backward_ms"] > 0, found
            assert found["max_error"] < CPU_TOLERANCE, found
        assert (
            figures["paths"]["masked sdpa"]["computed_over_useful"]
            > figures["paths"]["causal flash"]["computed_over_useful"]
            > 1
        )
        assert figures["paths"]["efficient varlen"]["status"] == "skipped"

    newton_schulz = parts["newton_schulz"]["dtypes"]
    assert newton_schulz["fp32"]["max_relative_error"] < 1e-4 < newton_schulz["bf16"]["max_relative_error"] < 0.1
    assert parts["roofline:gemm"]["weighted_tflops"] > 0 and len(parts["roofline:gemm"]["shapes"]) == 18
    for size, accum in ((2, 4), (4, 2)):
        step = parts[f"step:eager:{size}"]
        assert step["grad_accum"] == accum and step["tokens_per_step"] == 256 and len(step["step_seconds"]) == 2
        assert step["split_ms"]["matmul"] > 0 and step["split_ms"]["optimizer"] > 0
        assert step["split_ms"]["attention"] > 0 and step["attention_kinds"] == ["flash"]
        assert step["step_memory_bytes"] > 0 and step["muon_step_ms"] > 0
    assert parts["step:eager:2"]["first_step_loss"] == pytest.approx(
        parts["step:eager:4"]["first_step_loss"], rel=CPU_TOLERANCE
    )  # the same samples
    compared = parts["fp16_vs_bf16"]
    assert compared["steps"] == 3 and compared["runs"]["fp16"]["newton_schulz_dtype"] == "fp16"
    bf16_newton_schulz = hardware.newton_schulz_dtype(hardware.describe(torch.device("cpu")), "bf16")
    assert compared["runs"]["bf16"]["newton_schulz_dtype"] == bf16_newton_schulz and compared["close"]
    assert parts["overflow"]["weights_unchanged"] and parts["overflow"]["next_step_applied"]
    assert parts["snapshot"]["snapshot_1_equal"] and parts["snapshot"]["snapshot_2_equal"]
    assert parts["resume"]["bitwise"] and parts["resume"]["losses_equal"]

    events = [json.loads(line) for line in (tmp_path / "gpu.events.jsonl").read_text().splitlines()]
    assert [event["part"] for event in events if event["status"] != "started"] == list(parts)
    failed = next(event for event in events if event["part"] == "roofline:copy" and "traceback" in event)
    assert "Traceback" in failed["traceback"] and "injected failure" in failed["traceback"]
    printed = capsys.readouterr().out
    assert f"--precision auto -> {CPU_PRECISION}" in printed and "| eager:2 (x4) |" in printed


def test_the_varlen_paths_run_through_the_bench_s_glue(corpus, tmp_path, monkeypatch):
    """The attention parts' calls of the CUDA-only paths, on CPU: the varlen kernels replaced by a
    per-document reference (as tests/test_attention.py does), every path allowed."""
    for implementation in attention.VARLEN_IMPLEMENTATIONS:
        monkeypatch.setitem(attention.VARLEN_KERNELS, implementation, reference_varlen)
    monkeypatch.setattr(gpu_attention, "attention_path_problem", lambda *args: None)
    args = bench_gpu.parse_args(smoke_argv(corpus, tmp_path / "gpu.json", "--attention-shapes", "3x48"))
    info = distributed.init_distributed("cpu")
    recorder = gpu_record.Recorder(args, info, {"parts": {}})
    bench = bench_gpu.Bench(args, info, gpu_bench.Corpus(args, info, tmp_path), tmp_path, recorder)
    paths = recorder.run("attention:bench", bench.part("attention:bench"))["shapes"]["3x48"]["paths"]
    for path in ("flash varlen", "efficient varlen"):
        assert paths[path]["status"] == "ok" and paths[path]["max_error"] < CPU_TOLERANCE, paths[path]
        assert paths[path]["computed_over_useful"] == 1 and paths[path]["prepared"] == "documents_of on the host + copy"
    assert paths["causal efficient"]["status"] == "error"  # no memory-efficient kernel on CPU


def test_the_budget_skips_the_parts_that_would_start_late(corpus, tmp_path):
    out = tmp_path / "gpu.json"
    assert bench_gpu.main(smoke_argv(corpus, out, "--max-seconds", "1e-9")) == 0
    record = json.loads(out.read_text())
    assert list(record["parts"]) == record["plan"]
    assert {part["status"] for part in record["parts"].values()} == {"skipped"}


def test_two_ranks_under_torchrun_on_gloo(corpus, tmp_path):
    out = tmp_path / "gpu.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "bench/bench_gpu.py",
            *smoke_argv(corpus, out, "--collective-timeout", "120", "--only", "step:eager:2,resume", "--steps", "1"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    parts = json.loads(out.read_text())["parts"]
    assert {name: part["status"] for name, part in parts.items()} == {"step:eager:2": "ok", "resume": "ok"}, parts
    step = parts["step:eager:2"]
    assert step["world"] == 2 and step["tokens_per_step"] == 256 and step["grad_accum"] == 2
    assert set(step["split_ms"]) == set(gpu_plan.CATEGORIES)  # (gloo's all-reduce runs in its own thread: 0 here)
    assert parts["resume"]["bitwise"] and parts["resume"]["losses_equal"]


def test_an_out_of_memory_part_is_recorded_and_the_next_runs(tmp_path):
    args = bench_gpu.parse_args(["--device", "cpu", "--json", str(tmp_path / "gpu.json")])
    recorder = gpu_record.Recorder(args, distributed.init_distributed("cpu"), {"parts": {}})

    def too_big():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    assert recorder.run("step:compile:32", too_big)["status"] == "oom"
    assert recorder.run("overflow", lambda: {"passed": False, "weights_unchanged": False})["status"] == "failed"
    assert recorder.run("snapshot", lambda: {"passed": True})["status"] == "ok"
    parts = json.loads((tmp_path / "gpu.json").read_text())["parts"]
    oom = parts["step:compile:32"]
    assert oom["error"] == "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    assert oom["where"].startswith("test_bench_gpu.py:")
    assert [parts[name]["status"] for name in parts] == ["oom", "failed", "ok"]


@pytest.mark.parametrize("path", [path for path in gpu_plan.ATTENTION_PATHS if path != "masked sdpa"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_each_attention_path_of_the_bench_traces_on_fake_cuda(path, dtype, monkeypatch):
    """Bench.attention_call on fake "cuda" tensors of think72's heads (no GPU): the layout and dtype each
    CUDA-only path hands its kernel and returns. SDPA is recorded at its Python entry (tests/test_attention.py's
    rule). (The masked path copies its inputs, which a CPU build cannot do on fake "cuda"; it runs on CPU.)"""
    import torch.nn.functional as F
    from torch._subclasses.fake_tensor import FakeTensorMode

    bench = object.__new__(bench_gpu.Bench)  # no device to describe: only the preset is read
    bench.preset = THINK72
    sdpa_calls = []

    def sdpa(*args, **kwargs):
        sdpa_calls.append((args, kwargs))
        return torch.empty_like(args[0])

    monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa)
    layout = attention.documents_of(gpu_plan.sample_segments(2, 1024, seed=0))
    with FakeTensorMode():
        inputs = {
            name: torch.empty(2, 1024, heads, 128, device="cuda", dtype=dtype)
            for name, heads in (("q", 8), ("k", 4), ("v", 4))
        }
        inputs["documents"] = attention.Documents(
            torch.empty(2, 1024, dtype=torch.int32, device="cuda"),
            torch.empty(2, 1024, dtype=torch.long, device="cuda"),
            torch.tensor(layout.cu_seqlens.tolist(), dtype=torch.int32, device="cuda"),
            layout.longest,
        )
        inputs["mask"] = torch.empty(2, 1, 1024, 1024, dtype=torch.bool, device="cuda")
        output = bench.attention_call(path, inputs)
        assert output.shape == (2, 1024, 8, 128) and output.dtype == dtype and output.device.type == "cuda"
    if path.startswith("causal"):
        [(args, kwargs)] = sdpa_calls
        assert kwargs["is_causal"] and kwargs["enable_gqa"] == (path == "causal flash")
        assert args[1].shape[1] == (4 if path == "causal flash" else 8)
    else:
        assert sdpa_calls == []


@pytest.mark.slow
def test_a_compiled_step_part_on_cpu_counts_its_compiles(corpus, tmp_path):
    """step:compile on CPU (about a minute): train.py's compile at start, Dynamo's counts, the same first loss."""
    out = tmp_path / "gpu.json"
    argv = smoke_argv(
        corpus,
        out,
        "--only",
        "step",
        "--compile-modes",
        "eager,compile",
        "--step-batch-sizes",
        "2",
        "--step-tokens",
        "128",
    )
    assert bench_gpu.main(argv) == 0
    parts = json.loads(out.read_text())["parts"]
    eager, compiled = parts["step:eager:2"], parts["step:compile:2"]
    assert compiled["status"] == "ok" and compiled["compiled"] and compiled["compiled_in_the_end"], compiled
    assert compiled["compile_seconds"] > 0 and compiled["frames_compiled"] >= 1 and compiled["graph_breaks"] == 0
    assert compiled["recompiles"] >= 0 and compiled["unique_graphs"] >= 1
    assert eager["compile_seconds"] is None and "frames_compiled" not in eager
    assert compiled["first_step_loss"] == pytest.approx(eager["first_step_loss"], rel=1e-4)
