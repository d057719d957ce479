"""What the timeline reads from the database: step time summed per drawing column, and the saves.

A job may have millions of step events; the drawing needs only how much of each column of each
lane was kept or rolled-back training. So the database sums rank 0's step durations by
(attempt, column of the step's end, kept or rolled back) and sends back a few thousand rows. A
step longer than a column comes back alone, with its own start, so it is drawn across the
columns it covers. Rolled back is the engine's rule: a step numbered above its attempt's
`rolled_back_to` (service/accounting/engine.py, `JobAccount.settle`).
"""

from sqlalchemy import and_, case, func, select
from sqlalchemy.orm import Session

from service.accounting.engine import TIMING_SOURCE, JobAccount
from service.models import Checkpoint, JobEvent
from service.pages.timeline import Frame, SaveSpan, StepTime


def step_time(session: Session, job_id: str, account: JobAccount, frame: Frame) -> StepTime:
    width = frame.column_seconds
    cuts = {n: a.rolled_back_to for n, a in account.attempts.items() if a.rolled_back_to is not None}
    # Without a rollback there is no `wasted` column at all: a constant in GROUP BY is read by
    # SQLite as a column position (`2nd GROUP BY term out of range`).
    wasted = JobEvent.step > case(cuts, value=JobEvent.attempt) if cuts else None
    kept = [wasted] if wasted is not None else []
    steps = and_(JobEvent.job_id == job_id, JobEvent.kind == "step", JobEvent.source == TIMING_SOURCE)
    column = func.floor((JobEvent.ts - frame.start) / width)
    short = session.execute(
        select(JobEvent.attempt, column, func.sum(JobEvent.duration), *kept)
        .where(steps, JobEvent.duration <= width)
        .group_by(JobEvent.attempt, column, *kept)
    ).all()
    long = session.execute(
        select(JobEvent.attempt, JobEvent.ts - JobEvent.duration, JobEvent.duration, *kept).where(
            steps, JobEvent.duration > width
        )
    ).all()
    rows = [(a, any(w), frame.start + c * width, s) for a, c, s, *w in short]
    return StepTime.from_rows(rows + [(a, any(w), lo, d) for a, lo, d, *w in long])


def checkpoint_saves(session: Session, job_id: str) -> list[SaveSpan]:
    """The blocking part (start to staged) of each of the job's saves."""
    rows = session.execute(
        select(Checkpoint.attempt, Checkpoint.started_at, Checkpoint.staged_at).where(
            Checkpoint.job_id == job_id, Checkpoint.started_at.is_not(None), Checkpoint.staged_at.is_not(None)
        )
    )
    return [SaveSpan(*row) for row in rows]
