"""Server-rendered pages for people (docs/dashboards.md): /jobs and /jobs/{id}."""

from fastapi import FastAPI

from service.pages.auth import LoginNeeded, TokenAccepted, redact_access_log
from service.pages.routes import login_page, router


async def _store_token(_request, exc: Exception):
    assert isinstance(exc, TokenAccepted)
    return exc.response


def install_pages(app: FastAPI) -> None:
    """Adds the pages and their sign-in answers (a 401 page, the `?token=` redirect)."""
    redact_access_log()
    app.include_router(router)
    app.add_exception_handler(LoginNeeded, login_page)
    app.add_exception_handler(TokenAccepted, _store_token)
