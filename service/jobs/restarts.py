"""When a job's next attempt may start (the scheduler's allocation asks, service/jobs/scheduler.py)."""

from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.jobs.peer_loss import PEER_LOST, suspects
from service.jobs.placement import assignable
from service.models import ACTIVE_ATTEMPT_STATES as ACTIVE
from service.models import (BROKEN_CAUSES, Attempt, AttemptNode, AttemptState, Checkpoint, Job, JobState, Node,
                            NodeState)
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
    # a survivor lost its connection to and that say nothing since: spares take their places (peer_loss.py);
    # nor for those of a broken attempt, killed at once, which its next attempt may take as they are.
    stopped = all(s.state not in ACTIVE or handed_over(s) for s in last.nodes)
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


def handed_over(share: AttemptNode) -> bool:
    """Whether a share still stopping gives its node to its job's next attempt before it says it stopped:
    a share of a broken attempt (BROKEN_CAUSES), whose ranks are killed at once with nothing of theirs to
    save (scheduler.fail_attempt), unless the survivors' lost connection is all that is known (a silent
    node among them may be dead: peer_loss.py decides). Its agent carries out the stop, queued first, and
    holds the launch until the old ranks are gone (agent/groups/supervisor.py); the new attempt's
    rendezvous waits for every node: no rank of it starts beside one of the old. A node dead meanwhile
    is found as it would have been while waiting for its stop: by its silence past the deadline.
    Never node rank 0's: its rank 0 commits the checkpoints, and its end, reported once its events are in,
    may bring the newest commit, which the next attempt must be named to resume from."""
    attempt = share.attempt
    return (share.state in ACTIVE and attempt.state == AttemptState.failed and attempt.cause in BROKEN_CAUSES
            and attempt.diagnosis != PEER_LOST and share.node_rank != 0)


def handed_over_nodes(session: Session, job: Job, fresh: datetime) -> list[Node]:
    """The nodes its last attempt's shares hand over to the job's next attempt (handed_over), by the
    rules of any other node but busy (service/jobs/placement.py, `assignable`), locked as they are."""
    handed = [share.node_id for share in (job.attempts[-1].nodes if job.attempts else []) if handed_over(share)]
    if not handed:
        return []
    return list(session.scalars(select(Node).where(Node.id.in_(handed), *assignable(fresh, NodeState.busy))
                                .order_by(Node.name).with_for_update(skip_locked=True)))
