"""The built-in trainer as an elastic job (docs/trainer.md, "Elastic"): real torchrun ranks on gloo,
tiny preset, ZeRO-3, expert parallelism 2 at its full 2 ranks. Killed after its snapshot of step 6
(a checkpoint at step 5), it goes on at 1 rank (expert parallelism 1) from that snapshot, the
experts and the optimizer state resharded from the 2 ranks' shards (ett/snapshots/reshard.py); killed
again after its first step's snapshot, it grows back to 2 ranks from that 1-rank snapshot, each
tensor cut into the 2 ranks' shards: every step's loss is that of an uninterrupted 2-rank run. (The
service's own growth, a SIGTERM and a last checkpoint, is tests/e2e/recovery/test_elastic.py's.)"""

import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from ett.protocol import JobEnv
from tests.trainer.trainer_runs import TrainerRun, has_event, local_checkpoint_dir, run_trainer

pytestmark = pytest.mark.slow
TINY_EP2 = ["--preset", "tiny", "--parallel.ep", "2", "--parallel.zero", "3", "--checkpoint.interval_steps", "5",
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
        # Its steps slowed (0.25 s a block's forward, 1 s a step) so that the kill comes before its next.
        slow = {JobEnv.FULL_WORLD_SIZE: "2", "SLOW_FORWARD_RANK": "0", "SLOW_FORWARD_SECONDS": "0.25"}

        def snapshotted_its_first_step(events: list[dict]) -> bool:
            steps = [e["step"] for e in events if e["kind"] == "step"]
            return bool(steps) and (local / "snapshots" / "w1" / f"step-{steps[0]:08d}" / "rank-0.snap").exists()

        shrunk = run_trainer(tmp_path / "shrunk", [*TINY_EP2, "--train.steps", "10", *tiers], nproc=1, attempt=1,
                             checkpoint_dir=checkpoints, env=slow, module="tests.trainer.slow_forward",
                             signal_when=snapshotted_its_first_step)
        assert shrunk.returncode != 0, "the 1-rank run was not killed"
        stopped_at = max(shrunk.losses())
        assert stopped_at < 10
        grown = run_trainer(tmp_path / "grown", [*TINY_EP2, "--train.steps", "10", *tiers], attempt=2,
                            checkpoint_dir=checkpoints)
        assert grown.returncode == 0, grown.stderr
        expected = uninterrupted.result()
    assert expected.returncode == 0, expected.stderr

    # At 1 rank: ep 2 changed to 1, and the 2-rank snapshot of the last step (6, or 7 where the kill came
    # late), newer than the step-5 checkpoint, resharded: no step lost beyond the fast tier's.
    assert "parallel.ep 2 does not divide 1 ranks: expert parallelism 1, experts resharded" in shrunk.stderr
    [restored] = [e for e in shrunk.events() if e["kind"] == "restore_end"]
    assert 6 <= restored["step"] <= max(full.losses()), (restored, max(full.losses()))
    assert restored["data"]["saved_world_size"] == 2 and restored["data"]["source"] == "local-snapshot", restored
    assert "not_restored" not in restored["data"] and "missing" not in restored["data"], restored
    [restored] = [e for e in grown.events() if e["kind"] == "restore_end"]
    assert restored["step"] == stopped_at and restored["data"]["saved_world_size"] == 1, restored
    assert restored["data"]["source"] == "local-snapshot" and "missing" not in restored["data"], restored
    for run in (full, shrunk, grown):
        [elastic] = [e["data"] for e in run.events() if e["kind"] == "elastic"]
        assert elastic == {"world_sizes": [1], "full_world_size": 2}

    losses = full.losses() | shrunk.losses() | grown.losses()  # a step run again after a kill: its later run's
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
