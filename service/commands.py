"""The per-agent command queue and the wake-up signal that makes heartbeats long-poll."""

import asyncio
from collections import defaultdict
from typing import Any

from sqlalchemy import event, select, update
from sqlalchemy.orm import Session, sessionmaker

from service.models import AgentCommand, Node, utcnow


class CommandBell:
    """Wakes the heartbeats waiting in this process when a command for their node is queued.

    Other service processes learn of new commands by polling the table, so a bell only shortens
    the wait; it never carries state.
    """

    def __init__(self) -> None:
        self._events: dict[int, asyncio.Event] = defaultdict(asyncio.Event)
        self._loop: asyncio.AbstractEventLoop | None = None

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def ring(self, node_id: int) -> None:
        # Called from worker threads (sync endpoints), so hop onto the event loop.
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._events[node_id].set)

    async def wait(self, node_id: int, timeout: float) -> None:
        event = self._events[node_id]
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except TimeoutError:
            pass
        event.clear()


def enqueue(session: Session, node: Node, payload: dict[str, Any]) -> None:
    session.add(AgentCommand(node_id=node.id, payload=payload))
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
    rows = session.execute(
        update(AgentCommand)
        .where(AgentCommand.node_id == node_id, AgentCommand.delivered_at.is_(None))
        .values(delivered_at=utcnow())
        .returning(AgentCommand.id, AgentCommand.payload)
    ).all()
    return [payload for _, payload in sorted(rows)]


def has_pending(session: Session, node_id: int) -> bool:
    query = select(AgentCommand.id).where(AgentCommand.node_id == node_id, AgentCommand.delivered_at.is_(None))
    return session.scalar(query.limit(1)) is not None
