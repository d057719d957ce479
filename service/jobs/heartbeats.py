"""Heartbeats, recorded in batches: all those that arrive while one batch is written go together
in the next (group commit), so a batch costs one worker-thread hop and one transaction of a few
statements, however many heartbeats it holds.

A heartbeat alone is written at once, so batching adds no delay to an idle service; under load
the batches grow with the time one takes, and the service's cost per heartbeat falls as its load
rises instead of queueing. Each heartbeat still gets its own answer: a 401/403/404 for one does
not touch the others, and a batch that fails is written again one heartbeat at a time, so an
error stays with the heartbeat that caused it.
"""

import asyncio
from dataclasses import dataclass
from datetime import datetime
from functools import partial
from typing import Any

import anyio
from sqlalchemy import Row, bindparam, select, update
from sqlalchemy.orm import Session, joinedload, sessionmaker

from ett.protocol.messages import AttemptReport
from service.agents import commands, node_evidence
from service.agents.nodes import claimed_node
from service.group_commit import GroupWriter
from service.jobs import peer_loss, scheduler
from service.failures.diagnosis import Diagnosis, FailurePolicy, diagnose_reports
from service.models import Attempt, AttemptNode, Node, NodeState, Token, utcnow
from service.outcomes import Refused
from service.schemas.agents import Heartbeat
from service.security import Caller
from service.settings import Settings

# What a heartbeat gets: its node's id and the commands handed out with it, or its error.
Outcome = tuple[int, list[dict]] | Exception


def clock_offset(current: float, sample: float, settings: Settings) -> float:
    """The node's clock offset from a new sample (service receipt time minus agent clock).

    A sample is the true offset plus the request's delay, which jitters by milliseconds to
    seconds under load; correcting event times by each raw sample would shift them back and
    forth between batches. So keep the smallest sample (least delayed, as NTP does) and take a
    new one only when it is smaller, or larger by more than any plausible delay (the agent's
    clock was set back).
    """
    if sample < current or sample - current > settings.clock_resync_seconds:
        return sample
    return current


def node_update(
    node: Row, offset: float, beat: Heartbeat, received: float, now: datetime, settings: Settings
) -> dict[str, Any]:
    """The new values of a node's row for its heartbeat (by primary key, for one bulk UPDATE);
    `offset`: the node's clock offset so far."""
    offset = clock_offset(offset, received - beat.clock, settings)
    return {
        "id": node.id,
        "last_heartbeat_at": now,
        "clock_offset_seconds": offset,
        "clock_skew_flagged": abs(offset) > settings.max_clock_skew_seconds,
        "stats": dict(beat.stats),
        "state": node_state_after(node.state, beat.leaving),
        "health": beat.health,
    }


def node_state_after(state: NodeState, leaving: bool) -> NodeState:
    """A heartbeat brings a lost node back, unless its agent says it is leaving; a leaving node
    stays so until it registers again."""
    if leaving:
        return NodeState.leaving
    return NodeState.idle if state == NodeState.lost else state


# The nodes of a batch with their token's revocation, whether commands wait for them and whether
# they are fenced (service/jobs/peer_loss.py), in the scheduler's order (no deadlock with it); two
# statements built once (built per batch, each left cyclic garbage for the collector).
_NODES = (
    select(Node.id, Node.name, Node.token_id, Node.state, Node.clock_offset_seconds, Node.health, Node.fenced,
           Token.revoked, commands.WAITING_FOR_NODE.label("pending"))
    .join(Token, Node.token_id == Token.id)
    .where(Node.name.in_(bindparam("names", expanding=True)))
    .order_by(Node.name)
)  # fmt: skip
_NODES_LOCKED = {skip: _NODES.with_for_update(of=Node, skip_locked=skip) for skip in (True, False)}
_SHARES = (
    select(AttemptNode.id, AttemptNode.node_id, AttemptNode.state, Attempt.job_id, Attempt.number,
           Attempt.state.label("attempt_state"))
    .join(Attempt)
    .where(AttemptNode.node_id.in_(bindparam("nodes", expanding=True)), AttemptNode.state.in_(scheduler.ACTIVE))
)  # fmt: skip


