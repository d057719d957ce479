"""Events the service itself emits (allocation, failure, stop, finish), stored like any other."""

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from ett.events import make_event
from service.ingest.store import ingest_trusted
from service.webhooks import notifications
from service.models import Attempt


def emit(session: Session, job_id: str, attempt: int, kind: str, ts: float, data: dict[str, Any]) -> None:
    """Records one `service` event through the same ingestion code as the agents' events, and the
    notification it owes the job's webhooks, if any."""
    row = session.scalar(select(Attempt).where(Attempt.job_id == job_id, Attempt.number == attempt))
    row.service_seq += 1
    ingest_trusted(session, job_id, [make_event(kind, ts, attempt, "service", row.service_seq, None, data)])
    notifications.on_service_event(session, job_id, attempt, kind, data, ts)
