"""Agents: registration and heartbeats (which carry commands back, long-polled)."""

import time
from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Query, Request, status
from fastapi.concurrency import run_in_threadpool
from sqlalchemy import select
from sqlalchemy.orm import Session

from service import commands, scheduler
from service.api.deps import AgentDep
from service.db import SessionDep
from service.models import Node, NodeState, utcnow
from service.schemas.agents import AgentRegister, Heartbeat, HeartbeatReply, NodeOut
from service.settings import Settings

router = APIRouter(prefix="/agents", tags=["agents"])


def node_out(node: Node) -> NodeOut:
    return NodeOut.model_validate(node, from_attributes=True)


def own_node(session: SessionDep, name: str, caller: AgentDep) -> Node:
    """The node named in the path, if the calling agent token is the one that registered it."""
    node = session.scalar(select(Node).where(Node.name == name))
    if node is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no agent {name}: register it first")
    if node.token_id != caller.id:
        raise HTTPException(status.HTTP_403_FORBIDDEN, f"agent {name} was registered with another token")
    return node


OwnNode = Annotated[Node, Depends(own_node)]


@router.post("/register")
def register(body: AgentRegister, session: SessionDep, caller: AgentDep) -> NodeOut:
    node = session.scalar(select(Node).where(Node.name == body.name))
    if node is None:
        node = Node(name=body.name, address=body.address, slots=body.slots, token_id=caller.id)
        session.add(node)
    elif node.token_id != caller.id:
        raise HTTPException(status.HTTP_403_FORBIDDEN, f"agent {body.name} was registered with another token")
    else:
        node.address, node.slots = body.address, body.slots
        if node.state == NodeState.lost:
            node.state = NodeState.idle
    node.last_heartbeat_at = utcnow()
    session.commit()
    return node_out(node)


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


def record_heartbeat(session: Session, settings: Settings, node: Node, beat: Heartbeat, received: float) -> None:
    node.last_heartbeat_at = utcnow()
    node.clock_offset_seconds = clock_offset(node.clock_offset_seconds, received - beat.clock, settings)
    node.clock_skew_flagged = abs(node.clock_offset_seconds) > settings.max_clock_skew_seconds
    node.stats = dict(beat.stats)
    if node.state == NodeState.lost:
        node.state = NodeState.idle
    scheduler.on_reports(session, node, beat.attempts, received)
    session.commit()


@router.post("/{name}/heartbeat")
async def heartbeat(
    beat: Heartbeat,
    request: Request,
    caller: AgentDep,
    name: str,
    wait: Annotated[float, Query(ge=0, description="seconds to hold the answer until a command exists")] = 0,
) -> HeartbeatReply:
    received = time.time()
    settings: Settings = request.app.state.settings
    bell: commands.CommandBell = request.app.state.bell
    sessions = request.app.state.sessions
    wait = min(wait, settings.max_heartbeat_wait_seconds)

    def record() -> int:
        with sessions() as session:
            node = own_node(session, name, caller)
            record_heartbeat(session, settings, node, beat, received)
            return node.id

    def take(node_id: int) -> list[dict]:
        with sessions() as session:
            # A read first: most polls find nothing, and need not queue for SQLite's write lock.
            if not commands.has_pending(session, node_id):
                return []
            taken = commands.take_pending(session, node_id)
            session.commit()
            return taken

    node_id = await run_in_threadpool(record)
    # Only an attempt that ended may need the scheduler now (a restart, a finish): a busy node
    # lists its running attempt in every heartbeat, and waking on each would run it non-stop.
    if any(report.state != "running" for report in beat.attempts):
        request.app.state.wake_scheduler()
    deadline = time.monotonic() + wait
    pending = await run_in_threadpool(take, node_id)
    while not pending and time.monotonic() < deadline:
        # The bell wakes us at once for commands queued by this process; the poll period
        # bounds the delay for commands queued by another service process.
        await bell.wait(node_id, min(1.0, deadline - time.monotonic()))
        pending = await run_in_threadpool(take, node_id)
    return HeartbeatReply(commands=pending, server_time=time.time())
