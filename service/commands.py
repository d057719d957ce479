"""The per-agent command queue and the wake-up signal that makes heartbeats long-poll."""

import asyncio
from collections import defaultdict
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from service.models import AgentCommand, AttemptState, Job, JobState, Node, utcnow


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


def cancel_job(session: Session, job: Job) -> None:
    if job.state not in (JobState.queued, JobState.running):
        return
    job.state = JobState.cancelled
    job.finished_at = utcnow()
    job.reason = "cancelled"
    for attempt in job.attempts:
        if attempt.state in (AttemptState.allocated, AttemptState.running):
            for share in attempt.nodes:
                enqueue(session, share.node, {"type": "stop", "job_id": job.id, "attempt": attempt.number,
                                              "reason": "cancelled"})
