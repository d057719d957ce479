"""Straggler detection (service/jobs/stragglers.py) and slow time (service/accounting/engine.py)
on made-up timings: the rules, one by one."""

import random

import pytest

from service.accounting.engine import JobAccount
from service.jobs.stragglers import Timing, find_stragglers


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


def account_of(durations: list[float], rolled_back_to: int | None = None) -> JobAccount:
    account = JobAccount()
    account.apply_steps(0, [(i + 1, 100.0 + i, d) for i, d in enumerate(durations)])
    a = account.attempts[0]
    if rolled_back_to is not None:
        kept = durations[:rolled_back_to]
        a.rolled_back_to, a.wasted_steps = rolled_back_to, len(durations) - rolled_back_to
        a.wasted_seconds = sum(durations) - sum(kept)
    return account


def test_slow_time_is_the_steps_excess_over_the_ideal_step():
    a = account_of([0.1] * 20 + [0.3] * 10).attempts[0]
    assert a.ideal_step_seconds == pytest.approx(0.1)
    assert a.slow_seconds == pytest.approx(10 * 0.2)
    shuffled = [0.3] * 10 + [0.1] * 20  # the same steps in any order: the same figures
    assert account_of(shuffled).attempts[0].slow_seconds == pytest.approx(a.slow_seconds)


def test_rolled_back_steps_are_wasted_not_slow_and_few_steps_tell_no_ideal():
    a = account_of([0.1] * 20 + [0.3] * 10, rolled_back_to=25).attempts[0]
    assert a.slow_seconds == pytest.approx(5 * 0.2)
    assert account_of([0.1] * 5 + [0.5]).attempts[0].slow_seconds == 0.0


def test_an_account_keeps_its_slow_time_through_its_stored_form():
    account = account_of([0.1] * 20 + [0.3] * 10)
    again = JobAccount.from_dict(account.to_dict())
    assert again.attempts[0].slow_seconds == pytest.approx(account.attempts[0].slow_seconds)


def test_a_slowdown_shorter_than_the_machines_noise_is_no_straggler():
    # A healthy rank of a job of 50 ms steps starved of its core for 0.75 s (three windows of five
    # steps) on a shared machine: not flagged. The same for 1.5 s (six windows) is a straggler.
    assert find_stragglers(windows(2, {1: [0.05] * 3}, duration=0.05), 2) == []
    assert [s.rank for s in find_stragglers(windows(2, {1: [0.05] * 6}, duration=0.05), 2)] == [1]
