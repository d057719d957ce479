"""bench/moe_memory.py, small: under the same real memory cap per rank (RLIMIT_DATA), one rank
runs out of memory and four ranks with expert parallelism and ZeRO-3 train."""

import subprocess
import sys

import pytest

from tests.trainer.trainer_runs import REPO

pytestmark = pytest.mark.slow


def test_experts_one_rank_cannot_hold_train_once_sharded_over_four():
    argv = [sys.executable, str(REPO / "bench" / "moe_memory.py"), "--experts", "32", "--dim", "128",
            "--hidden", "512", "--cap-mib", "180"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert "1 rank " in lines[1] and "out of memory" in lines[1] and "can't allocate memory" in lines[2]
    assert lines[-1] == "32 experts: do not fit on 1 rank, train on 4 ranks under 180 MiB each"
