"""The bad-event corpus: each batch is refused whole with a 4xx that names the event and its
field, and nothing of it is stored (SQLite and PostgreSQL)."""

import json
import time

from sqlalchemy import func, select

from service.models import Checkpoint, JobAccountRow, JobEvent
from tests.service.factories import give_attempt, register_agent, submit


def good(seq: int, **change) -> dict:
    event = {"kind": "step", "ts": time.time() - 60, "attempt": 0, "source": "rank:0", "seq": seq, "step": seq + 1,
             "data": {"duration": 0.5, "tokens": 1024, "loss": 2.5}}  # fmt: skip
    return event | change


def batch_with(bad: dict) -> list[dict]:
    """A good event, then the bad one (index 1), then another good one."""
    return [good(0), bad, good(2)]


CORPUS = [
    ("ts-not-a-number", batch_with(good(1, ts="yesterday")), "events.1.ts"),
    ("ts-in-the-future", batch_with(good(1, ts=time.time() + 86400)), "events.1.ts"),
    ("attempt-a-bool", batch_with(good(1, attempt=True)), "events.1.attempt"),
    ("seq-negative", batch_with(good(1) | {"seq": -1}), "events.1.seq"),
    ("step-a-string", batch_with(good(1, step="3")), "events.1.step"),
    ("unknown-kind", batch_with(good(1, kind="explode")), "events.1.kind"),
    ("unknown-field", batch_with(good(1, extra=1)), "events.1.extra"),
    ("step-without-number", batch_with(good(1, step=None)), "events.1.step"),
    ("step-without-duration", batch_with(good(1, data={"loss": 1.0})), "events.1.data"),
    ("kind-from-wrong-source", batch_with(good(1, kind="attempt_allocated")), "events.1.source"),
    ("source-malformed", batch_with(good(1, source="rank:zero")), "events.1.source"),
    ("data-not-an-object", batch_with(good(1, data=[1, 2])), "events.1.data"),
    ("data-over-the-limit", batch_with(good(1, data={"duration": 1.0, "blob": "x" * 20000})), "events.1.data"),
    ("seq-reused-in-batch", [good(0), good(1), good(1, step=99)], "events.2.seq"),
    ("no-events", [], "events"),
]


def stored(service) -> tuple[int, int, int]:
    with service.context.sessions() as session:
        return tuple(session.scalar(select(func.count()).select_from(t)) for t in (JobEvent, Checkpoint, JobAccountRow))


def test_each_bad_batch_is_refused_whole_naming_the_field(service):
    # One service for the whole corpus: each case is a request, not a server start.
    admin = service.client(service.token("admin"))
    job = submit(service.client(service.token("user")), nodes=8)
    for case, events, field in CORPUS:
        response = admin.post(f"/api/v1/jobs/{job['id']}/events", json={"events": events})
        assert response.status_code == 422, (case, response.text)
        assert field in [e["field"] for e in response.json()["detail"]], (case, response.json())
        assert stored(service) == (0, 0, 0), case


def test_seq_reused_with_other_content_after_a_stored_batch(service):
    admin = service.client(service.token("admin"))
    job = submit(service.client(service.token("user")), nodes=8)
    first = [good(0), good(1), {"kind": "ckpt_start", "ts": time.time() - 50, "attempt": 0, "source": "rank:0",
                                "seq": 2, "step": 2, "data": {}}]  # fmt: skip
    assert admin.post(f"/api/v1/jobs/{job['id']}/events", json={"events": first}).status_code == 200
    before = stored(service)
    changed = [good(3), good(1, data={"duration": 0.75})]
    response = admin.post(f"/api/v1/jobs/{job['id']}/events", json={"events": changed})
    assert response.status_code == 422 and response.json()["detail"][0]["field"] == "events.1.seq"
    assert "other content" in response.json()["detail"][0]["msg"]
    assert stored(service) == before == (3, 1, 1)


def test_nan_and_a_body_over_the_limit(service):
    admin = service.client(service.token("admin"))
    job = submit(service.client(service.token("user")), nodes=8)
    url = f"/api/v1/jobs/{job['id']}/events"
    # The duration's own key: its digits alone may also be found in the time ("...140.5...").
    nan = json.dumps({"events": [good(0)]}).replace('"duration": 0.5', '"duration": NaN', 1)
    assert "NaN" in nan
    response = admin.post(url, content=nan, headers={"content-type": "application/json"})
    assert response.status_code == 422 and response.json()["detail"][0]["field"].startswith("events.0")
    limit = service.context.settings.max_request_bytes
    huge = [good(i, data={"duration": 1.0, "pad": "x" * 8000}) for i in range(limit // 8000 + 1)]
    assert admin.post(url, json={"events": huge}).status_code == 413
    assert stored(service) == (0, 0, 0)


def test_agent_batch_naming_an_unknown_or_no_job(service):
    agent = service.client(service.token("agent", "node-a"))
    register_agent(agent, "node-a")
    job = submit(service.client(service.token("user")), nodes=8)
    give_attempt(service, job["id"], "node-a")
    for events, field in (
        ([good(0) | {"job_id": job["id"]}, good(1) | {"job_id": "f" * 32}], "events.1.job_id"),
        ([good(0)], "events.0.job_id"),
    ):
        response = agent.post("/api/v1/agents/node-a/events", json={"events": events})
        assert response.status_code == 422 and field in [e["field"] for e in response.json()["detail"]]
    assert stored(service) == (0, 0, 0)
