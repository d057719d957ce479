"""ZeRO stages shard what they should: bytes of parameters (at rest and during the forward),
gradients and Adam state on each of 4 ranks with EP=2. The measuring is in
dist_scripts/check_zero_memory.py; it fails on any figure more than 3% off."""

import pytest

from tests.trainer.dist_scripts import run_torchrun


@pytest.mark.slow
def test_zero_stages_shard_params_grads_and_optimizer_state():
    output = run_torchrun("check_zero_memory.py", 4, "--ep", "2", timeout=150)
    lines = output.splitlines()
    assert [line.split(" ranks=")[0] for line in lines] == [f"OK zero-memory zero={z}" for z in range(4)]
    assert "params+state=" in lines[3]