@dataclass
class Beat:
    name: str
    caller: Caller
    beat: Heartbeat
    received: float
    answer: asyncio.Future[tuple[int, list[dict]]]
    # The failures it reports, diagnosed before the first transaction that writes it: (job, attempt) -> why
    diagnoses: dict[tuple[str, int], Diagnosis] | None = None


class HeartbeatWriter:
    """Collects heartbeats on the event loop; two lanes of group commit (service/group_commit.py)
    write them in batches on worker threads.

    The fast lane skips nodes whose row another transaction holds (the scheduler's, allocating
    or declaring nodes lost, for up to seconds): one held row would hold up every heartbeat of
    the batch. Their heartbeats go to the held lane, which waits for the rows.
    """

    def __init__(
        self, sessions: sessionmaker[Session], settings: Settings, max_batch: int = 512, pace: float = 0.025
    ) -> None:
        self.sessions, self.settings = sessions, settings
        self.failure_policy = FailurePolicy.of(settings)  # service/failures/diagnosis.py
        # Threads of their own (one a lane): heartbeats never queue behind event batches for a thread.
        threads = anyio.CapacityLimiter(2)
        self.held = GroupWriter(partial(self._write_batch, skip_locked=False), threads, most=max_batch, pace=pace)
        self.fast = GroupWriter(partial(self._write_batch, skip_locked=True), threads, most=max_batch, pace=pace,
                                unplaced=self.held.put)  # fmt: skip

    async def record(self, name: str, caller: Caller, beat: Heartbeat, received: float) -> tuple[int, list[dict]]:
        """Records a heartbeat; returns its node's id and the commands handed out with it."""
        item = Beat(name, caller, beat, received, asyncio.get_running_loop().create_future())
        self.fast.put(item)
        return await item.answer

    async def run(self) -> None:
        """The writer's tasks (cancel to stop; heartbeats still waiting then fail)."""
        await asyncio.gather(self.fast.run(), self.held.run())

    def _write_batch(self, batch: list[Beat], skip_locked: bool) -> list[Outcome | None]:
        """Writes the batch in one transaction; None for a heartbeat whose node row is held
        (only when skip_locked), to be written by the held lane.

        Plain rows and one bulk UPDATE by primary key: the ORM's loading and unit of work were
        most of a batch's cost. Only a report that changes something (an attempt started or
        ended) goes through the scheduler's ORM code, after the nodes' UPDATE."""
        self._diagnose(batch)
        with self.sessions() as session:
            names = list({item.name for item in batch})
            nodes = {row.name: row for row in session.execute(_NODES_LOCKED[skip_locked], {"names": names})}
            shares = self._active_shares(session, batch, [row.id for row in nodes.values()])
            now = utcnow()
            updates: dict[int, dict[str, Any]] = {}  # node id -> its row's new values (the last heartbeat's)
            changing: list[tuple[int, Beat, AttemptReport]] = []  # (share id, heartbeat, report)
            recorded: dict[int, int] = {}  # batch index -> node id
            to_take: dict[int, int] = {}  # node id -> batch index of its first heartbeat with commands waiting
            evidence: list[tuple[int, str | None, Beat]] = []  # (node id, its health before, heartbeat)
            fenced: list[tuple[int, int, bool, Beat]] = []  # (batch index, node id, commands waiting, heartbeat)
            outcomes: list[Outcome | None] = [None] * len(batch)
            for i, item in enumerate(batch):
                node = claimed_node(session, nodes.get(item.name), item.name, item.caller)
                if isinstance(node, Refused):
                    outcomes[i] = node
                    continue
                if isinstance(node, Node):  # its row is held (skip_locked): the held lane writes it
                    continue
                # Two heartbeats of a node in one batch: the second goes on from the first's offset and health.
                before = updates[node.id] if node.id in updates else node._mapping
                updates[node.id] = node_update(node, before["clock_offset_seconds"], item.beat, item.received, now,
                                               self.settings)  # fmt: skip
                if (item.beat.health and not before["health"]) or any(r.kernel for r in item.beat.attempts):
                    evidence.append((node.id, before["health"], item))
                for report in item.beat.attempts:
                    share = shares.get((node.id, report.job_id, report.attempt))
                    # None: an ended attempt reported again, or none of this node's: nothing to do. A
                    # running one's report that carries its script's imports is read (once: the agent
                    # drops them once answered), for its spares to warm them (service/jobs/launch.py).
                    if share is not None and (report.imports or not scheduler.report_changes_nothing(
                        share.state, share.attempt_state, report.state
                    )):
                        changing.append((share.id, item, report))
                recorded[i] = node.id
                if node.fenced is not None:
                    fenced.append((i, node.id, node.pending, item))
                if node.pending:
                    to_take.setdefault(node.id, i)
            if updates:
                session.execute(update(Node), list(updates.values()))
            if evidence:
                self._record_evidence(session, evidence, now)
            if changing:
                self._apply_reports(session, changing)
            for i, node_id, pending, item in fenced:  # rare: a node declared lost by its peers, back
                if peer_loss.answer_fenced(session, session.get_one(Node, node_id), item.beat.attempts, pending):
                    session.flush()
                    to_take.setdefault(node_id, i)  # its stop goes with this very answer
            taken = commands.take_pending_of(session, to_take) if to_take else {}
            for i, node_id in recorded.items():
                outcomes[i] = (node_id, taken.get(node_id, []) if to_take.get(node_id) == i else [])
            session.commit()
            return outcomes

    def _diagnose(self, batch: list[Beat]) -> None:
        """Diagnoses the failures the heartbeats report, before the transaction that applies them:
        the failed ranks' output is read in a short transaction of its own and matched with none
        open (bounded, in linear time: service/failures/failure_text.py), so no writer waits on a job's text."""
        failed = [(item, report) for item in batch if item.diagnoses is None
                  for report in item.beat.attempts if report.state == "failed"]  # fmt: skip
        found = diagnose_reports(self.sessions, [(item.name, report) for item, report in failed],
                                 self.failure_policy.patterns)  # fmt: skip
        for item in batch:
            if item.diagnoses is None:
                item.diagnoses = {report.key: diagnosis for (of, report), diagnosis in zip(failed, found, strict=True)
                                  if of is item}  # fmt: skip

    def _record_evidence(self, session: Session, evidence: list[tuple[int, str | None, Beat]], now: datetime) -> None:
        """What tells of the nodes themselves (rare): a health check that starts failing, the kernel
        records their agents read while an attempt ran; then the drain they may call for."""
        policy = self.failure_policy
        for node_id, health_before, item in evidence:
            node = session.get_one(Node, node_id)
            node_evidence.record_health(session, node, health_before, item.beat.health, now)
            for report in item.beat.attempts:
                node_evidence.record_readings(session, node, report.kernel, report.job_id, report.attempt, now)
            node_evidence.drain_on_evidence(session, node, policy.node_failure_limit,
                                            policy.node_failure_window_seconds, now)

    @staticmethod
    def _active_shares(session: Session, batch: list[Beat], node_ids: list[int]) -> dict[tuple[int, str, int], Row]:
        """The active shares of these nodes with their attempt's state, by (node id, job id, attempt)."""
        if not any(item.beat.attempts for item in batch):
            return {}
        rows = session.execute(_SHARES, {"nodes": node_ids})
        return {(row.node_id, row.job_id, row.number): row for row in rows}

    def _apply_reports(self, session: Session, changing: list[tuple[int, Beat, AttemptReport]]) -> None:
        """The reports that start or end something, through the scheduler (rare: a few per attempt)."""
        query = (
            select(AttemptNode).options(joinedload(AttemptNode.attempt), joinedload(AttemptNode.node))
            .where(AttemptNode.id.in_({share_id for share_id, _, _ in changing}))
        )  # fmt: skip
        loaded = {share.id: share for share in session.scalars(query)}
        for share_id, item, report in changing:
            share = loaded[share_id]
            diagnosis = item.diagnoses.get(report.key) if item.diagnoses else None
            scheduler.apply_report(session, share.node, share, report, item.received, self.failure_policy, diagnosis)
