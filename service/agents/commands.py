"""The per-agent command queue and the wake-up signal that makes heartbeats long-poll."""

import asyncio
import logging
from collections import Counter, defaultdict
from collections.abc import Collection
from typing import Any

from fastapi.concurrency import run_in_threadpool
from sqlalchemy import event, exists, select, update
from sqlalchemy.orm import Session, sessionmaker

from ett.protocol.messages import IntervalCommand, LaunchCommand, StopCommand, WarmCommand
from service.models import AgentCommand, Node, utcnow

log = logging.getLogger("ett.service")

AgentCommandModel = LaunchCommand | StopCommand | IntervalCommand | WarmCommand


class CommandBell:
    """Wakes the heartbeats waiting in this process when a command for their node is queued: at
    once for commands queued by this process (rung after the commit), within `watch`'s period for
    those queued by another service process (one query a period for all waiting nodes, not one
    per waiting heartbeat: 2,048 long-polling agents would otherwise poll 2,048 times a second).
    A bell only shortens the wait; it never carries state.
    """

    def __init__(self) -> None:
        self._events: dict[int, asyncio.Event] = defaultdict(asyncio.Event)
        self._waiting: Counter[int] = Counter()  # node id -> heartbeats waiting for it here
        self._loop: asyncio.AbstractEventLoop | None = None

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def ring(self, node_id: int) -> None:
        # Called from worker threads (sync endpoints), so hop onto the event loop.
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._events[node_id].set)

    async def wait(self, node_id: int, timeout: float) -> bool:
        """Waits for the node's bell; whether it rang (else the timeout passed)."""
        event = self._events[node_id]
        self._waiting[node_id] += 1
        try:
            async with asyncio.timeout(timeout):
                await event.wait()
        except TimeoutError:
            return False
        finally:
            self._waiting[node_id] -= 1
            if not self._waiting[node_id]:
                del self._waiting[node_id]
            event.clear()
        return True

    async def watch(self, sessions: sessionmaker[Session], period: float = 1.0) -> None:
        """Rings for the commands other service processes queue for nodes whose heartbeats wait here."""
        while True:
            await asyncio.sleep(period)
            if not self._waiting:
                continue
            try:
                pending = await run_in_threadpool(_with_pending, sessions, list(self._waiting))
            except Exception:  # a database busy or away: the next period asks again (the watch must not die)
                log.exception("looking for commands queued elsewhere failed; retrying next period")
                continue
            for node_id in pending:
                self._events[node_id].set()


def _with_pending(sessions: sessionmaker[Session], node_ids: list[int]) -> list[int]:
    with sessions() as session:
        query = select(AgentCommand.node_id).distinct()
        query = query.where(AgentCommand.node_id.in_(node_ids), AgentCommand.delivered_at.is_(None))
        return list(session.scalars(query))


def enqueue(session: Session, node: Node, command: AgentCommandModel) -> None:
    session.add(AgentCommand(node_id=node.id, payload=command.model_dump(mode="json")))
    # Rung after the commit (ring_on_commit), when the command is visible to the waiting heartbeat.
    session.info.setdefault("nodes_to_wake", set()).add(node.id)


def ring_on_commit(sessions: sessionmaker[Session], bell: CommandBell) -> None:
    @event.listens_for(sessions, "after_commit")
    def _ring(session: Session) -> None:
        for node_id in session.info.pop("nodes_to_wake", ()):
            bell.ring(node_id)

    @event.listens_for(sessions, "after_rollback")
    def _forget(session: Session) -> None:
        session.info.pop("nodes_to_wake", None)


def take_pending(session: Session, node_id: int) -> list[dict[str, Any]]:
    """Hands out the node's undelivered commands once, oldest first."""
    return take_pending_of(session, [node_id]).get(node_id, [])


def take_pending_of(session: Session, node_ids: Collection[int]) -> dict[int, list[dict[str, Any]]]:
    """take_pending for several nodes in one statement (a batch of heartbeats): by node id."""
    rows = session.execute(
        update(AgentCommand)
        .where(AgentCommand.node_id.in_(node_ids), AgentCommand.delivered_at.is_(None))
        .values(delivered_at=utcnow())
        .returning(AgentCommand.id, AgentCommand.node_id, AgentCommand.payload)
        .execution_options(synchronize_session=False)  # no command object is loaded in these sessions
    ).all()
    taken: dict[int, list[dict[str, Any]]] = {}
    for _, node_id, payload in sorted(rows):
        taken.setdefault(node_id, []).append(payload)
    return taken


# In a query over nodes: whether commands wait for the node (the hot agent endpoints read it with the node).
WAITING_FOR_NODE = exists().where(AgentCommand.node_id == Node.id, AgentCommand.delivered_at.is_(None))


def has_pending(session: Session, node_id: int) -> bool:
    query = select(AgentCommand.id).where(AgentCommand.node_id == node_id, AgentCommand.delivered_at.is_(None))
    return session.scalar(query.limit(1)) is not None
