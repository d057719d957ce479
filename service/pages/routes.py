"""The pages: the jobs list and a job's page (ETT breakdown, failures, timeline of its attempts).

Server-rendered with Jinja2, no script. Every figure comes from the same code as the API
(`job_report` of service/accounting/accounts.py), so a page and `GET /api/v1/jobs/{id}/ett` agree.
"""

import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.templating import Jinja2Templates

from service.accounting.accounts import (
    fleet_figures,
    fleet_mtbf_seconds,
    job_account,
    job_report,
)
from service.accounting.engine import CATEGORIES
from service.accounting.steps import step_curve
from service.api.routing import SessionRoute
from service.context import SessionDep
from service.jobs.catalog import visible_job, visible_jobs
from service.ingest.logs import failure_tails
from service.models import JobState
from service.pages.auth import COOKIE, LoginNeeded, PageCallerDep
from service.pages.job_view import MEANINGS, checkpoint_intervals, reason_of
from service.pages.step_chart import build_step_chart
from service.pages.timeline import build_timeline, frame_of
from service.pages.timeline_data import checkpoint_saves, step_time

router = APIRouter(include_in_schema=False, default_response_class=HTMLResponse, route_class=SessionRoute)
templates = Jinja2Templates(directory=Path(__file__).resolve().parents[1] / "templates")
# Pages hold a user's private data and run no script: not cached, nothing loaded from elsewhere.
HEADERS = {
    "Cache-Control": "no-store",
    "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; img-src 'self'; form-action 'self'",
    "Referrer-Policy": "same-origin",
}


def _seconds(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f} s"


def _steps(value: int | None) -> str:
    return "-" if value is None else f"{value} step{'' if value == 1 else 's'}"


def _utc(unix: float | None) -> str:
    return "-" if unix is None else datetime.fromtimestamp(unix, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


templates.env.filters.update(seconds=_seconds, steps=_steps, utc=_utc)
templates.env.globals.update(categories=CATEGORIES, meanings=MEANINGS)


def render(request: Request, name: str, context: dict[str, Any], status_code: int = 200) -> Response:
    return templates.TemplateResponse(request, name, context, status_code=status_code, headers=HEADERS)


@router.get("/")
def home() -> RedirectResponse:
    return RedirectResponse("/jobs", status_code=303)


@router.get("/jobs")
def jobs_page(
    request: Request,
    session: SessionDep,
    caller: PageCallerDep,
    state: JobState | None = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    offset: Annotated[int, Query(ge=0)] = 0,
) -> Response:
    now = time.time()
    jobs, total = visible_jobs(session, caller, state, limit, offset)
    fleet_mtbf = fleet_mtbf_seconds(session, now)
    rows = [(job, job_report(session, job, now, fleet_mtbf)) for job in jobs]
    context = {"caller": caller, "rows": rows, "total": total, "state": state, "states": list(JobState),
               "limit": limit, "offset": offset}  # fmt: skip
    return render(request, "jobs.html", context)


@router.get("/jobs/{job_id}")
def job_page(request: Request, job_id: str, session: SessionDep, caller: PageCallerDep) -> Response:
    job = visible_job(session, job_id, caller)
    if job is None:
        return render(request, "error.html", {"caller": caller, "message": f"no job {job_id}"}, 404)
    now = time.time()  # one instant for the figures and the drawing
    report = job_report(session, job, now)
    account = job_account(session, job.id)
    frame = frame_of(account, now)
    timeline = None
    if frame is not None:
        steps = step_time(session, job.id, account, frame)
        timeline = build_timeline(account, frame, steps, checkpoint_saves(session, job.id))
    failures = report["failures"]
    context = {"caller": caller, "job": job, "report": report, "timeline": timeline,
               "restored": account.restored_steps(), "failure_logs": failure_tails(session, job),
               "reason": reason_of(job.reason, failures), "failed": {f["attempt"] for f in failures},
               "intervals": checkpoint_intervals(job, account, report),
               "chart": build_step_chart(step_curve(session, job.id, account), report["attempt_sizes"])}  # fmt: skip
    return render(request, "job.html", context)


WINDOWS = {"1": "last hour", "24": "last 24 hours", "168": "last 7 days", "all": "all time"}


@router.get("/fleet")
def fleet_page(request: Request, session: SessionDep, caller: PageCallerDep, window: str = "24") -> Response:
    """The fleet's ETT over a window: the totals, where the rest of the time went, failures by
    cause, each job; the same figures as GET /api/v1/ett."""
    if window not in WINDOWS:
        message = f"window must be one of {', '.join(WINDOWS)}"
        return render(request, "error.html", {"caller": caller, "message": message}, 422)
    now = time.time()
    since = None if window == "all" else now - 3600 * int(window)
    fleet = fleet_figures(session, caller, now, since, None)
    lost = sorted(((k, v) for k, v in fleet["seconds"].items() if k != "productive" and v > 0), key=lambda kv: -kv[1])
    jobs = sorted(fleet["by_job"].items(), key=lambda item: item[1]["ett_percent"])
    context = {"caller": caller, "fleet": fleet, "lost": lost, "jobs": jobs, "window": window, "windows": WINDOWS}
    return render(request, "fleet.html", context)


@router.post("/logout")
def logout() -> RedirectResponse:
    response = RedirectResponse("/jobs", status_code=303)
    response.delete_cookie(COOKIE, path="/")
    return response


async def login_page(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, LoginNeeded)
    return render(request, "login.html", {"caller": None, "reason": exc.reason}, 401)
