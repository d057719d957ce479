"""Event ingestion's two doors: the agents' batches and the admin's replay of a timeline."""

from fastapi import APIRouter, HTTPException, Request, status
from sqlalchemy.orm import Session

from service.api.deps import AdminDep, AgentCallerDep
from service.db import SessionDep
from service.ingest.batches import EventBatchWriter, unprocessable
from service.ingest.store import EventRejected, ingest
from service.models import Job
from service.schemas.events import AgentEventBatch, EventBatch, EventIn, IngestOut
from service.settings import Settings

router = APIRouter(tags=["events"])


def _store(session: Session, batch: list[tuple[str, EventIn]], settings: Settings) -> IngestOut:
    try:
        result = ingest(session, batch, settings=settings)
        session.commit()
    except EventRejected as rejected:
        session.rollback()  # nothing of the batch is kept
        raise unprocessable(rejected) from None
    return IngestOut(accepted=result.accepted, duplicates=result.duplicates)


@router.post("/agents/{name}/events")
async def agent_events(body: AgentEventBatch, name: str, caller: AgentCallerDep, request: Request) -> IngestOut:
    """An agent's batch: its ranks' and its own events, each naming its job. Their times are
    moved onto the service's clock by the node's offset measured at heartbeat, recorded per event.
    Stored with the other batches that arrive meanwhile (service/ingest/batches.py)."""
    writer: EventBatchWriter = request.app.state.event_batches
    return await writer.store(name, caller, body.events)


@router.post("/jobs/{job_id}/events")
def replay_events(job_id: str, body: EventBatch, session: SessionDep, _caller: AdminDep, request: Request) -> IngestOut:
    """An admin's replay of (part of) a job's timeline, on the service's clock as given."""
    if session.get(Job, job_id) is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no job {job_id}")
    return _store(session, [(job_id, e) for e in body.events], request.app.state.settings)
