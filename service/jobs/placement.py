"""Where an attempt's node ranks go: a restart's nodes in the order its snapshots need; and the
spares a running attempt's next one could take."""

from collections.abc import Sequence
from datetime import datetime

from sqlalchemy import ColumnElement, Select, func, select
from sqlalchemy.orm import Session

from service.models import Attempt, AttemptNode, Job, Node, NodeState


def rank_order(job: Job, idle: Sequence[Node], count: int) -> list[Node]:
    """`count` idle nodes in node-rank order: the last attempt's keep their ranks (their disks hold
    those ranks' state), a new one takes a lost one's, so peers' copies of snapshots, kept by rank
    (ett/snapshots/peers.py), line up whichever node was lost (rank 0's too). An elastic job's
    smaller attempt takes the last attempt's nodes before any other (their disks hold its state)."""
    previous = {s.node_id: s.node_rank for s in job.attempts[-1].nodes} if job.attempts else {}
    kept = {previous[n.id]: n for n in idle if previous.get(n.id, count) < count}
    others = iter(sorted((n for n in idle if n not in kept.values()), key=lambda n: (n.id not in previous, n.name)))
    return [kept.get(rank) or next(others) for rank in range(count)]


def free_spares(session: Session, attempt: Attempt, fresh: datetime) -> int:
    """How many nodes the scheduler could give the attempt's next one beside or in place of its own
    (free_spare_nodes)."""
    return session.scalar(select(func.count()).select_from(free_spare_nodes(attempt, fresh).subquery())) or 0


def free_spare_nodes(attempt: Attempt, fresh: datetime) -> Select[tuple[Node]]:
    """The nodes the scheduler could give the attempt's next one beside or in place of its own: idle,
    alive (a heartbeat since `fresh`), healthy, not drained or fenced, serving the same jobs, with
    its slots, not already left out for a straggler of the job (service/jobs/scheduler.py's allocation)."""
    job = attempt.job
    serves = job.id if job.spec.slurm is not None else None
    avoided = [a.failed_node_id for a in job.attempts if a.cause == "straggler" and a.failed_node_id is not None]
    return select(Node).where(
        *assignable(fresh), Node.slots >= job.spec.procs_per_node,
        Node.job_id.is_(None) if serves is None else Node.job_id == serves,
        Node.id.not_in(select(AttemptNode.node_id).where(AttemptNode.attempt_id == attempt.id)),  # not loaded
        Node.id.not_in(avoided))  # fmt: skip


def assignable(fresh: datetime) -> tuple[ColumnElement[bool], ...]:
    """What makes a node one an attempt may be given: idle, alive (a heartbeat since `fresh`),
    healthy, neither drained nor fenced."""
    return (Node.state == NodeState.idle, Node.last_heartbeat_at >= fresh, Node.health.is_(None),
            Node.drained.is_(None), Node.fenced.is_(None))  # fmt: skip
