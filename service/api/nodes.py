"""Nodes for operators: list them with their health, drain, node evidence and failures; drain one, return it."""

from datetime import UTC, datetime

from fastapi import APIRouter

from service.agents.nodes import NodeView, drain_node, node_views, return_node
from service.api.deps import AdminDep
from service.api.routing import SessionRoute
from service.context import ContextDep, SessionDep
from service.schemas.agents import DrainRequest, NodeDetail, NodeEvidenceOut, NodeOut

router = APIRouter(prefix="/nodes", tags=["nodes"], route_class=SessionRoute)


def detail(view: NodeView) -> NodeDetail:
    node = NodeOut.model_validate(view.node, from_attributes=True)
    evidence = [NodeEvidenceOut.model_validate(e, from_attributes=True) for e in view.evidence]
    return NodeDetail(**node.model_dump(), jobs=view.jobs, failures=view.failures, flags=view.flags,
                      slow_in_jobs=view.slow_in_jobs, slow=view.slow, evidence_count=view.evidence_count,
                      evidence=evidence)


@router.get("")
def list_nodes(session: SessionDep, _caller: AdminDep, context: ContextDep) -> list[NodeDetail]:
    window = context.settings.node_failure_window_seconds
    return [detail(view) for view in node_views(session, window, datetime.now(UTC))]


@router.post("/{name}/drain")
def drain(name: str, body: DrainRequest, session: SessionDep, caller: AdminDep) -> NodeOut:
    node = drain_node(session, name, body.reason, caller.subject)
    session.commit()
    return NodeOut.model_validate(node, from_attributes=True)


@router.post("/{name}/return")
def give_back(name: str, session: SessionDep, _caller: AdminDep) -> NodeOut:
    node = return_node(session, name)
    session.commit()
    return NodeOut.model_validate(node, from_attributes=True)
