"""Straggler detection (service/stragglers/scoring.py) on made-up timings: the rules, one by one,
each threshold with a case on each side of it. Slow time: tests/service/stragglers/test_slow_time.py."""

import random

import pytest

from service.stragglers.scoring import Timing, find_stragglers


def windows(world: int, values: dict[int, list[float]], duration: float = 0.1, default: float = 0.01) -> list[Timing]:
    """Windows ending at steps 5, 10, ...; rank r's work in window i is values[r][i] (else `default`)."""
    count = max(len(v) for v in values.values())
    return [Timing(rank, 5 * (i + 1), duration, values.get(rank, [default] * count)[i])
            for i in range(count) for rank in range(world)]


def test_a_rank_slow_in_three_windows_in_a_row_is_flagged_from_the_first():
    timings = windows(4, {2: [0.01, 0.01, 0.08, 0.08, 0.09]})  # work_low unknown: the median alone
    (found,) = find_stragglers(timings, 4)
    assert (found.rank, found.since_step, found.flagged_step) == (2, 15, 25)
    assert found.relative == pytest.approx(9.0) and found.peer_seconds == pytest.approx(0.01)


def test_two_slow_windows_or_a_rank_that_recovered_is_not_flagged():
    assert find_stragglers(windows(4, {1: [0.01, 0.01, 0.01, 0.08, 0.08]}), 4) == []
    assert find_stragglers(windows(4, {1: [0.08, 0.09, 0.09, 0.01, 0.01]}), 4) == []


def test_a_lag_under_15_percent_of_the_step_is_left_alone_however_large_its_ratio():
    # 6 ms against 2 ms is 3x, but a step of 100 ms loses 4%: noise on a shared machine, or not worth it.
    assert find_stragglers(windows(4, {3: [0.006] * 4}, default=0.002), 4) == []
    assert find_stragglers(windows(4, {3: [0.02] * 4}, default=0.002), 4) != []


def test_a_rank_slow_in_two_steps_of_five_is_not_flagged_one_slow_in_every_step_is():
    """Its median is slow (3 of 5 steps), but its second-lowest step is as fast as its peers'."""
    hiccups = [Timing(rank, step, 0.1, 0.05 if rank == 2 else 0.01, work_low=0.01)
               for step in (5, 10, 15) for rank in range(4)]
    assert find_stragglers(hiccups, 4) == []
    steady = [Timing(rank, step, 0.1, 0.05 if rank == 2 else 0.01, work_low=0.04 if rank == 2 else 0.01)
              for step in (5, 10, 15) for rank in range(4)]
    assert [s.rank for s in find_stragglers(steady, 4)] == [2]


def test_two_ranks_compare_with_each_other_and_incomplete_windows_wait():
    (found,) = find_stragglers(windows(2, {1: [0.05, 0.05, 0.05]}), 2)
    assert found.rank == 1
    incomplete = [t for t in windows(2, {1: [0.05, 0.05, 0.05]}) if not (t.rank == 0 and t.step == 15)]
    assert find_stragglers(incomplete, 2) == []


def test_steps_without_a_mark_are_compared_by_their_step_time():
    timings = [Timing(rank, step, 0.3 if rank == 1 and step > 5 else 0.1, None)
               for step in (5, 10, 15, 20) for rank in (0, 1, 2)]
    assert [f.rank for f in find_stragglers(timings, 3)] == [1]


def test_noise_of_a_healthy_job_is_never_flagged():
    rng = random.Random(7)
    for _ in range(200):  # every rank's window median within +-50% of the others'
        values = {rank: [0.02 * rng.uniform(0.7, 1.3) for _ in range(6)] for rank in range(4)}
        assert find_stragglers(windows(4, values), 4) == []


def test_a_slowdown_shorter_than_the_machines_noise_is_no_straggler():
    # A healthy rank of a job of 50 ms steps starved of its core for 0.75 s (three windows of five
    # steps) on a shared machine: not flagged. The same for 1.5 s (six windows) is a straggler.
    assert find_stragglers(windows(2, {1: [0.05] * 3}, duration=0.05), 2) == []
    assert [s.rank for s in find_stragglers(windows(2, {1: [0.05] * 6}, duration=0.05), 2)] == [1]


def test_a_rank_is_slow_from_one_and_a_half_times_its_peers_work_not_below():
    # Lags of 20 and 30 ms in a step of 100 ms: both over 15% of it; the ratios 1.4x and 1.6x.
    assert find_stragglers(windows(4, {2: [0.07] * 4}, default=0.05), 4) == []
    assert [s.rank for s in find_stragglers(windows(4, {2: [0.08] * 4}, default=0.05), 4)] == [2]


def test_a_lag_is_worth_a_flag_from_fifteen_percent_of_the_step_not_below():
    # 8x and 9x its peers' work, lags of 14 and 16 ms in a step of 100 ms.
    assert find_stragglers(windows(4, {1: [0.016] * 4}, default=0.002), 4) == []
    assert [s.rank for s in find_stragglers(windows(4, {1: [0.018] * 4}, default=0.002), 4)] == [1]


def test_a_slowdown_is_a_straggler_from_a_second_and_a_half_not_below():
    # Three windows of five steps of 90 ms last 1.35 s; of 110 ms, 1.65 s.
    assert find_stragglers(windows(2, {1: [0.06] * 3}, duration=0.09), 2) == []
    assert [s.rank for s in find_stragglers(windows(2, {1: [0.06] * 3}, duration=0.11), 2)] == [1]


def test_three_slow_windows_in_a_row_flag_two_do_not_however_long_they_last():
    # Steps of a second: two windows last 10 s, far over MIN_SLOW_SECONDS.
    assert find_stragglers(windows(2, {1: [0.1, 0.1, 0.1, 0.5, 0.5]}, duration=1.0), 2) == []
    assert [s.rank for s in find_stragglers(windows(2, {1: [0.1, 0.1, 0.5, 0.5, 0.5]}, duration=1.0), 2)] == [1]
