#!/usr/bin/env bash
# The MoE experts' two paths on one GPU, in one call: `torch._grouped_mm` (the default on CUDA bf16,
# `--moe.grouped_mm` unset) against the per-expert loop (`--moe.grouped_mm false`).
#
#   OUT=/tmp/out PYTHON=python3 bench/gpu/grouped_mm_check.sh [--with-gpu-check]
#
# 1. bench/gpu/grouped_vs_loop.py at the gpu-moe layer's size: output and gradients of each path
#    against an fp32 reference, and the layer's forward+backward time of each
# 2. the gpu-moe preset, 40 steps at batch 8, no checkpoints: grouped_mm, the loop, grouped_mm
#    again (the trainer's MFU line every 5 steps)
# 3. with --with-gpu-check: bench/gpu_check.sh
# Each part's whole output goes to a file in $OUT (default /tmp/grouped-mm-check).
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/grouped-mm-check}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
FAILED=()

{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
  $PY -c 'import torch, platform; print("torch", torch.__version__, "CUDA", torch.version.cuda, "python", platform.python_version())'
  git log -1 --format=%h 2>/dev/null; } 2>&1 | tee "$OUT/env.txt"

echo; echo "== 1. grouped_mm against the loop, gpu-moe layer size"
$PY bench/gpu/grouped_vs_loop.py --reps 20 2>&1 | tee "$OUT/grouped_vs_loop.log" || FAILED+=("grouped_vs_loop")

train() {  # name, then overrides
    local name=$1; shift
    echo; echo "== 2. gpu-moe, 40 steps, batch 8: $name ($(date -u +%H:%M:%S))"
    $PY -m torch.distributed.run --standalone --nproc-per-node 1 -m trainer.train --preset gpu-moe \
        --train.steps 40 --log.interval_steps 5 "$@" >"$OUT/mfu_$name.log" 2>&1 || FAILED+=("train $name")
    grep -E "parameters|step [0-9]+ loss|Error|error" "$OUT/mfu_$name.log"
}
train grouped_mm
train loop --moe.grouped_mm false
train grouped_mm2

if [ "${1:-}" = "--with-gpu-check" ]; then
    echo; echo "== 3. bench/gpu_check.sh ($(date -u +%H:%M:%S))"
    PYTHON=$PY bench/gpu_check.sh 2>&1 | tee "$OUT/gpu_check.log" || FAILED+=("gpu_check.sh")
fi
date -u +"end %H:%M:%S"
if [ ${#FAILED[@]} -eq 0 ]; then echo "grouped_mm_check: all parts passed"; else printf 'grouped_mm_check FAILED: %s\n' "${FAILED[@]}"; exit 1; fi
