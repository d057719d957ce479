"""What the timeline reads from the database: step time summed per drawing column, and the saves.

A job may have millions of step events; the drawing needs only how much of each column of each
lane was kept or rolled-back training. So the database sums rank 0's step durations by
(attempt, column of the step's end, kept or rolled back) and sends back a few thousand rows. A
step longer than a column comes back alone, with its own start, so it is drawn across the
columns it covers. Rolled back is the engine's rule: a step numbered above its attempt's
`rolled_back_to` (service/ett/engine.py, `JobAccount.settle`).
"""

from sqlalchemy import and_, case, false, func, select
from sqlalchemy.orm import Session

from service.ett.engine import TIMING_SOURCE, JobAccount
from service.models import Checkpoint, JobEvent
from service.pages.timeline import Frame, SaveSpan, StepTime


def step_time(session: Session, job_id: str, account: JobAccount, frame: Frame) -> StepTime:
    width = frame.column_seconds
    cuts = {n: a.rolled_back_to for n, a in account.attempts.items() if a.rolled_back_to is not None}
    wasted = JobEvent.step > case(cuts, value=JobEvent.attempt) if cuts else false()
    steps = and_(JobEvent.job_id == job_id, JobEvent.kind == "step", JobEvent.source == TIMING_SOURCE)
    column = func.floor((JobEvent.ts - frame.start) / width)
    short = session.execute(
        select(JobEvent.attempt, wasted, column, func.sum(JobEvent.duration))
        .where(steps, JobEvent.duration <= width)
        .group_by(JobEvent.attempt, wasted, column)
    ).all()
    long = session.execute(
        select(JobEvent.attempt, wasted, JobEvent.ts - JobEvent.duration, JobEvent.duration).where(
            steps, JobEvent.duration > width
        )
    ).all()
    rows = [(a, bool(w), frame.start + c * width, s) for a, w, c, s in short]
    return StepTime.from_rows(rows + [(a, bool(w), lo, d) for a, w, lo, d in long])


def checkpoint_saves(session: Session, job_id: str) -> list[SaveSpan]:
    """The blocking part (start to staged) of each of the job's saves."""
    rows = session.execute(
        select(Checkpoint.attempt, Checkpoint.started_at, Checkpoint.staged_at).where(
            Checkpoint.job_id == job_id, Checkpoint.started_at.is_not(None), Checkpoint.staged_at.is_not(None)
        )
    )
    return [SaveSpan(*row) for row in rows]
