"""A job past its bound on events (ETT_MAX_EVENTS_PER_RANK a rank, service/ingest/bound.py) is
stopped: its running attempt fails with cause `event_limit` and the bound for detail (its agents are
told to stop it), and the job fails with it for reason, not restarted: a restart would only send
more. Ingestion has already left its events past the bound out, so the database, and every other
job, never pays for it; this runs after ingestion's transaction, in one of its own."""

import time
from collections.abc import Callable, Collection

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from service.ingest.bound import bound_reason
from service.failures.failure_text import SUMMARY_CHARS, Diagnosis
from service.jobs.scheduler import fail_attempt, finish_job
from service.models import ACTIVE_ATTEMPT_STATES, Job, JobState
from service.settings import Settings

EVENT_LIMIT = "event_limit"  # the attempt's cause and diagnosis


def stop_over_bound(session: Session, job_ids: Collection[str], settings: Settings, now: float | None = None) -> None:
    """Stops those of these jobs still queued or running, and commits."""
    if not job_ids:
        return
    now = time.time() if now is None else now
    # Locked as the scheduler locks them (jobs first, in id order), before their attempts and events.
    query = select(Job).where(Job.id.in_(sorted(job_ids)), Job.state.in_((JobState.queued, JobState.running)))
    for job in session.scalars(query.order_by(Job.id).with_for_update()).all():
        reason = bound_reason(job.spec.world_size, settings)
        diagnosis = Diagnosis(EVENT_LIMIT, reason[:SUMMARY_CHARS])
        for attempt in job.attempts:
            if attempt.state in ACTIVE_ATTEMPT_STATES:
                fail_attempt(session, attempt, EVENT_LIMIT, reason, now, diagnosis=diagnosis)
        # Failed already when no restart was left (its reason then quotes this one): else failed here.
        if job.state in (JobState.queued, JobState.running):
            finish_job(session, job, JobState.failed, f"stopped: {reason}", now)
    session.commit()


def stopper(sessions: sessionmaker[Session], settings: Settings) -> Callable[[Collection[str]], None]:
    """stop_over_bound in a session of its own: the event batches' writer's `over_bound` (main.py)."""

    def stop(job_ids: Collection[str]) -> None:
        with sessions() as session:
            stop_over_bound(session, job_ids, settings)

    return stop
