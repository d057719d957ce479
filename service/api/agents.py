"""Agents: registration and heartbeats (which carry commands back, long-polled)."""

from typing import Annotated

from fastapi import APIRouter, Query

from service.agents.nodes import register_node
from service.api.deps import AgentCallerDep, AgentDep
from service.api.long_poll import answer_heartbeat
from service.api.routing import SessionRoute
from service.context import ContextDep, SessionDep
from service.models import Node
from service.schemas.agents import AgentRegister, Heartbeat, HeartbeatReply, NodeOut

router = APIRouter(prefix="/agents", tags=["agents"], route_class=SessionRoute)


def node_out(node: Node) -> NodeOut:
    return NodeOut.model_validate(node, from_attributes=True)


@router.post("/register")
def register(body: AgentRegister, session: SessionDep, caller: AgentDep, context: ContextDep) -> NodeOut:
    rule = (context.settings.node_failure_limit, context.settings.node_failure_window_seconds)
    node = register_node(session, body.name, body.address, body.slots, caller, body.health, rule)
    session.commit()
    return node_out(node)


@router.post("/{name}/heartbeat")
async def heartbeat(
    beat: Heartbeat,
    context: ContextDep,
    caller: AgentCallerDep,
    name: str,
    wait: Annotated[float, Query(ge=0, description="seconds to hold the answer until a command exists")] = 0,
) -> HeartbeatReply:
    return await answer_heartbeat(context, name, caller, beat, wait)
