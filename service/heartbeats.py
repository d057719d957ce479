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
import logging
from dataclasses import dataclass
from functools import partial

import anyio
import anyio.to_thread
from fastapi import HTTPException
from sqlalchemy import exists, select
from sqlalchemy.orm import Session, contains_eager, sessionmaker

from service import commands, scheduler
from service.api.deps import own_node
from service.db import retry_on_disconnect
from service.group_commit import Waiting, answer
from service.models import AgentCommand, Attempt, AttemptNode, Node, NodeState, Token, utcnow
from service.schemas.agents import Heartbeat
from service.security import Caller
from service.settings import Settings

log = logging.getLogger("ett.heartbeats")

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


def record_heartbeat(
    session: Session, settings: Settings, node: Node, beat: Heartbeat, received: float,
    shares: dict[tuple[str, int], AttemptNode],
) -> None:  # fmt: skip
    """Records a heartbeat on its node; `shares`: the node's active shares, by (job id, attempt)."""
    node.last_heartbeat_at = utcnow()
    node.clock_offset_seconds = clock_offset(node.clock_offset_seconds, received - beat.clock, settings)
    node.clock_skew_flagged = abs(node.clock_offset_seconds) > settings.max_clock_skew_seconds
    node.stats = dict(beat.stats)
    if node.state == NodeState.lost:
        node.state = NodeState.idle
    for report in beat.attempts:
        share = shares.get((report.job_id, report.attempt))
        if share is not None:  # else an ended attempt reported again, or none of this node's: nothing to do
            scheduler.apply_report(session, node, share, report, received)


@dataclass
class Beat:
    name: str
    caller: Caller
    beat: Heartbeat
    received: float
    answer: asyncio.Future[tuple[int, list[dict]]]


class HeartbeatWriter:
    """Collects heartbeats on the event loop; two tasks write them in batches on worker threads.

    The fast lane skips nodes whose row another transaction holds (the scheduler's, allocating
    or declaring nodes lost, for up to seconds): one held row would hold up every heartbeat of
    the batch. Their heartbeats go to the held lane, which waits for the rows.
    """

    def __init__(
        self, sessions: sessionmaker[Session], settings: Settings, max_batch: int = 512, pace: float = 0.025
    ) -> None:
        self.sessions, self.settings, self.max_batch = sessions, settings, max_batch
        self.fast: Waiting[Beat] = Waiting(pace)
        self.held: Waiting[Beat] = Waiting(pace)
        # Threads of their own (one a lane): heartbeats never queue behind event batches for a thread.
        self.threads = anyio.CapacityLimiter(2)

    async def record(self, name: str, caller: Caller, beat: Heartbeat, received: float) -> tuple[int, list[dict]]:
        """Records a heartbeat; returns its node's id and the commands handed out with it."""
        item = Beat(name, caller, beat, received, asyncio.get_running_loop().create_future())
        self.fast.put(item)
        return await item.answer

    async def run(self) -> None:
        """The writer's tasks (cancel to stop; heartbeats still waiting then fail)."""
        try:
            await asyncio.gather(self._drain(self.fast, skip_locked=True), self._drain(self.held, skip_locked=False))
        finally:
            self.fast.cancel_all()
            self.held.cancel_all()

    async def _drain(self, lane: Waiting[Beat], skip_locked: bool) -> None:
        while True:
            batch = await lane.take(self.max_batch)
            for item, outcome in zip(batch, await self._write(batch, skip_locked), strict=True):
                if outcome is not None:
                    answer(item, outcome)
                elif not item.answer.done():  # its node row is held: the held lane writes it
                    self.held.put(item)

    async def _write(self, batch: list[Beat], skip_locked: bool) -> list[Outcome | None]:
        try:
            write = partial(retry_on_disconnect, partial(self._write_batch, batch, skip_locked))
            return await anyio.to_thread.run_sync(write, limiter=self.threads)
        except Exception as exc:
            if len(batch) == 1:
                log.exception("heartbeat of %s not recorded", batch[0].name)
                return [exc]
        # One heartbeat broke the batch: write them one by one, so only that one fails.
        return [outcome for item in batch for outcome in await self._write([item], skip_locked)]

    def _write_batch(self, batch: list[Beat], skip_locked: bool) -> list[Outcome | None]:
        """Writes the batch in one transaction; None for a heartbeat whose node row is held
        (only when skip_locked), to be written by the held lane."""
        with self.sessions() as session:
            pending = exists().where(AgentCommand.node_id == Node.id, AgentCommand.delivered_at.is_(None))
            rows = session.execute(
                select(Node, Token.revoked, pending).join(Token, Node.token_id == Token.id)
                .where(Node.name.in_({item.name for item in batch}))
                .order_by(Node.name)  # rows locked in the scheduler's order: no deadlock with it
                .with_for_update(of=Node, skip_locked=skip_locked)
            ).all()  # fmt: skip
            nodes = {node.name: (node, revoked, has_pending) for node, revoked, has_pending in rows}
            shares = self._active_shares(session, batch, [node.id for node, _, _ in nodes.values()])
            recorded: dict[int, Node] = {}  # batch index -> node
            to_take: dict[int, int] = {}  # node id -> batch index of its first heartbeat with commands waiting
            outcomes: list[Outcome | None] = [None] * len(batch)
            for i, item in enumerate(batch):
                found = nodes.get(item.name)
                if found is None or found[1] or found[0].token_id != item.caller.token_id:
                    try:  # the answer it would get alone: 401, 403 or 404; else its node is held: later
                        own_node(session, item.name, item.caller)
                    except HTTPException as refused:
                        outcomes[i] = refused
                    continue
                node, _, has_pending = found
                record_heartbeat(session, self.settings, node, item.beat, item.received, shares.get(node.id, {}))
                recorded[i] = node
                if has_pending:
                    to_take.setdefault(node.id, i)
            taken = commands.take_pending_of(session, to_take) if to_take else {}
            for i, node in recorded.items():
                outcomes[i] = (node.id, taken.get(node.id, []) if to_take.get(node.id) == i else [])
            session.commit()
            return outcomes

    @staticmethod
    def _active_shares(
        session: Session, batch: list[Beat], node_ids: list[int]
    ) -> dict[int, dict[tuple[str, int], AttemptNode]]:
        """The active shares of these nodes (with their attempts), by node id, then (job id, attempt)."""
        if not any(item.beat.attempts for item in batch):
            return {}
        query = (
            select(AttemptNode).join(Attempt).options(contains_eager(AttemptNode.attempt))
            .where(AttemptNode.node_id.in_(node_ids), AttemptNode.state.in_(scheduler.ACTIVE))
        )  # fmt: skip
        shares: dict[int, dict[tuple[str, int], AttemptNode]] = {}
        for share in session.scalars(query):
            shares.setdefault(share.node_id, {})[(share.attempt.job_id, share.attempt.number)] = share
        return shares
