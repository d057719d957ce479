"""Slow time (service/accounting/step_times.py, docs/ett.md "Slow time") on made-up step times:
the worked example, each threshold of the rule on each side of it, and its properties."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.accounting import step_times as rule
from service.accounting.engine import Event, JobAccount
from service.accounting.memory import MemoryJob


def account_of(durations: list[float], first: int = 1, rolled_back_to: int | None = None, stride: int = 1
               ) -> JobAccount:
    """Rank 0's steps first, first + stride, ... of attempt 0, taking `durations`."""
    account = JobAccount()
    account.apply_steps(0, [(first + i * stride, 100.0 + i, d, 0.0) for i, d in enumerate(durations)])
    account.attempts[0].rolled_back_to = rolled_back_to
    return account


def verdict(durations: list[float], **kwargs) -> rule.Verdict:
    return account_of(durations, **kwargs).attempts[0].slow_time()


def example(steps: int = 80, slow_from: int | None = None) -> list[float]:
    """docs/ett.md's worked example: 0.1 s steps, every 10th 0.2 s, the first 3 0.4 s, twice as
    long from `slow_from` on."""
    return [0.1 * (4 if s <= 3 else 1) * (2 if s % 10 == 0 else 1) * (2 if slow_from and s >= slow_from else 1)
            for s in range(1, steps + 1)]


def test_the_worked_example():
    v = verdict(example(slow_from=30))
    assert v.ideal_step_seconds == pytest.approx(0.11)
    assert v.band_seconds == pytest.approx(0.11 * 4 * 0.1 / 1.1)  # noise 9.1%, band 36.4%
    assert v.slow_seconds == pytest.approx(5 * (2.2 - 1.1))
    [slowdown] = v.slowdowns
    assert (slowdown.since_step, slowdown.last_step, slowdown.ongoing) == (30, 79, True)
    assert slowdown.factor == pytest.approx(2.0) and slowdown.slow_seconds == pytest.approx(5.5)
    healthy = verdict(example())
    assert (healthy.slow_seconds, healthy.slowdowns, healthy.ideal_step_seconds) == (0.0, (), pytest.approx(0.11))


def test_the_same_steps_in_any_order_and_through_the_stored_form_give_the_same_figures():
    durations = example(1500, slow_from=900)  # 1,500 steps: windows of 20
    steps = [(i + 1, 100.0 + i, d, 0.0) for i, d in enumerate(durations)]
    ordered, shuffled = JobAccount(), JobAccount()
    ordered.apply_steps(0, steps)
    random.Random(3).shuffle(steps)
    for i in range(0, len(steps), 97):
        shuffled.apply_steps(0, steps[i:i + 97])
    figures = [(v.ideal_step_seconds, v.slow_seconds, [s.since_step for s in v.slowdowns])
               for v in (ordered.attempts[0].slow_time(), shuffled.attempts[0].slow_time(),
                         JobAccount.from_dict(ordered.to_dict()).attempts[0].slow_time())]
    assert ordered.attempts[0].step_windows["width"] == 20
    assert figures[0] == (pytest.approx(0.11, rel=0.01), pytest.approx(600 * 0.11, rel=0.01), [900])
    assert figures[1] == figures[2] == (pytest.approx(figures[0][0]), pytest.approx(figures[0][1]), [900])


def test_an_account_stored_by_the_former_rule_still_loads():
    stored = account_of(example()).to_dict()
    for a in stored["attempts"]:
        del a["step_windows"]
        a["step_buckets"] = {"-115": [10, 1.0]}
    assert JobAccount.from_dict(stored).attempts[0].slow_seconds == 0.0


# -- each threshold on each side --------------------------------------------------------------


def test_warm_up_is_the_first_five_steps_of_an_attempt_after_its_restore():
    # Restored at step 95: steps 96-100 are warm-up; window 10 (steps 100-109 but 100) is judged.
    steady = [0.1] * 45
    assert verdict([0.4] * 5 + steady, first=96).slow_seconds == 0.0
    assert verdict([0.4] * 6 + steady[1:], first=96).slow_seconds == pytest.approx(0.3)


