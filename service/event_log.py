"""Reading a job's stored events back (service/ingest.py writes them).

Plain rows of the few columns needed, not `data`: a page over a job of 10^5 steps must not decode
10^5 JSON documents nor build 10^5 objects.
"""

from collections.abc import Sequence

from sqlalchemy import Row, select
from sqlalchemy.orm import Session

from service.ett.engine import TIMING_SOURCE
from service.models import JobEvent


def step_events(session: Session, job_id: str) -> Sequence[Row[tuple[int, int, float, float]]]:
    """(attempt, step, ts, duration) of each `step` event of rank 0, by attempt and step (the
    order of the index on job, kind, attempt, step: no sort)."""
    return session.execute(
        select(JobEvent.attempt, JobEvent.step, JobEvent.ts, JobEvent.duration)
        .where(JobEvent.job_id == job_id, JobEvent.kind == "step", JobEvent.source == TIMING_SOURCE)
        .order_by(JobEvent.attempt, JobEvent.step)
    ).all()
