"""Event values no column holds (#48): a declared number is bounded (service/schemas/events.py), and
a declared field that is a secret of the job's `env` is dropped at ingest, its event refused when the
field is one it must have. Each is a 422 naming the event's field, and nothing of its batch is
stored: the agent sets that event aside and sends the rest again (agent/forwarding/delivery.py)."""

import json
import time

import pytest
from sqlalchemy import select

from service.models import JobEvent
from tests.service.factories import give_attempt, register_agent, submit

SECRET = "48151623"


@pytest.fixture
def posted(service):
    """Posts a batch of rank 0's events, raw (half a UTF-16 pair is no text httpx encodes)."""
    agent = service.client(service.token("agent", "node-a"))
    alice = service.client(service.token("user", "alice"))
    register_agent(agent, "node-a")
    job = submit(alice, nodes=8, env={"TOKEN_COUNT_KEY": SECRET})
    give_attempt(service, job["id"], "node-a")
    base = {"ts": time.time(), "attempt": 0, "source": "rank:0", "job_id": job["id"]}

    def post(*events: dict):
        body = {"events": [base | {"seq": i, "step": i + 1} | e for i, e in enumerate(events)]}
        return agent.post("/api/v1/agents/node-a/events", content=json.dumps(body),
                          headers={"content-type": "application/json"})
    post.job_id = job["id"]
    return post


def stored(service, job_id: str) -> list:
    with service.context.sessions() as session:
        return list(session.scalars(select(JobEvent.data).where(JobEvent.job_id == job_id).order_by(JobEvent.seq)))


@pytest.mark.parametrize(("data", "field", "says"), [
    ({"duration": 1e308}, "duration", "less than or equal to 1000000000"),
    ({"duration": 0.5, "tokens": 10**40}, "tokens", "less than or equal to 9007199254740992"),
    ({"duration": 0.5, "tokens": -1}, "tokens", "greater than or equal to 0"),
    ({"duration": -0.5}, "", "a number >= 0"),
])  # fmt: skip
def test_a_declared_number_past_its_bound_is_refused_naming_it_and_nothing_of_its_batch_stored(service, posted, data,
                                                                                                 field, says):
    good = {"kind": "step", "data": {"duration": 0.5, "tokens": 2**53, "loss": -3.5}}
    response = posted(good, {"kind": "step", "data": data})
    assert response.status_code == 422, response.text
    [error] = response.json()["detail"]
    assert error["field"] == f"events.1.data{'.' + field if field else ''}" and says in error["msg"], error
    assert stored(service, posted.job_id) == []
    assert posted(good).json() == {"accepted": 1, "duplicates": 0, "refused": 0}  # the rest, sent again


def test_timings_and_counts_of_other_kinds_are_bounded_too(service, posted):
    for data, field in [({"first_step": 1, "steps": 2, "duration": 2.0**70}, "duration"),
                        ({"first_step": 1, "steps": -5, "duration": 0.1}, "steps")]:
        response = posted({"kind": "step_timing", "step": None, "data": data})
        assert response.status_code == 422 and response.json()["detail"][0]["field"] == f"events.0.data.{field}"
    response = posted({"kind": "elastic", "step": None, "data": {"world_sizes": [10**40], "full_world_size": 16}})
    assert response.json()["detail"][0]["field"] == "events.0.data.world_sizes.0", response.text


def test_half_a_utf16_pair_is_stored_as_its_escape_not_an_error(service, posted):
    assert posted({"kind": "step", "data": {"duration": 0.5, "note": "\ud800"}}).status_code == 200
    assert stored(service, posted.job_id) == [{"duration": 0.5, "note": "\ud800"}]


def test_a_declared_number_that_is_a_secret_is_dropped_and_a_step_without_its_duration_refused(service, posted):
    """What an agent that restarted (and no longer knows the job's secrets) sends: the service drops
    the field (ett/protocol/redaction.py); a number that merely holds the secret's digits is kept."""
    response = posted({"kind": "step", "data": {"duration": 0.5, "tokens": int(SECRET)}},
                      {"kind": "step", "data": {"duration": 0.5, "tokens": int("1" + SECRET), "n": int(SECRET)}},
                      {"kind": "step", "data": {"duration": 0.5, "loss": float(SECRET)}})
    assert response.status_code == 200, response.text
    assert stored(service, posted.job_id) == [{"duration": 0.5}, {"duration": 0.5, "tokens": int("1" + SECRET),
                                                                  "n": "[redacted]"}, {"duration": 0.5}]
    response = posted({"kind": "step", "seq": 9, "data": {"duration": float(SECRET)}})
    assert response.status_code == 422, response.text
    assert response.json()["detail"][0]["field"] == "events.0.data.duration", response.text
