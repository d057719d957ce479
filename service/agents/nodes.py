"""Nodes: an agent's claim on its node (the check every hot agent endpoint runs first), the fleet's
capacity, and what an operator sees and does (`ett nodes`: drain, return)."""

from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import Row, func, select
from sqlalchemy.orm import Session

from service.agents import node_evidence
from service.agents.commands import WAITING_FOR_NODE
from service.models import (ACTIVE_ATTEMPT_STATES, Attempt, AttemptNode, Node, NodeEvidence, NodeState, StragglerFlag,
                            Token, utcnow)
from service.outcomes import Forbidden, NotFound, Refused
from service.security import Caller, unauthorized


def register_node(session: Session, name: str, address: str, slots: int, token: Token,
                  health: str | None = None, drain_rule: tuple[int, float] | None = None) -> Node:
    """The node, made or updated; a node registered with another token stays that token's (403).
    A lost or leaving node that registers again is back. A token made for one job's Slurm
    allocation binds its nodes to that job. A failing health check is node evidence, which drains
    the node by `drain_rule` (node_failure_limit, its window; service/agents/node_evidence.py).
    The caller commits."""
    node = session.scalar(select(Node).where(Node.name == name))
    if node is None:
        node = Node(name=name, address=address, slots=slots, token_id=token.id, job_id=token.job_id)
        session.add(node)
        session.flush()  # its id, for its evidence
    elif node.token_id != token.id:
        raise Forbidden(f"agent {name} was registered with another token")
    else:
        node.address, node.slots = address, slots
        if node.state in (NodeState.lost, NodeState.leaving):
            node.state = NodeState.idle
    now = utcnow()
    if node_evidence.record_health(session, node, node.health, health, now) and drain_rule is not None:
        node_evidence.drain_on_evidence(session, node, *drain_rule, now)
    node.last_heartbeat_at, node.health = now, health
    return node


def fleet_capacity(session: Session, slots: int, fresh: datetime) -> tuple[int, int]:
    """The shared nodes (not one Slurm job's) that heartbeated since `fresh` (not lost, not
    leaving), and how many of them have `slots` or more."""
    gone = (NodeState.lost, NodeState.leaving)
    live = select(Node.slots).where(Node.state.not_in(gone), Node.last_heartbeat_at >= fresh,
                                    Node.job_id.is_(None)).subquery()  # a Slurm job's nodes serve it alone
    total, fitting = session.execute(
        select(func.count(), func.count().filter(live.c.slots >= slots)).select_from(live)).one()
    return total, fitting


def waiting_reason(nodes: int, slots: int, free: int, registered: int, fitting: int) -> str:
    """Why a job of `nodes` x `slots` waits: the free and the registered nodes that could take it."""
    each = f"{slots} free slot{'s' if slots > 1 else ''} each"
    if fitting < nodes:
        return (f"waiting for {nodes} node{'s' if nodes > 1 else ''} with {each}: the fleet has {fitting} "
                f"({registered} agent{'s' if registered != 1 else ''} registered); start more agents (ett agent)")
    return f"waiting for {nodes} node{'s' if nodes > 1 else ''} with {each}: {free} free now, {fitting} in the fleet"


def claimed_node(session: Session, row: Row | None, name: str, caller: Caller) -> Row | Node | Refused:
    """The node a request of a group claims, checked against `row`, the node's row as the group's
    one query read it (with its token's `revoked`; None if the query did not find it): `row` when
    the caller's token registered the node and is not revoked. Otherwise the answer the request
    would get alone (own_node): its 401, 403 or 404, or the node itself when it exists after all
    (the group's query skipped a row another transaction held)."""
    if row is not None and not row.revoked and row.token_id == caller.token_id:
        return row
    try:
        return own_node(session, name, caller)[0]
    except Refused as refused:
        return refused


def own_node(session: Session, name: str, caller: Caller) -> tuple[Node, bool]:
    """The node named in the path, if the caller's token registered it and is not revoked, and
    whether commands wait for it: one query for the three (the hot agent endpoints run it first)."""
    row = session.execute(
        select(Token.revoked, Node, WAITING_FOR_NODE).select_from(Token)
        .outerjoin(Node, Node.name == name).where(Token.id == caller.token_id)
    ).one_or_none()  # fmt: skip
    if row is None or row.revoked:
        raise unauthorized()
    node = row.Node
    if node is None:
        raise NotFound(f"no agent {name}: register it first")
    if node.token_id != caller.token_id:
        raise Forbidden(f"agent {name} was registered with another token")
    return node, bool(row[2])


