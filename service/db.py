"""Database engine and sessions; the one place that knows how to connect."""

from collections.abc import Callable
from typing import TypeVar

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, sessionmaker

T = TypeVar("T")

# Worker threads for the endpoints' database work (the service sets its thread pool to this; the
# heartbeat writer has its own two). Fewer than the pooled connections, so a thread never queues
# for one: that ended in 500s (pool timeouts) under load, while requests held their connection
# between thread hops. Few, because the work they do (ingesting event batches) is Python that
# holds the GIL: more threads add no throughput, and with 10 of them the event loop and the
# heartbeat writer waited so long for the GIL that agents were declared lost (BENCHMARKS.md, "Load").
# SQLite's write lock is one, fewer than the threads: so no transaction of a request outlives its
# hop (service/api/routing.py).
DB_THREADS = 4


def make_engine(url: str) -> Engine:
    # A failed statement's parameters stay out of its error and of every log line: they hold
    # jobs' specs (their env) and token digests.
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30}, hide_parameters=True)

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn, _record) -> None:
            # WAL lets readers run beside the single writer; foreign keys are off by default.
            cursor = dbapi_conn.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA synchronous=NORMAL")
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.close()
            dbapi_conn.isolation_level = None  # we send BEGIN ourselves (below)

        @event.listens_for(engine, "begin")
        def _begin_immediate(conn) -> None:
            # pysqlite would begin a transaction only at its first write, so a read-modify-write
            # (an ETT account folded by two batches at once, a scheduler tick) could lose an
            # update. BEGIN IMMEDIATE takes the write lock first: SQLite's stand-in for the
            # row locks PostgreSQL takes.
            conn.exec_driver_sql("BEGIN IMMEDIATE")

        return engine
    # No pool_pre_ping: its round trip on every checkout cost as much as a heartbeat's own
    # queries. A connection found dead invalidates the pool; see retry_on_disconnect.
    return create_engine(url, pool_size=10, max_overflow=20, hide_parameters=True)


def retry_on_disconnect(transaction: Callable[[], T]) -> T:
    """Runs a whole transaction again, once, if its connection was dead (PostgreSQL restarted,
    a connection cut while idle). The first failure empties the pool, so the retry connects
    afresh. Endpoints outside the agents' hot paths answer that one request with a 500 instead."""
    try:
        return transaction()
    except DBAPIError as exc:
        if not exc.connection_invalidated:
            raise
        return transaction()


def make_session_factory(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


