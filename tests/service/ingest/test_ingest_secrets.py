"""A job's secrets in its ranks' events: blanked in every string of their `data` before the service
stores them (service/ingest/store.py), whatever field they are in and however deep, as on the node
(ett/protocol/redaction.py): an agent that restarted no longer knows them."""

import time

from sqlalchemy import select

from service.models import JobEvent
from tests.service.factories import give_attempt, register_agent, submit

SECRET = "golfo-s3cr3t-G7"


def test_a_secret_in_any_string_of_a_ranks_event_is_stored_blanked(service):
    agent = service.client(service.token("agent", "node-a"))
    alice = service.client(service.token("user", "alice"))
    register_agent(agent, "node-a")
    job = submit(alice, nodes=8, env={"WANDB_API_KEY": SECRET, "GPU": "a10"})
    give_attempt(service, job["id"], "node-a")
    base = {"ts": time.time(), "attempt": 0, "source": "rank:0", "step": None, "job_id": job["id"]}
    events = [
        base | {"kind": "init_start", "seq": 0, "data": {"pid": 7, "note": f"key {SECRET} on a10"}},  # undeclared
        base | {"kind": "ckpt_failed", "seq": 1, "step": 5, "data": {"error": f"denied for golfo-\u0000s3cr3t-G7",  # a NUL inside
                                                            "more": {"deep": [[f"x {SECRET}"]]}}},
        base | {"kind": "ckpt_committed", "seq": 2, "step": 5,
                "data": {"path": f"/ckpt/{SECRET}/step-5", "verified": False, "note": SECRET}},
    ]
    for expected in ({"accepted": 3, "duplicates": 0, "refused": 0}, {"accepted": 0, "duplicates": 3, "refused": 0}):
        response = agent.post("/api/v1/agents/node-a/events", json={"events": events})  # sent again: a repeat
        assert response.status_code == 200 and response.json() == expected, response.text
    with service.context.sessions() as session:
        stored = list(session.scalars(select(JobEvent.data).where(JobEvent.job_id == job["id"]).order_by(JobEvent.seq)))
    assert stored == [
        {"pid": 7, "note": "key [redacted] on a10"},
        {"error": "denied for [redacted]", "more": {"deep": [["x [redacted]"]]}},
        # The service resumes from a committed checkpoint's path: kept as the job wrote it.
        {"path": f"/ckpt/{SECRET}/step-5", "verified": False, "note": "[redacted]"},
    ]
