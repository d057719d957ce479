"""Agents' event batches written as one group (service/ingest/batches.py): each batch still gets
its own answer, counts and errors, and a rejected batch stores nothing while the others of its
group are stored (SQLite and PostgreSQL)."""

import asyncio
import time

from sqlalchemy import func, select

from service.ingest.batches import EventBatchWriter
from service.models import JobAccountRow, JobEvent
from service.outcomes import Refused
from service.schemas.events import AgentEventIn
from service.security import Caller, find_token
from tests.service.factories import give_attempt, register_agent, submit
from tests.service.ingest.test_ingest_bad_events import good


def post_together(service, posts: list[tuple[str, Caller, list[dict]]]) -> list:
    """Hands the batches to a fresh writer at once, so that they are written as one group."""
    writer = EventBatchWriter(service.context.sessions, service.context.settings)

    async def run() -> list:
        task = asyncio.create_task(writer.run())
        try:
            stores = (writer.store(name, caller, [AgentEventIn.model_validate(e) for e in events])
                      for name, caller, events in posts)  # fmt: skip
            return await asyncio.gather(*stores, return_exceptions=True)
        finally:
            task.cancel()

    return asyncio.run(run())


def agent(service, name: str, job_id: str) -> Caller:
    secret = service.token("agent", name)
    register_agent(service.client(secret), name)
    give_attempt(service, job_id, name)
    with service.context.sessions() as session:
        token = find_token(session, secret)
        return Caller(token.id, token.role, token.subject)


def test_a_group_answers_each_batch_and_stores_only_the_good_ones(service):
    job = submit(service.client(service.token("user")), nodes=8)["id"]
    other = submit(service.client(service.token("user")), nodes=8)["id"]
    a, b = agent(service, "node-a", job), agent(service, "node-b", other)

    ts = time.time() - 60  # one time for all: a repeat must have the same content

    def events(job_id: str, *seqs: int, **change) -> list[dict]:
        return [good(s, ts=ts, **change) | {"job_id": job_id} for s in seqs]

    launched = {"kind": "workers_launched", "step": None, "data": {}, "source": "node:node-a"}

    answers = post_together(service, [
        ("node-a", a, events(job, 0, 1)),
        ("node-b", b, events(other, 0, 1, 2)),
        ("node-a", a, events(job, 1, 2)),  # seq 1 again: a repeat of the first batch's
        ("node-b", b, events(other, 3) + events(other, 4, **launched)),  # another node's source: 422
        ("node-b", b, events(job, 5)),  # an attempt not given to node-b: 403
        ("node-a", b, events(job, 6)),  # node-b's token for node-a: 403
    ])  # fmt: skip
    assert [(r.accepted, r.duplicates) for r in answers[:3]] == [(2, 0), (3, 0), (1, 1)]
    assert all(isinstance(r, Refused) for r in answers[3:])
    assert [r.status_code for r in answers[3:]] == [422, 403, 403]
    assert answers[3].detail[0]["field"] == "events.1.source"
    # A batch that ingestion refuses breaks its group's transaction: the others are written again.
    good_one, refused = post_together(service, [
        ("node-b", b, events(other, 7)),
        ("node-a", a, events(job, 8) + events(job, 2, step=99)),  # seq 2 with other content: 422
    ])  # fmt: skip
    assert (good_one.accepted, good_one.duplicates) == (1, 0)
    assert refused.status_code == 422 and refused.detail[0]["field"] == "events.1.seq"
    with service.context.sessions() as session:
        per_job = dict(session.execute(select(JobEvent.job_id, func.count()).group_by(JobEvent.job_id)).all())
        counted = dict(session.execute(select(JobAccountRow.job_id, JobAccountRow.events)).all())
    assert per_job == counted == {job: 3, other: 4}  # nothing of the refused batch (seq 8)
