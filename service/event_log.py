"""Reading a job's stored events back, in order (service/ingest.py writes them).

Rows carry the columns the engine's timings need and not `data`: a page over a job of 10^5
steps reads plain tuples, without decoding 10^5 JSON documents.
"""

from collections.abc import Iterator
from typing import NamedTuple

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.models import JobEvent


class StoredEvent(NamedTuple):
    attempt: int
    source: str
    seq: int
    kind: str
    ts: float  # on the service's clock
    step: int | None
    duration: float | None  # data.duration of `step` events


def job_events(
    session: Session, job_id: str, *, kinds: tuple[str, ...] | None = None, source: str | None = None
) -> Iterator[StoredEvent]:
    """A job's events by attempt, then time, then emitter order; optionally of some kinds or one source."""
    query = select(
        JobEvent.attempt, JobEvent.source, JobEvent.seq, JobEvent.kind, JobEvent.ts, JobEvent.step, JobEvent.duration
    ).where(JobEvent.job_id == job_id)
    if kinds is not None:
        query = query.where(JobEvent.kind.in_(kinds))
    if source is not None:
        query = query.where(JobEvent.source == source)
    query = query.order_by(JobEvent.attempt, JobEvent.ts, JobEvent.source, JobEvent.seq)
    for row in session.execute(query.execution_options(yield_per=5000)):
        yield StoredEvent(*row)
