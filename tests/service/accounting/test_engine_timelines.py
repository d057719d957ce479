"""Hand-computed timelines through the pure engine: every category to the millisecond.

Each timeline's comment walks through the numbers attempt by attempt; the figures asserted are
worked out by hand from the table of docs/ett.md, not from the engine.
"""

import math

import pytest

from service.accounting.engine import CATEGORIES
from service.accounting.memory import MemoryJob
from tests.service.accounting.timelines import T0, Timeline

MS = 1e-3


def report_of(tl: Timeline, now: float, **kw):
    job = MemoryJob("j")
    job.ingest(tl.events)
    return job.report(T0 + now, **kw)


def check(report, wall: float, **seconds: float) -> None:
    assert report["wall_seconds"] == pytest.approx(wall, abs=MS)
    expected = dict.fromkeys(CATEGORIES, 0.0) | seconds
    for category in CATEGORIES:
        assert report["seconds"][category] == pytest.approx(expected[category], abs=MS), category
    assert sum(report["seconds"].values()) == pytest.approx(report["wall_seconds"], abs=MS)
    assert report["ett_percent"] == pytest.approx(100 * expected["productive"] / wall, abs=MS)


def test_clean_run():
    tl = Timeline()
    tl.start_attempt(0, allocated=0, init_end=11)
    # Ten 2 s steps, a 0.5 s gap between them: step k runs 12 + 2.5(k-1) .. +2.
    tl.steps(0, 1, 10, start=12, duration=2, gap=0.5)
    tl.checkpoint(0, 5, start=24.0, staged=24.3, committed=26.0)  # 0.3 s of the gap before step 6
    tl.checkpoint(0, 10, start=36.5, staged=36.9, committed=38.0)
    tl.rank0("train_end", 38.5, 0)
    tl.service("job_finished", 40, 0, state="succeeded")
    r = report_of(tl, now=100, submitted_at=T0 - 5, fleet_mtbf_seconds=3600)
    # idle: 9 gaps x 0.5 - 0.3 = 4.2, then 36.5 -> 40 less 0.4 of save = 3.1
    check(r, 40, productive=20, checkpoint_save=0.7, init=12, idle=7.3)
    assert r["state"] == "succeeded" and r["queued_seconds"] == pytest.approx(5)
    assert r["time_to_start_seconds"] == pytest.approx(12)
    assert r["failures"] == [] and r["restarts"] == 0 and r["mtbf_seconds"] is None
    assert r["checkpoints"] == pytest.approx(
        {"committed": 2, "last_committed_step": 10, "mean_blocking_seconds": 0.35, "mean_commit_seconds": 1.75}
    )
    # No failure of its own: the fleet's MTBF.
    assert r["recommended_checkpoint_interval_seconds"] == pytest.approx(math.sqrt(2 * 0.35 * 3600))


def crash_with_rollback(t0: float = T0) -> Timeline:
    """Also the worked example of docs/ett.md."""
    tl = Timeline(t0)
    tl.start_attempt(0, allocated=0, init_end=10)
    tl.steps(0, 1, 4, start=10, duration=3)  # ends 22
    tl.checkpoint(0, 4, start=22, staged=22.5, committed=24)
    tl.steps(0, 5, 6, start=22.5, duration=3)  # ends 28.5; steps 5 and 6 will be rolled back
    tl.add("worker_exited", 29.2, 0, "node:n1", rank=1, signal="SIGKILL")
    tl.service("attempt_failed", 30, 0, cause="signal", detail="rank 1 killed by signal 9")
    tl.start_attempt(1, allocated=35, init_end=41, restore=(41, 43, 4))
    tl.steps(1, 5, 8, start=43, duration=3)  # ends 55
    tl.checkpoint(1, 8, start=55, staged=55.5, committed=57)
    tl.rank0("train_end", 56, 1)
    tl.service("job_finished", 58, 1, state="succeeded")
    return tl


