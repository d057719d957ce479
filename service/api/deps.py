"""Typed dependencies shared by the routers: the database session, the caller's token, its node."""

from collections.abc import Callable
from typing import Annotated

from fastapi import Depends, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from service.context import SessionDep, context_of
from service.jobs.catalog import visible_job
from service.models import Job, Role, Token
from service.outcomes import Forbidden, NotFound
from service.security import Caller, find_token, hash_token, unauthorized

_bearer = HTTPBearer(auto_error=False, description="A token from `ett token create`")
BearerDep = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]


def current_token(session: SessionDep, credentials: BearerDep) -> Token:
    token = find_token(session, credentials.credentials) if credentials else None
    # End the read now: the connection goes back to the pool instead of being held for the whole
    # request. The token stays loaded (expire_on_commit=False).
    session.commit()
    if token is None:
        raise unauthorized()
    return token


def check_role(role: Role, roles: tuple[Role, ...]) -> None:
    if role not in roles:
        allowed = " or ".join(r.value for r in roles)
        raise Forbidden(f"this needs a {allowed} token")


def require(*roles: Role) -> Callable[[Token], Token]:
    # async: a check without I/O need not hop onto a worker thread.
    async def check(token: Annotated[Token, Depends(current_token)]) -> Token:
        check_role(token.role, roles)
        return token

    return check


async def current_agent(request: Request, credentials: BearerDep) -> Caller:
    """The calling agent for the hot agent endpoints (heartbeat, events): from this process's cache
    of seen tokens, so most calls skip the lookup. These endpoints must check revocation in their
    own query (service/agents/nodes.py), since the cache does not know of it."""
    if credentials is None:
        raise unauthorized()
    digest = hash_token(credentials.credentials)
    context = context_of(request.app)
    cache = context.callers
    caller = cache.get(digest)
    if caller is None:

        def lookup() -> Caller | None:
            with context.sessions() as session:
                token = find_token(session, credentials.credentials)
                return None if token is None else Caller(token.id, token.role, token.subject, token.expires_at)

        caller = await run_in_threadpool(lookup)
        if caller is None:
            raise unauthorized()
        cache.put(digest, caller)
    check_role(caller.role, (Role.agent,))
    return caller


UserDep = Annotated[Token, Depends(require(Role.user, Role.admin))]
AdminDep = Annotated[Token, Depends(require(Role.admin))]
AgentDep = Annotated[Token, Depends(require(Role.agent))]
AgentCallerDep = Annotated[Caller, Depends(current_agent)]


def get_visible_job(session: SessionDep, job_id: str, caller: UserDep) -> Job:
    """The job named in the path, if the caller may see it (its owner or an admin)."""
    job = visible_job(session, job_id, caller)
    # Like current_token, end the read before the endpoint's hop (service/api/routing.py);
    # the job is read again, in the endpoint's own transaction, at its first use.
    session.commit()
    if job is None:  # someone else's job answers 404 like a missing one: ids are not disclosed
        raise NotFound(f"no job {job_id}")
    session.expire(job)
    return job


VisibleJobDep = Annotated[Job, Depends(get_visible_job)]
