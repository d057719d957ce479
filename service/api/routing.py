"""The route class of every router: a sync endpoint closes the request's database session on
its own worker thread, as it returns.

On SQLite a transaction holds the database's one write lock from its first statement (BEGIN
IMMEDIATE, service/db.py). FastAPI runs a sync endpoint on a worker thread, then validates its
answer on another: a transaction left open by the endpoint held the lock while that hop waited
for a thread, and every thread could be waiting for the lock. All then stood still until
SQLite's busy timeout (30 s) failed them (a cancel that never answered, seen in CI;
tests/service/ingest/test_write_lock.py). What the endpoint did not commit is dropped, as the session's
teardown would drop it. A dependency that reads ends its own read for the same reason
(current_token, get_visible_job, page_caller): the endpoint is another hop.
"""

import functools
import inspect
from collections.abc import Callable
from typing import Any

from fastapi.routing import APIRoute
from sqlalchemy.orm import Session


def closes_its_session(endpoint: Callable[..., Any]) -> Callable[..., Any]:
    """The sync endpoint, closing the sessions it was given when it returns or raises."""
    if inspect.iscoroutinefunction(endpoint) or getattr(endpoint, "closes_its_session", False):
        return endpoint  # async endpoints run no hop (and use no request session)

    @functools.wraps(endpoint)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return endpoint(*args, **kwargs)
        finally:
            for value in kwargs.values():
                if isinstance(value, Session):
                    value.close()

    run.closes_its_session = True  # type: ignore[attr-defined]  # include_router makes the route again
    return run


class SessionRoute(APIRoute):
    def __init__(self, path: str, endpoint: Callable[..., Any], **kwargs: Any) -> None:
        super().__init__(path, closes_its_session(endpoint), **kwargs)
