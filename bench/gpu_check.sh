#!/usr/bin/env bash
# The first GPU's command, one line on a lent card (docs/development.md):
#
#     bash bench/gpu_check.sh OUTDIR [SECONDS]       # SECONDS: bench_gpu.py's --max-seconds (default 480)
#
# Installs nothing (requirements.txt only) and runs nothing CPU-only on the GPU's clock. Writes into OUTDIR:
# machine.txt (nvidia-smi, the versions), then bench_gpu.py on every GPU (torchrun when there are several):
# gpu.json rewritten after every part (and during the long ones), gpu.events.jsonl, gpu.log. Each part
# starts only when its estimate fits in what is left of SECONDS (bench_gpu.PART_SECONDS, most important
# first); a hard stop at SECONDS + 60 ends a hung run, and the lines for bench/RESULTS.md are then printed
# from what gpu.json kept. 480 s: the whole command stays under 10 minutes (a device machine's limit per
# command is 600 s). BENCH_GPU_ARGS: more options for bench_gpu.py (tests/test_bench_gpu.py runs the
# script on CPU with them).
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
echo "GPUs: $gpus; budget $budget s"
if [ "$gpus" -gt 1 ]; then
    launcher=("$python" -m torch.distributed.run --standalone --nproc_per_node="$gpus")
else
    launcher=("$python")
fi
# shellcheck disable=SC2086  # BENCH_GPU_ARGS is a list of options
timeout -k 10 $((budget + 60)) "${launcher[@]}" bench/bench_gpu.py --json "$out/gpu.json" \
    --max-seconds "$budget" ${BENCH_GPU_ARGS:-} 2>&1 | tee "$out/gpu.log"
status=${PIPESTATUS[0]}
echo "bench_gpu.py exited $status; results in $out/gpu.json"
if [ "$status" -ne 0 ] && [ -f "$out/gpu.json" ]; then
    echo "for bench/RESULTS.md (from what gpu.json kept):"
    "$python" bench/bench_gpu.py --markdown-from "$out/gpu.json"
fi
exit "$status"
