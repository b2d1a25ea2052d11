"""bench_gpu.py's attention parts: the versions and SDPA's own choice, the kernels each path runs, cuDNN's NaN
case, and the micro-benchmark of every path against an fp64 reference."""

from __future__ import annotations

import contextlib
import math
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gpu_measure import host_seconds, time_on_device  # noqa: E402
from gpu_plan import (  # noqa: E402
    ATTENTION_PATHS,
    NAN_LENGTHS,
    attention_kernels,
    attention_path_problem,
    kernel_category,
    relative_difference,
    row_lengths,
    sample_segments,
)
from gpu_record import first_line, free_memory  # noqa: E402

from tinyllm.model import attention  # noqa: E402


def layer_stub(implementation: str, groups: int):
    """What attention.py's and transformers' attention functions read of a decoder layer."""
    from types import SimpleNamespace

    return SimpleNamespace(
        config=SimpleNamespace(_attn_implementation=implementation), num_key_value_groups=groups, is_causal=True
    )


class AttentionParts:
    """The parts `versions`, `attention:kernels`, `attention:nan` and `attention:bench` (of a `BenchContext`)."""

    # -- versions and SDPA's choice ------------------------------------------------------------

    def versions(self) -> dict:
        """The software, and what SDPA itself would pick for think72's two kinds of calls."""
        import torch

        found = {
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
            "sdpa_priority": sdpa_priority(),
        }
        with contextlib.suppress(Exception):
            found["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if self.device.is_cuda else None
        with contextlib.suppress(ImportError):
            import triton

            found["triton"] = triton.__version__
        found["sdpa_enabled"] = {
            "flash": torch.backends.cuda.flash_sdp_enabled(),
            "efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
            "cudnn": torch.backends.cuda.cudnn_sdp_enabled(),
            "math": torch.backends.cuda.math_sdp_enabled(),
        }
        if not self.device.is_cuda:
            found["sdpa_choice"] = "n/a on CPU (can_use_* are CUDA's rules)"
            return found
        preset, dtype = self.preset, self.dtype()
        choice = {}
        for case, (length, masked) in {
            "causal, grouped heads": (preset.context, False),
            "masked, heads repeated": (preset.context, True),
            "masked at 1088": (1088, True),
        }.items():
            q = torch.randn(2, preset.heads, length, preset.head_dim, device=self.info.device, dtype=dtype)
            kv_heads = preset.heads if masked else preset.kv_heads
            k = torch.randn(2, kv_heads, length, preset.head_dim, device=self.info.device, dtype=dtype)
            mask = (
                torch.ones(2, 1, length, length, dtype=torch.bool, device=self.info.device).tril() if masked else None
            )
            try:
                choice[case] = sdpa_choice(q, k, k, mask, causal=not masked, gqa=not masked)
            except Exception as error:  # noqa: BLE001 - one case's failure is its finding
                choice[case] = {"ran": first_line(error)}
        found["sdpa_choice"] = choice
        return found

    # -- attention: which kernels run, the NaN case, the micro-benchmark -------------------------

    def attention_inputs(self, rows: int, tokens: int, seed: int = 0) -> dict:
        """q, k, v (leaves laid out (B, C, H, D) as the projections give them), the output gradient, the
        segments of realistic documents, their mask and Documents, on the device."""
        import torch

        preset = self.preset
        generator = torch.Generator(device=self.info.device).manual_seed(seed)
        make = lambda heads: (  # noqa: E731
            (
                torch.randn(
                    rows,
                    tokens,
                    heads,
                    preset.head_dim,
                    device=self.info.device,  # noqa: E731
                    generator=generator,
                )
                * 0.5
            )
            .to(self.dtype())
            .requires_grad_()
        )
        segments = sample_segments(rows, tokens, seed, self.args.document_median, self.args.document_sigma)
        documents = attention.documents_of(segments).to(self.info.device)
        return {
            "q": make(preset.heads),
            "k": make(preset.kv_heads),
            "v": make(preset.kv_heads),
            "grad": torch.randn(
                rows, tokens, preset.heads, preset.head_dim, device=self.info.device, generator=generator
            ).to(self.dtype()),
            "segments": segments,
            "documents": documents,
            "mask": attention.document_mask(documents.segments),
        }

    def attention_call(self, path: str, inputs: dict):
        """One layer's attention by `path`, as training calls it: (B, C, H, D)."""
        from torch.nn.attention import SDPBackend, sdpa_kernel

        q, k, v = (inputs[name].transpose(1, 2) for name in ("q", "k", "v"))
        groups, scale = self.preset.heads // self.preset.kv_heads, self.preset.head_dim**-0.5
        if path == "masked sdpa":  # today's: transformers' sdpa with the boolean mask, SDPA's own backend
            return attention.masked_attention(
                layer_stub(attention.MASKED, groups), q, k, v, inputs["mask"], scaling=scale
            )[0]
        implementation = attention.FLASH if "flash" in path else attention.EFFICIENT
        stub = layer_stub(implementation, groups)
        if attention.kernel(path).boundaries:
            documents = inputs["documents"]
            return attention.varlen_attention(
                stub,
                q,
                k,
                v,
                None,
                scaling=scale,
                document_starts=documents.cu_seqlens,
                longest_document=documents.longest,
            )[0]
        backend = SDPBackend.FLASH_ATTENTION if "flash" in path else SDPBackend.EFFICIENT_ATTENTION
        with sdpa_kernel([backend]):
            return attention.varlen_attention(stub, q, k, v, None, scaling=scale)[0]

    def attention_step(self, path: str, inputs: dict) -> None:
        for name in ("q", "k", "v"):
            inputs[name].grad = None
        self.attention_call(path, inputs).backward(inputs["grad"])

    def runnable_paths(self) -> dict[str, str | None]:
        return {
            path: attention_path_problem(path, self.device, self.precision, self.preset.head_dim)
            for path in ATTENTION_PATHS
        }

    def attention_kernels(self) -> dict:
        """Each path's forward + backward once under the profiler: the kernels that actually run."""
        import torch
        from torch.profiler import ProfilerActivity, profile

        rows, tokens = self.args.attention_shapes[0]
        inputs = self.attention_inputs(rows, tokens)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.is_cuda else [])
        result = {"shape": f"{rows}x{tokens}", "precision": self.precision, "paths": {}}
        for path, problem in self.runnable_paths().items():
            if problem:
                result["paths"][path] = {"status": "skipped", "reason": problem}
                continue
            try:
                self.attention_step(path, inputs)  # compiled kernels loaded before the profile
                with profile(activities=activities) as profiler:
                    self.attention_step(path, inputs)
                    self.synchronize()
                names = sorted({event.key for event in profiler.key_averages()})
                kernels = [name for name in names if kernel_category(name) == "attention"]
                result["paths"][path] = {"status": "ok", **attention_kernels(names), "attention_names": kernels[:8]}
            except Exception as error:  # noqa: BLE001 - one path's failure is its finding
                result["paths"][path] = {"status": "error", "error": first_line(error)}
            if self.device.is_cuda:
                torch.cuda.empty_cache()
            self.recorder.partial(result)
        return result

    def attention_nan(self) -> dict:
        """cuDNN attention with a boolean mask at 1088 (64 mod 128) and 1024 tokens: NaN in the gradients?"""
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel

        self.needs_cuda("cuDNN attention")
        preset, result = self.preset, {"precision": self.precision, "lengths": {}}
        for length, precision in [
            (length, precision) for precision in dict.fromkeys([self.precision, "fp16"]) for length in NAN_LENGTHS
        ]:
            generator = torch.Generator(device=self.info.device).manual_seed(0)
            q, k, v = (
                torch.randn(2, preset.heads, length, preset.head_dim, device=self.info.device, generator=generator)
                .to(self.dtype(precision))
                .requires_grad_()
                for _ in range(3)
            )
            segments = torch.zeros(2, length, dtype=torch.int32, device=self.info.device)
            segments[:, length // 3 :] = 1
            mask = attention.document_mask(segments)
            try:
                with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
                out.backward(torch.randn_like(out))
                self.synchronize()
                result["lengths"][f"{length} {precision}"] = {
                    "nan_output": bool(out.isnan().any()),
                    "nan_grad_q": bool(q.grad.isnan().any()),
                    "nan_grad_k": bool(k.grad.isnan().any()),
                    "nan_grad_v": bool(v.grad.isnan().any()),
                }
            except Exception as error:  # noqa: BLE001 - a card without cuDNN attention says so here
                result["lengths"][f"{length} {precision}"] = {"error": first_line(error)}
        return result

    def attention_bench(self) -> dict:
        """Every path at every --attention-shapes: forward + backward, memory, error, prepare time."""
        import torch

        preset, result = (
            self.preset,
            {
                "precision": self.precision,
                "document_median": self.args.document_median,
                "document_sigma": self.args.document_sigma,
                "shapes": {},
            },
        )
        for rows, tokens in self.args.attention_shapes:
            shape = f"{rows}x{tokens}"
            inputs = self.attention_inputs(rows, tokens)
            lengths = row_lengths(inputs["segments"])
            counts = [len(row) for row in lengths]
            figures = {
                "documents_per_row": statistics.mean(counts),
                "mean_document_tokens": rows * tokens / sum(counts),
                "longest_document": inputs["documents"].longest,
                "paths": {},
            }
            result["shapes"][shape] = figures
            useful = sum(
                attention.attention_flops("flash varlen", row, tokens, preset.heads, preset.head_dim) for row in lengths
            )
            checked = min(rows, 2)
            references = {kind: self.attention_reference(inputs, checked, kind) for kind in ("documents", "causal")}
            for path, problem in self.runnable_paths().items():
                if problem:
                    figures["paths"][path] = {"status": "skipped", "reason": problem}
                    continue
                if self.time_up():
                    figures["paths"][path] = {"status": "skipped", "reason": "the part's time is spent"}
                    continue
                try:
                    figures["paths"][path] = self.attention_path(path, inputs, references, checked, useful, lengths)
                except Exception as error:  # noqa: BLE001 - one path's failure is its finding
                    figures["paths"][path] = {
                        "status": "oom" if "out of memory" in str(error).lower() else "error",
                        "error": first_line(error),
                    }
                if self.device.is_cuda:
                    torch.cuda.empty_cache()
                self.recorder.partial(result)
            del inputs, references
            free_memory()
        return result

    def attention_path(
        self, path: str, inputs: dict, references: dict, checked: int, useful: float, lengths: list[list[int]]
    ) -> dict:
        import torch

        preset = self.preset
        rows, tokens = inputs["segments"].shape
        seconds = time_on_device(lambda: self.attention_step(path, inputs), self.info.device, self.args.repeats)
        peak = None
        if self.device.is_cuda:
            for name in ("q", "k", "v"):
                inputs[name].grad = None
            self.synchronize()
            torch.cuda.reset_peak_memory_stats(self.info.device)
            base = torch.cuda.memory_allocated(self.info.device)
            self.attention_step(path, inputs)
            self.synchronize()
            peak = torch.cuda.max_memory_allocated(self.info.device) - base
        self.attention_step(path, inputs)
        output = self.attention_call(path, inputs).detach()
        reference = references["documents" if attention.kernel(path).exact else "causal"]
        errors = {"output": relative_difference(reference["output"], output[:checked])}
        for name in ("q", "k", "v"):
            errors[f"grad_{name}"] = relative_difference(reference[name], inputs[name].grad[:checked])
        segments = inputs["segments"]
        if attention.kernel(path).exact:  # the data reader's Documents (positions, cu_seqlens)
            prepare = host_seconds(lambda: attention.documents_of(segments).to(self.info.device), self.args.repeats)
            prepared = "documents_of on the host + copy"
            if path == "masked sdpa":  # and the mask, built on the device in every forward
                prepare += time_on_device(
                    lambda: attention.document_mask(inputs["documents"].segments), self.info.device, self.args.repeats
                )
                prepared += ", document_mask on the device"
        else:
            prepare, prepared = 0.0, "none (plain causal: no mask, no documents)"
        computed = sum(attention.attention_flops(path, row, tokens, preset.heads, preset.head_dim) for row in lengths)
        return {
            "status": "ok",
            "forward_backward_ms": 1000 * seconds,
            "peak_memory_bytes": peak,
            "max_error": max(errors.values()),
            "errors": errors,
            "prepare_ms": 1000 * prepare,
            "prepared": prepared,
            "per_micro_batch_ms": 1000 * (preset.layers * seconds + prepare),
            "useful_tflops": useful / seconds / 1e12,
            "computed_over_useful": computed / useful,
            "exact": attention.kernel(path).exact,
        }

    def attention_reference(self, inputs: dict, rows: int, kind: str) -> dict:
        """fp64 output and gradients of the first `rows` rows: per-document causal ("documents") or
        causal over the whole row ("causal"), by the softmax written out, the K/V heads repeated."""
        import torch

        groups, scale = self.preset.heads // self.preset.kv_heads, self.preset.head_dim**-0.5
        found: dict[str, list] = {"output": [], "q": [], "k": [], "v": []}
        tokens = inputs["segments"].shape[1]
        causal = torch.ones(tokens, tokens, dtype=torch.bool, device=self.info.device).tril()
        for row in range(rows):
            q, k, v = (inputs[name][row].detach().double().requires_grad_() for name in ("q", "k", "v"))
            allowed = inputs["mask"][row, 0] if kind == "documents" else causal
            keys, values = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q, keys) * scale
            weights = scores.masked_fill(~allowed, -math.inf).softmax(dim=-1)
            output = torch.einsum("hqk,khd->qhd", weights, values)
            output.backward(inputs["grad"][row].double())
            for name, tensor in (("output", output.detach()), ("q", q.grad), ("k", k.grad), ("v", v.grad)):
                found[name].append(tensor)
            del scores, weights, output
        return {name: torch.stack(tensors) for name, tensors in found.items()}


