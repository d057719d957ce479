"""A job's steps (GET /jobs/{id}/steps): each step of rank 0, a page at a time."""

from typing import Annotated

from fastapi import APIRouter, Query

from service.accounting.accounts import job_account
from service.accounting.steps import MAX_STEPS_PER_PAGE, step_page
from service.api.deps import VisibleJobDep
from service.api.routing import SessionRoute
from service.context import SessionDep
from service.schemas.steps import StepPageOut

router = APIRouter(tags=["ett"], route_class=SessionRoute)


@router.get("/jobs/{job_id}/steps")
def job_steps(
    job: VisibleJobDep,
    session: SessionDep,
    since_step: Annotated[int, Query(ge=-1, description="only steps numbered above it (a `next_since_step`)")] = -1,
    limit: Annotated[int, Query(ge=1, le=MAX_STEPS_PER_PAGE, description="rows per page")] = 1000,
) -> StepPageOut:
    """Rank 0's steps numbered above `since_step`, lowest first, each number's attempts together: at
    most `limit` rows (10,000; a few more where several attempts stepped the last number, so a page
    never splits a step), with the nodes each attempt ran on and its rolled-back steps marked."""
    return StepPageOut.model_validate(step_page(session, job.id, job_account(session, job.id), since_step, limit))
