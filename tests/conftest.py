"""Shared fixtures: databases (SQLite and a real PostgreSQL), a live service, tokens."""

import itertools
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from agent.warm.servers import SINGLE_THREAD_ENV
from service.db import make_engine, make_session_factory
from service.migrate import upgrade
from service.models import Base
from service.settings import Settings
from tests.support.live import LiveService, live_service
from tests.support.postgres import postgres_server
from tests.support.processes import TEST_MARK_ENV, kill_marked

BACKENDS = ["sqlite", "postgresql"]
# Each xdist worker's services hand out master ports of their own (Settings reads these): two
# services of the suite giving one port to two jobs at once failed a torchrun rendezvous at random
# ("torchrun exit code 1" before any fault). Below Linux's ephemeral ports (32768 on).
_WORKER = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
WORKER_ENV = {"ETT_MASTER_PORT_FIRST": str(20000 + 1000 * _WORKER), "ETT_MASTER_PORT_COUNT": "1000"}
# Set, not defaulted: the workers inherit the controller's environment, where this module set
# worker 0's range first (both workers then shared it: "EADDRINUSE" on a master port, BENCHMARKS.md).
os.environ.update(WORKER_ENV)
# The suite plays many nodes on one machine: each of its processes computes on one thread, as
# torchrun gives each of several ranks on a node. The ranks of one-process "nodes" each ran as many
# intra-op threads as there are cores, and spun against each other: the elastic trainer test took
# 57 s and 94 s of CPU alone, 33 s and 60 s with one thread a process (BENCHMARKS.md, 2026-11-29).
os.environ.update(SINGLE_THREAD_ENV)
_database_numbers = itertools.count()
# Each test's budget on a quiet 2-core machine (two xdist workers): one that needs more says why in
# `@pytest.mark.over_budget(reason)`; the others over it are named at the end of the run (not failed:
# these machines are shared and noisy, and a timing must not make the suite flaky).
BUDGET_SECONDS = 40.0
_over_budget: list[str] = []


@pytest.fixture(autouse=True)
def _ends_the_processes_it_started(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Whatever a test started and left running (a test that failed or timed out before its own
    clean-up: ranks, agents, torchrun) is killed when the test ends, so no test's processes burden
    the next ones. They are found by a mark in their environment (tests/support/processes.py)."""
    mark = uuid.uuid4().hex
    monkeypatch.setenv(TEST_MARK_ENV, mark)
    yield
    kill_marked(mark)


@pytest.fixture(scope="session")
def postgres_admin_url() -> Iterator[str]:
    """One PostgreSQL server for the whole run; tests get their own databases on it."""
    with postgres_server(database="ett_admin") as url:
        yield url


@pytest.fixture
def new_database_url(request, tmp_path: Path):
    """Makes an empty database of the given backend and returns its URL."""

    def make(backend: str) -> str:
        if backend == "sqlite":
            return f"sqlite:///{tmp_path / f'ett-{next(_database_numbers)}.db'}"
        admin_url = request.getfixturevalue("postgres_admin_url")
        name = f"ett_{next(_database_numbers)}"
        engine = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT")
        with engine.connect() as conn:
            conn.execute(sa.text(f"CREATE DATABASE {name}"))
        engine.dispose()
        return admin_url.rsplit("/", 1)[0] + f"/{name}"

    return make


@pytest.fixture(scope="session")
def _migrated_urls(tmp_path_factory) -> dict[str, str]:
    return {}


@pytest.fixture(params=BACKENDS)
def database_url(request, tmp_path_factory, _migrated_urls: dict[str, str]) -> Iterator[str]:
    """A database at head, one per backend for the session, emptied after each test."""
    backend = request.param
    if backend not in _migrated_urls:
        if backend == "sqlite":
            url = f"sqlite:///{tmp_path_factory.mktemp('db') / 'ett.db'}"
        else:
            admin_url = request.getfixturevalue("postgres_admin_url")
            url = admin_url.rsplit("/", 1)[0] + "/ett_api"
            engine = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT")
            with engine.connect() as conn:
                conn.execute(sa.text("CREATE DATABASE ett_api"))
            engine.dispose()
        upgrade(url)
        _migrated_urls[backend] = url
    url = _migrated_urls[backend]
    yield url
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        for table in reversed(Base.metadata.sorted_tables):
            conn.execute(table.delete())
    engine.dispose()


@pytest.fixture
def settings(database_url: str, tmp_path: Path) -> Settings:
    return Settings(database_url=database_url, data_dir=tmp_path / "data")


@pytest.fixture
def session(settings: Settings) -> Iterator[Session]:
    """A session on the parametrized database, for tests of the domain without HTTP."""
    engine = make_engine(settings.resolved_database_url)
    with make_session_factory(engine)() as session:
        yield session
    engine.dispose()


@pytest.fixture
def service(settings: Settings) -> Iterator[LiveService]:
    """The real service on loopback, over the parametrized database."""
    with live_service(settings) as live:
        yield live


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # Runs on the controller too (xdist sends it each report, its markers among the keywords): the
    # names gather where the summary is printed.
    if report.when == "call" and report.duration > BUDGET_SECONDS and "over_budget" not in report.keywords:
        _over_budget.append(f"{report.duration:6.1f} s  {report.nodeid}")


def pytest_terminal_summary(terminalreporter) -> None:
    if _over_budget:
        terminalreporter.section(f"over the {BUDGET_SECONDS:.0f} s budget, with no over_budget(reason) marker")
        for line in sorted(_over_budget, reverse=True):
            terminalreporter.line(line)
