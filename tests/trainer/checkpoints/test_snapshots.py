"""The fast tier (ett/snapshots/tier.py) on real torchrun ranks (EP 2, ZeRO-3, dropout): a rank killed
right after a local snapshot resumes from it with at most that step lost, bitwise as an
uninterrupted run; a node whose local shards are gone (a lost node) makes every rank fall back to
the persistent tier; snapshots never block the loop; their cadence follows their cost."""

import shutil

import pytest

from ett.snapshots.tier import MAX_EVERY, next_every
from tests.trainer.trainer_runs import TINY_EP_ZERO3, has_event, local_checkpoint_dir, run_trainer

pytestmark = pytest.mark.slow
FAST_TIER = ["--checkpoint.snapshots", "true", "--checkpoint.snapshot_every", "1"]  # every step, for the test's kill


def snapshot_file(local, step: int, rank: int):
    return local / "snapshots" / "w2" / f"step-{step:08d}" / f"rank-{rank}.snap"


@pytest.fixture(scope="module")
def killed_after_step_6(tmp_path_factory):
    """Persistent checkpoints every 4 steps; every rank SIGKILLed once step 6 is snapshotted by both."""
    workdir = tmp_path_factory.mktemp("snap-killed")
    local = local_checkpoint_dir(workdir)

    def snapshotted_6(events: list[dict]) -> bool:
        return has_event(events, "step", 6) and all(snapshot_file(local, 6, r).exists() for r in (0, 1))

    run = run_trainer(workdir, [*TINY_EP_ZERO3, "--train.steps", "8", "--checkpoint.interval_steps", "4",
                                *FAST_TIER, "--checkpoint.local_dir", str(local)],
                      signal_when=snapshotted_6)
    assert run.returncode != 0
    return run, local


def resume(tmp_path, killed, local) -> object:
    """Attempt 1 on copies of the killed run's folders (each test its own: a resume commits more)."""
    persistent = tmp_path / "ckpt"
    shutil.copytree(killed.checkpoint_dir, persistent)
    run = run_trainer(tmp_path, [*TINY_EP_ZERO3, "--train.steps", "8", "--checkpoint.interval_steps", "4",
                                 *FAST_TIER, "--checkpoint.local_dir", str(local),
                                 "--checkpoint.resume_from", "auto"],
                      checkpoint_dir=persistent, attempt=1)
    assert run.returncode == 0, run.stderr
    return run


def test_a_rank_killed_right_after_a_local_snapshot_resumes_from_it_bitwise(killed_after_step_6, straight_run,
                                                                          tmp_path):
    killed, local = killed_after_step_6
    copy = tmp_path / "local"
    shutil.copytree(local, copy)
    run = resume(tmp_path, killed, copy)
    restored = [next(e for e in run.events(r) if e["kind"] == "restore_end") for r in (0, 1)]
    newest = max(e["step"] for e in killed.events(0) if e["kind"] == "step")
    assert [(e["step"], e["data"]["source"]) for e in restored] == [(6, "local-snapshot")] * 2
    assert newest - 6 <= 1  # at most the step being taken when the kill came is lost
    straight = straight_run.losses()
    assert run.losses() == {step: straight[step] for step in (7, 8)}


def test_a_node_that_lost_its_local_shards_makes_every_rank_use_the_persistent_tier(killed_after_step_6, tmp_path):
    killed, local = killed_after_step_6
    copy = tmp_path / "local"
    shutil.copytree(local, copy)
    for snapshot in (copy / "snapshots").rglob("rank-1.snap"):  # rank 1's node was replaced: its disk is gone
        snapshot.unlink()
    run = resume(tmp_path, killed, copy)
    restored = [next(e for e in run.events(r) if e["kind"] == "restore_end") for r in (0, 1)]
    assert [e["step"] for e in restored] == [4, 4]
    assert all(e["data"]["source"] != "local-snapshot" for e in restored)
    assert not snapshot_file(copy, 6, 0).exists()  # rank 0's newer snapshot was of the abandoned timeline


def test_the_snapshot_cadence_doubles_when_costly_and_comes_back_when_cheap_without_swinging():
    step = 0.1  # seconds; the budget is MAX_SHARE (5%) of the steps between two snapshots
    assert next_every(1, 0.004, step) == 1  # 4 ms of a 100 ms step: every step
    assert next_every(1, 0.006, step) == 2  # over 5 ms
    assert next_every(2, 0.006, step) == 2  # within the 10 ms of two steps, and above a quarter of it
    assert next_every(4, 0.003, step) == 2  # a passing stall is over: half the cadence costs at most half
    assert next_every(2, 0.002, step) == 1
    every, cadences = 1, []
    for cost in (0.02, 0.02, 0.002, 0.001, 0.001, 0.001):  # a stall, then cheap again
        every = next_every(every, cost, step)
        cadences.append(every)
    assert cadences == [2, 4, 2, 1, 1, 1]
    assert next_every(MAX_EVERY, 1.0, step) == MAX_EVERY


def test_one_slow_snapshot_between_cheap_ones_keeps_the_cadence_two_in_a_row_double_it():
    step = 0.1
    assert next_every(1, 0.02, step, previous_cost=0.002) == 1  # a single stall
    assert next_every(1, 0.02, step, previous_cost=0.03) == 2  # the load stays
    assert next_every(4, 0.001, step, previous_cost=0.02) == 2  # back: the cheaper one decides here too
