"""Where an attempt's node ranks go: a restart's nodes in the order its snapshots need; and the
spares a running attempt's next one could take."""

from collections.abc import Collection, Iterable, Sequence
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
    its slots, not already left out for a straggler of the job (service/jobs/scheduler.py's allocation).

    may_take is the same rules in Python, for many attempts weighed against one read of the idle nodes
    (service/jobs/launch.py's warm_spares, the allocation); this form stays for one attempt's count
    (free_spares) and for the one spare a straggler's replacement locks (service/stragglers/spares.py)."""
    job = attempt.job
    serves = served_job(job)
    return select(Node).where(
        *assignable(fresh), Node.slots >= job.spec.procs_per_node,
        Node.job_id.is_(None) if serves is None else Node.job_id == serves,
        Node.id.not_in(select(AttemptNode.node_id).where(AttemptNode.attempt_id == attempt.id)),  # not loaded
        Node.id.not_in(sorted(straggler_avoided(job.attempts))))  # fmt: skip


def may_take(node: Node, job: Job, excluded: Collection[int]) -> bool:
    """Whether an assignable node (read with `assignable`) could take the job's next attempt, as
    free_spare_nodes says: serving the same jobs, with its slots, not one of `excluded` (the nodes the
    job left out for its stragglers, and for a running attempt its own)."""
    return node.job_id == served_job(job) and node.slots >= job.spec.procs_per_node and node.id not in excluded


def served_job(job: Job) -> str | None:
    """The job whose nodes alone may run this one: a Slurm job runs on its allocation's agents alone,
    and they on nothing else (Node.job_id); None: the nodes that serve no one job."""
    return job.id if job.spec.slurm is not None else None


def straggler_avoided(attempts: Iterable[Attempt]) -> set[int]:
    """The nodes a job left out for its stragglers (service/stragglers/): never given its next attempts."""
    return {a.failed_node_id for a in attempts if a.cause == "straggler" and a.failed_node_id is not None}


def assignable(fresh: datetime, state: NodeState = NodeState.idle) -> tuple[ColumnElement[bool], ...]:
    """What makes a node one an attempt may be given: idle (or `state`: a broken attempt's node, busy,
    to the next attempt of its job: service/jobs/restarts.py), alive (a heartbeat since `fresh`),
    healthy, neither drained nor fenced."""
    return (Node.state == state, Node.last_heartbeat_at >= fresh, Node.health.is_(None),
            Node.drained.is_(None), Node.fenced.is_(None))  # fmt: skip
