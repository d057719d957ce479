"""Property tests over generated valid timelines.

The generator lays a job out on a clock of 1/8 s ticks (so every sum is exact in floating
point) and tallies, while it lays each interval down, which category that interval is: an oracle
written from the table of docs/ett.md independently of the engine. The engine must agree with it and
give the very same report whatever the order, the batch split or the repeats of ingestion.
"""

import random
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service.accounting.engine import CATEGORIES
from service.accounting.fleet import FleetJob, fleet_report
from service.accounting.memory import MemoryJob
from tests.service.accounting.timelines import T0, Timeline

TICK = 1 / 8
PROPERTY_SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def timelines(draw):
    """(Timeline, now, expected seconds by category) for a job of 1 to 4 attempts."""
    tl, tally = Timeline(), Counter()
    ticks = st.integers(1, 6)
    interval = draw(st.integers(2, 4))
    n_attempts = draw(st.integers(1, 4))
    committed: list[int] = []
    restore_points: list[int | None] = []
    steps_of: list[list[tuple[int, int]]] = []  # per attempt: (step, duration in ticks)
    t = 0
    last_activity = 0
    for a in range(n_attempts):
        last = a == n_attempts - 1
        alloc = t
        tl.service("attempt_allocated", t * TICK, a, nodes=["n1"])
        tl.rank0("init_start", (t + 1) * TICK, a)
        fail_in_init = not last and draw(st.booleans()) and draw(st.booleans())
        if fail_in_init:  # dies before init_end: everything from allocation is recovery
            t += draw(ticks)
            last_activity = alloc
            restore_points.append(None)
            steps_of.append([])
            tl.service("attempt_failed", t * TICK, a, cause="exit")
            t += draw(ticks)
            tally["recovery"] += t - last_activity
            continue
        t += 1 + draw(ticks)
        tally["init"] += t - alloc
        tl.rank0("init_end", t * TICK, a)
        position, restored = 0, None
        if committed and draw(st.booleans()):
            restored = draw(st.sampled_from(committed))
            r = draw(ticks)
            tl.rank0("restore_start", t * TICK, a, restored)
            tl.rank0("restore_end", (t + r) * TICK, a, restored)
            t += r
            tally["restore"] += r
            position = restored
        last_activity = t
        n_steps = draw(st.integers(0 if not last else 1, 10))
        pending: list[tuple[int, int]] = []  # (step, commit time) of saves still being written
        mine = []
        for _ in range(n_steps):
            gap = draw(st.integers(0, 2))
            tally["init" if not mine else "idle"] += gap
            d = draw(ticks)
            position += 1
            t += gap + d
            tl.step(a, position, (t - d) * TICK, d * TICK)
            mine.append((position, d))
            last_activity = t
            if position % interval == 0:
                blocking = draw(ticks)
                tl.rank0("ckpt_start", t * TICK, a, position)
                tl.rank0("ckpt_staged", (t + blocking) * TICK, a, position)
                pending.append((position, t + blocking + draw(st.integers(0, 12))))
                t += blocking
                tally["checkpoint_save"] += blocking
                last_activity = t
        steps_of.append(mine)
        restore_points.append(restored if restored is not None else (0 if mine else None))
        fails = last_failed = not last or draw(st.booleans())
        end = t + draw(st.integers(1, 8))  # crash, or the end of the run
        for step, at in pending:
            if not fails or at < end:
                tl.rank0("ckpt_committed", at * TICK, a, step, path=f"/c/{step}", bytes=1)
                committed.append(step)
        if fails:
            tl.service("attempt_failed", end * TICK, a, cause=draw(st.sampled_from(["exit", "signal", "hang"])))
            t = end + draw(ticks)
            if not last:
                tally["recovery"] += t - last_activity
        else:
            t = max([end] + [at for _, at in pending])
            tl.rank0("train_end", t * TICK, a)
            t += draw(ticks)
    finished = draw(st.booleans())
    now = t + draw(st.integers(0, 5))
    tail = now - last_activity
    if finished:
        tl.service("job_finished", now * TICK, n_attempts - 1, state="failed" if last_failed else "succeeded")
    # The tail after the last activity: recovery while a failed job waits, idle otherwise.
    tally["recovery" if last_failed and not finished else "idle"] += tail
    # Rolled-back steps: step s of attempt a is wasted iff a later attempt went back below s.
    for a, mine in enumerate(steps_of):
        later = [p for p in restore_points[a + 1 :] if p is not None]
        for step, d in mine:
            tally["wasted" if later and step > min(later) else "productive"] += d
    return tl, now, {c: tally[c] * TICK for c in CATEGORIES}


def report(events, now):
    job = MemoryJob("j")
    job.ingest(events)
    return job.report(T0 + now * TICK, fleet_mtbf_seconds=100.0)


@PROPERTY_SETTINGS
@given(timelines())
def test_categories_match_the_oracle_and_sum_to_wall(case):
    tl, now, expected = case
    r = report(tl.events, now)
    assert r["wall_seconds"] == now * TICK
    assert all(v >= 0 for v in r["seconds"].values())
    assert sum(r["seconds"].values()) == pytest.approx(r["wall_seconds"], abs=1e-9)
    assert r["seconds"] == pytest.approx(expected, abs=1e-9)
    assert 0 <= r["ett_percent"] <= 100


@PROPERTY_SETTINGS
@given(timelines(), st.randoms(use_true_random=False), st.integers(1, 6))
def test_order_batches_and_repeats_do_not_change_the_report(case, rng: random.Random, n_batches):
    tl, now, _ = case
    expected = report(tl.events, now)
    events = tl.events + rng.sample(tl.events, k=len(tl.events) // 3)  # some sent twice
    rng.shuffle(events)
    cuts = sorted(rng.sample(range(1, len(events)), k=min(n_batches, len(events) - 1)))
    job = MemoryJob("j")
    for lo, hi in zip([0, *cuts], [*cuts, len(events)]):
        job.ingest(events[lo:hi])
    job.ingest(tl.events)  # and the whole timeline once more
    assert job.report(T0 + now * TICK, fleet_mtbf_seconds=100.0) == expected


@PROPERTY_SETTINGS
@given(timelines(), st.integers(0, 400))
def test_fleet_windows_add_up_to_the_whole(case, cut):
    """Two windows that meet at any instant hold the job's whole time between them."""
    tl, now, expected = case
    job = MemoryJob("j")
    job.ingest(tl.events)
    at, stop = T0 + cut * TICK / 4, T0 + now * TICK
    jobs = [FleetJob("moe", job.account)]
    whole = fleet_report(jobs, now=stop)
    before = fleet_report(jobs, now=stop, until=at)
    after = fleet_report(jobs, now=stop, since=at)
    assert whole["seconds"] == pytest.approx(expected, abs=1e-9)
    for category in CATEGORIES:
        parts = before["seconds"][category] + after["seconds"][category]
        assert parts == pytest.approx(expected[category], abs=1e-6), category
    assert before["failures"] + after["failures"] == whole["failures"] == len(job.report(stop)["failures"])
    assert whole["by_name"]["moe"]["seconds"] == whole["seconds"]
