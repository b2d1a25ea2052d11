#!/usr/bin/env bash
# The first GPU's command, one line on a lent card (docs/development.md):
#
#     bash bench/gpu_check.sh OUTDIR [SECONDS]       # SECONDS: bench_gpu.py's --max-seconds (default 480)
#
# Installs nothing (requirements.txt only) and runs nothing CPU-only on the GPU's clock. Writes into OUTDIR:
# machine.txt (nvidia-smi, the versions), then bench_gpu.py on every GPU (torchrun when there are several):
# gpu.json rewritten after every part (and during the long ones), gpu.events.jsonl, gpu.log. Each part
# starts only when its estimate fits in what is left of SECONDS (gpu_plan.PART_SECONDS, most important
# first); a hard stop at SECONDS + 60 ends a hung run, and the lines for bench/RESULTS.md are then printed
# from what gpu.json kept. 480 s: the whole command stays under 10 minutes (a device machine's limit per
# command is 600 s). BENCH_GPU_ARGS: more options for bench_gpu.py (tests/test_bench_gpu.py runs the
# script on CPU with them; they come after --step-batch-sizes 8, so they may override it).
#
# Also, within the same 8 minutes (issue 46):
# - plan.txt: the torch-capability rule's answer on the card's own torch (the varlen APIs the installed torch
#   has, and attention.choose_attention's plan for this card from them);
# - the compiled T4 document path: --step-batch-sizes 8 runs the README's micro-batch eager, then compiled
#   (--packing masked, train.py's default on CUDA); the last lines say whether it compiled, the compile
#   time, graph breaks, recompiles and tokens/s against eager (from gpu.json's step parts).
set -u
out=${1:?usage: bash bench/gpu_check.sh OUTDIR [SECONDS]}
budget=${2:-480}
python=${PYTHON:-$(command -v python || command -v python3)}  # the device machine has python3 only
mkdir -p "$out"
cd "$(dirname "$0")/.." || exit 2
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
{ nvidia-smi; "$python" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'cudnn', torch.backends.cudnn.version(), 'transformers', transformers.__version__, 'devices', torch.cuda.device_count())"
} > "$out/machine.txt" 2>&1
"$python" - > "$out/plan.txt" 2>&1 <<'PLAN'
import inspect

import torch

from tinyllm.model import attention, hardware
from tinyllm.model import config as model_config

print("torch", torch.__version__)
try:
    from torch.nn.attention.varlen import varlen_attn
    print("varlen_attn", inspect.signature(varlen_attn))
except ImportError as error:
    print("varlen_attn: none:", error)
for name in ("_flash_attention_forward", "_efficient_attention_forward"):
    op = getattr(torch.ops.aten, name, None)
    print(name, [argument.name for argument in op.default._schema.arguments] if op else "none")
device = hardware.describe(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
offered = attention.torch_kernels()
print("the installed torch offers:", offered)
for precision in ("fp16", "bf16"):
    print(precision, "on", device.label(), "->", attention.choose_attention(device, precision, model_config.PRESETS["think72"].head_dim, offered))
PLAN
echo "the torch-capability rule on this card (plan.txt):"; cat "$out/plan.txt"
echo "GPUs: $gpus; budget $budget s"
if [ "$gpus" -gt 1 ]; then
    launcher=("$python" -m torch.distributed.run --standalone --nproc_per_node="$gpus")
else
    launcher=("$python")
fi
# shellcheck disable=SC2086  # BENCH_GPU_ARGS is a list of options
timeout -k 10 $((budget + 60)) "${launcher[@]}" bench/bench_gpu.py --json "$out/gpu.json" \
    --max-seconds "$budget" --step-batch-sizes 8 ${BENCH_GPU_ARGS:-} 2>&1 | tee "$out/gpu.log"
status=${PIPESTATUS[0]}
echo "bench_gpu.py exited $status; results in $out/gpu.json"
"$python" - "$out/gpu.json" <<'STEPS'
import json
import sys

try:
    parts = json.load(open(sys.argv[1]))["parts"]
except (OSError, ValueError, KeyError) as error:
    sys.exit(f"no step parts to read: {error}")
eager = {name.rsplit(":", 1)[1]: part for name, part in parts.items() if name.startswith("step:eager:")}
for name, part in parts.items():
    if not name.startswith("step:compile:"):
        continue
    size = name.rsplit(":", 1)[1]
    speed = part.get("tokens_per_second")
    baseline = eager.get(size, {}).get("tokens_per_second")
    ratio = f"{speed / baseline:.2f}x eager's {baseline:,.0f}" if speed and baseline else "no eager figure"
    print(f"compiled document path, micro-batch {size}: {part.get('status')}, compiled in the end: "
          f"{part.get('compiled_in_the_end')}, compile {part.get('compile_seconds')} s, graph breaks "
          f"{part.get('graph_breaks')}, recompiles {part.get('recompiles')}, tokens/s {speed} ({ratio}), "
          f"attention {part.get('attention_plan')}")
STEPS
if [ "$status" -ne 0 ] && [ -f "$out/gpu.json" ]; then
    echo "for bench/RESULTS.md (from what gpu.json kept):"
    "$python" bench/bench_gpu.py --markdown-from "$out/gpu.json"
fi
exit "$status"
