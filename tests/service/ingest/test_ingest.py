"""Event ingestion over real HTTP (SQLite and PostgreSQL): both doors, idempotency, clock skew,
the checkpoint catalog, and reports that agree with the pure engine."""

import json
import random
import time
from dataclasses import asdict

import pytest
from sqlalchemy import func, select

from service.accounting.memory import MemoryJob
from service.models import Checkpoint, JobEvent
from tests.service.accounting.test_engine_timelines import crash_with_rollback
from tests.service.accounting.timelines import T0, Timeline
from tests.service.factories import give_attempt, register_agent, submit

# Jobs here need more nodes than the tests register, so the scheduler leaves them alone.
SPEC = {"nodes": 8}


def wire(events, job_id: str | None = None) -> list[dict]:
    return [asdict(e) | ({"job_id": job_id} if job_id else {}) for e in events]


def replay(admin, job_id: str, events) -> dict:
    response = admin.post(f"/api/v1/jobs/{job_id}/events", json={"events": wire(events)})
    assert response.status_code == 200, response.text
    return response.json()


def stored_events(service, job_id: str) -> int:
    with service.context.sessions() as session:
        return session.scalar(select(func.count()).where(JobEvent.job_id == job_id))


def catalog(service, job_id: str) -> list[tuple]:
    """The job's checkpoint records, newest step first: (attempt, step, started_at, staged_at,
    committed_at, path, bytes)."""
    with service.context.sessions() as session:
        return [tuple(row) for row in session.execute(
            select(Checkpoint.attempt, Checkpoint.step, Checkpoint.started_at, Checkpoint.staged_at,
                   Checkpoint.committed_at, Checkpoint.path, Checkpoint.bytes)
            .where(Checkpoint.job_id == job_id).order_by(Checkpoint.step.desc(), Checkpoint.attempt)
        )]  # fmt: skip


def test_replayed_timeline_reports_what_the_engine_does(service):
    admin = service.client(service.token("admin"))
    alice = service.client(service.token("user", "alice"))
    job = submit(alice, **SPEC)
    events = crash_with_rollback().events
    assert replay(admin, job["id"], events) == {"accepted": len(events), "duplicates": 0, "refused": 0}
    report = alice.get(f"/api/v1/jobs/{job['id']}/ett").json()
    expected = MemoryJob(job["id"])
    expected.ingest(events)
    want = expected.report(time.time())
    assert report["seconds"] == pytest.approx(want["seconds"], abs=1e-6)
    assert report["wall_seconds"] == pytest.approx(58) and report["ett_percent"] == pytest.approx(want["ett_percent"])
    assert report["failures"] == [pytest.approx(f) for f in want["failures"]]
    assert report["checkpoints"] == pytest.approx(want["checkpoints"])
    assert report["state"] == "queued" and report["queued_seconds"] == 0  # submitted after this old timeline
    # The catalog holds the committed checkpoints, newest step first for the scheduler.
    committed = [(c[0], c[1], c[5], c[6]) for c in catalog(service, job["id"]) if c[4] is not None]
    assert committed == [(1, 8, "/ckpt/step-00000008", 4096), (0, 4, "/ckpt/step-00000004", 4096)]


def test_repeats_splits_and_any_order_give_the_same_report(service):
    admin = service.client(service.token("admin"))
    alice = service.client(service.token("user", "alice"))
    once, scrambled = submit(alice, **SPEC), submit(alice, **SPEC)
    events = crash_with_rollback().events
    assert replay(admin, once["id"], events[:5]) == {"accepted": 5, "duplicates": 0, "refused": 0}
    # Stored and new events in one batch (PostgreSQL: its COPY fails, then the new ones go in alone).
    assert replay(admin, once["id"], events) == {"accepted": len(events) - 5, "duplicates": 5, "refused": 0}
    shuffled = random.Random(7).sample(events, len(events))
    for lo in range(0, len(shuffled), 7):
        replay(admin, scrambled["id"], shuffled[lo : lo + 7])
    again = replay(admin, scrambled["id"], events)
    assert again == {"accepted": 0, "duplicates": len(events), "refused": 0}
    in_batch = replay(admin, scrambled["id"], events[:3] + events[:3])
    assert in_batch == {"accepted": 0, "duplicates": 6, "refused": 0}
    assert stored_events(service, scrambled["id"]) == len(events)
    a = alice.get(f"/api/v1/jobs/{once['id']}/ett").json()
    b = alice.get(f"/api/v1/jobs/{scrambled['id']}/ett").json()
    for report in (a, b):
        report.pop("job_id")
        report.pop("queued_seconds")  # the two jobs were submitted a few ms apart
    assert b == a
    # The checkpoint records, whose events came in batches apart, end up the same.
    assert catalog(service, scrambled["id"]) == catalog(service, once["id"]) != []