def test_a_window_holding_half_its_steps_is_judged_one_holding_fewer_is_not():
    steady = [0.1] * 40  # steps 10-49
    assert verdict(steady + [0.3] * 5, first=10).slow_seconds == pytest.approx(5 * 0.2)
    assert verdict(steady + [0.3] * 4, first=10).slow_seconds == 0.0


def test_three_windows_tell_a_pace_two_do_not():
    assert verdict([0.1] * 20 + [0.3] * 10, first=10).slow_seconds == pytest.approx(10 * 0.2)
    assert verdict([0.1] * 10 + [0.3] * 10, first=10) == rule.NO_VERDICT


def test_the_pace_holds_while_a_quarter_of_the_windows_keep_it():
    # 9 windows: the lower quartile is the third fastest.
    assert verdict([0.1] * 30 + [0.3] * 60, first=10).slow_seconds == pytest.approx(60 * 0.2)
    assert verdict([0.1] * 20 + [0.3] * 70, first=10).slow_seconds == 0.0


def test_a_job_without_noise_books_a_window_over_five_percent_not_one_under():
    steady = [1.0] * 80  # steps 10-89
    assert verdict(steady + [1.045] * 10, first=10).slow_seconds == 0.0
    assert verdict(steady + [1.055] * 10, first=10).slow_seconds == pytest.approx(0.55)


def test_a_noisy_job_books_a_window_over_four_of_its_standard_errors_not_one_under():
    noisy = [0.9, 1.1] * 5  # each window's standard error: 3.33% of its mean; the band: 13.3%
    steady = noisy * 8
    assert verdict(steady + [d * 1.12 for d in noisy], first=10).slow_seconds == 0.0
    assert verdict(steady + [d * 1.15 for d in noisy], first=10).slow_seconds == pytest.approx(1.5, rel=0.02)


def test_three_slow_windows_after_a_steady_one_are_a_slowdown_two_or_slow_from_the_start_are_not():
    steady = [0.1] * 60
    assert [s.since_step for s in verdict(steady + [0.3] * 30 + steady, first=10).slowdowns] == [70]
    two = verdict(steady + [0.3] * 20 + steady, first=10)
    assert two.slowdowns == () and two.slow_seconds == pytest.approx(20 * 0.2)  # slow, not lasting
    assert verdict([0.3] * 30 + steady * 2, first=10).slowdowns == ()  # no steady window before it


def test_an_attempt_outgrowing_its_windows_merges_them_in_pairs():
    assert account_of([0.1] * 1279).attempts[0].step_windows["width"] == 10  # steps 1-1279: 128 windows
    durations = [0.1] * 1279 + [0.3] * 10  # steps 1-1289: 129 windows of 10 -> 65 of 20
    w = account_of(durations).attempts[0].step_windows
    assert w["width"] == 20 and len(w["windows"]) == 65
    assert verdict(durations).slow_seconds == pytest.approx(10 * 0.2)


def test_rolled_back_steps_are_wasted_not_slow():
    durations = [0.1] * 39 + [0.3] * 30  # steps 1-69, slow from step 40
    assert verdict(durations).slow_seconds == pytest.approx(30 * 0.2)
    assert verdict(durations, rolled_back_to=49).slow_seconds == pytest.approx(10 * 0.2)


def saving_job(blocked_in_step: bool, told: bool = True) -> MemoryJob:
    """60 steps of 0.1 s and a save of every 10th step blocking 0.5 s: inside the step after it (the
    built-in trainer waits for the copy there; the step event says so in `saving` when `told`), or
    between the two steps (run.checkpoint after a library script's step)."""
    job, events, seq = MemoryJob(), [], iter(range(10_000))
    t = 1000.0
    for step in range(1, 61):
        saved = step - 1 if step > 1 and (step - 1) % 10 == 0 else None
        if saved and not blocked_in_step:
            events += [Event("ckpt_start", t, 0, "rank:0", next(seq), saved),
                       Event("ckpt_staged", t + 0.5, 0, "rank:0", next(seq), saved)]
            t += 0.5
        blocked = 0.5 if saved and blocked_in_step else 0.0
        if blocked:
            events += [Event("ckpt_start", t, 0, "rank:0", next(seq), saved),
                       Event("ckpt_staged", t + 0.5, 0, "rank:0", next(seq), saved)]
        t += 0.1 + blocked
        data = {"duration": 0.1 + blocked, **({"saving": blocked} if blocked and told else {})}
        events.append(Event("step", t, 0, "rank:0", next(seq), step, data))
    job.ingest(events)
    return job


