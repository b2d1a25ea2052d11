#!/usr/bin/env bash
# The first GPU run as one command, for a machine lent for a few minutes:
#
#     bash bench/gpu_check.sh OUTDIR [SECONDS]       # SECONDS: bench_gpu.py's --max-seconds (default 420)
#
# Installs nothing (requirements.txt only). Writes into OUTDIR: machine.txt (nvidia-smi, torch), the CPU
# smoke of every part (cpu_smoke.json/.log: the bench's own logic, seconds), then bench_gpu.py on every
# GPU (torchrun when there are several): gpu.json rewritten after each part, gpu.events.jsonl, gpu.log.
# A hard stop at SECONDS + 120 ends a hung run; the JSON keeps every part finished before it.
set -u
out=${1:?usage: bash bench/gpu_check.sh OUTDIR [SECONDS]}
budget=${2:-420}
python=${PYTHON:-python}
mkdir -p "$out"
cd "$(dirname "$0")/.." || exit 2
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
{ nvidia-smi; "$python" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'devices', torch.cuda.device_count())"; } > "$out/machine.txt" 2>&1
echo "GPUs: $gpus; CPU smoke ..."
OMP_NUM_THREADS=1 "$python" bench/bench_gpu.py --device cpu --preset tiny --vocab 0 --context 32 --precisions fp32 \
    --compile-modes eager --also '' --steps 2 --warmup 1 --batch-size 2 --grad-accum 2 --matmul-size 64 \
    --json "$out/cpu_smoke.json" > "$out/cpu_smoke.log" 2>&1 \
    && echo "CPU smoke done" || echo "CPU smoke failed (see $out/cpu_smoke.log); the GPU bench runs anyway"
if [ "$gpus" -gt 1 ]; then
    launcher=("$python" -m torch.distributed.run --standalone --nproc_per_node="$gpus")
else
    launcher=("$python")
fi
timeout -k 20 $((budget + 120)) "${launcher[@]}" bench/bench_gpu.py --json "$out/gpu.json" \
    --max-seconds "$budget" 2>&1 | tee "$out/gpu.log"
status=${PIPESTATUS[0]}
echo "bench_gpu.py exited $status; results in $out/gpu.json"
exit "$status"
