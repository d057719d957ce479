"""Node evidence, and the drain it alone decides (docs/reliability.md, "Draining a node").

A node is condemned only by what tells of the node itself, which no job can make: its agent's
health check failing (the operator's command), a record the agent read in the kernel's log (an
Xid of the hardware, an uncorrected memory error, an out-of-memory kill over no limit of a job's
own: agent/node/kernel_log.py), its heartbeats gone (node loss). What a job prints, how it exits,
the signals and faults it brings on itself, its hangs and the step times its ranks report are the
job's, and never count: a job printing "Xid 79" and exiting 1 again and again drains nothing.

`node_failure_limit` pieces of evidence within `node_failure_window_seconds` drain the node until an
admin returns it; the evidence counted is kept with the drain (`drained`) and shown by `ett nodes`.
"""

from collections.abc import Sequence
from datetime import datetime, timedelta

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session

from ett.protocol import NODE_LOSS_FAULT
from ett.protocol.messages import KernelReading
from service.models import AttemptNode, Node, NodeEvidence
from service.settings import Settings

HEALTH_CHECK = "the agent's health check"
KERNEL_LOG = "the agent's reading of the kernel log"
HEARTBEATS = "the service: its heartbeats stopped"
SHOWN = 10  # pieces of evidence a node shows (`ett nodes`), newest first


def record(session: Session, node: Node, kind: str, source: str, detail: str, now: datetime,
           key: str | None = None, job_id: str | None = None, attempt: int | None = None) -> bool:
    """Adds a piece of evidence, once per key; whether it is new."""
    if key is not None and session.scalar(select(NodeEvidence.id).where(
            NodeEvidence.node_id == node.id, NodeEvidence.key == key)) is not None:  # fmt: skip
        return False
    session.add(NodeEvidence(node_id=node.id, kind=kind, source=source, detail=detail[:256], key=key,
                             job_id=job_id, attempt=attempt, seen_at=now))  # fmt: skip
    return True


def record_readings(session: Session, node: Node, readings: Sequence[KernelReading], job_id: str, attempt: int,
                    now: datetime) -> int:
    """The kernel readings of an attempt's report, each once whichever attempts told it; how many were new."""
    return sum(record(session, node, r.kind, KERNEL_LOG, r.text, now, r.key, job_id, attempt) for r in readings)


def record_health(session: Session, node: Node, before: str | None, now_failing: str | None, now: datetime) -> bool:
    """A health check that starts failing is one piece of evidence; while it keeps failing (its words
    may change from run to run) it is the same one: the node takes no new work meanwhile anyway."""
    if now_failing is None or before is not None:
        return False
    return record(session, node, "health_check", HEALTH_CHECK, now_failing, now)


def node_lost(session: Session, node: Node, shares: Sequence[AttemptNode], detail: str, settings: Settings,
              now: datetime) -> None:
    """A node whose heartbeats stopped, with its active shares: node evidence, unless one of its
    attempts asked for it (the `lose_node` drill, a fault of the job's spec, on a rank of this node).
    Lost by the deadline or to its peers (silent after their ranks lost their connection to it:
    service/jobs/peer_loss.py), alike: a job can end its own ranks, and its peers then say so, but
    not silence its node's agent, which answers its stop at once while it lives."""
    for share in shares:
        spec = share.attempt.job.spec
        if any(f.action == NODE_LOSS_FAULT and f.attempt == share.attempt.number
               and f.rank // spec.procs_per_node == share.node_rank for f in spec.faults):  # fmt: skip
            return
    record(session, node, "node_lost", HEARTBEATS, detail, now)
    drain_on_evidence(session, node, settings.node_failure_limit, settings.node_failure_window_seconds, now)


def drain_on_evidence(session: Session, node: Node, limit: int, window_seconds: float, now: datetime) -> None:
    """Drains the node when it has `limit` pieces of evidence within the window, keeping them with the
    drain. Evidence older than the window and counted in no drain is let go here: a node's rows stay few."""
    since = now - timedelta(seconds=window_seconds)
    session.flush()
    session.execute(delete(NodeEvidence).where(NodeEvidence.node_id == node.id, NodeEvidence.seen_at < since,
                                               NodeEvidence.drained.is_(False)))  # fmt: skip
    if node.drained is not None:
        return
    counted = session.scalars(select(NodeEvidence).where(NodeEvidence.node_id == node.id,
                                                         NodeEvidence.seen_at >= since)
                              .order_by(NodeEvidence.seen_at)).all()  # fmt: skip
    if len(counted) < limit:
        return
    for evidence in counted:
        evidence.drained = True
    kinds = ", ".join(sorted({f"{e.kind} ({e.source})" for e in counted}))
    pieces = f"{len(counted)} piece{'s' if len(counted) != 1 else ''}"
    node.drained = (f"{pieces} of node evidence within {window_seconds:g} s: {kinds}; "
                    "drained until an admin returns it")[:512]


def forget(session: Session, node: Node) -> None:
    """A node an admin returns starts afresh: its evidence, judged, is counted no more."""
    session.execute(delete(NodeEvidence).where(NodeEvidence.node_id == node.id))


def evidence_of(session: Session, since: datetime) -> dict[int, list[NodeEvidence]]:
    """Each node's evidence within the window or counted in its standing drain, newest first (SHOWN at most)."""
    rows = session.scalars(select(NodeEvidence).where((NodeEvidence.seen_at >= since) | NodeEvidence.drained)
                           .order_by(NodeEvidence.node_id, NodeEvidence.seen_at.desc())).all()  # fmt: skip
    found: dict[int, list[NodeEvidence]] = {}
    for row in rows:
        shown = found.setdefault(row.node_id, [])
        if len(shown) < SHOWN:
            shown.append(row)
    return found


def counts_within(session: Session, since: datetime) -> dict[int, int]:
    """How many pieces of evidence each node has within the window."""
    return dict(session.execute(select(NodeEvidence.node_id, func.count()).where(NodeEvidence.seen_at >= since)
                                .group_by(NodeEvidence.node_id)).all())  # fmt: skip
