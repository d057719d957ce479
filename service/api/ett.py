"""ETT reports over HTTP: one job's (GET /jobs/{id}/ett) and the fleet's (GET /ett)."""

import time
from datetime import UTC, datetime
from typing import Annotated

from fastapi import APIRouter, HTTPException, Query, status
from sqlalchemy import select

from service.api.deps import UserDep, VisibleJobDep
from service.db import SessionDep
from service.ett.accounts import job_report
from service.ett.engine import JobAccount
from service.ett.fleet import FleetJob, fleet_report
from service.models import Job, JobAccountRow, Role
from service.schemas.events import EttReport, FleetReport

router = APIRouter(tags=["ett"])


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
