"""Each event kind's `data` typed once (ett/protocol/event_fields.py): the service refuses a known
field of the wrong type with a 422 naming it, and keeps a field no type declares as it was sent
(SQLite and PostgreSQL)."""

import time

from sqlalchemy import select

from agent.groups.rank_records import exit_record
from ett.protocol import EVENT_KINDS
from ett.protocol.event_fields import EVENT_FIELDS, FIELD_NAMES, WorkerExitedData
from service.models import JobEvent
from tests.service.factories import submit


def event(kind: str, seq: int, data: dict, source: str = "rank:0", step: int | None = 1) -> dict:
    return {"kind": kind, "ts": time.time() - 60, "attempt": 0, "source": source, "seq": seq, "step": step,
            "data": data}  # fmt: skip


def step(seq: int, **data) -> dict:
    return event("step", seq, {"duration": 0.5, "tokens": 1024, "loss": 2.5} | data, step=seq + 1)


# (case, the bad event, the field its 422 names)
WRONG_TYPES = [
    ("tokens-a-string", step(1, tokens="1024"), "events.1.data.tokens"),
    ("tokens-a-float", step(1, tokens=1024.0), "events.1.data.tokens"),
    ("loss-a-bool-list", step(1, loss=[True]), "events.1.data.loss"),
    ("pid-a-bool", event("init_start", 1, {"pid": True}, step=None), "events.1.data.pid"),
    ("bytes-a-string", event("ckpt_committed", 1, {"path": "/c/step-1", "bytes": "4096"}), "events.1.data.bytes"),
    ("argv-not-strings", event("workers_launched", 1, {"argv": ["python", 3]}, "node:n1", None),
     "events.1.data.argv.1"),
    ("signal-a-number", event("worker_exited", 1, {"rank": 1, "signal": 9}, "node:n1", None), "events.1.data.signal"),
    ("nodes-a-string", event("attempt_allocated", 1, {"nodes": "n1"}, "service", None), "events.1.data.nodes"),
    ("interval-a-string", event("checkpoint_interval", 1, {"interval_steps": "50"}, "service", None),
     "events.1.data.interval_steps"),
]  # fmt: skip


def test_every_kind_has_its_type_and_the_agent_takes_its_fields_from_it():
    assert set(EVENT_FIELDS) == EVENT_KINDS
    assert all(names == set(EVENT_FIELDS[kind].__annotations__) for kind, names in FIELD_NAMES.items())
    # The agent passes on a runner's exit record as its type has it: declared fields alone, and
    # `oom` only ever the agent's own (the kernel's word).
    line = {"rank": 1, "exit_code": 3, "signal": "SIGKILL", "fault": "exit", "error": "x", "oom": "forged", "pid": 7}
    assert set(exit_record(line)) == set(WorkerExitedData.__annotations__) - {"oom"}
    assert exit_record({"rank": 1, "signal": "sierra-s3cr3t-S9"}) == {"rank": 1}  # no signal's name: no signal
    assert exit_record({"rank": 1, "exit_code": True, "signal": ["SIGKILL"], "error": "e" * 10_000}) == {
        "rank": 1, "error": "e" * 512}


def test_a_known_field_of_the_wrong_type_is_refused_naming_it(service):
    admin = service.client(service.token("admin"))
    job = submit(service.client(service.token("user")), nodes=8)
    for case, bad, field in WRONG_TYPES:
        response = admin.post(f"/api/v1/jobs/{job['id']}/events", json={"events": [step(0), bad]})
        assert response.status_code == 422, (case, response.text)
        problems = response.json()["detail"]
        assert [p["field"] for p in problems] == [field], (case, problems)
        assert "\n" not in problems[0]["msg"] and "Input should be" in problems[0]["msg"], (case, problems)
    with service.context.sessions() as session:
        assert session.scalars(select(JobEvent).where(JobEvent.job_id == job["id"])).all() == []


def test_an_unknown_field_is_kept_as_it_was_sent(service):
    admin = service.client(service.token("admin"))
    job = submit(service.client(service.token("user")), nodes=8)
    events = [
        step(0, lr=3e-4, extra={"nested": [1, "two"]}),
        event("ckpt_committed", 1, {"path": "/c/step-1", "bytes": 4096, "verified": True, "shards": 8}),
        event("worker_exited", 2, {"rank": 1, "exit_code": 0, "runner": "warm"}, "node:n1", None),
        event("attempt_allocated", 3, {"nodes": ["n1"], "node_count": 1, "gpus": 8}, "service", None),
    ]
    response = admin.post(f"/api/v1/jobs/{job['id']}/events", json={"events": events})
    assert response.status_code == 200, response.text
    with service.context.sessions() as session:
        stored = {row.kind: row.data for row in session.scalars(select(JobEvent).where(JobEvent.job_id == job["id"]))}
    assert stored == {e["kind"]: e["data"] for e in events}
