"""ETT reports: one job's (GET /jobs/{id}/ett) and the fleet's (GET /ett), read from the
accounting rows that ingestion keeps up to date: O(attempts) per job, whatever its step count."""

import time
from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Query, status
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from service.api.deps import UserDep, VisibleJobDep
from service.db import SessionDep
from service.ett.engine import JobAccount
from service.ett.fleet import FleetJob, fleet_report
from service.ett.report import build_report
from service.models import Job, JobAccountRow, Role
from service.schemas.events import EttReport, FleetReport

router = APIRouter(tags=["ett"])


def fleet_mtbf_seconds(session: Session, now: float) -> float | None:
    """All jobs' accounted wall time over all their failures (for jobs without a failure)."""
    wall, failures = session.execute(
        select(
            func.sum(func.coalesce(JobAccountRow.finished_at, now) - JobAccountRow.window_start),
            func.sum(JobAccountRow.failures),
        ).where(JobAccountRow.window_start.is_not(None))
    ).one()
    return float(wall) / failures if failures else None


def job_report(session: Session, job: Job, now: float, fleet_mtbf: float | None = None) -> dict[str, Any]:
    row = session.get(JobAccountRow, job.id)
    account = JobAccount.from_dict(row.account) if row is not None else JobAccount()
    if fleet_mtbf is None and not (row is not None and row.failures):
        fleet_mtbf = fleet_mtbf_seconds(session, now)
    return build_report(
        account, job_id=job.id, state=job.state.value, now=now,
        submitted_at=job.submitted_at.timestamp(), fleet_mtbf_seconds=fleet_mtbf,
    )  # fmt: skip


@router.get("/jobs/{job_id}/ett")
def get_job_ett(job: VisibleJobDep, session: SessionDep) -> EttReport:
    return EttReport.model_validate(job_report(session, job, time.time()))


def _unix(t: datetime | None) -> float | None:
    if t is None:
        return None
    return (t if t.tzinfo else t.replace(tzinfo=UTC)).timestamp()


@router.get("/ett")
def get_fleet_ett(
    session: SessionDep,
    caller: UserDep,
    since: Annotated[
        datetime | None, Query(description="window start: ISO 8601 (UTC if no zone) or unix seconds")
    ] = None,
    until: Annotated[datetime | None, Query(description="window end (default: now)")] = None,
) -> FleetReport:
    """The figures of all jobs (a user's own, for a user) over [since, until], and per job name."""
    now = time.time()
    lo, hi = _unix(since), _unix(until)
    if lo is not None and hi is not None and hi <= lo:
        detail = [{"field": "until", "msg": "until must be after since", "type": "value_error"}]
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, detail)
    query = select(Job.name, JobAccountRow.account).join(JobAccountRow, JobAccountRow.job_id == Job.id)
    query = query.where(JobAccountRow.window_start.is_not(None))
    if hi is not None:
        query = query.where(JobAccountRow.window_start < hi)
    if lo is not None:
        query = query.where((JobAccountRow.finished_at.is_(None)) | (JobAccountRow.finished_at > lo))
    if caller.role != Role.admin:
        query = query.where(Job.owner == caller.subject)
    jobs = [FleetJob(name, JobAccount.from_dict(account)) for name, account in session.execute(query)]
    return FleetReport.model_validate(fleet_report(jobs, now=now, since=lo, until=hi))