def test_crash_with_rollback():
    r = report_of(crash_with_rollback(), now=100, submitted_at=T0 - 10)
    # attempt 0 [0, 35): init 10, steps 18 of which 6 wasted, save 0.5, recovery 28.5 -> 35 = 6.5
    # attempt 1 [35, 58]: init 35 -> 43 less restore 2 = 6, productive 12, save 0.5, idle 55.5 -> 58
    check(r, 58, productive=24, wasted=6, checkpoint_save=1.0, restore=2, init=16, recovery=6.5, idle=2.5)
    assert r["queued_seconds"] == pytest.approx(10)
    assert r["failures"] == [
        {"attempt": 0, "cause": "signal", "detail": "rank 1 killed by signal 9", "diagnosis": None, "summary": None,
         "at": T0 + 30, "time_to_recover_seconds": pytest.approx(14.5), "lost_steps": 2}
    ]
    assert r["restarts"] == 1 and r["mtbf_seconds"] == pytest.approx(58)
    assert r["checkpoints"]["committed"] == 2 and r["checkpoints"]["last_committed_step"] == 8
    assert r["checkpoints"]["mean_blocking_seconds"] == pytest.approx(0.5)
    assert r["checkpoints"]["mean_commit_seconds"] == pytest.approx(2.0)
    assert r["recommended_checkpoint_interval_seconds"] == pytest.approx(math.sqrt(2 * 0.5 * 58))


@pytest.mark.parametrize("order", ["peer first", "root cause first"])
def test_root_cause_amends_a_peers_exit_in_any_order(order):
    tl = crash_with_rollback()
    # The scheduler's amendment: same time as the first report, the killed rank's cause.
    tl.service("attempt_failed", 30, 0, cause="exit", detail="rank 2 exit code 1")
    if order == "peer first":
        tl.events = tl.events[-1:] + tl.events[:-1]
    r = report_of(tl, now=100)
    assert [(f["cause"], f["at"]) for f in r["failures"]] == [("signal", T0 + 30)]


def test_two_failures_second_dies_before_its_first_checkpoint():
    tl = Timeline()
    tl.start_attempt(0, allocated=0, init_end=5)
    tl.steps(0, 1, 4, start=5, duration=1)  # ends 9
    tl.checkpoint(0, 4, start=9, staged=9.25, committed=10)
    tl.steps(0, 5, 8, start=9.25, duration=1)  # ends 13.25
    tl.service("attempt_failed", 14, 0, cause="exit")
    tl.start_attempt(1, allocated=16, init_end=19, restore=(19, 20, 4))
    tl.steps(1, 5, 7, start=20, duration=1)  # ends 23, dies before its checkpoint at 8
    tl.add("hang_detected", 25.5, 1, "node:n1")
    tl.service("attempt_failed", 26, 1, cause="hang")
    tl.start_attempt(2, allocated=28, init_end=30, restore=(30, 31.5, 4))
    tl.steps(2, 5, 12, start=31.5, duration=1)  # ends 39.5
    tl.checkpoint(2, 12, start=39.5, staged=39.75, committed=40.5)
    tl.service("job_finished", 41, 2, state="succeeded")
    r = report_of(tl, now=100)
    # a0 [0, 16): init 5, steps 8 (5..8 wasted: 4), save 0.25, recovery 13.25 -> 16 = 2.75
    # a1 [16, 28): init 3, restore 1, steps 5..7 all wasted (3), recovery 23 -> 28 = 5
    # a2 [28, 41]: init 2, restore 1.5, productive 8, save 0.25, idle 39.75 -> 41 = 1.25
    check(r, 41, productive=12, wasted=7, checkpoint_save=0.5, restore=2.5, init=10, recovery=7.75, idle=1.25)
    assert [(f["attempt"], f["cause"], f["lost_steps"]) for f in r["failures"]] == [(0, "exit", 4), (1, "hang", 3)]
    assert [f["time_to_recover_seconds"] for f in r["failures"]] == pytest.approx([6.75, 8.5])
    assert r["restarts"] == 2 and r["mtbf_seconds"] == pytest.approx(20.5)
    assert r["checkpoints"] == pytest.approx(
        {"committed": 2, "last_committed_step": 12, "mean_blocking_seconds": 0.25, "mean_commit_seconds": 1.0}
    )


