"""When a job's next attempt may start (the scheduler's allocation asks, service/jobs/scheduler.py)."""

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.jobs.peer_loss import suspects
from service.models import ACTIVE_ATTEMPT_STATES as ACTIVE
from service.models import Attempt, Checkpoint, Job, JobState, Node, NodeState
from service.settings import Settings


def needs_attempt(session: Session, job: Job, settings: Settings, now: float) -> bool:
    """Whether the job wants its next attempt now: queued, or its last attempt over, its backoff
    past and every share of it stopped. As it says yes, the spare held for its replacement is
    handed over (service/stragglers/spares.py): idle for the allocation that asked, which serves
    restarts before queued jobs."""
    ready = _ready(session, job, settings, now)
    if ready and job.attempts and job.attempts[-1].cause == "straggler":
        for spare in session.scalars(select(Node).where(Node.state == NodeState.reserved, Node.reserved_for == job.id)):
            spare.state, spare.reserved_for = NodeState.idle, None
    return ready


def _ready(session: Session, job: Job, settings: Settings, now: float) -> bool:
    if job.state == JobState.queued:
        return True
    if job.state != JobState.running or not job.attempts:
        return False
    last = job.attempts[-1]
    if last.state in ACTIVE or last.ended_at is None:
        return False
    # Wait for the survivors to stop, so they can be reused and hold no stale ranks; not for the nodes
    # a survivor lost its connection to and that say nothing since: spares take their places (peer_loss.py).
    stopped = all(s.state not in ACTIVE for s in last.nodes)
    lost_to_peers = not stopped and bool(suspects(last, settings, now))
    # A lost node is no crash loop of the job's: the next attempt runs without it, at once; nor is
    # an elastic job's growing back, which stopped it at a checkpoint (service/jobs/elastic.py).
    backoff_over = (last.cause in ("node_lost", "grow") or lost_to_peers or made_progress(session, last)
                    or now >= last.ended_at.timestamp() + settings.restart_backoff_seconds)
    return backoff_over and (stopped or lost_to_peers)


def made_progress(session: Session, attempt: Attempt) -> bool:
    """An attempt that committed a checkpoint is no crash loop: the next one needs no backoff."""
    query = select(Checkpoint.id).where(Checkpoint.job_id == attempt.job_id, Checkpoint.attempt == attempt.number,
                                        Checkpoint.committed_at.is_not(None))
    return session.scalar(query.limit(1)) is not None
