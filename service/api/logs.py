"""Rank logs: an agent ships its ranks' output; a job's owner reads it (service/ingest/logs.py)."""

from typing import Annotated

from fastapi import APIRouter, Query

from service.agents.nodes import own_node
from service.api.deps import AgentCallerDep, VisibleJobDep
from service.api.routing import SessionRoute
from service.context import SessionDep
from service.ingest.logs import Piece, read_log, store_pieces
from service.schemas.logs import AgentLogBatch, RankLogOut

router = APIRouter(tags=["logs"], route_class=SessionRoute)


@router.post("/agents/{name}/logs")
def agent_logs(body: AgentLogBatch, name: str, caller: AgentCallerDep, session: SessionDep) -> dict[str, int]:
    """New output of the agent's ranks, each piece naming its job, attempt and rank; 403 for an
    attempt the scheduler did not give this node."""
    node, _ = own_node(session, name, caller)
    store_pieces(session, node, [Piece(p.job_id, p.attempt, p.rank, p.text, p.skipped) for p in body.logs])
    session.commit()
    return {"accepted": len(body.logs)}


@router.get("/jobs/{job_id}/logs")
def job_logs(
    job: VisibleJobDep,
    session: SessionDep,
    attempt: Annotated[int | None, Query(ge=0, description="default: the newest attempt")] = None,
    rank: Annotated[int | None, Query(ge=0, description="default: the rank its failure names, else 0")] = None,
    since: Annotated[int | None, Query(ge=0, description="an `end` of an earlier answer: only what follows")] = None,
    tail: Annotated[int | None, Query(ge=1, le=100_000, description="only the last lines")] = None,
) -> RankLogOut:
    """The last part of a rank's output (the service keeps 256 Ki characters a rank and attempt;
    values of the job's `env` are blanked)."""
    view = read_log(session, job, attempt, rank, since, tail)
    return RankLogOut(job_id=job.id, attempt=view.attempt, rank=view.rank, node=view.node, text=view.text,
                      start=view.start, end=view.end, ranks=view.ranks)
