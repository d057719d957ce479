#!/usr/bin/env bash
# The GPU checks, in one command, on a machine with an NVIDIA GPU (the CPU suite is the gate;
# this is what it cannot run). Every section runs even if one before it failed; a summary of
# which failed comes last. Needs only torch (and pytest): the CUDA tests load no conftest, so the
# service's packages need not be installed there.
#
#   bench/gpu_check.sh            # from the repository's root; PYTHON=python3 where there is no .venv
#
# 1. the CUDA tests (tests/cuda: NCCL, bf16 grouped experts against the loop, pinned staging, CUDA RNG)
# 2. the MoE layer in bf16 against the masked loop (target: at least 5x), at the bench's default
#    size and at the gpu-moe preset's layer size
# 3. checkpoint staging of a GPU state through pinned memory: GB/s
# 4. the gpu-moe preset on one GPU: MFU, three asynchronous checkpoint saves of the whole 1.26B-
#    parameter state (14 GiB; blocking time, commit time), then a resume from the last one and a
#    fourth save in thread mode. The first save of each process allocates and pins its buffers.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
FAILED=()
section() { echo; echo "== $1"; }
check() { local name=$1; shift; "$@" || FAILED+=("$name (exit $?)"); }

$PY -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "gpu_check: no CUDA device (torch " + torch.__version__ + ")")' || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
$PY -c 'import torch, platform; print("torch", torch.__version__, "CUDA", torch.version.cuda, "python", platform.python_version())'

section "1. CUDA tests"
check "CUDA tests" $PY -m pytest -q --noconftest -p no:cacheprovider -m cuda tests/cuda

section "2. MoE layer, bf16, against the masked loop (target >= 5x)"
check "MoE bench, default size" $PY bench/moe_layer.py --device cuda --dtype bfloat16 --reps 20
check "MoE bench, gpu-moe size" $PY bench/moe_layer.py --device cuda --dtype bfloat16 --reps 20 \
    --tokens 16384 --dim 1024 --experts 32 --expert-hidden 1024

section "3. checkpoint staging through pinned memory"
check "staging" $PY bench/gpu/staging.py

section "4. gpu-moe preset, 1 GPU, bf16, ZeRO-3: MFU, three saves, a resume, a fourth save"
CKPT=${GPU_CHECK_DIR:-/tmp/gpu-check}
rm -rf "$CKPT"; mkdir -p "$CKPT/events"
train() {
    ETT_EVENT_DIR=$CKPT/events $PY -m torch.distributed.run --standalone --nproc-per-node 1 -m trainer.train \
        --preset gpu-moe --log.interval_steps 10 --checkpoint.dir "$CKPT/ckpt" --checkpoint.interval_steps 50 \
        --checkpoint.keep 1 "$@" 2>&1 | grep -E "parameters|step [0-9]+ loss|Error|error"
}
check "train 150 steps" train --train.steps 150
check "resume to 160, thread mode" train --train.steps 160 --checkpoint.async_mode thread
check "checkpoint events" $PY bench/gpu/ckpt_events.py "$CKPT/events/rank-0.jsonl"
rm -rf "$CKPT"

echo
if [ ${#FAILED[@]} -eq 0 ]; then echo "gpu_check: all sections passed"; else printf 'gpu_check FAILED: %s\n' "${FAILED[@]}"; exit 1; fi
