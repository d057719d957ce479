"""Where an attempt's node ranks go: a restart's nodes in the order its snapshots need."""

from collections.abc import Sequence

from service.models import Job, Node


def rank_order(job: Job, idle: Sequence[Node], count: int) -> list[Node]:
    """`count` idle nodes in node-rank order: the last attempt's keep their ranks (their disks hold
    those ranks' state), a new one takes a lost one's, so peers' copies of snapshots, kept by rank
    (ett/snapshots/peers.py), line up whichever node was lost (rank 0's too)."""
    previous = {s.node_id: s.node_rank for s in job.attempts[-1].nodes} if job.attempts else {}
    kept = {previous[n.id]: n for n in idle if previous.get(n.id, count) < count}
    others = iter(sorted((n for n in idle if n not in kept.values()), key=lambda n: n.name))
    return [kept.get(rank) or next(others) for rank in range(count)]
