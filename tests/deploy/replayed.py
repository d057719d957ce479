"""A job with three attempts and two failures, replayed into a live service as an admin would."""

from collections.abc import Callable
from dataclasses import asdict, dataclass

from tests.service.accounting.timelines import Timeline
from tests.service.factories import submit
from tests.support.live import LiveService


def three_attempts(t0: float) -> Timeline:
    """Attempt 0 fails (exit) after a checkpoint, attempt 1 hangs in its own save, attempt 2 finishes
    from attempt 0's checkpoint: attempt 0's later steps and all of attempt 1's are wasted."""
    tl = Timeline()
    tl.start_attempt(0, allocated=0, init_end=5)
    tl.steps(0, 1, 40, start=5, duration=1)  # ends 45
    tl.checkpoint(0, 40, start=45, staged=46, committed=48)
    tl.steps(0, 41, 60, start=46, duration=1)  # ends 66
    tl.service("attempt_failed", 67, 0, cause="exit", detail="rank 1 exit code 1")
    tl.start_attempt(1, allocated=70, init_end=74, restore=(74, 76, 40))
    tl.steps(1, 41, 55, start=76, duration=1)  # ends 91
    tl.rank0("ckpt_start", 91, 1, 55)
    tl.rank0("ckpt_failed", 99, 1, 55)  # its save never stages: no blocking time, one failed save
    tl.add("hang_detected", 100, 1, "node:n1")
    tl.service("attempt_failed", 101, 1, cause="hang")
    tl.start_attempt(2, allocated=104, init_end=108, restore=(108, 110, 40))
    tl.steps(2, 41, 100, start=110, duration=1)  # ends 170
    tl.checkpoint(2, 100, start=170, staged=171, committed=173)
    tl.service("job_finished", 174, 2, state="succeeded")
    # Times relative to t0 rather than the builder's fixed epoch: the job is "recently finished".
    shift = t0 - tl.events[0].ts
    tl.events = [type(e)(e.kind, e.ts + shift, e.attempt, e.source, e.seq, e.step, e.data) for e in tl.events]
    return tl


def clean_success(t0: float) -> Timeline:
    """One attempt, 30 steps and a save, then success: nothing rolled back."""
    tl = Timeline(t0)
    tl.start_attempt(0, allocated=0, init_end=3)
    tl.steps(0, 1, 20, start=3, duration=1)  # ends 23
    tl.checkpoint(0, 20, start=23, staged=23.5, committed=25)
    tl.steps(0, 21, 30, start=23.5, duration=1)  # ends 33.5
    tl.service("job_finished", 34, 0, state="succeeded")
    return tl


def failed_at_start(t0: float) -> Timeline:
    """Each of two attempts fails before its first step (a missing script, say); the job then ends."""
    tl = Timeline(t0)
    for attempt, t in ((0, 0.0), (1, 5.0)):
        tl.service("attempt_allocated", t, attempt, nodes=["n1"])
        tl.add("workers_launched", t + 0.1, attempt, "node:n1")
        tl.service("attempt_failed", t + 1, attempt, cause="exit", detail="rank 0 exit code 2")
    tl.service("job_finished", 7, 1, state="failed")
    return tl


@dataclass
class ReplayedJob:
    id: str
    name: str
    admin_token: str
    user_token: str


def replayed_job(
    service: LiveService, t0: float, name: str = "moe-pages", timeline: Callable[[float], Timeline] = three_attempts
) -> ReplayedJob:
    admin_token, user_token = service.token("admin"), service.token("user", "alice")
    # More nodes than any test registers: the scheduler leaves the job to the replayed events.
    job = submit(service.client(user_token), name=name, nodes=8)
    events = [asdict(e) for e in timeline(t0).events]
    response = service.client(admin_token).post(f"/api/v1/jobs/{job['id']}/events", json={"events": events})
    assert response.status_code == 200, response.text
    return ReplayedJob(job["id"], name, admin_token, user_token)
