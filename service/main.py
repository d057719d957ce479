"""The FastAPI application, assembled: settings, database, the group writers and background
tasks, the ASGI pieces (service/asgi/), the routers and the pages."""

import asyncio
import contextlib
import logging
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio.to_thread
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError

from service.agents.commands import ring_on_commit
from service.api import include_api
from service.api.health import router as health_router
from service.asgi.access_log import QuietAgentCalls
from service.asgi.background import YoungCollector, run_notifier, run_scheduler, run_slurm_bridge
from service.asgi.errors import ValidationProblem, refused_handler, validation_error
from service.asgi.hot_paths import AgentHotPaths
from service.asgi.limits import BodySizeLimit, RateLimit
from service.asgi.metrics import install_metrics
from service.context import ServiceContext
from service.db import DB_THREADS, make_engine, make_session_factory
from service.ingest.batches import EventBatchWriter
from service.jobs import event_limit
from service.jobs.heartbeats import HeartbeatWriter
from service.migrate import check_at_head
from service.outcomes import Refused
from service.pages import install_pages
from service.settings import Settings, get_settings

# Idle connections are kept longer than clients keep theirs (httpx: 5 s), so a client never sends
# on a connection the service is closing at that moment (a connection reset for the agent or the
# user); agents heartbeating every few seconds keep theirs open.
KEEP_ALIVE_SECONDS = 20


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    engine = make_engine(settings.resolved_database_url)
    context = ServiceContext(settings, engine, make_session_factory(engine))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        check_at_head(engine)
        anyio.to_thread.current_default_thread_limiter().total_tokens = DB_THREADS
        # A thread ingesting an event batch keeps the GIL up to the switch interval whenever the
        # event loop or the heartbeat writer wants it: at 1 ms instead of 5, heartbeats kept up
        # with 2,048 agents beside the batches (BENCHMARKS.md, "Load").
        sys.setswitchinterval(0.001)
        loop = asyncio.get_running_loop()
        context.bell.bind(loop)
        wake = asyncio.Event()
        context.wake_scheduler = lambda: loop.call_soon_threadsafe(wake.set)
        stop = asyncio.Event()
        task = asyncio.create_task(run_scheduler(context, wake, stop))
        slurm = asyncio.create_task(run_slurm_bridge(context, stop)) if settings.slurm else None
        notifier = asyncio.create_task(run_notifier(context, stop))
        context.heartbeats = HeartbeatWriter(context.sessions, settings)
        writer = asyncio.create_task(context.heartbeats.run())
        context.event_batches = EventBatchWriter(context.sessions, settings,
                                                 over_bound=event_limit.stopper(context.sessions, settings))
        events_writer = asyncio.create_task(context.event_batches.run())
        watcher = asyncio.create_task(context.bell.watch(context.sessions))
        collector = asyncio.create_task(YoungCollector().run())
        yield
        stop.set()
        wake.set()
        await task  # lets a tick in flight finish: no transaction outlives the app
        if slurm is not None:
            await slurm
        await notifier
        for background in (writer, events_writer, watcher, collector):
            background.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await background
        engine.dispose()

    app = FastAPI(title="ETT", version="1", lifespan=lifespan, docs_url="/docs",
                  responses={422: {"model": ValidationProblem, "description": "a field of the request is wrong"}})
    app.state.context = context
    ring_on_commit(context.sessions, context.bell)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(Refused, refused_handler)
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
