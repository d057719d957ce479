"""Event ingestion's two doors: the agents' batches and the admin's replay of a timeline."""

from fastapi import APIRouter
from sqlalchemy.orm import Session

from service.api.deps import AdminDep, AgentCallerDep
from service.api.routing import SessionRoute
from service.context import ContextDep, SessionDep
from service.ingest.batches import unprocessable
from service.ingest.store import EventRejected, ingest
from service.jobs.event_limit import stop_over_bound
from service.models import Job
from service.outcomes import NotFound
from service.schemas.events import AgentEventBatch, EventBatch, EventIn, IngestOut
from service.settings import Settings

router = APIRouter(tags=["events"], route_class=SessionRoute)


def _store(session: Session, batch: list[tuple[str, EventIn]], settings: Settings) -> IngestOut:
    try:
        result = ingest(session, batch, settings=settings)
        session.commit()
    except EventRejected as rejected:
        session.rollback()  # nothing of the batch is kept
        raise unprocessable(rejected) from None
    stop_over_bound(session, result.over_bound, settings)  # an admin's replay is bounded as an agent's batch
    return IngestOut(accepted=result.accepted, duplicates=result.duplicates, refused=len(result.refused))


@router.post("/agents/{name}/events")
async def agent_events(body: AgentEventBatch, name: str, caller: AgentCallerDep, context: ContextDep) -> IngestOut:
    """An agent's batch: its ranks' and its own events, each naming its job. Their times are
    moved onto the service's clock by the node's offset measured at heartbeat, recorded per event.
    Stored with the other batches that arrive meanwhile (service/ingest/batches.py)."""
    return await context.event_batches.store(name, caller, body.events)


@router.post("/jobs/{job_id}/events")
def replay_events(job_id: str, body: EventBatch, session: SessionDep, _caller: AdminDep, context: ContextDep) -> IngestOut:
    """An admin's replay of (part of) a job's timeline, on the service's clock as given."""
    if session.get(Job, job_id) is None:
        raise NotFound(f"no job {job_id}")
    return _store(session, [(job_id, e) for e in body.events], context.settings)
