"""The checkpoint decisions of a launch: which checkpoint to resume from, how often to save."""

import time

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.ett.accounts import job_account, job_report
from service.models import Checkpoint, Job

# Used for `interval_steps: "auto"` until the job has measured what a step and a save cost.
DEFAULT_INTERVAL_STEPS = 50


def newest_checkpoint(session: Session, job_id: str) -> str | None:
    """The newest committed checkpoint in the catalog (the trainer still verifies it, and falls
    back to an older one in the same folder if it does not verify)."""
    return session.scalar(
        select(Checkpoint.path)
        .where(Checkpoint.job_id == job_id, Checkpoint.committed_at.is_not(None), Checkpoint.path.is_not(None))
        .order_by(Checkpoint.step.desc(), Checkpoint.committed_at.desc())
        .limit(1)
    )


def checkpoint_interval_steps(session: Session, job: Job) -> int:
    """The job's interval, or for "auto" the ETT report's recommended interval (Young) in steps."""
    interval = job.spec["checkpoint"]["interval_steps"]
    if interval != "auto":
        return int(interval)
    account = job_account(session, job.id)
    steps = sum(a.steps for a in account.attempts.values())
    step_seconds = sum(a.step_seconds for a in account.attempts.values())
    recommended = job_report(session, job, time.time())["recommended_checkpoint_interval_seconds"]
    if not steps or not step_seconds or recommended is None:
        return DEFAULT_INTERVAL_STEPS
    return max(1, round(recommended / (step_seconds / steps)))
