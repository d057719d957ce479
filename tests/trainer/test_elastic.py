"""The built-in trainer as an elastic job (docs/trainer.md, "Elastic"): real torchrun ranks on gloo,
tiny preset, ZeRO-3, expert parallelism 2 at its full 2 ranks. Killed after its snapshot of step 6
(a checkpoint at step 4), it goes on at 1 rank (expert parallelism 1, the experts and the optimizer
state resharded from the checkpoint; the 2-rank snapshots cannot be loaded), is stopped after step
7 or so with a checkpoint, and grows back to 2 ranks: every step's loss is that of an uninterrupted 2-rank run."""

import re
import signal
from concurrent.futures import ThreadPoolExecutor

import pytest

from ett.protocol import EXIT_STOPPED, JobEnv
from tests.trainer.trainer_runs import TrainerRun, has_event, local_checkpoint_dir, run_trainer

pytestmark = pytest.mark.slow
TINY_EP2 = ["--preset", "tiny", "--parallel.ep", "2", "--parallel.zero", "3", "--checkpoint.interval_steps", "4",
            "--log.interval_steps", "1"]  # each step's gradient norm in the log
FAST_TIER = ["--checkpoint.snapshots", "true", "--checkpoint.snapshot_every", "1"]


def grad_norms_logged(run: TrainerRun) -> dict[int, float]:
    """Rank 0's gradient norm of each step, from its metrics line (trainer/metrics.py)."""
    logged = re.findall(r"step (\d+) loss \S+ lr \S+ grad_norm (\S+)", run.stderr)
    return {int(step): float(norm) for step, norm in logged}


@pytest.mark.over_budget("three trainer runs of 2, 1 and 2 ranks against an uninterrupted one")
def test_shrunk_to_one_rank_with_its_experts_resharded_and_grown_back_it_trains_as_the_uninterrupted_run(tmp_path):
    checkpoints, local = tmp_path / "ckpt", local_checkpoint_dir(tmp_path)
    tiers = ["--checkpoint.local_dir", str(local), *FAST_TIER]
    snapshot_6 = [local / "snapshots" / "w2" / "step-00000006" / f"rank-{r}.snap" for r in (0, 1)]
    with ThreadPoolExecutor(1) as pool:
        uninterrupted = pool.submit(run_trainer, tmp_path / "uninterrupted", [*TINY_EP2, "--train.steps", "10"])
        def snapshotted_6(events: list[dict]) -> bool:
            return has_event(events, "step", 6) and all(path.exists() for path in snapshot_6)

        full = run_trainer(tmp_path / "full", [*TINY_EP2, "--train.steps", "10", *tiers], checkpoint_dir=checkpoints,
                           signal_when=snapshotted_6)
        assert full.returncode != 0, "the 2-rank run was not killed"
        # Stopped as the service stops a shrunk job to grow it back: SIGTERM, a last checkpoint. Its
        # steps slowed (0.25 s a block's forward, 1 s a step) so that the signal comes before its last.
        slow = {JobEnv.FULL_WORLD_SIZE: "2", "SLOW_FORWARD_RANK": "0", "SLOW_FORWARD_SECONDS": "0.25"}
        shrunk = run_trainer(tmp_path / "shrunk", [*TINY_EP2, "--train.steps", "10", *tiers], nproc=1, attempt=1,
                             checkpoint_dir=checkpoints, env=slow, module="tests.trainer.slow_forward",
                             signal_when=lambda events: has_event(events, "step", 7), signum=signal.SIGTERM)
        assert f"exitcode  : {EXIT_STOPPED}" in shrunk.stderr, shrunk.stderr  # torchrun's own exit is 1
        stopped_at = max(shrunk.losses())
        assert stopped_at < 10
        grown = run_trainer(tmp_path / "grown", [*TINY_EP2, "--train.steps", "10", *tiers], attempt=2,
                            checkpoint_dir=checkpoints)
        assert grown.returncode == 0, grown.stderr
        expected = uninterrupted.result()
    assert expected.returncode == 0, expected.stderr

    # At 1 rank: ep 2 changed to 1, the 2-rank snapshots of steps 5 and 6 passed over for the step-4 checkpoint.
    assert "parallel.ep 2 does not divide 1 ranks: expert parallelism 1, experts resharded" in shrunk.stderr
    assert "saved by 2 ranks, loaded resharded by 1" in shrunk.stderr
    [restored] = [e for e in shrunk.events() if e["kind"] == "restore_end"]
    assert restored["step"] == 4 and restored["data"]["saved_world_size"] == 2, restored
    [restored] = [e for e in grown.events() if e["kind"] == "restore_end"]
    assert restored["step"] == stopped_at and restored["data"]["saved_world_size"] == 1, restored
    for run in (full, shrunk, grown):
        [elastic] = [e["data"] for e in run.events() if e["kind"] == "elastic"]
        assert elastic == {"world_sizes": [1], "full_world_size": 2}

    losses = full.losses() | shrunk.losses() | grown.losses()  # steps 5 and 6 again at 1 rank: theirs
    reference = expected.losses()
    assert sorted(losses) == sorted(reference) == list(range(1, 11))
    for step, loss in reference.items():
        assert losses[step] == pytest.approx(loss, rel=1e-3), (step, losses, reference)
    # The gradients too, before clipping (which, with Adam, would hide a gradient scaled wrong).
    grad_norms = grad_norms_logged(full) | grad_norms_logged(shrunk) | grad_norms_logged(grown)
    for step, norm in grad_norms_logged(expected).items():
        assert grad_norms[step] == pytest.approx(norm, rel=1e-3), (step, grad_norms)
    # The global batch's tokens at any size.
    assert {e["data"]["tokens"] for e in shrunk.events() if e["kind"] == "step"} == {2 * 4 * 32}
