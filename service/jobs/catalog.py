"""The jobs: a new one submitted, and those a caller may see (their owner's, or every job for an admin)."""

import logging
import shlex
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from urllib.parse import urlsplit

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from service.agents.nodes import fleet_capacity
from service.jobs.checkpoints import confined_checkpoint_dir
from service.jobs.owners import number_owner
from service.models import Job, JobState, Role, Token
from service.outcomes import Forbidden, Unprocessable
from service.settings import Settings
from service.spec.job_spec import JobSpec

log = logging.getLogger(__name__)


class EntrypointRefused(Forbidden):
    """A job's entrypoint that the operator's policy does not allow; the message names the rule."""


class SlurmOff(Unprocessable):
    """A job with a `slurm` section sent to a service that does not submit to Slurm."""

    def __init__(self, message: str) -> None:
        super().__init__("slurm", message)


def check_entrypoint(settings: Settings, entrypoint: list[str] | None, caller: Token) -> None:
    if entrypoint is None or settings.entrypoint_policy == "any":
        return
    if settings.entrypoint_policy == "admins":
        if caller.role != Role.admin:
            raise EntrypointRefused("entrypoint refused by ETT_ENTRYPOINT_POLICY=admins: only an admin may submit "
                                    "a job that runs its own program; submit a trainer job instead")
        return
    allowed = [shlex.split(line) for line in settings.allowed_entrypoints]
    if not any(entrypoint[: len(prefix)] == prefix for prefix in allowed if prefix):
        listed = "; ".join(settings.allowed_entrypoints) or "none listed"
        raise EntrypointRefused(f"entrypoint refused by ETT_ENTRYPOINT_POLICY=listed: {shlex.join(entrypoint)!r} "
                                f"starts as none of ETT_ALLOWED_ENTRYPOINTS ({listed})")


def check_webhooks(settings: Settings, spec: JobSpec) -> None:
    """A job's webhooks must be on the hosts the operator allows, when it names some."""
    if spec.notify is None or not settings.notify_hosts:
        return
    for index, url in enumerate(spec.notify.webhooks):
        host = urlsplit(url).hostname
        if host not in settings.notify_hosts:
            raise Unprocessable(f"notify.webhooks.{index}", f"{host} is not a host webhooks may be on "
                                f"(ETT_NOTIFY_HOSTS: {', '.join(settings.notify_hosts)})")


def create_job(session: Session, settings: Settings, spec: JobSpec, caller: Token) -> Job:
    """A new queued job of the caller (the spec already validated); the caller commits and wakes
    the scheduler. Raises EntrypointRefused, CheckpointDirRefused for a checkpoint folder
    outside the owner's area, or SlurmOff."""
    check_entrypoint(settings, spec.entrypoint, caller)
    check_webhooks(settings, spec)
    if spec.slurm is not None and not settings.slurm:
        raise SlurmOff("this service does not run jobs on Slurm (its operator sets ETT_SLURM=true); remove the "
                       "slurm section to run on the registered agents")
    owner = caller.subject
    if spec.checkpoint.dir is not None:
        confined = confined_checkpoint_dir(settings, owner, spec.checkpoint.dir)
        spec = spec.model_copy(update={"checkpoint": spec.checkpoint.model_copy(update={"dir": confined})})
    number_owner(session, owner)
    job = Job(id=uuid.uuid4().hex, name=spec.name, owner=owner, spec=spec)
    session.add(job)
    return job


def fleet_warnings(session: Session, settings: Settings, job: Job) -> list[str]:
    """What the submitter should know now: a job larger than the registered fleet is accepted, and
    waits until enough agents register. A Slurm job brings its own agents."""
    if job.spec.slurm is not None:
        return []
    nodes, slots = job.spec.nodes, job.spec.procs_per_node
    fresh = datetime.now(UTC) - timedelta(seconds=settings.heartbeat_timeout_seconds)
    registered, fitting = fleet_capacity(session, slots, fresh)
    if fitting >= nodes:
        return []
    warning = (f"the job needs {nodes} node{'s' if nodes > 1 else ''} with {slots} slot{'s' if slots > 1 else ''} "
               f"each and the fleet has {fitting} ({registered} agent{'s' if registered != 1 else ''} registered): "
               "it waits in the queue until enough agents register (ett agent)")
    log.warning("job %s: %s", job.id, warning)
    return [warning]


def visible_job(session: Session, job_id: str, caller: Token) -> Job | None:
    """The job, or None when it does not exist or is someone else's (the two look alike)."""
    job = session.get(Job, job_id)
    if job is None or (caller.role != Role.admin and job.owner != caller.subject):
        return None
    return job


def visible_jobs(
    session: Session, caller: Token, state: JobState | None, limit: int, offset: int
) -> tuple[Sequence[Job], int]:
    """A page of the caller's jobs, newest first, and how many there are in all."""
    query = select(Job)
    if caller.role != Role.admin:
        query = query.where(Job.owner == caller.subject)
    if state is not None:
        query = query.where(Job.state == state)
    total = session.scalar(select(func.count()).select_from(query.subquery())) or 0
    jobs = session.scalars(query.order_by(Job.submitted_at.desc(), Job.id).limit(limit).offset(offset)).all()
    return jobs, total
