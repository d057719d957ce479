"""Scripts the trainer tests run under torchrun (real gloo process groups), and the launcher."""

import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]


def run_torchrun(script: str, nproc: int, *args: str, timeout: float = 120) -> str:
    """Run tests/trainer/dist_scripts/<script> on nproc local ranks; return its output, fail on rc != 0."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            str(Path(__file__).parent / script), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run(argv, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"{script} on {nproc} ranks exited {result.returncode}:\n{output[-6000:]}"
    return result.stdout