@dataclass(frozen=True)
class NodeView:
    """A node as an operator sees it (`ett nodes`)."""

    node: Node
    jobs: list[str]  # the jobs of its active attempts
    failures: int  # failures its reports told within the window, of any kind (the jobs' as much as its own)
    flags: int = 0  # times a rank on it was flagged as a straggler within the window (never drains it)
    evidence: tuple[NodeEvidence, ...] = ()  # within the window or counted in its drain, newest first
    evidence_count: int = 0  # within the window
    slow_in_jobs: int = 0  # the jobs whose ranks on it were stragglers within the window, for the node's sake

    @property
    def slow(self) -> str | None:
        """What names it slow: stragglers on it in several jobs (one job alone may be its own cause)."""
        if self.slow_in_jobs < SLOW_IN_JOBS:
            return None
        return (f"slow in {self.slow_in_jobs} jobs: their ranks on it were stragglers (a flag never drains it; "
                "check the node)")


# A node that stragglers of this many jobs ran on is named slow: one job's flags may be its own doing
# (its data, a rank that sleeps), other jobs' on the same node point at the node.
SLOW_IN_JOBS = 2


def slow_in_jobs(session: Session, since: datetime) -> dict[str, int]:
    """Each node's count of jobs with a straggler on it since `since`. A job's rank flagged on two
    nodes or more carried its slowness along (service/stragglers/policy.py): it counts for none."""
    flags = session.execute(select(StragglerFlag.node, StragglerFlag.job_id, StragglerFlag.rank)
                            .where(StragglerFlag.flagged_at >= since)).all()  # fmt: skip
    nodes_of: dict[tuple[str, int], set[str]] = {}
    for node, job_id, rank in flags:
        nodes_of.setdefault((job_id, rank), set()).add(node)
    jobs: dict[str, set[str]] = {}
    for (job_id, _), nodes in nodes_of.items():
        if len(nodes) == 1:
            jobs.setdefault(next(iter(nodes)), set()).add(job_id)
    return {node: len(ids) for node, ids in jobs.items()}


def node_views(session: Session, failure_window_seconds: float, now: datetime) -> list[NodeView]:
    nodes = session.scalars(select(Node).order_by(Node.name)).all()
    running = session.execute(
        select(AttemptNode.node_id, Attempt.job_id).join(Attempt)
        .where(AttemptNode.state.in_(ACTIVE_ATTEMPT_STATES)).order_by(Attempt.job_id)
    ).all()  # fmt: skip
    since = now - timedelta(seconds=failure_window_seconds)
    failures = dict(session.execute(
        select(Attempt.failed_node_id, func.count())
        .where(Attempt.failed_node_id.is_not(None), Attempt.ended_at >= since)
        .group_by(Attempt.failed_node_id)
    ).all())  # fmt: skip
    flags = dict(session.execute(select(StragglerFlag.node, func.count()).where(StragglerFlag.flagged_at >= since)
                                 .group_by(StragglerFlag.node)).all())  # fmt: skip
    evidence, counts = node_evidence.evidence_of(session, since), node_evidence.counts_within(session, since)
    slow = slow_in_jobs(session, since)
    return [NodeView(node, [job for node_id, job in running if node_id == node.id], failures.get(node.id, 0),
                     flags.get(node.name, 0), tuple(evidence.get(node.id, ())), counts.get(node.id, 0),
                     slow.get(node.name, 0))
            for node in nodes]  # fmt: skip


def drain_node(session: Session, name: str, reason: str | None, admin: str) -> Node:
    """Takes the node out of the scheduler's choice (its running attempt goes on) until returned."""
    node = _named(session, name)
    node.drained = f"drained by {admin}" + (f": {reason}" if reason else "")
    return node


def return_node(session: Session, name: str) -> Node:
    """Gives a drained node back to the scheduler (a failing health check still keeps it out); its
    evidence so far, which the admin has judged, counts no more."""
    node = _named(session, name)
    node.drained = None
    node_evidence.forget(session, node)
    return node


def _named(session: Session, name: str) -> Node:
    node = session.scalar(select(Node).where(Node.name == name))
    if node is None:
        raise NotFound(f"no node {name}")
    return node
