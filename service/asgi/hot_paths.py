"""The agents' two hot endpoints, heartbeat and event batch, answered straight from ASGI for an
agent whose token this process has already seen.

2,048 agents make about 460 such requests a second, and up to twice that in a checkpoint burst, on
one event loop. FastAPI's routing, dependency resolution and response validation were most of
their cost on that loop: a heartbeat took 188 to 192 us of its CPU through the declared route,
62 to 64 us here (BENCHMARKS.md, "Load"). The declared routes (service/api/agents.py, events.py) stay the
contract and the fallback: they give the OpenAPI schema, a token's first call (its lookup), and
every request this path does not take whole: a query other than the heartbeat's `wait`, a body
that does not validate (FastAPI's 422 then names the field), an unseen or non-agent token.
Both paths run the same code once the body is parsed, and refusals (401, 403, 404, 422) come out
of the same exception handler.
"""

import math
import re
from urllib.parse import parse_qsl

from fastapi.security.utils import get_authorization_scheme_param
from pydantic import BaseModel, ValidationError
from starlette.responses import Response
from starlette.routing import compile_path
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.api import PREFIX, agents, events
from service.api.long_poll import answer_heartbeat
from service.asgi.errors import refused_answer
from service.context import context_of
from service.models import Role
from service.outcomes import Refused
from service.schemas.agents import Heartbeat
from service.schemas.events import AgentEventBatch
from service.security import Caller, CallerCache, hash_token

# (route, its body's model), by the last part of the path.
HOT = {
    "heartbeat": (next(r for r in agents.router.routes if r.endpoint is agents.heartbeat), Heartbeat),
    "events": (next(r for r in events.router.routes if r.endpoint is events.agent_events), AgentEventBatch),
}
_PATH, _, _ = compile_path(PREFIX + "/agents/{name}/{kind}")


def match_hot(path: str) -> re.Match[str] | None:
    """The match (its `name` and `kind`) of an agent's heartbeat or event-batch path, else None."""
    match = _PATH.match(path)
    return match if match is not None and match["kind"] in HOT else None


class AgentHotPaths:
    """ASGI middleware, inside the size limit, rate limit and metrics middlewares."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        match = match_hot(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if match is None:
            return await self.app(scope, receive, send)
        context = context_of(scope["app"])
        caller = _seen_agent(scope, context.callers)
        wait = _wait(scope["query_string"], match["kind"])
        if caller is None or wait is None:
            return await self.app(scope, receive, send)
        body = await _read_body(receive)
        if body is None:
            return  # the client left, or the size limit refused the body (and answered 413)
        route, model = HOT[match["kind"]]
        try:
            parsed: BaseModel = model.model_validate_json(body)
        except ValidationError:
            return await self.app(scope, _replay(body, receive), send)
        scope["route"] = route  # the metrics' label, as the router would set it
        try:
            if isinstance(parsed, Heartbeat):
                reply: BaseModel = await answer_heartbeat(context, match["name"], caller, parsed, wait)
            else:
                reply = await context.event_batches.store(match["name"], caller, parsed.events)
        except Refused as refused:  # as the routes answer it (service/asgi/errors.py)
            response = refused_answer(refused)
        else:
            response = Response(reply.model_dump_json(), media_type="application/json")
        await response(scope, receive, send)


def _seen_agent(scope: Scope, callers: CallerCache) -> Caller | None:
    """The caller, if its bearer token is in this process's cache and is an agent's."""
    authorization = next((value for key, value in scope["headers"] if key == b"authorization"), b"")
    scheme, token = get_authorization_scheme_param(authorization.decode("latin-1"))
    if scheme.lower() != "bearer" or not token:
        return None
    caller = callers.get(hash_token(token))
    return caller if caller is not None and caller.role == Role.agent else None


def _wait(query: bytes, kind: str) -> float | None:
    """The heartbeat's `wait` (0 without a query); None for any other query, left to the route."""
    if not query:
        return 0.0
    pairs = parse_qsl(query.decode("latin-1"), keep_blank_values=True)
    if kind != "heartbeat" or len(pairs) != 1 or pairs[0][0] != "wait":
        return None
    try:
        wait = float(pairs[0][1])
    except ValueError:
        return None
    return wait if 0 <= wait < math.inf else None


async def _read_body(receive: Receive) -> bytes | None:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """`receive` for the declared route, which reads the body again."""
    given = False

    async def replay() -> Message:
        nonlocal given
        if given:
            return await receive()
        given = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay
