"""The checkpoint decisions of a job: where its checkpoints go (confined to its owner's area),
which one a launch resumes from, how often to save."""

import hashlib
import os
import re
import time
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session

from ett.paths import inside
from service.accounting.accounts import job_account, job_report
from service.accounting.engine import JobAccount
from service.accounting.report import young_interval
from service.models import Checkpoint, Job
from service.outcomes import Unprocessable
from service.settings import Settings

# Used for `interval_steps: "auto"` until the job has measured what a step and a save cost.
DEFAULT_INTERVAL_STEPS = 50


SAFE_FOLDER_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,63}$")


class CheckpointDirRefused(Unprocessable):
    """A job's `checkpoint.dir` outside its owner's area; the message says where it resolved."""

    def __init__(self, message: str) -> None:
        super().__init__("checkpoint.dir", message)


def owner_area(settings: Settings, owner: str) -> Path:
    """The folder under which an owner's jobs checkpoint. A name unfit for a folder (a slash,
    dots, over 64 characters) gets a folder named by its digest instead."""
    name = owner if SAFE_FOLDER_NAME.match(owner) else "owner-" + hashlib.sha256(owner.encode()).hexdigest()[:16]
    return settings.resolved_checkpoint_root / name


def confined_checkpoint_dir(settings: Settings, owner: str, requested: str) -> str:
    """The folder a job names, resolved (normalised, links followed as they are now), if it lies
    inside the owner's area; the agent resolves it again at each launch."""
    area = owner_area(settings, owner)
    if not inside(Path(requested), area):
        raise CheckpointDirRefused(f"{requested} resolves to {os.path.realpath(requested)}, outside {area}, the "
                                   f"checkpoint area of {owner}: name a folder inside it, or none (default: "
                                   f"{area}/<job id>)")  # fmt: skip
    return os.path.realpath(requested)


def job_checkpoint_dir(settings: Settings, job: Job) -> str:
    return job.spec.checkpoint.dir or str(owner_area(settings, job.owner) / job.id)


def newest_checkpoint(session: Session, job_id: str) -> str | None:
    """The newest committed checkpoint in the catalog (the trainer still verifies it, and falls
    back to an older one in the same folder if it does not verify)."""
    return session.scalar(
        select(Checkpoint.path)
        .where(Checkpoint.job_id == job_id, Checkpoint.committed_at.is_not(None), Checkpoint.path.is_not(None))
        .order_by(Checkpoint.step.desc(), Checkpoint.committed_at.desc())
        .limit(1)
    )


def checkpoint_interval_steps(session: Session, job: Job, settings: Settings) -> int:
    """The job's interval, or for "auto" Young's interval (sqrt(2 x save blocking x MTBF)) in
    steps, from this job's measured costs and failure rate (else the fleet's, else the assumed
    MTBF); DEFAULT_INTERVAL_STEPS until a save and a step have been measured."""
    interval = job.spec.checkpoint.interval_steps
    if interval != "auto":
        return int(interval)
    step_seconds = mean_step_seconds(job_account(session, job.id))
    report = job_report(session, job, time.time())
    recommended = report["recommended_checkpoint_interval_seconds"]
    if recommended is None:
        recommended = young_interval(report["checkpoints"]["mean_blocking_seconds"], settings.assumed_mtbf_seconds)
    if step_seconds is None or recommended is None:
        return DEFAULT_INTERVAL_STEPS
    return steps_in(recommended, step_seconds)


def mean_step_seconds(account: JobAccount) -> float | None:
    """The job's mean step time, over every step of every attempt; None before one took time."""
    steps = sum(a.steps for a in account.attempts.values())
    seconds = sum(a.step_seconds for a in account.attempts.values())
    return seconds / steps if steps and seconds else None


def steps_in(seconds: float, step_seconds: float) -> int:
    """An interval of `seconds` in whole steps of `step_seconds` (at least one)."""
    return max(1, round(seconds / step_seconds))
