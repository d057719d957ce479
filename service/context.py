"""What the service's parts share, typed: one ServiceContext per app, made in main.py, kept in
`app.state.context`, and reached by routes through dependency aliases (`ContextDep`, `SessionDep`)
rather than through untyped attributes of `app.state`."""

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, FastAPI, Request
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from service.agents.commands import CommandBell
from service.ingest.batches import EventBatchWriter
from service.jobs.heartbeats import HeartbeatWriter
from service.security import CallerCache
from service.settings import Settings


@dataclass
class ServiceContext:
    settings: Settings
    engine: Engine
    sessions: sessionmaker[Session]
    bell: CommandBell = field(default_factory=CommandBell)  # rung when a command for a node is queued
    callers: CallerCache = field(default_factory=CallerCache)  # the agents' tokens seen by this process
    # Set once the event loop runs (main.py's lifespan): the group writers and the scheduler's bell.
    heartbeats: HeartbeatWriter = field(init=False)
    event_batches: EventBatchWriter = field(init=False)
    wake_scheduler: Callable[[], None] = lambda: None


def context_of(app: FastAPI) -> ServiceContext:
    return app.state.context


def get_context(request: Request) -> ServiceContext:
    return context_of(request.app)


def get_session(request: Request) -> Iterator[Session]:
    with context_of(request.app).sessions() as session:
        yield session


ContextDep = Annotated[ServiceContext, Depends(get_context)]
# Closed at the end of the request; its endpoint's route closes it first (service/api/routing.py).
SessionDep = Annotated[Session, Depends(get_session)]
