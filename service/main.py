"""The FastAPI application: settings, database, routers, error shapes, request limits."""

import asyncio
import contextlib
import gc
import logging
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio.to_thread
from fastapi import FastAPI, Request, status
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.api import include_api
from service.api.hot_paths import AgentHotPaths, match_hot
from service.api.health import router as health_router
from service import scheduler
from service.commands import CommandBell, ring_on_commit
from service.db import DB_THREADS, make_engine, make_session_factory
from service.event_batches import EventBatchWriter
from service.heartbeats import HeartbeatWriter
from service.metrics import install_metrics
from service.migrate import check_at_head
from service.pages import install_pages
from service.ratelimit import RateLimit
from service.security import CallerCache
from service.settings import Settings, get_settings

log = logging.getLogger("ett.service")


class BodySizeLimit:
    """Answers 413 to bodies over the limit, declared or streamed, before anything parses them."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._too_large(scope, receive, send)
        seen, rejected = 0, False

        async def counting_receive() -> Message:
            nonlocal seen, rejected
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes and not rejected:
                # Answer now and tell the app the client left, so it stops reading and its reply is dropped.
                rejected = True
                await self._too_large(scope, receive, send)
            return {"type": "http.disconnect"} if rejected else message

        async def guarded_send(message: Message) -> None:
            if not rejected:
                await send(message)

        await self.app(scope, counting_receive, guarded_send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        detail = f"request body over the limit of {self.max_bytes} bytes"
        await JSONResponse({"detail": detail}, status.HTTP_413_CONTENT_TOO_LARGE)(scope, receive, send)


class QuietAgentCalls(logging.Filter):
    """Leaves out of uvicorn's access log the agents' answered heartbeats and event batches:
    2,048 agents make 500 such lines a second, which drown the rest and cost the event loop
    6% of its time under load. Their errors (status 400 and over) are still logged; the counts
    and latencies of all of them are in /metrics."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        # uvicorn's access record: (client, method, path with query, HTTP version, status)
        if isinstance(args, tuple) and len(args) == 5 and isinstance(args[4], int) and args[4] < 400:
            return match_hot(str(args[2]).partition("?")[0]) is None
        return True


def field_path(loc: tuple | list) -> str:
    # ("body", "events", 3, "ts") -> "events.3.ts": the path a person finds in the JSON they sent.
    parts = [str(p) for p in loc]
    return ".".join(parts[1:] if parts and parts[0] in ("body", "query", "path") else parts) or "body"


class FieldProblem(BaseModel):
    field: str
    msg: str
    type: str


class ValidationProblem(BaseModel):
    """The 422 answer, declared in the OpenAPI schema in place of FastAPI's default shape."""

    detail: list[FieldProblem]


async def validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = [{"field": field_path(e["loc"]), "msg": e["msg"], "type": e["type"]} for e in exc.errors()]
    # The input is not echoed back: it may hold secrets (env values of a job spec).
    return JSONResponse({"detail": errors}, status.HTTP_422_UNPROCESSABLE_CONTENT)


async def run_scheduler(app: FastAPI, wake: asyncio.Event, stop: asyncio.Event) -> None:
    """Ticks the scheduler when woken (a submit, an attempt report) or every period at the latest."""
    settings: Settings = app.state.settings

    up_since = time.time()

    def tick_once() -> None:
        with app.state.sessions() as session:
            scheduler.tick(session, settings, up_since=up_since)
            session.commit()

    while not stop.is_set():
        try:
            await run_in_threadpool(tick_once)
        except Exception:
            log.exception("scheduler tick failed; retrying next period")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(wake.wait(), settings.scheduler_period_seconds)
        wake.clear()


class YoungCollector:
    """Runs Python's cyclic garbage collector on a clock instead of on allocation counts.

    Under load, counted collections (every 50,000 net allocations) paused the whole process for
    up to 210 ms: a batch of events allocates tens of thousands of objects that live until it is
    answered, and each collection triggered by the count walked all those in flight, and freed the
    garbage of the many requests before it, in one go. On the clock, the youngest generation is
    collected every `period` seconds (7 ms on average in the load bench, 48 ms at most), however
    fast the load allocates. The older generations, which hold every open connection's state (two
    per agent), are walked rarely: only cyclic garbage that outlived its request waits there
    (BENCHMARKS.md, "Load"). The counted collector stays on with a high threshold, as a backstop
    for a loop too busy to keep the clock.
    """

    def __init__(self, period: float = 0.25, middle_every: int = 20, full_every: int = 240) -> None:
        self.period, self.middle_every, self.full_every = period, middle_every, full_every

    async def run(self) -> None:
        gc.freeze()  # the startup heap (imports, the app) never becomes garbage: out of every pass
        gc.set_threshold(200_000, 10, 10)
        passes = 0
        while True:
            await asyncio.sleep(self.period)
            passes += 1
            gc.collect(2 if passes % self.full_every == 0 else 1 if passes % self.middle_every == 0 else 0)


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    engine = make_engine(settings.resolved_database_url)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        check_at_head(engine)
        anyio.to_thread.current_default_thread_limiter().total_tokens = DB_THREADS
        # A thread ingesting an event batch keeps the GIL up to the switch interval whenever the
        # event loop or the heartbeat writer wants it: at 1 ms instead of 5, heartbeats kept up
        # with 2,048 agents beside the batches (BENCHMARKS.md, "Load").
        sys.setswitchinterval(0.001)
        loop = asyncio.get_running_loop()
        app.state.bell.bind(loop)
        wake = asyncio.Event()
        app.state.wake_scheduler = lambda: loop.call_soon_threadsafe(wake.set)
        stop = asyncio.Event()
        task = asyncio.create_task(run_scheduler(app, wake, stop))
        app.state.heartbeats = HeartbeatWriter(app.state.sessions, settings)
        writer = asyncio.create_task(app.state.heartbeats.run())
        app.state.event_batches = EventBatchWriter(app.state.sessions, settings)
        events_writer = asyncio.create_task(app.state.event_batches.run())
        watcher = asyncio.create_task(app.state.bell.watch(app.state.sessions))
        collector = asyncio.create_task(YoungCollector().run())
        yield
        stop.set()
        wake.set()
        await task  # lets a tick in flight finish: no transaction outlives the app
        for background in (writer, events_writer, watcher, collector):
            background.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await background
        engine.dispose()

    app = FastAPI(title="ETT", version="1", lifespan=lifespan, docs_url="/docs",
                  responses={422: {"model": ValidationProblem, "description": "a field of the request is wrong"}})
    app.state.settings = settings
    app.state.engine = engine
    app.state.sessions = make_session_factory(engine)
    app.state.bell = CommandBell()
    app.state.callers = CallerCache()
    app.state.wake_scheduler = lambda: None  # replaced once the event loop runs
    ring_on_commit(app.state.sessions, app.state.bell)
    app.add_exception_handler(RequestValidationError, validation_error)
    access_log = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, QuietAgentCalls) for f in access_log.filters):
        access_log.addFilter(QuietAgentCalls())  # before the pages' token redaction: less work
    app.add_middleware(AgentHotPaths)  # innermost: behind the size limit, rate limit and metrics
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_request_bytes)
    app.add_middleware(RateLimit, per_second=settings.rate_limit_per_second, burst=settings.rate_limit_burst)
    include_api(app)
    app.include_router(health_router)
    install_metrics(app)
    install_pages(app)
    return app
