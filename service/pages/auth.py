"""Who is looking at a page: the API's bearer tokens, carried the way a browser can.

A browser cannot add an Authorization header to a link, so a page also accepts the token once
as `?token=`: it answers with a redirect to the same address without it, setting the token in
an HttpOnly cookie that later pages read. The API itself reads only the header, so the cookie
cannot be used to make it act (no CSRF); the pages only show things. Tokens never reach a log:
the access log's request lines have `token=` values masked.
"""

import logging
import re
from typing import Annotated
from urllib.parse import urlencode

from fastapi import Depends, Request
from fastapi.responses import RedirectResponse

from service.context import SessionDep
from service.models import Role, Token
from service.security import find_token

COOKIE = "ett_token"
COOKIE_MAX_AGE_SECONDS = 12 * 3600
_TOKEN_IN_QUERY = re.compile(r"(?<=token=)[^&\s\"]+")


class RedactTokens(logging.Filter):
    """Masks `token=...` in log records (uvicorn's access log prints each request's query)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(_TOKEN_IN_QUERY.sub("***", a) if isinstance(a, str) else a for a in record.args)
        record.msg = _TOKEN_IN_QUERY.sub("***", str(record.msg))
        return True


def redact_access_log() -> None:
    access = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, RedactTokens) for f in access.filters):
        access.addFilter(RedactTokens())


class LoginNeeded(Exception):
    """No valid user or admin token: the page answers with the sign-in page (401)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


class TokenAccepted(Exception):
    """A valid `?token=`: the page answers with a redirect that stores it in the cookie."""

    def __init__(self, response: RedirectResponse) -> None:
        self.response = response


def _presented(request: Request) -> tuple[str | None, str]:
    header = request.headers.get("authorization", "")
    if header.lower().startswith("bearer "):
        return header[7:].strip(), "header"
    if "token" in request.query_params:
        return request.query_params["token"], "query"
    return request.cookies.get(COOKIE), "cookie"


def page_caller(request: Request, session: SessionDep) -> Token:
    secret, carrier = _presented(request)
    if not secret:
        raise LoginNeeded("sign in with a user or admin token")
    token = find_token(session, secret)
    session.commit()  # the read ends before the page's own hop, as in current_token (service/api/deps.py)
    if token is None:
        raise LoginNeeded("that token is not valid (revoked, mistyped or from another service)")
    if token.role not in (Role.user, Role.admin):
        raise LoginNeeded(f"a {token.role.value} token cannot open pages; use a user or admin token")
    if carrier == "query":
        query = urlencode([(k, v) for k, v in request.query_params.multi_items() if k != "token"])
        response = RedirectResponse(request.url.path + (f"?{query}" if query else ""), status_code=303)
        response.set_cookie(
            COOKIE, secret, max_age=COOKIE_MAX_AGE_SECONDS, httponly=True, samesite="lax",
            secure=request.url.scheme == "https", path="/",
        )  # fmt: skip
        raise TokenAccepted(response)
    return token


PageCallerDep = Annotated[Token, Depends(page_caller)]