def test_a_diverged_runs_nan_and_infinite_losses_are_stored_as_null_and_repeats_stay_repeats(service):
    admin = service.client(service.token("admin"))
    job = submit(service.client(service.token("user")), **SPEC)
    step = {"kind": "step", "ts": time.time() - 60, "attempt": 0, "source": "rank:0", "step": 1}
    diverged = step | {"seq": 0, "data": {"duration": 0.5, "loss": float("nan")}}
    # A count up to 2**53 is kept (service/schemas/events.py; above it, tests/service/ingest/test_event_values.py).
    counted = step | {"seq": 1, "step": 2, "data": {"duration": 0.5, "loss": float("inf"), "tokens": 2**53}}
    # Python's json writes NaN and Infinity, as a trainer's json.dumps would.
    body = json.dumps({"events": [diverged, counted, diverged]})
    url, headers = f"/api/v1/jobs/{job['id']}/events", {"content-type": "application/json"}
    for expected in ({"accepted": 2, "duplicates": 1, "refused": 0},
                     {"accepted": 0, "duplicates": 3, "refused": 0}):  # fmt: skip
        response = admin.post(url, content=body, headers=headers)
        assert response.status_code == 200 and response.json() == expected, response.text
    with service.context.sessions() as session:
        stored = session.scalars(select(JobEvent.data).where(JobEvent.job_id == job["id"]).order_by(JobEvent.seq))
        assert list(stored) == [{"duration": 0.5, "loss": None}, {"duration": 0.5, "loss": None, "tokens": 2**53}]

def test_agent_events_are_moved_onto_the_service_clock(service):
    agent = service.client(service.token("agent", "node-a"))
    alice = service.client(service.token("user", "alice"))
    register_agent(agent, "node-a")
    job = submit(alice, **SPEC)
    give_attempt(service, job["id"], "node-a")
    # The node's clock is 40 s behind the service's.
    agent.post("/api/v1/agents/node-a/heartbeat", json={"clock": time.time() - 40}).raise_for_status()
    agent_now = time.time() - 40
    tl = Timeline()
    tl.rank0("init_start", 0, 0)
    tl.rank0("init_end", 1, 0)
    tl.step(0, 1, start=1, duration=0.5)
    tl.add("worker_exited", 2, 0, "node:node-a", exit_code=0)
    # Events of 10 s ago on the node's clock.
    batch = [dict(e, ts=agent_now - 10 + (e["ts"] - T0)) for e in wire(tl.events, job["id"])]
    response = agent.post("/api/v1/agents/node-a/events", json={"events": batch})
    assert response.status_code == 200, response.text
    assert response.json() == {"accepted": 4, "duplicates": 0, "refused": 0}
    with service.context.sessions() as session:
        rows = session.scalars(select(JobEvent).where(JobEvent.job_id == job["id"]).order_by(JobEvent.ts)).all()
    offsets = {round(r.clock_offset_seconds) for r in rows}
    assert offsets == {40}
    assert all(abs(r.ts - r.clock_offset_seconds - b["ts"]) < 1e-6 for r, b in zip(rows, batch, strict=True))
    assert time.time() - 12 < rows[0].ts < time.time() - 8  # 10 s ago on the service's clock
    # Sent again after the offset changed: still the same events.
    agent.post("/api/v1/agents/node-a/heartbeat", json={"clock": time.time() - 38}).raise_for_status()
    again = agent.post("/api/v1/agents/node-a/events", json={"events": batch})
    assert again.json() == {"accepted": 0, "duplicates": 4, "refused": 0}


