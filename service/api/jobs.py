"""Jobs: submit, list, get, cancel, and a job's notifications."""

import time

from fastapi import APIRouter, Query, status

from service.accounting.accounts import job_account, restored_steps
from service.api.deps import UserDep, VisibleJobDep
from service.api.routing import SessionRoute
from service.context import ContextDep, SessionDep
from service.jobs import scheduler
from service.webhooks import notifications
from service.jobs.catalog import create_job, fleet_warnings, visible_jobs
from service.models import Job, JobState
from service.schemas.jobs import AttemptOut, JobCreated, JobList, JobOut, JobSpec, SlurmOut
from service.schemas.notify import NotificationOut

router = APIRouter(prefix="/jobs", tags=["jobs"], route_class=SessionRoute)


def job_out(job: Job, restored: dict[int, int]) -> JobOut:
    """`restored`: the step each attempt restored (service.accounting.accounts.restored_steps)."""
    attempts = [
        AttemptOut(
            number=a.number, state=a.state, allocated_at=a.allocated_at, ended_at=a.ended_at, cause=a.cause,
            detail=a.detail, diagnosis=a.diagnosis, summary=a.summary, resume_from=a.resume_from,
            restored_step=restored.get(a.number), nodes=[n.node.name for n in a.nodes],
        )
        for a in job.attempts
    ]
    newest = job.slurm_allocations[-1] if job.slurm_allocations else None
    slurm = newest and SlurmOut(job_id=newest.slurm_job_id, allocation=newest.number, state=newest.slurm_state,
                                reason=newest.slurm_reason, nodes=newest.slurm_nodes)
    return JobOut(
        id=job.id, name=job.name, owner=job.owner, state=job.state, spec=job.spec,
        submitted_at=job.submitted_at, finished_at=job.finished_at, restarts=job.restarts, reason=job.reason,
        attempts=attempts, slurm=slurm,
    )


@router.post("", status_code=status.HTTP_201_CREATED)
def submit_job(spec: JobSpec, session: SessionDep, caller: UserDep, context: ContextDep) -> JobCreated:
    job = create_job(session, context.settings, spec, caller)  # a refusal: service/outcomes.py
    warnings = fleet_warnings(session, context.settings, job)
    session.commit()
    context.wake_scheduler()
    return JobCreated(**dict(job_out(job, {})), warnings=warnings)  # not dumped: that hides notify's secret


@router.get("")
def list_jobs(
    session: SessionDep,
    caller: UserDep,
    state: JobState | None = None,
    limit: int = Query(50, ge=1, le=500),
    offset: int = Query(0, ge=0, le=2**31),  # bounded: a huge offset overflows SQLite's integers
) -> JobList:
    jobs, total = visible_jobs(session, caller, state, limit, offset)
    restored = restored_steps(session, [j.id for j in jobs])
    return JobList(items=[job_out(j, restored.get(j.id, {})) for j in jobs], total=total)


@router.get("/{job_id}")
def get_job(job: VisibleJobDep, session: SessionDep) -> JobOut:
    return job_out(job, job_account(session, job.id).restored_steps())


@router.post("/{job_id}/cancel")
def cancel_job(job: VisibleJobDep, session: SessionDep) -> JobOut:
    scheduler.cancel_job(session, job, time.time())
    session.commit()
    return job_out(job, job_account(session, job.id).restored_steps())


@router.get("/{job_id}/notifications")
def job_notifications(job: VisibleJobDep, session: SessionDep) -> list[NotificationOut]:
    """What the job's events owed its webhooks (`notify` in its spec), and how each delivery went."""
    return [NotificationOut.model_validate(n, from_attributes=True) for n in notifications.of_job(session, job)]
