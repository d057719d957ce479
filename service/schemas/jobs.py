"""The job views the API returns (the spec itself: service/spec/job_spec.py)."""

from datetime import datetime

from pydantic import BaseModel

from service.models import AttemptState, JobState
from service.spec.job_spec import JobSpec


class AttemptOut(BaseModel):
    number: int
    state: AttemptState
    allocated_at: datetime
    ended_at: datetime | None
    cause: str | None
    detail: str | None
    # Why it failed, from the evidence (docs/reliability.md, "Failure diagnosis"): `exception` and
    # `ValueError: bad batch`, say. None while it has not failed.
    diagnosis: str | None = None
    summary: str | None = None
    resume_from: str | None  # the newest committed checkpoint when the attempt was scheduled
    # The step its ranks went on from: a local snapshot newer than resume_from when every rank
    # held one. None until they have restored (and for an attempt that started from scratch).
    restored_step: int | None = None
    nodes: list[str]


class SlurmOut(BaseModel):
    """The job's Slurm allocation: the newest one (a lost node or allocation gets a new one)."""

    job_id: str
    allocation: int  # 0 for the first, 1 for its replacement, ...
    state: str  # what Slurm last said: PENDING, RUNNING, TIMEOUT, ...
    reason: str | None
    nodes: list[str]


class JobOut(BaseModel):
    id: str
    name: str
    owner: str
    state: JobState
    spec: JobSpec
    submitted_at: datetime
    finished_at: datetime | None
    restarts: int
    reason: str | None
    attempts: list[AttemptOut]
    slurm: SlurmOut | None = None


class JobCreated(JobOut):
    """The answer to a submit: the job, and what its submitter should know now."""

    warnings: list[str] = []


class JobList(BaseModel):
    items: list[JobOut]
    total: int
