"""Expert parallelism + every ZeRO stage on real gloo process groups equals one rank, and
round-trips through DCP. The checks live in dist_scripts/check_parallel_model.py."""

import pytest

from tests.trainer.dist_scripts import run_torchrun

CHECKS = ("gradients", "optimizer-step", "dcp-roundtrip")


def expected_lines(eps: list[int], zeros: list[int]) -> list[str]:
    return [f"OK {check} ep={ep} zero={zero}" for ep in eps for zero in zeros for check in CHECKS]


@pytest.mark.slow
@pytest.mark.parametrize(
    "nproc, eps, zeros",
    [
        (2, [2, 1], [0, 1, 2, 3]),  # experts split 2 ways; then plain data parallel experts
        (4, [2, 4], [1, 3]),  # 2 ranks per expert shard (efsdp=2), then one expert per rank
    ],
    ids=["2-ranks", "4-ranks"],
)
def test_parallel_model_matches_single_rank(tmp_path, nproc, eps, zeros):
    args = ["--ep", *map(str, eps), "--zero", *map(str, zeros), "--ckpt-dir", str(tmp_path)]
    output = run_torchrun("check_parallel_model.py", nproc, *args, timeout=150)
    assert output.splitlines() == expected_lines(eps, zeros)