def test_older_restore_rolls_back_steps_an_earlier_restore_kept():
    """Attempt 2 restarts from scratch (no restore): steps 1..4 of attempt 0, kept when attempt 1
    restored step 4, are rolled back too."""
    tl = Timeline()
    tl.start_attempt(0, allocated=0, init_end=1)
    tl.steps(0, 1, 6, start=1, duration=1)  # ends 7
    tl.service("attempt_failed", 8, 0, cause="exit")
    tl.start_attempt(1, allocated=9, init_end=10, restore=(10, 11, 4))
    tl.steps(1, 5, 5, start=11, duration=1)  # ends 12
    tl.service("attempt_failed", 13, 1, cause="exit")
    tl.start_attempt(2, allocated=14, init_end=15)
    tl.steps(2, 1, 5, start=15, duration=1)  # ends 20
    tl.service("job_finished", 20, 2, state="succeeded")
    r = report_of(tl, now=100)
    # a0 [0, 9): init 1, 6 steps all wasted, recovery 7 -> 9; a1 [9, 14): init 1, restore 1,
    # step 5 wasted, recovery 12 -> 14; a2 [14, 20]: init 1, productive 5
    check(r, 20, productive=5, wasted=7, restore=1, init=3, recovery=4)
    assert [f["lost_steps"] for f in r["failures"]] == [2, 5]


def test_hang():
    tl = Timeline()
    tl.start_attempt(0, allocated=0, init_end=4)
    tl.steps(0, 1, 3, start=4, duration=2)  # ends 10
    tl.checkpoint(0, 3, start=10, staged=10.5, committed=11)
    tl.steps(0, 4, 5, start=10.5, duration=2)  # ends 14.5, then rank 1 hangs
    tl.add("hang_detected", 24.5, 0, "node:n1")
    tl.service("attempt_failed", 25, 0, cause="hang")
    tl.start_attempt(1, allocated=27, init_end=30, restore=(30, 31, 3))
    tl.steps(1, 4, 7, start=31, duration=2)  # ends 39
    tl.rank0("train_end", 39.2, 1)
    tl.service("job_finished", 40, 1, state="succeeded")
    r = report_of(tl, now=100)
    # The hung time (14.5 -> 25) and the restart (25 -> 27) are recovery: 12.5 s.
    check(r, 40, productive=14, wasted=4, checkpoint_save=0.5, restore=1, init=7, recovery=12.5, idle=1)
    (failure,) = r["failures"]
    assert failure["cause"] == "hang" and failure["lost_steps"] == 2
    assert failure["time_to_recover_seconds"] == pytest.approx(16.5)


def test_save_in_flight_at_the_crash():
    tl = Timeline()
    tl.start_attempt(0, allocated=0, init_end=2)
    tl.steps(0, 1, 2, start=2, duration=1)  # ends 4
    tl.checkpoint(0, 2, start=4, staged=4.5, committed=5.5)
    tl.steps(0, 3, 4, start=4.5, duration=1)  # ends 6.5
    tl.checkpoint(0, 4, start=6.5, staged=7.0, committed=None)  # still being written when...
    tl.step(0, 5, start=7, duration=1)  # ends 8
    tl.service("attempt_failed", 9, 0, cause="signal")  # ... the job crashed at 8.4
    tl.start_attempt(1, allocated=10, init_end=12, restore=(12, 13, 2))  # step 4 never committed
    tl.steps(1, 3, 6, start=13, duration=1)  # ends 17
    tl.service("job_finished", 18, 1, state="succeeded")
    r = report_of(tl, now=100)
    # The blocking part of the lost save still counts as checkpoint_save; steps 3..5 are wasted.
    check(r, 18, productive=6, wasted=3, checkpoint_save=1.0, restore=1, init=4, recovery=2, idle=1)
    assert r["checkpoints"] == pytest.approx(
        {"committed": 1, "last_committed_step": 2, "mean_blocking_seconds": 0.5, "mean_commit_seconds": 1.5}
    )
    assert r["failures"][0]["lost_steps"] == 3
    assert r["failures"][0]["time_to_recover_seconds"] == pytest.approx(5)


def test_crash_while_a_save_blocks_is_recovery():
    tl = Timeline()
    tl.start_attempt(0, allocated=0, init_end=2)
    tl.steps(0, 1, 2, start=2, duration=1)  # ends 4
    tl.rank0("ckpt_start", 4, 0, 2)  # never staged: the rank died at 4.3
    tl.service("attempt_failed", 5, 0, cause="exit")
    tl.start_attempt(1, allocated=6, init_end=7)
    tl.steps(1, 1, 2, start=7, duration=1)  # ends 9
    tl.service("job_finished", 9, 1, state="succeeded")
    r = report_of(tl, now=100)
    check(r, 9, productive=2, wasted=2, init=3, recovery=2)
    assert r["checkpoints"]["mean_blocking_seconds"] is None


