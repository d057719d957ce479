"""Per-rank step timing (ett/timing.py, ett/waits.py): the windows a rank writes, the work it marks,
the DDP hook that marks it for a script, the waits on collectives taken off it, and the injected
slowdown."""

import json
import threading
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import ett
from ett import waits
from ett.protocol import EVENTS_DIR, rank_spool
from ett.timing import WINDOW, DDPWatch, SyncClock, TimingWindow
from tests.ett.test_run import in_job, no_ett_environment  # noqa: F401 (fixtures)
from tests.trainer.trainer_runs import read_events


def test_a_window_is_summarised_every_five_steps_and_a_partial_one_at_the_end():
    emitted = []
    window = TimingWindow(lambda kind, step, **data: emitted.append((kind, step, data)))
    for step, work in zip(range(3, 13), [0.1, 0.2, 0.3, 0.1, 0.1, 0.5, 0.1, 0.1, 0.1, 0.2], strict=True):
        window.add(step, duration=1.0 + work, work=work if step != 12 else None)
    window.flush()
    windows = [(step, data["first_step"], data["steps"]) for _, step, data in emitted]
    assert windows == [(5, 3, 3), (10, 6, 5), (12, 11, 2)]
    assert emitted[0][2]["work"] == pytest.approx(0.2) and emitted[1][2]["work"] == pytest.approx(0.1)
    assert emitted[1][2]["duration"] == pytest.approx(1.1)
    assert "work" not in emitted[2][2]  # a step without a mark: the window's work is not known
    assert {kind for kind, _, _ in emitted} == {"step_timing"}


def test_ddp_buckets_mark_where_the_rank_starts_to_wait():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    clock = SyncClock()
    watch = DDPWatch(clock)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1)))
    for _ in range(2):
        clock.begin()
        loss = model(torch.randn(4, 8)).sum()
        before_backward = time.perf_counter()
        loss.backward()
        after_backward = time.perf_counter()
        span = clock.end()
        assert span is not None and span.mark is not None and before_backward <= span.mark <= after_backward
    assert watch.found and watch._handle is None  # the global hook is gone once the module is timed


def test_a_job_run_writes_each_window_with_the_work_it_marked(in_job, monkeypatch):  # noqa: F811
    monkeypatch.setenv("ETT_FAULTS", json.dumps([{"action": "slow", "rank": 0, "at_step": 6, "factor": 3.0,
                                                  "attempt": 2}]))
    with ett.init() as run:
        for step in range(1, 2 * WINDOW + 1):
            with run.step(step) as s:
                time.sleep(0.01)
                s.synchronizing()
                time.sleep(0.01)
    timings = [e for e in read_events(in_job / EVENTS_DIR / rank_spool(0)) if e["kind"] == "step_timing"]
    assert [(e["step"], e["data"]["first_step"]) for e in timings] == [(5, 1), (10, 6)]
    before, slowed = (e["data"] for e in timings)
    assert 0.009 < before["work"] < before["duration"]
    # From step 6 the rank sleeps twice its step before it reaches the mark: about 3x the step.
    assert slowed["work"] > 0.04 and slowed["duration"] > 2.5 * before["duration"]


def test_a_steps_work_leaves_out_its_waits_on_collectives_before_the_mark_only():
    """One rank's group: its all-reduces wait on nothing, but every wait is timed; a wait after
    the mark, or on another thread (an asynchronous save's), is not the step's."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    clock = SyncClock(time_waits=True)
    try:
        clock.begin()
        dist.all_reduce(torch.ones(4))
        other = threading.Thread(target=dist.all_reduce, args=(torch.ones(4),))
        other.start()
        other.join()
        clock.mark()
        dist.all_reduce(torch.ones(4))
        span = clock.end()
    finally:
        clock.stop()
    assert span is not None and len(span.waits) == 2 and span.waits_before_mark == 1
    waited = span.waits[0][1] - span.waits[0][0]
    assert span.work() == pytest.approx(span.mark - span.start - waited)
    assert dist.Work.wait is waits._WORK_WAIT  # torch's own again once the run stops


def test_without_a_mark_the_work_is_the_step_less_all_its_waits():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    clock = SyncClock(time_waits=True)
    try:
        clock.begin()
        dist.all_reduce(torch.ones(4))
        dist.barrier()
        span = clock.end()
    finally:
        clock.stop()
    waited = sum(end - begin for begin, end in span.waits)
    assert len(span.waits) == 2 and span.work() == pytest.approx(span.end - span.start - waited)
    untimed = SyncClock()  # one rank, or outside a job: nothing is timed, and without a mark no work is known
    untimed.begin()
    assert untimed.end().work() is None


class PendingClock(waits.WallClock):
    """A GPU's clock as the window sees it: points the device has not passed yet (on CUDA, the
    events of a step the host ran ahead of)."""

    passed = False

    def done(self, _point: float) -> bool:
        return self.passed


def test_a_window_waits_for_its_last_steps_points_to_be_passed():
    emitted = []
    window = TimingWindow(lambda kind, step, **data: emitted.append((step, data)))
    clock = PendingClock()
    for step in range(1, WINDOW + 2):
        span = waits.StepSpan(clock)
        span.waits_timed, span.end = True, span.start + 0.5
        window.add(step, duration=0.5, work=span)
    assert emitted == []  # due at step 5, not read before the device is there
    clock.passed = True
    window.add(WINDOW + 2, duration=0.5, work=0.25)
    assert [(step, data["first_step"], data["steps"]) for step, data in emitted] == [(WINDOW + 2, 1, WINDOW + 2)]
    assert emitted[0][1]["work"] == pytest.approx(0.5)
