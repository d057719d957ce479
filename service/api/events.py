"""Event ingestion's two doors: the agents' batches and the admin's replay of a timeline."""

from fastapi import APIRouter, HTTPException, Request, status
from fastapi.concurrency import run_in_threadpool
from sqlalchemy import select, tuple_
from sqlalchemy.orm import Session

from service.api.deps import AdminDep, AgentCallerDep, own_node
from service.db import SessionDep, retry_on_disconnect
from service.ingest import EventRejected, ingest
from service.models import Attempt, AttemptNode, Job, Node
from service.schemas.events import AgentEventBatch, AgentEventIn, EventBatch, EventIn, IngestOut
from service.settings import Settings

router = APIRouter(tags=["events"])


def _store(
    session: Session, batch: list[tuple[str, EventIn]], settings: Settings, clock_offset: float = 0.0
) -> IngestOut:
    try:
        result = ingest(session, batch, clock_offset=clock_offset, settings=settings)
        session.commit()
    except EventRejected as rejected:
        session.rollback()  # nothing of the batch is kept
        detail = [{"field": rejected.field, "msg": rejected.msg, "type": "value_error"}]
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, detail) from None
    return IngestOut(accepted=result.accepted, duplicates=result.duplicates)


def _first_not_given(session: Session, node: Node, events: list[AgentEventIn]) -> int | None:
    """Index of the first event of an attempt the scheduler did not give this node (None: none).
    Events of unknown jobs are left to ingestion, which refuses them with 422 naming the field."""
    asked = list({(e.job_id, e.attempt) for e in events})
    known = set(session.scalars(select(Job.id).where(Job.id.in_({job for job, _ in asked}))))
    given = {tuple(row) for row in session.execute(
        select(Attempt.job_id, Attempt.number).join(AttemptNode)
        .where(AttemptNode.node_id == node.id, tuple_(Attempt.job_id, Attempt.number).in_(asked))
    )}  # fmt: skip
    return next((i for i, e in enumerate(events) if e.job_id in known and (e.job_id, e.attempt) not in given), None)


@router.post("/agents/{name}/events")
async def agent_events(body: AgentEventBatch, name: str, caller: AgentCallerDep, request: Request) -> IngestOut:
    """An agent's batch: its ranks' and its own events, each naming its job. Their times are
    moved onto the service's clock by the node's offset measured at heartbeat, recorded per event."""

    def store() -> IngestOut:
        # The whole request on one worker thread and one connection (no hop between checks).
        with request.app.state.sessions() as session:
            node, _ = own_node(session, name, caller)
            return _store_from(session, node, body, request.app.state.settings)

    return await run_in_threadpool(retry_on_disconnect, store)


def _store_from(session: Session, node: Node, body: AgentEventBatch, settings: Settings) -> IngestOut:
    for i, e in enumerate(body.events):
        if not (e.source.startswith("rank:") or e.source == f"node:{node.name}"):
            detail = [{"field": f"events.{i}.source", "msg": f"agent {node.name} may send only its ranks' "
                       f"events and node:{node.name}'s, not {e.source}'s", "type": "value_error"}]  # fmt: skip
            raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, detail)
    stranger = _first_not_given(session, node, body.events)
    if stranger is not None:
        e = body.events[stranger]
        raise HTTPException(status.HTTP_403_FORBIDDEN, f"events.{stranger}: attempt {e.attempt} of job {e.job_id} "
                            f"was not given to agent {node.name}; it may report only its own attempts")  # fmt: skip
    batch = [(e.job_id, e) for e in body.events]
    return _store(session, batch, settings, node.clock_offset_seconds)


@router.post("/jobs/{job_id}/events")
def replay_events(job_id: str, body: EventBatch, session: SessionDep, _caller: AdminDep, request: Request) -> IngestOut:
    """An admin's replay of (part of) a job's timeline, on the service's clock as given."""
    if session.get(Job, job_id) is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no job {job_id}")
    return _store(session, [(job_id, e) for e in body.events], request.app.state.settings)
