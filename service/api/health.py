"""Liveness and readiness probes (no token: load balancers call them)."""

from fastapi import APIRouter, HTTPException, status
from sqlalchemy import text
from sqlalchemy.exc import SQLAlchemyError

from service.api.routing import SessionRoute
from service.context import SessionDep

router = APIRouter(tags=["health"], route_class=SessionRoute)


@router.get("/healthz")
def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz")
def readyz(session: SessionDep) -> dict[str, str]:
    try:
        session.execute(text("SELECT 1"))
    except SQLAlchemyError:
        raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, "the database does not answer") from None
    return {"status": "ready"}