def sdpa_priority() -> list[str]:
    """SDPA's backend priority order as torch reports it (names), flash first by default."""
    import torch
    from torch.nn.attention import SDPBackend

    names = {
        int(getattr(SDPBackend, name)): name.lower()
        for name in ("MATH", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "OVERRIDEABLE")
        if hasattr(SDPBackend, name)
    }
    try:
        return [names.get(int(value), str(value)) for value in torch._C._get_sdp_priority_order()]
    except (AttributeError, RuntimeError):
        return []


def sdpa_choice(q, k, v, mask, causal: bool, gqa: bool) -> dict:
    """Which backends SDPA's own checks (torch.backends.cuda.can_use_*) accept for this call, the first of
    them in torch's global priority order, and the kernel that ran (a forward under the profiler: the
    effective choice, which on sm_90 may put cuDNN first whatever the global order says)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    checks = {
        "flash_attention": torch.backends.cuda.can_use_flash_attention,
        "efficient_attention": torch.backends.cuda.can_use_efficient_attention,
        "cudnn_attention": torch.backends.cuda.can_use_cudnn_attention,
    }
    params = torch.backends.cuda.SDPAParams(q, k, v, mask, 0.0, causal, gqa)
    accepted = {}
    for name, check in checks.items():
        try:
            accepted[name] = bool(check(params, False))
        except (RuntimeError, TypeError) as error:
            accepted[name] = first_line(error)
    order = [name for name in sdpa_priority() if name != "overrideable"]
    first = next((name for name in order if name == "math" or accepted.get(name) is True), None)
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
            torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa)
            torch.cuda.synchronize()
        found = attention_kernels([event.key for event in profiler.key_averages()])
        ran = ", ".join(found["kinds"]) or "none seen"
    except Exception as error:  # noqa: BLE001 - what failed is the finding
        ran = first_line(error)
    return {"accepted": accepted, "first_in_global_order": first, "ran": ran}