def test_a_saves_blocking_inside_a_step_is_booked_as_checkpoint_time_never_again_as_slow():
    told, untold = saving_job(blocked_in_step=True).account.attempts[0], saving_job(True, told=False).account.attempts[0]
    assert told.blocking_seconds == pytest.approx(2.5) and told.slow_seconds == 0.0
    assert told.slow_time().ideal_step_seconds == pytest.approx(0.1)
    assert untold.slow_time().ideal_step_seconds == pytest.approx(0.15)  # a step that did not say it waited


def test_a_save_between_steps_takes_nothing_off_the_pace():
    """The review's break: run.checkpoint between steps blocked 0.5 s every 10 steps, and the rule
    took it off the window after, so the pace came out below every real step (0.075 s for 0.1 s)."""
    verdict = saving_job(blocked_in_step=False).account.attempts[0].slow_time()
    assert verdict.ideal_step_seconds == pytest.approx(0.1) and verdict.slow_seconds == 0.0


def test_steps_numbered_four_apart_are_judged_in_windows_of_ten_steps():
    """The review's break: a script that counts micro-batches numbers its steps 4 apart; windows of
    10 numbers held 2 or 3 steps, under half, and a 3x slowdown booked nothing."""
    durations = [0.1] * 30 + [0.3] * 30
    v = verdict(durations, stride=4)
    assert v.ideal_step_seconds == pytest.approx(0.1) and v.slow_seconds == pytest.approx(30 * 0.2)
    [slowdown] = v.slowdowns
    # The first slow step is 121 (1 + 30 x 4); a slowdown is told by its windows', here of 40 numbers.
    assert slowdown.since_step == 120 and slowdown.factor == pytest.approx(3.0)
    # At stride 1 the same steps are numbered 1-60: step 60 alone in its window tells nothing.
    assert verdict(durations, stride=1).slow_seconds == pytest.approx(29 * 0.2)


# -- properties --------------------------------------------------------------------------------


def steady_job(rng: random.Random, steps: int, base: float, jitter: float, spike: float, warm: float) -> list[float]:
    """Seeded jitter of +-`jitter`, the first 3 steps `warm` times as long, every 10th `spike` times."""
    return [base * rng.uniform(1 - jitter, 1 + jitter) * (warm if s <= 3 else 1) * (spike if s % 10 == 0 else 1)
            for s in range(1, steps + 1)]


@settings(max_examples=150, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**32), steps=st.integers(30, 400), base=st.floats(0.001, 100),
       jitter=st.floats(0, 0.25), spike=st.floats(1, 3), warm=st.floats(1, 10))
def test_noise_within_the_jobs_band_is_never_booked(seed, steps, base, jitter, spike, warm):
    v = verdict(steady_job(random.Random(seed), steps, base, jitter, spike, warm))
    assert (v.slow_seconds, v.slowdowns) == (0.0, ())


@settings(max_examples=150, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**32), before=st.integers(40, 80), k=st.integers(30, 120), after=st.integers(20, 60),
       base=st.floats(0.001, 100), jitter=st.floats(0, 0.10), factor=st.floats(1.5, 4))
def test_an_injected_slowdown_books_within_ten_percent_of_its_cost(seed, before, k, after, base, jitter, factor):
    durations = steady_job(random.Random(seed), before + k + after, base, jitter, spike=1, warm=4)
    cost = sum(d * (factor - 1) for d in durations[before:before + k])
    durations[before:before + k] = [d * factor for d in durations[before:before + k]]
    assert verdict(durations).slow_seconds == pytest.approx(cost, rel=0.10)
