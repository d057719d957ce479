"""Agents: registration and heartbeats (which carry commands back, long-polled)."""

import time
from typing import Annotated

from fastapi import APIRouter, HTTPException, Query, Request, status
from fastapi.concurrency import run_in_threadpool
from sqlalchemy import select
from starlette.datastructures import State

from service.agents import commands
from service.agents.heartbeats import HeartbeatWriter
from service.api.deps import AgentCallerDep, AgentDep
from service.db import SessionDep
from service.models import Node, NodeState, utcnow
from service.schemas.agents import AgentRegister, Heartbeat, HeartbeatReply, NodeOut
from service.security import Caller
from service.settings import Settings

router = APIRouter(prefix="/agents", tags=["agents"])


def node_out(node: Node) -> NodeOut:
    return NodeOut.model_validate(node, from_attributes=True)


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


@router.post("/{name}/heartbeat")
async def heartbeat(
    beat: Heartbeat,
    request: Request,
    caller: AgentCallerDep,
    name: str,
    wait: Annotated[float, Query(ge=0, description="seconds to hold the answer until a command exists")] = 0,
) -> HeartbeatReply:
    return await answer_heartbeat(request.app.state, name, caller, beat, wait)


async def answer_heartbeat(state: State, name: str, caller: Caller, beat: Heartbeat, wait: float) -> HeartbeatReply:
    """A heartbeat's answer, after its checks (also taken by service/asgi/hot_paths.py)."""
    received = time.time()
    settings: Settings = state.settings
    bell: commands.CommandBell = state.bell
    wait = min(wait, settings.max_heartbeat_wait_seconds)

    def take(node_id: int) -> list[dict]:
        with state.sessions() as session:
            # A read first: most polls find nothing, and need not queue for SQLite's write lock.
            if not commands.has_pending(session, node_id):
                return []
            taken = commands.take_pending(session, node_id)
            session.commit()
            return taken

    # Written with the other heartbeats that arrive meanwhile (service/agents/heartbeats.py), commands included.
    writer: HeartbeatWriter = state.heartbeats
    node_id, pending = await writer.record(name, caller, beat, received)
    # Only an attempt that ended may need the scheduler now (a restart, a finish): a busy node
    # lists its running attempt in every heartbeat, and waking on each would run it non-stop.
    if any(report.state != "running" for report in beat.attempts):
        state.wake_scheduler()
    deadline = time.monotonic() + wait
    while not pending and time.monotonic() < deadline:
        # No thread, no connection and no query while waiting: the bell rings when a command
        # for the node is queued, by this service process or (found within a second) another.
        if await bell.wait(node_id, deadline - time.monotonic()):
            pending = await run_in_threadpool(take, node_id)
    return HeartbeatReply(commands=pending, server_time=time.time())
