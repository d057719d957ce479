"""The spare a straggler's replacement relies on, held for it (docs/reliability.md, "Stragglers").

`replace` stops an attempt to restart it without its slow node only where a spare is free; the
stop takes seconds (its ranks save and exit), and meanwhile another job's allocation could take
the spare: the job would restart where it ran, stopped for nothing. So the decision holds one, in
its own transaction: the spare turns `reserved` for the job (Node.reserved_for), and an allocation
takes idle nodes only. The allocation that finds the job ready for its next attempt gets it back
idle (service/jobs/restarts.py, needs_attempt), and it serves restarts before queued jobs. A hold
that no restart ends (the job ended or restarted otherwise, its stop never confirmed) is ended by
the watch's passes (hand_back) HOLD_SECONDS after the attempt ended at the latest.
"""

from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.jobs.placement import free_spare_nodes
from service.models import Attempt, Job, JobState, Node, NodeState

# Past a stop's grace (ETT_STOP_GRACE_SECONDS, 30 s: its shares are then taken as stopped) and the restart's
# backoff, the job is ready for its restart: a hold still there this long after has none coming.
HOLD_SECONDS = 120.0


def reserve_spare(session: Session, attempt: Attempt, fresh: datetime) -> bool:
    """Holds a free spare for the replacement of the attempt (the first by name, as the allocation
    takes new nodes); False: none is free any more (taken since the policy counted, or locked by a
    tick that is giving it away now). A Slurm job's spares serve it alone: nothing to hold."""
    job = attempt.job
    if job.spec.slurm is not None:
        return True
    spare = session.scalar(free_spare_nodes(attempt, fresh).order_by(Node.name).limit(1)
                           .with_for_update(skip_locked=True))  # fmt: skip
    if spare is None:
        return False
    spare.state, spare.reserved_for = NodeState.reserved, job.id
    return True


def hand_back(session: Session, now: float) -> list[str]:
    """Ends the holds no restart will end: the job ended, restarted without the spare, or its
    replaced attempt ended HOLD_SECONDS ago or more. Those spares turn idle; their names."""
    handed = []
    for node in session.scalars(select(Node).where(Node.state == NodeState.reserved).order_by(Node.name)
                                .with_for_update(skip_locked=True)):  # fmt: skip
        job = session.get(Job, node.reserved_for) if node.reserved_for is not None else None
        last = job.attempts[-1] if job is not None and job.attempts else None
        if (last is None or job.state != JobState.running or last.cause != "straggler" or last.ended_at is None
                or now >= last.ended_at.timestamp() + HOLD_SECONDS):  # fmt: skip
            node.state, node.reserved_for = NodeState.idle, None
            handed.append(node.name)
    return handed
