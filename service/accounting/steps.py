"""A job's steps for people: rank 0's `step` events a page at a time (GET /api/v1/jobs/{id}/steps)
and summed into points for the job page's chart, with the nodes each attempt ran on.

A job may hold millions of steps: a page is read attempt by attempt along the partial index of
rank 0's steps (ix_events_rank0_steps), at most `limit` rows each, and the chart's points are
averaged per attempt and band of step numbers by the database. Rolled back is the engine's rule
(`AttemptSummary.rolled_back`, settled by `JobAccount.settle`), never a second one.
"""

from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from service.accounting.engine import JobAccount
from service.models import RANK0_STEPS, JobEvent

MAX_STEPS_PER_PAGE = 10_000


def attempt_nodes(session: Session, job_id: str, attempts: list[int]) -> dict[int, list[str]]:
    """The nodes each attempt's `attempt_allocated` named, read per attempt (the job's other events
    are not scanned)."""
    rows = session.execute(select(JobEvent.attempt, JobEvent.data).where(
        JobEvent.job_id == job_id, JobEvent.attempt.in_(attempts), JobEvent.source == "service",
        JobEvent.kind == "attempt_allocated"))  # fmt: skip
    return {attempt: list(data.get("nodes") or []) for attempt, data in rows}


def step_page(session: Session, job_id: str, account: JobAccount, since_step: int, limit: int) -> dict[str, Any]:
    """The steps numbered above `since_step`, lowest first (each number's attempts together, oldest
    first): `limit` rows, or a few more where the last number was stepped by several attempts, so a
    page never splits a step; `next_since_step` continues (None: nothing follows)."""
    rows: list[tuple[int, int, float, float | None, dict[str, Any]]] = []
    last, more = None, False  # the page's last step so far; whether a row above it was seen
    for attempt in sorted(account.attempts):
        mine = (JobEvent.job_id == job_id, JobEvent.attempt == attempt, RANK0_STEPS)
        upto = () if last is None else (JobEvent.step <= last,)  # a later attempt's rows above it are not read
        rows += session.execute(
            select(JobEvent.step, JobEvent.attempt, JobEvent.ts, JobEvent.duration, JobEvent.data)
            .where(*mine, JobEvent.step > since_step, *upto).order_by(JobEvent.step).limit(limit + 1)
        ).all()  # fmt: skip
        if last is not None and not more:
            more = session.scalar(select(JobEvent.step).where(*mine, JobEvent.step > last).limit(1)) is not None
        rows.sort(key=lambda row: (row[0], row[1]))
        if len(rows) > limit:
            last = rows[limit - 1][0]
            more = more or rows[-1][0] > last
            rows = [row for row in rows if row[0] <= last]
    names = attempt_nodes(session, job_id, sorted(account.attempts))
    summaries = account.attempts
    steps = [{"step": step, "attempt": attempt, "at": ts, "seconds": duration, "loss": data.get("loss"),
              "tokens": data.get("tokens"), "nodes": len(names.get(attempt, ())) or None,
              "rolled_back": summaries[attempt].rolled_back(step)}
             for step, attempt, ts, duration, data in rows]  # fmt: skip
    attempts = [{"attempt": n, "nodes": names.get(n, []), "full_nodes": a.full_nodes or a.nodes}
                for n, a in sorted(summaries.items())]  # fmt: skip
    return {"job_id": job_id, "steps": steps, "attempts": attempts, "next_since_step": last if more else None}


@dataclass(frozen=True)
class CurvePoint:
    """The mean of an attempt's steps in a band of step numbers [first_step, last_step]."""

    attempt: int
    first_step: int
    last_step: int
    seconds: float
    loss: float | None
    rolled_back: bool  # its first step was rolled back by a later attempt


def step_curve(session: Session, job_id: str, account: JobAccount, points: int = 300) -> list[CurvePoint]:
    """Each attempt's steps averaged in at most `points` bands of the job's step numbers."""
    steps = (JobEvent.job_id == job_id, RANK0_STEPS)
    lo, hi = session.execute(select(func.min(JobEvent.step), func.max(JobEvent.step)).where(*steps)).one()
    if lo is None:
        return []
    width = max(1, -(-(hi - lo + 1) // points))  # steps per band, rounded up
    band = (JobEvent.step - lo) // width if width > 1 else JobEvent.step
    rows = session.execute(
        select(JobEvent.attempt, func.min(JobEvent.step), func.max(JobEvent.step), func.avg(JobEvent.duration),
               func.avg(JobEvent.data["loss"].as_float()))
        .where(*steps).group_by(JobEvent.attempt, band).order_by(JobEvent.attempt, func.min(JobEvent.step))
    ).all()  # fmt: skip
    return [CurvePoint(attempt, first, last, float(seconds or 0.0), None if loss is None else float(loss),
                       attempt in account.attempts and account.attempts[attempt].rolled_back(first))
            for attempt, first, last, seconds, loss in rows]  # fmt: skip
