"""Database engine and sessions; the one place that knows how to connect."""

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.orm import Session, sessionmaker


def make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})

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
    return create_engine(url, pool_size=10, max_overflow=20, pool_pre_ping=True)


def make_session_factory(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


def get_db(request: Request) -> Iterator[Session]:
    with request.app.state.sessions() as session:
        yield session


SessionDep = Annotated[Session, Depends(get_db)]
