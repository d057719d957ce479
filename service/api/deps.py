"""Typed dependencies shared by the routers: the database session and the caller's token."""

from collections.abc import Callable
from typing import Annotated

from fastapi import Depends, HTTPException, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from service.db import SessionDep
from service.models import Job, Role, Token
from service.security import find_token

_bearer = HTTPBearer(auto_error=False, description="A token from `ett token create`")


def current_token(
    session: SessionDep, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> Token:
    token = find_token(session, credentials.credentials) if credentials else None
    # End the read now: the connection goes back to the pool instead of being held for the whole
    # request (a heartbeat long-polls, and opens sessions of its own: holding this one too could
    # exhaust the pool under load). The token stays loaded (expire_on_commit=False).
    session.commit()
    if token is None:
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED,
            "a valid bearer token is required (create one with `ett token create`)",
            headers={"WWW-Authenticate": "Bearer"},
        )
    return token


def require(*roles: Role) -> Callable[[Token], Token]:
    def check(token: Annotated[Token, Depends(current_token)]) -> Token:
        if token.role not in roles:
            allowed = " or ".join(r.value for r in roles)
            raise HTTPException(status.HTTP_403_FORBIDDEN, f"this needs a {allowed} token")
        return token

    return check


UserDep = Annotated[Token, Depends(require(Role.user, Role.admin))]
AdminDep = Annotated[Token, Depends(require(Role.admin))]
AgentDep = Annotated[Token, Depends(require(Role.agent))]


def get_visible_job(session: SessionDep, job_id: str, caller: UserDep) -> Job:
    """The job named in the path, if the caller may see it (its owner or an admin)."""
    job = session.get(Job, job_id)
    # A job of someone else answers 404 like a missing one: ids are not disclosed.
    if job is None or (caller.role != Role.admin and job.owner != caller.subject):
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no job {job_id}")
    return job


VisibleJobDep = Annotated[Job, Depends(get_visible_job)]