def test_one_agent_batch_for_two_jobs(service):
    agent = service.client(service.token("agent", "node-a"))
    alice = service.client(service.token("user", "alice"))
    register_agent(agent, "node-a")
    jobs = [submit(alice, **SPEC)["id"] for _ in range(2)]
    timelines = []
    for steps, job_id in zip((3, 5), jobs, strict=True):
        give_attempt(service, job_id, "node-a")
        tl = Timeline(time.time() - 60)
        tl.rank0("init_end", 1, 0)
        tl.steps(0, 1, steps, start=1, duration=0.5)
        timelines.append(wire(tl.events, job_id))
    # The jobs' events interleaved, with the same (attempt, source, seq) keys in both.
    batch = [e for pair in zip(*timelines) for e in pair] + timelines[1][len(timelines[0]) :]
    for expected in ({"accepted": 10, "duplicates": 0, "refused": 0},
                     {"accepted": 0, "duplicates": 10, "refused": 0}):  # fmt: skip
        response = agent.post("/api/v1/agents/node-a/events", json={"events": batch})
        assert response.status_code == 200 and response.json() == expected, response.text
    assert [stored_events(service, job_id) for job_id in jobs] == [4, 6]
    reports = [alice.get(f"/api/v1/jobs/{job_id}/ett").json() for job_id in jobs]
    assert [r["seconds"]["productive"] for r in reports] == [pytest.approx(1.5), pytest.approx(2.5)]

def test_agents_send_only_their_own_sources(service):
    agent = service.client(service.token("agent", "node-a"))
    register_agent(agent, "node-a")
    job = submit(service.client(service.token("user")), **SPEC)
    base = {"ts": time.time(), "attempt": 0, "seq": 0, "step": None, "data": {}, "job_id": job["id"]}
    for event, field in (
        (base | {"kind": "attempt_failed", "source": "service"}, "events.0.source"),
        (base | {"kind": "hang_detected", "source": "node:node-b"}, "events.0.source"),
    ):
        response = agent.post("/api/v1/agents/node-a/events", json={"events": [event]})
        assert response.status_code == 422 and response.json()["detail"][0]["field"] == field
    assert stored_events(service, job["id"]) == 0


def test_who_may_send_and_read(service):
    alice = service.client(service.token("user", "alice"))
    bob = service.client(service.token("user", "bob"))
    agent = service.client(service.token("agent", "node-a"))
    job = submit(alice, **SPEC)
    body = {"events": wire(crash_with_rollback().events[:2])}
    assert alice.post(f"/api/v1/jobs/{job['id']}/events", json=body).status_code == 403
    assert agent.post(f"/api/v1/jobs/{job['id']}/events", json=body).status_code == 403
    assert service.client().post(f"/api/v1/jobs/{job['id']}/events", json=body).status_code == 401
    assert service.client(service.token("admin")).post("/api/v1/jobs/nope/events", json=body).status_code == 404
    assert alice.get(f"/api/v1/jobs/{job['id']}/ett").status_code == 200
    assert bob.get(f"/api/v1/jobs/{job['id']}/ett").status_code == 404
    assert service.client().get("/api/v1/ett").status_code == 401


def test_fleet_report_over_windows_and_names(service):
    admin = service.client(service.token("admin"))
    alice = service.client(service.token("user", "alice"))
    bob = service.client(service.token("user", "bob"))
    first, second = submit(alice, name="moe-a", **SPEC), submit(bob, name="moe-b", **SPEC)
    replay(admin, first["id"], crash_with_rollback().events)
    replay(admin, second["id"], crash_with_rollback().events)
    whole = admin.get("/api/v1/ett").json()
    assert whole["jobs"] == 2 and whole["wall_seconds"] == pytest.approx(116)
    assert whole["seconds"]["productive"] == pytest.approx(48) and whole["failures"] == 2
    assert set(whole["by_name"]) == {"moe-a", "moe-b"}
    assert whole["by_name"]["moe-a"]["wall_seconds"] == pytest.approx(58)
    # Attempt 1 alone (its allocation at 35 to the end at 58), given as ISO 8601 and as unix seconds.
    since = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(T0 + 35))
    window = admin.get("/api/v1/ett", params={"since": since, "until": T0 + 58}).json()
    assert window["wall_seconds"] == pytest.approx(46)
    assert window["seconds"]["restore"] == pytest.approx(4) and window["seconds"]["recovery"] == 0
    assert window["restarts"] == 2 and window["failures"] == 0
    # A user's figures cover their own jobs.
    assert alice.get("/api/v1/ett").json()["by_name"].keys() == {"moe-a"}
    assert admin.get("/api/v1/ett", params={"since": T0 + 10, "until": T0}).status_code == 422