def test_job_still_running():
    tl = Timeline()
    tl.start_attempt(0, allocated=0, init_end=3)
    tl.steps(0, 1, 4, start=3, duration=2, gap=1)  # ends 14
    tl.checkpoint(0, 2, start=8, staged=8.5, committed=None)
    r = report_of(tl, now=20, submitted_at=T0 - 3, fleet_mtbf_seconds=1000)
    # The window runs to now: idle 5 -> 6, 8.5 -> 9, 11 -> 12 and 14 -> 20.
    check(r, 20, productive=8, checkpoint_save=0.5, init=3, idle=8.5)
    assert r["state"] == "running" and r["queued_seconds"] == pytest.approx(3)
    assert r["checkpoints"]["committed"] == 0 and r["checkpoints"]["mean_commit_seconds"] is None
    assert r["recommended_checkpoint_interval_seconds"] == pytest.approx(math.sqrt(2 * 0.5 * 1000))


def test_job_still_starting_counts_init_to_now():
    tl = Timeline()
    tl.service("attempt_allocated", 0, 0, nodes=["n1"])
    tl.rank0("init_start", 1, 0)
    r = report_of(tl, now=5)
    check(r, 5, init=5)
    assert r["time_to_start_seconds"] is None


def test_job_waiting_for_its_next_attempt_is_in_recovery():
    tl = Timeline()
    tl.start_attempt(0, allocated=0, init_end=1)
    tl.steps(0, 1, 2, start=1, duration=1)  # ends 3
    tl.service("attempt_failed", 4, 0, cause="node_lost")
    r = report_of(tl, now=10)
    check(r, 10, productive=2, init=1, recovery=7)
    assert r["failures"][0]["time_to_recover_seconds"] is None


def test_job_never_allocated_is_all_queue():
    r = MemoryJob("j").report(T0 + 10, submitted_at=T0 + 4)
    assert r["state"] == "queued" and r["queued_seconds"] == pytest.approx(6) and r["wall_seconds"] == 0


def test_a_recovery_that_fails_in_start_up_gives_both_failures_a_time_to_recover_and_books_lost_steps_once():
    tl = Timeline()
    tl.start_attempt(0, allocated=0, init_end=2)
    tl.steps(0, 1, 4, start=2, duration=1)  # ends 6
    tl.checkpoint(0, 2, start=4, staged=4, committed=4.5)
    tl.service("attempt_failed", 6.5, 0, cause="signal")
    # Attempt 1 restores step 2, then dies before its first step.
    tl.start_attempt(1, allocated=7, init_end=8, restore=(8, 9, 2))
    tl.service("attempt_failed", 10, 1, cause="exit")
    # Attempt 2 restores step 2 again and trains to the end.
    tl.start_attempt(2, allocated=11, init_end=12, restore=(12, 13, 2))
    tl.steps(2, 3, 4, start=13, duration=1)  # ends 15
    tl.service("job_finished", 15, 2, state="succeeded")
    r = report_of(tl, now=100)
    first, second = r["failures"]
    # Attempt 0's steps 3 and 4 were rolled back when attempt 1 started over from step 2: they are
    # its loss, not attempt 1's; each recovery ends at attempt 2's first step (13).
    assert (first["attempt"], first["lost_steps"]) == (0, 2) and (second["attempt"], second["lost_steps"]) == (1, 0)
    assert first["time_to_recover_seconds"] == pytest.approx(13 - 6)  # from attempt 0's last step
    assert second["time_to_recover_seconds"] == pytest.approx(13 - 9)  # from attempt 1's restore, its last activity


def test_an_attempt_that_died_before_restoring_leaves_the_loss_to_where_the_next_one_went_back():
    tl = Timeline()
    tl.start_attempt(0, allocated=0, init_end=2)
    tl.steps(0, 1, 4, start=2, duration=1)  # ends 6
    tl.service("attempt_failed", 6.5, 0, cause="signal")
    tl.start_attempt(1, allocated=7, init_end=8)  # died in start-up: no restore, no step
    tl.service("attempt_failed", 9, 1, cause="exit")
    tl.start_attempt(2, allocated=10, init_end=11, restore=(11, 12, 2))
    tl.steps(2, 3, 4, start=12, duration=1)
    tl.service("job_finished", 14, 2, state="succeeded")
    first, second = report_of(tl, now=100)["failures"]
    assert (first["lost_steps"], second["lost_steps"]) == (2, 0)
    assert first["time_to_recover_seconds"] == pytest.approx(12 - 6)
    assert second["time_to_recover_seconds"] == pytest.approx(12 - 8)
