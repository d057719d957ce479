"""The adaptive hang limit (agent/groups/hang.py) on its own: it follows the longest gap between steps,
never below the floor or above the ceiling, and a save's gap does not count as a step's."""

import pytest

from agent.groups.hang import FACTOR, FLOOR_SECONDS, WARMUP_STEPS, HangLimit


def steps(limit: HangLimit, first: int, count: int, start: float, seconds: float) -> float:
    now = start
    for step in range(first, first + count):
        limit.stepped(step, now)
        now += seconds
    return now


def test_the_ceiling_until_warm_then_four_times_the_longest_gap_with_a_floor():
    limit = HangLimit(ceiling=120.0)
    now = steps(limit, 1, WARMUP_STEPS, 0.0, 0.5)
    assert limit.seconds == 120.0 and not limit.adaptive  # WARMUP_STEPS marks are one gap short
    steps(limit, WARMUP_STEPS + 1, 1, now, 0.5)
    assert limit.seconds == FLOOR_SECONDS  # 4 x 0.5 s is under the floor
    steps(limit, WARMUP_STEPS + 2, 3, now + 2.0, 1.5)  # one gap of 2 s, then 1.5 s
    assert limit.seconds == pytest.approx(FACTOR * 2.0)
    limit.saving = True
    assert limit.seconds == 120.0  # a save may block longer than any step


def test_a_gap_in_which_a_save_started_is_not_a_steps_time():
    limit = HangLimit(ceiling=20.0)
    now = steps(limit, 1, 10, 0.0, 0.5)
    limit.save_started()  # after step 10: a save that waits 5 s for the one before it
    limit.stepped(11, now + 5.0)
    last = steps(limit, 12, 3, now + 5.5, 0.5) - 0.5  # step 14's time
    assert limit.seconds == FLOOR_SECONDS  # the 5.5 s gap was left out: 4 x 0.5 s, floored
    limit.stepped(15, last + 2.0)  # a slow step with no save: it counts
    assert limit.seconds == pytest.approx(FACTOR * 2.0)


def test_steps_during_a_background_write_and_between_writes_have_limits_of_their_own():
    limit = HangLimit(ceiling=60.0)
    now = steps(limit, 1, 8, 0.0, 0.2)  # between writes: 0.2 s steps
    limit.set_writing(True)  # a checkpoint written in the background slows the steps to 2 s
    now = steps(limit, 9, 8, now, 2.0)
    assert limit.seconds == pytest.approx(FACTOR * 2.0)  # during a write: the write's own steps
    limit.set_writing(False)
    assert limit.seconds == FLOOR_SECONDS  # between writes: 4 x 0.2 s, floored; not 8 s
    fresh = HangLimit(ceiling=60.0)
    steps(fresh, 1, 8, 0.0, 0.2)
    fresh.set_writing(True)
    assert fresh.seconds == 60.0  # no write seen yet: the ceiling until its steps are
