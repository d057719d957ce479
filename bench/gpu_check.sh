#!/usr/bin/env bash
# The GPU checks, in one command, on a machine with an NVIDIA GPU (the CPU suite is the gate;
# this is what it cannot run). Prints each figure; record them in BENCHMARKS.md with the machine.
#
#   bench/gpu_check.sh            # from the repository's root, after `make setup` (a CUDA torch build)
#
# 1. the CUDA tests (tests/cuda: NCCL, bf16 grouped experts against the loop, pinned staging, CUDA RNG)
# 2. the MoE layer in bf16 against the masked loop (target: at least 5x)
# 3. checkpoint staging of a GPU state through pinned memory: GB/s, and the blocking time of a save
# 4. a training step's MFU: the gpu-moe preset for 30 steps on one GPU
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}

$PY -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "gpu_check: no CUDA device (torch " + torch.__version__ + ")")'
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$PY -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda)'

echo "== 1. CUDA tests"
$PY -m pytest -q -m cuda tests/cuda

echo "== 2. MoE layer, bf16, against the masked loop (target >= 5x)"
$PY bench/moe_layer.py --device cuda --dtype bfloat16 --reps 20

echo "== 3. checkpoint staging through pinned memory"
$PY - <<'PY'
import time, torch
from ett.checkpoint_staging import ReusedBufferStager
state = {f"w{i}": torch.randn(64, 1024, 1024, device="cuda") for i in range(4)}  # 1 GiB
nbytes = sum(t.nbytes for t in state.values())
for pinned in (False, True):
    stager = ReusedBufferStager(share_memory=False, pin_memory=pinned)
    stager.stage(state).result()  # first: allocates (and pins) the buffers
    torch.cuda.synchronize()
    start = time.perf_counter()
    stager.stage(state).result()
    seconds = time.perf_counter() - start
    print(f"  {'pinned' if pinned else 'pageable'} buffers: {nbytes / seconds / 1e9:.1f} GB/s ({seconds * 1e3:.0f} ms for {nbytes / 2**30:.0f} GiB)")
    stager.close()
PY

echo "== 4. MFU of a training step (gpu-moe preset, 1 GPU, bf16, ZeRO-3)"
$PY -m torch.distributed.run --standalone --nproc-per-node 1 -m trainer.train --preset gpu-moe \
    --train.steps 30 --log.interval_steps 10 --checkpoint.dir /tmp/gpu-check-ckpt 2>&1 | grep -E "step|mfu" | tail -5
