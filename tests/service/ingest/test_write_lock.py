"""SQLite has one write lock. A request that held it while it waited for a worker thread (between
FastAPI's hops: a dependency, the endpoint, the answer's serialization), while every worker
thread waited for the lock, stood still until SQLite's busy timeout (30 s) failed them all: seen
in CI as a cancel that never answered. No request may hold the lock across a hop."""

import asyncio
import sqlite3
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from sqlalchemy import event

from ett.protocol.messages import StopCommand
from service.agents import commands
from service.agents.commands import CommandBell
from service.db import DB_THREADS, make_engine, make_session_factory
from service.models import Node
from tests.service.factories import register_agent, submit

pytestmark = pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)

REQUESTS = 4 * DB_THREADS


def _lock_holder(settings) -> sqlite3.Connection:
    """Another process's writer, stood in for by a connection of this one: it holds the write lock."""
    holder = sqlite3.connect(settings.resolved_database_url.removeprefix("sqlite:///"), isolation_level=None,
                             check_same_thread=False)
    holder.execute("BEGIN IMMEDIATE")
    return holder


def test_requests_that_queued_for_the_lock_all_answer_once_it_is_free(service, settings):
    with service.client(service.token("user", "alice")) as user, service.client(service.token("admin")) as admin:
        job_ids = [submit(user, name=f"j{i}")["id"] for i in range(REQUESTS)]
        # Another writer holds the lock while the requests arrive: each of them queues for it.
        holder = _lock_holder(settings)
        threading.Timer(1.0, holder.rollback).start()

        def ask(i: int) -> float:
            start = time.monotonic()
            if i % 2:
                response = admin.post(f"/api/v1/jobs/{job_ids[i]}/cancel", timeout=15)
            else:
                response = user.get(f"/api/v1/jobs/{job_ids[i]}", timeout=15)
            assert response.status_code == 200, response.text
            return time.monotonic() - start

        with ThreadPoolExecutor(REQUESTS) as pool:
            waited = list(pool.map(ask, range(REQUESTS)))
        holder.close()
        assert max(waited) < 10, f"requests waited {max(waited):.1f} s for the write lock"
        states = {user.get(f"/api/v1/jobs/{j}").json()["state"] for j in job_ids[1::2]}
        assert states == {"cancelled"}


def test_the_bells_watch_outlives_a_database_locked_past_its_busy_timeout(service, settings):
    # The watch found the commands other service processes queue; one query that failed (the lock
    # held past the busy timeout) ended it for good, and with it those wake-ups.
    agent = service.client(service.token("agent"))
    register_agent(agent)
    with service.context.sessions() as session:
        node = session.query(Node).one()
        commands.enqueue(session, node, StopCommand(type="stop", job_id="j", attempt=0, reason="test"))
        session.commit()
    engine = make_engine(settings.resolved_database_url)
    event.listen(engine, "connect", lambda conn, _record: conn.execute("PRAGMA busy_timeout = 50"))
    bell, holder = CommandBell(), _lock_holder(settings)

    async def watched() -> bool:
        bell.bind(asyncio.get_running_loop())
        watch = asyncio.create_task(bell.watch(make_session_factory(engine), period=0.05))
        woken = asyncio.create_task(bell.wait(node.id, timeout=10))
        await asyncio.sleep(0.5)  # the watch's queries fail meanwhile
        holder.rollback()
        try:
            return await woken
        finally:
            watch.cancel()

    assert asyncio.run(watched())
    engine.dispose()
