"""ETT reports over HTTP: one job's (GET /jobs/{id}/ett) and the fleet's (GET /ett)."""

import time
from datetime import UTC, datetime
from typing import Annotated

from fastapi import APIRouter, Query

from service.accounting.accounts import fleet_figures, job_report
from service.api.deps import UserDep, VisibleJobDep
from service.api.routing import SessionRoute
from service.context import SessionDep
from service.outcomes import Unprocessable
from service.schemas.events import EttReport, FleetReport

router = APIRouter(tags=["ett"], route_class=SessionRoute)


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
        raise Unprocessable("until", "until must be after since")
    return FleetReport.model_validate(fleet_figures(session, caller, now, lo, hi))
