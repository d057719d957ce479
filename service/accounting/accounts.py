"""ETT reports read from the accounting rows that ingestion keeps up to date: O(attempts) per
job, whatever its step count. The API, the pages, the metrics and the scheduler all read them here."""

from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from service.accounting.engine import JobAccount
from service.accounting.fleet import FleetJob, fleet_report
from service.accounting.report import build_report
from service.models import Job, JobAccountRow, Role, StragglerFlag, Token

STRAGGLER_FIELDS = ("attempt", "rank", "node", "since_step", "flagged_step", "relative", "individual", "work_seconds",
                    "peer_seconds", "action", "reason", "follows_rank")  # fmt: skip


def job_account(session: Session, job_id: str) -> JobAccount:
    row = session.get(JobAccountRow, job_id)
    return JobAccount.from_dict(row.account) if row is not None else JobAccount()


def restored_steps(session: Session, job_ids: list[str]) -> dict[str, dict[int, int]]:
    """JobAccount.restored_steps of each job, in one query (a page of the jobs list)."""
    if not job_ids:
        return {}
    rows = session.scalars(select(JobAccountRow).where(JobAccountRow.job_id.in_(job_ids)))
    return {row.job_id: JobAccount.from_dict(row.account).restored_steps() for row in rows}


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
    if fleet_mtbf is None and not (row is not None and row.failures):  # Young's formula takes the fleet's
        fleet_mtbf = fleet_mtbf_seconds(session, now)
    report = build_report(
        account, job_id=job.id, state=job.state.value, now=now,
        submitted_at=job.submitted_at.timestamp(), fleet_mtbf_seconds=fleet_mtbf,
        ended_at=job.finished_at.timestamp() if job.finished_at else None,
    )  # fmt: skip
    flags = session.scalars(select(StragglerFlag).where(StragglerFlag.job_id == job.id)
                            .order_by(StragglerFlag.attempt, StragglerFlag.rank))
    report["stragglers"] = [{field: getattr(f, field) for field in STRAGGLER_FIELDS} for f in flags]
    report["slowdowns"] = with_causes(report["slowdowns"], {f["attempt"] for f in report["stragglers"]})
    return report


def with_causes(slowdowns: list[dict[str, Any]], straggling: set[int]) -> list[dict[str, Any]]:
    """Each lasting slowdown told apart (docs/ett.md, "Slow time"): a straggler's where its attempt
    flagged a rank its peers waited for, else the whole job's (every rank slower alike)."""
    return [s | {"cause": "straggler" if s["attempt"] in straggling else "whole_job"} for s in slowdowns]


def fleet_figures(session: Session, caller: Token, now: float, since: float | None, until: float | None
                  ) -> dict[str, Any]:
    """The fleet report over [since, until] of the jobs the caller may see (a user's own, all for an admin)."""
    query = select(Job.id, Job.name, JobAccountRow.account).join(JobAccountRow, JobAccountRow.job_id == Job.id)
    query = query.where(JobAccountRow.window_start.is_not(None))
    if until is not None:
        query = query.where(JobAccountRow.window_start < until)
    if since is not None:
        query = query.where((JobAccountRow.finished_at.is_(None)) | (JobAccountRow.finished_at > since))
    if caller.role != Role.admin:
        query = query.where(Job.owner == caller.subject)
    jobs = [FleetJob(name, JobAccount.from_dict(account), job_id) for job_id, name, account in session.execute(query)]
    return fleet_report(jobs, now=now, since=since, until=until)
